"""A dataset that mixes rows with images, videos and text-only rows trains on several ranks: every rank runs the
same sharded modules in the same order whatever its micro-batch holds (the vision blocks are FSDP units of their own;
a rank that skipped them, or ran them twice, would leave the others waiting in an all-gather)."""
import io

import datasets
import pytest
from PIL import Image

from test_train import run


RGB = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "white": (235, 235, 235)}


def png(color):
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), RGB[color]).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def mixed_parquet(path, n_rows=16, videos=False):
    """Every other row text-only; the others an image or (videos=True) alternately an image, a clip of 4 frames
    and a picture with a clip."""
    rows = {"problem": [], "answer": [], "images": [], **({"videos": []} if videos else {})}
    for i in range(n_rows):
        color = ("red", "green", "blue", "white")[i % 4]
        kind = "text" if i % 2 else "image" if not videos else ("image", "video", "both")[i // 2 % 3]
        question = {"text": f"The picture is {color}. What is its main color?",
                    "image": "<image>What is the main color of the picture?",
                    "video": "<video>Which colour does the video end with?",
                    "both": "<image> <video>Which colour does the video end with?"}[kind]
        rows["problem"].append(question)
        rows["images"].append([png(color)] if kind in ("image", "both") else [])
        if videos:
            rows["videos"].append([[png("white"), png("white"), png(color), png(color)]] if kind in ("video", "both")
                                  else [])
        rows["answer"].append(color)
    features = {"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                "images": datasets.List(datasets.Image())}
    if videos:
        features["videos"] = datasets.List(datasets.List(datasets.Image()))
    datasets.Dataset.from_dict(rows, features=datasets.Features(features)).to_parquet(str(path))
    return str(path)


def test_mixed_image_and_text_rows_on_two_ranks(tmp_path, launch):
    data = mixed_parquet(tmp_path / "mixed.parquet")
    # 1 prompt x 4 samples per rank and micro-batch: within three steps some rank holds a text-only micro-batch
    # while the other holds an image (seen: the reference forward then failed at step 2 with a collective mismatch)
    kw = ["--train-files", data, "--max-steps", "3", "--global-batch-size", "4", "--micro-batch-size-per-device", "4",
          "--reward-function", "color"]
    two = run(launch, kw, tmp_path / "two", nproc=2)
    one = run(launch, kw, tmp_path / "one")
    assert [m["step"] for m in two] == [1, 2, 3]
    for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl"):
        assert two[0][k] == pytest.approx(one[0][k], rel=1e-4, abs=1e-6), k


def test_mixed_image_video_and_text_rows_on_two_ranks(tmp_path, launch):
    """The same with videos: one rank's micro-batch may hold an image, a video, both or neither while the other's
    holds something else; the vision tower runs once per micro-batch on every rank (images and videos in one call)."""
    data = mixed_parquet(tmp_path / "mixed.parquet", n_rows=24, videos=True)
    kw = ["--train-files", data, "--max-steps", "3", "--global-batch-size", "4", "--micro-batch-size-per-device", "4",
          "--reward-function", "color"]
    two = run(launch, kw, tmp_path / "two", nproc=2)
    one = run(launch, kw, tmp_path / "one")
    assert [m["step"] for m in two] == [1, 2, 3]
    for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl"):
        assert two[0][k] == pytest.approx(one[0][k], rel=1e-4, abs=1e-6), k
