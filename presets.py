"""Real-size models with random weights (bench.py's presets): the dimensions of the real Qwen2.5-VL / Qwen3-VL
checkpoints (from their hub config.json files), built in code with tiny_model.py's tokenizer and processor, so a
benchmark measures the real shapes without a download."""
import torch

import tiny_moe
from tiny_model import (_atomic_build, _save_generation_config, _save_processor, _text_config, _token_ids, _vl_classes,
                        _vl_config, build_tokenizer)


PRESETS = {
    "qwen2_5_vl_3b": dict(hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2,
                          vocab_size=151936, tie=True),
    # The 7B checkpoint's embedding is padded to 152064 rows (unlike the 3B's 151936).
    "qwen2_5_vl_7b": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
                          vocab_size=152064, tie=False),
    # Qwen/Qwen3-VL-8B-Instruct: a Qwen3-8B-shaped LLM (head_dim 128, q/k norms) and a 27-block ViT
    # (patch 16) whose blocks 8, 16 and 24 feed the LLM's first three layers (deepstack).
    "qwen3_vl_8b": dict(arch="qwen3_vl", hidden=4096, intermediate=12288, layers=36, heads=32,
                        kv_heads=8, vocab_size=151936, tie=False),
    # The larger Qwen2.5-VL: Qwen2.5-32B / -72B language models, the same ViT (for bench.py table's computed rows).
    "qwen2_5_vl_32b": dict(hidden=5120, intermediate=27648, layers=64, heads=40, kv_heads=8,
                           vocab_size=152064, tie=False),
    "qwen2_5_vl_72b": dict(hidden=8192, intermediate=29568, layers=80, heads=64, kv_heads=8,
                           vocab_size=152064, tie=False),
    **tiny_moe.PRESETS,  # Qwen3-VL-30B-A3B
}


def preset_config(preset, ids):
    """Config of a real-size Qwen2.5-VL / Qwen3-VL (vocab of the real model, not of the small tokenizer)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    arch = p.get("arch", "qwen2_5_vl")
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        text = _text_config(ids, p["vocab_size"], p["hidden"], p["intermediate"], p["layers"],
                            p["heads"], p["kv_heads"], mrope_section=[24, 20, 20], tie=p["tie"],
                            max_pos=262144)
        text.update(head_dim=128, **p.get("moe", {}))
        text["rope_parameters"].update(rope_theta=5000000.0, mrope_interleaved=True)
        vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                      out_hidden_size=p["hidden"], patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh",
                      in_channels=3)
    else:
        text = _text_config(ids, p["vocab_size"], p["hidden"], p["intermediate"], p["layers"],
                            p["heads"], p["kv_heads"], mrope_section=[16, 24, 24], tie=p["tie"],
                            max_pos=128000)
        text.update(sliding_window=32768, max_window_layers=p["layers"], use_sliding_window=False)
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                      out_hidden_size=p["hidden"], patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                      hidden_act="silu", tokens_per_second=2, in_channels=3)
    Cfg, Model, _ = _vl_classes(arch)
    return _vl_config(Cfg, Model, text, vision, ids, tie=p["tie"])


def build_random_model(out_dir, preset, seed=0, device=None) -> str:
    """Real-size Qwen2.5-VL / Qwen3-VL with random bf16 weights (GPU benchmarks). Too slow for CPU CI."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    arch = PRESETS.get(preset, {}).get("arch", "qwen2_5_vl")

    def build(tmp):
        tok = build_tokenizer(split_digits=arch in ("qwen3_vl", "qwen3_vl_moe"))
        ids = _token_ids(tok)
        cfg = preset_config(preset, ids)
        Model = _vl_classes(arch)[1]
        torch.manual_seed(seed)
        # Built directly in bf16 on the target device: no fp32 copy, GPU init takes seconds.
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = Model(cfg).eval()
        finally:
            torch.set_default_dtype(old)
        model.save_pretrained(tmp)
        tiny_moe.hub_layout(tmp)
        _save_generation_config(ids, tmp)
        tok.save_pretrained(tmp)
        _save_processor(arch, tok, tmp, min_pixels=3136, max_pixels=512 * 512)

    return _atomic_build(out_dir, build, {"preset": preset, "seed": seed, "version": 1})


def count_params(cfg, arch=None) -> int:
    """Parameter count of a config without allocating (meta device)."""
    Model = _vl_classes(arch or cfg.model_type)[1]
    with torch.device("meta"):
        model = Model(cfg)
    return sum(p.numel() for p in model.parameters())
