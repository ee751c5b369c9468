"""video.py -- video inputs for data.py: a video file (PyAV, optional) or a list of frames -> sampled, resized frames
-> the Qwen-VL processor's video outputs and the prompt's video tokens; and the decoding of any image form (to_pil).
The Qwen-VL video processors need torchvision (not on the CPU box) and vLLM runs them itself from frames: the
trainer's side is done here, in their layout, on frames those processors leave unchanged."""
import io
import math
import os

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from common import UserError, first_line


# ----------------------------------------------------------------------------- images (a video's frames are images)
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


# ----------------------------------------------------------------------------- videos
# A video reaches the model as frames sampled here (a file at --video-fps, at most --max-frames), resized to the size
# the Qwen-VL video processor would pick and padded to an even count: both engines and the trainer get these exact
# frames (the processors' own resize leaves them), so vLLM's video tokens and positions are the trainer's.
MIN_FRAMES = 4  # qwen-vl-utils' FPS_MIN_FRAMES: a short file still gives 4 frames when it has them


def load_video(item, image_dir=None, fps=2.0, max_frames=768):
    """A video file path or a list of frames (any image form) -> (frames as RGB PIL images, frames per second)."""
    if isinstance(item, dict) and item.get("path") and not item.get("bytes"):
        item = item["path"]
    if isinstance(item, (str, os.PathLike)):
        return _decode_video_file(os.fspath(item), image_dir, fps, max_frames)
    if not isinstance(item, (list, tuple)) or isinstance(item, (bytes, bytearray)):
        raise UserError(f"a video is a file path or a list of frames, got {type(item).__name__}")
    if not item:
        raise UserError("a video with no frames")
    frames = [to_pil(f, image_dir) for f in item]
    if len(frames) > max_frames:  # keep max_frames of them, evenly spread: they are then further apart in time
        keep = [round(i * (len(frames) - 1) / (max_frames - 1)) if max_frames > 1 else 0 for i in range(max_frames)]
        fps = fps * len(keep) / len(frames)
        frames = [frames[i] for i in keep]
    return frames, float(fps)


def _decode_video_file(path, image_dir, fps, max_frames):
    """PyAV (optional: only video files need it). Frame choice as qwen-vl-utils: `fps` frames per second of the
    file, at least MIN_FRAMES and at most max_frames, an even count, evenly spread; the frame rate of what is kept."""
    if image_dir is not None and not os.path.isabs(path):
        path = os.path.join(image_dir, path)
    if not os.path.isfile(path):
        raise UserError(f"video file not found: {path!r}")
    try:
        import av  # optional (PyAV): only video files need it
    except ImportError as e:
        raise UserError(f"video file {path!r}: decoding video files needs PyAV (pip install av); a list of frames "
                        "needs nothing") from e
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            native = float(stream.average_rate or 0)
            frames = [f.to_image().convert("RGB") for f in container.decode(stream)]
    except Exception as e:  # PyAV raises its own error types (InvalidDataError, ...)
        raise UserError(f"could not decode video file {path!r} ({first_line(e)})") from e
    total = len(frames)
    if total == 0:
        raise UserError(f"video file {path!r} has no frames")
    native = native or fps  # a stream without a rate: take its frames as sampled already
    n = round(total / native * fps)
    n = max(min(n, max_frames, total), min(MIN_FRAMES, max_frames, total))
    n = max(n - n % 2, 1) if n > 1 else 1
    keep = [round(i * (total - 1) / (n - 1)) if n > 1 else 0 for i in range(n)]
    return [frames[i] for i in keep], n / total * native


def vision_params(proc):
    """(patch, temporal patch, merge, mean, std) of the processor's video side (its image side where it has none)."""
    vp = getattr(proc, "video_processor", None) or proc.image_processor
    return (vp.patch_size, vp.temporal_patch_size, vp.merge_size, list(vp.image_mean), list(vp.image_std))


def smart_resize(h, w, factor, min_pixels, max_pixels, frames=1):
    """transformers' smart_resize of the Qwen-VL video processors: sides multiples of `factor`, aspect kept, frames x
    height x width within the bounds (Qwen2(.5)-VL's bound one frame, frames=1; Qwen3-VL's the whole clip)."""
    if frames > 1 and (h < factor or w < factor):  # (Qwen3-VL's first scales a frame smaller than a patch up)
        scale = max(factor / h, factor / w)
        h, w = int(h * scale), int(w * scale)
    if max(h, w) / min(h, w) > 200:
        raise UserError(f"frame of {w}x{h}: aspect ratio over 200")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if frames * hb * wb > max_pixels:
        beta = math.sqrt(frames * h * w / max_pixels)
        hb, wb = (max(factor, math.floor(x / beta / factor) * factor) for x in (h, w))
    elif frames * hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (frames * h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def prepare_video(frames, proc, min_pixels, max_pixels):
    """PIL frames -> uint8 array [T, H, W, 3]: T padded to a multiple of the temporal patch with the last frame, every
    frame at the size the processor picks for the first one (Qwen3-VL: for the clip; see smart_resize)."""
    patch, tps, merge, _, _ = vision_params(proc)
    frames = frames + [frames[-1]] * (-len(frames) % tps)
    clip = len(frames) if _arch(proc) == "qwen3_vl" else 1
    h, w = smart_resize(frames[0].height, frames[0].width, patch * merge, min_pixels, max_pixels, clip)
    frames = [f if f.size == (w, h) else f.resize((w, h), Image.BICUBIC) for f in frames]
    return np.stack([np.asarray(f, dtype=np.uint8) for f in frames])  # [T, H, W, 3]


def video_inputs(videos, fps, proc):
    """The processor's video outputs for prepared videos ([T, H, W, 3] uint8 each): pixel_values_videos [P, C*t*p*p]
    in the Qwen-VL patch order, video_grid_thw [V, 3], and Qwen2.5-VL's second_per_grid_ts [V] (its M-RoPE time)."""
    patch, tps, merge, mean, std = vision_params(proc)
    pixels, grids = [], []
    for v in videos:
        x = torch.from_numpy(v).permute(0, 3, 1, 2).float() / 255.0  # [T, C, H, W]
        x = (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
        T, C, H, W = x.shape
        gt, gh, gw = T // tps, H // patch, W // patch
        x = x.view(gt, tps, C, gh // merge, merge, patch, gw // merge, merge, patch)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h-block, w-block, h-in, w-in, C, t-in, p, p), as transformers
        pixels.append(x.reshape(gt * gh * gw, C * tps * patch * patch))
        grids.append([gt, gh, gw])
    out = {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}
    if _arch(proc) == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([tps / f for f in fps])
    return out


def video_options(cfg) -> dict:
    """grpo.Config's video options as encode_prompt's keyword arguments."""
    return dict(video_key=cfg.video_key, video_fps=cfg.video_fps, max_frames=cfg.max_frames,
                video_min_pixels=cfg.video_min_pixels, video_max_pixels=cfg.video_max_pixels)


def most_videos(ds) -> int:
    """The most videos one row of a PromptDataset has (the vLLM engine's per-prompt limit)."""
    key = ds.encode_kwargs.get("video_key", "videos")
    if key not in (getattr(ds.rows, "column_names", None) or [key]):
        return 0
    column = ds.rows[key] if hasattr(ds.rows, "column_names") else [r.get(key) for r in ds.rows]
    return max([len(column[i] or []) for i in ds.indices], default=0)


def _arch(proc):
    name = type(proc).__name__
    return "qwen3_vl" if name.startswith("Qwen3VL") else "qwen2_5_vl" if name.startswith("Qwen2_5_VL") else "qwen2_vl"


def expand_video_pads(ids, grids, fps, proc):
    """Each video's one <|video_pad|> in `ids` -> its tokens. Qwen2(.5)-VL: one pad per merged patch. Qwen3-VL: per
    temporal patch "<t seconds>" (its mid time, tokenised digit by digit as vLLM does), vision start, pads, end."""
    tok = getattr(proc, "tokenizer", proc)
    pad = tok.convert_tokens_to_ids("<|video_pad|>")
    _, tps, merge, _, _ = vision_params(proc)
    out, k = [], 0
    for t in ids:
        if t != pad:
            out.append(t)
            continue
        (gt, gh, gw), f = [int(x) for x in grids[k]], fps[k]
        per_frame = gh * gw // merge ** 2
        if _arch(proc) == "qwen3_vl":
            start, end = (tok.convert_tokens_to_ids(x) for x in ("<|vision_start|>", "<|vision_end|>"))
            for g in range(gt):
                mid = (g * tps + g * tps + tps - 1) / 2 / f  # the mean of its first and last frame's times
                out += tok.encode(f"<{mid:.1f} seconds>", add_special_tokens=False)
                out += [start] + [pad] * per_frame + [end]
        else:
            out += [pad] * (gt * per_frame)
        k += 1
    return out


# ======================================================================== Qwen2(.5)-VL's time axis, as the model has it
def qwen2_vl_rope_index(self, input_ids, mm_token_type_ids=None, image_grid_thw=None, video_grid_thw=None,
                        second_per_grid_ts=None, attention_mask=None, **kwargs):
    """Qwen2-VL / Qwen2.5-VL M-RoPE positions ([3, B, T] and [B, 1] deltas) by the Qwen team's rule, which vLLM
    follows: text after an image or video goes on from the largest position + 1; a video's time positions are
    int(t * second_per_grid_ts * tokens_per_second). transformers 5.x restarts the text at max(h, w) after a block
    (seen on 5.17, 5.24): the trainer would not score the engine's positions. Images come out the same either way."""
    cfg = self.config
    merge, tps = cfg.vision_config.spatial_merge_size, getattr(cfg.vision_config, "tokens_per_second", None)
    grids = {cfg.image_token_id: iter(image_grid_thw if image_grid_thw is not None else []),
             cfg.video_token_id: iter(video_grid_thw if video_grid_thw is not None else [])}
    seconds = iter(second_per_grid_ts.tolist() if torch.is_tensor(second_per_grid_ts) else second_per_grid_ts or [])
    position_ids = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    deltas = []
    for b, row in enumerate(input_ids):
        keep = attention_mask[b].bool() if attention_mask is not None else torch.ones_like(row, dtype=torch.bool)
        ids, parts, nxt, i = row[keep].tolist(), [], 0, 0
        while i < len(ids):
            if ids[i] in grids:  # one image or video: t x h x w patches, merge x merge of them per token
                t, h, w = (int(x) for x in next(grids[ids[i]]))
                h, w = h // merge, w // merge
                step = 1.0  # images: t = 1; Qwen2-VL's videos: one position per grid step
                if ids[i] == cfg.video_token_id and tps is not None:
                    step = float(next(seconds, 1.0)) * tps
                tt = (torch.arange(t, dtype=torch.float64) * step).long()  # vLLM: (indices * t_factor).astype(int64)
                pos = torch.stack(torch.meshgrid(tt, torch.arange(h), torch.arange(w), indexing="ij")).reshape(3, -1)
                n = t * h * w
            else:  # a run of text
                n = next((j for j in range(i, len(ids)) if ids[j] in grids), len(ids)) - i
                pos = torch.arange(n).expand(3, -1)
            parts.append(pos + nxt)
            nxt, i = int(parts[-1].max()) + 1, i + n
        pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        position_ids[:, b, keep] = pos.to(input_ids.device)
        deltas.append(nxt - len(ids))
    return position_ids, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)
