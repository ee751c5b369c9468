"""Dataset loading and prompt encoding (EasyR1 data contract) + the synthetic colour and comparison tasks.

Rows follow EasyR1: a `problem` text (with optional `<image>` placeholders), an `answer` and an
`images` list. encode_prompt turns one row into the prompt record of the shared spec:
prompt_ids (image pads expanded, what the actor sees), raw_prompt_ids (one pad per image, what
vLLM expands itself), resized PIL images, processor outputs (mm_inputs), answer, prompt_text.
"""
import functools
import glob
import io
import math
import os
import random
import tempfile

import torch
from PIL import Image, ImageDraw

IMAGE_PLACEHOLDER = "<image>"
# Text-only keys of the processor output: per-token tensors that are rebuilt by whoever builds
# the full (prompt + response) sequence, so they do not belong in the per-prompt mm_inputs.
TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
DATA_EXTS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
# EasyR1 defaults (data.min_pixels / data.max_pixels).
MIN_PIXELS, MAX_PIXELS = 262144, 4194304

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
          "white": (235, 235, 235)}  # four colours far apart in RGB: a close pair (red/yellow) gets confused
SHAPES = ("circle", "square", "triangle")
COLOR_QUESTION = "<image>What is the main color of the picture?"
DEMO_FORMAT_PROMPT = "{{ content }} Answer with one word."
COMPARE_QUESTION = "Which is larger, {a} or {b}?"
NUMBER_FORMAT_PROMPT = "{{ content }} Answer with a number."


# ----------------------------------------------------------------------------- loading
def load_rows(source: str, split: str = "train"):
    """Rows from a hub dataset ("name" or "name@split"), a .parquet/.json/.jsonl file, or a
    folder of such files (split inferred from file names, like EasyR1)."""
    import datasets
    if "@" in source and not os.path.exists(source):
        source, split = source.rsplit("@", 1)
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        files = [f for f in sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
                 if os.path.splitext(f)[1] in DATA_EXTS]
        if not files:
            raise FileNotFoundError(f"no .parquet/.json/.jsonl files in folder {path!r}")
        kinds = {DATA_EXTS[os.path.splitext(f)[1]] for f in files}
        if len(kinds) > 1:
            raise ValueError(f"folder {path!r} mixes file types {sorted(kinds)}")
        return datasets.load_dataset(kinds.pop(), data_dir=path, split=split)
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1]
        if ext not in DATA_EXTS:
            raise ValueError(f"unsupported data file {path!r}: expected one of {sorted(DATA_EXTS)}")
        return datasets.load_dataset(DATA_EXTS[ext], data_files=path, split="train")
    if os.path.splitext(path)[1] in DATA_EXTS or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data file or folder not found: {path!r}")
    try:
        return datasets.load_dataset(source, split=split)
    except Exception as e:  # hub errors are long; make the failing source obvious
        raise FileNotFoundError(f"could not load dataset {source!r} (split {split!r}): {e}") from e


def load_processor(model_path: str, min_pixels: int | None = None, max_pixels: int | None = None):
    """AutoProcessor for VL models (a tokenizer for text-only ones). min/max_pixels, when given,
    replace the image processor's pixel budget (give vLLM the same via mm_processor_kwargs, or
    its image-token counts differ from ours). Without torchvision, transformers 5 cannot build
    Qwen-VL processors (the video and Auto image processors need it), so we assemble one from
    its parts with the PIL image backend."""
    import transformers
    try:
        proc = transformers.AutoProcessor.from_pretrained(model_path)
    except ImportError as e:
        proc = _processor_without_torchvision(model_path, e)
    ip = getattr(proc, "image_processor", None)
    if ip is not None and (min_pixels or max_pixels):
        lo = min_pixels or ip.size["shortest_edge"]
        hi = max_pixels or ip.size["longest_edge"]
        ip.size = {"shortest_edge": lo, "longest_edge": hi}  # transformers 5
        ip.min_pixels, ip.max_pixels = lo, hi  # transformers 4.x reads these
    return proc


def _processor_without_torchvision(model_path, error):
    import transformers
    model_type = transformers.AutoConfig.from_pretrained(model_path).model_type
    names = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen2_vl": "Qwen2VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
    if model_type not in names:
        raise error
    ImgProc = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    cls = getattr(transformers, names[model_type])
    proc = cls.__new__(cls)  # skips the __init__ check that demands a video processor
    proc.image_processor, proc.tokenizer, proc.video_processor = (
        ImgProc.from_pretrained(model_path), tok, None)
    proc.chat_template = tok.chat_template
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = tok.convert_tokens_to_ids(proc.image_token)
    proc.video_token_id = tok.convert_tokens_to_ids(proc.video_token)
    # Qwen3-VL's processor also knows the frame delimiters (its videos get a timestamp and a start/end per frame)
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    proc.vision_start_token_id = tok.convert_tokens_to_ids(proc.vision_start_token)
    proc.vision_end_token_id = tok.convert_tokens_to_ids(proc.vision_end_token)
    return proc


# ----------------------------------------------------------------------------- images
def to_pil(item, image_dir=None) -> Image.Image:
    """Decode any image encoding found in datasets into an RGB PIL image."""
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        if item.get("bytes"):
            return to_pil(item["bytes"])
        if item.get("path"):
            return to_pil(item["path"], image_dir)
        raise ValueError(f"image dict has neither 'bytes' nor 'path': keys {sorted(item)}")
    if isinstance(item, (bytes, bytearray)):
        try:
            img = Image.open(io.BytesIO(item))
            img.load()
        except Exception as e:
            raise ValueError(f"could not decode {len(item)} image bytes: {e}") from e
        return img.convert("RGB")
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item)
        if image_dir is not None and not os.path.isabs(path):
            path = os.path.join(image_dir, path)
        if not os.path.isfile(path):
            raise ValueError(f"image file not found: {path!r}")
        with Image.open(path) as img:
            return img.convert("RGB")
    raise ValueError(f"unsupported image type {type(item).__name__}")


def resize_image(img: Image.Image, min_pixels: int, max_pixels: int) -> Image.Image:
    """EasyR1/Qwen pixel budget: scale (keeping aspect) into [min_pixels, max_pixels]. Floor
    when shrinking and ceil when growing, so the bound holds (unless a side is clamped to 1)."""
    w, h = img.size
    if w * h > max_pixels:
        f = math.sqrt(max_pixels / (w * h))
        img = img.resize((max(1, math.floor(w * f)), max(1, math.floor(h * f))))
    elif w * h < min_pixels:
        f = math.sqrt(min_pixels / (w * h))
        img = img.resize((max(1, math.ceil(w * f)), max(1, math.ceil(h * f))))
    return img


# ----------------------------------------------------------------------------- prompts
@functools.lru_cache(maxsize=16)
def _template(format_prompt: str):
    """A jinja template from a string or a .jinja file path (cached: called once per row)."""
    import jinja2
    if format_prompt.endswith(".jinja") or os.path.isfile(format_prompt):
        with open(os.path.expanduser(format_prompt)) as f:
            format_prompt = f.read()
    return jinja2.Template(format_prompt.strip())


def _user_content(text: str, n_images: int, row_desc: str):
    """Split on <image> into chat content items; EasyR1 prepends images when there is none."""
    n_ph = text.count(IMAGE_PLACEHOLDER)
    if n_images == 0:
        if n_ph:
            raise ValueError(f"{row_desc}: {n_ph} '<image>' placeholder(s) but no images")
        return text
    if n_ph == 0:
        return [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    if n_ph != n_images:
        raise ValueError(f"{row_desc}: {n_ph} '<image>' placeholder(s) but {n_images} images")
    content = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            content.append({"type": "image"})
        if piece:
            content.append({"type": "text", "text": piece})
    return content


def encode_prompt(row: dict, processor_or_tokenizer, prompt_key="problem", answer_key="answer",
                  image_key="images", image_dir=None, format_prompt: str | None = None,
                  min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS) -> dict:
    """One dataset row -> prompt record (see the spec). The processor runs once per prompt."""
    proc = processor_or_tokenizer
    tok = getattr(proc, "tokenizer", proc)  # a processor wraps a tokenizer; a tokenizer is one
    text = str(row[prompt_key])
    row_desc = f"row with {prompt_key}={text[:60]!r}"
    if format_prompt:
        text = _template(format_prompt).render(content=text)
    raw_images = row.get(image_key) or []
    if raw_images and not hasattr(proc, "image_processor"):
        raise ValueError(f"{row_desc} has images but a tokenizer was given, not a processor")
    images = [resize_image(to_pil(im, image_dir), min_pixels, max_pixels) for im in raw_images]
    messages = [{"role": "user", "content": _user_content(text, len(images), row_desc)}]
    # No system message: the chat template inserts its default system prompt.
    templated = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    raw_prompt_ids = tok.encode(templated, add_special_tokens=False)
    if images:
        enc = proc(text=[templated], images=images, return_tensors="pt", add_special_tokens=False)
        prompt_ids = enc["input_ids"][0].tolist()
        mm_inputs = {k: v for k, v in enc.items()  # pixel_values [P, D], image_grid_thw [I, 3]
                     if k not in TOKEN_KEYS and isinstance(v, torch.Tensor)}
    else:
        prompt_ids, mm_inputs = list(raw_prompt_ids), {}
    return {"prompt_ids": prompt_ids, "raw_prompt_ids": raw_prompt_ids, "images": images,
            "mm_inputs": mm_inputs, "answer": str(row[answer_key]), "prompt_text": text}


class PromptDataset:
    """Index-based access to encoded prompts (the trainer shuffles indices itself, so resuming
    is exact). Rows whose real encoding exceeds max_prompt_length are dropped up front, like
    EasyR1's filter_overlong_prompts."""

    def __init__(self, source, processor_or_tokenizer, split="train", max_prompt_length=None,
                 filter_overlong=True, **encode_kwargs):
        self.rows = load_rows(source, split) if isinstance(source, str) else source
        self.processor = processor_or_tokenizer
        self.encode_kwargs = encode_kwargs
        self.indices = list(range(len(self.rows)))
        if max_prompt_length is not None and filter_overlong:
            self.indices = [i for i in self.indices
                            if len(self.encode_row(i)["prompt_ids"]) <= max_prompt_length]
            if not self.indices:
                raise ValueError(f"every prompt of {source!r} is longer than {max_prompt_length}")

    def encode_row(self, row_index: int) -> dict:
        try:
            return encode_prompt(self.rows[row_index], self.processor, **self.encode_kwargs)
        except ValueError as e:
            raise ValueError(f"dataset row {row_index}: {e}") from e

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return self.encode_row(self.indices[i])


# ----------------------------------------------------------------------------- synthetic task
def draw_color_image(rng: random.Random):
    """A picture filled with one saturated colour (jittered) and 1-3 small grey shapes as distractors.
    Returns (image, colour name, shape name). The colour covers most of the picture: a tiny random vision tower
    then sees it clearly, so RL from scratch learns the task in minutes on a CPU."""
    w, h = rng.randint(56, 112), rng.randint(56, 112)
    color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLORS[color])
    img = Image.new("RGB", (w, h), fill)
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


def make_color_dataset(out_path: str, n_rows: int, seed: int) -> str:
    """EasyR1-format parquet (problem, answer, images=[{"bytes": png}]); written atomically."""
    import datasets
    rng = random.Random(seed)
    rows = {"problem": [], "answer": [], "images": []}
    for _ in range(n_rows):
        img, color, _ = draw_color_image(rng)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        rows["problem"].append(COLOR_QUESTION)
        rows["answer"].append(color)
        rows["images"].append([{"bytes": buf.getvalue(), "path": None}])
    features = datasets.Features({"problem": datasets.Value("string"),
                                  "answer": datasets.Value("string"),
                                  "images": datasets.List(datasets.Image())})
    out_path = os.path.abspath(os.path.expanduser(out_path))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".parquet.tmp", dir=os.path.dirname(out_path))
    os.close(fd)
    try:
        datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp)
        os.replace(tmp, out_path)  # readers never see a half-written file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path


def demo_data(data_dir=None, n_train=2000, n_val=200):
    """(train_path, val_path) of the colour task; created once. Different seeds -> unseen val."""
    data_dir = os.path.expanduser(data_dir or "~/.cache/vlm_rl/color-v3")
    train = os.path.join(data_dir, f"train-{n_train}.parquet")
    val = os.path.join(data_dir, f"val-{n_val}.parquet")
    if not os.path.isfile(train):
        make_color_dataset(train, n_train, seed=0)
    if not os.path.isfile(val):
        make_color_dataset(val, n_val, seed=1)
    return train, val



COMPARE_PAIRS = [(a, b) for a in range(10) for b in range(a + 1, 10)]  # the 45 pairs of different digits


def make_compare_dataset(out_path: str, pairs, n_rows: int, seed: int) -> str:
    """Text-only rows (problem, answer; no images column) of the text demo's task, drawn from `pairs` (either order).
    The answer is uniform over the larger digits the pairs allow, so no constant answer pays (a tiny policy would
    otherwise settle on always saying 9). Written atomically."""
    import datasets
    rng = random.Random(seed)
    by_max = {}
    for a, b in pairs:
        by_max.setdefault(max(a, b), []).append((a, b))
    rows = {"problem": [], "answer": []}
    for _ in range(n_rows):
        a, b = rng.choice(by_max[rng.choice(sorted(by_max))])
        if rng.random() < 0.5:
            a, b = b, a
        rows["problem"].append(COMPARE_QUESTION.format(a=a, b=b))
        rows["answer"].append(str(max(a, b)))
    out_path = os.path.abspath(os.path.expanduser(out_path))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".parquet.tmp", dir=os.path.dirname(out_path))
    os.close(fd)
    try:
        datasets.Dataset.from_dict(rows).to_parquet(tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path


def demo_compare_data(data_dir=None, n_train=2000, n_val=200):
    """(train_path, val_path) of the text demo's task, "Which is larger, a or b?" for two different digits; created
    once. Validation draws fresh rows (another seed) from the same 90 questions: it measures the learned comparison
    on every question, not generalisation to unseen pairs (the tiny policy learns a table: holding 9 of the 45 pairs
    out of training, it answered 57% of them right while it answered the trained ones all right)."""
    data_dir = os.path.expanduser(data_dir or "~/.cache/vlm_rl/compare-v1")
    train, val = os.path.join(data_dir, f"train-{n_train}.parquet"), os.path.join(data_dir, f"val-{n_val}.parquet")
    if not os.path.isfile(train):
        make_compare_dataset(train, COMPARE_PAIRS, n_train, seed=0)
    if not os.path.isfile(val):
        make_compare_dataset(val, COMPARE_PAIRS, n_val, seed=1)
    return train, val
