"""Dataset loading and prompt encoding (EasyR1 data contract) + the synthetic colour and largest-digit tasks.

Rows follow EasyR1: a `problem` text (with optional `<image>` placeholders), an `answer` and an
`images` list. encode_prompt turns one row into the prompt record of the shared spec:
prompt_ids (image pads expanded, what the actor sees), raw_prompt_ids (one pad per image, what
vLLM expands itself), resized PIL images, processor outputs (mm_inputs), answer, prompt_text.
"""
import collections
import contextlib
import functools
import glob
import io
import math
import os
import random
import re
import sys
import tempfile
import time
import zlib

import torch
from PIL import Image, ImageDraw, UnidentifiedImageError

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
MAX_QUESTION = "What is the largest of {digits}?"
NUMBER_FORMAT_PROMPT = "{{ content }} Answer with a number."


class UserError(ValueError):
    """A mistake in what the user gave (an option, a file, a data row, a reward file). grpo.py and dapo.py print
    its message as one `error:` line (rank 0 only, unless rank_local: only the rank that raised it saw it) and exit
    with code 2, no traceback."""

    def __init__(self, message, rank_local=False):
        super().__init__(message)
        self.rank_local = rank_local


class BadRow(UserError):
    """A dataset row that cannot be trained on; `kind` is its reason's category (the data check counts them)."""

    def __init__(self, kind, detail=""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@contextlib.contextmanager
def one_line_errors():
    """Around a command line's work: a UserError ends the process with `error: <message>` and exit code 2, no
    traceback. The checks are deterministic, so every rank raises the same one and rank 0 speaks for them all;
    a rank_local one (a reward only this rank computed) is printed by the rank that raised it."""
    try:
        yield
    except UserError as e:
        import torch.distributed as dist
        if int(os.environ.get("RANK", "0")) == 0 or e.rank_local:
            from tqdm import tqdm
            for bar in list(tqdm._instances):
                bar.close()  # end the progress bar's line first
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(2)  # exiting first would let torchrun stop rank 0 before it prints
        if dist.is_initialized() and not e.rank_local:  # (the others may be inside a collective: just go)
            dist.destroy_process_group()
        sys.exit(2)


NO_PROMPT, NO_ANSWER, BAD_IMAGE, PLACEHOLDERS, TOO_LONG = (
    "no prompt", "no answer", "bad image", "placeholders != images", "prompt too long")


# ----------------------------------------------------------------------------- loading
def load_rows(source: str, split: str = "train"):
    """Rows from a hub dataset ("name" or "name@split"), a .parquet/.json/.jsonl file, or a
    folder of such files (split inferred from file names, like EasyR1). Images stay undecoded
    ({"bytes", "path"}) until encode_prompt: a bad one is then a row's error, not the loader's."""
    import datasets
    source, split = _split_source(source, split)
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        files = [f for f in sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
                 if os.path.splitext(f)[1] in DATA_EXTS]
        if not files:
            raise UserError(f"no .parquet/.json/.jsonl files in folder {path!r}")
        kinds = {DATA_EXTS[os.path.splitext(f)[1]] for f in files}
        if len(kinds) > 1:
            raise UserError(f"folder {path!r} mixes file types {sorted(kinds)}: keep one kind per folder")
        rows = datasets.load_dataset(kinds.pop(), data_dir=path, split=split)
    elif os.path.isfile(path):
        ext = os.path.splitext(path)[1]
        if ext not in DATA_EXTS:
            raise UserError(f"unsupported data file {path!r}: expected one of {sorted(DATA_EXTS)}")
        rows = datasets.load_dataset(DATA_EXTS[ext], data_files=path, split="train")
    elif not looks_like_hub_name(source):
        raise UserError(f"no such file or folder: {path!r}")
    else:
        try:
            rows = datasets.load_dataset(source, split=split)
        except Exception as e:  # hub errors are long: their first line, and the source that failed
            raise UserError(f"no such file or folder, and the hub could not load dataset {source!r} (split "
                            f"{split!r}): {first_line(e)}") from e
    return _undecoded_images(rows)


def _undecoded_images(rows):
    import datasets
    for key, feature in rows.features.items():
        inner = getattr(feature, "feature", None)  # List(Image()) holds the Image feature in .feature
        if isinstance(feature, datasets.Image) or isinstance(inner, datasets.Image):
            new = datasets.Image(decode=False)
            was_on = not datasets.utils.are_progress_bars_disabled()
            datasets.disable_progress_bars()  # no "Casting the dataset" bar for what is a metadata change
            try:
                rows = rows.cast_column(key, new if inner is None else datasets.List(new))
            finally:
                if was_on:
                    datasets.enable_progress_bars()
    return rows


def _split_source(source, split="train"):
    """"name@split" -> (name, split), unless the whole string is a path on disk."""
    if "@" in source and not os.path.exists(os.path.expanduser(source)):
        source, split = source.rsplit("@", 1)
    return source, split


def check_source(source: str, option: str):
    """A data source that is neither on disk nor shaped like a hub name ("org/name") is a missing path."""
    name = _split_source(source)[0]
    if source and not os.path.exists(os.path.expanduser(name)) and not looks_like_hub_name(name):
        raise UserError(f"{option} {source}: no such file or folder")


def looks_like_hub_name(name: str) -> bool:
    """"org/name" (the form a hub id has); anything else that is not on disk is a missing local path."""
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None and ".." not in name
            and os.path.splitext(name)[1] not in DATA_EXTS)


def first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def check_model_path(model_path: str):
    """A local folder must exist (transformers would say "Repo id must be in the form ..." instead); an
    "org/name" that is not on disk is a hub name, checked when the processor loads."""
    path = os.path.expanduser(model_path)
    if model_path and not os.path.exists(path) and not looks_like_hub_name(model_path):
        raise UserError(f"--model-path {model_path}: no such folder (give a local model folder or a hub name "
                        "like Qwen/Qwen2.5-VL-3B-Instruct)")
    if os.path.isfile(path):
        raise UserError(f"--model-path {model_path}: is a file; give the folder that holds config.json")


def load_processor(model_path: str, min_pixels: int | None = None, max_pixels: int | None = None):
    """AutoProcessor for VL models (a tokenizer for text-only ones). min/max_pixels, when given,
    replace the image processor's pixel budget (give vLLM the same via mm_processor_kwargs, or
    its image-token counts differ from ours). Without torchvision, transformers 5 cannot build
    Qwen-VL processors (the video and Auto image processors need it), so we assemble one from
    its parts with the PIL image backend."""
    import transformers
    check_model_path(model_path)
    try:
        proc = _processor_without_torchvision(model_path) or transformers.AutoProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as e:  # transformers' messages for a bad folder or hub name run to many lines
        raise UserError(f"--model-path {model_path}: could not load its tokenizer/processor ({first_line(e)}); "
                        "give a model folder (with config.json) or a hub name") from e
    ip = getattr(proc, "image_processor", None)
    if ip is not None and (min_pixels or max_pixels):
        lo = min_pixels or ip.size["shortest_edge"]
        hi = max_pixels or ip.size["longest_edge"]
        ip.size = {"shortest_edge": lo, "longest_edge": hi}  # transformers 5
        if hasattr(ip, "min_pixels"):  # transformers 4.x reads these (5 warns when they are set)
            ip.min_pixels, ip.max_pixels = lo, hi
    return proc


def _processor_without_torchvision(model_path):
    """Qwen2(.5)-VL's processor from its parts with the PIL image backend; None where AutoProcessor works."""
    import transformers
    from transformers.utils import is_torchvision_available
    names = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen2_vl": "Qwen2VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
    if is_torchvision_available():
        return None
    model_type = getattr(transformers.AutoConfig.from_pretrained(model_path), "model_type", None)
    if model_type not in names:
        return None
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    cls = getattr(transformers, names[model_type])
    proc = cls.__new__(cls)  # skips the __init__ check that demands a video processor
    proc.image_processor, proc.tokenizer, proc.video_processor = (
        (getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
         ).from_pretrained(model_path), tok, None)
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
        raise UserError(f"image dict has neither 'bytes' nor 'path': keys {sorted(item)}")
    if isinstance(item, (bytes, bytearray)):
        try:
            img = Image.open(io.BytesIO(item))
            img.load()
        except Exception as e:
            raise UserError(f"could not decode {len(item)} image bytes ({_pil_reason(e)})") from e
        return img.convert("RGB")
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item)
        if image_dir is not None and not os.path.isabs(path):
            path = os.path.join(image_dir, path)
        if not os.path.isfile(path):
            raise UserError(f"image file not found: {path!r}")
        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except Exception as e:
            raise UserError(f"could not decode image file {path!r} ({_pil_reason(e)})") from e
    raise UserError(f"unsupported image type {type(item).__name__}")


def _pil_reason(e):
    return "not an image format PIL can read" if isinstance(e, UnidentifiedImageError) else first_line(e)


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
    path = os.path.expanduser(format_prompt)
    if format_prompt.endswith(".jinja") or os.path.isfile(path):
        if not os.path.isfile(path):
            raise UserError(f"--format-prompt {format_prompt}: no such file")
        with open(path) as f:
            format_prompt = f.read()
    try:
        return jinja2.Template(format_prompt.strip())
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"--format-prompt: not a jinja template ({e.message}, line {e.lineno})") from e


def _user_content(text: str, n_images: int):
    """Split on <image> into chat content items; EasyR1 prepends images when there is none."""
    n_ph = text.count(IMAGE_PLACEHOLDER)
    if n_images == 0:
        if n_ph:
            raise BadRow(PLACEHOLDERS, f"{n_ph} '<image>' placeholder(s) but no images")
        return text
    if n_ph == 0:
        return [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    if n_ph != n_images:
        raise BadRow(PLACEHOLDERS, f"{n_ph} '<image>' placeholder(s) but {n_images} images")
    content = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            content.append({"type": "image"})
        if piece:
            content.append({"type": "text", "text": piece})
    return content


def _prompt_parts(row: dict, proc, prompt_key="problem", answer_key="answer", image_key="images",
                  image_dir=None, format_prompt: str | None = None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """Everything a row must pass, then (chat text with one pad per image, resized images, answer, prompt text).
    A bad row raises BadRow; a mistake that no row can pass (a text model given images) a plain UserError."""
    prompt, answer = row.get(prompt_key), row.get(answer_key)
    if prompt is None or not str(prompt).strip():
        raise BadRow(NO_PROMPT, f"{prompt_key!r} is {prompt!r}")
    if answer is None or (isinstance(answer, float) and math.isnan(answer)) or not str(answer).strip():
        raise BadRow(NO_ANSWER, f"{answer_key!r} is {answer!r}")  # None would train as the string 'None'
    text = str(prompt)
    if format_prompt:
        text = _template(format_prompt).render(content=text)
    raw_images = row.get(image_key) or []
    if raw_images and not hasattr(proc, "image_processor"):
        raise UserError(f"rows have images ({image_key!r}) but the model has a tokenizer, no image processor "
                        "(a text LLM?): use a VL model, or data without images")
    images = []
    for k, im in enumerate(raw_images):
        try:
            images.append(resize_image(to_pil(im, image_dir), min_pixels, max_pixels))
        except UserError as e:
            raise BadRow(BAD_IMAGE, f"image {k}: {e}") from e
    messages = [{"role": "user", "content": _user_content(text, len(images))}]
    # No system message: the chat template inserts its default system prompt.
    templated = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return templated, images, str(answer), text


def encode_prompt(row: dict, processor_or_tokenizer, prompt_key="problem", answer_key="answer",
                  image_key="images", image_dir=None, format_prompt: str | None = None,
                  min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS) -> dict:
    """One dataset row -> prompt record (see the spec). The processor runs once per prompt."""
    proc = processor_or_tokenizer
    tok = getattr(proc, "tokenizer", proc)  # a processor wraps a tokenizer; a tokenizer is one
    templated, images, answer, text = _prompt_parts(row, proc, prompt_key, answer_key, image_key, image_dir,
                                                    format_prompt, min_pixels, max_pixels)
    raw_prompt_ids = tok.encode(templated, add_special_tokens=False)
    if images:
        enc = proc(text=[templated], images=images, return_tensors="pt", add_special_tokens=False)
        prompt_ids = enc["input_ids"][0].tolist()
        mm_inputs = {k: v for k, v in enc.items()  # pixel_values [P, D], image_grid_thw [I, 3]
                     if k not in TOKEN_KEYS and isinstance(v, torch.Tensor)}
    else:
        prompt_ids, mm_inputs = list(raw_prompt_ids), {}
    return {"prompt_ids": prompt_ids, "raw_prompt_ids": raw_prompt_ids, "images": images,
            "mm_inputs": mm_inputs, "answer": answer, "prompt_text": text}


def prompt_length(row: dict, proc, **encode_kwargs) -> int:
    """len(encode_prompt(row)["prompt_ids"]) at a third of the cost: each image's one pad becomes the number of
    tokens the image processor gives an image of its size, without processing its pixels."""
    templated, images, _, _ = _prompt_parts(row, proc, **encode_kwargs)
    n = len(getattr(proc, "tokenizer", proc).encode(templated, add_special_tokens=False))
    try:
        ip = proc.image_processor if images else None
        return n + sum(ip.get_number_of_image_patches(im.height, im.width, {}) // ip.merge_size**2 - 1
                       for im in images)
    except (AttributeError, NotImplementedError):  # a processor that cannot count: encode for real
        return len(encode_prompt(row, proc, **encode_kwargs)["prompt_ids"])


def check_rows(rows, processor_or_tokenizer, max_prompt_length=None, **encode_kwargs):
    """Read every row. Returns [(row number in the source, kind, message)] for each one that cannot be used, in
    order; a prompt longer than max_prompt_length is one (kind TOO_LONG: the caller drops it or stops)."""
    columns = getattr(rows, "column_names", None)
    for key, option in ((encode_kwargs.get("prompt_key", "problem"), "--prompt-key"),
                        (encode_kwargs.get("answer_key", "answer"), "--answer-key")):
        if columns is not None and key not in columns:
            raise UserError(f"{option} {key}: no such column (the columns are {columns})")
    problems = []
    for i in range(len(rows)):
        try:
            n = prompt_length(rows[i], processor_or_tokenizer, **encode_kwargs)
        except BadRow as e:
            problems.append((i, e.kind, str(e)))
            continue
        if max_prompt_length is not None and n > max_prompt_length:
            problems.append((i, TOO_LONG, f"{TOO_LONG}: {n} tokens > --max-prompt-length {max_prompt_length}"))
    return problems


def describe_problems(problems, limit=None) -> str:
    """One line per bad row (at most `limit`), then the count of each reason."""
    lines = [f"  row {i}: {msg}" for i, _, msg in problems[:limit]]
    if limit is not None and len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    return "\n".join(lines + [f"  counts: {count_kinds(problems)}"])


def count_kinds(problems) -> str:
    return ", ".join(f"{k} {c}" for k, c in collections.Counter(kind for _, kind, _ in problems).items())


def row_list(problems, limit=20) -> str:
    rows = [str(i) for i, _, _ in problems]
    return ", ".join(rows[:limit]) + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


class PromptDataset:
    """Index-based access to encoded prompts (the trainer shuffles indices itself, so resuming
    is exact). Every row is checked up front (check_rows): bad ones stop the run with the list of
    them unless skip_bad_rows; rows longer than max_prompt_length are dropped when filter_overlong
    (EasyR1's filter_overlong_prompts), bad otherwise. `notes` says what was dropped."""

    def __init__(self, source, processor_or_tokenizer, split="train", max_prompt_length=None,
                 filter_overlong=True, skip_bad_rows=False, option="data", **encode_kwargs):
        where = f"{option} {source if isinstance(source, str) else '(rows)'}"
        try:
            self.rows = load_rows(source, split) if isinstance(source, str) else source
            problems = check_rows(self.rows, processor_or_tokenizer, max_prompt_length, **encode_kwargs)
        except UserError as e:
            raise UserError(f"{where}: {e}") from e
        self.processor = processor_or_tokenizer
        self.encode_kwargs = encode_kwargs
        dropped = [p for p in problems if filter_overlong and p[1] == TOO_LONG]
        bad = [p for p in problems if not (filter_overlong and p[1] == TOO_LONG)]
        if bad and not skip_bad_rows:
            hint = (" (raise --max-prompt-length, or drop them with --filter-overlong-prompts)"
                    if any(k == TOO_LONG for _, k, _ in bad) else "")
            raise UserError(f"{where}: {len(bad)} of {len(self.rows)} rows cannot be used (row numbers count "
                            f"from 0 in the source){hint}:\n{describe_problems(bad, limit=20)}\nfix them, or pass "
                            "--skip-bad-rows to drop them; `python data.py check` takes the same options")
        self.notes = []
        if bad:
            self.notes.append(f"{where}: skipped {len(bad)} bad rows (--skip-bad-rows; {count_kinds(bad)}): rows "
                              f"{row_list(bad)}")
        if dropped:
            self.notes.append(f"{where}: dropped {len(dropped)} prompts longer than --max-prompt-length "
                              f"{max_prompt_length} (--filter-overlong-prompts): rows {row_list(dropped)}")
        skip = {i for i, _, _ in problems}  # each one is dropped or skipped by now (or the run has stopped)
        self.indices = [i for i in range(len(self.rows)) if i not in skip]
        if not self.indices:
            raise UserError(f"{where}: no usable rows ({len(dropped)} too long, {len(bad)} bad)")

    def encode_row(self, row_index: int) -> dict:
        try:
            return encode_prompt(self.rows[row_index], self.processor, **self.encode_kwargs)
        except UserError as e:
            raise UserError(f"dataset row {row_index}: {e}") from e

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



def max_question(rng: random.Random, lengths=(3, 4, 5)) -> tuple[str, str]:
    """One question of the text demo's task and its answer: the largest of k digits (k drawn from lengths), which
    occurs once. The answer is drawn first, uniformly from 2 to 9, so no constant answer pays more than 1/8; the
    other digits are drawn below it (repeats allowed: even the answer 2 then has 124 lists, enough to hold some out
    for validation), and the largest sits at a uniform place, so copying any one place pays 1/k."""
    k = rng.choice(lengths)
    top = rng.randint(2, 9)
    digits = [rng.randrange(top) for _ in range(k - 1)]
    digits.insert(rng.randrange(k), top)
    return MAX_QUESTION.format(digits=", ".join(map(str, digits))), str(top)


def is_val_question(question: str) -> bool:
    """Which side of the split a question is on: a tenth of all questions (by a hash of the text) belong to
    validation and are never drawn for training. A hash rather than "whatever validation happened to draw": both
    sides keep the task's answer distribution (excluding validation's draws would thin out the small answers,
    whose few lists validation's rows would nearly exhaust)."""
    return zlib.crc32(question.encode()) % 10 == 0


def make_max_dataset(out_path: str, n_rows: int, seed: int, split="train", lengths=(3, 4, 5)) -> str:
    """Text-only rows (problem, answer; no images column) of the text demo's task, drawn from `split`'s side of the
    question space only (is_val_question); validation's rows are all different questions. Written atomically."""
    import datasets
    rng = random.Random(seed)
    rows = {"problem": [], "answer": []}
    while len(rows["problem"]) < n_rows:
        question, answer = max_question(rng, lengths)
        if is_val_question(question) == (split == "val") and not (split == "val" and question in rows["problem"]):
            rows["problem"].append(question)
            rows["answer"].append(answer)
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


def demo_max_data(data_dir=None, n_train=4000, n_val=200):
    """(train_path, val_path) of the text demo's task, "What is the largest of 3, 8, 1, 5?" (3 to 5 digits: 85,608
    lists); created once. Validation and training come from disjoint tenths and nine tenths of the question space
    (is_val_question), and every call checks it: validation measures the learned maximum on lists the policy never
    trained on."""
    data_dir = os.path.expanduser(data_dir or "~/.cache/vlm_rl/max-v2")
    train, val = os.path.join(data_dir, f"train-{n_train}.parquet"), os.path.join(data_dir, f"val-{n_val}.parquet")
    if not os.path.isfile(val):
        make_max_dataset(val, n_val, seed=1, split="val")
    if not os.path.isfile(train):
        make_max_dataset(train, n_train, seed=0, split="train")
    seen = set(load_rows(val)["problem"]) & set(load_rows(train)["problem"])  # the cached files too, every time
    if seen:
        raise UserError(f"{len(seen)} validation questions occur in {train} (e.g. {min(seen)!r}): validation would "
                        f"not be unseen; delete {data_dir} to have it made again")
    return train, val


# ----------------------------------------------------------------------------- python data.py check
DATA_OPTIONS = ("model_path", "train_files", "val_files", "prompt_key", "answer_key", "image_key", "image_dir",
                "format_prompt", "min_pixels", "max_pixels", "max_prompt_length", "filter_overlong_prompts")


def check_main(argv) -> int:
    """`python data.py check [grpo.py's data options]`: reads every row of --train-files and --val-files (the demo's
    colour task when empty) and prints each bad one with its row number in the source and the reason, then the
    counts. Returns 2 when a row is bad, 0 otherwise; --model-path's tokenizer counts the prompt tokens."""
    import dataclasses
    from typing import Annotated

    import tyro

    import grpo

    def field(f, marker):  # grpo's option as it is there; the help text grpo.py --help shows (tyro reads comments)
        try:
            marker = marker or tyro.conf.arg(help=tyro._docstrings.get_field_docstring(grpo.Config, f.name, ()))
        except Exception:  # a private helper of tyro: without it the options lose their help, not their use
            marker = tyro.conf.arg()
        return (f.name, Annotated[f.type, marker], dataclasses.field(default=f.default) if f.default is not
                dataclasses.MISSING else dataclasses.field(default_factory=f.default_factory))
    fields = [field(f, None if f.name in DATA_OPTIONS else tyro.conf.Suppress) for f in dataclasses.fields(grpo.Config)]
    Check = dataclasses.make_dataclass("CheckConfig", fields, bases=(grpo.Config,))
    kw = dict(args=argv, prog="data.py check", description=" ".join(check_main.__doc__.split()))
    cfg = tyro.cli(Check, **kw)
    if not cfg.model_path:  # the demo: its data defaults, as grpo.py applies them (a flag still wins)
        demo = {k: v for k, v in grpo.DEMO.items() if k in DATA_OPTIONS}
        cfg = tyro.cli(Check, default=dataclasses.replace(Check(), **demo), **kw)
    check_model_path(cfg.model_path)
    import tiny_model
    model_path = cfg.model_path or tiny_model.build_tiny_model()
    sources, fmt = [("--train-files", cfg.train_files), ("--val-files", cfg.val_files)], cfg.format_prompt
    if not cfg.train_files:
        sources = list(zip(("--train-files", "--val-files"), demo_data()))
        fmt = DEMO_FORMAT_PROMPT if fmt is None else fmt
    proc = load_processor(model_path, cfg.min_pixels, cfg.max_pixels)
    kw = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, image_key=cfg.image_key,
              image_dir=cfg.image_dir, format_prompt=fmt, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    any_bad = False
    for option, source in sources:
        if not source:
            continue
        try:
            rows = load_rows(source)
            problems = check_rows(rows, proc, cfg.max_prompt_length, **kw)
        except UserError as e:
            raise UserError(f"{option} {source}: {e}") from e
        dropped = [p for p in problems if cfg.filter_overlong_prompts and p[1] == TOO_LONG]
        bad = [p for p in problems if p not in dropped]
        any_bad |= bool(bad)
        print(f"{option} {source}: {len(rows)} rows, " + (f"{len(bad)} bad (row numbers count from 0 in the source)"
                                                          if bad else "none bad"))
        if bad:
            print(describe_problems(bad))
        if dropped:
            print(f"  {len(dropped)} prompts longer than --max-prompt-length {cfg.max_prompt_length} are dropped "
                  f"(--filter-overlong-prompts): rows {row_list(dropped, limit=len(dropped))}")
    if any_bad:
        print("fix the rows above, or train with --skip-bad-rows to drop them")
    return 2 if any_bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["check"]:
        print("usage: python data.py check [--train-files ... --val-files ... --model-path ... (grpo.py's data "
              "options; --help lists them)]", file=sys.stderr)
        sys.exit(2)
    with one_line_errors():
        sys.exit(check_main(sys.argv[2:]))
