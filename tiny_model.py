"""Builds small checkpoints in code (no hub access): build_tiny_model() makes a tiny random Qwen2.5-VL / Qwen2-VL /
Qwen3-VL(-MoE) / Qwen3.5(-MoE) / Qwen2 / Qwen3 / Llama-3 (Gemma 4, InternVL: tiny_families) with a BPE tokenizer
trained in code, saved as a hub folder (AutoModel*, AutoProcessor and vLLM load it); cached, a marker written last.
Below: the demos' settings (DEMO, TEXT_DEMO, VIDEO_DEMO) and synthetic tasks, written on first use."""
import io
import json
import os
import random
import shutil
import tempfile
import zlib

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

import tiny_families
import tiny_moe
from common import UserError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
DEFAULT_SYSTEM = "You are a helpful assistant."
# Qwen2-VL style template: string content or a list of {"type": "image"|"video"|"text"} items; one pad per image
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the colour task's words, frequent in the corpus so BPE gives each one token (one-token answers: a dense reward)
TASK_WORDS = "red green blue white yellow shape color circle square triangle answer".split()
FILLER_WORDS = ("the a of is what which this image picture shows one word with in it and "
                "think so because therefore number count left right").split()
MARKER = "BUILD_COMPLETE.json"
CACHE_ROOT = os.path.expanduser("~/.cache/vlm_rl")
ARCHS = ("qwen2_5_vl", "qwen2_vl", "qwen2", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3", "llama")
QWEN3_VISION = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # 16-pixel patches, Qwen3-VL's processor
TEXT_ARCHS = ("qwen2", "qwen3", "llama")  # causal LMs without a vision tower
FAMILIES = ("gemma4", "internvl")  # other image-text families (tiny_families.py): the generic path


# ----------------------------------------------------------------------------- tokenizer
def _corpus(n_lines=3000, seed=0):
    rng = random.Random(seed)
    lines = [DEFAULT_SYSTEM, "system", "user", "assistant", "What is the color of the shape? Answer with one word."]
    for _ in range(n_lines):
        words = [rng.choice(TASK_WORDS) if rng.random() < 0.6 else rng.choice(FILLER_WORDS)
                 for _ in range(rng.randint(2, 10))]
        if rng.random() < 0.3:  # capitalised / digit variants so the vocab is not degenerate
            words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 99)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":", ""]))
    lines += [w for w in TASK_WORDS for _ in range(200)]  # alone on a line: the no-leading-space form frequent too
    lines += [DEFAULT_SYSTEM, "system", "user", "assistant"] * 100  # the chat scaffolding: few tokens per template
    return lines


def build_tokenizer(vocab_size=512, split_digits=False, specials=SPECIAL_TOKENS, eos="<|im_end|>", pad="<|endoftext|>",
                    template=CHAT_TEMPLATE, first=(), **named):
    """Byte-level BPE (like Qwen's) trained on the synthetic corpus, plus Qwen's special tokens. split_digits: one
    token per digit, as Qwen's own (the Qwen3 models; the older demos keep the numbers measured with merged digits).
    Other families (tiny_families.py): their own specials, eos, pad, chat template, named tokens, first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # slow to import (~2 s)
    from transformers import PreTrainedTokenizerFast  # slow to import (~2 s)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), min_frequency=2, special_tokens=list(first),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, unk_token=None,
                                 additional_special_tokens=list(specials), model_max_length=32768, **named)
    hf.chat_template = template
    return hf


def _token_ids(tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert all(isinstance(i, int) and i >= 0 for i in ids.values()), ids
    return ids


# ----------------------------------------------------------------------------- configs
# arch -> transformers' prefix of its config and model classes (+ "Config", + "ForConditionalGeneration") and its
# processor class: Qwen3-VL's serves the MoE and Qwen3.5 (its vision tower, without deepstack, before a hybrid LLM)
VL_CLASSES = {"qwen2_5_vl": ("Qwen2_5_VL", "Qwen2_5_VLProcessor"), "qwen2_vl": ("Qwen2VL", "Qwen2VLProcessor"),
              "qwen3_vl": ("Qwen3VL", "Qwen3VLProcessor"), "qwen3_vl_moe": ("Qwen3VLMoe", "Qwen3VLProcessor"),
              "qwen3_5": ("Qwen3_5", "Qwen3VLProcessor"), "qwen3_5_moe": ("Qwen3_5Moe", "Qwen3VLProcessor"),
              "gemma4": ("Gemma4", "Gemma4Processor")}  # (tiny_families.py; presets.py's gemma4_e2b)


def _vl_classes(arch):
    if arch not in VL_CLASSES:
        raise ValueError(f"unknown VL arch {arch!r}; expected one of {ARCHS}")
    import transformers  # slow to import (~2 s)
    prefix, proc = VL_CLASSES[arch]
    return tuple(getattr(transformers, n) for n in (prefix + "Config", prefix + "ForConditionalGeneration", proc))


def _text_config(ids, vocab_size, hidden, intermediate, layers, heads, kv_heads, mrope_section, tie, max_pos=4096):
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if mrope_section is not None:
        # transformers 5 reads M-RoPE here (4.x: rope_scaling); the sections split head_dim/2 frequencies over t, h, w
        rope["mrope_section"] = list(mrope_section)
    return dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                rms_norm_eps=1e-6, hidden_act="silu", rope_parameters=rope, bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=tie)


def tiny_config(arch, ids, vocab_size):
    """Config of the tiny demo model. head_dim = 128/4 = 32, so mrope_section sums to 16."""
    if arch == "llama":
        return _llama_config(ids, vocab_size)
    # Qwen3-VL interleaves the (time, height, width) frequencies (t h w t h w ...) instead of giving each a block;
    # [6, 5, 5] is its [24, 20, 20] scaled to 16 frequencies
    q3vl = arch in QWEN3_VISION  # the MoE: Qwen3-VL with experts in place of each dense MLP
    mrope = None if arch in TEXT_ARCHS else [6, 5, 5] if q3vl else [4, 6, 6]
    text = _text_config(ids, vocab_size, hidden=128, intermediate=256, layers=2, heads=4,
                        kv_heads=2, mrope_section=mrope, tie=False)
    if arch == "qwen3" or q3vl:
        text["head_dim"] = 32  # Qwen3 configs name it (and its attention norms q and k per head)
    if q3vl:
        text["rope_parameters"]["mrope_interleaved"] = True  # what vLLM reads; transformers always interleaves
    if arch in TEXT_ARCHS:
        from transformers import Qwen2Config, Qwen3Config  # slow to import (~2 s)
        Cfg = Qwen3Config if arch == "qwen3" else Qwen2Config
        return Cfg(**text, architectures=[Cfg.__name__.replace("Config", "ForCausalLM")])
    Cfg, Model, _ = _vl_classes(arch)
    if arch == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1],
                      hidden_act="silu", tokens_per_second=2)
    elif q3vl:  # patch 16; blocks 0 and 1 also feed the LLM's layers 0 and 1 (deepstack)
        vision = dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                      deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh")
    else:  # Qwen2-VL names: embed_dim = ViT width, hidden_size = output (LLM) width
        vision = dict(depth=2, embed_dim=64, mlp_ratio=2, hidden_size=128, num_heads=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if arch == "qwen3_vl_moe":
        text.update(tiny_moe.TINY)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        text.update(QWEN3_5_TINY)  # (after the Qwen3-VL settings above: its own head size and rotary share)
        vision.pop("deepstack_visual_indexes")
        if arch == "qwen3_5_moe":
            text.update({k: v for k, v in tiny_moe.TINY.items() if k not in ("decoder_sparse_step", "mlp_only_layers")},
                        shared_expert_intermediate_size=96)
    return _vl_config(Cfg, Model, text, vision, ids, tie=False)


# Qwen3.5 in small, in the checkpoints' pattern: 3 Gated DeltaNet layers (2 value heads per key head, as the 9B's) then
# full attention (output gate; rotary on a quarter of head 64: 8 frequencies 3 / 3 / 2 over t, h, w, as [11, 11, 10])
QWEN3_5_TINY = dict(num_hidden_layers=4, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [3, 3, 2],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.25})


def _llama_config(ids, vocab_size):
    """Llama 3.2's shape in small: GQA (2 key/value heads for 4), rope_theta 500000 with Llama 3.1's "llama3" scaling,
    no biases, rms_norm_eps 1e-5, tied embeddings as Llama 3.2 1B/3B; this file's tokenizer and Qwen's chat template
    (as the DeepSeek-R1 Llama distills), so the same data and reward code run on it."""
    from transformers import LlamaConfig  # slow to import (~2 s)
    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu",
                       max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192},
                       bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                       pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True, architectures=["LlamaForCausalLM"])


def _vl_config(Cfg, Model, text, vision, ids, tie):
    return Cfg(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie, architectures=[Model.__name__])


# ----------------------------------------------------------------------------- saving
def _save_processor(arch, tok, out, min_pixels, max_pixels):
    """Write the processor as the hub Qwen-VL repos' per-component files: transformers 5's Processor.save_pretrained
    needs a video processor, which needs torchvision (the CPU box lacks it); without it, use data.load_processor."""
    import transformers  # slow to import (~2 s)
    # The PIL backend (transformers 5: *Pil; 4.x: the slow class) works without torchvision and saves as the plain
    # "Qwen2VLImageProcessor" type, so each machine picks its own backend.
    ImgProc = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    # the Qwen3-VL repos: 16-pixel patches, inputs scaled to [-1, 1]
    kw = dict(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3) if arch in QWEN3_VISION else {}
    ImgProc(min_pixels=min_pixels, max_pixels=max_pixels, **kw).save_pretrained(out)
    proc_class = _vl_classes(arch)[2].__name__
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    path = os.path.join(out, "preprocessor_config.json")
    cfg = json.load(open(path))
    # min/max_pixels + processor_class: what transformers 4.x and older vLLM versions read.
    cfg.update(processor_class=proc_class, min_pixels=min_pixels, max_pixels=max_pixels, size=size)
    _write_json(path, cfg)
    video = {k: cfg[k] for k in ("image_mean", "image_std", "do_convert_rgb", "do_normalize", "do_rescale", "do_resize",
                                 "rescale_factor", "resample", "patch_size", "temporal_patch_size", "merge_size")}
    video.update(video_processor_type="Qwen2VLVideoProcessor", processor_class=proc_class,
                 min_pixels=min_pixels, max_pixels=max_pixels, size=size)
    if arch in QWEN3_VISION:  # its own video processor, which knows only `size` (as in the Qwen3-VL repos)
        del video["min_pixels"], video["max_pixels"]
        video["video_processor_type"] = "Qwen3VLVideoProcessor"
    _write_json(os.path.join(out, "video_preprocessor_config.json"), video)
    if not os.path.isfile(os.path.join(out, "chat_template.jinja")):  # older tokenizers embed it
        with open(os.path.join(out, "chat_template.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def _is_complete(path):
    return os.path.isfile(os.path.join(path, MARKER))


def _atomic_build(out_dir, build_fn, meta):
    """Run build_fn(tmp_dir) and rename tmp_dir to out_dir; the marker is written last."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    if _is_complete(out_dir):
        return out_dir
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        build_fn(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(meta, f)
        if os.path.exists(out_dir):  # a half-written folder from an older crash
            if _is_complete(out_dir):  # another process won the race
                return out_dir
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not _is_complete(out_dir):  # lost a race to a concurrent builder: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def build_tiny_model(out_dir=None, arch="qwen2_5_vl", seed=0, rank=None, extra_tokens=()) -> str:
    """Build (or reuse) the tiny random model; returns its folder (pass it to from_pretrained). rank: under
    torch.distributed, rank 0 builds and the others wait for it. extra_tokens: added to the vocabulary, one token
    each (the zoom demo's tool call), in a model of their own."""
    if rank is not None:
        if rank == 0:
            build_tiny_model(out_dir, arch, seed, extra_tokens=extra_tokens)
        dist.barrier()
    if arch not in ARCHS + FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS + FAMILIES}")
    version = 7 if arch == "gemma4" else 3  # 3: the MoE config names norm_topk_prob; 7: Gemma 4's <pad> at id 0
    out_dir = out_dir or os.path.join(CACHE_ROOT, f"tiny-{arch}-v{version}" + "-tools" * bool(extra_tokens))

    def build(tmp):
        if arch in FAMILIES:
            return tiny_families.build(arch, tmp, seed, build_tokenizer, _text_config, CHAT_TEMPLATE, SPECIAL_TOKENS)
        tok = build_tokenizer(512 - len(extra_tokens), split_digits=arch in ("qwen3",) + QWEN3_VISION)
        tok.add_tokens(list(extra_tokens))  # (not special: a decoded response keeps them)
        ids = _token_ids(tok)
        vocab_size = (len(tok) + 63) // 64 * 64  # aligned rows, like Qwen's padded embeddings
        cfg = tiny_config(arch, ids, vocab_size)
        torch.manual_seed(seed)
        if arch in TEXT_ARCHS:
            from transformers import AutoModelForCausalLM  # slow to import (~2 s)
            model = AutoModelForCausalLM.from_config(cfg)
        else:
            model = _vl_classes(arch)[1](cfg)
        model = model.to(torch.float32).eval()  # fp32: the CPU demo trains in fp32
        model.save_pretrained(tmp)
        tiny_moe.hub_layout(tmp)
        tiny_families.generation_config(tmp, [ids["<|im_end|>"], ids["<|endoftext|>"]], *[ids["<|endoftext|>"]] * 2)
        tok.save_pretrained(tmp)
        if arch not in TEXT_ARCHS:  # 4..16 image tokens per image keeps CPU steps fast
            _save_processor(arch, tok, tmp, min_pixels=56 * 56, max_pixels=112 * 112)

    return _atomic_build(out_dir, build, {"arch": arch, "seed": seed, "version": 1})


if __name__ == "__main__":
    import sys
    print(build_tiny_model(*(sys.argv[1:2] or [None])))


# ================================================================================ the demos' settings
# The demo settings, over grpo.Config's defaults (EasyR1's). The demo (no --model-path) trains a tiny model from scratch
# on one-word answers about small pictures, so it gets its own; a value given on the command line wins in both.
DEMO = dict(reward_function="color", max_prompt_length=512, max_response_length=4, min_pixels=56 * 56,
            max_pixels=112 * 112, n=16, rollout_batch_size=16, global_batch_size=16, lr=1e-3, max_steps=150,
            val_freq=10, save_freq=10, output_dir="outputs/demo", shuffle=False, lr_scheduler_type="cosine")
# Why (the runs: docs/demos.md): shuffle off, each step holds each colour 4 times (shuffled, colours not yet told apart
# drifted to one answer). cosine: at a constant lr a solved task's rare mistakes gave gradient spikes AdamW's momentum
# carried into a lost colour; the slow demos (text, zoom, dapo.py) keep a constant lr. Each keeps every answer sampled
# (one never sampled is never learned): the text demo (--demo-model qwen3) at half the lr, temperature 1.5, n 32.
TEXT_DEMO = dict(reward_function="number", max_response_length=1, n=32, lr=5e-4, temperature=1.5, lr_scheduler_type="constant")
# The video demo (--demo-task video): one-token answers, groups of 32 (with 4 and 16 all clips ending green said "blue")
VIDEO_DEMO = dict(max_response_length=1, n=32)
# The zoom demo (tools.py): turns of one token (the call, the colour), groups of 32, KL 0.1 (at 0.01 it lost a colour)
TOOLS_DEMO = dict(tools="zoom", reward_function="zoom", max_turns=2, max_turn_tokens=1, max_response_length=40,
                  limit_images=3, n=32, kl_coef=0.1, lr_scheduler_type="constant")
FAMILY_DEMO = {"gemma4": dict(kl_coef=0.1),  # Gemma 4's colour demo: KL 0.1 (at 0.01 it lost a colour more often)
               "qwen3_5_moe": dict(temperature=1.2)}  # at 1.0 a merged pair split late (CPU seed 3: 0.835 at step 130)


# ================================================================================ the demos' synthetic tasks
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
          "white": (235, 235, 235)}  # four colours far apart in RGB: a close pair (red/yellow) gets confused
SHAPES = ("circle", "square", "triangle")
COLOR_QUESTION = "<image>What is the main color of the picture?"
DEMO_FORMAT_PROMPT = "{{ content }} Answer with one word."
MAX_QUESTION = "What is the largest of {digits}?"
NUMBER_FORMAT_PROMPT = "{{ content }} Answer with a number."


def jittered(rng: random.Random, color: str):
    """The RGB of one of COLORS, each channel moved by up to 20 (pictures and clips alike)."""
    return tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLORS[color])


def png_item(img):
    """A picture as an EasyR1 image item ({"bytes": PNG, "path": None}), as HF datasets store images."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def write_parquet(rows, out_path, features=None):
    """Rows (column -> list) to a parquet file, written whole then renamed (atomic). Returns its absolute path."""
    import datasets  # slow to import (~2 s): only where a task's data are written or read
    out_path = os.path.abspath(os.path.expanduser(out_path))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".parquet.tmp", dir=os.path.dirname(out_path))
    os.close(fd)
    try:
        datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path


def draw_color_image(rng: random.Random, color=None):
    """A picture filled with one saturated colour (jittered; None: drawn at random) and 1-3 small grey shapes as
    distractors. Returns (image, colour name, shape name). The colour covers most of the picture: a tiny random
    vision tower sees it clearly, so RL from scratch learns the task in minutes on a CPU."""
    w, h = rng.randint(56, 112), rng.randint(56, 112)
    color, shape = color or rng.choice(list(COLORS)), rng.choice(SHAPES)
    img = Image.new("RGB", (w, h), jittered(rng, color))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(1, 3)):
        s = rng.randint(int(0.15 * min(w, h)), int(0.3 * min(w, h)))
        x, y = rng.randint(0, w - s), rng.randint(0, h - s)
        grey = (rng.randint(90, 170),) * 3
        if shape == "circle":
            draw.ellipse([x, y, x + s - 1, y + s - 1], fill=grey)
        elif shape == "square":
            draw.rectangle([x, y, x + s - 1, y + s - 1], fill=grey)
        else:
            draw.polygon([(x + s // 2, y), (x, y + s - 1), (x + s - 1, y + s - 1)], fill=grey)
    return img, color, shape


def make_color_dataset(out_path: str, n_rows: int, seed: int, draw=draw_color_image, question=COLOR_QUESTION) -> str:
    """EasyR1-format parquet (problem, answer, images=[{"bytes": png}]) of draw(rng, colour)'s pictures, written
    atomically; each 16 rows in a row hold every colour 4 times (why: DEMO)."""
    import datasets  # slow to import (~2 s): only where a task's data are written or read
    rng = random.Random(seed)
    order = [c for b in range(-(-n_rows // 16)) for c in random.Random(f"{seed}/{b}").sample([*COLORS] * 4, 16)]
    answers = order[:n_rows]
    rows = {"problem": [question] * n_rows, "answer": answers,
            "images": [[png_item(draw(rng, color)[0])] for color in answers]}
    features = datasets.Features({"problem": datasets.Value("string"),
                                  "answer": datasets.Value("string"), "images": datasets.List(datasets.Image())})
    return write_parquet(rows, out_path, features)


def demo_files(data_dir, name, n_train, n_val, write):
    """(train_path, val_path) of a demo task in data_dir (~/.cache/vlm_rl/<name> if None), each written once by
    write(path, rows, seed): seed 0 trains, seed 1 validates (rows the policy never trained on)."""
    data_dir = os.path.expanduser(data_dir or f"~/.cache/vlm_rl/{name}")
    paths = tuple(os.path.join(data_dir, f"{s}-{k}.parquet") for s, k in (("train", n_train), ("val", n_val)))
    for path, k, seed in zip(paths, (n_train, n_val), (0, 1)):
        if not os.path.isfile(path):
            write(path, k, seed)
    return paths


def demo_data(data_dir=None, n_train=2000, n_val=200):
    """(train_path, val_path) of the colour task."""
    return demo_files(data_dir, "color-v4", n_train, n_val, make_color_dataset)


# --demo-task zoom (tools.py): a grey, noisy picture with a 2 x 2-pixel coloured dot at its centre, too small for the
# tiny vision tower to tell the colour (--max-turns 1 stays near chance); tools.zoom returns the centre magnified
ZOOM_QUESTION = "<image>What is the color of the dot in the middle?"
ZOOM_FORMAT_PROMPT = "{{ content }} Zoom in, then answer with one word."


def draw_zoom_image(rng: random.Random, color=None):
    """(picture, colour) of the zoom task (make_color_dataset's rows); color None: drawn at random."""
    color, img = color or rng.choice(list(COLORS)), Image.new("RGB", (112, 112))
    img.putdata([(g, g, g) for g in (rng.randint(100, 160) for _ in range(112 * 112))])  # grey noise
    ImageDraw.Draw(img).rectangle([55, 55, 56, 56], fill=jittered(rng, color))
    return img, color


def demo_zoom_data(data_dir=None, n_train=2000, n_val=200):
    """(train_path, val_path) of the zoom task."""
    return demo_files(data_dir, "zoom-v2", n_train, n_val,
                      lambda path, k, seed: make_color_dataset(path, k, seed, draw_zoom_image, ZOOM_QUESTION))


def max_question(rng: random.Random, lengths=(3, 4, 5)) -> tuple[str, str]:
    """One question of the text demo's task and its answer: the largest of k digits, which occurs once; the answer
    uniform from 2 to 9 (no constant answer pays more than 1/8), the others below it, the largest at a uniform place."""
    k, top = rng.choice(lengths), rng.randint(2, 9)
    digits = [rng.randrange(top) for _ in range(k - 1)]
    digits.insert(rng.randrange(k), top)
    return MAX_QUESTION.format(digits=", ".join(map(str, digits))), str(top)


def is_val_question(question: str) -> bool:
    """Which side of the split a question is on: a tenth of all questions (by a hash of the text) are validation's,
    never drawn for training; a hash keeps both sides' answer distributions alike."""
    return zlib.crc32(question.encode()) % 10 == 0


def make_max_dataset(out_path: str, n_rows: int, seed: int, split="train", lengths=(3, 4, 5)) -> str:
    """Text-only rows (problem, answer; no images column) of the text demo's task, drawn from `split`'s side of the
    question space only (is_val_question); validation's rows are all different questions. Written atomically."""
    rng = random.Random(seed)
    rows = {"problem": [], "answer": []}
    while len(rows["problem"]) < n_rows:
        question, answer = max_question(rng, lengths)
        if is_val_question(question) == (split == "val") and not (split == "val" and question in rows["problem"]):
            rows["problem"].append(question)
            rows["answer"].append(answer)
    return write_parquet(rows, out_path)


def demo_max_data(data_dir=None, n_train=4000, n_val=200):
    """(train_path, val_path) of the text demo's task, "What is the largest of 3, 8, 1, 5?" (3 to 5 digits: 85,608
    lists); created once, validation and training from disjoint parts of the question space (checked each call)."""
    train, val = demo_files(data_dir, "max-v2", n_train, n_val,
                            lambda path, k, seed: make_max_dataset(path, k, seed, split=("train", "val")[seed]))
    seen = set(_questions(val)) & set(_questions(train))  # the cached files too, every time
    if seen:
        raise UserError(f"{len(seen)} validation questions occur in {train} (e.g. {min(seen)!r}): validation would "
                        f"not be unseen; delete {os.path.dirname(train)} to have it made again")
    return train, val


def _questions(path):
    """The problem column of a parquet file of make_max_dataset (as data.load_rows reads it)."""
    import datasets  # slow to import (~2 s): only where a task's data are written or read
    return datasets.load_dataset("parquet", data_files=path, split="train")["problem"]


# ================================================================================ the video demo's task
VIDEO_QUESTION = "<video>Which colour does the video end with?"


def draw_clip(rng: random.Random, n_frames=4):
    """A clip whose first half is one colour and second half another (jittered per frame, one grey shape that
    moves): the answer is in its last frames only. Returns (frames, first colour, last colour)."""
    w, h = rng.randint(56, 84), rng.randint(56, 84)
    first, last = rng.sample(list(COLORS), 2)
    s = rng.randint(int(0.2 * min(w, h)), int(0.35 * min(w, h)))
    frames = []
    for i in range(n_frames):
        color = first if i < n_frames // 2 else last
        img = Image.new("RGB", (w, h), jittered(rng, color))
        x, y = rng.randint(0, w - s), rng.randint(0, h - s)
        ImageDraw.Draw(img).ellipse([x, y, x + s - 1, y + s - 1], fill=(rng.randint(90, 170),) * 3)
        frames.append(img)
    return frames, first, last


def make_video_dataset(out_path: str, n_rows: int, seed: int) -> str:
    """EasyR1-format parquet (problem, answer, videos=[[frame PNGs]]) of the video demo; written atomically."""
    import datasets  # slow to import (~2 s): only where a task's data are written or read
    rng = random.Random(seed)
    clips = [draw_clip(rng) for _ in range(n_rows)]  # (frames, first colour, last colour)
    rows = {"problem": [VIDEO_QUESTION] * n_rows, "answer": [last for _, _, last in clips],
            "videos": [[[png_item(f) for f in frames]] for frames, _, _ in clips]}
    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "videos": datasets.List(datasets.List(datasets.Image()))})
    return write_parquet(rows, out_path, features)


def demo_video_data(data_dir=None, n_train=2000, n_val=200):
    """(train_path, val_path) of the video demo (--demo-task video)."""
    return demo_files(data_dir, "video-v1", n_train, n_val, make_video_dataset)
