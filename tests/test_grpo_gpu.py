"""The trainer with the colocated vLLM engine (GPU only): after every sync the engine and the trainer agree on the
log-probs of the engine's samples, and a skipped sync is caught.  python3 -m pytest -q -m gpu tests"""
import json
import os
import sys

import pytest

pytestmark = pytest.mark.gpu
# GPU_TESTS_SHARED=1 (benchmarks/gpu_tests.sh shared): several test files at once on one GPU. vLLM's start-up memory
# profile assumes no other process allocates meanwhile, so each engine then takes a fixed KV cache (8 GiB: a sleep
# still frees far more than the other engines' wake-ups move the device's free memory) and a small share.
SHARED = os.environ.get("GPU_TESTS_SHARED") == "1"
SHARED_KV_GIB = 8


def engine_memory(share):
    """vLLM's memory options for a test engine that alone would take `share` of the GPU."""
    return dict(gpu_memory_utilization=0.05, kv_cache_memory_bytes=SHARED_KV_GIB * 2**30) if SHARED else dict(
        gpu_memory_utilization=share)


def engine_flags(share):
    """engine_memory as grpo.py's flags."""
    return ["--gpu-memory-utilization", "0.05", "--kv-cache-memory-gb", str(SHARED_KV_GIB)] if SHARED else [
        "--gpu-memory-utilization", str(share)]


def run(launch, tmp_path, *extra):
    pytest.importorskip("vllm")
    out = tmp_path / "run"
    launch.run([sys.executable, "grpo.py", "--rollout-engine", "vllm", "--enforce-eager", *engine_flags(0.2),
                "--max-steps", "4", "--val-freq", "0", "--output-dir", out, *extra], tmp_path / "run.log", 900)
    return [json.loads(x) for x in open(out / "metrics.jsonl")]


def test_engine_agrees_with_trainer_after_every_sync(tmp_path, launch):
    rows = run(launch, tmp_path)
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert len(diffs) == 4 and max(diffs) < 0.01, diffs  # bf16 on both sides: ~1e-3 seen on an H200
    assert all(r["memory/free_engine_asleep_gb"] > r["memory/free_engine_awake_gb"] + 1 for r in rows)


def test_a_skipped_sync_is_caught(tmp_path, launch):
    rows = run(launch, tmp_path, "--debug-skip-sync", "--max-steps", "5")
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    # stale once an update has moved the policy (0.13-0.3 seen); a first step whose groups all scored alike (every
    # sample wrong: ~1.5% are right at the start) has no gradient and leaves the engine current
    moved = next(i for i, r in enumerate(rows) if r["actor/grad_norm"] > 0)
    assert moved < 3 and max(diffs[:moved + 1]) < 0.01 and min(diffs[moved + 1:]) > 0.05, (moved, diffs)


def test_lora_engine_agrees_after_every_sync(tmp_path, launch):
    """LoRA: the engine gets merged weights (W + scale B A) under the base names; after the first step only the
    LoRA-wrapped layers (and modules trained in full) are re-sent, and the engine still matches the trainer."""
    rows = run(launch, tmp_path, "--lora-rank", "16", "--lora-modules-to-save", "lm_head")
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert len(diffs) == 4 and max(diffs) < 0.01, diffs
    assert rows[-1]["actor/kl"] > 0  # the adapters moved the policy away from the reference (adapters off)
