"""Two runs of the same demo, step by step: are they the same run? (a reshaping of the code must not change one)

    python -m benchmarks.compare_runs RUN_A RUN_B [RUN_A2]

RUN_* are run folders (metrics.jsonl, samples.jsonl). Prints whether every logged sample (prompt, response, reward)
is equal, then per metric the largest relative difference over the steps both logged (timings left out); with a
third folder (a repeat of RUN_A), the same for A against its repeat: the noise floor the A/B differences compare to.
"""
import json
import os
import sys

SKIP = ("timing/", "time/", "throughput/", "memory/", "perf/")


def load(run, name):
    path = os.path.join(run, name)
    return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []


def differences(a, b):
    """metric -> the largest |a - b| / max(|a|, 1e-12) over the steps both runs logged."""
    by_step = {r["step"]: r for r in load(b, "metrics.jsonl")}
    out = {}
    for r in load(a, "metrics.jsonl"):
        other = by_step.get(r["step"], {})
        for k, v in r.items():
            if k.startswith(SKIP) or k not in other or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            out[k] = max(out.get(k, 0.0), abs(v - other[k]) / max(abs(v), 1e-12))
    return out


def main(argv):
    a, b = argv[0], argv[1]
    sa, sb = load(a, "samples.jsonl"), load(b, "samples.jsonl")
    steps = sorted({r["step"] for r in load(a, "metrics.jsonl")} & {r["step"] for r in load(b, "metrics.jsonl")})
    print(f"steps compared: {len(steps)} ({steps[0]}..{steps[-1]}); logged samples equal: "
          f"{sum(x == y for x, y in zip(sa, sb))} of {max(len(sa), len(sb))}")
    d = differences(a, b)
    floor = differences(a, argv[2]) if len(argv) > 2 else {}
    print(f"{'metric':34} {'max rel diff A/B':>17}" + (f" {'A/A repeat':>12}" if floor else ""))
    for k in sorted(d):
        print(f"{k:34} {d[k]:17.2e}" + (f" {floor[k]:12.2e}" if k in floor else ""))
    return 0 if sa == sb else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
