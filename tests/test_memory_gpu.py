"""Memory modes on a GPU with the colocated vLLM engine (GPU only): pure bf16 trains and the engine agrees with
it, offloading runs, and the memory keys separate the trainer's peak from the engine's pool.
python3 -m pytest -q -m gpu tests/test_memory_gpu.py"""
import pytest

from test_grpo_gpu import run

pytestmark = pytest.mark.gpu


def test_memory_keys_split_trainer_and_engine(tmp_path, launch):
    rows = run(launch, tmp_path, "--max-steps", "2")
    for r in rows:
        pool, awake = r["memory/engine_pool_gb"], r["memory/engine_awake_gb"]
        assert pool > 0.5, r  # weights + KV cache of the engine (gpu_memory_utilization 0.2 of an H200: ~28 GB)
        assert awake == pytest.approx(pool, rel=0.25), r  # the driver sees the pool mapped on waking
        for ph in ("gen", "update"):
            assert 0 < r[f"memory/trainer_peak_{ph}_gb"] < r["memory/gpu_peak_allocated_gb"], (ph, r)
        assert 0 <= r["memory/engine_other_gb"] < 5, r  # CUDA graphs (none here: --enforce-eager), buffers
        assert r["memory/trainer_peak_gb"] + pool + r["memory/engine_other_gb"] == pytest.approx(
            r["memory/gpu_peak_allocated_gb"], rel=1e-6)


def test_pure_bf16_trains_and_the_engine_agrees(tmp_path, launch):
    rows = run(launch, tmp_path, "--precision", "bf16")
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert max(diffs) < 0.01, diffs
    assert rows[-1]["reward/mean"] > rows[0]["reward/mean"] or rows[-1]["actor/kl"] > 0


@pytest.mark.parametrize("flags", [["--offload-params"], ["--offload-optimizer"]])
def test_offload_runs_and_agrees(tmp_path, flags, launch):
    rows = run(launch, tmp_path, "--max-steps", "3", *flags)
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert max(diffs) < 0.01, diffs
    # the offloaded state takes real steps (a step whose groups all scored alike has no gradient: 0 is right then)
    norms = [r["actor/grad_norm"] for r in rows]
    assert all(n >= 0 for n in norms) and sum(n > 0 for n in norms) >= 2, norms
