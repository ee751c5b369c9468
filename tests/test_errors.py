"""What a user sees when the input is wrong: one `error:` line naming the option, file or row (exit code 2, no
traceback, printed once under torchrun), and no silent failure. docs/errors.md lists these.

The option checks and the data check run in this process as grpo.py's __main__ runs them (they fail before any
model loads); the reward check, the skipped-step stop, torchrun and data.py check run as the user runs them, in a
subprocess."""
import io
import json
import os
import random
import re
import sys
import warnings

import pytest

import common
import tiny_model
import dapo
import grpo

SMALL = ["--rollout-batch-size", "2", "--global-batch-size", "2", "--rollout-n", "2", "--val-freq", "0"]


def run(launch, log, args, nproc=1, script="grpo.py", timeout=600):
    """The script as the user runs it; it must exit 2 (torchrun itself exits 1 when a worker fails)."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    return launch.run(launcher + [script] + args, log, timeout, expect=2 if nproc == 1 else 1)


def grpo_main(argv):
    """grpo.py's __main__ (grpo.main), in this process."""
    from easyr1_config import cli
    with common.one_line_errors():
        grpo.train(cli(grpo.Config, grpo.DEMO, args=argv))


def error_of(p):
    """The one error message of a finished run (its exit code checked by run): a single `error:` and no Python
    traceback of ours."""
    out = p.out
    assert out.count("error: ") == 1, out[-3000:]
    assert "Traceback" not in out.split("error: ")[0] and 'grpo.py", line' not in out, out[-3000:]
    return out.split("error: ", 1)[1]


@pytest.mark.parametrize("args, says", [
    (["--lr", "0"], "--lr 0.0: must be > 0"),
    (["--max-response-length", "0"], "--max-response-length 0: must be > 0"),
    (["--rollout-n", "0"], "--rollout-n 0: must be at least 1"),
    (["--temperature", "0"], "--temperature 0.0: must be > 0 (greedy is for --val-temperature)"),
    (["--global-batch-size", "32"], "--global-batch-size 32 is larger than --rollout-batch-size 16"),
    (["--global-batch-size", "3"], "--global-batch-size 3 must divide --rollout-batch-size 16"),
    (["--kv-cache-memory-gb", "-1"], "--kv-cache-memory-gb -1.0: the first is a share of the GPU in (0, 1]"),
    (["--gpu-memory-utilization", "60"], "--gpu-memory-utilization 60.0 / --kv-cache-memory-gb 0.0: the first is"),
    (["--model-path", "./no/such/model"], "--model-path ./no/such/model: no such folder"),
    (["--model-path", "/tmp"], "--model-path /tmp: could not load its tokenizer/processor"),
    (["--train-files", "missing.parquet"], "--train-files missing.parquet: no such file or folder"),
    (["--val-files", "./val_dir@test"], "--val-files ./val_dir@test: no such file or folder"),
    (["--reward-function", "gsm8k"], "--reward-function gsm8k: unknown; built-ins:"),
    (["--reward-function", "nope.py:fn"], "--reward-function nope.py:fn: no such file"),
    (["--reward-function-kwargs", "{bad"], "--reward-function-kwargs {bad: not JSON"),
    (["--reward-function", "math", "--reward-function-kwargs", '{"format_weight": 0.5}'],
     "unexpected keyword argument 'format_weight'"),
])
def test_option_errors_are_one_line(args, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        grpo_main(["--output-dir", str(tmp_path / "out")] + args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert "Repo id must be" not in err


def test_unwritable_output_dir(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit):
        grpo_main(["--output-dir", str(tmp_path / "a_file" / "out")])
    assert capsys.readouterr().err.startswith(f"error: --output-dir {tmp_path / 'a_file' / 'out'}: cannot write there")


def test_every_option_has_its_own_help():
    """tyro takes the comment above a field as its help when the field has none on its line: a section banner
    ("# --- rollout ---") then becomes the help of every option under it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import tyro
        for cls in (grpo.Config, dapo.DAPOConfig):
            actions = [a for a in tyro.extras.get_parser(cls)._actions if a.option_strings != ["-h", "--help"]]
            helps = {a.option_strings[0]: re.sub(r"\s*\(default: .*\)$", "", a.help or "") for a in actions}
            assert all(helps.values()), [k for k, v in helps.items() if not v]
            assert not [k for k, v in helps.items() if "---" in v]
            assert len(set(helps.values())) == len(helps), "two options share one help text"


def _png(seed):
    buf = io.BytesIO()
    tiny_model.draw_color_image(random.Random(seed))[0].save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def bad_parquet(path, n_good=4):
    """n_good usable rows, then a missing answer, two placeholders for one image, undecodable bytes, a prompt
    longer than 512 tokens: rows n_good .. n_good + 3 of the file."""
    import datasets
    ok = {"problem": "<image>What is the main color of the picture?", "answer": "red"}
    rows = [{**ok, "images": [_png(i)]} for i in range(n_good)]
    rows += [{**ok, "answer": None, "images": [_png(10)]},
             {**ok, "problem": "<image><image>Which?", "images": [_png(11)]},
             {**ok, "images": [{"bytes": b"\x89PNG broken", "path": None}]},
             {**ok, "problem": "<image>" + "word " * 600, "images": [_png(12)]}]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_bad_rows_stop_training_before_the_model_loads(tmp_path, monkeypatch, capsys):
    src = bad_parquet(tmp_path / "bad.parquet")
    monkeypatch.setattr(grpo.actor, "build_actor", None)  # the check must come first: loading a model would crash here
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        grpo_main(["--train-files", src, "--output-dir", str(tmp_path / "o")] + SMALL)
    assert e.value.code == 2
    err = capsys.readouterr().err  # (after the datasets library's progress bar for reading the file)
    assert err.count("error: ") == 1 and "Traceback" not in err
    msg = err[err.index("error: "):]
    assert msg.startswith(f"error: --train-files {src}: 3 of 8 rows cannot be used (row numbers count from 0")
    assert "row 4: no answer: 'answer' is None" in msg and "row 5: placeholders != images" in msg
    assert "row 6: bad image: image 0: could not decode" in msg and "--skip-bad-rows" in msg
    assert "row 7" not in msg  # overlong: dropped by --filter-overlong-prompts, not an error


@pytest.mark.parametrize("where, stage, advice", [
    ("rollout.HFRollout.generate", "during generation", "a smaller engine (--gpu-memory-utilization 0.6, or a fixed "
     "--kv-cache-memory-gb"),
    ("fsdp_actor.optimizer_step", "during the policy update", "fewer tokens per micro-batch "
     "(--max-token-len-per-device 16384)"),
])
def test_out_of_gpu_memory_is_one_line_with_the_stage(where, stage, advice, tmp_path, monkeypatch, capsys):
    """CUDA's out-of-memory error inside a step: one line naming the stage and the options that move memory there
    (on a GPU also the trainer's, the engine's and the free GiB), exit 2; other errors pass through unchanged."""
    import torch

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 592.00 MiB.")
    monkeypatch.setattr(where, oom)  # (a dotted "module.attr" target)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        grpo_main(["--output-dir", str(tmp_path / "o"), "--max-steps", "1"] + SMALL)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "Traceback" not in err, err[-2000:]
    msg = err[err.index("error: "):]
    assert msg.startswith(f"error: rank 0 ran out of GPU memory in step 1, {stage}"), msg
    assert advice in msg, msg

    def other(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(where, other)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        grpo_main(["--output-dir", str(tmp_path / "o2"), "--max-steps", "1"] + SMALL)


def test_data_py_check_lists_every_bad_row(tmp_path, launch):
    src = bad_parquet(tmp_path / "bad.parquet")
    p = run(launch, tmp_path / "check.log", ["check", "--train-files", src, "--no-filter-overlong-prompts"],
            script="data.py")
    lines = p.out[p.out.index("--train-files"):].splitlines()  # (after the datasets library's progress bar)
    assert lines[0] == f"--train-files {src}: 8 rows, 4 bad (row numbers count from 0 in the source)"
    assert [ln.split(":")[0].strip() for ln in lines[1:5]] == ["row 4", "row 5", "row 6", "row 7"]
    assert "row 7: prompt too long: " in p.out and " tokens > --max-prompt-length 512" in p.out
    assert "counts: no answer 1, placeholders != images 1, bad image 1, prompt too long 1" in p.out


NAN_REWARD = """
REWARD_TYPE = "sequential"
def score(item):
    return {"overall": float("nan") if item["ground_truth"] == "red" else 1.0, "accuracy": 0.0}
"""


def test_skip_bad_rows_then_a_nan_reward_names_the_sample(tmp_path, launch):
    src = bad_parquet(tmp_path / "bad.parquet")
    (tmp_path / "r.py").write_text(NAN_REWARD)
    out = tmp_path / "o"
    p = run(launch, tmp_path / "run.log", ["--train-files", src, "--skip-bad-rows", "--reward-function",
                                           f"{tmp_path / 'r.py'}:score", "--output-dir", str(out), "--save-freq", "1"]
            + SMALL)
    log = p.out
    assert "skipped 3 bad rows (--skip-bad-rows; no answer 1, placeholders != images 1, bad image 1): rows 4, 5, 6" \
        in log
    assert "dropped 1 prompts longer than --max-prompt-length 512 (--filter-overlong-prompts): rows 7" in log
    msg = error_of(p)
    assert msg.startswith(f"reward function '{tmp_path / 'r.py'}:score' gave overall=nan: every score must be a "
                          "finite number")
    assert "prompt '<image>What is the main color of the picture?'" in msg and "ground truth 'red'" in msg
    assert not os.path.exists(out / "checkpoints")  # the run exits 2 and saves nothing


def test_a_run_of_skipped_steps_stops_training(tmp_path, launch):
    # lr 1e30 turns the weights to ~1e28 after one step; from then on the loss is NaN and every step is skipped.
    # --debug-skip-sync keeps the engine on the first weights, so generation itself still works.
    out = tmp_path / "o"
    p = run(launch, tmp_path / "run.log", ["--output-dir", str(out), "--lr", "1e30", "--debug-skip-sync",
                                           "--max-skipped-steps", "2", "--max-steps", "6", "--save-freq", "1"] + SMALL)
    msg = error_of(p)
    assert msg.startswith("stopped at step 3: the last 2 optimizer steps were skipped (gradient norm nan)")
    m = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [(r["step"], r["actor/skipped_steps"], r["actor/skipped_steps_total"]) for r in m] == [(1, 0, 0), (2, 1, 1)]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_1", "step_2"]  # nothing saved from the stopped step


def test_torchrun_prints_the_error_once_and_no_rank_hangs(tmp_path, launch):
    # the data check runs after the process group and the demo model's barrier: every rank must raise it
    src = bad_parquet(tmp_path / "bad.parquet")
    p = run(launch, tmp_path / "run.log", ["--train-files", src, "--output-dir", str(tmp_path / "o")] + SMALL,
            nproc=2, timeout=300)
    assert error_of(p).startswith(f"--train-files {src}: 3 of 8 rows cannot be used")


def test_gpus_too_small_for_the_model_stop_before_anything_loads(tmp_path, monkeypatch, capsys):
    """grpo.setup checks the run against the memory model first (memory.check_before_loading) when CUDA is there:
    with the card of this rank's GPU (LOCAL_RANK's) and the world size, a model whose config.json is readable (here
    the 30B-A3B's, config only) stops with one line that names the GPUs it takes, exit 2, before the process group,
    the data or a model. A card that holds it, or no CUDA, passes on to the loading."""
    import types

    import presets
    import torch
    folder = tmp_path / "qwen3-vl-30b"
    presets.preset_config("qwen3_vl_30b_a3b", tiny_model._token_ids(tiny_model.build_tokenizer())).save_pretrained(
        folder)
    asked = []

    def card(gib):
        def props(i):
            asked.append(i)
            return types.SimpleNamespace(total_memory=gib * 2**30)
        return props

    def loading(*a, **k):
        raise RuntimeError("past the check")
    monkeypatch.setattr(grpo.actor, "init_distributed", loading)  # the first thing after the checks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", card(80))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--model-path", str(folder), "--output-dir", str(tmp_path / "o"), "--precision", "bf16"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        grpo_main(argv)
    assert e.value.code == 2 and asked == [3]
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model-path {folder} with --precision bf16 ") and err.count("\n") == 1, err
    assert "GiB per GPU on 2 GPUs (the memory model, README \"Memory modes\"), more than a 80 GiB GPU holds: it " \
           "takes 8 such GPUs (torchrun --nproc_per_node 8); or less per GPU: --lora-rank 64, " \
           "--offload-params" in err, err
    monkeypatch.setattr(torch.cuda, "get_device_properties", card(1000))  # a card that holds it
    with pytest.raises(RuntimeError, match="past the check"):
        grpo_main(argv)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU: nothing to compare with
    monkeypatch.setattr(torch.cuda, "get_device_properties", None)
    with pytest.raises(RuntimeError, match="past the check"):
        grpo_main(argv)
