import io
import json
import os
import random

import pytest
import torch
from PIL import Image

import data
import tiny_model

PX = dict(min_pixels=56 * 56, max_pixels=112 * 112)


@pytest.fixture(scope="session")
def proc(tmp_path_factory):
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))
    return data.load_processor(path)


@pytest.fixture(scope="session")
def image_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("imgs")
    img, _, _ = tiny_model.draw_color_image(random.Random(7))
    img.save(d / "a.png")
    return d, "a.png"


def png_bytes(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def n_expanded(proc, rec):  # image tokens the processor inserts: t*h*w / merge^2 per image
    merge = proc.image_processor.merge_size
    return int(rec["mm_inputs"]["image_grid_thw"].prod(-1).sum()) // merge**2


def test_every_image_encoding_gives_the_same_pixels(proc, image_file):
    d, name = image_file
    pil = Image.open(d / name)
    raw = (d / name).read_bytes()
    encodings = [pil, pil.convert("RGBA"), {"bytes": raw}, {"bytes": raw, "path": "x.png"},
                 raw, str(d / name), name, {"bytes": None, "path": name}]
    recs = [data.encode_prompt({"problem": "<image>What color?", "answer": "red",
                                "images": [e]}, proc, image_dir=str(d), **PX)
            for e in encodings]
    for rec in recs:
        assert rec["images"][0].mode == "RGB"
        assert torch.equal(rec["mm_inputs"]["pixel_values"], recs[0]["mm_inputs"]["pixel_values"])
        assert rec["prompt_ids"] == recs[0]["prompt_ids"]


def test_bad_images_raise_clear_errors(image_file):
    d, name = image_file
    with pytest.raises(ValueError, match="not found.*nope.png"):
        data.to_pil("nope.png", image_dir=str(d))
    with pytest.raises(ValueError, match="neither 'bytes' nor 'path'"):
        data.to_pil({"bytes": None, "path": None})
    with pytest.raises(ValueError, match="could not decode"):
        data.to_pil(b"not an image")
    with pytest.raises(ValueError, match="unsupported image type int"):
        data.to_pil(3)


def test_pad_counts_single_and_multi_image(proc):
    rng = random.Random(1)
    imgs = [tiny_model.draw_color_image(rng)[0] for _ in range(2)]
    pad = proc.image_token_id
    one = data.encode_prompt({"problem": "<image>Which?", "answer": "red", "images": imgs[:1]},
                             proc, **PX)
    assert one["raw_prompt_ids"].count(pad) == 1
    assert one["prompt_ids"].count(pad) == n_expanded(proc, one)
    two = data.encode_prompt({"problem": "First <image> then <image> which?", "answer": "blue",
                              "images": imgs}, proc, **PX)
    assert two["mm_inputs"]["image_grid_thw"].shape == (2, 3)
    assert two["raw_prompt_ids"].count(pad) == 2
    assert two["prompt_ids"].count(pad) == n_expanded(proc, two)
    assert two["mm_inputs"]["pixel_values"].shape[0] == int(
        two["mm_inputs"]["image_grid_thw"].prod(-1).sum())  # [P, D]: one row per patch
    assert len(two["images"]) == 2
    text = proc.tokenizer.decode(two["raw_prompt_ids"])
    assert "First <|vision_start|><|image_pad|><|vision_end|> then" in text
    # Without expansion the ids are what you get by collapsing each run of pads to one.
    collapsed = [t for i, t in enumerate(two["prompt_ids"])
                 if not (t == pad and i and two["prompt_ids"][i - 1] == pad)]
    assert collapsed == two["raw_prompt_ids"]


def test_images_without_placeholder_are_prepended(proc):
    img = tiny_model.draw_color_image(random.Random(2))[0]
    rec = data.encode_prompt({"problem": "What color?", "answer": "red", "images": [img]},
                             proc, **PX)
    text = proc.tokenizer.decode(rec["raw_prompt_ids"])
    assert "user\n<|vision_start|><|image_pad|><|vision_end|>What color?" in text


def test_text_only_rows(proc):
    for row in [{"problem": "1+1?", "answer": "2"},
                {"problem": "1+1?", "answer": 2, "images": []},
                {"problem": "1+1?", "answer": "2", "images": None}]:
        for p in (proc, proc.tokenizer):  # a text LLM only has a tokenizer
            rec = data.encode_prompt(row, p)
            assert rec["mm_inputs"] == {} and rec["images"] == []
            assert rec["prompt_ids"] == rec["raw_prompt_ids"]
            assert rec["answer"] == "2"
            assert proc.tokenizer.decode(rec["prompt_ids"]).startswith(
                "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n1+1?")


def test_placeholder_mismatch_errors(proc, tmp_path):
    img = tiny_model.draw_color_image(random.Random(3))[0]
    with pytest.raises(data.BadRow, match="2 '<image>' placeholder.*but 1 images"):
        data.encode_prompt({"problem": "<image><image>Q", "answer": "a", "images": [img]},
                           proc, **PX)
    with pytest.raises(data.BadRow, match="but no images"):
        data.encode_prompt({"problem": "<image>Q", "answer": "a"}, proc)
    with pytest.raises(data.UserError, match="no image processor"):
        data.encode_prompt({"problem": "<image>Q", "answer": "a", "images": [img]},
                           proc.tokenizer)
    rows = [{"problem": "<image>ok", "answer": "a", "images": [png_bytes(img)]},
            {"problem": "<image><image>bad", "answer": "a", "images": [png_bytes(img)]}]
    path = str(tmp_path / "bad.parquet")
    _write(rows, path)
    with pytest.raises(data.UserError, match="1 of 2 rows cannot be used.*\n  row 1: placeholders"):
        data.PromptDataset(path, proc, **PX)
    assert len(data.PromptDataset(path, proc, skip_bad_rows=True, **PX)) == 1


def test_format_prompt_string_and_file(proc, tmp_path):
    row = {"problem": "<image>What color?", "answer": "red",
           "images": [tiny_model.draw_color_image(random.Random(4))[0]]}
    rec = data.encode_prompt(row, proc, format_prompt=tiny_model.DEMO_FORMAT_PROMPT, **PX)
    assert rec["prompt_text"] == "<image>What color? Answer with one word."
    f = tmp_path / "fmt.jinja"
    f.write_text("{{ content | trim }} Think step by step.\n")
    rec = data.encode_prompt(row, proc, format_prompt=str(f), **PX)
    assert rec["prompt_text"] == "<image>What color? Think step by step."
    assert "What color? Think step by step.<|im_end|>" in proc.tokenizer.decode(rec["prompt_ids"])


def test_resize_bounds():
    lo, hi = 56 * 56, 112 * 112
    big = data.resize_image(Image.new("RGB", (1000, 500)), lo, hi)
    assert big.width * big.height <= hi and abs(big.width / big.height - 2) < 0.05
    small = data.resize_image(Image.new("RGB", (10, 30)), lo, hi)
    assert small.width * small.height >= lo and abs(small.height / small.width - 3) < 0.1
    mid = Image.new("RGB", (80, 70))
    assert data.resize_image(mid, lo, hi).size == (80, 70)
    thin = data.resize_image(Image.new("RGB", (100000, 1)), lo, hi)
    assert thin.width >= 1 and thin.height >= 1


def _write(rows, path):
    import datasets
    ext = os.path.splitext(path)[1]
    if ext == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(path)
    elif ext == ".jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    else:
        with open(path, "w") as f:
            json.dump(rows, f)


def test_sources_parquet_json_jsonl_and_folder(proc, image_file, tmp_path):
    d, name = image_file
    rows = [{"problem": f"<image>q{i}", "answer": str(i), "images": [name]} for i in range(3)]
    for ext in (".parquet", ".json", ".jsonl"):
        path = str(tmp_path / f"rows{ext}")
        _write(rows, path)
        got = data.load_rows(path)
        assert [r["answer"] for r in got] == ["0", "1", "2"], ext
        rec = data.encode_prompt(got[1], proc, image_dir=str(d), **PX)
        assert rec["answer"] == "1" and rec["mm_inputs"]["pixel_values"].shape[0] > 0
    folder = tmp_path / "folder"
    folder.mkdir()
    _write(rows, str(folder / "train.jsonl"))
    _write(rows[:1], str(folder / "test.jsonl"))
    assert len(data.load_rows(str(folder))) == 3
    assert len(data.load_rows(str(folder) + "@test")) == 1
    assert len(data.load_rows(str(folder), split="test")) == 1
    with pytest.raises(data.UserError, match="no such file or folder.*missing.parquet"):
        data.load_rows(str(tmp_path / "missing.parquet"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(data.UserError, match="no .parquet/.json/.jsonl files in folder.*empty"):
        data.load_rows(str(empty))


def test_color_dataset_answers_match_pixels(tmp_path):
    path = tiny_model.make_color_dataset(str(tmp_path / "c.parquet"), 40, seed=3)
    rows = data.load_rows(path)
    assert set(rows.column_names) == {"problem", "answer", "images"}
    seen = set()
    for row in rows:
        assert row["problem"].count("<image>") == 1 and len(row["images"]) == 1
        img = data.to_pil(row["images"][0])
        assert 56 <= img.width <= 112 and 56 <= img.height <= 112
        # The colour fills most of the picture (the most common pixel value); the distractors are grey.
        (n_fg, fg), = sorted(img.getcolors(1 << 16), reverse=True)[:1]
        assert n_fg > 0.5 * img.width * img.height
        greys = [c for n, c in img.getcolors(1 << 16) if c != fg]
        assert greys and all(max(c) - min(c) == 0 for c in greys)
        nearest = min(tiny_model.COLORS, key=lambda c: sum((a - b) ** 2 for a, b in zip(fg, tiny_model.COLORS[c])))
        assert nearest == row["answer"]
        seen.add(row["answer"])
    assert seen == set(tiny_model.COLORS)


def test_demo_data_is_cached_and_val_differs(tmp_path):
    train, val = tiny_model.demo_data(str(tmp_path), n_train=30, n_val=10)
    mtime = os.path.getmtime(train)
    assert tiny_model.demo_data(str(tmp_path), n_train=30, n_val=10) == (train, val)
    assert os.path.getmtime(train) == mtime
    tr, va = data.load_rows(train), data.load_rows(val)
    assert len(tr) == 30 and len(va) == 10
    tr_bytes = {data.to_pil(r["images"][0]).tobytes() for r in tr}
    assert not any(data.to_pil(r["images"][0]).tobytes() in tr_bytes for r in va)


def test_prompt_dataset_filters_overlong(proc, tmp_path):
    train, _ = tiny_model.demo_data(str(tmp_path), n_train=20, n_val=5)
    full = data.PromptDataset(train, proc, format_prompt=tiny_model.DEMO_FORMAT_PROMPT, **PX)
    lengths = [len(full[i]["prompt_ids"]) for i in range(len(full))]
    cut = sorted(lengths)[len(lengths) // 2]
    short = data.PromptDataset(train, proc, max_prompt_length=cut,
                               format_prompt=tiny_model.DEMO_FORMAT_PROMPT, **PX)
    assert len(short) == sum(n <= cut for n in lengths) < len(full)
    assert all(len(short[i]["prompt_ids"]) <= cut for i in range(len(short)))
    assert short[0]["answer"] in tiny_model.COLORS


def test_load_processor_pixel_budget(proc):
    path = proc.tokenizer.name_or_path
    p = data.load_processor(path, min_pixels=56 * 56, max_pixels=224 * 224)
    img = Image.new("RGB", (300, 200))
    assert data.encode_prompt({"problem": "<image>Q", "answer": "a", "images": [img]}, p,
                              min_pixels=1, max_pixels=10**7)["mm_inputs"]["image_grid_thw"].tolist() == [[1, 12, 18]]
    assert proc.image_processor(images=[img])["image_grid_thw"].tolist() == [[1, 6, 8]]  # untouched


# ---------------------------------------------------------------- the data check
def _bad_rows(tmp_path):
    """Two good rows around one of each kind of bad row, as a parquet of {"bytes", "path"} image structs."""
    good = png_bytes(tiny_model.draw_color_image(random.Random(5))[0])
    ok = {"problem": "<image>What color?", "answer": "red", "images": [{"bytes": good, "path": None}]}
    rows = [ok,
            {**ok, "answer": None},  # 1: would train as the string 'None'
            {**ok, "answer": "  "},  # 2
            {**ok, "problem": "<image><image>Which?"},  # 3: two placeholders, one image
            {**ok, "images": [{"bytes": b"not a png", "path": None}]},  # 4
            {**ok, "images": [{"bytes": None, "path": "missing.png"}]},  # 5
            {**ok, "problem": "<image>" + "word " * 600},  # 6: ~630 tokens
            {**ok, "problem": None},  # 7
            ok]
    path = str(tmp_path / "bad.parquet")
    _write(rows, path)
    return path


def test_check_rows_names_every_bad_row_by_its_source_number(proc, tmp_path, image_file):
    rows = data.load_rows(_bad_rows(tmp_path))
    problems = data.check_rows(rows, proc, max_prompt_length=512, image_dir=str(image_file[0]), **PX)
    assert [(i, kind) for i, kind, _ in problems] == [
        (1, data.NO_ANSWER), (2, data.NO_ANSWER), (3, data.PLACEHOLDERS), (4, data.BAD_IMAGE),
        (5, data.BAD_IMAGE), (6, data.TOO_LONG), (7, data.NO_PROMPT)]
    msgs = dict((i, m) for i, _, m in problems)
    assert "'answer' is None" in msgs[1] and "could not decode 9 image bytes" in msgs[4]
    assert "missing.png" in msgs[5] and "> --max-prompt-length 512" in msgs[6]
    n = int(msgs[6].split(": ")[1].split()[0])  # the count it reports is the real encoded length
    assert n == len(data.encode_prompt(rows[6], proc, **PX)["prompt_ids"])
    report = data.describe_problems(problems)
    assert "counts: no answer 2, placeholders != images 1, bad image 2, prompt too long 1, no prompt 1" in report
    with pytest.raises(data.UserError, match="--answer-key solution: no such column"):
        data.check_rows(rows, proc, answer_key="solution")


def test_prompt_dataset_refuses_skips_and_drops(proc, tmp_path):
    path = _bad_rows(tmp_path)
    with pytest.raises(data.UserError) as e:  # overlong rows are dropped (filter on), the rest listed
        data.PromptDataset(path, proc, max_prompt_length=512, option="--train-files", **PX)
    msg = str(e.value)
    assert msg.startswith(f"--train-files {path}: 6 of 9 rows cannot be used")
    assert [ln.split(":")[0].strip() for ln in msg.splitlines()[1:7]] == [f"row {i}" for i in (1, 2, 3, 4, 5, 7)]
    assert "--skip-bad-rows" in msg and "row 6" not in msg
    ds = data.PromptDataset(path, proc, max_prompt_length=512, skip_bad_rows=True, **PX)
    assert ds.indices == [0, 8] and len(ds) == 2 and ds[1]["answer"] == "red"
    assert ds.notes[0].endswith("skipped 6 bad rows (--skip-bad-rows; no answer 2, placeholders != images 1, bad "
                                "image 2, no prompt 1): rows 1, 2, 3, 4, 5, 7")
    assert "dropped 1 prompts longer than --max-prompt-length 512 (--filter-overlong-prompts): rows 6" in ds.notes[1]
    off = data.PromptDataset(path, proc, max_prompt_length=512, filter_overlong=False, skip_bad_rows=True, **PX)
    assert "skipped 7 bad rows" in off.notes[0] and len(off.notes) == 1  # overlong is a bad row without the filter


def test_prompt_length_matches_the_encoding(proc):
    rng = random.Random(6)
    sizes = [(7, 300), (56, 56), (113, 97), (640, 480), (1000, 30)]
    imgs = [Image.new("RGB", s, (rng.randint(0, 255),) * 3) for s in sizes]
    rows = [{"problem": "<image>Q?", "answer": "a", "images": [im]} for im in imgs]
    rows += [{"problem": "<image> vs <image>", "answer": "b", "images": imgs[2:4]},
             {"problem": "text only", "answer": "c"}]
    for px in (PX, dict(min_pixels=3136, max_pixels=512 * 512)):
        p = data.load_processor(proc.tokenizer.name_or_path, **px)
        for row in rows:
            assert data.prompt_length(row, p, **px) == len(data.encode_prompt(row, p, **px)["prompt_ids"])


def test_image_columns_stay_undecoded_until_encoding(tmp_path):
    path = tiny_model.make_color_dataset(str(tmp_path / "c.parquet"), 3, seed=0)
    row = data.load_rows(path)[0]
    assert set(row["images"][0]) == {"bytes", "path"}  # a bad image is then a row's problem, not the loader's


def test_the_stream_is_one_seeded_shuffle_per_epoch_or_the_files_order():
    rows = list(range(6))  # draw_prompts reads any sequence
    shuffled = [r for _, r in data.draw_prompts(rows, 0, 12, 0, 1, seed=1)]
    assert sorted(shuffled[:6]) == rows and sorted(shuffled[6:]) == rows and shuffled[:6] != shuffled[6:]
    assert shuffled[:6] != rows
    # --shuffle False (EasyR1's data.shuffle: false): the file's order, epoch after epoch, split over ranks as ever
    ordered = [data.draw_prompts(rows, 4, 4, rank, 2, seed=1, shuffle=False) for rank in (0, 1)]
    assert ordered == [[(4, 4), (5, 5)], [(6, 0), (7, 1)]]
