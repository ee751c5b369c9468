"""Video inputs end to end on the CPU: the data contract (videos column, <video> placeholders, frames or files), the
processor outputs the model needs (frames, second_per_grid_ts, Qwen3-VL's timestamps), the HF engine, the trainer's
log-probs against a plain HF forward (padded and padding-free), for the tiny Qwen2.5-VL and Qwen3-VL."""
import io
import os

import pytest
import torch
from PIL import Image

import data
import fsdp_actor as A
import tiny_model

PX = dict(min_pixels=56 * 56, max_pixels=112 * 112)
COLOURS = ["red", "green", "blue", "white"]


def clip(first, last, n=4, size=(64, 60)):
    """n frames: the first half one colour, the rest another."""
    return [Image.new("RGB", size, data.COLORS[first if i < n // 2 else last]) for i in range(n)]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def arch(request, tmp_path_factory):
    A.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp(request.param) / "m"), arch=request.param)
    return request.param, path, data.load_processor(path, **PX)


def video_rows():
    img = Image.new("RGB", (70, 70), data.COLORS["green"])
    return [
        {"problem": "<video>Which colour does the video end with?", "answer": "blue", "videos": [clip("red", "blue")]},
        {"problem": "<image> then <video> and <video>: which?", "answer": "red", "images": [img],
         "videos": [clip("white", "red", n=6), clip("blue", "green", n=3)]},
        {"problem": "Name a colour.", "answer": "red"},
    ]


def samples_of(prompts, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [dict(prompt=p, response_ids=torch.randint(3, 300, (1 + (3 * i + k) % 5,), generator=g).tolist())
            for i, p in enumerate(prompts) for k in range(n)]
