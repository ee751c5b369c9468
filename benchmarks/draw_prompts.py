"""benchmarks/draw_prompts.py -- seconds to draw (read, decode, template, tokenize, resize and normalise the images of)
the bar's 64 prompts on one thread: the host work that grpo.prefetch_prompts moves off the start of each step's
generation. The bar's data (bench.py's geo-v2 set, one 512x512 image per prompt) and processor, built without weights
(`python -m benchmarks.bench --prepare-only --random-init`, ~10 s on the CPU). Usage:
`python benchmarks/draw_prompts.py [PRESET]`; prints one DRAW line of JSON (seconds per draw, at three cursors)."""
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import data  # noqa: E402  (the repository's root, above)
import fsdp_actor  # noqa: E402
from benchmarks import bench  # noqa: E402


def main(preset="qwen2_5_vl_3b", workdir="/tmp/draw_prompts"):
    subprocess.run([sys.executable, "-m", "benchmarks.bench", "--preset", preset, "--prepare-only", "--random-init"],
                   cwd=ROOT, env=dict(os.environ, BENCH_DIR=workdir), check=True, capture_output=True)
    fsdp_actor.init_distributed()
    cfg = replace(bench.defaults(workdir, os.path.join(workdir, "model-random"),
                                 os.path.join(workdir, "geo-v2.parquet")), val_files="")
    _, train, _ = data.load_datasets(cfg, cfg.model_path)
    seconds = []
    for cursor in (0, cfg.rollout_batch_size, 2 * cfg.rollout_batch_size):
        t = time.perf_counter()
        data.draw_prompts(train, cursor, cfg.rollout_batch_size, 0, 1, cfg.seed)
        seconds.append(round(time.perf_counter() - t, 3))
    print("DRAW " + json.dumps(dict(preset=preset, prompts=cfg.rollout_batch_size, seconds=seconds)), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
