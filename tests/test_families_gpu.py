"""vLLM with the tiny Gemma 4 and InternVL (the generic path, families.py; GPU only, skipped elsewhere).

    pytest -m gpu tests/test_families_gpu.py -s       # each engine check runs in its own process (one vLLM each)
    PYTHONPATH=.:tests python tests/test_families_gpu.py gemma4    # the same checks by hand: gemma4 | internvl

Per family: vLLM expands the one-placeholder prompt (the chat template's <|image|> / <IMG_CONTEXT>) into exactly the
tokens the HF processor made (Gemma 4: <|image> + 70 soft tokens + <image|>; InternVL: <img> + 4 per tile + </img>),
the engine's log-probs agree with HF's forward on the same weights (Gemma 4: soft-capped logits, per-layer head sizes
through families.vllm_overrides), a sync of every HF in-memory name changes greedy output and restoring gives it
back exactly; and the demo's engine/trainer agreement over 4 steps (the matrix rows: benchmarks/matrix.py).
"""
import sys

import pytest

import rollout
import tiny_model
from test_grpo_gpu import run
from test_qwen3_gpu import engine_checked, mean_logprob_diff, vl_prompts
from test_vllm_gpu import greedy, perturb

pytestmark = pytest.mark.gpu


def check(arch):
    rollout._set_vllm_env()
    path = tiny_model.build_tiny_model(arch=arch)
    recs = vl_prompts(path)  # three one-image prompts of different sizes and a two-image one
    eng, ref, sd, base = engine_checked(path, arch, recs, limit_mm_per_prompt={"image": 2, "video": 0})
    assert greedy(eng, recs) == base
    for name, keep in (("all", lambda k: True), ("vision tower only", lambda k: "vision_tower" in k)):
        new = perturb(sd, keep, scale=0.5)
        eng.sync_weights(new.items())
        changed = greedy(eng, recs)
        print(f"[{arch}] perturbed {name} ({len(new)} tensors): greedy changed for "
              f"{sum(a != b for a, b in zip(changed, base))}/{len(base)} prompts")
        if name == "all":
            assert changed != base
        else:  # the engine computes with exactly the new vision weights (its encoder cache reset)
            ref.load_state_dict({k: v.float() for k, v in new.items()}, strict=False)
            d = mean_logprob_diff(eng, ref, recs)
            print(f"[{arch}] after the vision update: vLLM vs HF mean |logp diff| {d:.4f}")
            assert d < 0.1
        eng.sync_weights(sd.items())
        ref.load_state_dict({k: v.float() for k, v in sd.items()})
        assert greedy(eng, recs) == base  # restored exactly
    print(f"FAMILIES_GPU_OK {arch} vllm={eng.version}", flush=True)


@pytest.mark.parametrize("arch", ["gemma4", "internvl"])
def test_vllm_engine_expansion_logprobs_and_sync(launch, tmp_path, arch):
    pytest.importorskip("vllm")
    launch.script(__file__, arch, tmp_path / f"{arch}.log", f"FAMILIES_GPU_OK {arch}")


@pytest.mark.parametrize("demo", ["gemma4", "internvl"])
def test_demo_engine_agrees_with_trainer_after_every_sync(tmp_path, demo, launch):
    rows = run(launch, tmp_path, "--demo-model", demo)
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert len(diffs) == 4 and max(diffs) < 0.01, diffs


if __name__ == "__main__":
    check(sys.argv[1])
