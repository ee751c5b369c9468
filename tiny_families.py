"""Tiny checkpoints of the non-Qwen families (build_tiny_model's arch "gemma4" / "internvl") from transformers' own
classes: the real module layout, processor class, special tokens and chat format, saved as a hub folder (Gemma 4's
tokenizer, config and processor also serve presets.py's gemma4_e2b).
  gemma4    the E2B layout in small: sliding and full attention layers with their own head sizes (32 / 64) and rotary,
            per-layer inputs, the last 2 layers reusing earlier keys/values with a double-wide MLP, logits soft-capped
            at 30; a vision tower with 2-D positions and 2x2 pooling (70 soft tokens an image).
  internvl  InternVL3's layout: an InternViT of 56-pixel tiles (an image's tiles, then its thumbnail), pixel shuffle
            0.5 and a 2-layer projector before a Qwen2 LLM; 4 <IMG_CONTEXT> tokens a tile."""
import json
import os

import torch
from safetensors.torch import save_file

GEMMA4_TOKENS = dict(image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>", audio_token="<|audio|>",
                     boa_token="<|audio>", eoa_token="<audio|>")
GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|video|>", *GEMMA4_TOKENS.values()]
# Gemma 4's turn format: <bos><|turn>user\n ... <turn|>\n<|turn>model\n (the assistant's role is "model")
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>{{ 'model' if message['role'] == 'assistant' else "
    "message['role'] }}\n{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<|image|>{% elif item['type'] == 'text' %}"
    "{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}")
INTERNVL_TOKENS = dict(start_image_token="<img>", end_image_token="</img>", context_image_token="<IMG_CONTEXT>",
                       video_token="<video>")


class _Saved(dict):
    """A sub-processor that cannot be built here (a video processor needs torchvision): its settings, saved as one."""
    _auto_class = None


def _save_processor(cls, out, **parts):
    """cls(**parts).save_pretrained(out), with _Saved parts let through its type check."""
    from transformers import ProcessorMixin  # slow to import (~2 s)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, n, a: None if isinstance(a, _Saved) else check(
        self, n, a)
    try:
        cls(**parts).save_pretrained(out)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def generation_config(out, eos, pad, bos):
    from transformers import GenerationConfig  # slow to import (~2 s)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=bos, do_sample=False).save_pretrained(out)


def gemma4_tokenizer(make_tokenizer):
    """tiny_model's BPE (`make_tokenizer`) with Gemma 4's special tokens and turn format: (tokenizer, {token: id})."""
    tok = make_tokenizer(specials=GEMMA4_SPECIALS, eos="<eos>", pad="<pad>", template=GEMMA4_TEMPLATE,
                         bos_token="<bos>", first=("<pad>", "<eos>", "<bos>"), **GEMMA4_TOKENS)  # the hub's ids (vLLM)
    return tok, {t: tok.convert_tokens_to_ids(t) for t in GEMMA4_SPECIALS}


def gemma4_config(text, vision, ids, audio=None, **extra):
    """Gemma4Config of these sub-configs (dicts) with the special tokens' ids of `ids` (GEMMA4_SPECIALS -> id)."""
    import transformers  # slow to import (~2 s)
    return transformers.Gemma4Config(
        text_config={**text, "pad_token_id": ids["<pad>"], "eos_token_id": ids["<eos>"], "bos_token_id": ids["<bos>"]},
        vision_config=vision, audio_config=audio, image_token_id=ids["<|image|>"], boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"], video_token_id=ids["<|video|>"], audio_token_id=ids["<|audio|>"],
        boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"], architectures=["Gemma4ForConditionalGeneration"],
        **extra)


def save_gemma4(out, tok, ids, **image):
    """Gemma 4's generation config (eos: <eos> and <turn|>) and processor (image: its image processor's settings)."""
    import transformers  # slow to import (~2 s)
    generation_config(out, [ids["<eos>"], ids["<turn|>"]], ids["<pad>"], ids["<bos>"])
    _save_processor(transformers.Gemma4Processor, out, tokenizer=tok, image_seq_length=image["max_soft_tokens"],
                    chat_template=GEMMA4_TEMPLATE, image_processor=transformers.Gemma4ImageProcessorPil(**image),
                    feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
                    video_processor=_Saved(video_processor_type="Gemma4VideoProcessor", **image))


def build(arch, out, seed, make_tokenizer, text_config, qwen_template, qwen_specials):
    """Write the tiny `arch` checkpoint into folder `out`; tiny_model's tokenizer, text config, Qwen chat template and
    special tokens come as arguments (it imports this file)."""
    import transformers  # slow to import (~2 s)
    if arch == "gemma4":
        tok, ids = gemma4_tokenizer(make_tokenizer)
        V = (len(tok) + 63) // 64 * 64
        text = dict(vocab_size=V, vocab_size_per_layer_input=V, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=512,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                    hidden_size_per_layer_input=16, num_kv_shared_layers=2, use_double_wide_mlp=True,
                    final_logit_softcapping=30.0, max_position_embeddings=4096, tie_word_embeddings=True)
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=32, patch_size=8, pooling_kernel_size=2,
                      position_embedding_size=1024, default_output_length=70, standardize=True)
        cfg, model_cls = gemma4_config(text, vision, ids), transformers.Gemma4ForConditionalGeneration
    elif arch == "internvl":
        # InternVL3-hf: Qwen2's chat format, each image one <IMG_CONTEXT> on its own line (the processor expands it)
        template = qwen_template.replace("<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n")
        specials = qwen_specials + list(INTERNVL_TOKENS.values())
        tok = make_tokenizer(specials=specials, template=template, **INTERNVL_TOKENS)
        ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
        text = text_config(ids, (len(tok) + 63) // 64 * 64, hidden=128, intermediate=256, layers=2, heads=4,
                              kv_heads=2, mrope_section=None, tie=False)
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      image_size=56, patch_size=14, hidden_act="gelu")
        cfg = transformers.InternVLConfig(text_config={**text, "model_type": "qwen2"}, vision_config=vision,
                                          image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=4,
                                          downsample_ratio=0.5, tie_word_embeddings=False)
        model_cls, eos = transformers.InternVLForConditionalGeneration, [ids["<|im_end|>"], ids["<|endoftext|>"]]
        image = dict(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=4,
                     image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
        proc = dict(cls=transformers.InternVLProcessor, image_seq_length=4, chat_template=template,
                    image_processor=transformers.GotOcr2ImageProcessorPil(**image),
                    video_processor=_Saved(video_processor_type="InternVLVideoProcessor", **image))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    cfg.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(cfg)
    if arch == "gemma4":  # transformers fills the vision tower's learned 2-D position table with ones (the hub's
        # weights replace them): each patch starts as one constant vector plus a tenth of its pixels, the colours
        # reach the LLM alike (cosine 0.98) and it never learns them apart; drawn as the other weights are instead
        pos = model.model.vision_tower.patch_embedder.position_embedding_table
        torch.nn.init.normal_(pos, std=cfg.vision_config.initializer_range)
        # Gemma 4 scales attention by 1.0 and leaves the temperature to the learned q/k norms; at their init of ones
        # q.k has std sqrt(head_dim) and each head looks at one random token (entropy 0.1-2.7 of 4.6 at the answer),
        # many at none of the picture: head_dim ** -0.25 each starts every head as 1/sqrt(d) attention does
        for name, w in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                torch.nn.init.constant_(w, w.numel() ** -0.25)
    model.to(torch.float32).eval().save_pretrained(out)
    complete_for_vllm(out)
    if arch == "gemma4":
        return save_gemma4(out, tok, ids, max_soft_tokens=70, patch_size=8, pooling_kernel_size=2)
    generation_config(out, eos, *[ids["<|endoftext|>"]] * 2)
    _save_processor(proc.pop("cls"), out, tokenizer=tok, **proc)


def complete_for_vllm(folder):
    """Add to a written HF folder what vLLM requires and transformers' model lacks: the k norm of Gemma 4's KV-shared
    layers (transformers drops the hub's; vLLM 0.26 refuses a folder without it). Unused there: ones, a file apart."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    t = cfg.get("text_config", cfg)
    n, shared = t.get("num_hidden_layers", 0), t.get("num_kv_shared_layers") or 0
    if cfg.get("model_type") != "gemma4" or not shared:
        return
    per_layer = {int(k): v for k, v in (t.get("per_layer_config") or {}).items()}  # transformers' ("04": ...); the
    dims = [(per_layer.get(i) or {}).get("head_dim")  # hub's config: global_head_dim (or 512)
            or (kind == "full_attention" and t.get("global_head_dim", 512)) or t["head_dim"]
            for i, kind in enumerate(t["layer_types"])]
    norms = {f"model.language_model.layers.{i}.self_attn.k_norm.weight": torch.ones(dims[i])
             for i in range(n - shared, n)}
    save_file(norms, os.path.join(folder, "model-kv-shared-norms.safetensors"), metadata={"format": "pt"})
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):  # sharded: vLLM reads only the files its index names
        doc = json.load(open(index))
        doc["weight_map"].update(dict.fromkeys(norms, "model-kv-shared-norms.safetensors"))
        json.dump(doc, open(index, "w"), indent=2)
