"""Real-size models with random weights (benchmarks/bench.py's presets): real Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen3 and
Gemma 4 checkpoints' dimensions, without a download; what the trainer knows of a model before loading it (the memory
check). A preset too big for the disk has no weights written (RANDOM_INIT): the trainer builds it from the config and
seed where it runs, vLLM starts on placeholders that the first weight sync replaces."""
import json
import os

import torch

import tiny_families
from tiny_model import _text_config, _token_ids, _vl_classes, _vl_config, build_tokenizer, tiny_config

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
    # Qwen3.5: of every 4 layers 3 Gated DeltaNet (16 key heads of 128 for 32 value heads) and 1 gated attention; the
    # 9B is transformers' defaults, the 27B / 35B-A3B's as slime's Megatron scripts give them (the 27B's 48 GDN value
    # heads: the count that makes 27B parameters)
    "qwen3_5_9b": dict(arch="qwen3_5", hidden=4096, intermediate=12288, layers=32, heads=16, kv_heads=4,
                       vocab_size=248320, tie=False),
    "qwen3_5_27b": dict(arch="qwen3_5", hidden=5120, intermediate=17408, layers=64, heads=24, kv_heads=4,
                        vocab_size=248320, tie=False, linear_value_heads=48),
    "qwen3_5_35b_a3b": dict(arch="qwen3_5_moe", hidden=2048, intermediate=0, layers=40, heads=16, kv_heads=2,
                            vocab_size=248320, tie=False,
                            moe=dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                     shared_expert_intermediate_size=512, router_aux_loss_coef=0.001)),
    # google/gemma-4-E2B-it's config.json, all written out (transformers' defaults differ); its audio conformer (0.31B)
    # kept as the checkpoint has it, never run by the trainer (no gradient or optimizer state: memory's `idle`)
    "gemma4_e2b": dict(arch="gemma4", vision_soft_tokens_per_image=280, text=dict(
        vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=1536, intermediate_size=6144, head_dim=256,
        num_hidden_layers=35, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, sliding_window=512,
        num_attention_heads=8, num_key_value_heads=1, global_head_dim=512, attention_k_eq_v=False, rms_norm_eps=1e-6,
        hidden_size_per_layer_input=256, num_kv_shared_layers=20, use_double_wide_mlp=True, tie_word_embeddings=True,
        final_logit_softcapping=30.0, max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4), "full_attention": dict(
            rope_type="proportional", rope_theta=1e6, partial_rotary_factor=0.25)}),
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12, head_dim=64,
                    num_key_value_heads=12, global_head_dim=64, patch_size=16, pooling_kernel_size=3, standardize=False,
                    position_embedding_size=10240, default_output_length=280, use_clipped_linears=True),
        audio=dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, subsampling_conv_channels=[128, 32],
                   conv_kernel_size=5, attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
                   output_proj_dims=1536, residual_weight=0.5, use_clipped_linears=True)),
    # Qwen/Qwen3-4B, a text LLM (head_dim 128, q/k norms, 40960 positions): the long-answer bench (gpu_long.sh)
    "qwen3_4b": dict(arch="qwen3", hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, vocab_size=151936,
                     tie=True),
    # the tiny demo MoE (tiny_model.tiny_config, its own small vocabulary) as a preset: bench.py's paths on the CPU
    "tiny_qwen3_vl_moe": dict(arch="qwen3_vl_moe", tiny=True),
}
# hub names of the checkpoints a preset matches: the check before loading (memory.py) knows them without config.json
HUB_NAMES = {"Qwen/Qwen2.5-VL-3B-Instruct": "qwen2_5_vl_3b", "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl_7b",
             "Qwen/Qwen2.5-VL-32B-Instruct": "qwen2_5_vl_32b", "Qwen/Qwen2.5-VL-72B-Instruct": "qwen2_5_vl_72b",
             "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl_8b", "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_30b_a3b",
             **{f"Qwen/Qwen3.5-{n}": f"qwen3_5_{n.lower().replace('-', '_')}" for n in ("9B", "27B", "35B-A3B")},
             "google/gemma-4-E2B-it": "gemma4_e2b", "Qwen/Qwen3-4B": "qwen3_4b", "Qwen/Qwen3-4B-Base": "qwen3_4b"}
GEMMA4_HUB_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|image>": 255999, "<|audio>": 256000, "<|image|>": 258880,
                  "<|audio|>": 258881, "<image|>": 258882, "<audio|>": 258883, "<|video|>": 258884}


# per family: the M-RoPE sections and the context length of its checkpoints' config.json
MROPE = {"qwen2_5_vl": ([16, 24, 24], 128000), "qwen3_vl": ([24, 20, 20], 262144), "qwen3_5": ([11, 11, 10], 262144)}
# the 27-block ViT (patch 16) of Qwen3-VL and Qwen3.5 (Qwen3-VL's blocks 8, 16 and 24 also feed the LLM: deepstack)
QWEN3_VIT = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
                 temporal_patch_size=2, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", in_channels=3)


def preset_config(preset, ids):
    """Config of a real-size preset (the real model's vocabulary, not the small tokenizer's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    arch = p.get("arch", "qwen2_5_vl")
    if arch == "gemma4":  # the special tokens' ids of the bench's Gemma 4 tokenizer, else (Qwen's) the hub's (above)
        return tiny_families.gemma4_config(ids=ids if "<|image|>" in ids else GEMMA4_HUB_IDS,
                                           **{k: v for k, v in p.items() if k != "arch"})
    if p.get("tiny"):  # the demo's vocabulary: the tokenizer's (its special tokens last), in rows of 64
        return tiny_config(arch, ids, (max(ids.values()) + 64) // 64 * 64)
    if arch == "qwen3":
        from transformers import Qwen3Config  # slow to import (~2 s)
        return Qwen3Config(**_text_config(ids, p["vocab_size"], p["hidden"], p["intermediate"], p["layers"], p["heads"],
                                          p["kv_heads"], None, p["tie"], max_pos=40960), head_dim=128,
                           architectures=["Qwen3ForCausalLM"])
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


def model_class(arch):
    import transformers  # slow to import (~2 s)
    return transformers.Qwen3ForCausalLM if arch == "qwen3" else _vl_classes(arch)[1]


def random_init(path):
    """{"preset", "seed"} of a model folder written without weights (bench.build_random_model), else None."""
    f = os.path.join(path, RANDOM_INIT) if isinstance(path, str) else ""
    return json.load(open(f)) if os.path.isfile(f) else None


def random_model(path, dtype=torch.float32, attn_implementation=None, device=None):
    """The model of a folder without weights, as from_pretrained would give it had they been saved: built from its
    config with its seed in bf16 on `device` (default: this process's GPU, else the CPU), then cast to `dtype` a
    parameter at a time. Every rank builds it whole before FSDP2 shards it (the 30B-A3B in AMP: 116 GiB at most)."""
    from transformers import AutoConfig  # slow to import (~2 s)
    cfg = AutoConfig.from_pretrained(path)
    model = init_model(model_class(cfg.model_type), cfg, random_init(path)["seed"], device)
    if dtype != torch.bfloat16:
        for p in model.parameters():
            p.data = p.data.to(dtype)
            if p.is_cuda:  # the bf16 copy's memory back to the driver now: cached, it would stand beside the fp32 ones
                torch.cuda.empty_cache()
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model


def known_config(model_path):
    """The config a --model-path names, nothing loaded or downloaded: its readable config.json (a folder's, or the HF
    cache's copy of a hub name), else its preset's for a name of HUB_NAMES; None for any other."""
    if not model_path:
        return None
    from transformers import AutoConfig  # slow to import (~2 s)
    try:
        return AutoConfig.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError):  # none there, or not a config transformers can read (an unknown type)
        pass
    preset = HUB_NAMES.get(model_path)
    return preset_config(preset, _token_ids(build_tokenizer())) if preset else None


def count_params(cfg) -> int:
    """Parameter count of a config without allocating (meta device): of the model fsdp_actor.load_hf_model would
    load (a VLM's image-text-to-text model, a text LLM's causal LM)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # slow to import (~2 s)
    with torch.device("meta"):
        try:
            model = AutoModelForImageTextToText.from_config(cfg)
        except ValueError:  # "Unrecognized configuration class": a text LLM (as load_hf_model tells them apart)
            model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())
