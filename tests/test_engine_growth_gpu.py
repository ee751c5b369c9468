"""The engine does not grow across steps (GPU, vLLM; skipped elsewhere): EasyR1 found that vLLM's multimodal encoder
cache survives a level-1 sleep and gains about one entry per image per step until the update runs out of memory.
Here every sleep drains it (VLLMRollout._reset_caches; passed on one H200, 2026-12-01): after 1 and after 50 steps of
fresh pictures the engine holds no cached encoder output once asleep, and its GPU memory while awake is the same.

    python3 -m pytest -q -m gpu tests/test_engine_growth_gpu.py -s
"""
import random

import pytest
import torch

import data
import rollout
import tiny_model
from test_grpo_gpu import engine_memory

pytestmark = pytest.mark.gpu


def encoder_entries(eng):
    """(scheduler's cached encoder inputs, GPU runner's cached encoder outputs) of the in-process engine."""
    core = eng.llm.llm_engine.engine_core.engine_core
    runner = eng.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return len(core.scheduler.encoder_cache_manager.cached), len(runner.encoder_cache)


def test_fifty_steps_of_fresh_images_leave_no_encoder_cache_and_no_memory_growth():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rollout._set_vllm_env()
    pytest.importorskip("vllm")
    path = tiny_model.build_tiny_model()
    eng = rollout.VLLMRollout(path, **engine_memory(0.2), max_model_len=1024, enforce_eager=True,
                              limit_mm_per_prompt={"image": 1, "video": 0},
                              mm_processor_kwargs={"min_pixels": 56 * 56, "max_pixels": 112 * 112})
    proc = data.load_processor(path, 56 * 56, 112 * 112)
    hf = rollout.load_hf_model(path, torch.float32)
    weights = {k: v.to("cuda", torch.bfloat16) for k, v in hf.state_dict().items()}
    rng = random.Random(0)

    def step(i):  # one training step's engine work: sync, wake, generate on 8 new pictures, sleep
        rows = []
        for _ in range(8):
            img, color, _ = tiny_model.draw_color_image(rng)
            rows.append({"problem": tiny_model.COLOR_QUESTION, "answer": color, "images": [img]})
        recs = [data.encode_prompt(r, proc, min_pixels=56 * 56, max_pixels=112 * 112) for r in rows]
        eng.sync_weights(weights.items())
        eng.wake()
        eng.generate(recs, n=4, temperature=1.0, top_p=1.0, max_tokens=4, seeds=list(range(8 * i, 8 * i + 8)))
        torch.cuda.synchronize()
        # this process's own allocations (the runner's cached encoder outputs are torch tensors; the device's free
        # memory would also move with other processes when the test files run side by side)
        awake_bytes, during = torch.cuda.memory_allocated(), encoder_entries(eng)
        eng.sleep()
        return awake_bytes, during, encoder_entries(eng)

    first = step(0)
    for i in range(1, 50):
        last = step(i)
    print(f"[growth] GPU bytes allocated awake, step 1 vs 50: {first[0]} / {last[0]}; encoder entries while generating "
          f"{first[1]} / {last[1]}, asleep {first[2]} / {last[2]}")
    assert first[1] != (0, 0), "the encoder cache was never used: the test measures nothing"
    assert first[2] == last[2] == (0, 0)
    assert abs(first[0] - last[0]) < 64 * 2**20
