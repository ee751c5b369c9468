"""Qwen3-VL (deepstack, interleaved M-RoPE, patch 16) and the text-only Qwen3: the trainer's log-probs equal a plain
HF forward, the HF engine generates, and the demos are selected by --demo-model."""
import os
import random

import pytest
import torch

import data
import fsdp_actor as A
import rollout
import tiny_model
from test_actor import reference_logprobs

CPU = torch.device("cpu")
PX = dict(min_pixels=56 * 56, max_pixels=112 * 112)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    A.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("q3vl") / "m"), arch="qwen3_vl")
    proc = data.load_processor(path)
    rng = random.Random(0)
    imgs = [data.draw_color_image(rng)[0] for _ in range(4)]
    one = [data.encode_prompt({"problem": "<image>What is the main color?", "answer": "red", "images": [im]}, proc,
                              **PX) for im in imgs[:3]]
    two = data.encode_prompt({"problem": "<image> and <image>: same colour?", "answer": "no", "images": imgs[2:]},
                             proc, **PX)
    text = data.encode_prompt({"problem": "Name a colour.", "answer": "red", "images": []}, proc, **PX)
    prompts = [one[0], one[1], two, text, one[2]]
    g = torch.Generator().manual_seed(0)
    samples = [dict(prompt=prompts[i % len(prompts)],
                    response_ids=torch.randint(3, 300, (1 + (i * 5) % 9,), generator=g).tolist()) for i in range(10)]
    return path, proc, samples


def test_qwen3_vl_logprobs_match_plain_hf_forward(qwen3_vl, monkeypatch):
    """Images, a two-image row and a text-only row in one batch, 2 samples per prompt: equal to the model's own
    forward (float64 reference), with the vision tower run once over the distinct images."""
    path, proc, samples = qwen3_vl
    model = A.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=False).eval()
    seen = []
    vis = model.hf.model.visual
    monkeypatch.setattr(vis, "forward", lambda pixel_values, grid_thw, **kw: (
        seen.append(len(grid_thw)), type(vis).forward(vis, pixel_values, grid_thw=grid_thw, **kw))[1])
    ref = reference_logprobs(path, samples, proc.tokenizer.pad_token_id)
    for max_tokens in (10_000, 60):  # one micro-batch (5 prompts, 5 distinct images), then several
        lps, _ = A.compute_logprobs(model, samples, proc.tokenizer.pad_token_id, CPU, 1.0, max_tokens=max_tokens,
                                    max_samples=16)
        for a, b in zip(lps, ref):
            assert a.shape == b.shape
            assert torch.allclose(a.double(), b, atol=2e-5), (a, b)
    assert seen[0] == 5  # the first (single) micro-batch: each distinct image once, not once per sample


def test_qwen3_vl_hf_engine_generates_what_the_trainer_scores(qwen3_vl):
    """The HF engine samples with a KV cache (its positions continue from the image's 3-D ones); the log-probs it
    reports must be the trainer's full-forward recomputation of the same tokens, single- and two-image prompts."""
    path, proc, samples = qwen3_vl
    eng = rollout.HFRollout(path, device="cpu", dtype=torch.float32)
    prompts = [samples[0]["prompt"], samples[2]["prompt"]]  # one image; two images
    T = 0.25  # a peaked distribution: wrong positions or features then change the numbers visibly
    out = eng.generate(prompts, n=3, temperature=T, top_p=1.0, max_tokens=12, seeds=[1, 2])
    model = A.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=False).eval()
    gen = [dict(prompt=p, response_ids=o["response_ids"]) for p, g in zip(prompts, out) for o in g]
    assert all(len(s["response_ids"]) > 0 for s in gen)
    lps, _ = A.compute_logprobs(model, gen, proc.tokenizer.pad_token_id, CPU, T, max_tokens=10_000, max_samples=8)
    eng_lp = [torch.tensor(o["logprobs"]) for g in out for o in g]
    for a, b in zip(lps, eng_lp):
        assert torch.allclose(a, b, atol=1e-4), (a, b)
    g = eng.generate(prompts[1:], n=2, temperature=0, top_p=1.0, max_tokens=8, seeds=[0])[0]
    assert g[0] == g[1] and len(g[0]["response_ids"]) > 0
