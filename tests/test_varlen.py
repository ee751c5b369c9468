"""Variable-length attention: the vision tower in one attention call per layer, and padding-free (packed) rows for
the language model, each equal to transformers' own path (float64 on CPU; CUDA kernels: tests/test_varlen_gpu.py)."""
import pytest
import torch
import torch.nn.functional as F

import fsdp_actor as actor
import tiny_model
import varlen as V


def _vision_run(path, varlen, grid, seed=0):
    """get_image_features over random pixels in float64: (features, {param name: grad}, pixel grad, SDPA calls)."""
    hf = actor.load_hf_model(path, dtype=torch.float64).eval()
    if varlen:
        V.set_varlen_attention(hf, vision=True)
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
        out = V.reference_varlen_attention(q, k, v, cu, causal, scale=0.3)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            want = F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=causal,
                                                  scale=0.3, enable_gqa=True).transpose(0, 1)
            assert torch.allclose(out[a:b], want, atol=1e-12), (causal, a, b)


# ------------------------------------------------------------------------------------------- padding-free training
def _samples(path, seed=0):
    """Rows with one image, two images and none, 2 samples per prompt, responses of 1..9 tokens."""
    import data
    proc = data.load_processor(path)
    kw = dict(min_pixels=56 * 56, max_pixels=112 * 112)
    from PIL import Image
    imgs = [Image.new("RGB", (112, 84), (200, 30, 30)), Image.new("RGB", (56, 112), (30, 30, 200))]
    one = data.encode_prompt({"problem": "<image>What colour is it?", "answer": "red", "images": imgs[:1]}, proc, **kw)
    two = data.encode_prompt({"problem": "<image> and <image>: same colour?", "answer": "no", "images": imgs},
                             proc, **kw)
    text = data.encode_prompt({"problem": "Name a colour.", "answer": "red", "images": []}, proc, **kw)
    g = torch.Generator().manual_seed(seed)
    prompts = [one, two, text]
    return [dict(prompt=prompts[i % 3], response_ids=torch.randint(3, 300, (1 + (i * 5) % 9,), generator=g).tolist())
            for i in range(6)], proc.tokenizer.pad_token_id


def _grads(path, samples, pad, packed, dtype, share=False):
    torch.manual_seed(0)
    vision = "on" if packed and "qwen3" not in path else "off"  # (Qwen3-VL's vision tower: its own path)
    model = actor.build_actor(path, torch.device("cpu"), dtype, dtype, gradient_checkpointing=True,
                              padding_free="on" if packed else "off", vision_varlen=vision, share_prompts=share)
    assert model.packed == packed and model.share_prompts == (packed and share)
    w = torch.Generator().manual_seed(1)
    lps = []
    for idx in actor.plan_micro_batches(model, samples, 10_000, 64):
        batch, resp_len = actor.collate([samples[i] for i in idx], pad, torch.device("cpu"), model)
        assert batch["input_ids"].shape[0] == (1 if packed else len(idx))
        lp, _ = model(**batch)
        assert type(lp.grad_fn.next_functions[0][0]).__name__ == "ChunkLogProbsBackward"  # (not a checkpoint)
        (lp * torch.rand(lp.shape, generator=w, dtype=lp.dtype)).sum().backward()
        lps += list(zip(idx, lp.detach().split(resp_len.tolist())))
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return [lp for _, lp in sorted(lps, key=lambda x: x[0])], grads


def _text_reference(path, samples):
    hf = actor.load_hf_model(path).eval()
    out = []
    for s in samples:
        ids = torch.tensor([s["prompt"]["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=ids).logits[0].double(), -1)
        Lp = len(s["prompt"]["prompt_ids"])
        out.append(lp[Lp - 1:-1].gather(-1, torch.tensor(s["response_ids"])[:, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen2", "qwen3_vl", "qwen3_vl_moe"])
def test_packed_logprobs_and_gradients_equal_padded_and_hf(arch, tmp_path):
    from test_actor import reference_logprobs
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / arch), arch=arch)
    if arch == "qwen2":  # a text LLM: the same rows without images
        import data
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
        p = data.encode_prompt({"problem": "Name a colour.", "answer": "red", "images": []}, tok)
        q = data.encode_prompt({"problem": "What is the answer? Think.", "answer": "blue", "images": []}, tok)
        samples, pad = [dict(prompt=(p, q)[i % 2], response_ids=[5 + i] * (1 + i)) for i in range(5)], tok.pad_token_id
    else:
        samples, pad = _samples(path)
    # one micro-batch with all kinds of rows, then only the text rows (the vision tower's blank-image run)
    for subset in (samples, [s for s in samples if not s["prompt"]["mm_inputs"]]):
        lp_pad, g_pad = _grads(path, subset, pad, False, torch.float64)
        lp_pack, g_pack = _grads(path, subset, pad, True, torch.float64)
        ref = reference_logprobs(path, subset, pad) if arch != "qwen2" else _text_reference(path, subset)
        for a, b, c in zip(lp_pack, lp_pad, ref, strict=True):
            assert torch.allclose(a, b, atol=1e-10), (a, b)
            assert torch.allclose(a, c.to(a.dtype), atol=2e-5), (a, c)  # the plain HF forward (fp32) as well
        assert g_pad.keys() == g_pack.keys() and len(g_pad) > 10
        for n in g_pad:
            assert torch.allclose(g_pad[n], g_pack[n], atol=1e-9, rtol=1e-7), n
        # each prompt once in the row (its two samples' responses after it): the same log-probs, and the same
        # gradients up to transformers' RMSNorm, which rounds to fp32 inside even in float64: there the prompt's
        # gradient is rounded once as a sum instead of once per copy
        lp_share, g_share = _grads(path, subset, pad, True, torch.float64, share=True)
        for a, b in zip(lp_share, lp_pad, strict=True):
            assert torch.allclose(a, b, atol=1e-10), (a, b)
        assert g_share.keys() == g_pad.keys()
        for n in g_pad:
            assert (g_share[n] - g_pad[n]).abs().max() <= 1e-6 * g_pad[n].abs().max(), n


def test_positions_are_the_models_own_on_the_padded_batch():
    """M-RoPE positions from one get_rope_index call per distinct prompt, continued through the response, equal the
    model's get_rope_index over the whole padded batch (what a padded forward computes for itself)."""
    path = tiny_model.build_tiny_model()
    samples, pad = _samples(path)
    hf = actor.load_hf_model(path)
    batch, _ = actor.collate(samples, pad, torch.device("cpu"))
    ids = batch["input_ids"]  # [B, T] padded
    grid = torch.cat([s["prompt"]["mm_inputs"]["image_grid_thw"] for s in samples if s["prompt"]["mm_inputs"]])
    want, _ = hf.model.get_rope_index(input_ids=ids, image_grid_thw=grid, attention_mask=None,
                                      **actor.mm_token_types(hf, ids, {"image_grid_thw": grid}))
    prompts = list({id(s["prompt"]): s["prompt"] for s in samples}.values())
    owner = [prompts.index(s["prompt"]) for s in samples]
    got = actor._positions(hf, samples, prompts, owner, "mrope")
    assert any(int(p.max()) < p.shape[1] - 1 for p in got)  # image rows: not plain 0..L-1
    for i, p in enumerate(got):
        assert torch.equal(p, want[:, i, :p.shape[1]]), i


def test_packed_micro_batches_count_real_tokens():
    lengths, groups = [10, 12, 30, 28, 5, 6], ["a", "a", "b", "b", "c", "c"]
    mbs = actor.make_micro_batches(lengths, 60, 64, groups, packed=True)
    assert sorted(i for mb in mbs for i in mb) == list(range(6))
    assert all(sum(lengths[i] for i in mb) <= 60 for mb in mbs)
    assert mbs == [[2, 3], [1, 0, 5, 4]]  # 58 and 33 real tokens (padded, the second would cost 4 x 12 = 48)
    assert actor.make_micro_batches([10, 30, 30], 70, 64, packed=True) == [[1, 2, 0]]  # padded: 3 x 30 = 90 > 70
    assert len(actor.make_micro_batches([10, 30, 30], 70, 64)) == 2


def test_shared_prompt_row_layout():
    """Two prompts (3 and 2 tokens), three samples; responses of 2, 0 and 3 tokens, the empty one skipped."""
    pieces, resp_idx, kw = V.packed_layout([3, 2], [2, 0, 3], [0, 1, 0])
    # row: p0 p0 p0 | r0 r0 | r2 r2 r2 | p1 p1
    assert pieces == [(0, 0, 3), (0, 3, 5), (2, 3, 6), (1, 0, 2)]
    assert resp_idx.tolist() == [2, 3, 2, 5, 6]  # sample 0: p0's last, its own first; sample 2: p0's last, then its own
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 10]
    assert kw["cu_seq_lens_k"].tolist() == [0, 3, 8, 14, 16]  # p0 | p0 + r0 | p0 + r2 | p1
    assert kw["kv_index"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9]
    assert (kw["max_length_q"], kw["max_length_k"]) == (3, 6)
    mbs = actor.make_micro_batches([13, 13, 12, 12], 20, 64, ["a", "a", "b", "b"], packed=True, prompt_lens=[10] * 4)
    assert mbs == [[0, 1], [2, 3]]  # 10 + 3 + 3 = 16 tokens each (unshared: 26 and 24, over the 20 allowed)


def test_keys_of_their_own_length_are_causal_from_the_end():
    """reference_varlen_attention with cu_k: each sequence's queries against an explicit mask per sequence (query j
    sees keys up to j + keys - queries), in one masked call and in the per-sequence path past 8192 tokens."""
    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = torch.tensor([0, 4, 7], dtype=torch.int32), torch.tensor([0, 4, 13], dtype=torch.int32)
    q, k, v = torch.randn(7, 4, 8, generator=g, dtype=torch.float64), *(torch.randn(13, 2, 8, generator=g,
                                                                                     dtype=torch.float64) for _ in "kv")
    want = []
    for a, b, c, d in ((0, 4, 0, 4), (4, 7, 4, 13)):
        mask = torch.tensor([[kk <= qq + (d - c) - (b - a) for kk in range(d - c)] for qq in range(b - a)])
        want.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                   v[c:d].transpose(0, 1), attn_mask=mask, enable_gqa=True))
    want = torch.cat(want, 1).transpose(0, 1)
    assert torch.allclose(V.reference_varlen_attention(q, k, v, cu_q, True, None, cu_k), want, atol=1e-12)
    big = [torch.cat([x] * 1200) for x in (q, k, v)]  # 1200 copies of each sequence: 8400 queries
    cq = torch.cat([cu_q[:-1] + 7 * i for i in range(1200)] + [torch.tensor([8400], dtype=torch.int32)])
    ck = torch.cat([cu_k[:-1] + 13 * i for i in range(1200)] + [torch.tensor([15600], dtype=torch.int32)])
    out = V.reference_varlen_attention(*big, cq, True, None, ck)
    assert torch.allclose(out[-7:], want, atol=1e-12) and torch.allclose(out[:7], want, atol=1e-12)


def test_kernel_check_refuses_a_kernel_that_aligns_causality_at_the_start():
    """A kernel whose causal mask starts at each sequence's first key (SDPA's is_causal on unequal lengths) would
    hide the prompt from the responses of a shared-prompt row: _check_kernel must refuse it."""
    def top_left(q, k, v, cu, cu_k, max_len, max_k, causal, scale):
        return torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                         v[c:d].transpose(0, 1), is_causal=causal, scale=scale,
                                                         enable_gqa=True).transpose(0, 1)
                          for a, b, c, d in zip(cu[:-1].tolist(), cu[1:].tolist(), cu_k[:-1].tolist(),
                                                cu_k[1:].tolist())])

    def bottom_right(q, k, v, cu, cu_k, max_len, max_k, causal, scale):
        return V.reference_varlen_attention(q.float(), k.float(), v.float(), cu, causal, scale, cu_k)

    V._check_kernel(bottom_right, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="own key boundaries"):
        V._check_kernel(top_left, torch.device("cpu"))


def _fake_varlen(style):
    """Stand-ins with the signatures torch's varlen_attn had (2.10: is_causal; 2.11: window_size, no GQA flag;
    2.13: window_size and enable_gqa), computing through the reference on the CPU."""
    def run(q, k, v, cu, cu_k, causal, scale, gqa):
        assert gqa or k.shape[1] == q.shape[1], "GQA heads passed to a varlen_attn without enable_gqa"
        return V.reference_varlen_attention(q, k, v, cu, causal, scale, cu_k)

    if style == "2.10":
        def f(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False, scale=None):
            return run(query, key, value, cu_seq_q, cu_seq_k, is_causal, scale, False)
    elif style == "2.11":
        def f(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
              window_size=(-1, -1)):
            return run(query, key, value, cu_seq_q, cu_seq_k, tuple(window_size) == (-1, 0), scale, False)
    else:
        def f(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
              window_size=(-1, -1), enable_gqa=False):
            return run(query, key, value, cu_seq_q, cu_seq_k, tuple(window_size) == (-1, 0), scale, enable_gqa)
    return f


@pytest.mark.parametrize("style", ["2.10", "2.11", "2.13"])
def test_torch_varlen_keywords_follow_the_installed_signature(style, monkeypatch):
    import torch.nn.attention.varlen as tv
    monkeypatch.setattr(tv, "varlen_attn", _fake_varlen(style), raising=False)
    kernel = V._torch_varlen_kernel()
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 4, 9, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    for causal in (True, False):
        want = V.reference_varlen_attention(q, k, v, cu, causal, 0.5)
        assert torch.allclose(kernel(q, k, v, cu, cu, 11, 11, causal, 0.5), want)
    cu_k = torch.tensor([0, 4, 9, 20], dtype=torch.int32)  # keys of their own boundaries reach the kernel
    want = V.reference_varlen_attention(q[:11], k, v, torch.tensor([0, 2, 5, 11], dtype=torch.int32), True, 0.5, cu_k)
    assert torch.allclose(kernel(q[:11], k, v, torch.tensor([0, 2, 5, 11], dtype=torch.int32), cu_k, 6, 11, True,
                                 0.5), want)


def test_reference_past_8192_tokens_is_per_sequence_and_equal():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 4000, 4001, 8300], dtype=torch.int32)
    q, k, v = (torch.randn(8300, h, 4, generator=g) for h in (2, 1, 1))
    out = V.reference_varlen_attention(q, k, v, cu, True, 0.5)
    for a, b in ((0, 4000), (4000, 4001), (4001, 8300)):
        small = V.reference_varlen_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), True, 0.5)
        assert torch.allclose(out[a:b], small, atol=1e-5)


def test_text_only_batch_after_an_image_batch_uses_plain_positions():
    """Left to compute its own positions from inputs_embeds, Qwen2.5-VL would offset a text-only batch by the
    rope_deltas an earlier image batch left in the model (and fail when the batch size differs)."""
    from test_actor import reference_logprobs
    actor.init_distributed()
    path = tiny_model.build_tiny_model()
    samples, pad = _samples(path)
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    text = [s for s in samples if not s["prompt"]["mm_inputs"]][:1]
    with torch.no_grad():
        model(**actor.collate(samples[:4], pad, torch.device("cpu"))[0])  # no model given: the HF model's own positions
        lp, _ = model(**actor.collate(text, pad, torch.device("cpu"))[0])
    assert torch.allclose(lp.double(), reference_logprobs(path, text, pad)[0], atol=2e-5)


def test_compiled_elementwise_kernels_equal_the_plain_modules(tmp_path, monkeypatch):
    """--torch-compile on: the norms, gated MLPs, rotary functions and the log-prob chunk compiled by inductor give
    the plain path's log-probs and gradients (float64, packed rows with images and without)."""
    import sys
    actor.init_distributed()
    path = tiny_model.build_tiny_model(arch="qwen2_5_vl")
    samples, pad = _samples(path)
    mod = sys.modules[type(actor.load_hf_model(path)).__module__]
    for fn in ("apply_rotary_pos_emb",):  # undone after the test
        monkeypatch.setattr(mod, fn, getattr(mod, fn))
    lp0, g0 = _grads(path, samples, pad, True, torch.float64)
    built = actor.build_actor
    monkeypatch.setattr(actor, "build_actor", lambda *a, **kw: built(*a, **kw, torch_compile="on"))
    lp1, g1 = _grads(path, samples, pad, True, torch.float64)
    model = actor.build_actor(path, torch.device("cpu"), torch.float64, torch.float64)
    compiled = [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert any(n.endswith("mlp") for n in compiled) and any(n.endswith("norm") for n in compiled), compiled
    assert model.chunk_kernels != V.LOGPROB_KERNELS
    assert all(hasattr(k, "_torchdynamo_orig_callable") for k in model.chunk_kernels)
    assert hasattr(mod.apply_rotary_pos_emb, "_torchdynamo_orig_callable")
    (stats, grad), seen = model.chunk_kernels, []  # and the forward and backward call them
    model.chunk_kernels = (lambda *a: (seen.append("stats"), stats(*a))[1],
                           lambda *a: (seen.append("grad"), grad(*a))[1])
    lp, _ = model(**actor.collate(samples[:2], pad, torch.device("cpu"), model)[0])
    lp.sum().backward()
    assert seen == ["stats", "grad"]
    for a, b in zip(lp0, lp1, strict=True):
        assert torch.allclose(a, b, atol=1e-10), (a, b)
    assert g0.keys() == g1.keys()
    for n in g0:  # transformers' RMSNorm rounds to fp32 inside even in float64: fused, it rounds elsewhere
        assert (g0[n] - g1[n]).abs().max() <= 1e-6 * g0[n].abs().max(), n


# ------------------------------------------------------------------------------------------- per-chunk log-probs
def _plain_chunk_logprobs(h, targets, weight, temperature, forbidden=()):
    """The formula through autograd, as fsdp_actor.py had it under torch.utils.checkpoint: the reference."""
    logits = F.linear(h, weight) / temperature  # [n, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if forbidden:
        logits[:, forbidden] = float("-inf")
    logz = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz  # [n]
    with torch.no_grad():
        p = torch.softmax(logits, dim=-1)
        ent = logz - (p * logits.masked_fill(p == 0, 0)).sum(-1)
    return logp, ent


@pytest.mark.parametrize("compiled,dtype", [(False, torch.float64), (False, torch.bfloat16), (True, torch.float64)],
                         ids=["plain", "plain-bf16", "compiled"])
def test_chunk_logprobs_equal_plain_autograd(compiled, dtype):
    """ChunkLogProbs against autograd through the plain formula: log-probs, entropies and the gradients wrt the hidden
    states and the head (temperature 0.7, two forbidden ids, the last vocabulary id and a forbidden one among the
    targets): the same bits with the plain kernels (float64, and bf16: the matmuls in bf16 and the roundings where
    autograd has them), within rounding compiled (float64); and no [n, V] tensor kept for backward."""
    kernels = tuple(torch.compile(k, dynamic=True) for k in V.LOGPROB_KERNELS) if compiled else V.LOGPROB_KERNELS
    g = torch.Generator().manual_seed(0)
    n, H, vocab, forbidden = 37, 16, 50, [3, 7]
    h0 = torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype)
    w0 = (torch.randn(vocab, H, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.isin(targets, torch.tensor(forbidden))] = 11
    targets[[0, 5]] = vocab - 1
    targets[9] = forbidden[0]  # never sampled, but if it were: log-prob -inf, and still no gradient in its column
    up = torch.randn(n, generator=g, dtype=torch.float64).to(torch.promote_types(dtype, torch.float32))  # dloss/dlogp
    same = torch.equal if not compiled else (lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-13))
    for h_grad, w_grad in ((True, True), (True, False), (False, True)):
        h, w = h0.clone().requires_grad_(h_grad), w0.clone().requires_grad_(w_grad)
        ref_h, ref_w = h0.clone().requires_grad_(h_grad), w0.clone().requires_grad_(w_grad)
        want, want_ent = _plain_chunk_logprobs(ref_h, targets, ref_w, 0.7, forbidden)
        (want * up).sum().backward()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.shape), t)[1], lambda t: t):
            got, ent = V.ChunkLogProbs.apply(h, targets, w, 0.7, forbidden, True, kernels)
        assert sorted(saved) == sorted([h.shape, w.shape, targets.shape, (n,), (n,)])  # h, weight, targets, logz, ent
        (got * up).sum().backward()
        assert same(got, want) and same(ent, want_ent)
        assert (h.grad is None) == (not h_grad) and (w.grad is None) == (not w_grad)
        for a, b in ((h.grad, ref_h.grad), (w.grad, ref_w.grad)):
            assert a is None or same(a, b)
        assert w.grad is None or w.grad[forbidden].abs().max() == 0  # forbidden ids: probability 0, no gradient
    with torch.no_grad():  # without entropy: the same log-probs
        got, ent = V.ChunkLogProbs.apply(h0, targets, w0, 0.7, forbidden, False, kernels)
    assert ent is None and same(got, want.detach())


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_chunk_entropy_gradient_equals_autograd(compiled):
    """The entropy bonus's gradient (--entropy-coeff) through ChunkLogProbs against autograd through a differentiable
    entropy (float64, temperature 0.7, two forbidden ids): with the log-probs' gradient beside it and alone."""
    kernels = tuple(torch.compile(k, dynamic=True) for k in V.LOGPROB_KERNELS) if compiled else V.LOGPROB_KERNELS
    g = torch.Generator().manual_seed(1)
    n, H, vocab, forbidden = 29, 16, 50, [3, 7]
    h0, w0 = (torch.randn(k, H, generator=g, dtype=torch.float64) for k in (n, vocab))
    targets = torch.randint(8, vocab, (n,), generator=g)
    up, up_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    for with_logp in (True, False):
        h, w, ref_h, ref_w = (t.clone().requires_grad_() for t in (h0, w0, h0, w0))
        logits = F.linear(ref_h, ref_w) / 0.7  # [n, V]
        logits[:, forbidden] = float("-inf")
        la = torch.log_softmax(logits, -1)
        want, want_ent = la.gather(1, targets[:, None]).squeeze(1), -(la.exp() * la.masked_fill(la.isinf(), 0)).sum(-1)
        got, ent = V.ChunkLogProbs.apply(h, targets, w, 0.7, forbidden, True, kernels)
        ((got * up).sum() * with_logp + (ent * up_ent).sum()).backward()
        ((want * up).sum() * with_logp + (want_ent * up_ent).sum()).backward()
        assert torch.allclose(ent, want_ent, rtol=1e-12, atol=1e-13)
        for a, b in ((h.grad, ref_h.grad), (w.grad, ref_w.grad)):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (a - b).abs().max()
        assert w.grad[forbidden].abs().max() == 0


def test_auto_packs_what_ran_on_a_gpu(monkeypatch):
    """auto, given a fast kernel on CUDA in bf16: packed rows for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and text LLMs, the
    vision varlen path for the first two; Qwen3-VL-MoE only with "on" (never run packed on a GPU); nothing without
    the fast kernel, in fp32 or with an explicit attention implementation."""
    from types import SimpleNamespace as NS
    monkeypatch.setattr(V, "_fast_varlen_kernel", lambda index: "kernel")
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16

    def auto(mt, vision=True, device=cuda, dtype=bf16, impl=None, text="auto"):
        hf = NS(config=NS(model_type=mt, vision_config=NS() if vision else None))
        r = V.use_varlen_attention(hf, device, dtype, impl, text, "auto")
        return r["text"], r["vision"]
    assert auto("qwen2_5_vl") == auto("qwen2_vl") == (True, True)
    assert auto("qwen3_vl") == (True, False)
    assert auto("qwen3_vl_moe") == (False, False) and auto("qwen3_vl_moe", text="on") == (True, False)
    assert auto("qwen3", vision=False) == (True, False)
    assert auto("qwen3_vl", device=torch.device("cpu")) == auto("qwen3_vl", dtype=torch.float32) == (False, False)
    assert auto("qwen2_5_vl", impl="sdpa") == (False, False)
    monkeypatch.setattr(V, "_fast_varlen_kernel", lambda index: None)
    assert auto("qwen2_5_vl") == (False, False)
