"""benchmarks/loop_steps.py METRICS.jsonl... -- the engine loop's parts per step of bench.py runs (the gen_loop/* keys
that engine_bench.engine_loop_timers puts in metrics.jsonl), steps after the first, one markdown table."""
import json
import os
import sys

KEYS = ("timing/gen", "gen_loop/step", "gen_loop/schedule", "gen_loop/launch", "gen_loop/sample_launch",
        "gen_loop/wait", "gen_loop/update", "gen_loop/outputs", "gen_loop/add", "gen_loop/gc")


def table(paths):
    out = ["| run, step | timing/gen | loop step | schedule | launch | sample_launch | wait | update | outputs | add "
           "| gc |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        name = os.path.basename(path).replace("_metrics.jsonl", "")
        for line in open(path):
            m = json.loads(line)
            if m.get("step", 1) > 1 and "gen_loop/step" in m:
                out.append(f"| {name}, {m['step']} | " + " | ".join(f"{m.get(k, float('nan')):.2f}" for k in KEYS)
                           + " |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/loop_steps.py METRICS.jsonl...")
    print(table(sys.argv[1:]))
