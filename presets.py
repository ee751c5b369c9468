"""Real-size models with random weights (benchmarks/bench.py's presets): the dimensions of the real Qwen2.5-VL /
Qwen3-VL / Qwen3.5 checkpoints (from their hub config.json files), so a benchmark measures the real shapes without a
download; and what the trainer knows of a model before loading it (known_config, count_params: the memory check).
A preset too big for the disk is written without weights (RANDOM_INIT says so): the trainer builds the model from
the config where it runs (random_model: the same seed, so the same values), and vLLM starts on placeholder weights
(load_format="dummy") that the first weight sync replaces in full, before anything is generated."""
import json
import os

import torch

from tiny_model import (ARCHS, TEXT_ARCHS, _text_config, _token_ids, _vl_classes, _vl_config, build_tokenizer,
                        tiny_config)

RANDOM_INIT = "random_init.json"  # in a model folder without weights: {"preset", "seed"}


PRESETS = {
    "qwen2_5_vl_3b": dict(hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, vocab_size=151936,
                          tie=True),
    # The 7B checkpoint's embedding is padded to 152064 rows (unlike the 3B's 151936).
    "qwen2_5_vl_7b": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab_size=152064,
                          tie=False),
    # Qwen/Qwen3-VL-8B-Instruct: a Qwen3-8B-shaped LLM (head_dim 128, q/k norms) and a 27-block ViT
    # (patch 16) whose blocks 8, 16 and 24 feed the LLM's first three layers (deepstack).
    "qwen3_vl_8b": dict(arch="qwen3_vl", hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                        vocab_size=151936, tie=False),
    # The larger Qwen2.5-VL: Qwen2.5-32B / -72B language models, the same ViT (for bench.py table's computed rows).
    "qwen2_5_vl_32b": dict(hidden=5120, intermediate=27648, layers=64, heads=40, kv_heads=8, vocab_size=152064,
                           tie=False),
    "qwen2_5_vl_72b": dict(hidden=8192, intermediate=29568, layers=80, heads=64, kv_heads=8, vocab_size=152064,
                           tie=False),
    # Qwen/Qwen3-VL-30B-A3B-Instruct: a 48-layer LLM of width 2048 (32 query heads of 128, 4 key/value heads), every
    # layer sparse with 128 experts of width 768, 8 routed per token; the 8B's ViT with its output at 2048
    "qwen3_vl_30b_a3b": dict(arch="qwen3_vl_moe", hidden=2048, intermediate=6144, layers=48, heads=32, kv_heads=4,
                             vocab_size=151936, tie=False,
                             moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                                      norm_topk_prob=True)),
    # Qwen3.5 (hybrid): of every 4 layers 3 Gated DeltaNet (16 key heads of 128 shared by 32 value heads, a 4-tap
    # conv) and 1 gated attention (head 256, rotary on a quarter); a 27-block ViT (patch 16, no deepstack). 9B and 27B
    # dense, 35B-A3B with 256 experts of 512 (8 routed) and a shared one (transformers' Qwen3.5 config defaults are the
    # 9B's; the 27B's and 35B-A3B's attention, MLP and experts as slime's Megatron scripts give them; the 27B's GDN
    # value heads are not in them: 48, the count that makes 27B parameters, the 9B's 32 would make 25.8B)
    "qwen3_5_9b": dict(arch="qwen3_5", hidden=4096, intermediate=12288, layers=32, heads=16, kv_heads=4,
                       vocab_size=248320, tie=False),
    "qwen3_5_27b": dict(arch="qwen3_5", hidden=5120, intermediate=17408, layers=64, heads=24, kv_heads=4,
                        vocab_size=248320, tie=False, linear_value_heads=48),
    "qwen3_5_35b_a3b": dict(arch="qwen3_5_moe", hidden=2048, intermediate=0, layers=40, heads=16, kv_heads=2,
                            vocab_size=248320, tie=False,
                            moe=dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                     shared_expert_intermediate_size=512, router_aux_loss_coef=0.001)),
    # the tiny demo MoE (tiny_model.tiny_config, its own small vocabulary) as a preset: bench.py's paths on the CPU
    "tiny_qwen3_vl_moe": dict(arch="qwen3_vl_moe", tiny=True),
}
# the hub's names of the checkpoints a preset has the dimensions of: grpo.py's check before loading (memory.py)
# knows these models without their config.json
HUB_NAMES = {"Qwen/Qwen2.5-VL-3B-Instruct": "qwen2_5_vl_3b", "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl_7b",
             "Qwen/Qwen2.5-VL-32B-Instruct": "qwen2_5_vl_32b", "Qwen/Qwen2.5-VL-72B-Instruct": "qwen2_5_vl_72b",
             "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl_8b", "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_30b_a3b",
             **{f"Qwen/Qwen3.5-{n}": f"qwen3_5_{n.lower().replace('-', '_')}" for n in ("9B", "27B", "35B-A3B")}}


# per family: the M-RoPE sections and the context length of its checkpoints' config.json
MROPE = {"qwen2_5_vl": ([16, 24, 24], 128000), "qwen3_vl": ([24, 20, 20], 262144), "qwen3_5": ([11, 11, 10], 262144)}
# the 27-block ViT (patch 16) of Qwen3-VL and Qwen3.5 (Qwen3-VL's blocks 8, 16 and 24 also feed the LLM: deepstack)
QWEN3_VIT = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
                 temporal_patch_size=2, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", in_channels=3)


def preset_config(preset, ids):
    """Config of a real-size Qwen2.5-VL / Qwen3-VL / Qwen3.5 (vocab of the real model, not of the small tokenizer)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    arch = p.get("arch", "qwen2_5_vl")
    if p.get("tiny"):  # the demo's vocabulary: the tokenizer's (its special tokens last), in rows of 64
        return tiny_config(arch, ids, (max(ids.values()) + 64) // 64 * 64)
    family = arch.removesuffix("_moe")
    mrope, max_pos = MROPE[family]
    text = _text_config(ids, p["vocab_size"], p["hidden"], p["intermediate"], p["layers"], p["heads"], p["kv_heads"],
                        mrope_section=mrope, tie=p["tie"], max_pos=max_pos)
    if family == "qwen3_5":
        text.update(head_dim=256, linear_num_key_heads=16, linear_num_value_heads=p.get("linear_value_heads", 32),
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                    full_attention_interval=4, **p.get("moe", {}))
        text["rope_parameters"].update(rope_theta=10000000.0, mrope_interleaved=True, partial_rotary_factor=0.25)
        vision = dict(QWEN3_VIT, out_hidden_size=p["hidden"])
    elif family == "qwen3_vl":
        text.update(head_dim=128, **p.get("moe", {}))
        text["rope_parameters"].update(rope_theta=5000000.0, mrope_interleaved=True)
        vision = dict(QWEN3_VIT, out_hidden_size=p["hidden"], deepstack_visual_indexes=[8, 16, 24])
    else:
        text.update(sliding_window=32768, max_window_layers=p["layers"], use_sliding_window=False)
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=p["hidden"],
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2, in_channels=3)
    Cfg, Model, _ = _vl_classes(arch)
    return _vl_config(Cfg, Model, text, vision, ids, tie=p["tie"])


def init_model(Model, cfg, seed, device=None):
    """The model with the random weights of `seed`: built in bf16 on `device` (the GPU where there is one: no fp32
    copy, a 31B model in seconds), the caller's random state untouched."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with device:
                return Model(cfg).eval()
        finally:
            torch.set_default_dtype(old)


def random_init(path):
    """{"preset", "seed"} of a model folder written without weights (bench.build_random_model), else None."""
    f = os.path.join(path, RANDOM_INIT) if isinstance(path, str) else ""
    if not os.path.isfile(f):
        return None
    with open(f) as fh:
        return json.load(fh)


def random_model(path, dtype=torch.float32, attn_implementation=None, device=None):
    """The model of a folder without weights, as from_pretrained would give it had its weights been saved: built
    from its config with its seed in bf16 on `device` (default: this process's GPU, else the CPU), then each
    parameter cast to `dtype` in turn (bf16 -> fp32 is exact). Every rank builds the whole model before FSDP2 shards
    it: 2 bytes per parameter on its GPU, 4 at most for fp32 master weights (the 30B-A3B in AMP: 116 GiB)."""
    from transformers import AutoConfig  # slow to import (~2 s)
    cfg = AutoConfig.from_pretrained(path)
    model = init_model(_vl_classes(cfg.model_type)[1], cfg, random_init(path)["seed"], device)
    if dtype != torch.bfloat16:
        for p in model.parameters():
            p.data = p.data.to(dtype)
            if p.is_cuda:  # the bf16 copy's memory back to the driver now: cached, it would stand beside the fp32 ones
                torch.cuda.empty_cache()
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model


def known_config(model_path):
    """The config of the model a --model-path names, without loading or downloading anything: its config.json where
    one is readable (the folder's, or the HF cache's copy of a hub name), else its preset's for a name of HUB_NAMES;
    None for any other."""
    if not model_path:
        return None
    from transformers import AutoConfig  # slow to import (~2 s)
    try:
        return AutoConfig.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError):  # none there, or not a config transformers can read (an unknown type)
        pass
    preset = HUB_NAMES.get(model_path)
    return preset_config(preset, _token_ids(build_tokenizer())) if preset else None


def count_params(cfg, arch=None) -> int:
    """Parameter count of a config without allocating (meta device): a VLM of tiny_model's, else the model
    fsdp_actor.load_hf_model would load (a text LLM's causal LM, another VLM's image-text-to-text model)."""
    arch = arch or cfg.model_type
    with torch.device("meta"):
        if arch in ARCHS and arch not in TEXT_ARCHS:
            model = _vl_classes(arch)[1](cfg)
        else:
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # slow to import (~2 s)
            try:
                model = AutoModelForImageTextToText.from_config(cfg)
            except ValueError:  # "Unrecognized configuration class": a text LLM (as load_hf_model tells them apart)
                model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())
