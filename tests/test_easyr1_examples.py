"""EasyR1's 20 example scripts (tests/easyr1_examples, copied unchanged; its README names the commit) with
`python3 -m verl.trainer.main` replaced by `grpo.py`: bash expands each (its variables, `${MODEL_PATH}`, quotes,
line continuations, `$(date ...)`), a recorder stands in for python3, and the words go through grpo.py's parser and
the checks that run before a model loads, launched as README says: `python grpo.py` when the script asks for one
GPU, `torchrun --nproc_per_node N grpo.py` (WORLD_SIZE = n_gpus_per_node x nnodes) otherwise.
 Every
script must parse and pass (the DAPO-17k one with its ulysses_size=8 on its 8 GPUs)."""
import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest

import dapo
import easyr1_config as E
import grpo
import memory
from data import UserError
from benchmarks import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENDORED = os.path.join(ROOT, "tests", "easyr1_examples")
SCRIPTS = sorted(os.path.relpath(p, VENDORED) for p in glob.glob(os.path.join(VENDORED, "examples", "**", "*.sh"),
                                                                   recursive=True))


def test_the_twenty_scripts_are_there():
    assert len(SCRIPTS) == 20
    with open(os.path.join(ROOT, "tests", "easyr1_config.yaml")) as a, \
            open(os.path.join(VENDORED, "examples", "config.yaml")) as b:
        assert a.read().split("\n", 2)[2] == b.read()  # the same EasyR1 config as test_config.py's


def recorder(tmp_path, name):
    """An executable `name` in tmp_path/bin that writes its arguments to tmp_path/argv.json."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    code = f"import json, sys; json.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))"
    (shim / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{code}" "$@"\n')
    (shim / name).chmod(0o755)
    if not (tmp_path / "examples").exists():  # the scripts' relative paths, from a folder of the test's own
        (tmp_path / "examples").symlink_to(os.path.join(VENDORED, "examples"))
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "EXPERIMENT_NAME")}
    return {**env, "PATH": f"{shim}{os.pathsep}{env['PATH']}"}


def expand(script, tmp_path):
    """The script's python3 command line as bash builds it: a python3 on PATH that writes its argv as JSON. Runs in
    a folder of its own that sees the vendored examples/ (the save path EasyR1 derives is relative)."""
    env = recorder(tmp_path, "python3")
    subprocess.run(["bash", os.path.join(VENDORED, script)], cwd=tmp_path, check=True, capture_output=True, env=env)
    argv = json.load(open(tmp_path / "argv.json"))
    assert argv[:2] == ["-m", "verl.trainer.main"], argv
    return argv[2:]


def parse_and_check(words, cls, monkeypatch):
    """grpo.py's (or dapo.py's) start under the launcher the script's n_gpus_per_node x nnodes asks for."""
    trainer = E.from_words(words)[0].get("trainer", {})
    world = trainer.get("n_gpus_per_node", 8) * trainer.get("nnodes", 1)
    if world > 1:
        monkeypatch.setenv("WORLD_SIZE", str(world))  # torchrun --nproc_per_node N
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)  # python grpo.py
    cfg = E.cli(cls, grpo.DEMO, args=words)
    E.check(cfg, world)
    return cfg


@pytest.mark.parametrize("script", SCRIPTS)
def test_easyr1_script_parses_and_passes_the_checks(script, tmp_path, monkeypatch):
    words = expand(script, tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = parse_and_check(words, grpo.Config, monkeypatch)
    assert cfg.model_path.startswith("Qwen/") and os.path.isdir(cfg.output_dir)


def test_what_the_scripts_ask_for_arrives(tmp_path, monkeypatch):
    """A few values through bash and the parser: quoting, lists, the environment variable's default, a mapping."""
    words = expand("examples/qwen2_5_vl_3b_android_gui_grpo.sh", tmp_path)
    exp = next(w for w in words if w.startswith("trainer.experiment_name="))
    assert exp.startswith("trainer.experiment_name=qwen2_5_vl_3b_android_gui_grpo_2")  # ${VAR:-...$(date ...)}
    monkeypatch.chdir(tmp_path)
    cfg = parse_and_check([w for w in words if "lr_warmup_ratio" not in w], grpo.Config, monkeypatch)
    assert (cfg.logger, cfg.kl_coef, cfg.lr, cfg.max_grad_norm, cfg.filter_overlong_prompts, cfg.seed) == (
        ["console", "jsonl", "wandb"], 0.04, 1e-5, 0.1, False, 42)
    words = expand("examples/qwen2_5_vl_7b_geo3k_swanlab.sh", tmp_path)
    assert "trainer.logger=[console,swanlab]" in words  # bash removed the quotes inside the brackets
    words = expand("examples/qwen3_14b_dapo17k_dapo.sh", tmp_path)
    # as typed, on its 8 GPUs: Ulysses over all 8, dynamic sampling, 16 validation answers
    cfg = parse_and_check(words, grpo.Config, monkeypatch)
    assert (cfg.ulysses_size, cfg.max_response_length) == (8, 20480)
    assert json.loads(cfg.reward_function_kwargs) == {"max_response_length": 20480, "overlong_buffer_length": 4096,
                                                      "overlong_penalty_factor": 1.0}
    assert (cfg.filter_groups, cfg.filter_key, cfg.gen_batch_size, cfg.max_try_make_batch, cfg.precision) == (
        True, "accuracy_normalized", 256, 10, "bf16")
    assert (cfg.filter_low, cfg.filter_high, cfg.val_n, cfg.val_temperature, cfg.val_top_p) == (0.01, 0.99, 16, 1.0,
                                                                                                 0.7)
    words = expand("examples/qwen2_5_vl_7b_geo3k_reinforce.sh", tmp_path)
    cfg = parse_and_check(words, grpo.Config, monkeypatch)  # REINFORCE++ with the KL in the reward, as EasyR1
    assert (cfg.adv_estimator, cfg.kl_in_reward, cfg.kl_penalty, cfg.kl_coef, cfg.kl_type) == (
        "reinforce_plus_plus", True, "k1", 1e-3, "fixed")
    words = expand("examples/qwen2_5_vl_3b_android_gui_grpo.sh", tmp_path)
    assert parse_and_check(words, grpo.Config, monkeypatch).lr_warmup_ratio == 0.05  # steps once the data load


def test_the_dapo_script_passes_under_dapo_py_today(tmp_path, monkeypatch):
    words = expand("examples/qwen2_5_vl_7b_geo3k_dapo.sh", tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = parse_and_check(words, dapo.DAPOConfig, monkeypatch)
    assert (cfg.filter_groups, cfg.kl_coef, cfg.gen_batch_size, cfg.clip_ratio_high) == (True, 0.0, 128, 0.28)


def test_readme_one_word_change_runs_a_script(tmp_path, monkeypatch):
    """README's command, as written, with torchrun recording its argv: the script's words reach grpo.py, parse and
    pass the checks; and README says that all of them run."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    lines = [x.strip() for x in readme.splitlines()]
    i = next(i for i, x in enumerate(lines) if x.startswith("sed 's|python3 -m verl.trainer.main|"))
    cmd = (lines[i].rstrip("\\") + lines[i + 1]).replace("/path/to/vlm-rl/grpo.py", os.path.join(ROOT, "grpo.py"))
    subprocess.run(cmd, shell=True, cwd=tmp_path, check=True, capture_output=True,
                   env=recorder(tmp_path, "torchrun"))
    argv = json.load(open(tmp_path / "argv.json"))
    assert argv[:2] == ["--nproc_per_node", "8"] and argv[2] == os.path.join(ROOT, "grpo.py"), argv
    monkeypatch.chdir(tmp_path)
    cfg = parse_and_check(argv[3:], grpo.Config, monkeypatch)
    assert cfg.model_path == "Qwen/Qwen2.5-VL-7B-Instruct" and cfg.experiment_name == "qwen2_5_vl_7b_geo_grpo"
    assert f"{len(SCRIPTS)} example scripts" in readme
    assert f"all {len(SCRIPTS)} run this way" in " ".join(readme.split())


def test_the_qwen3_vl_30b_script_fits_the_computed_table(tmp_path, monkeypatch):
    """EasyR1's Qwen3-VL-30B-A3B example parses to pure bf16 (bf16 weights, bf16 AdamW) on 8 ranks, and the memory
    model for exactly that (the 30B-A3B preset, its rank count, its LoRA rank, KL coefficient and micro-batch tokens)
    holds it on an 80 GB card beside the engine; the computed table (BENCHMARKS.md, Memory cells) shows that cell. Then the script's config goes
    through grpo.setup's own check before loading (memory.check_before_loading) on simulated cards: the hub name
    Qwen/Qwen3-VL-30B-A3B-Instruct is a known model (presets.HUB_NAMES), so it is checked without a download."""
    words = expand("examples/qwen3_vl_30b_geo3k_grpo.sh", tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = parse_and_check(words, grpo.Config, monkeypatch)
    assert cfg.model_path == "Qwen/Qwen3-VL-30B-A3B-Instruct" and cfg.precision == "bf16"
    dims = bench.model_dims("qwen3_vl_30b_a3b")
    assert memory.known_dims(cfg.model_path) == dims
    m = memory.memory_model(dims, precision=cfg.precision, lora_rank=cfg.lora_rank, world=8, kl_coef=cfg.kl_coef,
                            mb_tokens=cfg.max_token_len_per_device)
    assert bench.smallest_card(m, dims, 8) == 80, m
    assert bench.smallest_card(memory.memory_model(dims, precision="amp", world=8), dims, 8) == 80  # AMP: just
    assert bench.smallest_card(memory.memory_model(dims, precision=cfg.precision, world=2), dims, 2) is None
    # EasyR1's config.yaml offloads weights and optimizer state (offload_params / offload_optimizer: true), so the
    # script as it is leaves the GPUs almost empty in the update and passes on 8 GPUs of 80 GB and on 2 H200s alike
    # (the host holds the state: memory.check_host_memory). Without the offload, the table's "bf16 (Kahan)" cells:
    # 8 x 80 GB pass, two H200s stop with one line that names the GPUs it takes (the 4-GPU cell holds it on a
    # 140 GiB card).
    assert cfg.offload_params and cfg.offload_optimizer
    memory.check_before_loading(cfg, 8, card_gib=80)
    memory.check_before_loading(cfg, 2, card_gib=140)
    on_gpu = dataclasses.replace(cfg, offload_params=False, offload_optimizer=False)
    memory.check_before_loading(on_gpu, 8, card_gib=80)
    with pytest.raises(UserError) as e:
        memory.check_before_loading(on_gpu, 2, card_gib=140)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--model-path Qwen/Qwen3-VL-30B-A3B-Instruct with --precision bf16 "
                                              "needs about "), msg
    assert "on 2 GPUs" in msg and "it takes 4 such GPUs (torchrun --nproc_per_node 4)" in msg, msg
    assert msg.endswith("or less per GPU: --lora-rank 64, --offload-params"), msg
