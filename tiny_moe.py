"""The mixture-of-experts pieces: the tiny Qwen3-VL-MoE's settings, the experts' layout on disk as the hub's
checkpoints hold them, the routers the trainer finds and balances, and LoRA on the experts' fused tensors
(--lora-target-experts: peft's target_parameters)."""
import json
import os
from types import SimpleNamespace

from safetensors.torch import load_file, save_file

# The tiny MoE: Qwen3-VL's tiny model with every dense MLP replaced by 4 experts of width 96 (no square expert matrix:
# a transposed copy could not load unnoticed), 2 routed per token; the balancing coefficient the checkpoints' own
# (grpo's --router-aux-loss-coef: 0). norm_topk_prob: vLLM builds the layers with Qwen3-MoE's code, which reads it.
TINY = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[],
            router_aux_loss_coef=0.001, norm_topk_prob=True)


def hub_layout(out):
    """Qwen3-VL-MoE's expert tensors on disk as the hub checkpoints hold them, gate_up_proj [E, H, 2I] and down_proj
    [E, I, H] (transformers 5 keeps [E, 2I, H] / [E, H, I] in memory): a file written here loads like the real one in
    transformers and vLLM. The config names the count num_experts, as the hub's."""
    cfg = json.load(open(os.path.join(out, "config.json")))
    text = cfg.get("text_config", cfg)
    if "num_local_experts" in text:
        text["num_experts"] = text.pop("num_local_experts")
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    for f in sorted(os.listdir(out)):
        if not f.endswith(".safetensors"):
            continue
        sd = load_file(os.path.join(out, f))
        fused = [k for k in sd if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
        if fused:
            save_file({k: v.transpose(1, 2).contiguous() if k in fused else v for k, v in sd.items()},
                      os.path.join(out, f), metadata={"format": "pt"})


def routers(hf):
    """The MoE routers of a model (transformers' top-k routers: Qwen3-MoE, Qwen3-VL-MoE, ...); [] for a dense one."""
    return [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]


def router_aux_loss(hf, logits, input_ids):
    """The model's own load-balancing loss (Switch Transformer's, as transformers computes it for output_router_logits)
    over a micro-batch's real tokens: logits per layer [B*T, experts], pads (right-padded rows) left out."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func  # (slow import)
    cfg = hf.config.get_text_config()
    real = (input_ids != cfg.pad_token_id).long() if cfg.pad_token_id is not None else None  # [B, T]
    return load_balancing_loss_func(tuple(logits), cfg.num_experts, cfg.num_experts_per_tok, real)


# LoRA on the experts (--lora-target-experts): peft's target_parameters wraps each fused 3-D tensor in a ParamWrapper
# (nested for two), its adapters per expert: lora_A [E x r, in], lora_B [out, E x r]; the forward adds the delta to
# the tensor, so the fused layout (and the engine's names) stay.
def expert_parameters(hf):
    """peft's target_parameters for a model's fused expert tensors (`experts.gate_up_proj`, `experts.down_proj`:
    the 3-D parameters of modules named experts, outside the vision tower); [] for a dense model."""
    return sorted({f"experts.{n.rsplit('.', 1)[1]}" for n, p in hf.named_parameters()
                   if p.dim() == 3 and n.rsplit(".", 2)[-2] == "experts" and ".visual." not in f".{n}"})


def expert_wrappers(model):
    """{the state-dict name of a LoRA-wrapped expert tensor (`...experts.base_layer.base_layer.down_proj`): (the
    name of its peft ParamWrapper, the wrapper)}; {} without expert adapters."""
    from peft.tuners.lora.layer import ParamWrapper  # peft: slow to import (~3 s)
    hf = getattr(model, "hf", model)
    out = {}
    for name, m in hf.named_modules():
        if isinstance(m, ParamWrapper):
            depth, inner = 1, m.base_layer  # the tensor lives on the innermost module: one .base_layer per wrapper
            while isinstance(inner, ParamWrapper):
                depth, inner = depth + 1, inner.base_layer
            out[f"{name}{'.base_layer' * depth}.{m.parameter_name}"] = (name, m)
    return out


def merged_expert(wrapper, w, a, b):
    """W + delta of one fused expert tensor, fp32, by peft's own ParamWrapper.get_delta_weight (the merge its
    merge_and_unload makes) on the full (all-gathered) tensors: under FSDP2 the wrapper's own lora_A/B are shards."""
    from peft.tuners.lora.layer import ParamWrapper  # peft: slow to import (~3 s)
    w = w.float()
    view = SimpleNamespace(lora_A={"default": SimpleNamespace(weight=a.float())}, num_experts=wrapper.num_experts,
                           lora_B={"default": SimpleNamespace(weight=b.float())}, scaling=wrapper.scaling,
                           _did_swap_in_out_features=wrapper._did_swap_in_out_features, get_param=lambda: w)
    return w + ParamWrapper.get_delta_weight(view, "default")


def per_expert(named_tensors):
    """(name, tensor) pairs with transformers' fused experts ([E, 2I, H] gate|up, [E, H, I] down) split into the hub's
    per-expert tensors (Qwen3.5-MoE's checkpoints, vLLM's Qwen3.5 loader); every other pair as it comes. Views."""
    for name, t in named_tensors:
        base, _, kind = name.rpartition(".")
        if not base.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
            yield name, t
            continue
        halves = t.chunk(2, dim=1) if kind == "gate_up_proj" else (t,)
        for e in range(t.shape[0]):
            for proj, x in zip(("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",), halves):
                yield f"{base}.{e}.{proj}.weight", x[e]
