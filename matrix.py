"""The GPU learning matrix: every built-in demo trained with vLLM, side by side on one GPU, each row asserted.

    python matrix.py run                       # all rows at once (one H200: ~8 min; vLLM installed)
    python matrix.py run --rows qwen3vl_colour,qwen3_text --out /tmp/m --timeout 450
    python matrix.py table benchmarks/h200/matrix_*.json   # the markdown table of kept results (README, BENCHMARKS)

A row passes when greedy validation reaches its target (0.95; the text demo 0.90) within the demo's steps, the
engine/trainer log-prob agreement (mean per token over the run) stays under 5e-3, and no optimizer step was
skipped. `run` exits 1 if any row fails (or was cut by --timeout before reaching its target). Each engine gets a fixed
KV cache (--kv-cache-memory-gb): vLLM's start-up memory profile assumes no other process allocates meanwhile, and the
other rows' engines sleep and wake every step. Results: one JSON file (the rows' summaries, their validation curves,
the versions that ran) and the table, under --out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib import metadata

ENGINE = ["--rollout-engine", "vllm", "--enforce-eager", "--gpu-memory-utilization", "0.05",
          "--kv-cache-memory-gb", "2", "--save-freq", "-1"]
# name -> (script, options on top of the demo's, validation target, what the row shows)
ROWS = {
    "qwen25vl_colour": ("grpo.py", [], 0.95, "Qwen2.5-VL colour, full AMP"),
    "qwen3vl_colour": ("grpo.py", ["--demo-model", "qwen3_vl"], 0.95, "Qwen3-VL colour (deepstack)"),
    "qwen3_text": ("grpo.py", ["--demo-model", "qwen3"], 0.90, "Qwen3 text, largest digit"),
    "lora": ("grpo.py", ["--lora-rank", "16", "--lora-modules-to-save", "lm_head"], 0.95, "Qwen2.5-VL colour, LoRA 16"),
    "bf16": ("grpo.py", ["--precision", "bf16"], 0.95, "Qwen2.5-VL colour, pure bf16"),
    "qwen25vl_video": ("grpo.py", ["--demo-task", "video"], 0.95, "Qwen2.5-VL video"),
    "qwen3vl_video": ("grpo.py", ["--demo-task", "video", "--demo-model", "qwen3_vl"], 0.95, "Qwen3-VL video"),
    "dapo": ("dapo.py", [], 0.95, "dapo.py, Qwen2.5-VL colour"),
    "rloo": ("grpo.py", ["--adv-estimator", "rloo"], 0.95, "RLOO, Qwen2.5-VL colour"),
}
MAX_DIFF_MEAN = 5e-3


def versions():
    out = {}
    for pkg in ("vllm", "torch", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                    text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        out["gpu"] = None
    return out


def summarize(name, metrics_path, target):
    """One row's figures from its metrics.jsonl (what `table` prints and `run` asserts)."""
    rows = [json.loads(line) for line in open(metrics_path)] if os.path.isfile(metrics_path) else []
    val = [(r["step"], r.get("val/accuracy", r["val/mean"])) for r in rows if "val/mean" in r]
    steps = [r for r in rows if "timing/step" in r]
    diffs = [r["rollout/logprob_diff_mean"] for r in steps if "rollout/logprob_diff_mean" in r]
    reached = next((s for s, v in val if v >= target), None)
    s = dict(row=name, steps=max((r["step"] for r in steps), default=0), target=target, steps_to_target=reached, final_val=val[-1][1] if val else None, val=val,
             diff_mean=statistics.fmean(diffs) if diffs else None,
             diff_max=max((r.get("rollout/logprob_diff_max", 0) for r in steps), default=None),
             sec_per_step=statistics.median(r["timing/step"] for r in steps[1:]) if len(steps) > 1 else None,
             peak_gb=max((r.get("memory/gpu_peak_allocated_gb", 0) for r in steps), default=None),
             skipped=max((r.get("actor/skipped_steps_total", 0) for r in steps), default=0))
    s["failures"] = failures(s)
    return s


def failures(s):
    out = []
    if s["steps_to_target"] is None:
        out.append(f"validation never reached {s['target']} (last {s['final_val']})")
    if s["diff_mean"] is None or s["diff_mean"] >= MAX_DIFF_MEAN:
        out.append(f"engine/trainer log-prob difference {s['diff_mean']} per token (bar {MAX_DIFF_MEAN})")
    if s["skipped"]:
        out.append(f"{s['skipped']} optimizer steps skipped")
    return out


def run(names, out, timeout, runs_dir):
    os.makedirs(out, exist_ok=True)
    subprocess.run([sys.executable, "-c", "import tiny_model, video; [tiny_model.build_tiny_model(arch=a) for a in "
                    "tiny_model.ARCHS]; tiny_model.demo_data(); tiny_model.demo_max_data(); video.demo_video_data()"],
                   check=True)  # the models and data once, before the rows race to build them
    procs, t0 = {}, time.time()
    for name in names:
        script, extra, _, _ = ROWS[name]
        cmd = [sys.executable, script, *ENGINE, *extra, "--output-dir", os.path.join(runs_dir, name)]
        env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
        log = open(os.path.join(out, f"{name}.log"), "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, cmd)
        time.sleep(3)  # engine start-ups a little apart
    results = []
    for name, (p, log, cmd) in procs.items():
        try:
            p.wait(timeout=max(1, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        s = summarize(name, os.path.join(runs_dir, name, "metrics.jsonl"), ROWS[name][2])
        s.update(command=" ".join(cmd[1:]), returncode=p.returncode, seconds=round(time.time() - t0),
                 log_tail=open(os.path.join(out, f"{name}.log"), errors="replace").read()[-1500:])
        if p.returncode != 0:
            s["failures"].append(f"exit code {p.returncode}" + (" (cut by --timeout)" if p.returncode < 0 else ""))
        results.append(s)
        print(f"[matrix] {name}: {'PASS' if not s['failures'] else 'FAIL ' + '; '.join(s['failures'])}", flush=True)
    doc = dict(date=time.strftime("%Y-%m-%d"), versions=versions(), rows=results)
    with open(os.path.join(out, "matrix.json"), "w") as f:
        json.dump(doc, f, indent=1)
    md = table([doc])
    with open(os.path.join(out, "matrix.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return all(not s["failures"] for s in results)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(docs):
    """Markdown: one line per row, from the last of the kept runs (files in order) that ran it; earlier attempts
    at a row are listed below the table with what stopped them."""
    latest, earlier = {}, []
    for doc in docs:
        for s in doc["rows"]:
            if s["row"] in latest:
                earlier.append(latest[s["row"]])
            latest[s["row"]] = {**s, "doc": doc}
    lines = ["| row | what | steps to target (target) | final val | agreement mean / max | s/step | peak GiB | "
             "result | date |", "|---|---|---|---|---|---|---|---|---|"]
    for name in [n for n in ROWS if n in latest] + [n for n in latest if n not in ROWS]:
        s = latest[name]
        what = ROWS.get(name, ("", [], 0, name))[3]
        lines.append(
            f"| {name} | {what} | {_fmt(s['steps_to_target'], 'd')} ({s['target']}) of {s['steps']} | "
            f"{_fmt(s['final_val'], '.3f')} | {_fmt(s['diff_mean'], '.1e')} / {_fmt(s['diff_max'], '.2f')} | "
            f"{_fmt(s['sec_per_step'], '.2f')} | {_fmt(s['peak_gb'], '.1f')} | "
            f"{'pass' if not s['failures'] else 'FAIL: ' + '; '.join(s['failures'])} | {s['doc']['date']} |")
    ran = sorted({_ran(s["doc"]) for s in latest.values()})
    lines.insert(0, "Ran on: " + "; ".join(ran) + ".\n")
    for s in earlier:
        err = [ln for ln in s.get("log_tail", "").splitlines() if "Error" in ln]
        lines.append(f"\nEarlier attempt at {s['row']} ({s['doc']['date']}): {'; '.join(s['failures']) or 'passed'} "
                     f"at step {s['steps']}" + (f" ({err[-1].strip()[-120:]})" if err else "") + ".")
    return "\n".join(lines)


def _ran(doc):
    v = doc["versions"]
    return f"{v.get('gpu')}, vLLM {v.get('vllm')}, torch {v.get('torch')}, transformers {v.get('transformers')}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    r.add_argument("--out", default=os.environ.get("OUT", "outputs/matrix"))
    r.add_argument("--timeout", type=float, default=540, help="seconds for all rows together")
    r.add_argument("--runs-dir", default="/tmp/matrix_runs", help="the rows' output folders (checkpoints, logs)")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "table":
        print(table([json.load(open(f)) for f in a.files]))
        return 0
    names = [n for n in a.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    return 0 if run(names, a.out, a.timeout, a.runs_dir) else 1


if __name__ == "__main__":
    sys.exit(main())
