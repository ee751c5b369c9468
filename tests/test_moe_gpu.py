"""vLLM with the tiny Qwen3-VL-MoE (GPU only; skipped elsewhere; passed on one H200, 2026-12-01).

    pytest -m gpu tests/test_moe_gpu.py -s        # the engine check runs in its own process (one vLLM per process)
    PYTHONPATH=. python tests/test_moe_gpu.py     # the same check by hand

The engine gets the HF names and the fused expert tensors as transformers keeps them ([E, 2I, H] gate|up, [E, H, I]
down; vLLM 0.26's RoutedExperts.load_weights takes a 3-D tensor whole and splits it per expert itself), so a weight
changed in one expert only must reach exactly that expert of the engine, and the engine must then compute what the
HF model with that weight computes.
"""
import pytest
import torch

import rollout
import tiny_model
from test_grpo_gpu import engine_memory, run
from test_qwen3_gpu import PX, mean_logprob_diff, vl_prompts
from test_vllm_gpu import greedy, sharpen

pytestmark = pytest.mark.gpu
NAME = "model.language_model.layers.0.mlp.experts.gate_up_proj"


def engine_experts(eng, layer=0):
    """The engine's fused gate|up weights of one layer, [E, 2I, H] on the host (vLLM's w13 parameter)."""
    def get(model):
        found = [p for n, p in model.named_parameters() if f"layers.{layer}.mlp.experts" in n and "w13" in n]
        assert len(found) == 1, [n for n, _ in model.named_parameters() if "experts" in n]
        return found[0].detach().float().cpu().clone()
    return eng.llm.apply_model(get)[0]


def check():
    rollout._set_vllm_env()
    path = tiny_model.build_tiny_model(arch="qwen3_vl_moe")
    eng = rollout.VLLMRollout(path, **engine_memory(0.25), max_model_len=1024, enforce_eager=True,
                              dtype="bfloat16", limit_mm_per_prompt={"image": 2, "video": 0}, mm_processor_kwargs=PX)
    recs = vl_prompts(path)
    ref = rollout.load_hf_model(path, torch.bfloat16).float().cuda().eval()
    sd = {k: v.to(torch.bfloat16) for k, v in sharpen(ref.state_dict()).items()}
    eng.sync_weights(sd.items())
    ref.load_state_dict({k: v.float() for k, v in sd.items()})
    before = engine_experts(eng)
    assert torch.equal(before, sd[NAME].float().cpu())  # the fused layout as the engine holds it: no transpose
    d = mean_logprob_diff(eng, ref, recs)
    print(f"[qwen3_vl_moe] vLLM vs HF mean |logp diff| {d:.4f}")
    assert d < 0.1
    base = greedy(eng, recs)
    # expert 1 of layer 0 only: its gate and up rows change, the other experts' rows are sent unchanged
    new = sd[NAME].clone()
    g = torch.Generator().manual_seed(7)
    new[1] = (new[1].float() + 2.0 * torch.randn(new[1].shape, generator=g).to(new.device)).to(new.dtype)
    eng.sync_weights([(NAME, new)])
    after = engine_experts(eng)
    assert torch.equal(after[1], new[1].float().cpu()), "expert 1 did not reach the engine"
    for e in (0, 2, 3):
        assert torch.equal(after[e], before[e]), f"expert {e} changed"
    ref.load_state_dict({NAME: new.float()}, strict=False)
    d = mean_logprob_diff(eng, ref, recs)
    print(f"[qwen3_vl_moe] after the one-expert update: vLLM vs HF mean |logp diff| {d:.4f}; greedy changed for "
          f"{sum(a != b for a, b in zip(greedy(eng, recs), base))}/{len(base)} prompts")
    assert d < 0.1
    eng.sync_weights(sd.items())
    assert torch.equal(engine_experts(eng), before) and greedy(eng, recs) == base  # restored exactly
    print(f"MOE_GPU_OK vllm={eng.version}", flush=True)


def test_vllm_qwen3_vl_moe_engine_and_one_expert_sync(launch, tmp_path):
    pytest.importorskip("vllm")
    launch.script(__file__, "moe", tmp_path / "moe.log", "MOE_GPU_OK")


def test_moe_demo_engine_agrees_with_trainer_after_every_sync(tmp_path, launch):
    """The matrix's agreement measure on the tiny MoE (per token, mean and max), printed for BENCHMARKS.md."""
    rows = run(launch, tmp_path, "--demo-model", "qwen3_vl_moe")
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    print("MoE engine/trainer |logp diff| mean per step", diffs,
          "max", [r.get("rollout/logprob_diff_max") for r in rows])
    assert len(diffs) == 4 and max(diffs) < 0.05, diffs


if __name__ == "__main__":
    check()
