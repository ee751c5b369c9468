"""The FSDP2 actor: log-probs equal a plain HF forward pass; micro-batching does not change loss or gradients."""

import gc
import weakref

import pytest
import torch

import data
import fsdp_actor as actor
import tiny_model
from grpo import agg_loss, policy_loss


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    actor.init_distributed()  # a 1-rank gloo group, as `python grpo.py` gets
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"))
    proc = data.load_processor(path)
    train, _ = tiny_model.demo_data(str(tmp_path_factory.mktemp("data")), n_train=8, n_val=2)
    ds = data.PromptDataset(train, proc, format_prompt=tiny_model.DEMO_FORMAT_PROMPT, min_pixels=56 * 56,
                            max_pixels=112 * 112)
    g = torch.Generator().manual_seed(0)
    two = data.encode_prompt({"problem": "<image> and <image>: same colour?", "answer": "no",
                              "images": [data.to_pil(r["images"][0]) for r in ds.rows.select([0, 1])]},
                             proc, min_pixels=56 * 56, max_pixels=112 * 112)
    prompts = [ds[0], ds[1], two, ds[2]]  # one record per prompt, shared by its samples (as after a rollout)
    samples = []
    for i in range(8):  # 2 samples per prompt, response lengths 1..9 tokens
        resp = torch.randint(3, 300, (1 + (i * 5) % 9,), generator=g).tolist()
        samples.append(dict(prompt=prompts[i % len(prompts)], response_ids=resp))
    return path, proc, samples


def reference_logprobs(path, samples, pad_id):
    """Plain HF forward, one sample at a time, float64 log_softmax over the full logits."""
    hf = actor.load_hf_model(path, dtype=torch.float32).eval()
    out = []
    for s in samples:
        ids = torch.tensor([s["prompt"]["prompt_ids"] + s["response_ids"]])
        mm = s["prompt"]["mm_inputs"]
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), **mm,
                        **actor.mm_token_types(hf, ids, mm)).logits[0].double()
        logits[:, [hf.config.image_token_id, hf.config.video_token_id]] = float("-inf")  # never sampled
        lp = torch.log_softmax(logits, -1)
        Lp, Lr = len(s["prompt"]["prompt_ids"]), len(s["response_ids"])
        tgt = torch.tensor(s["response_ids"])
        out.append(lp[Lp - 1:Lp - 1 + Lr].gather(-1, tgt[:, None]).squeeze(-1))
    return out


def test_logprobs_match_plain_hf_forward(setup):
    path, proc, samples = setup
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    model.eval()
    ref = reference_logprobs(path, samples, proc.tokenizer.pad_token_id)
    # tiny micro-batches and tiny chunks: padding, batching and chunking must not change any value
    for max_tokens, chunk in ((10_000, 4096), (40, 3)):
        lps, ents = actor.compute_logprobs(model, samples, proc.tokenizer.pad_token_id, torch.device("cpu"), 1.0,
                                           max_tokens=max_tokens, max_samples=4, chunk_size=chunk)
        for a, b, e in zip(lps, ref, ents, strict=True):
            assert a.shape == b.shape
            assert torch.allclose(a.double(), b, atol=2e-5), (a, b)
            assert (e > 0).all() and (e <= torch.log(torch.tensor(512.0)) + 1e-4).all()
    # the generic path (one copy of the pixels per row, the model's own vision call) gives the same values
    model.hf.config.model_type = "generic_vlm"
    try:
        lps, _ = actor.compute_logprobs(model, samples, proc.tokenizer.pad_token_id, torch.device("cpu"), 1.0,
                                        max_tokens=10_000, max_samples=8)
    finally:
        model.hf.config.model_type = "qwen2_5_vl"
    for a, b in zip(lps, ref, strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5)


def test_logprobs_without_entropy_are_the_same(setup):
    """compute_logprobs(entropy=False) (grpo.py's old and reference passes): the same log-probs, no entropy, none
    computed (the kernel is told)."""
    path, proc, samples = setup
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    kw = dict(pad_id=proc.tokenizer.pad_token_id, device=torch.device("cpu"), temperature=0.7, max_tokens=40,
              max_samples=4, chunk_size=3)
    lps, ents = actor.compute_logprobs(model.eval(), samples, **kw)
    stats, seen = model.chunk_kernels[0], []
    model.chunk_kernels = (lambda *a: (seen.append(a[-1]), stats(*a))[1], model.chunk_kernels[1])
    lps2, ents2 = actor.compute_logprobs(model, samples, **kw, entropy=False)
    assert seen and not any(seen)  # every chunk asked for no entropy
    assert all(e is not None and e.shape == a.shape for e, a in zip(ents, lps, strict=True))
    assert ents2 == [None] * len(samples)
    for a, b in zip(lps, lps2, strict=True):
        assert torch.equal(a, b)


def test_mrope_positions_are_used(setup):
    """Without the image-token types the model would use 1-D positions: the log-probs must differ."""
    path, proc, samples = setup
    hf = actor.load_hf_model(path, dtype=torch.float32).eval()
    s = samples[1]
    ids = torch.tensor([s["prompt"]["prompt_ids"] + s["response_ids"]])
    kw = actor.mm_token_types(hf, ids, s["prompt"]["mm_inputs"])
    assert "mm_token_type_ids" in kw and int(kw["mm_token_type_ids"].sum()) > 0
    with torch.no_grad():
        a = hf(input_ids=ids, **s["prompt"]["mm_inputs"], **kw).logits
        b = hf(input_ids=ids, **s["prompt"]["mm_inputs"]).logits
    assert not torch.allclose(a, b)


def test_micro_batching_gives_the_same_gradient(setup):
    path, proc, samples = setup
    pad = proc.tokenizer.pad_token_id
    adv = [1.0, -0.5, 0.25, -1.0, 0.75, 0.0, 0.5, -0.25]
    num_tokens = sum(len(s["response_ids"]) for s in samples)
    g = torch.Generator().manual_seed(1)
    olds = [-torch.rand(len(s["response_ids"]), generator=g) * 8 for s in samples]

    def grads(max_tokens):
        torch.manual_seed(0)
        model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
        total = 0.0
        for idx in actor.make_micro_batches([len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in samples],
                                            max_tokens, 64):
            mb = [samples[i] for i in idx]
            batch, resp_len = actor.collate(mb, pad, torch.device("cpu"))
            lp, _ = model(**batch)
            logp, mask = actor.pad_responses(lp, resp_len)
            old = actor.stack_padded([olds[i] for i in idx], logp.shape[1], logp.device)  # off-policy: ratios != 1
            loss, _ = policy_loss(logp, old, torch.tensor([adv[i] for i in idx]), mask)
            loss = agg_loss(loss, mask, "token", num_tokens=num_tokens)
            loss.backward()
            total += float(loss.detach())
        return total, {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}

    l1, g1 = grads(100_000)  # one micro-batch
    l2, g2 = grads(40)  # several
    assert len(actor.make_micro_batches([40] * 8, 40, 64)) == 8
    assert l1 == pytest.approx(l2, rel=1e-4)
    assert g1.keys() == g2.keys() and len(g1) > 10
    for n in g1:
        assert torch.allclose(g1[n], g2[n], atol=1e-5, rtol=1e-3), n


def test_optimizer_skips_non_finite_steps(setup):
    path, _, _ = setup
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
    opt, sched = actor.build_optimizer(model, 1e-3, 0.0, (0.9, 0.999), 2, torch.device("cpu"))
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    norm = actor.optimizer_step(model, opt, sched, 1.0)
    assert norm != norm  # NaN reported
    for n, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), before[n]), n  # and nothing changed
    assert sched.get_last_lr()[0] == pytest.approx(1e-3)  # warmup: (s+1)/2 -> step 1 reaches lr


def test_full_params_stream_hf_names(setup):
    path, _, _ = setup
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
    hf = actor.load_hf_model(path)
    names = dict(actor.iter_full_params(model))
    assert names.keys() == hf.state_dict().keys()
    for k, v in hf.state_dict().items():
        assert torch.equal(names[k], v), k


def test_micro_batches_respect_bounds_and_keep_prompts_together():
    lengths, groups = [10, 12, 30, 28, 5, 6], ["a", "a", "b", "b", "c", "c"]
    mbs = actor.make_micro_batches(lengths, 60, 64, groups)
    assert sorted(i for mb in mbs for i in mb) == list(range(6))
    assert all(len(mb) * max(lengths[i] for i in mb) <= 60 for mb in mbs)
    assert mbs == [[2, 3], [1, 0, 5, 4]]  # longest prompt first; each prompt's samples side by side
    assert all(len(mb) <= 3 for mb in actor.make_micro_batches(lengths, 10_000, 3, groups))


def test_attention_runs_maskless_and_vision_once_per_image(setup, monkeypatch):
    """The speed properties of the forward: the language model's SDPA calls get no mask (is_causal instead, which
    lets PyTorch pick its flash kernel), and the vision tower sees each distinct image once, not once per sample."""
    import torch.nn.functional as F
    path, proc, samples = setup
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    calls, orig = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((q.shape[0], attn_mask is None, is_causal))
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    seen = []
    vis = model.hf.model.visual
    monkeypatch.setattr(vis, "forward", lambda pixel_values, grid_thw, **kw: (
        seen.append(len(grid_thw)), type(vis).forward(vis, pixel_values, grid_thw=grid_thw, **kw))[1])
    batch, _ = actor.collate(samples, proc.tokenizer.pad_token_id, torch.device("cpu"))  # 8 rows, 4 prompts, 5 images
    with torch.no_grad():
        model(**batch)
    text = [c for c in calls if c[0] == len(samples)]  # the language model's calls: batch = rows
    assert text and all(no_mask and causal for _, no_mask, causal in text)
    assert seen == [5]  # one vision pass over the 5 distinct images


def test_qwen2_vl_logprobs_match_plain_hf_forward(tmp_path):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "q2vl"), arch="qwen2_vl")
    proc = data.load_processor(path)
    train, _ = tiny_model.demo_data(str(tmp_path / "data"), n_train=4, n_val=2)
    ds = data.PromptDataset(train, proc, format_prompt=tiny_model.DEMO_FORMAT_PROMPT, min_pixels=56 * 56,
                            max_pixels=112 * 112)
    p0, p1 = ds[0], ds[1]
    samples = [dict(prompt=p0, response_ids=[5, 6, 7]), dict(prompt=p0, response_ids=[8]),
               dict(prompt=p1, response_ids=[9, 9, 9, 9])]
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    lps, _ = actor.compute_logprobs(model.eval(), samples, proc.tokenizer.pad_token_id, torch.device("cpu"), 1.0,
                                    max_tokens=10_000, max_samples=8)
    for a, b in zip(lps, reference_logprobs(path, samples, proc.tokenizer.pad_token_id), strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5)


def test_text_only_rows_in_a_vlm_match_plain_hf_forward(setup):
    """A micro-batch without images still runs the vision tower (on a blank image, times 0, so every rank runs
    the same FSDP units): the log-probs are those of the plain text forward, and the vision blocks get a (zero)
    gradient, which is what keeps the ranks' reduce-scatters lined up."""
    path, proc, _ = setup
    p = data.encode_prompt({"problem": "Name a colour.", "answer": "red", "images": []}, proc)
    samples = [dict(prompt=p, response_ids=[5, 6, 7]), dict(prompt=p, response_ids=[9, 9])]
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    batch, resp_len = actor.collate(samples, proc.tokenizer.pad_token_id, torch.device("cpu"))
    seen = []
    vis = model.hf.model.visual
    vis.register_forward_hook(lambda *a: seen.append(1))
    lp, _ = model(**batch)
    ref = reference_logprobs(path, samples, proc.tokenizer.pad_token_id)
    for a, b in zip(lp.split(resp_len.tolist()), ref, strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5)
    lp.sum().backward()
    assert seen == [1]
    grads = [q.grad for n, q in model.named_parameters() if ".visual." in n]
    assert grads and all(g is not None and float(g.full_tensor().abs().sum()) == 0 for g in grads)


def test_a_micro_batchs_tensors_are_not_kept_alive_by_the_copy_to_the_device():
    """to_device once carried a stray @functools.cache (left from a removed helper above it): every micro-batch's
    tensors stayed referenced by the cache, and the host's memory grew ~70 MB a step on the Gemma 4 demo."""
    t = torch.ones(3)
    ref = weakref.ref(t)
    actor.to_device(t, torch.device("cpu"))
    del t
    gc.collect()
    assert ref() is None
