"""A dataset that mixes rows with images and text-only rows trains on several ranks: every rank runs the same
sharded modules in the same order whatever its micro-batch holds (the vision blocks are FSDP units of their own;
a rank that skipped them would leave the others waiting in an all-gather)."""
import io

import datasets
import pytest
from PIL import Image

from test_train import run


def mixed_parquet(path, n_rows=16):
    rows = {"problem": [], "answer": [], "images": []}
    for i in range(n_rows):
        color = ("red", "green", "blue", "white")[i % 4]
        if i % 2:  # text only: the colour is in the question
            rows["problem"].append(f"The picture is {color}. What is its main color?")
            rows["images"].append([])
        else:
            buf = io.BytesIO()
            Image.new("RGB", (64, 64), {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
                                        "white": (235, 235, 235)}[color]).save(buf, format="PNG")
            rows["problem"].append("<image>What is the main color of the picture?")
            rows["images"].append([{"bytes": buf.getvalue(), "path": None}])
        rows["answer"].append(color)
    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "images": datasets.List(datasets.Image())})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
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
