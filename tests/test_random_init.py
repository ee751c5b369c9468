"""Models without weights on disk (bench.py's big presets, the 30B-A3B): the folder holds config, tokenizer and
processor; the trainer builds the random model from the config (the values build_random_model would have saved), the
engines start on placeholders (vLLM: load_format="dummy") and the first sync, before any generation, sends every
weight, LoRA or not. Runs on the tiny MoE preset."""
import dataclasses
import json
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import fsdp_actor as actor
import grpo
import presets
import rollout
from benchmarks import bench

CPU = torch.device("cpu")
PRESET = "tiny_qwen3_vl_moe"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    actor.init_distributed()  # (build_actor's device mesh: a 1-rank group)
    d = tmp_path_factory.mktemp("random_init")
    return (bench.build_random_model(str(d / "weights"), PRESET),
            bench.build_random_model(str(d / "none"), PRESET, weights=False))


def test_the_model_built_from_the_config_is_the_one_presets_would_have_saved(folders):
    """Same config file, no weight file, and load_hf_model of the folder without weights gives exactly the model
    read from the folder with them (every parameter and buffer, fp32 from the bf16 build), the caller's random
    stream untouched."""
    saved, none = folders
    assert not [f for f in os.listdir(none) if f.endswith((".safetensors", ".bin"))]
    assert presets.random_init(none) == {"preset": PRESET, "seed": 0} and presets.random_init(saved) is None
    assert json.load(open(os.path.join(none, "config.json"))) == json.load(open(os.path.join(saved, "config.json")))
    want = actor.load_hf_model(saved)
    torch.manual_seed(5)
    got = actor.load_hf_model(none)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))  # built under its own seed, in a forked random state
    assert type(got) is type(want) and not got.training
    for a, b in ((want.state_dict(), got.state_dict()), (dict(want.named_buffers()), dict(got.named_buffers()))):
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert {p.dtype for p in got.parameters()} == {torch.float32}
    assert {p.dtype for p in actor.load_hf_model(none, torch.bfloat16).parameters()} == {torch.bfloat16}


def test_which_presets_go_without_weights():
    """bench.py writes the 30B-A3B (62 GB in bf16, the GPU machine has 64 GiB of disk), the 32B and the 72B without
    weights; the 8B and smaller (measured from disk) and the tiny preset keep theirs unless --random-init."""
    assert [p for p in ("qwen2_5_vl_3b", "qwen3_vl_8b", "qwen3_vl_30b_a3b", "qwen2_5_vl_72b", PRESET)
            if bench.too_big_for_disk(p)] == ["qwen3_vl_30b_a3b", "qwen2_5_vl_72b"]


def _ctx(model, engine, lora):
    return SimpleNamespace(cfg=SimpleNamespace(debug_skip_sync=False), engine_stale=True, rollout=engine, model=model,
                           lora=lora, compute_dtype=torch.float32)


def test_the_engine_starts_on_placeholders_and_the_first_sync_sends_every_weight(folders):
    """The HF engine on a folder without weights holds placeholders (vLLM's dummy range, +-1e-3) and says its
    weights are lost; grpo.sync_engine then sends them all, with LoRA too (whose later syncs send only the merged
    LoRA layers): afterwards the engine holds exactly the trainer's merged weights. A sync of the LoRA layers alone
    onto placeholders is refused."""
    _, none = folders
    lora = dict(r=4, alpha=8, target_modules="all-linear", exclude_modules=r".*visual.*", modules_to_save="")
    model = actor.build_actor(none, CPU, torch.float32, torch.float32, lora=lora)
    with torch.no_grad():  # adapters that change the merged weights
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.to_local().normal_(0, 0.1)
    engine = rollout.make_rollout("hf", none, CPU, torch.float32)
    assert engine.weights_lost and max(float(p.detach().abs().max()) for p in engine.model.parameters()) < 1.01e-3
    with pytest.raises(RuntimeError, match="were not sent"):
        engine.sync_weights(actor.iter_full_params(model, torch.float32, lora_only=True))
    grpo.sync_engine(_ctx(model, engine, lora))
    want = dict(actor.iter_full_params(model, torch.float32))
    got = engine.model.state_dict()
    assert not engine.weights_lost and want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    base = actor.load_hf_model(none).state_dict()
    assert any(not torch.equal(want[k], base[k]) for k in want)  # the merged adapters arrived, not only the base


def test_vllm_starts_with_load_format_dummy_only_without_weights(folders, monkeypatch):
    """make_rollout gives vLLM load_format="dummy" for a folder without weights (and nothing new otherwise), and
    the engine then counts its weights as lost: generate refuses until a sync has sent them."""
    made = []

    class LLM:
        llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(use_v2_model_runner=True))

        def __init__(self, **kw):
            made.append(kw)

    names = ["model", "tensor_parallel_size", "dtype", "gpu_memory_utilization", "max_model_len",
             "max_num_batched_tokens", "enable_sleep_mode", "seed", "enforce_eager", "logprobs_mode",
             "disable_log_stats", "limit_mm_per_prompt", "mm_processor_kwargs", "load_format",
             "distributed_executor_backend", "kv_cache_memory_bytes"]
    EngineArgs = dataclasses.make_dataclass("EngineArgs", names)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.26.0", LLM=LLM))
    monkeypatch.setitem(sys.modules, "vllm.engine", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", types.SimpleNamespace(EngineArgs=EngineArgs))
    monkeypatch.setattr(rollout, "_init_world_for_external_dp", lambda: None)
    saved, none = folders
    opts = rollout.engine_options(grpo.Config(max_pixels=112 * 112, min_pixels=56 * 56))
    engines = [rollout.make_rollout("vllm", path, CPU, torch.bfloat16, **opts) for path in (none, saved)]
    assert made[0]["load_format"] == "dummy" and "load_format" not in made[1]
    assert engines[0].weights_lost and not engines[1].weights_lost
    with pytest.raises(RuntimeError, match="call sync_weights"):
        engines[0].generate([{}], 1, 1.0, 1.0, 4, [0])


def test_bench_trains_two_steps_without_weights_on_disk(tmp_path, launch):
    """`python -m benchmarks.bench --random-init` on the tiny MoE preset with LoRA, on the CPU (HF engine): no weight file is written,
    two steps train, and the engine's log-probs of what it sampled equal the trainer's (on placeholders they would
    differ by ~0.2 per token: seen when the engine's first sync sent only the LoRA layers)."""
    out = tmp_path / "run"
    launch.run([sys.executable, "-m", "benchmarks.bench", "--preset", PRESET, "--random-init", "--max-steps", "2",
                "--rollout-batch-size", "2", "--global-batch-size", "2", "--n", "4", "--max-response-length", "8",
                "--min-pixels", "3136", "--max-pixels", "12544", "--lora-rank", "4", "--lr", "1e-3",
                "--rollout-logprobs-every", "1", "--output-dir", out], tmp_path / "bench.log", BENCH_DIR=tmp_path / "bench")
    folder = tmp_path / "bench" / "model-random"
    assert presets.random_init(str(folder)) and not list(folder.glob("*.safetensors"))
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4 and r["timing/update"] > 0
    summary = json.load(open(out / "bench_summary.json"))
    assert summary["preset"] == PRESET and summary["config"]["lora_rank"] == 4
