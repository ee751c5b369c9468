"""EasyR1's own command line: `grpo.py config=FILE key.sub=value ...` with this project's flags mixed in, values read
as OmegaConf reads a dotlist, the dotted keys merged over the file whatever their place, a flag winning (and saying
so), EasyR1's reward_function_kwargs passed to the reward function, and n_gpus_per_node x nnodes against torchrun."""
import json
import os
import sys

import pytest

import common
import dapo
import easyr1_config as E
import grpo
import rewards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "tests", "easyr1_config.yaml")
MODEL = "worker.actor.model.model_path=Qwen/Qwen2.5-VL-7B-Instruct"


def test_words_and_flags_in_any_order_flag_wins_and_says_so(capsys):
    cfg = E.cli(grpo.Config, grpo.DEMO, args=[
        "--lr", "3e-6", "worker.actor.optim.lr=2e-6", f"config={EXAMPLE}", "worker.rollout.n=8",
        "--temperature", "0.9", "data.max_response_length=512", "worker.rollout.temperature=0.7"])
    assert (cfg.lr, cfg.n, cfg.temperature, cfg.max_response_length) == (3e-6, 8, 0.9, 512)
    assert cfg.model_path == "Qwen/Qwen2.5-7B-Instruct"  # the rest from the file
    out = capsys.readouterr().out
    assert f"from {EXAMPLE} and 4 dotted key(s):" in out
    won = next(line for line in out.splitlines() if "flags win: " in line)  # (in easyr1_config.TABLE's order)
    assert "--lr 3e-06 over worker.actor.optim.lr=2e-06" in won and "--temperature 0.9 over " \
           "worker.rollout.temperature=0.7" in won
    # no file: the dotted keys alone, over EasyR1's defaults
    cfg = E.cli(grpo.Config, grpo.DEMO, args=[MODEL, "algorithm.kl_coef=0"])
    assert (cfg.model_path, cfg.kl_coef, cfg.n) == ("Qwen/Qwen2.5-VL-7B-Instruct", 0.0, 5)
    # dapo.py reads the same form (and the dynamic-sampling keys grpo.py has no option for)
    d = E.cli(dapo.DAPOConfig, dapo.DEMO, args=[MODEL, "algorithm.online_filtering=true",
                                                "algorithm.filter_key=accuracy", "data.mini_rollout_batch_size=64"])
    assert (d.filter_groups, d.filter_key, d.gen_batch_size) == (True, "accuracy", 64)


def test_values_are_yaml_as_omegaconf_reads_them():
    config, path = E.from_words([f"config={EXAMPLE}", "trainer.logger=[console,tensorboard]",
                                 "worker.rollout.val_override_config={temperature: 1.0, top_p: 0.7}",
                                 "worker.actor.optim.lr=1e-6", "trainer.max_steps=null", "data.shuffle=True",
                                 "worker.actor.model.lora.rank=8"])
    assert path == EXAMPLE
    assert config["trainer"]["logger"] == ["console", "tensorboard"]  # a list replaces the file's
    # a mapping merges into the file's, key by key (n: 1 kept)
    assert config["worker"]["rollout"]["val_override_config"] == {"temperature": 1.0, "top_p": 0.7, "n": 1}
    assert config["worker"]["actor"]["optim"]["lr"] == 1e-6 and type(config["worker"]["actor"]["optim"]["lr"]) is float
    assert config["trainer"]["max_steps"] is None and config["data"]["shuffle"] is True
    assert config["worker"]["actor"]["model"]["lora"] == {"rank": 8, "alpha": 64, "target_modules": "all-linear",
                                                          "exclude_modules": ".*visual.*"}
    # the last word for a key wins, as OmegaConf's merge
    assert E.from_words(["worker.rollout.n=4", "worker.rollout.n=6"])[0] == {"worker": {"rollout": {"n": 6}}}


def test_split_keeps_flag_values_that_hold_an_equals_sign():
    words, flags = E.split_argv(["--format-prompt", "answer={{ content }}", "data.seed=3", "config=a.yaml",
                                 "--output-dir", "x=y", "--lr=1e-5"])
    assert words == ["data.seed=3", "config=a.yaml"]
    assert flags == ["--format-prompt", "answer={{ content }}", "--output-dir", "x=y", "--lr=1e-5"]


@pytest.mark.parametrize("args, says", [
    ([f"config={EXAMPLE}", f"--config={EXAMPLE}"], "config= / --config given 2 times"),
    (["config=no/such.yaml"], "config=no/such.yaml: no such file"),
    ([MODEL, "data.typo_key=1"], "EasyR1 config: data.typo_key: not an EasyR1 key"),  # a typo stops the run
    ([MODEL, "worker.rollout.n=[1"], "worker.rollout.n=[1: not a YAML value"),
    ([MODEL, "worker.rollout=4", "worker.rollout.n=2"], "worker.rollout.n=2: worker.rollout holds a value"),
    ([MODEL, "worker.reward.reward_function_kwargs=[1, 2]"], "reward_function_kwargs=[1, 2]: give a mapping"),
])
def test_bad_words_are_one_clear_error(args, says, capsys, tmp_path):
    with pytest.raises(SystemExit) as e, common.one_line_errors():
        E.cli(grpo.Config, grpo.DEMO, args=args + ["--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and says in err, err


def test_world_size_must_match_n_gpus_per_node_times_nnodes(monkeypatch, capsys):
    args = [f"config={EXAMPLE}", "trainer.n_gpus_per_node=4", "trainer.nnodes=2"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    E.cli(grpo.Config, grpo.DEMO, args=args)  # torchrun --nnodes 2 --nproc_per_node 4
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"trainer.n_gpus_per_node=4: trainer.n_gpus_per_node x trainer.nnodes = "
                                         r"4 x 2 = 8 processes, but torchrun started 4 \(WORLD_SIZE\): launch "
                                         r"torchrun --nnodes 2 --nproc_per_node 4, or set trainer.n_gpus_per_node=2"):
        E.cli(grpo.Config, grpo.DEMO, args=args)
    monkeypatch.setenv("WORLD_SIZE", "2")  # only nnodes given: EasyR1's 8 GPUs per node
    with pytest.raises(ValueError, match=r"trainer.nnodes=2: .* = 8 x 2 = 16 processes, but torchrun started 2"):
        E.cli(grpo.Config, grpo.DEMO, args=[MODEL, "trainer.nnodes=2"])
    # one process (`python grpo.py`, or torchrun with 1: WORLD_SIZE unset or 1) is the one-GPU launch: EasyR1's
    # config.yaml says 8 GPUs, and that does not stop it
    monkeypatch.setenv("WORLD_SIZE", "1")
    E.cli(grpo.Config, grpo.DEMO, args=args)
    monkeypatch.delenv("WORLD_SIZE")
    capsys.readouterr()
    E.cli(grpo.Config, grpo.DEMO, args=args)
    assert "trainer.n_gpus_per_node=4 (no option here: torchrun's --nproc_per_node: python grpo.py runs one " \
           "process" in capsys.readouterr().out


def test_reward_function_kwargs_reach_the_reward_function(tmp_path):
    """EasyR1's DAPO-17k example passes the overlong shaping to its reward file as reward_function_kwargs."""
    (tmp_path / "r.py").write_text(
        "def compute_score(reward_inputs, max_response_length, overlong_buffer_length, overlong_penalty_factor):\n"
        "    return [{'overall': max_response_length - overlong_buffer_length + overlong_penalty_factor,\n"
        "             'kind': type(overlong_penalty_factor).__name__} for _ in reward_inputs]\n")
    cfg = E.cli(grpo.Config, grpo.DEMO, args=[
        MODEL, f"worker.reward.reward_function={tmp_path / 'r.py'}:compute_score",
        'worker.reward.reward_function_kwargs={"max_response_length":20480,"overlong_buffer_length":4096,'
        '"overlong_penalty_factor":1e-1}'])
    assert json.loads(cfg.reward_function_kwargs) == {"max_response_length": 20480, "overlong_buffer_length": 4096,
                                                      "overlong_penalty_factor": 0.1}
    fn = rewards.get_reward_fn(cfg.reward_function, cfg.reward_function_kwargs)
    assert fn([{"response": "x", "ground_truth": "y"}]) == [{"overall": 16384.1, "kind": "float"}]
    # in a file too, and an empty mapping sets nothing
    opts, _ = E.translate({"worker": {"reward": {"reward_function_kwargs": {}}}}, grpo.Config)
    assert "reward_function_kwargs" not in opts


def test_python_grpo_py_takes_easyr1s_form(launch, tmp_path):
    """As a user types it: the words reach grpo.py's parser (and the run stops at the first check that needs a real
    model, with one line)."""
    p = launch.run([sys.executable, "grpo.py", f"config={EXAMPLE}", "worker.actor.model.model_path=./no/such/model",
                    "--output-dir", str(tmp_path), "trainer.n_gpus_per_node=1"], tmp_path / "log", timeout=300,
                   expect=2)
    assert "[config] defaults: EasyR1; from " in p.out
    assert "error: --model-path ./no/such/model: no such folder" in p.out
