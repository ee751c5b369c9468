"""Dataset loading and prompt encoding (EasyR1's data contract: `problem` with `<image>` / `<video>` placeholders,
`answer`, `images`, `videos`), the synthetic tasks' rows, and the prompt stream: draw_prompts (seeded epoch shuffles,
a function of its cursor); take_prompts and prefetch_prompts (a step's share, drawn on a thread meanwhile)."""
import collections
import dataclasses
import functools
import glob
import math
import os
import re
import sys
import threading
import time
import types
from typing import Annotated

import jinja2
import torch
import torch.distributed as dist
import tyro
from PIL import Image

import families
import tiny_model
import video
from common import MAX_PIXELS, MIN_PIXELS, UserError, first_line, one_line_errors
from config import Config
from video import to_pil

IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER = "<image>", "<video>"
# the processor's per-token outputs: rebuilt with the full (prompt + response) sequence, not a prompt's mm_inputs
TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
DATA_EXTS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}


class BadRow(UserError):
    """A dataset row that cannot be trained on; `kind` is its reason's category (the data check counts them)."""

    def __init__(self, kind, detail=""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


NO_PROMPT, NO_ANSWER, BAD_IMAGE, PLACEHOLDERS, TOO_LONG = (
    "no prompt", "no answer", "bad image", "placeholders != images", "prompt too long")
BAD_VIDEO, VIDEO_PLACEHOLDERS = "bad video", "placeholders != videos"


# ----------------------------------------------------------------------------- loading
def load_rows(source: str, split: str = "train"):
    """Rows from a hub dataset ("name" or "name@split"), a .parquet/.json/.jsonl file, or a folder of such files (the
    split from file names, as EasyR1). Images stay undecoded until encode_prompt: a bad one is a row's error."""
    import datasets  # slow to import (~2 s): only where data are read or written
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
    import datasets  # slow to import (~2 s): only where data are read or written
    def undecoded(feature):  # Image, List(Image) (images) or List(List(Image)) (videos as frames) -> decode=False
        if isinstance(feature, datasets.Image):
            return datasets.Image(decode=False)
        inner = getattr(feature, "feature", None)  # a List holds its element's feature in .feature
        new = undecoded(inner) if inner is not None else None
        return datasets.List(new) if new is not None else None
    for key, feature in rows.features.items():
        if (new := undecoded(feature)) is not None:
            was_on = not datasets.utils.are_progress_bars_disabled()
            datasets.disable_progress_bars()  # no "Casting the dataset" bar for what is a metadata change
            try:
                rows = rows.cast_column(key, new)
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
    """AutoProcessor for VL models (a tokenizer for text-only ones). min/max_pixels replace the image processor's pixel
    budget (vLLM gets the same via mm_processor_kwargs). Without torchvision, transformers 5 builds no video processor:
    the processor comes without one (families.processor_without_video; video.py makes the frames)."""
    import transformers  # slow to import (~2 s): only where a model or processor loads
    from transformers.utils import is_torchvision_available  # (likewise)
    check_model_path(model_path)
    try:
        proc = (transformers.AutoProcessor.from_pretrained(model_path) if is_torchvision_available()
                else families.processor_without_video(model_path))
    except (OSError, ValueError) as e:  # transformers' messages for a bad folder or hub name run to many lines
        raise UserError(f"--model-path {model_path}: could not load its tokenizer/processor ({first_line(e)}); "
                        "give a model folder (with config.json) or a hub name") from e
    ip = getattr(proc, "image_processor", None)
    if hasattr(ip, "merge_size") and (min_pixels or max_pixels):  # Qwen-VL's budget (other families: their own)
        lo, hi = min_pixels or ip.size["shortest_edge"], max_pixels or ip.size["longest_edge"]
        ip.size = {"shortest_edge": lo, "longest_edge": hi}  # transformers 5
        if hasattr(ip, "min_pixels"):  # transformers 4.x reads these (5 warns when they are set)
            ip.min_pixels, ip.max_pixels = lo, hi
    return proc


# ----------------------------------------------------------------------------- images
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


def _user_content(text: str, n_images: int, n_videos: int = 0):
    """Split on <image> and <video> into chat content items. Each kind's placeholders must match its items in number;
    with none in the text the items go first (EasyR1 prepends images; videos are treated the same way)."""
    counts = {}
    for ph, n, kind, what in ((IMAGE_PLACEHOLDER, n_images, PLACEHOLDERS, "images"),
                              (VIDEO_PLACEHOLDER, n_videos, VIDEO_PLACEHOLDERS, "videos")):
        n_ph = text.count(ph)
        if n_ph and n_ph != n:
            raise BadRow(kind, f"{n_ph} '{ph}' placeholder(s) but {n or 'no'} {what}")
        counts[ph] = n_ph
    if not n_images and not n_videos:
        return text
    content = ([{"type": "image"}] * n_images * (counts[IMAGE_PLACEHOLDER] == 0)
               + [{"type": "video"}] * n_videos * (counts[VIDEO_PLACEHOLDER] == 0))
    for piece in re.split(f"({IMAGE_PLACEHOLDER}|{VIDEO_PLACEHOLDER})", text):
        if piece in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER):
            content.append({"type": "image" if piece == IMAGE_PLACEHOLDER else "video"})
        elif piece:
            content.append({"type": "text", "text": piece})
    return content


def _prompt_parts(row: dict, proc, prompt_key="problem", answer_key="answer", image_key="images", image_dir=None,
                  format_prompt: str | None = None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, video_key="videos",
                  video_fps=2.0, max_frames=768, video_min_pixels=None, video_max_pixels=None, tools=None):
    """Everything a row must pass, then (chat text with one pad per image and video, resized images, prepared videos,
    their frame rates, answer, prompt text). A bad row raises BadRow; what no row can pass a plain UserError."""
    prompt, answer = row.get(prompt_key), row.get(answer_key)
    if prompt is None or not str(prompt).strip():
        raise BadRow(NO_PROMPT, f"{prompt_key!r} is {prompt!r}")
    if answer is None or (isinstance(answer, float) and math.isnan(answer)) or not str(answer).strip():
        raise BadRow(NO_ANSWER, f"{answer_key!r} is {answer!r}")  # None would train as the string 'None'
    text = str(prompt)
    if format_prompt:
        text = _template(format_prompt).render(content=text)
    raw_images, raw_videos = row.get(image_key) or [], row.get(video_key) or []
    for raw, key in ((raw_images, image_key), (raw_videos, video_key)):
        if raw and not hasattr(proc, "image_processor"):
            raise UserError(f"rows have {key} ({key!r}) but the model has a tokenizer, no image processor "
                            f"(a text LLM?): use a VL model, or data without {key}")
    if raw_videos and not hasattr(proc.image_processor, "merge_size"):
        raise UserError(f"rows have videos ({video_key!r}): videos train with the Qwen-VL families only (Qwen2-VL, "
                        "Qwen2.5-VL, Qwen3-VL, Qwen3.5); other families take images")
    own = getattr(proc, "image_token", None)  # the family's own placeholder (<|image_pad|>, <|image|>, ...)
    if own and own in text:
        raise BadRow(PLACEHOLDERS, f"the text holds {own!r}, the model's own image token: mark images with <image>")
    images, videos, fps = [], [], []
    for k, im in enumerate(raw_images):
        try:
            images.append(resize_image(to_pil(im, image_dir), min_pixels, max_pixels))
        except UserError as e:
            raise BadRow(BAD_IMAGE, f"image {k}: {e}") from e
    for k, v in enumerate(raw_videos):
        try:
            frames, f = video.load_video(v, image_dir, video_fps, max_frames)
            videos.append(video.prepare_video(frames, proc, video_min_pixels or min_pixels,
                                             video_max_pixels or max_pixels))
            fps.append(f)
        except UserError as e:
            raise BadRow(BAD_VIDEO, f"video {k}: {e}") from e
    messages = [{"role": "user", "content": _user_content(text, len(images), len(videos))}]
    # No system message: the chat template inserts its default system prompt.
    templated = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,  # tools: their schemas
                                         **({"tools": tools} if tools else {}))
    return templated, images, videos, fps, str(answer), text


def encode_prompt(row: dict, processor_or_tokenizer, **encode_kwargs) -> dict:
    """One dataset row -> its prompt record, shared by the prompt's n samples: prompt_ids (pads expanded: the model's
    tokens), raw_prompt_ids (one pad per image or video: vLLM expands them), images, videos and video_fps, mm_inputs
    (the processor's tensors; {} for text), answer, prompt_text. encode_kwargs: _prompt_parts' options."""
    proc = processor_or_tokenizer
    tok = getattr(proc, "tokenizer", proc)  # a processor wraps a tokenizer; a tokenizer is one
    templated, images, videos, fps, answer, text = _prompt_parts(row, proc, **encode_kwargs)
    raw_prompt_ids = tok.encode(templated, add_special_tokens=False)
    prompt_ids, mm_inputs = list(raw_prompt_ids), {}
    if images and not videos:
        enc = proc(text=[templated], images=images, return_tensors="pt", add_special_tokens=False)
        prompt_ids = enc["input_ids"][0].tolist()
        mm_inputs = {k: v for k, v in enc.items()  # pixel_values [P, D], image_grid_thw [I, 3]
                     if k not in TOKEN_KEYS and isinstance(v, torch.Tensor)}
    elif images:  # the processor refuses video pads without its videos: the image processor, and the pads by hand
        mm_inputs = dict(proc.image_processor(images=images, return_tensors="pt"))
        merge = proc.image_processor.merge_size
        sizes = iter((mm_inputs["image_grid_thw"].prod(-1) // merge ** 2).tolist())  # tokens per image
        pad = tok.convert_tokens_to_ids("<|image_pad|>")
        prompt_ids = [x for t in prompt_ids for x in ([pad] * next(sizes) if t == pad else [t])]
    if videos:  # pixel_values_videos [P', D], video_grid_thw [V, 3] (+ second_per_grid_ts [V])
        mm_inputs.update(video.video_inputs(videos, fps, proc))
        prompt_ids = video.expand_video_pads(prompt_ids, mm_inputs["video_grid_thw"].tolist(), fps, proc)
    return {"prompt_ids": prompt_ids, "raw_prompt_ids": raw_prompt_ids, "images": images, "videos": videos,
            "video_fps": fps, "mm_inputs": mm_inputs, "answer": answer, "prompt_text": text}


def prompt_length(row: dict, proc, **encode_kwargs) -> int:
    """len(encode_prompt(row)["prompt_ids"]) at a third of the cost: each image's pad becomes the count of tokens the
    image processor gives an image of its size, without its pixels (videos: from their frame counts and sizes)."""
    templated, images, videos, fps, _, _ = _prompt_parts(row, proc, **encode_kwargs)
    n = len(getattr(proc, "tokenizer", proc).encode(templated, add_special_tokens=False))
    if videos:
        patch, tps, _, _, _ = video.vision_params(proc)
        grids = [[len(v) // tps, v.shape[1] // patch, v.shape[2] // patch] for v in videos]
        pad = getattr(proc, "tokenizer", proc).convert_tokens_to_ids("<|video_pad|>")
        n += len(video.expand_video_pads([pad] * len(videos), grids, fps, proc)) - len(videos)
    try:
        ip = proc.image_processor if images else None
        return n + sum(ip.get_number_of_image_patches(im.height, im.width, {}) // ip.merge_size**2 - 1 for im in images)
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
    """Index-based access to encoded prompts (exact resume). Every row is checked up front: bad ones stop the run
    unless skip_bad_rows; rows over max_prompt_length dropped when filter_overlong, else bad. `notes`: what dropped."""

    def __init__(self, source, processor_or_tokenizer, split="train", max_prompt_length=None,
                 filter_overlong=True, skip_bad_rows=False, option="data", **encode_kwargs):
        self.source = source if isinstance(source, str) else "(rows)"
        where = f"{option} {self.source}"
        try:
            self.rows = load_rows(source, split) if isinstance(source, str) else source
            problems = check_rows(self.rows, processor_or_tokenizer, max_prompt_length, **encode_kwargs)
        except UserError as e:
            raise UserError(f"{where}: {e}") from e
        self.processor, self.encode_kwargs = processor_or_tokenizer, encode_kwargs
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

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        try:
            return encode_prompt(self.rows[self.indices[i]], self.processor, **self.encode_kwargs)
        except UserError as e:
            raise UserError(f"dataset row {self.indices[i]}: {e}") from e


def draw_prompts(dataset, cursor, count, rank, world, seed, shuffle=True):
    """`count` prompts (all ranks together) from an endless stream of seeded epoch shuffles of `dataset` at `cursor`
    -> this rank's share as (stream position, record): a function of the cursor (exact resume, any rank count)."""
    N, per = len(dataset), count // world
    out = []
    for pos in range(cursor + rank * per, cursor + (rank + 1) * per):
        epoch, k = divmod(pos, N)
        out.append((pos, dataset[int(_epoch_perm(N, seed + epoch)[k]) if shuffle else k]))
    return out


def take_prompts(ctx, count):
    """This rank's share of the `count` prompts at the stream's cursor (ctx: grpo's State), which then moves past
    them: prefetch_prompts' when it drew these, else drawn here (the same records: exact resume)."""
    t = time.time()
    ahead, ctx.prefetch = ctx.prefetch, None
    if ahead is not None:
        ahead.thread.join()  # (a stale one too: never two threads encoding at once)
    if ahead is not None and (ahead.cursor, ahead.count) == (ctx.cursor, count):
        if "error" in ahead.box:
            raise ahead.box["error"]  # a bad row: the error the draw here would have raised
        drawn = ahead.box["drawn"]
    else:
        drawn = draw_prompts(ctx.train, ctx.cursor, count, ctx.rank, ctx.world, ctx.cfg.seed, ctx.cfg.shuffle)
    ctx.cursor += count
    ctx.prefetch_count = count
    ctx.prompt_seconds += time.time() - t
    return drawn


def prefetch_prompts(ctx, submit=None):
    """Start drawing the next step's prompts on a thread (encoding would otherwise idle the GPU at the next generation's
    start); submit(drawn) hands them to the engine. train_step waits for it before the step ends."""
    cursor, count, box = ctx.cursor, ctx.prefetch_count or ctx.cfg.rollout_batch_size, {}

    def draw():
        try:
            box["drawn"] = draw_prompts(ctx.train, cursor, count, ctx.rank, ctx.world, ctx.cfg.seed, ctx.cfg.shuffle)
            if submit is not None:
                if ctx.device.type == "cuda":
                    torch.cuda.set_device(ctx.device)  # (a thread starts on device 0)
                submit(box["drawn"])
        except BaseException as e:  # raised where the prompts are taken, as a draw there would
            box["error"] = e
    thread = threading.Thread(target=draw, name="prefetch_prompts", daemon=True)
    thread.start()
    ctx.prefetch = types.SimpleNamespace(cursor=cursor, count=count, thread=thread, box=box)


@functools.lru_cache(maxsize=2)  # the current epoch (and the next, while a batch straddles them)
def _epoch_perm(N, seed):
    return torch.randperm(N, generator=torch.Generator().manual_seed(seed))


def is_text_demo(demo_model):
    """--demo-model names a text-only model (its own task and reward: the largest digit)."""
    return demo_model in tiny_model.TEXT_ARCHS


def data_files(cfg):
    """(train files, validation files, format prompt) of cfg's data options; the demo's synthetic task (written on
    first use) when --train-files is empty: the largest digit for the text demo, clips or pictures for the VL ones."""
    if cfg.train_files:
        return cfg.train_files, cfg.val_files, cfg.format_prompt
    text = not cfg.model_path and is_text_demo(cfg.demo_model)
    zoom = not text and cfg.demo_task == "zoom"  # the task that needs its tool (tools.py)
    make = (tiny_model.demo_max_data if text else tiny_model.demo_video_data if cfg.demo_task == "video" else
            tiny_model.demo_zoom_data if zoom else tiny_model.demo_data)
    fmt = (tiny_model.NUMBER_FORMAT_PROMPT if text else tiny_model.ZOOM_FORMAT_PROMPT if zoom else
           tiny_model.DEMO_FORMAT_PROMPT)
    return (*make(), cfg.format_prompt if cfg.format_prompt is not None else fmt)


def load_datasets(cfg, model_path, say=print, tools=None):
    """grpo.py's data: the processor (or tokenizer) of model_path and the train and validation PromptDatasets (rank 0
    writes a demo's task, the others wait); every row checked here, before the model loads, alike on every rank."""
    if dist.get_rank() == 0:
        data_files(cfg)
    dist.barrier()
    train_files, val_files, fmt = data_files(cfg)
    processor = load_processor(model_path, cfg.min_pixels, cfg.max_pixels)
    kw = dict(processor_or_tokenizer=processor, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
              image_key=cfg.image_key, image_dir=cfg.image_dir, format_prompt=fmt, min_pixels=cfg.min_pixels,
              max_pixels=cfg.max_pixels, max_prompt_length=cfg.max_prompt_length, **video.video_options(cfg),
              filter_overlong=cfg.filter_overlong_prompts, skip_bad_rows=cfg.skip_bad_rows,
              tools=tools)  # the tools' JSON schemas (tools.schemas; None: none) go into the chat template
    train = PromptDataset(train_files, option="--train-files", **kw)
    val = PromptDataset(val_files, option="--val-files", **kw) if val_files else None
    for note in train.notes + (val.notes if val else []):
        say(note)
    if len(train) < cfg.rollout_batch_size:
        raise UserError(f"--train-files {train.source}: {len(train)} usable prompts < --rollout-batch-size "
                        f"{cfg.rollout_batch_size}; lower --rollout-batch-size or add data")
    return processor, train, val


# ----------------------------------------------------------------------------- python data.py check
DATA_OPTIONS = ("model_path", "train_files", "val_files", "prompt_key", "answer_key", "image_key", "image_dir",
                "format_prompt", "min_pixels", "max_pixels", "max_prompt_length", "filter_overlong_prompts",
                "video_key", "video_fps", "max_frames", "video_min_pixels", "video_max_pixels", "demo_task")


def check_main(argv) -> int:
    """`python data.py check [grpo.py's data options]`: every row of --train-files and --val-files, each bad one
    printed with its row number and reason, then the counts. Returns 2 when a row is bad, else 0."""
    def field(f, marker):  # grpo's option as it is there; the help text grpo.py --help shows (tyro reads comments)
        try:
            marker = marker or tyro.conf.arg(help=tyro._docstrings.get_field_docstring(Config, f.name, ()))
        except Exception:  # a private helper of tyro: without it the options lose their help, not their use
            marker = tyro.conf.arg()
        return (f.name, Annotated[f.type, marker], dataclasses.field(default=f.default) if f.default is not
                dataclasses.MISSING else dataclasses.field(default_factory=f.default_factory))
    fields = [field(f, None if f.name in DATA_OPTIONS else tyro.conf.Suppress) for f in dataclasses.fields(Config)]
    Check = dataclasses.make_dataclass("CheckConfig", fields, bases=(Config,))
    kw = dict(args=argv, prog="data.py check", description=" ".join(check_main.__doc__.split()))
    cfg = tyro.cli(Check, **kw)
    if not cfg.model_path:  # the demo: its data defaults, as grpo.py applies them (a flag still wins)
        demo = {k: v for k, v in tiny_model.DEMO.items() if k in DATA_OPTIONS}
        cfg = tyro.cli(Check, default=dataclasses.replace(Check(), **demo), **kw)
    check_model_path(cfg.model_path)
    model_path = cfg.model_path or tiny_model.build_tiny_model(arch=cfg.demo_model)
    train_files, val_files, fmt = data_files(cfg)
    proc = load_processor(model_path, cfg.min_pixels, cfg.max_pixels)
    kw = dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, image_key=cfg.image_key, image_dir=cfg.image_dir,
              format_prompt=fmt, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, **video.video_options(cfg))
    any_bad = False
    for option, source in (("--train-files", train_files), ("--val-files", val_files)):
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
