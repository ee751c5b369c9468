"""The zoom demo's multi-turn rollouts with the colocated vLLM engine (GPU only): the engine continues each trajectory
from the ids it sampled plus the tool's picture, and the trainer agrees with it on the model's tokens (the tools'
answers are outside the agreement, as outside the loss).  python3 -m pytest -q -m gpu"""
import json
import sys

import pytest

from test_grpo_gpu import engine_flags

pytestmark = pytest.mark.gpu


def test_zoom_demo_with_vllm_calls_the_tool_and_agrees_on_the_models_tokens(tmp_path, launch):
    pytest.importorskip("vllm")
    out = tmp_path / "run"
    launch.run([sys.executable, "grpo.py", "--demo-task", "zoom", "--rollout-engine", "vllm", "--enforce-eager",
                *engine_flags(0.2), "--max-steps", "70", "--val-freq", "0", "--rollout-logprobs-every", "1",
                "--output-dir", out], tmp_path / "run.log", 1800)
    check_zoom_run([json.loads(x) for x in open(out / "metrics.jsonl")])


def check_zoom_run(rows):
    """The bars of the run's metrics rows (tests/test_tools.py holds them to its recorded GPU runs of 2026-12-05)."""
    # 70 steps: the balanced batches, KL 0.1 (TOOLS_DEMO): the call rate passed 0.5 at step 43 in two runs (2026-12-05)
    late = [r for r in rows if r["tools/call_rate"] > 0.5]  # most samples' agreement then spans two turns
    assert late, [r["tools/call_rate"] for r in rows]
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    # the run's mean is the matrix's bar (MAX_DIFF_MEAN); one step's mean over ~1,000 one-token turns strays to
    # 0.7-1.4e-2 in some zoom runs (2026-12-03 to 12-05; not explained yet). A tool picture in the wrong place
    # or a turn's ids re-tokenized shifts whole stretches of steps by far more (the video demo's text at wrong M-RoPE
    # positions, before that fix: steps at up to 0.48, BENCHMARKS.md)
    assert sum(diffs) / len(diffs) < 5e-3 and max(diffs) < 5e-2, diffs
    assert all(r["tools/errors"] == 0 and r["tools/timeouts"] == 0 for r in rows)
