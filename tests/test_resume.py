"""The output folder holds one run: resume is explicit and refuses to mix two runs; logs are cut back to the resumed
step; the best checkpoint by val/mean outlives --save-limit; trackers and reward.png are written. A few runs of the
tiny demo model share one folder and check several things each (a run costs ~20 s on two cores)."""
import glob
import json
import os
import struct
import sys

import pytest

import rundir

SMALL = ["--rollout-batch-size", "4", "--global-batch-size", "4", "--rollout-n", "4", "--max-response-length", "6",
         "--log-samples", "1", "--val-max-rows", "8"]
DENSE_REWARD = """
def dense(items):  # varies with every answer, so validation scores move from step to step
    return [{"overall": len(set(it["response"])) / 10, "accuracy": 0.0} for it in items]
"""


def grpo(launch, args, out, log):
    # no API key and no WANDB_MODE from the caller's shell: --logger wandb runs offline, into the output folder
    return launch.run([sys.executable, "grpo.py", "--output-dir", out] + SMALL + args, log, WANDB_API_KEY=None,
                      WANDB_MODE=None, WANDB_SILENT="true")


def rows(path):
    return [json.loads(x) for x in open(path)]


def tensorboard_scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(folder)
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def wandb_history(run_file):
    """The logged rows of an offline wandb run, read from its .wandb file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, buf, out = open(run_file, "rb").read(), 7, b"", []  # 7 bytes: ":W&B", magic, version
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        n, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST fragment: a whole record
            r = pb.Record()
            r.ParseFromString(buf)
            buf = b""
            if r.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return out


def _installed(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, launch_module):
    """4 steps with validation and a checkpoint every step, 2 kept besides the best; every installed tracker on."""
    tmp = tmp_path_factory.mktemp("resume")
    (tmp / "r.py").write_text(DENSE_REWARD)
    out, kw = tmp / "run", ["--reward-function", f"{tmp / 'r.py'}:dense", "--lr-scheduler-type", "constant"]  # made
    # longer below: a constant lr (a cosine spans the run: config_diff)
    trackers = [t for t in ("tensorboard", "wandb") if _installed(t)]
    p = grpo(launch_module, kw + ["--max-steps", "4", "--val-freq", "1", "--save-freq", "1", "--save-limit", "2",
                                  "--logger", "console", *trackers], out, tmp / "first.log")
    return out, kw, p.out, rows(out / "metrics.jsonl")


def test_best_checkpoint_outlives_save_limit(first_run):
    out, _, log, first = first_run
    assert "[config] defaults: demo (tiny model)" in log and "set: " in log
    assert [r["step"] for r in first] == [0, 1, 2, 3, 4]
    # the best checkpoint: the highest val/mean among the saved steps (the earliest of equals), kept and named
    vals = {r["step"]: r["val/mean"] for r in first if r["step"] > 0}
    best = max(vals, key=lambda s: (vals[s], -s))
    assert json.load(open(out / "checkpoints" / "best.json")) == {
        "step": best, "checkpoint": f"checkpoints/step_{best}", "val/mean": vals[best]}
    assert f"[best] checkpoints/step_{best}:" in log
    assert sorted(os.listdir(out / "checkpoints")) == sorted({"best.json", "step_3", "step_4", f"step_{best}"})
    png = open(out / "reward.png", "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and not glob.glob(str(out / "*.tmp*"))


def test_tensorboard_reads_back(first_run):
    pytest.importorskip("tensorboard", reason="pip install tensorboard to test --logger tensorboard")
    out, _, _, first = first_run
    assert tensorboard_scalars(str(out / "tensorboard"), "reward/mean") == pytest.approx(
        {r["step"]: r["reward/mean"] for r in first if "reward/mean" in r})
    assert tensorboard_scalars(str(out / "tensorboard"), "val/mean") == pytest.approx(
        {r["step"]: r["val/mean"] for r in first})


def test_wandb_offline_reads_back(first_run):
    pytest.importorskip("wandb", reason="pip install wandb to test --logger wandb")
    out, _, _, first = first_run
    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))  # offline: no API key here
    hist = [h for h in wandb_history(run_file) if "reward/mean" in h]
    assert [(h["_step"], h["reward/mean"]) for h in hist] == [(r["step"], r["reward/mean"]) for r in first[1:]]


def test_a_missing_tracker_is_one_clear_error(monkeypatch, tmp_path):
    from dataclasses import replace

    import grpo as G
    for name in ("wandb", "tensorboard"):
        monkeypatch.setitem(sys.modules, name if name == "wandb" else "torch.utils.tensorboard", None)
        with pytest.raises(ValueError, match=f"--logger {name} needs the {name} package: pip install {name}"):
            rundir.open_trackers(replace(G.Config(), logger=["jsonl", name], output_dir=str(tmp_path)), 0)


def test_resume_path_logs_cut_back_complete_and_refusals(first_run, capsys, launch):
    """Runs after the tests above: it changes the folder."""
    out, kw, _, first = first_run
    # ---- --resume PATH to an older checkpoint: logs cut back to it, the newer checkpoint set aside ----
    p = grpo(launch, kw + ["--max-steps", "5", "--val-freq", "1", "--save-freq", "1", "--save-limit", "2",
                           "--resume", str(out / "checkpoints" / "step_3")], out, out.parent / "resumed.log")
    assert "dropped 1 row(s) after step 3" in p.out
    again = rows(out / "metrics.jsonl")
    assert [r["step"] for r in again] == [0, 1, 2, 3, 4, 5]  # no step twice
    assert [r["step"] for r in rows(out / "samples.jsonl")] == [1, 2, 3, 4, 5]
    assert again[:4] == first[:4]  # the kept rows are untouched
    assert again[4]["reward/mean"] == pytest.approx(first[4]["reward/mean"], abs=1e-9)  # step 4 again, exactly
    assert os.path.isdir(out / "checkpoints" / "step_4.abandoned")
    assert json.load(open(out / "config.json"))["max_steps"] == 4  # written by the fresh run only

    # ---- already complete: says so and stops before the model loads; a changed config or --resume never over
    # this folder is refused, every difference listed (in-process: the same calls `python grpo.py` makes) ----
    import grpo as G
    from easyr1_config import cli
    args = ["--output-dir", str(out)] + SMALL + kw
    ctx = G.setup(cli(G.Config, G.DEMO, args=args + ["--max-steps", "5"]))
    assert ctx.done and ctx.model is None  # stopped before the model loads
    assert "already complete" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"lr: 0.001 -> 0.01; kl_coef: 0.01 -> 0.1"):
        rundir.find_resume(cli(G.Config, G.DEMO, args=args + ["--max-steps", "6", "--lr", "0.01", "--kl-coef",
                                                              "0.1"]))
    with pytest.raises(ValueError, match="--resume never: .* already holds a run"):
        rundir.find_resume(cli(G.Config, G.DEMO, args=args + ["--resume", "never"]))
    assert rows(out / "metrics.jsonl") == again


def test_fresh_start_without_checkpoint(tmp_path):
    """A folder with a run's config.json and logs but no checkpoint (a crash before the first save): the same
    config starts over from step 0 with the logs cleared; another config is refused; a PATH must be a checkpoint."""
    from dataclasses import asdict, replace

    import grpo as G
    cfg = replace(G.Config(), output_dir=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(asdict(cfg)))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert rundir.find_resume(cfg) == (None, None)
    rundir.prepare(cfg, 0, None)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    with pytest.raises(ValueError, match="n: 5 -> 6"):
        rundir.find_resume(replace(cfg, n=6))
    with pytest.raises(ValueError, match="not a checkpoint"):
        rundir.find_resume(replace(cfg, resume=str(tmp_path)))


def test_truncate_and_best_helpers(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s}) + "\n" for s in [0, 1, 2, 3, 2, 3]))  # a crash after step 1's save
    assert rundir.truncate_jsonl(str(m), 1) == 4 and rows(m) == [{"step": 0}, {"step": 1}]
    assert rundir.truncate_jsonl(str(m), 0) == 2 and m.read_text() == ""  # starting over keeps nothing
    for step, val in [(1, 0.5), (2, 0.7), (3, 0.7), (4, None)]:
        os.makedirs(tmp_path / "checkpoints" / f"step_{step}")
        (tmp_path / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text(json.dumps({"val/mean": val}))
    assert rundir.find_best(str(tmp_path)) == (2, 0.7)  # the earliest of the best


def test_config_diff_ignores_only_the_allow_list():
    from dataclasses import asdict, replace

    import grpo as G
    saved = json.loads(json.dumps(asdict(G.Config())))
    assert rundir.config_diff(saved, replace(G.Config(), max_steps=9, save_freq=1, logger=["wandb"],
                                             micro_batch_size_per_device=2, logprob_max_token_len_per_device=65536,
                                             checkpoint_layers=0.5, prefetch_requests="off")) == []  # how the work
    # is cut or scheduled, not what it computes
    assert rundir.config_diff(saved, replace(G.Config(), lr=1e-5, seed=3)) == ["lr: 1e-06 -> 1e-05", "seed: 1 -> 3"]
    # a cosine (the colour demos') or a warm-up ratio spans the run: a longer run would bend the schedule it started on
    cos = json.loads(json.dumps(asdict(replace(G.Config(), lr_scheduler_type="cosine"))))
    assert rundir.config_diff(cos, replace(G.Config(), lr_scheduler_type="cosine", max_steps=9, save_freq=1)) == [
        "max_steps: 0 -> 9 (the lr schedule spans the run)"]
    assert rundir.config_diff(saved, replace(G.Config(), lr_warmup_ratio=0.1, max_steps=9))[-1].startswith("max_steps")
    del saved["lr"]  # a key the old run did not know: not compared
    assert rundir.config_diff(saved, replace(G.Config(), lr=1e-5)) == []
