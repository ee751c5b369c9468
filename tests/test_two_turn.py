"""benchmarks/two_turn.py (the two-turn rollout's timing) on the CPU with the HF engine and the tiny Qwen2.5-VL: both
runs generate the same forced tokens, and turn two's prompts carry the tool's picture (processor tensors and image
tokens) after the first turn's tokens, as tools.rollout continues a trajectory."""
import cProfile
import json
import os
import pstats

import pytest
import torch

import grpo
import rollout
import tiny_model
from benchmarks import two_turn
from common import UserError


def config(path, **kw):
    """The tiny Qwen2.5-VL's demo pictures at 56-112 pixels a side, two prompts a step."""
    return grpo.Config(model_path=path, train_files=tiny_model.demo_data()[0], val_files="", min_pixels=56 * 56,
                       max_pixels=112 * 112, max_prompt_length=256, rollout_batch_size=2, **kw)


def test_two_turns_generate_as_many_tokens_as_one_and_continue_with_the_picture(tmp_path, monkeypatch):
    seen, tokens = [], []
    generate = rollout.HFRollout.generate
    monkeypatch.setattr(rollout.HFRollout, "generate", lambda self, prompts, *a, **k: seen.append(prompts) or
                        tokens.append(a[3]) or generate(self, prompts, *a, **k))
    cfg = config(tiny_model.build_tiny_model(), rollout_engine="hf", n=2, max_response_length=64,
                 output_dir=str(tmp_path / "out"))
    r = two_turn.run(cfg, repeats=1, first=3, second=2, size=56, rows=two_turn.ROWS)
    assert [rs[0]["tokens"] for rs in r["runs"].values()] == [2 * 2 * 5] * len(two_turn.ROWS)
    assert tokens[:3] == [5, 3, 2]  # the untimed warm-up: one turn, then two turns, at the timed calls' lengths
    assert all(f"{name}, by part" in two_turn.table(r) for name in two_turn.ROWS[1:])
    assert r["runs"]["two_turn"][0]["tool_tokens"] >= 4  # the picture's 4 image tokens and the template's around it
    later = 2 * (len(two_turn.ROWS) - 2)  # turn two of the timed two_turn run: then the variants' two calls each
    second, first = seen[-1 - later], seen[-2 - later]
    assert len(second) == 4 and all(len(p["images"]) == 2 for p in second)
    assert all(c["prompt_ids"][:len(p["prompt_ids"])] == p["prompt_ids"] for c, p in zip(second[::2], first))
    assert all(c["mm_inputs"]["image_grid_thw"].shape[0] == 2 for c in second)
    assert json.load(open(tmp_path / "out" / "two_turn.json"))["ratio"] > 0


def test_turn_twos_intake_is_timed_apart_and_its_queue_is_what_runs(tmp_path, monkeypatch):
    """With vLLM (the stand-in: tests/vllm_standin.py) the bench times turn two's intake (submit) apart from its run,
    and generate runs the queued requests themselves: one enqueue, no abort, no second intake."""
    from vllm_standin import standin_vllm
    import data
    import fsdp_actor
    standin_vllm(monkeypatch)
    fsdp_actor.init_distributed()  # (draw_prompts' collectives; the run above made the group when run before)
    path = tiny_model.build_tiny_model()
    eng = rollout.make_rollout("vllm", path)
    proc = data.load_processor(path, min_pixels=56 * 56, max_pixels=112 * 112)
    cfg = config(path)
    train = data.load_datasets(cfg, path)[1]
    prompts = [p for _, p in data.draw_prompts(train, 0, 2, 0, 1, 0)]
    prof = cProfile.Profile()
    tokens, parts = two_turn.two_turn(eng, proc, prompts, [0, 1], 2, 3, 2, two_turn.picture(56), cfg, profile=prof)
    assert tokens == 2 * 2 * 5 and parts["intake_seconds"] is not None and parts["second_seconds"] > 0
    assert eng.llm.events[-3:] == ["generate", "enqueue", "wait"]  # turn one, turn two's intake, then its run
    seen = {f[2] for f in pstats.Stats(prof).stats}  # --profile: the intake and only it
    assert {"submit", "enqueue"} <= seen and not {"wait_for_completion", "render_answers"} & seen


def test_the_variants_give_each_trajectory_its_picture_or_make_the_pixels_first(tmp_path, monkeypatch):
    """--rows: two_turn_distinct continues each trajectory with a picture of its own (two_turn: one for all), and
    two_turn_pixels_first has the trainer's pixels made before turn two's intake (two_turn: after turn two)."""
    from vllm_standin import standin_vllm
    import data
    import fsdp_actor
    import tools
    standin_vllm(monkeypatch)
    fsdp_actor.init_distributed()
    path = tiny_model.build_tiny_model()
    eng = rollout.make_rollout("vllm", path)
    proc = data.load_processor(path, min_pixels=56 * 56, max_pixels=112 * 112)
    cfg = config(path)
    prompts = [p for _, p in data.draw_prompts(data.load_datasets(cfg, path)[1], 0, 2, 0, 1, 0)]
    pixels = tools.pixels
    monkeypatch.setattr(tools, "pixels", lambda parts: eng.llm.events.append("pixels") or pixels(parts))
    pictures = [two_turn.picture(56, seed=1 + i) for i in range(4)]
    for image, first in ((two_turn.picture(56), False), (pictures, False), (two_turn.picture(56), True)):
        eng.llm.events.clear()
        two_turn.two_turn(eng, proc, prompts, [0, 1], 2, 3, 2, image, cfg, pixels_first=first)
        shown = {p["multi_modal_data"]["image"][1].tobytes() for p in eng.llm.calls[-1]["reqs"]}  # turn two
        assert len(shown) == (4 if isinstance(image, list) else 1)
        ev = [e for e in eng.llm.events if e in ("pixels", "enqueue")]
        assert ev.count("enqueue") == 1 and ("pixels" in ev[:ev.index("enqueue")]) == first, ev


def test_pixels_made_in_processes_are_the_threads_pixels():
    """render_answers' `pool` (tools.pixel_pool): each answer gets the pixels the threads give it,
    answers of one size in a few jobs (a process sends its group's tensors back once: the answers' are views)."""
    import data
    import tools
    path = tiny_model.build_tiny_model()
    proc = data.load_processor(path, min_pixels=56 * 56, max_pixels=112 * 112)
    pictures = [two_turn.picture(56, seed=i) for i in range(3)] + [two_turn.picture(84, seed=9)]
    recs = [[{"name": "zoom", "result": pictures[i % 4]}] for i in range(11)]
    pool = tools.pixel_pool(path, 56 * 56, 112 * 112, pictures, workers=2)
    assert pool is not None
    try:
        got = [tools.pixels([a[3]]) for a in tools.render_answers(proc, recs, [""] * 11, 56 * 56, 112 * 112, pool=pool)]
    finally:
        tools._POOLS.pop((path, 56 * 56, 112 * 112)).shutdown()  # (the run's pool: made once, kept)
    want = [tools.pixels([a[3]]) for a in tools.render_answers(proc, recs, [""] * 11, 56 * 56, 112 * 112)]
    assert all(g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w) for g, w in zip(got, want))
    assert len({g["pixel_values"].untyped_storage().data_ptr() for g in got}) < 11  # (views of a job's tensors)


def test_a_small_dev_shm_leaves_the_pixels_on_threads(monkeypatch, capsys):
    """Docker gives a container 64 MB of /dev/shm unless told otherwise: the pool's pixels (in shared memory) would
    fail there mid-run, so tools.pixel_pool gives no pool (render_answers then uses threads) where /dev/shm can't hold
    the pictures' pixels twice over (saying so once a run), and one pool a run where it can."""
    import collections
    import shutil
    import tools
    free = [16 << 20]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: collections.namedtuple("du", "total used free")(
        64 << 20, 48 << 20, free[0]))
    pics = [two_turn.picture(512)] * 4  # (their 512^2 pixels: ~25 MB, twice over wanted)
    monkeypatch.setattr(tools, "_POOLS", {})
    monkeypatch.setattr(tools, "_SAID", set())
    assert tools.pixel_pool("m", 1, 2, pics) is None and tools.pixel_pool("m", 1, 2, pics) is None
    assert tools._POOLS == {} and capsys.readouterr().out.splitlines() == [
        "[tools] /dev/shm has 16 MB free, the tool pictures' pixels want 48 MB: made on threads, slower beside vLLM "
        "(docker: --shm-size)"]
    free[0] = 64 << 20
    made = []  # (the pools' sizes; none started here)
    monkeypatch.setattr(tools, "ProcessPoolExecutor", lambda n, *a, **k: made.append(n) or object())
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # (torchrun's: four ranks on this node share its cores)
    pool = tools.pixel_pool("m", 1, 2, pics)
    assert pool is not None and tools.pixel_pool("m", 1, 2, pics[:1]) is pool and tools.pixel_pool("m", 1, 3, pics) is not pool
    assert tools.pixel_pool("m", 1, 2, ["a text answer"]) is None and made == [4, 4]  # (no picture: no processes)


def test_rows_without_both_runs_of_the_ratio_are_refused_in_one_line():
    with pytest.raises(UserError, match="--rows two_turn: give one_turn, two_turn"):
        two_turn.run(grpo.Config(), rows=("two_turn",))


def test_busy_is_the_logs_mean_inside_each_generation_and_the_runs_table_shows_the_gpu_and_the_loop(tmp_path):
    # one_turn ran 10:00:00.5-10:00:10.5 (ended 10:00:10, 10 s), two_turn 10:00:20.5-10:00:40.5 with a 6 s turn one
    seconds = [(0, 100), (1, 10), (2, 20), (3, 30), (9, 90), (10, 100), (21, 5), (22, 40), (25, 60), (26, 99), (30, 1)]
    gpu, host = tmp_path / "x_gpu.csv", tmp_path / "x_host.csv"
    gpu.write_text("timestamp, index, sm, mem, temp, power, utilization.gpu [%], why\n" + "\n".join(
        f"2026/12/06 10:00:{s:02d}.100, 0, 1980 MHz, 2619 MHz, 50, 500 W, {u} %, 0x0" for s, u in seconds) + "\n")
    host.write_text("timestamp, cores_busy, steal_pct, cpu_mhz, proc_cpu_pct, top_thread_pct, top_thread\n" + "\n".join(
        f"2026/12/06 10:00:{s:02d}.600, 1.1, 0.0, 2100, 110, {100 - u / 10:.0f}, python" for s, u in seconds) + "\n")
    r = dict(prompts=2, n=2, engine="VLLMRollout", vllm="0.26.0", first=4, second=4, image=8,
             seconds=dict(one_turn=10.0, two_turn=20.0),
             runs=dict(one_turn=[dict(seconds=10.0, ended="10:00:10")],
                       two_turn=[dict(seconds=20.0, ended="10:00:40", first_seconds=6.0, intake_seconds=1.5)]))
    # the windows less their first and last second: 10:00:01.5-09.5 and 10:00:21.5-25.5 (the host's rows at .6:
    # 01.6-03.6 and 21.6-22.6 inside)
    assert two_turn.busy(r, str(gpu)) == dict(one_turn=[(20 + 30 + 90) / 3], two_turn=[(40 + 60) / 2])
    assert two_turn.busy(r, str(host), 5) == dict(one_turn=[(99 + 98 + 97) / 3], two_turn=[(100 + 96) / 2])
    text = two_turn.runs_table([("x.json", r, str(gpu), str(host)), ("y.json", r, None, None)])
    assert "| x.json | 10.00 (10.00) | 20.00 (20.00) | 2.000 | 1.50 | 47 / 50 | 98 / 98 |" in text
    assert "| y.json | 10.00 (10.00) | 20.00 (20.00) | 2.000 | 1.50 | - | - |" in text


def test_a_run_stopped_mid_way_keeps_the_rounds_it_finished(tmp_path, monkeypatch):
    """The bench writes its JSON after every round: a run its time limit stops (gpu_speed.sh's LIMIT) keeps them."""
    calls, generate = [], rollout.HFRollout.generate

    def stopped_in_round_two(self, *a, **k):
        calls.append(1)
        if len(calls) > 6:  # warm-up's 3 calls (one_turn's one, two_turn's two), then round one's 3
            raise KeyboardInterrupt
        return generate(self, *a, **k)
    monkeypatch.setattr(rollout.HFRollout, "generate", stopped_in_round_two)
    cfg = config(tiny_model.build_tiny_model(), rollout_engine="hf", n=2, max_response_length=64,
                 output_dir=str(tmp_path / "out"))
    with pytest.raises(KeyboardInterrupt):
        two_turn.run(cfg, repeats=2, first=3, second=2, size=56)
    r = json.load(open(tmp_path / "out" / "two_turn.json"))
    assert r["rounds"] == 1 and [len(v) for v in r["runs"].values()] == [1, 1] and r["ratio"] > 0


def test_a_rounds_calls_second_by_second_beside_the_gpu(tmp_path):
    """seconds_table: each call's window (its end is "ended" + 0.5 s, whole seconds in the log), the GPU's utilisation
    of every log row inside it in order, and where two turns' parts begin."""
    gpu = tmp_path / "x_gpu.csv"
    gpu.write_text("timestamp, index, sm, mem, temp, power, utilization.gpu [%], why\n" + "\n".join(
        f"2026/12/06 10:00:{s:02d}.100, 0, 1980 MHz, 2619 MHz, 50, 500 W, {10 * s} %, 0x0" for s in range(20)) + "\n")
    one = dict(seconds=5.0, ended="10:00:05")  # 10:00:00.5 to 05.5: the rows at 01-05
    two = dict(seconds=8.0, ended="10:00:14", first_seconds=3.0, render_seconds=0.1, continue_seconds=0.1,
               intake_seconds=1.8, second_seconds=3.0)  # 06.5 to 14.5: 07-14
    r = dict(runs=dict(one_turn=[dict(seconds=1.0, ended="10:00:00"), one], two_turn=[dict(one), two]))
    text = two_turn.seconds_table(r, str(gpu), k=1)
    assert "| one_turn, round 2 | 0-5.0 | 10 20 30 40 50 |" in text
    assert "| two_turn, round 2 | turn one 0-3.0, intake -5.0, turn two -8.0 | 70 80 90 100 110 120 130 140 |" in text


def test_a_pixel_process_that_dies_is_one_line_not_the_pools_traceback():
    """A process of tools.pixel_pool killed (the kernel's OOM killer, most often): the trajectory's pixels, when asked
    for, end the run with one line naming the pool and what to do."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    import tools
    with ProcessPoolExecutor(1, multiprocessing.get_context("forkserver")) as pool:
        job = pool.submit(os._exit, 9)
        with pytest.raises(UserError, match=r"pixel process \(tools.pixel_pool\) died, most often killed for memory"):
            tools._share(job, 0)
