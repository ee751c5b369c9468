"""matrix.py: what a row must show to pass, the run's verdict, and the kept H200 results quoted in
BENCHMARKS as generated (not hand-copied)."""
import glob
import json
import os
import subprocess
import sys
import time
import types

from benchmarks import matrix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEPT = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "h200", "matrix_*.json")))


def write_metrics(path, val, diff=1e-3, skipped=0, steps=20):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            row = {"step": step, "timing/step": 1.0, "rollout/logprob_diff_mean": diff,
                   "rollout/logprob_diff_max": 10 * diff, "actor/skipped_steps_total": skipped if step == steps else 0}
            if step % 10 == 0:
                row["val/mean"] = row["val/accuracy"] = val[step // 10 - 1]
            f.write(json.dumps(row) + "\n")


def test_the_stalled_qwen3vl_run_fails_its_row():
    path = os.path.join(ROOT, "tests/data/qwen3vl_stalled_before_seed_fix_2026-12-01_metrics.jsonl")
    s = matrix.summarize("qwen3vl_colour", path, 0.95)
    assert s["final_val"] == 0.755 and s["steps_to_target"] is None
    assert s["failures"] == ["validation never reached 0.95 (last 0.755)"]


def test_each_bar_fails_a_row(tmp_path):
    p = str(tmp_path / "m.jsonl")
    write_metrics(p, [0.5, 0.96, 1.0, 0.95], steps=40)
    s = matrix.summarize("r", p, 0.95)
    assert s["failures"] == [] and s["steps_to_target"] == 20 and s["held_from"] == 20
    write_metrics(p, [0.5, 0.96, 1.0, 0.95], diff=6e-3, steps=40)
    assert "log-prob difference" in " ".join(matrix.summarize("r", p, 0.95)["failures"])
    write_metrics(p, [0.5, 0.96, 1.0, 0.95], skipped=2, steps=40)
    assert matrix.summarize("r", p, 0.95)["failures"] == ["2 optimizer steps skipped"]
    assert "never reached" in matrix.summarize("r", str(tmp_path / "missing.jsonl"), 0.95)["failures"][0]


# Gemma 4's row on one H100 (vLLM 0.26, 2026-12-05): 0.77 from step 30 to 70, 1.0 once at 80, then a colour lost
GEMMA4_H100 = [0.25, 0.5, 0.77, 0.77, 0.77, 0.77, 0.77, 1.0, 0.915, 0.915, 0.77, 0.77, 0.77, 0.77, 0.77]


def test_a_row_that_touches_its_target_and_falls_back_fails(tmp_path):
    """The rule is the end, not a touch: the Gemma 4 curve above reached 1.0 at step 80 and ended at 0.77 (blue
    answered "white"); under the old rule (a validation at the target, once) it printed PASS."""
    p = str(tmp_path / "m.jsonl")
    write_metrics(p, GEMMA4_H100, steps=150)
    s = matrix.summarize("gemma4_colour", p, 0.95)
    assert s["steps_to_target"] == 80 and s["held_from"] is None and s["final_val"] == 0.77
    assert s["failures"] == ["validation reached 0.95 at step 80 but did not hold it: the last 3 of 15 0.770, 0.770, "
                             "0.770 (all 3 must be at it)"]
    # a dip in the last three fails too; a dip before them does not (held from the step after it)
    write_metrics(p, [0.5, 1.0, 0.77, 1.0, 0.96, 1.0], steps=60)
    assert not matrix.summarize("r", p, 0.95)["failures"] and matrix.summarize("r", p, 0.95)["held_from"] == 40
    write_metrics(p, [0.5, 1.0, 1.0, 1.0, 0.9, 1.0], steps=60)
    assert "did not hold" in matrix.summarize("r", p, 0.95)["failures"][0]
    write_metrics(p, [1.0, 1.0], steps=20)  # fewer validations than the rule reads: not shown to hold
    assert "did not hold" in matrix.summarize("r", p, 0.95)["failures"][0]
    # the table re-grades kept rows by this rule (a row kept with no validation failure)
    kept = {**s, "failures": []}
    assert "FAIL: validation reached 0.95 at step 80 but did not hold it" in matrix.table(
        [dict(date="d", versions={}, rows=[kept])])


def test_the_worst_class_of_the_last_validation(tmp_path):
    """val_samples.jsonl beside the metrics: the class answered worst at the last validation is named in the table
    (a final 0.84 of four colours is one colour half lost)."""
    p = str(tmp_path / "m.jsonl")
    write_metrics(p, [0.5, 0.9])
    with open(tmp_path / "val_samples.jsonl", "w") as f:
        for step, wrong in ((10, "red"), (20, "white")):
            for answer in ("red", "white", "blue"):
                for k in range(4):
                    acc = 0.0 if answer == wrong and k < 3 else 1.0
                    f.write(json.dumps({"step": step, "answer": answer, "accuracy": acc}) + "\n")
    s = matrix.summarize("r", p, 0.95)
    assert s["worst_class"] == ("white", 0.25)
    assert "(worst class white: 0.25)" in matrix.table([dict(date="d", versions={}, rows=[s])])


def test_collect_rebuilds_a_cut_call_from_kept_metrics(tmp_path):
    """A call cut before matrix.json was written: `collect` makes the rows from the kept NAME_metrics.jsonl files
    (each row's own bars, its worst class from NAME_val_samples.jsonl) with the versions of the named matrix.json."""
    good, bad = str(tmp_path / "qwen2vl_colour_metrics.jsonl"), str(tmp_path / "qwen3vl_video_metrics.jsonl")
    write_metrics(good, [0.5, 0.96, 0.97, 1.0], steps=40)
    write_metrics(bad, [0.5, 0.9])
    with open(tmp_path / "qwen3vl_video_val_samples.jsonl", "w") as f:
        f.writelines(json.dumps({"step": 20, "answer": a, "accuracy": float(a != "red")}) + "\n"
                     for a in ("red", "blue"))
    (tmp_path / "v.json").write_text(json.dumps({"versions": {"vllm": "0.26.0", "gpu": "G"}, "rows": []}))
    text = matrix.collect([f"qwen2vl_colour={good}", f"qwen3vl_video={bad}"], str(tmp_path / "o"),
                          str(tmp_path / "v.json"))
    doc = json.load(open(tmp_path / "o" / "matrix.json"))
    assert doc["versions"] == {"vllm": "0.26.0", "gpu": "G"} and "vLLM 0.26.0" in text
    rows = {r["row"]: r for r in doc["rows"]}
    assert rows["qwen2vl_colour"]["failures"] == [] and rows["qwen2vl_colour"]["steps_to_target"] == 20
    assert "never reached" in rows["qwen3vl_video"]["failures"][0]
    assert rows["qwen3vl_video"]["worst_class"] == ["red", 0.0]
    assert "--demo-model qwen2_vl" in rows["qwen2vl_colour"]["command"]


# a stand-in row: writes a metrics file like a demo's (--steps steps at --val), after --delay s, then lives --after s
FAKE_ROW = ("import json, os, sys, time\n"
            "arg = lambda k, d: float(sys.argv[sys.argv.index(k) + 1]) if k in sys.argv else d\n"
            "out = sys.argv[sys.argv.index('--output-dir') + 1]\n"
            "time.sleep(arg('--delay', 0))\n"
            "os.makedirs(os.path.join(out, 'checkpoints'))\n"
            "with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:\n"
            "    for s in range(1, int(arg('--steps', 2)) + 1):\n"
            "        f.write(json.dumps({'step': s, 'timing/step': 1.0, 'rollout/logprob_diff_mean': 1e-3,\n"
            "                            'val/mean': arg('--val', 1.0)}) + '\\n')\n"
            "time.sleep(arg('--after', 0))\n")


def test_run_fails_when_a_row_fails(tmp_path, monkeypatch):
    """Two stand-in rows (a script that writes a metrics file like a demo's): the run passes only if both do."""
    script = tmp_path / "fake_demo.py"
    script.write_text(FAKE_ROW)
    monkeypatch.setattr(matrix, "ENGINE", [])
    # no tiny models to build, no nvidia-smi to ask
    monkeypatch.setattr(matrix.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=""))
    monkeypatch.setattr(matrix.time, "sleep", lambda s: None)
    monkeypatch.setattr(matrix, "ROWS", {"good": (str(script), ["--val", "1.0", "--steps", "3"], 0.95, "passes"),
                                         "bad": (str(script), ["--val", "0.5", "--steps", "3"], 0.95, "stalls")})
    out = tmp_path / "out"
    assert matrix.run(["good"], str(out), 60, str(tmp_path / "runs1"))
    assert not matrix.run(["good", "bad"], str(out), 60, str(tmp_path / "runs2"))
    doc = json.load(open(out / "matrix.json"))
    assert [r["failures"] for r in doc["rows"]] == [[], ["validation never reached 0.95 (last 0.5)"]]
    assert sys.executable and doc["versions"]["torch"]
    # each row's metrics kept beside matrix.json as it ends (a cut call lost a passing row's, 2026-12-04)
    assert matrix.summarize("bad", str(out / "bad_metrics.jsonl"), 0.95)["final_val"] == 0.5


def test_benchmarks_quotes_the_generated_matrix_and_readme_links_it():
    assert KEPT, "no kept matrix run in benchmarks/h200"
    docs = [json.load(open(f)) for f in KEPT]
    text = matrix.table(docs, earlier_too=False)
    assert text in open(os.path.join(ROOT, "benchmarks", "BENCHMARKS.md")).read(), "benchmarks/BENCHMARKS.md: " \
        "paste `python -m benchmarks.matrix table benchmarks/h200/matrix_*.json --last`"
    # README quotes its results through a link (tests/test_docs.py: the link reaches the table's heading)
    assert "(benchmarks/BENCHMARKS.md#learning-matrix" in open(os.path.join(ROOT, "README.md")).read()
    latest = {r["row"]: r for d in docs for r in d["rows"]}
    # a kept row that failed stays, marked FAIL in the table (gemma4_colour); ROW/sN and ROW+LABEL are ROW's runs
    assert {r.partition("/s")[0].partition("+")[0] for r in latest} <= set(matrix.ROWS)
    for name in set(matrix.ROWS) - set(latest):  # a row added since the last GPU run says so in the table
        assert f"| {name} | {matrix.ROWS[name][3]} | - | - | - | - | - | not yet run | - |" in text


def test_the_table_can_show_some_rows_and_leave_out_earlier_attempts():
    docs = [json.load(open(f)) for f in KEPT]
    assert "Earlier attempts" in matrix.table(docs) and "Earlier attempts" not in matrix.table(docs, earlier_too=False)
    lines = [ln for ln in matrix.table(docs, True, ["qwen3_text", "lora"]).splitlines() if ln.startswith("| ")]
    assert [ln.split(" | ")[0] for ln in lines[1:]] == ["| qwen3_text", "| lora"], lines


def test_parity_of_a_trained_run_on_the_cpu(tmp_path):
    """The parity check's plumbing (the run's config and last checkpoint, merged; its validation prompts; greedy
    answers and sampled log-probs per prompt class) with the HF engine on both sides: equal answers, tiny gaps."""
    import subprocess
    run = str(tmp_path / "run")
    # no torch.distributed variables of this process (a test before may have set up a 1-rank group) in the children
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT
    subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), "--max-steps", "1", "--save-freq", "0",
                    "--val-freq", "0", "--val-max-rows", "6", "--rollout-batch-size", "4", "--global-batch-size", "4",
                    "--n", "4", "--output-dir", run], check=True, env=env, capture_output=True)
    out = str(tmp_path / "parity.json")
    subprocess.run([sys.executable, "-m", "benchmarks.matrix", "parity", run, "--engine", "hf", "--json", out],
                   cwd=ROOT, check=True, env=env, capture_output=True)
    p = json.load(open(out))
    assert p["prompts"] == 6 and p["greedy_equal"] == 1.0 and p["failures"] == []
    assert 6 * 4 <= sum(c["tokens"] for c in p["classes"].values()) <= 6 * 4 * 4  # 4 samples, 1 to 4 tokens each
    assert p["worst_mean"] < 5e-2 and p["worst_class"] in p["classes"]
    assert p["parted"] == []  # equal greedy answers: no place where they part
    # an engine whose first greedy token differs: the HF model's own greedy token is ahead of it there
    import torch
    import data
    import fsdp_actor
    import rollout
    from config import Config
    fsdp_actor.init_distributed()  # (load_datasets' collectives)
    cfg = Config(**{k: v for k, v in json.load(open(os.path.join(run, "config.json"))).items()
                    if k in Config.__dataclass_fields__})
    hf_dir = os.path.join(run, "hf")
    _, _, val = data.load_datasets(cfg, hf_dir)
    recs = [val[0], val[1]]
    hf = rollout.HFRollout(hf_dir, "cpu", torch.float32)
    greedy = [g[0]["response_ids"] for g in hf.generate(recs, 1, 0.0, 1.0, 4, [0, 1])]
    other = [[g[0] + 1] + g[1:] for g in greedy]
    parted = matrix.where_answers_part(hf, hf_dir, recs, other, greedy, "cpu")
    assert [x["at"] for x in parted] == [0, 0] and all(x["hf_margin"] >= 0 for x in parted), parted
    assert matrix.where_answers_part(hf, hf_dir, recs, greedy, greedy, "cpu") == []


def test_where_two_greedy_answers_part():
    assert matrix.first_difference([5, 6, 7], [5, 8, 7]) == 1
    assert matrix.first_difference([5, 6], [5, 6, 9]) == 2 and matrix.first_difference([4], [5]) == 0
    # the table says where and by how much (a near tie: a margin within bf16's noise)
    part = dict(answer="blue", engine="blue x", hf="blue y")
    p = dict(greedy_equal=0.98, mean=1e-3, worst_class="blue", worst_mean=2e-3,
             parted=[dict(part, at=3, hf_margin=0.012), dict(part, at=2, hf_margin=0.004)])
    note = matrix._parity_note(dict(parity=p))
    assert "2 part at token 2, 3, where the HF model prefers its own by at most 0.012 nats)" in note
    p["greedy_agree"] = 1.0
    assert "at most 0.012 nats; 1.000 with near ties)" in matrix._parity_note(dict(parity=p))
    del p["greedy_agree"]
    # the bar counts a parting at a near tie as agreement, a wide margin (or a missing one) as a difference
    p["prompts"] = 100
    assert matrix.parity_failures(p) == [] and p["greedy_agree"] == 1.0
    p["parted"][0]["hf_margin"] = 2 * matrix.NEAR_TIE
    assert matrix.parity_failures(p) == [] and p["greedy_agree"] == 0.99
    p["parted"][1]["hf_margin"] = None
    assert "0.980 of prompts, 0.000 more at a near tie" in matrix.parity_failures(p)[0]
    # a kept row is re-graded by the same bar (one before `parted` was kept: equal answers only)
    row = dict(val=[(10, 1.0), (20, 1.0), (30, 1.0)], target=0.95, steps_to_target=10, final_val=1.0, parity=dict(p, parted=[]),
               failures=["greedy answers equal ... (bar 0.99)"])
    assert matrix.regrade(row)["failures"] == matrix.parity_failures(dict(p, parted=[])) != []
    row["parity"]["parted"] = [dict(part, at=1, hf_margin=0.05)] * 2
    assert matrix.regrade(row)["failures"] == []


def test_a_rows_parity_check_starts_when_the_row_ends(tmp_path, monkeypatch):
    """With --parity, a fast row's check runs while a slow row still trains (run f lost every check when the
    slowest row ended at the call's limit); each row gets its check's summary, and matrix.json exists before the
    checks end."""
    script = tmp_path / "fake_demo.py"
    script.write_text(FAKE_ROW)
    check = tmp_path / "fake_parity.py"
    check.write_text("import json, sys\n"
                     "json.dump({'failures': [], 'greedy_equal': 1.0, 'mean': 1e-4, 'worst_class': 'red',\n"
                     "           'worst_mean': 2e-4}, open(sys.argv[1], 'w'))\n")
    monkeypatch.setattr(matrix, "ENGINE", [])
    monkeypatch.setattr(matrix.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=""))
    monkeypatch.setattr(matrix.time, "sleep", lambda s: None)
    monkeypatch.setattr(matrix.rundir, "latest_checkpoint", lambda d: os.path.isdir(d) or None)
    monkeypatch.setattr(matrix, "launch_parity", lambda run_dir, path: subprocess.Popen(
        [sys.executable, str(check), path]))
    monkeypatch.setattr(matrix, "ROWS", {"fast": (str(script), ["--delay", "0", "--steps", "3"], 0.95, "fast"),
                                         "slow": (str(script), ["--delay", "4", "--steps", "3"], 0.95, "slow")})
    out = tmp_path / "out"
    assert matrix.run(["slow", "fast"], str(out), 60, str(tmp_path / "runs"), with_parity=True)
    rows = {r["row"]: r for r in json.load(open(out / "matrix.json"))["rows"]}
    assert rows["fast"]["parity_started"] < rows["slow"]["seconds"] - 1, rows
    assert all(r["parity"]["greedy_equal"] == 1.0 and not r["failures"] for r in rows.values())


def test_stop_at_target_ends_a_row_as_a_pass(tmp_path, monkeypatch):
    """--stop-at-target (a short call): a row whose last 3 validations hold its target is ended and passes; the same
    row without it runs on until --timeout cuts it and fails; a row below target is never stopped, nor one that
    touched it only once."""
    script = tmp_path / "fake_demo.py"
    script.write_text(FAKE_ROW)
    monkeypatch.setattr(matrix, "ENGINE", [])
    monkeypatch.setattr(matrix.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=""))
    monkeypatch.setattr(matrix.time, "sleep", lambda s: None)
    monkeypatch.setattr(matrix, "ROWS", {"good": (str(script), ["--val", "1.0", "--steps", "3", "--after", "60"], 0.95,
                                                  "reaches"),
                                         "once": (str(script), ["--val", "1.0", "--steps", "2", "--after", "60"], 0.95,
                                                  "touches"),
                                         "low": (str(script), ["--val", "0.5", "--steps", "1", "--after", "60"], 0.95,
                                                 "stalls")})
    t0 = time.time()
    assert matrix.run(["good"], str(tmp_path / "a"), 20, str(tmp_path / "r1"), stop_at_target=True)
    assert time.time() - t0 < 15
    row = json.load(open(tmp_path / "a" / "matrix.json"))["rows"][0]
    assert row["stopped_at_target"] and row["steps_to_target"] == 1 and row["held_from"] == 1
    assert "(stopped at its target)" in matrix.table([json.load(open(tmp_path / "a" / "matrix.json"))])
    assert not matrix.run(["good"], str(tmp_path / "b"), 3, str(tmp_path / "r2"))  # cut: an exit code
    assert not matrix.run(["low"], str(tmp_path / "c"), 3, str(tmp_path / "r3"), stop_at_target=True)
    assert not matrix.run(["once"], str(tmp_path / "d"), 3, str(tmp_path / "r4"), stop_at_target=True)


def test_a_rows_figures_from_its_log_alone(tmp_path):
    """`matrix.py log`: the step lines among tqdm's carriage returns and vLLM's lines (a cut call's only record)."""
    log = tmp_path / "row.log"
    log.write_text("INFO vllm started\ngrpo:  1%|          | 1/150\r                step    1 | reward=0.1 "
                   "lpdiff=0.002 t_step=9\nstep    2 | reward=0.2 lpdiff=0.004 t_step=1\rgrpo: 2/150\rstep   10 | "
                   "reward=0.5 val=0.77 lpdiff=0.003 t_step=3\n[best] step_10\n")
    got = matrix.from_log(str(log))
    assert got["steps"] == 3 and got["val"] == [(10, 0.77)] and got["sec_per_step"] == 2
    assert abs(got["diff_mean"] - 0.003) < 1e-12 and got["diff_max_of_means"] == 0.004
    # a demo whose reward is not its accuracy (the zoom row: val=0.2 for the call alone): run asserts val/accuracy
    log.write_text("step   10 | reward=0.5 val=0.788 vacc=0.735 lpdiff=0.003 t_step=3\n")
    assert matrix.from_log(str(log))["val"] == [(10, 0.735)]


def test_a_variant_and_a_seed_of_a_row(monkeypatch):
    """ROW+LABEL runs ROW with the --variant's flags on top, ROW/sN with --seed N (the runs that look for a cause)."""
    monkeypatch.setitem(matrix.VARIANTS, "fp32hf", "--rollout-engine hf --dtype fp32")
    script, flags, target, what = matrix.spec("gemma4_colour+fp32hf/s2")
    assert (script, target) == ("grpo.py", 0.95) and matrix.slug("gemma4_colour+fp32hf/s2") == "gemma4_colour-fp32hf_s2"
    assert flags == ["--demo-model", "gemma4", "--rollout-engine", "hf", "--dtype", "fp32", "--seed", "2"]
    assert what == "Gemma 4 colour (generic path), --rollout-engine hf --dtype fp32, seed 2"
    assert matrix.spec("dapo") == ("dapo.py", [], 0.95, "dapo.py, Qwen2.5-VL colour")
