"""benchmarks/gc_freeze.py [on|off] -- what one full collection of Python's collector costs in the trainer's process at
each step, with grpo.train's freeze of the heap after step 1 (on) and without it (off): vLLM's sleep runs such a
collection every step (vllm/device_allocator/cumem.py). The CPU demo (HF engine, the tiny model), 4 steps; the
collection is timed at the start of each step's sampling. Prints one FREEZE line of JSON per run. On the 2-core CPU
machine: `python benchmarks/gc_freeze.py on; python benchmarks/gc_freeze.py off` (~1 min each)."""
import contextlib
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import grpo  # noqa: E402  (the repository's root, above)
from easyr1_config import cli  # noqa: E402


@contextlib.contextmanager
def no_freeze():
    yield lambda: None


def main(mode):
    if mode not in ("on", "off"):
        sys.exit("usage: python benchmarks/gc_freeze.py on|off")
    if mode == "off":
        grpo.heap_freezer = no_freeze
    rows = []

    def collect(ctx, step, metrics):
        t = time.perf_counter()
        gc.collect()
        rows.append(dict(step=step + 1, seconds=round(time.perf_counter() - t, 4), tracked=len(gc.get_objects()),
                         frozen=gc.get_freeze_count()))
        return grpo.collect_rollouts(ctx, step, metrics)
    args = ["--rollout-engine", "hf", "--max-steps", "4", "--val-freq", "0", "--save-freq", "-1", "--resume", "never",
            "--output-dir", f"/tmp/gc_freeze_{mode}"]
    grpo.train(cli(grpo.Config, grpo.DEMO, args=args), collect=collect)
    print("FREEZE", mode, json.dumps(rows), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "on")
