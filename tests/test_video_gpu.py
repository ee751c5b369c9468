"""vLLM with video prompts, tiny Qwen2.5-VL and Qwen3-VL (GPU only; skipped elsewhere).

    pytest -m gpu tests/test_video_gpu.py -s       # each engine check runs in its own process (one vLLM per process)
    PYTHONPATH=. python tests/test_video_gpu.py qwen2_5_vl      # the same checks by hand: qwen2_5_vl | qwen3_vl
"""
import sys

import pytest
import torch

import fsdp_actor as actor
import rollout
import tiny_model
from test_grpo_gpu import engine_memory, run
from test_vllm_gpu import ref_logprobs, sharpen

pytestmark = pytest.mark.gpu
PX = dict(min_pixels=56 * 56, max_pixels=112 * 112)


def video_prompts(path):
    """A clip, an image and a clip, two clips of different frame rates (4, 6 and 3 frames; the 3 padded to 4)."""
    import data
    from PIL import Image
    proc = data.load_processor(path, **PX)

    def clip(a, b, n, size=(64, 60)):
        return [Image.new("RGB", size, tiny_model.COLORS[a if i < n // 2 else b]) for i in range(n)]
    rows = [{"problem": "<video>Which colour does the video end with?", "answer": "blue",
             "videos": [clip("red", "blue", 4)]},
            {"problem": "<image> then <video>: which?", "answer": "red",
             "images": [Image.new("RGB", (70, 84), tiny_model.COLORS["green"])],
             "videos": [clip("white", "red", 6, (90, 60))]},
            {"problem": "<video> and <video>: which ends blue?", "answer": "a",
             "videos": [clip("red", "blue", 4), clip("blue", "green", 3)]}]
    recs = [data.encode_prompt(r, proc, **PX) for r in rows[:2]]
    recs.append(data.encode_prompt(rows[2], proc, video_fps=0.5, **PX))  # slower clips: other time positions
    return proc, recs


def check_processor(path, proc, recs):
    """Where torchvision is installed (the GPU image), transformers' own Qwen-VL processor on our frames gives our
    pixels, grids and prompt tokens: video.py reimplements it for machines without torchvision."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available
    if not is_torchvision_available():
        print("[processor] no torchvision: transformers' video processor not compared")
        return
    hf = AutoProcessor.from_pretrained(path)
    hf.video_processor.size = {"shortest_edge": PX["min_pixels"], "longest_edge": PX["max_pixels"]}
    tok = proc.tokenizer
    for r in recs:
        text = tok.decode(r["raw_prompt_ids"])
        meta = [{"total_num_frames": len(v), "fps": f, "frames_indices": list(range(len(v)))}
                for v, f in zip(r["videos"], r["video_fps"])]
        out = hf(text=[text], images=r["images"] or None, videos=list(r["videos"]), video_metadata=meta,
                 do_sample_frames=False, return_tensors="pt", add_special_tokens=False)
        assert out["input_ids"][0].tolist() == r["prompt_ids"]
        assert torch.equal(out["video_grid_thw"], r["mm_inputs"]["video_grid_thw"])
        err = (out["pixel_values_videos"] - r["mm_inputs"]["pixel_values_videos"]).abs().max().item()
        assert err < 1e-4, err
        if "second_per_grid_ts" in r["mm_inputs"]:
            got = torch.as_tensor(out["second_per_grid_ts"]).float()
            assert torch.allclose(got, r["mm_inputs"]["second_per_grid_ts"])
    print(f"[processor] transformers' processor gives our frames' pixels, grids and tokens for {len(recs)} prompts")


def engine_positions(eng, recs, arch):
    """[3, L] M-RoPE positions vLLM computed for each prompt, recorded from its model's own get_mrope_input_positions
    (the engine runs in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    if arch == "qwen3_vl":
        from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as M
    else:
        from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as M
    from vllm import SamplingParams
    seen, orig = {}, M.get_mrope_input_positions

    def spy(self, input_tokens, *args, **kwargs):
        pos, delta = orig(self, input_tokens, *args, **kwargs)
        seen[tuple(input_tokens)] = torch.as_tensor(pos).clone()
        return pos, delta
    M.get_mrope_input_positions = spy
    try:
        eng.llm.reset_prefix_cache()  # new requests: positions are computed when a request is first scheduled
        eng.llm.generate([eng._vllm_prompt(r) for r in recs], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        M.get_mrope_input_positions = orig
    return [seen[tuple(r["prompt_ids"])] for r in recs]


def mean_logprob_diff(eng, ref, recs, temperature=0.7):
    out = eng.generate(recs, n=4, temperature=temperature, top_p=1.0, max_tokens=24,
                       seeds=list(range(1, len(recs) + 1)))
    diffs = []
    for rec, group in zip(recs, out):
        for o in group:
            r = ref_logprobs(ref, rec, o["response_ids"], temperature, eng.forbidden_ids)
            diffs.append((torch.tensor(o["logprobs"]) - r).abs())
    return torch.cat(diffs).mean().item(), out


def check(arch):
    """One engine: the prompt expansion is the trainer's (Qwen3-VL: its timestamps too), the engine's log-probs are
    HF's on the trainer's inputs, and (Qwen2.5-VL) the frame rate reaches the engine's time positions."""
    import tiny_model
    rollout._set_vllm_env()
    path = tiny_model.build_tiny_model(arch=arch)
    proc, recs = video_prompts(path)
    eng = rollout.VLLMRollout(path, **engine_memory(0.25), max_model_len=1024, enforce_eager=True,
                              dtype="bfloat16", limit_mm_per_prompt={"image": 1, "video": 2}, mm_processor_kwargs=PX)
    from vllm import SamplingParams
    outs = eng.llm.generate([eng._vllm_prompt(r) for r in recs], SamplingParams(max_tokens=1), use_tqdm=False)
    for o, r in zip(outs, recs):  # vLLM's expansion is ours (Qwen3-VL: the timestamps too)
        got = list(o.prompt_token_ids)
        assert got == r["prompt_ids"], (len(got), len(r["prompt_ids"]), proc.tokenizer.decode(got)[-300:],
                                        proc.tokenizer.decode(r["prompt_ids"])[-300:])
    print(f"[{arch}] vLLM's prompts are the trainer's ({[len(r['prompt_ids']) for r in recs]} tokens)")
    ref = rollout.load_hf_model(path, torch.bfloat16).float().cuda().eval()  # bf16-rounded weights, fp32 compute
    sd = {k: v.to(torch.bfloat16) for k, v in sharpen(ref.state_dict()).items()}
    eng.sync_weights(sd.items())
    ref.load_state_dict({k: v.float() for k, v in sd.items()})
    d, _ = mean_logprob_diff(eng, ref, recs)
    print(f"[{arch}] vLLM vs HF mean |logp diff| on video prompts {d:.4f}")
    assert d < 0.1
    # The time axis: vLLM's M-RoPE positions of each prompt are the trainer's (Qwen2.5-VL: our frame rate reached its
    # processor's second_per_grid_ts; transformers' 24-fps fallback would give other positions, checked to differ)
    got = engine_positions(eng, recs, arch)
    for g, r in zip(got, recs, strict=True):
        want = actor._rope_index(ref, r["prompt_ids"], r["mm_inputs"])
        assert torch.equal(g.long(), want.long()), (arch, r["prompt_ids"], g.tolist(), want.tolist())
    if arch == "qwen2_5_vl":
        fallback = [actor._rope_index(ref, r["prompt_ids"], {**r["mm_inputs"], "second_per_grid_ts": torch.full_like(
            r["mm_inputs"]["second_per_grid_ts"], 2 / 24)}) for r in recs]
        assert any(not torch.equal(g.long(), f.long()) for g, f in zip(got, fallback)), "24 fps gives the same"
    print(f"[{arch}] vLLM's M-RoPE positions are the trainer's for every video prompt")
    check_processor(path, proc, recs)
    print(f"VIDEO_GPU_OK {arch} vllm={eng.version}", flush=True)


def _in_own_process(launch, tmp_path, arch):
    pytest.importorskip("vllm")
    launch.script(__file__, arch, tmp_path / f"{arch}.log", f"VIDEO_GPU_OK {arch}")


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_vllm_video_prompts(arch, launch, tmp_path):
    _in_own_process(launch, tmp_path, arch)


def test_qwen3_vl_video_demo_engine_agrees_with_trainer(tmp_path, launch):
    """The trainer's log-probs of the engine's samples, step by step (the Qwen2.5-VL video demo's own run with vLLM
    logs the same numbers in its metrics)."""
    rows = run(launch, tmp_path, "--demo-model", "qwen3_vl", "--demo-task", "video")
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert len(diffs) == 4 and max(diffs) < 0.01, diffs


if __name__ == "__main__":
    check(sys.argv[1])
