"""bench.py's workload is the one the speed bar names: one 512x512 image and about 100 text tokens per prompt."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import data  # noqa: E402
import tiny_model  # noqa: E402


def test_geo_prompts_have_one_512px_image_and_about_100_text_tokens(tmp_path):
    path = tiny_model.build_tiny_model(str(tmp_path / "tiny"))  # same tokenizer as the bench's random model
    proc = data.load_processor(path, min_pixels=3136, max_pixels=512 * 512)  # the bench's bounds
    parquet = bench.make_geo_dataset(str(tmp_path / "geo.parquet"), 3, proc.tokenizer)
    rows = data.load_rows(parquet)
    assert len(rows) == 3
    for row in rows:
        text = row["problem"].removeprefix("<image>")
        assert 100 <= len(proc.tokenizer(text)["input_ids"]) <= 110
        rec = data.encode_prompt(row, proc, min_pixels=3136, max_pixels=512 * 512)
        grid = rec["mm_inputs"]["image_grid_thw"]
        assert grid.tolist() == [[1, 36, 36]]  # 512 px -> 504 px (multiple of 28) -> 36 x 36 patches
        image_tokens = 36 * 36 // 4
        assert image_tokens + 100 <= len(rec["prompt_ids"]) <= image_tokens + 150  # + the chat template
