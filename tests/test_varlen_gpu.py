"""The CUDA fast paths of tests/test_varlen.py (GPU only, bf16): the varlen kernel against the plain reference at the
3B model's shapes, the vision tower in one kernel call per layer, padding-free log-probs and gradients against the
padded path.  python3 -m pytest -q -m gpu tests/test_varlen_gpu.py"""
import pytest
import torch

import fsdp_actor as actor
import tiny_model
import varlen as V

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fast_kernel_at_the_3b_shapes():
    """Some fast kernel passes the probe here, and matches the fp32 reference (forward and backward) on the 3B
    model's shapes: 4 packed samples with GQA 16/2 heads of 128 (causal); a shared-prompt row (a 424-token prompt,
    then 8 responses of 1024 tokens, each seeing the prompt's keys and its own); 25 windows of 64 patches and one
    1296-patch image with 16 heads of 80 (the vision tower)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    kernel = V._fast_varlen_kernel(dev.index)
    assert kernel is not None, "no usable varlen kernel: padding-free and vision varlen would be off (see warnings)"
    g = torch.Generator(device=dev).manual_seed(0)
    packed, shared = [1470, 900, 1201, 33], [424] + [1024] * 8
    for lens, klens, H, Hkv, D, causal in ((packed, packed, 16, 2, 128, True),
                                           (shared, [424] + [1448] * 8, 16, 2, 128, True),
                                           ([64] * 25 + [1296], [64] * 25 + [1296], 16, 16, 80, False)):
        cu, cu_k = (torch.tensor([0] + x, device=dev).cumsum(0).to(torch.int32) for x in (lens, klens))
        x = [torch.randn(sum(n), h, D, device=dev, generator=g) for n, h in ((lens, H), (klens, Hkv), (klens, Hkv))]
        fast = [t.bfloat16().requires_grad_() for t in x]
        ref = [t.clone().requires_grad_() for t in x]
        out = kernel(*fast, cu, cu_k, max(lens), max(klens), causal, D ** -0.5)
        want = V.reference_varlen_attention(*ref, cu, causal, D ** -0.5, cu_k)
        w = torch.randn(want.shape, device=dev, generator=g)
        (out.float() * w).sum().backward()
        (want * w).sum().backward()
        assert _rel(out, want) < 1e-2
        for a, b in zip(fast, ref):
            assert _rel(a.grad, b.grad) < 2e-2


def test_vision_tower_one_kernel_call_per_layer():
    dev = torch.device("cuda", torch.cuda.current_device())
    path = tiny_model.build_tiny_model()
    grid = torch.tensor([[1, 16, 16], [1, 6, 10], [2, 4, 4]], device=dev)
    outs, calls = [], []
    for varlen in (False, True):
        hf = actor.load_hf_model(path, dtype=torch.bfloat16).to(dev).eval()
        if varlen:
            V.set_varlen_attention(hf, vision=True)
        vc = hf.config.vision_config
        dim = getattr(vc, "in_channels", 3) * vc.temporal_patch_size * vc.patch_size ** 2
        pixels = torch.randn(int(grid.prod(-1).sum()), dim, device=dev, generator=torch.Generator(dev).manual_seed(0))
        orig = V.varlen_attention

        def spy(q, *a, **kw):
            calls.append((q.is_cuda, q.dtype))
            return orig(q, *a, **kw)

        V.varlen_attention = spy
        try:
            with torch.no_grad():
                out = hf.model.get_image_features(pixels.bfloat16(), grid)
        finally:
            V.varlen_attention = orig
        outs.append(torch.cat(list(getattr(out, "pooler_output", out))))
    assert calls == [(True, torch.bfloat16)] * hf.config.vision_config.depth
    assert _rel(outs[1], outs[0]) < 2e-2


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_padding_free_auto_on_cuda_matches_padded(arch):
    """auto picks padding-free (and, for Qwen2.5-VL, the vision varlen path) on CUDA in bf16; its
    log-probs are as close to the fp32 HF forward as the padded path's, and one backward gives the same gradients
    within bf16 noise."""
    from test_actor import reference_logprobs
    from test_varlen import _samples
    _, _, dev = actor.init_distributed()
    path = tiny_model.build_tiny_model(arch=arch)
    samples, pad = _samples(path)
    ref = reference_logprobs(path, samples, pad)
    res = {}
    for mode in ("auto", "off"):
        torch.manual_seed(0)
        model = actor.build_actor(path, dev, torch.float32, torch.bfloat16, padding_free=mode, vision_varlen=mode)
        assert model.packed == model.share_prompts == (mode == "auto")  # (the two samples of a prompt: one copy)
        lps, _ = actor.compute_logprobs(model, samples, pad, dev, 1.0, 10_000, 64)
        err = torch.cat([(a.double() - b).abs() for a, b in zip(lps, ref, strict=True)])
        batch, _ = actor.collate(samples, pad, dev, model)
        lp, _ = model(**batch)
        (lp * torch.linspace(-1, 1, len(lp), device=dev)).sum().backward()
        grads = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters() if p.grad is not None])
        res[mode] = err, grads
    (e_pack, g_pack), (e_pad, g_pad) = res["auto"], res["off"]
    assert float(e_pack.max()) < 0.1 and float(e_pack.mean()) <= 2 * float(e_pad.mean()) + 5e-3, (e_pack, e_pad)
    assert _rel(g_pack, g_pad) < 5e-2
