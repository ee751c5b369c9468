"""Variable-length attention: the vision tower in one attention call per layer, and padding-free (packed) rows for
the language model, each equal to transformers' own path (float64 on CPU; the CUDA kernels in tests/test_varlen_gpu.py)."""
import pytest
import torch
import torch.nn.functional as F

import fsdp_actor as A
import tiny_model


def _vision_run(path, varlen, grid, seed=0):
    """get_image_features over random pixels in float64: (features, {param name: grad}, pixel grad, SDPA calls)."""
    hf = A.load_hf_model(path, dtype=torch.float64).eval()
    if varlen:
        A.set_varlen_attention(hf, vision=True)
    vc = hf.config.vision_config
    dim = getattr(vc, "in_channels", 3) * vc.temporal_patch_size * vc.patch_size ** 2
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(int(grid.prod(-1).sum()), dim, generator=g, dtype=torch.float64, requires_grad=True)
    calls, orig = [], F.scaled_dot_product_attention

    def spy(q, *a, **kw):
        calls.append(q.shape)
        return orig(q, *a, **kw)

    F.scaled_dot_product_attention = spy
    try:
        out = hf.model.get_image_features(pixels, grid)
    finally:
        F.scaled_dot_product_attention = orig
    feats = torch.cat(list(getattr(out, "pooler_output", out)))
    (feats.sin().sum()).backward()
    grads = {n: p.grad for n, p in hf.model.visual.named_parameters() if p.grad is not None}
    return feats.detach(), grads, pixels.grad, calls, hf


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_vision_attention_one_call_per_layer_equals_per_window_path(arch, tmp_path):
    path = tiny_model.build_tiny_model(arch=arch) if arch == "qwen2_5_vl" else \
        tiny_model.build_tiny_model(str(tmp_path / arch), arch=arch)
    # 16x16 patches = 2x2 windows of 8x8 patches, 6x10 = two windows, a 2-frame clip: 7 windows, 3 images
    grid = torch.tensor([[1, 16, 16], [1, 6, 10], [2, 4, 4]])
    f0, g0, p0, calls0, hf = _vision_run(path, False, grid)
    f1, g1, p1, calls1, _ = _vision_run(path, True, grid)
    depth = hf.config.vision_config.depth
    assert len(calls1) == depth  # one attention call per layer for all windows and images together
    assert len(calls0) > 2 * depth  # transformers' path: one per window (Qwen2.5-VL) or per image (Qwen2-VL)
    assert torch.allclose(f0, f1, atol=1e-12, rtol=1e-10)
    assert torch.allclose(p0, p1, atol=1e-12, rtol=1e-10)
    assert g0.keys() == g1.keys() and len(g0) > 5
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-12, rtol=1e-10), n


def test_reference_varlen_equals_per_sequence_sdpa():
    """The plain path (one block-diagonal masked call) against one SDPA call per sequence, causal and not, GQA."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 10, 11, 30], dtype=torch.int32)
    q, k, v = (torch.randn(30, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    for causal in (True, False):
        out = A.reference_varlen_attention(q, k, v, cu, causal, scale=0.3)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            want = F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=causal,
                                                  scale=0.3, enable_gqa=True).transpose(0, 1)
            assert torch.allclose(out[a:b], want, atol=1e-12), (causal, a, b)
