"""vLLM with the tiny Qwen3-VL and the tiny text Qwen3 (GPU only; skipped elsewhere).

    pytest -m gpu tests/test_qwen3_gpu.py -s        # each engine check runs in its own process (one vLLM per process)
    PYTHONPATH=. python tests/test_qwen3_gpu.py qwen3_vl    # the same checks by hand: qwen3_vl | qwen3
"""
import sys

import pytest
import torch

import rollout
import tiny_model
from test_grpo_gpu import engine_memory, run
from test_vllm_gpu import greedy, perturb, ref_logprobs, sharpen_for

pytestmark = pytest.mark.gpu
PX = dict(min_pixels=56 * 56, max_pixels=112 * 112)


def vl_prompts(path):
    """Three one-image prompts and a two-image one (vLLM expands each single <|image_pad|> itself)."""
    import data
    from PIL import Image, ImageDraw
    proc = data.load_processor(path)
    ims = []
    for i, rgb in enumerate(tiny_model.COLORS.values()):
        im = Image.new("RGB", (84 + 28 * i, 56 + 14 * i), (255, 255, 255))
        ImageDraw.Draw(im).rectangle([10, 10, 50, 40], fill=rgb)
        ims.append(im)
    rows = [{"problem": "<image>What is the color of the shape?", "answer": "a", "images": [im]} for im in ims[:3]]
    rows.append({"problem": "<image> and <image>: which is blue?", "answer": "a", "images": ims[2:]})
    return [data.encode_prompt(r, proc, **PX) for r in rows]


def text_prompts(path):
    import data
    tok = data.load_processor(path)
    lists = ((3, 4, 1), (9, 8, 0, 2), (0, 5, 7, 1, 3), (6, 2, 4))  # the text demo's task: the largest digit
    return [data.encode_prompt({"problem": tiny_model.MAX_QUESTION.format(digits=", ".join(map(str, d))),
                                "answer": str(max(d))}, tok, format_prompt=tiny_model.NUMBER_FORMAT_PROMPT) for d in lists]


def mean_logprob_diff(eng, ref, recs, temperature=0.7):
    out = eng.generate(recs, n=4, temperature=temperature, top_p=1.0, max_tokens=24, seeds=[1, 2, 3, 4][:len(recs)])
    diffs = []
    for rec, group in zip(recs, out):
        for o in group:
            r = ref_logprobs(ref, rec, o["response_ids"], temperature, eng.forbidden_ids)
            diffs.append((torch.tensor(o["logprobs"]) - r).abs())
    return torch.cat(diffs).mean().item()


def engine_checked(path, arch, recs, **kw):
    """A vLLM engine on `path` whose prompt expansion is ours, synced with the sharpened weights, whose log-probs
    agree with HF's (bf16-rounded weights, fp32 compute). Returns (engine, HF model, weights sent, greedy answers)."""
    eng = rollout.VLLMRollout(path, **engine_memory(0.25), max_model_len=1024, enforce_eager=True,
                              dtype="bfloat16", **kw)
    from vllm import SamplingParams
    outs = eng.llm.generate([eng._vllm_prompt(r) for r in recs], SamplingParams(max_tokens=1), use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outs] == [r["prompt_ids"] for r in recs]  # vLLM's expansion is ours
    ref = rollout.load_hf_model(path, torch.bfloat16).float().cuda().eval()
    sd = {k: v.to(torch.bfloat16) for k, v in sharpen_for(ref).items()}
    eng.sync_weights(sd.items())
    ref.load_state_dict({k: v.float() for k, v in sd.items()})
    d = mean_logprob_diff(eng, ref, recs)
    print(f"[{arch}] vLLM vs HF mean |logp diff| {d:.4f}")
    assert d < 0.1
    return eng, ref, sd, greedy(eng, recs)


def check(arch):
    """One engine: prompt expansion, log-probs against HF, the streamed sync of every tensor (for Qwen3-VL: a change
    of the deepstack mergers alone must reach the engine), restore."""
    import tiny_model
    rollout._set_vllm_env()
    path = tiny_model.build_tiny_model(arch=arch)
    kw = dict(limit_mm_per_prompt={"image": 2, "video": 0}, mm_processor_kwargs=PX) if arch == "qwen3_vl" else {}
    recs = vl_prompts(path) if arch == "qwen3_vl" else text_prompts(path)
    eng, ref, sd, base = engine_checked(path, arch, recs, **kw)
    assert greedy(eng, recs) == base
    parts = {"all": lambda k: True}
    if arch == "qwen3_vl":
        parts["deepstack mergers only"] = lambda k: ".deepstack_merger_list." in k
    for name, keep in parts.items():
        new = perturb(sd, keep, scale=0.5)  # deepstack only: on CPU the HF engine's greedy output changed for 4/4
        assert new and (name == "all" or all(".deepstack_merger_list." in k for k in new))
        eng.sync_weights(new.items())
        changed = greedy(eng, recs)
        print(f"[{arch}] perturbed {name} ({len(new)} tensors): greedy changed for "
              f"{sum(a != b for a, b in zip(changed, base))}/{len(base)} prompts")
        assert changed != base
        if name != "all":  # the engine computes with exactly the new deepstack weights, in the right places
            ref.load_state_dict({k: v.float() for k, v in new.items()}, strict=False)
            d = mean_logprob_diff(eng, ref, recs)
            print(f"[{arch}] after the deepstack update: vLLM vs HF mean |logp diff| {d:.4f}")
            assert d < 0.1
        eng.sync_weights(sd.items())
        ref.load_state_dict({k: v.float() for k, v in sd.items()})
        assert greedy(eng, recs) == base  # restored exactly
    print(f"QWEN3_GPU_OK {arch} vllm={eng.version}", flush=True)


def _in_own_process(launch, tmp_path, arch):
    pytest.importorskip("vllm")
    launch.script(__file__, arch, tmp_path / f"{arch}.log", f"QWEN3_GPU_OK {arch}")


def test_vllm_qwen3_vl_engine_and_deepstack_sync(launch, tmp_path):
    _in_own_process(launch, tmp_path, "qwen3_vl")


def test_vllm_text_qwen3_engine_and_sync(launch, tmp_path):
    _in_own_process(launch, tmp_path, "qwen3")


@pytest.mark.parametrize("demo", ["qwen3_vl", "qwen3"])
def test_demo_engine_agrees_with_trainer_after_every_sync(tmp_path, demo, launch):
    rows = run(launch, tmp_path, "--demo-model", demo)
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert len(diffs) == 4 and max(diffs) < 0.01, diffs


if __name__ == "__main__":
    check(sys.argv[1])
