"""vLLM with the tiny Llama-3-style model (GPU only; skipped elsewhere): the engine checks test_qwen3_gpu.py runs for
the text Qwen3 (vLLM's prompt tokens are ours, log-probs against HF, every tensor's sync reaches the engine and
restores it; here with tied embeddings), and the demo's engine agreeing with the trainer after every sync.

    pytest -m gpu tests/test_llama_gpu.py -s
"""
import pytest

import test_qwen3_gpu
from test_grpo_gpu import run

pytestmark = pytest.mark.gpu


def test_vllm_llama_engine_and_sync(launch, tmp_path):
    pytest.importorskip("vllm")
    launch.script(test_qwen3_gpu.__file__, "llama", tmp_path / "llama.log", "QWEN3_GPU_OK llama")


def test_llama_demo_engine_agrees_with_trainer_after_every_sync(tmp_path, launch):
    rows = run(launch, tmp_path, "--demo-model", "llama")
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert len(diffs) == 4 and max(diffs) < 0.01, diffs
