"""bench.py engine-ablation (engine_bench.py): the rows against a stand-in vLLM, the second engine's command, and the
engine loop's timers, stack looks and py-spy table that say where a step's generation goes."""
import collections
import gc
import json
import lzma
import os
import subprocess
import sys
import time
from dataclasses import replace

import data
import grpo
import tiny_model
from benchmarks import bench, engine_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (python -m benchmarks.bench runs from here)


# ------------------------------------------------------------------------------------------- engine-ablation
ADDS = {"bare": set(), "logprobs": {"logprobs"}, "seeds": {"seed"},
        "banned": {"logit_bias"}, "sleep_wake": set(), "sync_sleep1": set(), "sync_sleep2": set()}
# (what each engine-level row's requests add to bare's)


def test_engine_ablation_rows_differ_from_bare_by_their_addition_alone(tmp_path, monkeypatch):
    """bench.py engine-ablation against a stand-in vLLM (tests/vllm_standin.py) that records every request: the rows
    are the step's requests (grpo's prompts and seeds) with VLLMRollout's switches; each engine-level row's
    SamplingParams differ from bare's in exactly its own fields, bare plus all the additions is what
    VLLMRollout.generate sends (all_ours), every timed row starts cold, the sleep rows wake before generating and
    sleep after, all_ours_gc_on is all_ours with Python's collector on in vLLM's loop (off in all_ours),
    all_ours_lp_all_n asks one request per prompt (all_ours splits a chosen prompt's), all_ours_no_lp is
    all_ours_lp_all_n without log-probs, all_ours_early queues all_ours's requests while asleep and runs them after
    the wake, and the table and JSON hold every row."""
    from vllm_standin import StandInLLM, standin_vllm
    seen, built = standin_vllm(monkeypatch)
    collector, standin_generate = [], StandInLLM.generate
    monkeypatch.setattr(StandInLLM, "generate", lambda self, *a, **k: collector.append(gc.isenabled())
                        or standin_generate(self, *a, **k))
    path = tiny_model.build_tiny_model()
    proc = data.load_processor(path)
    parquet = bench.make_geo_dataset(str(tmp_path / "geo.parquet"), 4, proc.tokenizer, size=112, text_tokens=20)
    cfg = replace(bench.defaults(str(tmp_path), path, parquet), rollout_batch_size=3, n=4, max_response_length=6,
                  min_pixels=56 * 56, max_pixels=112 * 112, rollout_engine="vllm", output_dir=str(tmp_path / "run"))
    result = engine_bench.run(cfg, warmup_tokens=2, bare_memory_share=0)
    assert seen["gpu_memory_utilization"] == cfg.gpu_memory_utilization  # the engine has bench's settings
    rows = list(engine_bench.ROWS)[:-1]  # all but memory_share (no second engine asked for)
    assert list(result["rows"]) == rows and result["model_runner"] == "V2"
    (eng,) = built
    calls, ev = eng.llm.calls, eng.llm.events
    names = list(ADDS) + ["all_ours"]
    # the warm-up (all_ours first), a timed round in ROWS' order, the variants, all_ours_early's queued requests
    assert len(calls) == 2 * len(names) + 4 and calls[-1].get("queued") and ev[-1] == "sleep"
    ours_params = [vars(p) for p in calls[len(names) + names.index("all_ours")]["params"]]
    assert [vars(p) for p in calls[-4]["params"]] == ours_params == [vars(p) for p in calls[-1]["params"]]  # gc_on
    # all_ours_early: queued while asleep, then the weights' wake (untimed), the KV cache's, and run, not sent again
    assert ev[ev.index("enqueue") - 1] == "sleep" and ev[ev.index("enqueue"):] == [
        "enqueue", "wake", "wake", "wait", "reset_prefix", "reset_encoder", "sleep"] and eng.llm.woken[-2:] == [
        ["weights"], ["kv_cache"]]
    assert collector[0] is False and collector[len(names) + names.index("all_ours")] is False
    assert collector[-3:] == [True, False, False] and gc.isenabled()
    assert [dict(vars(p), logprobs=None) for p in calls[-3]["params"]] == [vars(p) for p in calls[-2]["params"]]
    assert engine_bench.rollout.collector_paused is not None and engine_bench.grpo.logprob_samples(cfg) == 1
    assert all(p.max_tokens == 2 for c in calls[:len(names)] for p in c["params"])
    by_row = dict(zip(names, calls[len(names):]))
    assert all(p.max_tokens == 6 and p.temperature == 1.0 for c in by_row.values() for p in c["params"])
    assert all(p.n == 4 for name, c in by_row.items() for p in c["params"] if name != "all_ours")

    def diff(a, b):
        return {f for f in a.__struct_fields__ if getattr(a, f) != getattr(b, f)}  # every field vLLM gets
    split, bare, ours = by_row["all_ours"]["params"], by_row["bare"]["params"], calls[-3]["params"]  # lp_all_n
    assert [engine_bench.params_summary(p) for p in split] == result["ours_sent"]
    assert all(p.seed is None and p.logprobs is None and p.logit_bias is None and p.detokenize is False
               and p.stop_token_ids == eng.eos_ids for p in bare)
    # all_ours: the chosen prompt's first sample asks for log-probs, its other 3 come from a second request seeded 1
    # further (the samples vLLM would draw as one request's 2nd to 4th); the rest as all_ours_lp_all_n sends them
    assert [(p.n, p.seed, p.logprobs) for p in split[:2]] == [(1, ours[0].seed, 0), (3, ours[0].seed + 1, None)]
    assert diff(split[0], ours[0]) == {"n"} and [vars(p) for p in split[2:]] == [vars(p) for p in ours[1:]]
    assert by_row["all_ours"]["reqs"][1:] == calls[-3]["reqs"] == by_row["all_ours"]["reqs"][:1] + \
        by_row["all_ours"]["reqs"][2:]
    for name, c in by_row.items():
        assert name == "all_ours" or c["reqs"] == calls[-3]["reqs"] and len(c["reqs"]) == 3  # same prompts, order
        if name != "all_ours":
            assert [diff(p, b) for p, b in zip(c["params"], bare)] == [ADDS[name]] * 3, name
    union = set().union(*ADDS.values())
    # step 1's prompts are stream positions 0, 1, 2: only position 0 is one of the K-th (grpo.logprobs_every: 8)
    assert grpo.logprobs_every(cfg) == 8 and [o.logprobs for o in ours] == [0, None, None]
    for i, o in enumerate(ours):
        # generate adds these and nothing else: no addition lacks its row
        assert diff(o, bare[i]) == (union if i == 0 else union - {"logprobs"})
        for name, added in ADDS.items():  # ... and each with the value its row has
            if name == "logprobs" and i > 0:
                continue
            assert all(getattr(o, f) == getattr(by_row[name]["params"][i], f) for f in added), name
    # cold: every generate finds the caches emptied since the one before; the sleep rows wake, then sleep
    gens = [i for i, e in enumerate(ev) if e == "generate"]
    for a, b in zip(gens, gens[1:]):
        assert {"reset_prefix", "reset_mm", "reset_encoder"} <= set(ev[a + 1:b]), ev[a + 1:b]
    for k, name in enumerate(names):
        at = gens[len(names) + k]
        span = ev[ev.index("reset_mm", gens[len(names) + k - 1]):at]  # from the reset to the timed generate
        if name in ("sleep_wake", "all_ours", "sync_sleep1", "sync_sleep2"):
            assert "sleep" in span and span[-1] == "wake" and "sleep" in ev[at + 1:at + 5], (name, span)
            woken = eng.llm.woken[:ev[:at].count("wake")]  # what each wake before this generate mapped
            # all_ours: the weights first (untimed: a step's sync wakes them), then the KV cache (timing/gen's wake)
            assert woken[-2:] == [["weights"], ["kv_cache"]] if name == "all_ours" else \
                woken[-1] == ["weights", "kv_cache"] or name.startswith("sync"), (name, woken[-2:])
            assert ("load" in span) == name.startswith("sync"), (name, span)  # the sync rows sync first
        else:
            assert "sleep" not in span, (name, span)
    # the sync rows stream the checkpoint's every weight; level 2's sleeps are level 2 and its row re-sends them after
    # (untimed: the next row needs them): per round (the warm-up, one timed) 1 + 2 syncs, 2 level-2 sleeps
    keys = sorted(engine_bench.checkpoint_on_gpu(path, "cpu"))
    assert len(eng.llm.loaded) == 2 * 3 and all(sorted(x) == keys for x in eng.llm.loaded)
    assert eng.llm.levels.count(2) == 2 * 2 and eng.sleep_level == 1 and not eng.weights_lost
    saved = json.load(open(tmp_path / "run" / "engine_ablation.json"))
    assert list(saved["rows"]) == rows and saved["rows"]["bare"]["tokens"] == 3 * 4 * 6
    assert saved["rows"]["all_ours_scored"]["seconds"] >= saved["rows"]["all_ours"]["seconds"]
    table = engine_bench.table(saved)
    assert table.count("\n") == len(rows) + 1 and "| bare | nothing" in table and "| 1.000 |" in table
    two = {"bare": dict(saved["rows"]["bare"], seconds=15, runs=[10, 20]), "seeds": dict(saved["rows"]["seeds"],
                                                                                      seconds=16.5, runs=[11, 22])}
    assert "| 1.100 | 1.100, 1.100 |" in engine_bench.table(dict(saved, rows=two))  # each round against its own bare
    # memory_share: the engine sleeps (room for the second one), whose bare row joins the table
    children = []

    def child(cmd, out_dir):
        children.append((cmd, list(ev)))
        bare = json.load(open(tmp_path / "run" / "engine_ablation.json"))["rows"]["bare"]  # this run's, written
        return dict(bare, seconds=2 * bare["seconds"])
    monkeypatch.setattr(engine_bench, "run_child", child)
    got = engine_bench.run(cfg, ["bare", "memory_share"], warmup_tokens=2, bare_memory_share=0.6, argv=["x"])
    ((cmd, events),) = children
    assert events[-1] == "sleep" and cmd[-4:] == ["--gpu-memory-utilization", "0.6", "--output-dir",
                                                 str(tmp_path / "run" / "memory_share")]
    assert list(got["rows"]) == ["bare", "memory_share"]
    assert got["rows"]["memory_share"]["gpu_memory_utilization"] == 0.6
    assert "| memory_share | bare, at the bare engine's share of GPU memory (0.6 instead of 0.5) |" in \
        engine_bench.table(got) and "| 2.000 |" in engine_bench.table(got)


def test_bench_main_passes_the_engine_ablation_options(tmp_path, monkeypatch):
    """`python -m benchmarks.bench engine-ablation ...`: bench.py's preset and grpo's flags make the config, the
    ablation's own options reach engine_bench.run, and the whole command line goes to the memory_share child."""
    got = {}
    monkeypatch.setenv("BENCH_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "build_random_model", lambda path, preset, **kw: None)
    (tmp_path / "geo-v2.parquet").write_text("")
    monkeypatch.setattr(engine_bench, "run", lambda cfg, *a: got.update(cfg=cfg, args=a))
    monkeypatch.setattr(bench.dist, "destroy_process_group", lambda: None)
    argv = ["engine-ablation", "--preset", "qwen2_5_vl_3b", "--rows", "bare,seeds", "--repeats", "2",
            "--bare-memory-share", "0.7", "--sample-stacks", "5", "--n", "4", "--output-dir", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", ["bench.py"] + argv)
    bench.main()
    assert got["args"] == (["bare", "seeds"], 2, 32, 0.7, argv, 5.0)
    cfg = got["cfg"]
    assert (cfg.n, cfg.output_dir, cfg.rollout_batch_size, cfg.max_response_length) == (4, str(tmp_path / "o"), 64,
                                                                                         1024)


def test_sampled_stacks_say_where_the_calling_thread_spends_its_time():
    """--sample-stacks: the seconds looked at land in the function that held the thread (here a Python busy loop,
    then a sleep, the stand-ins for the engine's Python work and a wait on the GPU), each close to its share of the
    time although the busy loop holds the GIL and delays the looks; 0: no looks."""

    def busy_python(t):
        end = time.perf_counter() + t
        while time.perf_counter() < end:
            pass

    def wait_on_gpu(t):
        time.sleep(t)

    counts = collections.Counter()
    with engine_bench.sampled_stacks(counts, 0.005):
        busy_python(0.3)
        wait_on_gpu(0.3)
    total = counts.pop("*")
    assert 0.5 < total < 0.7, total
    mine = {k.split(" < ")[0].rsplit(" ", 1)[1]: c for k, c in counts.items()}  # innermost function -> seconds
    assert 0.4 < mine.get("busy_python", 0) / total < 0.6 and 0.4 < mine.get("wait_on_gpu", 0) / total < 0.6, counts
    assert all(" < " in k and "test_engine_bench.py" in k for k in counts if "busy_python" in k)
    none = collections.Counter()
    with engine_bench.sampled_stacks(none, 0):
        busy_python(0.05)
    assert not none
    table = engine_bench.stack_table({"rows": {"bare": {"stacks": {"*": 4, "a.py:1 f < b.py:2 g": 3, "c:3 h": 1}}}})
    assert table.splitlines() == ["bare (4.0 s looked at):", "   75.0%  a.py:1 f < b.py:2 g", "   25.0%  c:3 h"]


def test_engine_ablation_memory_share_row_runs_bare_alone_in_a_second_engine():
    """The memory_share row's child: this run's arguments, with the bare engine's share, the bare row alone and its
    own output folder in place of what this run was given (bench.py reads an option's first spelling)."""
    argv = ["engine-ablation", "--preset", "qwen2_5_vl_3b", "--gpu-memory-utilization", "0.5", "--rows=bare,seeds",
            "--repeats", "2", "--output-dir", "/o", "--max-steps", "3", "--bare-memory-share", "0.6"]
    cmd = engine_bench.child_command(argv, 0.6, "/o/memory_share")
    assert cmd[:3] == [sys.executable, "-m", "benchmarks.bench"]
    assert cmd[3:] == ["engine-ablation", "--preset", "qwen2_5_vl_3b", "--max-steps", "3", "--rows", "bare",
                       "--repeats", "1", "--bare-memory-share", "0", "--gpu-memory-utilization", "0.6",
                       "--output-dir", "/o/memory_share"]


def test_engine_loop_timers_split_the_loop_into_host_and_gpu_wait():
    """engine_loop_timers on a stand-in of vLLM's in-process loop (LLMEngine.step -> the scheduler, the executor's
    launches, the sampled tokens' future, the scheduler's update, the output processor) and its intake of requests
    (LLMEngine.add_request): each part's seconds, the wait inside the future's result, the step count; afterwards the
    objects are as before; no engine: nothing."""
    from concurrent.futures import Future
    from types import SimpleNamespace as NS

    def pause(t):
        def f(*a, **k):
            time.sleep(t)
        return f

    class Gpu(Future):  # vLLM's AsyncOutputFuture: result() waits for the GPU's copy of the sampled tokens
        def result(self, timeout=None):
            time.sleep(0.02)
            return ["tokens"]

    class Executor:
        def execute_model(self, out, non_block=False):
            time.sleep(0.001)
            return Future()

        def sample_tokens(self, grammar, non_block=False):
            return Gpu()

    sched = NS(schedule=pause(0.003), update_from_output=pause(0.002))
    core = NS(scheduler=sched, model_executor=Executor())
    outputs = NS(process_outputs=pause(0.004))

    class Engine:
        output_processor, engine_core, add_request = outputs, NS(engine_core=core), pause(0.006)

        def step(self):
            s = core.scheduler.schedule()
            core.model_executor.execute_model(s, non_block=True)
            assert core.model_executor.sample_tokens(None, non_block=True).result() == ["tokens"]
            core.scheduler.update_from_output(s, None)
            return self.output_processor.process_outputs([])

    llm = NS(llm_engine=Engine())
    before = {id(o): dict(vars(o)) for o in (sched, outputs, core.model_executor, llm.llm_engine)}
    with engine_bench.engine_loop_timers(llm, {}) as t:
        for _ in range(5):
            llm.llm_engine.add_request("id", "prompt", None)
            llm.llm_engine.step()
    assert t["steps"] == 5
    for key, each in (("wait", 0.02), ("schedule", 0.003), ("update", 0.002), ("outputs", 0.004), ("launch", 0.001),
                      ("add", 0.006)):
        assert 5 * each <= t[key] < 5 * each + 0.05, (key, t)
    assert t["step"] >= sum(t[k] for k in ("wait", "schedule", "update", "outputs", "launch", "sample_launch"))
    assert before == {id(o): dict(vars(o)) for o in (sched, outputs, core.model_executor, llm.llm_engine)}
    assert Executor.__dict__["execute_model"] is type(core.model_executor).execute_model
    with engine_bench.engine_loop_timers(None, {}) as t:
        pass
    assert t == {}
    table = engine_bench.loop_table({"rows": {"bare": {"loop": dict(t, steps=5, step=2.0, wait=0.5)}}})
    assert table.splitlines()[-1] == "| bare | 5 | 2.00 | 0.00 | 0.00 | 0.00 | 0.50 | 0.00 | 0.00 | 0.00 | 75% |"


def test_pyspy_table_shares_inside_the_engine_step(tmp_path):
    """bench.py pyspy: of py-spy's collapsed stacks only those inside vLLM's engine step count; each function's
    share is inclusive, counted once per sample however deep it recurses, its line numbers merged; .xz reads alike."""
    step = "LLMEngine.step (vllm/v1/engine/llm_engine.py:301)"
    raw = "\n".join([
        f"thread (1): MainThread;main (bench.py:9);{step};Scheduler.schedule (vllm/sched.py:10);f (x.py:1) 6",
        f"thread (1): MainThread;main (bench.py:9);{step};Scheduler.schedule (vllm/sched.py:12);"
        "Scheduler.schedule (vllm/sched.py:40) 2",  # recursion: once
        f"thread (1): MainThread;main (bench.py:9);{step};execute (vllm/run.py:5) 2",
        "thread (2): loader;main (bench.py:9);load (x.py:3) 50",  # outside the step: not counted
    ]) + "\n"
    (tmp_path / "raw.txt").write_text(raw)
    with lzma.open(tmp_path / "raw.txt.xz", "wt") as f:
        f.write(raw)
    table = engine_bench.pyspy_table(str(tmp_path / "raw.txt"))
    assert table == engine_bench.pyspy_table(str(tmp_path / "raw.txt.xz"))
    lines = table.splitlines()
    assert lines[0].startswith("10 samples inside LLMEngine.step")
    assert lines[1:] == ["  100.0%  LLMEngine.step (vllm/v1/engine/llm_engine.py)",
                         "   80.0%  Scheduler.schedule (vllm/sched.py)", "   60.0%  f (x.py)",
                         "   20.0%  execute (vllm/run.py)"]
    assert "no samples inside nothing" in engine_bench.pyspy_table(str(tmp_path / "raw.txt"), root="nothing")
    # through bench.py, root= and top= as asked; a wrong call is one line and exit code 2
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench", "pyspy", str(tmp_path / "raw.txt.xz"),
                        "root=Scheduler.schedule", "top=2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.splitlines()[1:] == ["  100.0%  Scheduler.schedule (vllm/sched.py)",
                                                              "   75.0%  f (x.py)"], r
    for args in (["pyspy", str(tmp_path / "nope.txt")], ["pyspy", str(tmp_path / "raw.txt"), "top=x"],
                 ["compare", str(tmp_path), str(tmp_path / "no_checkpoint")]):  # (bench.py compare's too)
        r = subprocess.run([sys.executable, "-m", "benchmarks.bench", *args], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.startswith(f"error: usage: python -m benchmarks.bench {args[0]}") and \
            len(r.stderr.strip().splitlines()) == 1, (args, r)
