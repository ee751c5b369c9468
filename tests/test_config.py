"""Which defaults are in force (EasyR1's for a real model, the demo's only for the demo) and EasyR1's own YAML
config read unchanged (tests/easyr1_config.yaml is a verbatim copy of EasyR1's examples/config.yaml)."""
import os
import re
from dataclasses import asdict

import pytest
import yaml

import dapo
import easyr1_config as E
import grpo
from easyr1_config import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "tests", "easyr1_config.yaml")
# where the defaults differ from EasyR1's example on purpose (README, Options): files, model and reward are the
# user's; one GPU must work out of the box (TP 1); validation is greedy; logs go where this project puts them
DELIBERATE = {"train_files", "val_files", "model_path", "format_prompt", "reward_function", "tensor_parallel_size",
              "val_temperature", "val_top_p", "logger", "project_name", "experiment_name", "output_dir",
              # EasyR1's example offloads the actor to the host; off here by default: an H200 holds a 7B policy
              # sharded over 2+ GPUs, and host offload costs seconds per step (README: Memory modes)
              "offload_params", "offload_optimizer",
              # dynamic sampling's prompts per try: 0 here, which is the rollout batch (EasyR1's null) for grpo.py
              # and 3 x it for dapo.py (the paper's); EasyR1's null reads as the rollout batch in both
              "gen_batch_size",
              # LoRA leaves every family's towers alone (EasyR1's .*visual.* names Qwen's only; the same on Qwen)
              "lora_exclude_modules"}


def leaves(d, prefix=""):
    for k, v in d.items():
        yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]


def test_real_models_get_easyr1_defaults():
    opts, _ = E.translate(yaml.safe_load(open(EXAMPLE)), grpo.Config)
    real = cli(grpo.Config, grpo.DEMO, args=["--model-path", "Qwen/Qwen2.5-VL-7B-Instruct"])
    same = {k: v for k, v in opts.items() if k not in DELIBERATE}
    assert {k: getattr(real, k) for k in same} == same  # lr 1e-6, n 5, 2048 tokens, 262144..4194304 pixels, ...
    assert (real.lr, real.n, real.max_response_length, real.rollout_batch_size, real.global_batch_size) == (
        1e-6, 5, 2048, 512, 128)
    assert real.max_steps == 0 and real.total_epochs == 15  # EasyR1's: max_steps null, 15 epochs


def test_the_demo_gets_its_own_and_flags_win(capsys):
    demo = cli(grpo.Config, grpo.DEMO, args=[])
    assert {k: getattr(demo, k) for k in grpo.DEMO} == grpo.DEMO
    # the demos' table (docs/demos.md) was measured with these
    assert (demo.lr, demo.n, demo.max_response_length, demo.max_pixels, demo.rollout_batch_size) == (
        1e-3, 16, 4, 12544, 16)
    assert "defaults: demo (tiny model); set: nothing" in capsys.readouterr().out
    # a flag equal to EasyR1's default still wins over the demo's (compared against the demo set, not EasyR1's)
    assert cli(grpo.Config, grpo.DEMO, args=["--rollout-n", "5", "--lr", "1e-6"]).n == 5
    real = cli(grpo.Config, grpo.DEMO, args=["--model-path", "m", "--lr", "2e-6"])
    assert real.lr == 2e-6 and real.n == 5
    out = capsys.readouterr().out
    assert "defaults: EasyR1; set: model_path=m lr=2e-06" in out
    d = cli(dapo.DAPOConfig, dapo.DEMO, args=[])
    assert (d.max_steps, d.n, d.output_dir, d.clip_ratio_high, d.lr) == (60, 32, "outputs/dapo", 0.28, 1e-3)
    assert cli(dapo.DAPOConfig, dapo.DEMO, args=["--model-path", "m"]).output_dir == "outputs/run"


def test_the_picture_demos_decay_their_lr_and_the_slow_demos_keep_it_constant():
    """tiny_model's demo settings: the colour demos, every family's, take a cosine lr (at a constant one a solved task's
    late gradient spikes undid a colour: Gemma 4, pure bf16); the text and zoom demos and dapo.py's keep a constant one
    (a cosine sums to half of it: the text demo and dapo's ended short with it). Gemma 4 takes KL 0.1 (at 0.01 it lost a
    colour more often), Qwen3.5-MoE temperature 1.2; a flag still wins, and a real model gets EasyR1's defaults."""
    demos = dict(text_demo=grpo.TEXT_DEMO, video_demo=grpo.VIDEO_DEMO, tools_demo=grpo.TOOLS_DEMO,
                 family_demo=grpo.FAMILY_DEMO)
    parse = lambda demo, *args: cli(grpo.Config, demo, args=list(args), **demos)  # noqa: E731
    for model in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5", "internvl", "gemma4"):
        assert parse(grpo.DEMO, "--demo-model", model).lr_scheduler_type == "cosine", model
    assert parse(grpo.DEMO, "--demo-task", "video").lr_scheduler_type == "cosine"
    for slow in (parse(grpo.DEMO, "--demo-model", "qwen3"), parse(grpo.DEMO, "--demo-task", "zoom"), parse(dapo.DEMO),
                 parse(dapo.DEMO, "--demo-model", "gemma4"), parse(grpo.DEMO, "--lr-scheduler-type", "constant"),
                 parse(grpo.DEMO, "--model-path", "m")):
        assert slow.lr_scheduler_type == "constant"
    assert [parse(grpo.DEMO, *a).kl_coef for a in (["--demo-model", "gemma4"], ["--demo-model", "internvl"],
            ["--demo-model", "gemma4", "--kl-coef", "0.01"], ["--model-path", "m", "--demo-model", "gemma4"])] == \
        [0.1, 0.01, 0.01, 0.01]
    # Qwen3.5-MoE samples at 1.2 (at 1.0 a merged pair of colours split late)
    assert [parse(grpo.DEMO, *a).temperature for a in (["--demo-model", "qwen3_5_moe"], ["--demo-model", "qwen3_5"],
            ["--demo-model", "qwen3_5_moe", "--temperature", "1.0"])] == [1.2, 1.0, 1.0]


def test_help_shows_the_real_defaults_and_names_the_demos(capsys):
    with pytest.raises(SystemExit):
        cli(grpo.Config, grpo.DEMO, args=["--help"])
    out = re.sub(r"[\s│]+", " ", capsys.readouterr().out)
    assert re.search(r"--lr FLOAT [^()]*\(default: 1e-06\)", out)
    assert "the demo (no --model-path) uses" in out and "lr=0.001" in out and "n=16" in out


def test_every_key_of_easyr1s_example_is_mapped_or_explained():
    keys = list(leaves(yaml.safe_load(open(EXAMPLE))))
    assert len(keys) >= 80
    assert [k for k in keys if E._entry(k) is None] == []
    for cls in (grpo.Config, dapo.DAPOConfig):
        opts, notes = E.translate(yaml.safe_load(open(EXAMPLE)), cls)
        assert all(o in asdict(cls()) for o in opts)
        listed = " ".join(notes)
        for k in keys:  # each key either sets an option or is named in the start-up notes
            entry = E.TABLE[E._entry(k)]
            assert entry[0] in opts or k in listed, k


def migration_table():
    """easyr1_config.TABLE as docs/easyr1.md shows it: the keys of the same name in one row, then one row each."""
    groups = {}
    for k, (o, c, n) in E.TABLE.items():
        if n is E.SAME:
            groups.setdefault(k.rpartition(".")[0], []).append(k.rpartition(".")[2])
    rows = ["| EasyR1 key | here | note |", "|---|---|---|",
            "| " + "; ".join(f"`{sec}.` " + ", ".join(keys) for sec, keys in groups.items())
            + " | the same name (`data.max_pixels` -> `--max-pixels`) | |"]
    for k, (o, c, n) in E.TABLE.items():
        if n is not E.SAME:
            rows.append(f"| `{k}` | {f'`--{o.replace(chr(95), chr(45))}`' if o else 'none'} | {n or ''} |")
    return "\n".join(rows)


def test_docs_migration_table_is_the_tables():
    """docs/easyr1.md (README "Coming from EasyR1" links it) holds easyr1_config.TABLE; when it does not, the
    message is the table to paste there."""
    table = migration_table()
    assert table in open(os.path.join(ROOT, "docs", "easyr1.md")).read(), "docs/easyr1.md's table should be:\n" + table


def test_example_config_values_and_overrides(capsys):
    cfg = cli(grpo.Config, grpo.DEMO, args=["--config", EXAMPLE, "--lr", "3e-6"])
    assert cfg.lr == 3e-6  # the flag wins over the file
    assert (cfg.model_path, cfg.n, cfg.kl_coef, cfg.val_temperature, cfg.val_top_p) == (
        "Qwen/Qwen2.5-7B-Instruct", 5, 1e-2, 0.6, 0.95)
    assert cfg.output_dir == "checkpoints/easy_r1/qwen2_5_7b_math_grpo"  # EasyR1's rule for the save path
    assert cfg.logger == ["jsonl", "wandb"] and cfg.val_freq == 5 and cfg.save_limit == 3
    out = capsys.readouterr().out
    assert "defaults: EasyR1; from " in out and "data.val_batch_size=1024 (no option here" in out  # listed, with why
    d = cli(dapo.DAPOConfig, dapo.DEMO, args=["--config", EXAMPLE])
    assert (d.filter_groups, d.filter_key, d.max_try_make_batch) == (False, "overall", 20)


def test_conversions_and_refusals():
    y = yaml.safe_load(open(EXAMPLE))
    y["algorithm"].update(disable_kl=True, kl_penalty="kl")
    y["worker"]["actor"]["optim"]["lr"] = "5e-7"  # YAML reads this as a string; EasyR1 converts by type
    y["trainer"].update(val_freq=-1, save_limit=-1, max_steps=40)
    y["worker"]["actor"]["optim"]["lr_warmup_ratio"] = 0.1
    y["worker"]["reward"]["reward_function"] = "my_reward.py"
    y["data"]["shuffle"] = False  # the file's order (data.draw_prompts)
    opts, _ = E.translate(y, grpo.Config)
    assert opts["shuffle"] is False
    assert (opts["kl_coef"], opts["kl_penalty"], opts["lr"], opts["val_freq"], opts["save_limit"]) == (
        0.0, "k1", 5e-7, 0, 0)
    # the warm-up ratio stays a ratio: grpo.setup turns it into optimizer steps once the data fix max_steps
    assert (opts["max_steps"], opts["lr_warmup_ratio"], opts["reward_function"]) == (40, 0.1, "my_reward.py:main")
    y["worker"]["actor"]["model"]["lora"]["rank"] = 8
    y["algorithm"].update(online_filtering=True, kl_penalty="full", adv_estimator="gae")
    y["trainer"]["logger"] = ["clearml"]
    y["data"]["typo_key"] = 1
    with pytest.raises(ValueError) as e:
        E.translate(y, grpo.Config)
    for part in ("data.typo_key: not an EasyR1 key", "algorithm.kl_penalty='full'", "algorithm.adv_estimator='gae'",
                 "trainer.logger=['clearml']"):
        assert part in str(e.value), part
    assert "online_filtering" not in str(e.value)  # dynamic sampling: grpo.py's too


def test_easyr1_lora_block_maps_to_our_lora_options():
    y = yaml.safe_load(open(EXAMPLE))
    y["worker"]["actor"]["model"]["lora"].update(rank=8, target_modules="q_proj,v_proj")
    opts, _ = E.translate(y, grpo.Config)
    assert (opts["lora_rank"], opts["lora_alpha"], opts["lora_target_modules"], opts["lora_exclude_modules"]) == (
        8, 64, "q_proj,v_proj", ".*visual.*")


def test_easyr1_precision_and_offload_map_to_ours():
    y = yaml.safe_load(open(EXAMPLE))
    actor = y["worker"]["actor"]
    actor["fsdp"].update(torch_dtype="bf16", enable_cpu_offload=False)
    actor["offload"].update(offload_params=False, offload_optimizer=True)
    opts, _ = E.translate(y, grpo.Config)
    assert (opts["precision"], opts.get("offload_params", False), opts["offload_optimizer"]) == ("bf16", False, True)
    actor["fsdp"].update(torch_dtype=None, enable_cpu_offload=True)
    opts, _ = E.translate(y, grpo.Config)
    assert "precision" not in opts and opts["offload_params"] is True
    actor["fsdp"]["torch_dtype"] = "fp16"
    with pytest.raises(Exception, match="torch_dtype='fp16': choose null, fp32 or bf16"):
        E.translate(y, grpo.Config)


@pytest.mark.parametrize("recipe, nproc", [("qwen25vl_7b", 8), ("lora_7b_40gb", 1), ("multinode", 16),
                                           ("qwen35_9b", 8)])
def test_run_sh_recipes_parse_and_pass_the_option_checks(recipe, nproc, tmp_path):
    """Each real-model line of run.sh, as bash expands it (python and torchrun replaced by a recorder), parses and
    passes the checks that run before a model loads: a misspelt option or a batch that does not divide fails here."""
    import subprocess
    shim = tmp_path / "bin"
    shim.mkdir()
    for exe in ("python", "torchrun"):  # write one argument per line: the recorded command line
        (shim / exe).write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
        (shim / exe).chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "NNODES": "2", "MASTER_ADDR": "node0"}
    subprocess.run(["bash", os.path.join(ROOT, "run.sh"), recipe, "--output-dir", str(tmp_path / "out")], env=env,
                   check=True)
    argv = (tmp_path / "argv").read_text().splitlines()
    args = argv[argv.index("grpo.py") + 1:]
    cfg = cli(grpo.Config, grpo.DEMO, args=args)
    want = "Qwen/Qwen3.5-9B" if recipe == "qwen35_9b" else "Qwen/Qwen2.5-VL-7B-Instruct"
    assert cfg.model_path == want and cfg.output_dir == str(tmp_path / "out")
    E.check(cfg, nproc)
    if recipe == "lora_7b_40gb":  # the cell measured on the H200 capped to 40 GB (BENCHMARKS.md, Memory cells)
        assert (cfg.lora_rank, cfg.precision, cfg.max_token_len_per_device, cfg.kv_cache_memory_gb) == \
            (64, "bf16", 8192, 1.5)
