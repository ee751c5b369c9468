"""The GPU learning matrix: every built-in demo trained with vLLM, side by side on one GPU, each row asserted.

From the repository root (the rows start grpo.py and dapo.py there):
    python -m benchmarks.matrix run                    # all rows at once (one H200: ~8 min; vLLM installed)
    python -m benchmarks.matrix run --rows qwen3vl_colour,qwen3_text --out /tmp/m --timeout 450
    python -m benchmarks.matrix table benchmarks/h200/matrix_*.json  # the markdown table of kept results (README,
                                                                      # BENCHMARKS)

A row passes when greedy validation holds its target (0.95; the text demo 0.90) to the end: its last three
validations all at or above it (a row that touches 1.0 once and ends a colour short has not learned it). Beside it
the engine/trainer log-prob agreement (mean per token over the run) stays under 5e-3, and no optimizer step was
skipped. "Steps to target" (the first validation at it) and "held from" (the step from which every validation is)
are reported. `run` exits 1 if any row fails (or was cut by --timeout before reaching its target). Each engine gets a fixed
KV cache (--kv-cache-memory-gb): vLLM's start-up memory profile assumes no other process allocates meanwhile, and the
other rows' engines sleep and wake every step. Results: one JSON file (the rows' summaries, their validation curves,
the versions that ran) and the table, under --out.
"""
import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata

import torch

import data
import fsdp_actor as actor
import merge
import rollout
import rundir
import video
from config import Config

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
    "qwen3vl_moe": ("grpo.py", ["--demo-model", "qwen3_vl_moe"], 0.95, "Qwen3-VL-MoE colour (4 experts, top 2)"),
    "qwen2vl_colour": ("grpo.py", ["--demo-model", "qwen2_vl"], 0.95, "Qwen2-VL colour"),
    "qwen35_colour": ("grpo.py", ["--demo-model", "qwen3_5"], 0.95, "Qwen3.5 colour (Gated DeltaNet hybrid)"),
    "qwen35_moe": ("grpo.py", ["--demo-model", "qwen3_5_moe"], 0.95, "Qwen3.5-MoE colour (GDN, 4 experts + shared)"),
    "gemma4_colour": ("grpo.py", ["--demo-model", "gemma4"], 0.95, "Gemma 4 colour (generic path)"),
    "internvl_colour": ("grpo.py", ["--demo-model", "internvl"], 0.95, "InternVL colour (generic path)"),
    "zoom_tools": ("grpo.py", ["--demo-task", "zoom"], 0.95, "Qwen2.5-VL zoom tool, two turns (tools.py)"),
}
VARIANTS = {}  # --variant LABEL=FLAGS: a row named ROW+LABEL runs ROW with FLAGS on top (a cause looked for)
MAX_DIFF_MEAN = 5e-3
HOLD = 3  # a row passes when its last HOLD validations are all at its target
MIN_GREEDY_EQUAL = 0.99  # parity: the share of validation prompts on which vLLM's greedy answer is the HF engine's
# ... or parts from it at a near tie: where the HF model prefers its own token by at most NEAR_TIE nats. Two bf16 kernels
# move a token's log-prob by up to ~0.03-0.06 (the largest per-token engine/HF gaps of the 2026-12-05 d matrix's rows),
# a margin by up to twice that; greedy decoding breaks such a tie either way. A wider margin is a real difference.
NEAR_TIE = 0.1


def spec(name):
    """(script, options, target, what) of a row name: ROW, ROW+LABEL (a --variant's flags on top) and either with /sN
    (--seed N: the same row on another draw of the data and the samples)."""
    base, _, seed = name.partition("/s")
    base, _, label = base.partition("+")
    script, extra, target, what = ROWS[base]
    flags = [*extra, *VARIANTS[label].split()] if label else list(extra)
    return (script, flags + (["--seed", seed] if seed else []), target,
            what + (f", {VARIANTS[label]}" if label else "") + (f", seed {seed}" if seed else ""))


def slug(name):
    """A row's name as a file name (gemma4_colour+fp32/s2 -> gemma4_colour-fp32_s2: the device tool returns no file
    whose name holds a "+")."""
    return name.replace("/", "_").replace("+", "-")


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
    s = dict(row=name, steps=max((r["step"] for r in steps), default=0), target=target, steps_to_target=reached,
             held_from=held_from(val, target),
             final_val=val[-1][1] if val else None, val=val,
             diff_mean=statistics.fmean(diffs) if diffs else None,
             diff_max=max((r.get("rollout/logprob_diff_max", 0) for r in steps), default=None),
             sec_per_step=statistics.median(r["timing/step"] for r in steps[1:]) if len(steps) > 1 else None,
             peak_gb=max((r.get("memory/gpu_peak_allocated_gb", 0) for r in steps), default=None),
             skipped=max((r.get("actor/skipped_steps_total", 0) for r in steps), default=0))
    s["worst_class"] = worst_class(os.path.join(os.path.dirname(metrics_path), "val_samples.jsonl"))
    s["failures"] = failures(s)
    return s


def accuracy_by_answer(rows):
    """answer -> mean accuracy over its rows (val_samples.jsonl of one validation): the worst class is min()."""
    out = collections.defaultdict(list)
    for r in rows:
        out[str(r["answer"])].append(r["accuracy"])
    return {a: sum(v) / len(v) for a, v in sorted(out.items())}


def worst_class(val_samples_path):
    """(answer, accuracy) of the class of prompts answered worst at the last validation (val_samples.jsonl), or None:
    a final 0.84 of four colours is one colour half lost, not noise spread evenly."""
    if not os.path.isfile(val_samples_path):
        return None
    rows = [json.loads(line) for line in open(val_samples_path)]
    last = [r for r in rows if r["step"] == rows[-1]["step"]] if rows else []
    by = accuracy_by_answer(last)
    return min(by.items(), key=lambda kv: kv[1]) if by else None


def held_from(val, target):
    """The step of the first validation from which every later one is at `target`, or None (the last is below)."""
    held = None
    for step, v in val:
        held = (held or step) if v >= target else None
    return held


def validation_failures(s):
    """The validation rule: the last HOLD validations at the target (a touch followed by a fall fails)."""
    last = [v for _, v in s["val"][-HOLD:]]
    if s["steps_to_target"] is None:
        return [f"validation never reached {s['target']} (last {s['final_val']})"]
    if len(last) < HOLD or min(last) < s["target"]:
        return [f"validation reached {s['target']} at step {s['steps_to_target']} but did not hold it: the last "
                f"{len(last)} of {len(s['val'])} {', '.join(f'{v:.3f}' for v in last)} (all {HOLD} must be at it)"]
    return []


def regrade(s):
    """A kept row judged by today's validation rule (its other failures, parity and exit code, as they were)."""
    s = {**s, "held_from": held_from(s["val"], s["target"])}
    kept = [f for f in s["failures"] if not f.startswith(("validation", "greedy"))]
    s["failures"] = validation_failures(s) + kept + (parity_failures(dict(s["parity"])) if s.get("parity") else [])
    return s


def failures(s):
    out = validation_failures(s)
    if s["diff_mean"] is None or s["diff_mean"] >= MAX_DIFF_MEAN:
        out.append(f"engine/trainer log-prob difference {s['diff_mean']} per token (bar {MAX_DIFF_MEAN})")
    if s["skipped"]:
        out.append(f"{s['skipped']} optimizer steps skipped")
    return out


def held_target(metrics_path, target):
    """Whether a running row's last HOLD validations are at its target already (--stop-at-target)."""
    if not os.path.isfile(metrics_path):
        return False
    rows = [json.loads(line) for line in open(metrics_path) if line.endswith("\n")]  # a half-written line waits
    val = [r.get("val/accuracy", r["val/mean"]) for r in rows if "val/mean" in r][-HOLD:]
    return len(val) == HOLD and min(val) >= target


def run(names, out, timeout, runs_dir, with_parity=False, stop_at_target=False):
    os.makedirs(out, exist_ok=True)
    subprocess.run([sys.executable, "-c", "import tiny_model; [tiny_model.build_tiny_model(arch=a) for a in "
                    "tiny_model.ARCHS + tiny_model.FAMILIES]; tiny_model.demo_data(); tiny_model.demo_max_data(); "
                    "tiny_model.demo_video_data()"], check=True)  # the models and data once, before the rows race to build them
    procs, t0 = {}, time.time()
    for name in names:
        script, extra, _, _ = spec(name)
        save = ["--save-freq", "0"] if with_parity else []  # 0: the last step only, for the parity check
        cmd = [sys.executable, script, *ENGINE, *extra, *save, "--output-dir", os.path.join(runs_dir, slug(name))]
        env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
        log = open(os.path.join(out, f"{slug(name)}.log"), "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, cmd)
        time.sleep(3)  # engine start-ups a little apart
    # each row's parity check starts as soon as the row ends (its engine beside the rows still training), so the
    # slowest row's training is not followed by every row's check
    results, checks, pending = {}, {}, dict(procs)
    while pending:
        left = timeout - (time.time() - t0)
        stopped = {n for n in pending if stop_at_target and pending[n][0].poll() is None
                   and held_target(os.path.join(runs_dir, slug(n), "metrics.jsonl"), spec(n)[2])}
        done = [n for n, (p, _, _) in pending.items() if p.poll() is not None or left <= 0 or n in stopped]
        if not done:
            try:
                next(iter(pending.values()))[0].wait(timeout=min(1.0, left))
            except subprocess.TimeoutExpired:
                pass
            continue
        for name in done:
            p, log, cmd = pending.pop(name)
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
            s = summarize(name, os.path.join(runs_dir, slug(name), "metrics.jsonl"), spec(name)[2])
            s.update(command=" ".join(cmd[1:]), what=spec(name)[3], returncode=p.returncode, seconds=round(time.time() - t0),
                     log_tail=open(os.path.join(out, f"{slug(name)}.log"), errors="replace").read()[-1500:])
            s["stopped_at_target"] = name in stopped
            if p.returncode != 0 and name not in stopped:
                s["failures"].append(f"exit code {p.returncode}" + (" (cut by --timeout)" if p.returncode < 0 else ""))
            results[name] = s
            for f in ("metrics.jsonl", "val_samples.jsonl"):  # kept now: a cut later in the call loses no row
                if os.path.isfile(os.path.join(runs_dir, slug(name), f)):  # (`collect` rebuilds matrix.json from them)
                    shutil.copy(os.path.join(runs_dir, slug(name), f), os.path.join(out, f"{slug(name)}_{f}"))
            print(f"[matrix] {name}: {'PASS' if not s['failures'] else 'FAIL ' + '; '.join(s['failures'])} (target at "
                  f"{s['steps_to_target']}, held from {s['held_from']}, final val {s['final_val']}, agreement "
                  f"{s['diff_mean']})", flush=True)
            if with_parity and rundir.latest_checkpoint(os.path.join(runs_dir, slug(name), "checkpoints")):
                path = os.path.join(out, f"{slug(name)}_parity.json")
                checks[name] = (launch_parity(os.path.join(runs_dir, slug(name)), path), path, time.time() - t0)
    results = [results[n] for n in names]
    write(out, results)  # kept if a cut comes during the parity checks
    for s in results:
        if s["row"] not in checks:
            continue
        p, path, s["parity_started"] = checks[s["row"]]
        try:
            p.wait(timeout=max(1, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
        s["parity"] = json.load(open(path)) if os.path.isfile(path) else None
        s["failures"] += s["parity"]["failures"] if s["parity"] else ["the parity check did not finish"]
    print(write(out, results))
    return all(not s["failures"] for s in results)


def write(out, results, vers=None):
    """matrix.json and matrix.md in `out`; returns the table."""
    doc = dict(date=time.strftime("%Y-%m-%d"), versions=vers or versions(), rows=results)
    rundir.write_atomic(os.path.join(out, "matrix.json"), json.dumps(doc, indent=1))
    md = table([doc])
    rundir.write_atomic(os.path.join(out, "matrix.md"), md + "\n")
    return md


def collect(pairs, out, versions_from):
    """Rows from kept metrics files (ROW=PATH, each beside its run's val_samples.jsonl if kept), for a matrix call
    cut before it wrote matrix.json; the versions from a matrix.json of the same device image."""
    results = []
    for pair in pairs:
        name, path = pair.split("=", 1)
        s = summarize(name, path, spec(name)[2])
        if path.endswith("_metrics.jsonl"):  # kept as NAME_metrics.jsonl beside NAME_val_samples.jsonl
            s["worst_class"] = worst_class(path[:-len("metrics.jsonl")] + "val_samples.jsonl")
            if os.path.isfile(path[:-len("metrics.jsonl")] + "parity.json"):  # and its parity check's summary
                s["parity"] = json.load(open(path[:-len("metrics.jsonl")] + "parity.json"))
                s["failures"] += s["parity"]["failures"]
        s.update(command=" ".join([spec(name)[0], *ENGINE, *spec(name)[1]]), collected_from=os.path.basename(path))
        results.append(s)
    os.makedirs(out, exist_ok=True)
    return write(out, results, json.load(open(versions_from))["versions"])


def launch_parity(run_dir, path):
    """`python -m benchmarks.matrix parity` on a finished row's folder, in the background: its summary to `path`, its
    log beside."""
    return subprocess.Popen([sys.executable, "-m", "benchmarks.matrix", "parity", run_dir, "--json", path],
                            stdout=subprocess.DEVNULL, stderr=open(path + ".log", "w"))


def parity(run_dir, engine="vllm", samples=4):
    """Engine = HF engine on one trained checkpoint: the run's last checkpoint merged into an HF folder, its
    validation prompts answered greedily by `engine` and by the HF engine (the share of equal answers), and `samples`
    sampled responses per prompt scored by the HF model (|engine log-prob - HF log-prob| per token, per prompt class:
    the answer; the worst class shows a class that the mean hides). Returns the summary dict."""
    cfg = Config(**{k: v for k, v in json.load(open(os.path.join(run_dir, "config.json"))).items()
                    if k in Config.__dataclass_fields__})
    hf_dir = os.path.join(run_dir, "hf")
    if not os.path.isdir(hf_dir):
        merge.merge(rundir.latest_checkpoint(os.path.join(run_dir, "checkpoints")), hf_dir)
    _, _, device = actor.init_distributed()
    _, _, val = data.load_datasets(cfg, hf_dir)
    recs = [val[j] for j in range(min(len(val), cfg.val_max_rows or len(val)))]
    seeds, T = list(range(len(recs))), cfg.max_response_length
    opts = rollout.engine_options(cfg, limit_videos=video.most_videos(val))  # the row's: a fixed KV cache
    eng = rollout.make_rollout(engine, hf_dir, device, torch.bfloat16, **opts)
    greedy = [g[0]["response_ids"] for g in eng.generate(recs, 1, 0.0, 1.0, T, seeds)]
    sampled = eng.generate(recs, samples, 1.0, 1.0, T, seeds)
    eng.sleep()
    hf = rollout.HFRollout(hf_dir, device, torch.bfloat16)
    hf_greedy = [g[0]["response_ids"] for g in hf.generate(recs, 1, 0.0, 1.0, T, seeds)]
    diffs = collections.defaultdict(list)  # prompt class -> |diff| per token
    with torch.no_grad():
        for rec, group in zip(recs, sampled):
            for smp in group:
                ids = torch.tensor(smp["response_ids"], device=device)  # [R]
                lp = _hf_logprobs(hf, rec, smp["response_ids"], device)[:-1].gather(1, ids[:, None]).squeeze(1)  # [R]
                diffs[rec["answer"]] += (lp.cpu() - torch.tensor(smp["logprobs"])).abs().tolist()
        parted = where_answers_part(hf, hf_dir, recs, greedy, hf_greedy, device)
    classes = {c: dict(tokens=len(d), mean=statistics.fmean(d), max=max(d)) for c, d in sorted(diffs.items())}
    worst = max(classes, key=lambda c: classes[c]["mean"])
    out = dict(greedy_equal=sum(a == b for a, b in zip(greedy, hf_greedy)) / len(recs), prompts=len(recs),
               classes=classes, worst_class=worst, worst_mean=classes[worst]["mean"],
               mean=statistics.fmean(x for d in diffs.values() for x in d), parted=parted)
    out["failures"] = parity_failures(out)
    return out


def parity_failures(p):
    """The parity bar: greedy answers equal the HF engine's, or part from them at a near tie, on MIN_GREEDY_EQUAL of
    the prompts (a summary kept before 2026-12-05 d has no `parted`: equal answers only)."""
    ties = sum(x["hf_margin"] is not None and x["hf_margin"] <= NEAR_TIE for x in p.get("parted") or [])
    ties = ties / p["prompts"] if ties else 0.0
    p["greedy_agree"] = p["greedy_equal"] + ties
    more = f", {ties:.3f} more at a near tie (margin <= {NEAR_TIE} nats)" if "parted" in p else ""
    return [] if p["greedy_agree"] >= MIN_GREEDY_EQUAL else [
        f"greedy answers equal the HF engine's on {p['greedy_equal']:.3f} of prompts{more} (bar {MIN_GREEDY_EQUAL})"]


def where_answers_part(hf, hf_dir, recs, greedy, hf_greedy, device):
    """Each prompt whose greedy answers differ: both texts, where they part, and by how much the HF model prefers its
    own token there (a margin within bf16's noise is a near tie two kernels may break either way; a wide one is a real
    difference)."""
    if greedy == hf_greedy:
        return []  # (no processor to load)
    proc = data.load_processor(hf_dir)
    tok, out = getattr(proc, "tokenizer", proc), []
    with torch.no_grad():
        for rec, a, b in zip(recs, greedy, hf_greedy):
            if a != b:
                k = first_difference(a, b)
                lp = _hf_logprobs(hf, rec, b[:k], device)[-1]  # [V]: the HF model's next token after the shared part
                margin = float(lp[b[k]] - lp[a[k]]) if k < min(len(a), len(b)) else None
                out.append(dict(answer=rec["answer"], engine=tok.decode(a), hf=tok.decode(b), at=k, hf_margin=margin))
    return out


def first_difference(a, b):
    """The first position where token lists a and b differ (the shorter one's length where one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _hf_logprobs(hf, rec, response_ids, device):
    """The HF model's next-token log-probs after the prompt and each prefix of response_ids: [R + 1, V] (forbidden
    tokens at -inf, as the engines sample)."""
    ids = torch.tensor([rec["prompt_ids"] + list(response_ids)], device=device)  # [1, L]
    mm = {k: (v.to(device, torch.bfloat16) if v.is_floating_point() else v.to(device))
          for k, v in rec["mm_inputs"].items()}
    logits = hf.model(input_ids=ids, attention_mask=torch.ones_like(ids), **mm,
                      **actor.mm_token_types(hf.model, ids, mm)).logits[0].float()
    logits = logits[len(rec["prompt_ids"]) - 1:]  # [R + 1, V]
    logits[:, hf.forbidden_ids] = float("-inf")
    return torch.log_softmax(logits, -1)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(docs, ran_only=False, rows=None, earlier_too=True):
    """Markdown: one line per row, from the last of the kept runs (files in order) that ran it; earlier attempts
    at a row are listed below the table with what stopped them (unless not earlier_too). Every row is judged by
    today's rule (regrade). rows: only these (names as the table shows them)."""
    latest, earlier = {}, []
    for doc in docs:
        for s in (regrade(s) for s in doc["rows"] if rows is None or s["row"] in rows):
            if s["row"] in latest:
                earlier.append(latest[s["row"]])
            latest[s["row"]] = {**s, "doc": doc}
    lines = ["| row | what | steps to target / held from (target) | final val | agreement mean / max | s/step | peak GiB | "
             "result | date |", "|---|---|---|---|---|---|---|---|---|"]
    for name in [n for n in ROWS if n in latest] + [n for n in latest if n not in ROWS]:
        s = latest[name]
        what = s.get("what") or ROWS.get(name, ("", [], 0, name))[3]
        lines.append(
            f"| {name} | {what} | {_fmt(s['steps_to_target'], 'd')} / {_fmt(s['held_from'], 'd')} ({s['target']}) of "
            f"{s['steps']} | "
            f"{_fmt(s['final_val'], '.3f')}{_worst_note(s)} | "
            f"{_fmt(s['diff_mean'], '.1e')} / {_fmt(s['diff_max'], '.2f')} | "
            f"{_fmt(s['sec_per_step'], '.2f')} | {_fmt(s['peak_gb'], '.1f')} | "
            f"{'pass' if not s['failures'] else 'FAIL: ' + '; '.join(s['failures'])}{_parity_note(s)}"
            f"{' (stopped at its target)' if s.get('stopped_at_target') else ''} | "
            f"{s['doc']['date']} |")
    lines += [f"| {name} | {ROWS[name][3]} | - | - | - | - | - | not yet run | - |"
              for name in ROWS if name not in latest and not ran_only]
    ran = sorted({_ran(s["doc"]) for s in latest.values()})
    lines.insert(0, "Ran on: " + "; ".join(ran) + ".\n")
    earlier = earlier if earlier_too else []
    lines += ["\nEarlier attempts (oldest first):\n"] if earlier else []
    passed = [f"{s['row']} ({s['doc']['date']})" for s in earlier if not s["failures"]]
    lines += [f"- passed: {', '.join(passed)}."] if passed else []
    for s in (s for s in earlier if s["failures"]):
        err = [ln for ln in s.get("log_tail", "").splitlines() if "Error" in ln]
        lines.append(f"- {s['row']} ({s['doc']['date']}): {'; '.join(s['failures'])} "
                     f"at step {s['steps']}"
                     + (f", final val {s['final_val']:.3f}" if s["final_val"] is not None else "")
                     + (f" ({err[-1].strip()[-120:]})" if err else "") + ".")
    return "\n".join(lines)


def _worst_note(s):
    w = s.get("worst_class")
    return f" (worst class {w[0]}: {w[1]:.2f})" if w and w[1] < 1 else ""


def _parity_note(s):
    p = s.get("parity")
    if not p:
        return ""
    parted = p.get("parted") or []  # kept since 2026-12-05 d
    margins = [x["hf_margin"] for x in parted if x["hf_margin"] is not None]
    at = ", ".join(sorted({str(x["at"]) for x in parted}))
    agree = f"; {p['greedy_agree']:.3f} with near ties" if "greedy_agree" in p else ""
    where = (f" ({len(parted)} part at token {at}, where the HF model prefers its own by at most {max(margins):.3f} "
             f"nats{agree})" if margins else f" ({len(parted)} part at token {at}{agree})" if parted else "")
    return (f"; greedy = HF engine on {p['greedy_equal']:.3f}{where}, log-prob diff {p['mean']:.1e}, "
            f"worst class {p['worst_class']} {p['worst_mean']:.1e}")


def _ran(doc):
    v = doc["versions"]
    return f"{v.get('gpu')}, vLLM {v.get('vllm')}, torch {v.get('torch')}, transformers {v.get('transformers')}"


def from_log(path):
    """A row's figures from its console log alone (the step lines grpo prints every step, 3 significant digits):
    what is left of a row whose metrics.jsonl a cut call lost (2026-12-04's Gemma 4 row, before rows' metrics were
    kept as they end). Validation: val/accuracy ("vacc") where the log has it, what `run` asserts; else val/mean."""
    steps = [m.group(0) for line in open(path, errors="replace").read().replace("\r", "\n").splitlines()
             if (m := re.search(r"\bstep +\d+ \|.*", line))]
    get = lambda k: [(int(x.split()[1]), float(m.group(1))) for x in steps  # noqa: E731
                     if (m := re.search(rf" {k}=(\S+)", x))]
    diffs, secs = [v for _, v in get("lpdiff")], [v for _, v in get("t_step")][1:]
    return dict(steps=len(steps), val=get("vacc") or get("val"), diff_mean=statistics.fmean(diffs) if diffs else None,
                diff_max_of_means=max(diffs, default=None), sec_per_step=statistics.median(secs) if secs else None)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.matrix", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}; ROW+LABEL runs a "
                   "--variant of ROW, ROW/sN (either) with --seed N")
    r.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="grpo.py flags on top of a row's, for rows named ROW+LABEL (e.g. fp32='--dtype fp32')")
    r.add_argument("--seeds", default="", help="comma-separated: every row once per seed (seed 1 keeps its name)")
    r.add_argument("--out", default=os.environ.get("OUT", "outputs/matrix"))
    r.add_argument("--timeout", type=float, default=540, help="seconds for all rows together")
    r.add_argument("--runs-dir", default="/tmp/matrix_runs", help="the rows' output folders (checkpoints, logs)")
    r.add_argument("--kv-gb", default="2", help="each engine's KV cache in GiB (the demos need well under 0.5: 17 rows "
                   "and the tools test fit one H100 at 0.5)")
    r.add_argument("--parity", action="store_true", help="then each row's final checkpoint: engine = HF engine")
    r.add_argument("--stop-at-target", action="store_true",
                   help="end a row once its last 3 validations hold the target (a short call; no parity)")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    t.add_argument("--ran", action="store_true", help="only the rows the files ran (no 'not yet run' lines)")
    t.add_argument("--rows", default="", help="only these rows, comma-separated (as the table names them)")
    t.add_argument("--last", action="store_true", help="each row's last run alone, no list of earlier attempts")
    c = sub.add_parser("collect", help="rows from kept metrics files, when a call was cut before matrix.json")
    c.add_argument("pairs", nargs="+", metavar="ROW=METRICS_JSONL")
    c.add_argument("--out", required=True)
    c.add_argument("--versions-from", required=True, help="a matrix.json from the same device image")
    g = sub.add_parser("log", help="a row's figures from its console log, when its metrics were lost")
    g.add_argument("file")
    q = sub.add_parser("parity", help="one trained run folder: the engine's answers and log-probs against HF's")
    q.add_argument("run_dir")
    q.add_argument("--engine", default="vllm", help="vllm, or hf (compares the HF engine with itself: a CPU check)")
    q.add_argument("--json", default=None, help="write the summary here")
    a = ap.parse_args(argv)
    if a.cmd == "log":
        return print(json.dumps(from_log(a.file)))
    if a.cmd == "parity":
        res = parity(a.run_dir, a.engine)
        print(json.dumps(res, indent=1))
        if a.json:
            rundir.write_atomic(a.json, json.dumps(res, indent=1))
        return 0 if not res["failures"] else 1
    if a.cmd == "collect":
        print(collect(a.pairs, a.out, a.versions_from))
        return 0
    if a.cmd == "table":
        print(table([json.load(open(f)) for f in a.files], a.ran, a.rows.split(",") if a.rows else None, not a.last))
        return 0
    VARIANTS.update(v.split("=", 1) for v in a.variant)
    ENGINE[ENGINE.index("--kv-cache-memory-gb") + 1] = a.kv_gb
    names = [n + (f"/s{seed}" if seed != "1" else "") for n in a.rows.split(",") if n
             for seed in (a.seeds.split(",") if a.seeds else ["1"])]
    unknown = [n for n in names if n.partition("/s")[0].partition("+")[0] not in ROWS
               or n.partition("/s")[0].partition("+")[2] not in ("", *VARIANTS)]
    if unknown:
        ap.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)} (+LABEL of a --variant)")
    return 0 if run(names, a.out, a.timeout, a.runs_dir, a.parity, a.stop_at_target) else 1


if __name__ == "__main__":
    sys.exit(main())
