"""What differs between model families, in one place. The Qwen-VL families (QWEN_VL) take the fast paths (M-RoPE on
the host, packed rows, the vision tower once per distinct image); any other image-text model transformers loads takes
the generic path: its processor builds the prompt and the inputs its forward takes, passed per row (padded rows), vLLM
expanding the placeholders itself (proven on the CPU: Gemma 4, InternVL). Text LLMs take the text path."""
import functools
import inspect
import types
from unittest import mock

import torch

import presets
from common import UserError

QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
WORKS = ("the families that train: Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE) (fast paths), Gemma 4, "
         "InternVL and any other image-text model transformers' AutoModelForImageTextToText loads (generic path), "
         "text LLMs (Qwen2/3, Llama, ...)")


def check_family(model_path, engine="auto"):
    """Before anything loads: one line (UserError) for a model neither path trains (no image-text or causal-LM class
    in transformers: audio-only, video-only, ...), or that the chosen vLLM has no class for (--rollout-engine hf)."""
    cfg = presets.known_config(model_path) if model_path else None
    if cfg is None:  # (a hub name not on disk: transformers says what it lacks when it loads)
        return
    from transformers.models.auto import modeling_auto as auto  # slow to import (~2 s)
    mt, arch = cfg.model_type, (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
    if mt not in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and (
            mt not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(cfg, "vision_config", None) is not None
            or getattr(cfg, "is_encoder_decoder", False)):
        raise UserError(f"--model-path {model_path}: {mt} ({arch}) has no image-text or text-generation class in "
                        f"transformers (audio- or video-only?), which training needs; {WORKS}")
    if engine == "vllm" or (engine == "auto" and torch.cuda.is_available()):
        try:
            import vllm  # optional: the GPU engine
            from vllm import ModelRegistry  # (likewise)
        except ImportError:  # ("auto" then falls back to the HF engine)
            return
        if arch not in ModelRegistry.get_supported_archs():
            raise UserError(f"--model-path {model_path}: vLLM {vllm.__version__} has no class for {arch}; train "
                            f"with --rollout-engine hf (transformers' generate; slower); {WORKS}")


def own_config(path):
    """transformers' own config class for the checkpoint: a started vLLM registers its own classes for some types
    (Qwen3.5) in AutoConfig, and a model built from one fails (seen on the H200)."""
    import transformers  # slow to import (~2 s)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # (register() leaves it alone)
    kind = transformers.PretrainedConfig.get_config_dict(path)[0].get("model_type")
    cls = getattr(transformers, CONFIG_MAPPING_NAMES.get(kind, ""), None)
    return cls.from_pretrained(path) if cls else transformers.AutoConfig.from_pretrained(path)


def special_token_ids(model_path):
    """(eos_ids, forbidden_ids) of a checkpoint folder, read alike by both engines so they stop alike: eos from
    generation_config's list plus the tokenizer's; forbidden: the image/video pads (one sampled corrupts the next)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # slow to import (~2 s)
    eos = []

    def add(x):
        for i in (x if isinstance(x, (list, tuple)) else [x]):
            if isinstance(i, int) and i >= 0 and i not in eos:
                eos.append(i)
    try:
        add(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except (OSError, ValueError):  # no generation_config.json
        pass
    cfg = AutoConfig.from_pretrained(model_path)
    if not eos:
        add(getattr(cfg.get_text_config(), "eos_token_id", None))
    try:
        add(AutoTokenizer.from_pretrained(model_path).eos_token_id)
    except Exception:  # a folder without tokenizer files still works from the configs
        pass
    if not eos:
        raise ValueError(f"{model_path}: no eos_token_id in generation_config, config or tokenizer")
    forbidden = [i for i in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None))
                 if isinstance(i, int) and i >= 0]
    return eos, forbidden


def head_dims(t):
    """Each decoder layer's head size of text config `t` (Gemma 4's differ: transformers refuses a global head_dim)."""
    try:
        return [getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads] * t.num_hidden_layers
    except RuntimeError:  # (AmbiguousGlobalPerLayerAttributeError)
        return [t.per_layer_config[i].head_dim for i in range(t.num_hidden_layers)]


def vllm_overrides(cfg):
    """hf_overrides vLLM needs under the names it reads: Gemma 4's full-attention head size (and kv heads), which
    transformers >= 5.17 keeps per layer while vLLM 0.26 reads global_head_dim from the text config."""
    t = cfg.get_text_config()
    layers = getattr(t, "per_layer_config", None)
    if cfg.model_type != "gemma4" or layers is None or "full_attention" not in t.layer_types:
        return {}
    full = layers[t.layer_types.index("full_attention")]
    # (and the flag that lets vLLM read the text config's head_dim at all: transformers 5.17 raises on a per-layer
    # attribute read globally, which stopped vLLM's start on the H200; vLLM takes the larger of the two head sizes)
    out = {"allow_global_per_layer_attribute_access": True, "global_head_dim": full.head_dim}
    if getattr(t, "attention_k_eq_v", False):
        out["num_global_key_value_heads"] = full.num_key_value_heads
    return {"text_config": out}


def engine_only(cfg):
    """Endings of names vLLM builds, never uses, and transformers lacks (no sync sends): Gemma 4's KV-shared k norms."""
    n, shared = (t := cfg.get_text_config()).num_hidden_layers, getattr(t, "num_kv_shared_layers", 0) or 0
    return tuple(f".layers.{i}.self_attn.k_norm.weight" for i in range(n - shared, n) if cfg.model_type == "gemma4")


def processor_without_video(model_path):
    """AutoProcessor without its video processor (transformers' need torchvision; the generic path takes images)."""
    import transformers  # slow to import (~2 s)
    import transformers.processing_utils as pu  # (likewise)
    auto, check = pu.MODALITY_TO_AUTOPROCESSOR_MAPPING, pu.ProcessorMixin.check_argument_for_proper_class
    none = types.SimpleNamespace(from_pretrained=lambda *a, **k: None)
    parts = type("Parts", (dict,), {"__getitem__": lambda _, m: none if m == "video_processor" else auto[m]})
    with mock.patch.object(pu, "MODALITY_TO_AUTOPROCESSOR_MAPPING", parts.fromkeys(auto.keys())), \
            mock.patch.object(pu.ProcessorMixin, "check_argument_for_proper_class",
                              lambda self, name, arg: arg is None or check(self, name, arg)):
        return transformers.AutoProcessor.from_pretrained(model_path)


def mm_token_types(hf, input_ids, mm_inputs):
    """Which tokens are image (1) and video (2) pads, for a model whose forward takes mm_token_type_ids: transformers
    >= 5 builds Qwen-VL's M-RoPE positions only when told (else 1-D ones, unlike vLLM's); Gemma 4's soft tokens too."""
    cfg = hf.config
    if not mm_inputs or not _takes_mm_token_types(type(hf.model)):
        return {}
    types_ = torch.zeros_like(input_ids)
    for tid, v in ((getattr(cfg, "image_token_id", None), 1), (getattr(cfg, "video_token_id", None), 2)):
        if tid is not None:
            types_[input_ids == tid] = v
    return {"mm_token_type_ids": types_}


@functools.cache
def _takes_mm_token_types(model_cls):  # once per class: this runs on every forward
    return "mm_token_type_ids" in inspect.signature(model_cls.forward).parameters


def soft_capped(kernels, cap):
    """varlen.LOGPROB_KERNELS (or their compiled twins) for soft-capped logits, cap x tanh(z / cap) (Gemma's final
    logits), with the chain rule in backward; in z's dtype as vLLM's (fp32: 1e-3 a token apart at 4x tiny Gemma 4's)."""
    stats, grad = kernels
    capped = lambda z: torch.tanh(z / cap)  # noqa: E731
    return (lambda z, *a: stats(capped(z) * cap, *a),
            lambda z, *a: (grad(capped(z) * cap, *a) * (1 - capped(z).float() ** 2)).to(z.dtype))
