"""Qwen3-VL-MoE: the tiny one's names and shapes are the real checkpoint's, the trainer's log-probs and gradients equal
a plain HF forward (float64), the experts shard with their decoder layer, the load-balancing loss is off unless asked
for and then is transformers' own, and the engine gets the names and the fused expert layout vLLM's loader takes."""
import json
import os
import re

import pytest
import torch

import data
import fsdp_actor as actor
import presets
import tiny_model
from test_actor import reference_logprobs
from test_qwen3 import hf_engine_matches_trainer, mixed_samples

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("q3moe") / "m"), arch="qwen3_vl_moe")
    return (path, *mixed_samples(path, 2, 8))


def _layer_names(sd_shapes, prefix="model.language_model.layers.0."):
    return {k[len(prefix):]: v for k, v in sd_shapes.items() if k.startswith(prefix)}


def test_tiny_moe_has_the_checkpoints_names_and_layout(moe):
    """Every name of a decoder layer is the 30B-A3B's, and the file holds the experts as the hub checkpoints do
    ([E, H, 2I], [E, I, H]); transformers loads them as [E, 2I, H], [E, H, I]."""
    from safetensors import safe_open
    from transformers import Qwen3VLMoeForConditionalGeneration
    path, proc, _ = moe
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["architectures"] == ["Qwen3VLMoeForConditionalGeneration"] and cfg["model_type"] == "qwen3_vl_moe"
    t = cfg["text_config"]
    # vLLM builds Qwen3-VL-MoE's layers with Qwen3-MoE's code, which reads norm_topk_prob (it failed to start without)
    assert t["norm_topk_prob"] is True and presets.PRESETS["qwen3_vl_30b_a3b"]["moe"]["norm_topk_prob"] is True
    assert "num_local_experts" not in t and (t["num_experts"], t["num_experts_per_tok"], t["moe_intermediate_size"]) == (4, 2, 96)
    assert type(proc).__name__ == "Qwen3VLProcessor"
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    layer = _layer_names(disk)
    assert layer["mlp.experts.gate_up_proj"] == (4, 128, 192) and layer["mlp.experts.down_proj"] == (4, 96, 128)
    assert layer["mlp.gate.weight"] == (4, 128)
    hf = actor.load_hf_model(path)
    assert hf.model.language_model.layers[0].mlp.experts.gate_up_proj.shape == (4, 192, 128)
    # the real model's names (meta device: nothing allocated)
    real = presets.preset_config("qwen3_vl_30b_a3b", tiny_model._token_ids(tiny_model.build_tokenizer()))
    with torch.device("meta"):
        big = Qwen3VLMoeForConditionalGeneration(real)
    big_sd = {k: v.shape for k, v in big.state_dict().items()}
    assert _layer_names(big_sd).keys() == _layer_names({k: v.shape for k, v in hf.state_dict().items()}).keys()
    anon = lambda names: {re.sub(r"\.\d+\.", ".N.", k) for k in names}  # noqa: E731 (layer/block/expert numbers)
    assert anon(big_sd) == anon(hf.state_dict())
    assert big_sd["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (128, 2 * 768, 2048)


def _weighted_grads(model_or_hf, samples, pad, is_actor, w_seed=1):
    """Log-probs and the gradient of sum(w x log-probs) (w fixed random weights): through the trainer (one padded
    micro-batch) or the plain HF model, one sample at a time."""
    w = torch.Generator().manual_seed(w_seed)
    if is_actor:
        batch, resp_len = actor.collate(samples, pad, CPU, model_or_hf)
        lp, _ = model_or_hf(**batch)
        lps = lp.split(resp_len.tolist())
        (lp * torch.rand(lp.shape, generator=w, dtype=lp.dtype)).sum().backward()
        grads = {n.removeprefix("hf."): p.grad.full_tensor() for n, p in model_or_hf.named_parameters()
                 if p.grad is not None}
        return [x.detach() for x in lps], grads
    hf, lps = model_or_hf, []
    for s in samples:
        ids = torch.tensor([s["prompt"]["prompt_ids"] + s["response_ids"]])
        mm = s["prompt"]["mm_inputs"]
        logits = hf(input_ids=ids, **{k: (v.to(hf.dtype) if v.is_floating_point() else v) for k, v in mm.items()},
                    **actor.mm_token_types(hf, ids, mm)).logits[0]
        logits[:, [hf.config.image_token_id, hf.config.video_token_id]] = float("-inf")
        Lp, Lr = len(s["prompt"]["prompt_ids"]), len(s["response_ids"])
        lps.append(torch.log_softmax(logits, -1)[Lp - 1:Lp - 1 + Lr].gather(
            -1, torch.tensor(s["response_ids"])[:, None]).squeeze(-1))
    lp = torch.cat(lps)
    (lp * torch.rand(lp.shape, generator=w, dtype=lp.dtype)).sum().backward()
    return [x.detach() for x in lps], {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}


def test_moe_logprobs_and_gradients_match_plain_hf_forward(moe, monkeypatch):
    """float64: the trainer's log-probs and the gradients of a weighted sum of them equal the plain HF model's
    (images, two images, text, 2 samples per prompt; routers, experts and the ViT all get their gradient), with
    the vision tower run once over the distinct images (Qwen3-VL's deepstack path, not one copy per row)."""
    path, proc, samples = moe
    pad = proc.tokenizer.pad_token_id
    model = actor.build_actor(path, CPU, torch.float64, torch.float64, gradient_checkpointing=True)
    seen, vis = [], model.hf.model.visual
    monkeypatch.setattr(vis, "forward", lambda pixel_values, grid_thw, **kw: (
        seen.append(len(grid_thw)), type(vis).forward(vis, pixel_values, grid_thw=grid_thw, **kw))[1])
    lp_t, g_t = _weighted_grads(model, samples, pad, True)
    assert seen[0] == 4  # the distinct prompts' 4 images, not the 8 its 6 image rows show
    hf = actor.load_hf_model(path, dtype=torch.float64)
    lp_h, g_h = _weighted_grads(hf, samples, pad, False)
    for a, b in zip(lp_t, lp_h, strict=True):
        assert torch.allclose(a, b, atol=1e-10), (a, b)
    assert g_t.keys() == g_h.keys()
    assert any(".mlp.gate." in n for n in g_t) and any("experts.gate_up_proj" in n for n in g_t)
    for n in g_h:
        assert torch.allclose(g_t[n], g_h[n], atol=1e-9, rtol=1e-6), n  # (sums in another order: ViT once)
    # against the repo's fp32 reference helper too (the padded multi-micro-batch path)
    ref = reference_logprobs(path, samples, pad)
    lps, _ = actor.compute_logprobs(model.eval(), samples, pad, CPU, 1.0, max_tokens=60, max_samples=4)
    for a, b in zip(lps, ref, strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5)


def test_experts_shard_with_their_decoder_layer(moe):
    """Each MoE decoder layer is its own FSDP unit holding its router and experts (all-gathered just for that
    layer), none of them left to the root."""
    from torch.distributed.fsdp import FSDPModule
    path, _, _ = moe
    model = actor.build_actor(path, CPU, torch.float32, torch.float32)
    layers = model.hf.model.language_model.layers
    for layer in layers:
        assert isinstance(layer, FSDPModule)
        group = layer._get_fsdp_state()._fsdp_param_group
        held = {id(p.sharded_param) for p in group.fsdp_params}
        moe_params = [layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight]
        assert all(id(p) in held for p in moe_params)
        assert all(type(p).__name__ == "DTensor" for p in moe_params)
    root = {id(p.sharded_param) for p in model._get_fsdp_state()._fsdp_param_group.fsdp_params}
    assert not any(id(p) in root for n, p in model.named_parameters() if ".mlp." in n)


def test_router_aux_loss_off_by_default_and_transformers_own_when_on(moe):
    """Default: no router logits kept, no aux loss. With a coefficient: the loss of a micro-batch of right-padded
    rows (pads left out) equals transformers' load_balancing_loss_func over the samples' own forwards, and the
    gradient of sum(w x log-probs) + 0.5 x it equals the plain HF model's gradient of the same objective."""
    import config
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func
    assert config.Config().router_aux_loss_coef == 0.0
    path, proc, samples = moe
    pad, mb = proc.tokenizer.pad_token_id, samples[:4]  # four rows of different lengths: pads in the batch
    off = actor.build_actor(path, CPU, torch.float64, torch.float64)
    batch, _ = actor.collate(mb, pad, CPU, off)
    lp, _ = off(**batch)
    lp.sum().backward()
    assert off.router_logits is None and off.aux_loss is None
    on = actor.build_actor(path, CPU, torch.float64, torch.float64, router_aux_loss_coef=0.01)
    batch, _ = actor.collate(mb, pad, CPU, on)
    lp, _ = on(**batch)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=lp.dtype)
    ((lp * w).sum() + 0.5 * on.aux_loss).backward()
    got = {n.removeprefix("hf."): p.grad.full_tensor() for n, p in on.named_parameters() if p.grad is not None}
    hf = actor.load_hf_model(path, dtype=torch.float64)
    per_layer, lps = None, []
    for s in mb:  # the HF model's own router logits, one sample at a time, concatenated per layer
        ids = torch.tensor([s["prompt"]["prompt_ids"] + s["response_ids"]])
        mm = s["prompt"]["mm_inputs"]
        out = hf(input_ids=ids, **mm, **actor.mm_token_types(hf, ids, mm), output_router_logits=True)
        logits = out.logits[0]
        logits[:, [hf.config.image_token_id, hf.config.video_token_id]] = float("-inf")
        Lp, Lr = len(s["prompt"]["prompt_ids"]), len(s["response_ids"])
        lps.append(torch.log_softmax(logits, -1)[Lp - 1:Lp - 1 + Lr].gather(
            -1, torch.tensor(s["response_ids"])[:, None]).squeeze(-1))
        per_layer = list(out.router_logits) if per_layer is None else [
            torch.cat([a, b]) for a, b in zip(per_layer, out.router_logits)]
    cfg = hf.config.text_config
    want = load_balancing_loss_func(tuple(per_layer), cfg.num_experts, cfg.num_experts_per_tok)
    assert torch.allclose(on.aux_loss.detach(), want.detach(), atol=1e-10), (on.aux_loss, want)
    ((torch.cat(lps) * w).sum() + 0.5 * want).backward()
    for n, p in hf.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got[n], p.grad, atol=1e-9, rtol=1e-6), n


def test_engine_gets_the_fused_expert_tensors_vllm_loads(moe):
    """The engine receives the HF names with each layer's experts as the two fused tensors transformers keeps
    ([E, 2I, H] gate|up, [E, H, I] down): vLLM 0.26's RoutedExperts.load_weights takes a 3-D tensor under
    "experts.gate_up_proj" / "experts.down_proj" whole (fused_mapping), splits gate | up along dim 1 and transposes
    only where the last dimension is not the hidden size; so no per-expert conversion (or copy) is made here.
    This mirrors that loader's split on one layer and checks it rebuilds each expert's HF forward."""
    path, _, _ = moe
    model = actor.build_actor(path, CPU, torch.float32, torch.float32)
    hf = actor.load_hf_model(path)
    got = dict(actor.iter_full_params(model))
    assert got.keys() == hf.state_dict().keys()
    gu, down = got["model.language_model.layers.1.mlp.experts.gate_up_proj"], \
        got["model.language_model.layers.1.mlp.experts.down_proj"]
    H = hf.config.text_config.hidden_size
    assert gu.dim() == 3 and gu.shape[-1] == H and down.shape[-2] == H  # no transpose taken by vLLM
    w1, w3 = gu.chunk(2, dim=1)  # vLLM: fused_weight.chunk(2, dim=1)[0 for w1 (gate), 1 for w3 (up)]
    experts = hf.model.language_model.layers[1].mlp.experts
    x = torch.randn(5, H)
    for e in range(experts.num_experts):
        mine = torch.nn.functional.silu(x @ w1[e].T) * (x @ w3[e].T) @ down[e].T
        theirs = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
        assert torch.allclose(mine, theirs, atol=1e-5), e


def test_lora_on_the_moe_trains_a_step_and_merges_to_base_plus_delta(moe):
    """LoRA (all-linear, the default) on the tiny MoE adapts the attention projections q/k/v/o of every decoder layer
    and nothing else: the experts are 3-D parameters and the router a plain parameter (no nn.Linear for peft's
    all-linear; peft's target_parameters on the experts is opt-in: tests/test_moe_lora.py), the vision tower is
    excluded. One optimizer
    step moves the adapters only; the engine's merged weights are base + scale x B @ A, everything else the base."""
    import memory
    path, proc, samples = moe
    lora = dict(r=4, alpha=8, target_modules="all-linear", exclude_modules=r".*visual.*", modules_to_save="")
    torch.manual_seed(0)
    model = actor.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=False, lora=lora)
    opt, sched = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, CPU)
    trained = [n for n, p in model.named_parameters() if any(p is q for g in opt.param_groups for q in g["params"])]
    layers = {n.split(".lora_")[0].removeprefix("hf.") for n in trained}
    n_layers = model.hf.config.text_config.num_hidden_layers
    assert layers == {f"model.language_model.layers.{i}.self_attn.{m}_proj" for i in range(n_layers)
                      for m in "qkvo"}
    batch, _ = actor.collate(samples, proc.tokenizer.pad_token_id, CPU, model)
    lp, _ = model(**batch)
    (-lp.mean()).backward()  # peft's B starts at 0: after one step the adapters are nonzero
    actor.optimizer_step(model, opt, sched, 1.0)
    merged = dict(actor.iter_full_params(model))
    base = actor.load_hf_model(path).state_dict()
    assert merged.keys() == base.keys()
    scales = memory.lora_layers(model)
    sd = {n.removeprefix("hf."): p.full_tensor() for n, p in model.named_parameters()}
    for name, w in base.items():
        layer = name.removesuffix(".weight")
        if layer in scales:
            delta = scales[layer] * sd[f"{layer}.lora_B.default.weight"] @ sd[f"{layer}.lora_A.default.weight"]
            assert float(delta.abs().max()) > 0, name
            assert torch.allclose(merged[name], w + delta, atol=1e-6), name
        else:
            assert torch.equal(merged[name], w), name  # experts, routers, norms, ViT, embeddings: the base


def test_packed_moe_logprobs_and_gradients_equal_padded_and_hf(tmp_path):
    """Padding-free packing with experts (float64): one packed row of several samples gives the padded batch's and
    the plain HF forward's log-probs, and the padded batch's gradients, routers and experts included. It runs on the
    text Qwen3-MoE, whose sparse block is Qwen3-VL-MoE's code (top-k router, fused experts): each token is routed on its
    own, so packing must not change what any token gets."""
    from test_varlen import _grads, _text_reference
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    import tiny_moe
    actor.init_distributed()
    tok = tiny_model.build_tokenizer(split_digits=True)
    ids = tiny_model._token_ids(tok)
    text = tiny_model.tiny_config("qwen3", ids, (len(tok) + 63) // 64 * 64).to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rope_parameters", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    cfg = Qwen3MoeConfig(**{k: text[k] for k in keep}, **tiny_moe.TINY)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    path = str(tmp_path / "qwen3_moe")
    Qwen3MoeForCausalLM(cfg).float().save_pretrained(path)
    tok.save_pretrained(path)
    p = data.encode_prompt({"problem": "Name a colour.", "answer": "red", "images": []}, tok)
    q = data.encode_prompt({"problem": "What is the answer? Think.", "answer": "blue", "images": []}, tok)
    samples = [dict(prompt=(p, q)[i % 2], response_ids=[5 + i] * (1 + i)) for i in range(5)]
    lp_pad, g_pad = _grads(path, samples, tok.pad_token_id, False, torch.float64)
    lp_pack, g_pack = _grads(path, samples, tok.pad_token_id, True, torch.float64)
    ref = _text_reference(path, samples)
    for a, b, c in zip(lp_pack, lp_pad, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-10), (a, b)
        assert torch.allclose(a, c.to(a.dtype), atol=2e-5), (a, c)
    assert g_pad.keys() == g_pack.keys() and any("experts.gate_up_proj" in n for n in g_pad)
    assert any(".mlp.gate." in n for n in g_pad)
    for n in g_pad:
        assert torch.allclose(g_pad[n], g_pack[n], atol=1e-9, rtol=1e-7), n


def test_grpo_adds_the_router_aux_loss_only_when_asked(tmp_path, launch):
    """grpo.py on the tiny MoE: by default no balancing term (no actor/router_aux_loss); with
    --router-aux-loss-coef c the first step's loss (same samples, same weights) is the default run's + c x the
    logged load-balancing loss, and the gradient differs."""
    from test_train import DENSE_REWARD, run
    (tmp_path / "r.py").write_text(DENSE_REWARD)
    kw = ["--demo-model", "qwen3_vl_moe", "--max-steps", "1", "--global-batch-size", "4",
          "--reward-function", f"{tmp_path / 'r.py'}:dense"]
    off = run(launch, kw, tmp_path / "off")[-1]
    on = run(launch, kw + ["--router-aux-loss-coef", "0.5"], tmp_path / "on")[-1]
    assert "actor/router_aux_loss" not in off and on["actor/router_aux_loss"] > 0
    assert on["actor/pg_loss"] == pytest.approx(off["actor/pg_loss"], abs=1e-6)
    assert on["actor/loss"] == pytest.approx(off["actor/loss"] + 0.5 * on["actor/router_aux_loss"], abs=1e-6)
    assert on["actor/grad_norm"] != pytest.approx(off["actor/grad_norm"], rel=1e-4)


def test_moe_hf_engine_generates_what_the_trainer_scores(moe):
    """The HF engine samples the MoE with a KV cache (each new token routed on its own); the log-probs it reports
    are the trainer's full-forward recomputation of the same tokens, one- and two-image prompts."""
    path, proc, samples = moe
    hf_engine_matches_trainer(path, proc, [samples[0]["prompt"], samples[1]["prompt"]])  # one image; two images
