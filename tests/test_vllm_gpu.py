"""vLLM rollout engine on a GPU (skipped elsewhere), with the tiny Qwen2.5-VL.

    pytest -m gpu tests/test_vllm_gpu.py -s               # one GPU: logprobs vs HF, weight sync, caches, sleep
    PYTHONPATH=. torchrun --nproc_per_node 2 tests/test_vllm_gpu.py --tp 1  # data-parallel SPMD (2 independent engines)
    PYTHONPATH=. torchrun --nproc_per_node 2 tests/test_vllm_gpu.py --tp 2  # tensor-parallel SPMD (prompts gathered)
"""
import os

import pytest
import torch

import rollout
import tiny_model
from test_grpo_gpu import SHARED, engine_memory

pytestmark = pytest.mark.gpu
T_SAMPLE = 0.7


def make_prompts(path, k=4):
    import data
    from PIL import Image, ImageDraw
    proc = data.load_processor(path)
    recs = []
    for i, (name, rgb) in enumerate(list(tiny_model.COLORS.items())[:k]):
        im = Image.new("RGB", (84 + 28 * i, 56 + 14 * i), (255, 255, 255))
        ImageDraw.Draw(im).rectangle([10, 10, 50, 40], fill=rgb)
        row = {"problem": "<image>What is the color of the shape?", "answer": name, "images": [im]}
        recs.append(data.encode_prompt(row, proc, min_pixels=56 * 56, max_pixels=112 * 112))
    return recs


def sharpen(sd, factor=10):
    """The random tiny model is almost uniform (log-probs ~ -log V), where temperature hardly matters; a 10x
    lm_head makes it peaked so the temperature convention and greedy agreement are really tested. (Gemma 4's logits
    are soft-capped at 30: 10x saturates them, every prompt then answers one token whatever the weights: 2x there.)"""
    head = sd.get("lm_head.weight")
    if head is None:
        return dict(sd)
    # tie_word_embeddings (the tiny Llama): lm_head.weight is the embedding's tensor under a second name. The engine
    # skips that name and reads the embedding, HF loads both into one parameter: scale the shared tensor once, so
    # both names carry the same values (scaled input embeddings are undone by the first RMSNorm)
    big = head * factor
    return {k: (big if v.data_ptr() == head.data_ptr() else v) for k, v in sd.items()}


def sharpen_for(model):
    """sharpen() at the factor the model's logits allow: 2x where they are soft-capped (Gemma 4), else 10x."""
    return sharpen(model.state_dict(), 2 if getattr(model.config.get_text_config(), "final_logit_softcapping", None)
                   else 10)


def perturb(sd, keep, scale=0.5):
    g = torch.Generator().manual_seed(123)
    return {k: (v.float() + scale * torch.randn(v.shape, generator=g).to(v.device)).to(v.dtype)
            for k, v in sd.items() if keep(k) and v.dim() > 1}


def mapped_gib():
    """GiB of vLLM's sleep-mode pool mapped to physical memory now, in this process (the engine's weights and KV
    cache while awake)."""
    from vllm.device_allocator.cumem import CuMemAllocator  # optional: the GPU engine
    return sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values() if not d.is_asleep) / 2**30


@pytest.fixture(scope="module")
def setup():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rollout._set_vllm_env()
    pytest.importorskip("vllm")
    import tiny_model
    path = tiny_model.build_tiny_model()
    eng = rollout.VLLMRollout(path, **engine_memory(0.3), max_model_len=1024, enforce_eager=True,
                              enable_sleep_mode=True, dtype="bfloat16", limit_mm_per_prompt={"image": 1, "video": 0})
    # the reference: bf16-rounded weights (what vLLM holds) computed in fp32
    ref = rollout.load_hf_model(path, torch.bfloat16).float().cuda().eval()
    sd = {k: v.to(torch.bfloat16) for k, v in sharpen(ref.state_dict()).items()}
    eng.sync_weights(sd.items())
    ref.load_state_dict({k: v.float() for k, v in sd.items()})
    return dict(path=path, eng=eng, ref=ref, sd=sd, prompts=make_prompts(path))


def ref_logprobs(ref, rec, response, temperature, forbidden):
    ids = torch.tensor([rec["prompt_ids"] + response], device="cuda")
    mm = {k: v.cuda() for k, v in rec["mm_inputs"].items()}
    with torch.no_grad():
        logits = ref(input_ids=ids, attention_mask=torch.ones_like(ids), **mm,
                     **rollout.mm_token_types(ref, ids, mm)).logits[0].float()
    Lp = len(rec["prompt_ids"])
    logits = logits[Lp - 1:Lp - 1 + len(response)]  # [T, V]
    logits[:, forbidden] = float("-inf")
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response, device="cuda")[:, None]).squeeze(1).cpu()  # [T]


def greedy(eng, prompts):
    out = eng.generate(prompts, n=1, temperature=0, top_p=1.0, max_tokens=24, seeds=[0] * len(prompts))
    return [g[0]["response_ids"] for g in out]


def test_consecutive_prompt_seeds_draw_independent_samples(setup):
    """The trainer seeds prompt pos with a number one above prompt pos - 1's; vLLM seeds a request's j-th sample with
    `seed + j`. Two copies of one prompt at consecutive positions once drew the same samples shifted by one (15 of 16
    equal: the Qwen3-VL demo's stall); at temperature 2 (vLLM's most) the sharpened tiny model spreads its samples,
    and independent samples of 12 tokens are hardly ever equal by chance."""
    eng, rec = setup["eng"], setup["prompts"][0]
    out = eng.generate([rec, rec], n=16, temperature=2.0, top_p=1.0, max_tokens=12, seeds=[1_000_003, 1_000_004])
    a, b = [[s["response_ids"] for s in g] for g in out]
    shifted = sum(x == y for x, y in zip(a[1:], b[:-1]))
    assert shifted <= 1, f"{shifted} of 15 samples of the second prompt repeat the first prompt's"
    again = eng.generate([rec], n=16, temperature=2.0, top_p=1.0, max_tokens=12, seeds=[1_000_003])[0]
    # still seeded: the same prompt and seed draw the same samples (alone rather than in a batch of two, only
    # batch-dependent kernel numerics could change a token)
    assert sum(s["response_ids"] == x for s, x in zip(again, a)) >= 12


def test_a_split_request_draws_the_samples_of_the_whole(setup):
    """Log-probs for a prompt's first k samples only (grpo.logprob_samples): generate splits the prompt's request in
    two, k samples seeded as the one request's first k and n - k seeded k further; vLLM seeds a request's j-th sample
    with seed + j, so the samples are the whole request's (at temperature 2, where a seed moved by one would draw
    other samples), and the first k carry the same log-probs. Only batch-dependent kernel numerics could change a
    token."""
    eng, recs = setup["eng"], setup["prompts"]
    kw = dict(n=4, temperature=2.0, top_p=1.0, max_tokens=12, seeds=[21, 22, 23, 24][:len(recs)])
    whole = eng.generate(recs, **kw)
    want = [1, 0, 2, 4][:len(recs)]
    split = eng.generate(recs, logprobs=want, **kw)
    same = [a["response_ids"] == b["response_ids"] for g, w in zip(split, whole) for a, b in zip(g, w)]
    print(f"[vllm] split requests: {sum(same)}/{len(same)} samples identical to the whole request's")
    assert sum(same) >= len(same) - 2
    for g, w, k in zip(split, whole, want):
        assert [a["logprobs"] is not None for a in g] == [j < k for j in range(4)]
        for a, b in zip(g[:k], w[:k]):
            if a["response_ids"] == b["response_ids"]:
                assert torch.allclose(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=0.05)


def test_prompt_expansion_matches_hf_processor(setup):
    # vLLM expands the single <|image_pad|> itself: it must give exactly the trainer's prompt_ids length
    eng, recs = setup["eng"], setup["prompts"]
    from vllm import SamplingParams
    outs = eng.llm.generate([eng._vllm_prompt(r) for r in recs], SamplingParams(max_tokens=1), use_tqdm=False)
    for o, r in zip(outs, recs, strict=True):
        assert list(o.prompt_token_ids) == r["prompt_ids"]


def test_composed_inputs_are_vllms_own_and_generate_alike(setup):
    """VLLMRollout._add composes a Qwen-VL request's input from its pictures' (vLLM's processor on each picture's pad
    alone): for every request, what vLLM's processor makes of the whole (ids, keys, placeholder ranges), the ids the
    trainer's prompt_ids, and greedy answers the same as from vLLM's own processing."""
    eng, recs = setup["eng"], setup["prompts"]
    assert eng.pad is not None
    for (req, *_), rec in zip(eng._items(recs, [0] * len(recs))[0], recs):
        got, want = eng._compose(req, {}), eng.llm.renderer.render_cmpl([req])[0]
        assert [got[k] for k in rollout._COMPOSED] == [want[k] for k in rollout._COMPOSED]
        assert got["prompt_token_ids"] == rec["prompt_ids"]
    composed, pad = greedy(eng, recs), eng.pad
    try:
        eng.pad = None  # vLLM's own processing
        assert greedy(eng, recs) == composed
    finally:
        eng.pad = pad


def test_logprobs_match_hf_recompute(setup):
    eng, ref, recs = setup["eng"], setup["ref"], setup["prompts"]
    out = eng.generate(recs, n=4, temperature=T_SAMPLE, top_p=1.0, max_tokens=32, seeds=[1, 2, 3, 4])
    diffs, raw_diffs = [], []
    for rec, group in zip(recs, out, strict=True):
        for o in group:
            ids = o["response_ids"]
            assert len(o["logprobs"]) == len(ids) > 0
            assert o["finished"] == (ids[-1] in eng.eos_ids)
            assert not set(ids) & set(eng.forbidden_ids)
            r = ref_logprobs(ref, rec, ids, T_SAMPLE, eng.forbidden_ids)
            diffs.append((torch.tensor(o["logprobs"]) - r).abs())
            raw_diffs.append((torch.tensor(o["logprobs"]) - ref_logprobs(ref, rec, ids, 1.0, [])).abs())
    mean, raw_mean = torch.cat(diffs).mean().item(), torch.cat(raw_diffs).mean().item()
    print(f"[vllm vs hf] mean |logp diff| {mean:.4f} (vs untempered: {raw_mean:.4f})")
    assert mean < 0.1
    assert raw_mean > 3 * mean  # the engine reports the tempered ("processed") distribution, not the raw one


def test_seeds(setup):
    eng, recs = setup["eng"], setup["prompts"]
    kw = dict(n=3, temperature=1.0, top_p=0.9, max_tokens=24)
    a = eng.generate(recs, seeds=[7, 8, 9, 10], **kw)
    b = eng.generate(recs, seeds=[7, 8, 9, 10], **kw)
    assert [[o["response_ids"] for o in g] for g in a] == [[o["response_ids"] for o in g] for g in b]
    alone = eng.generate(recs[2:3], seeds=[9], **kw)[0]
    # the sampling noise is per request; only batch-dependent kernel numerics could change a token
    same = sum(x["response_ids"] == y["response_ids"] for x, y in zip(alone, a[2]))
    print(f"[vllm] prompt alone vs in a batch: {same}/3 identical samples")
    assert same >= 2


def test_greedy_agrees_with_hf_engine(setup):
    hf = rollout.HFRollout(setup["path"], device="cuda", dtype=torch.float32)
    hf.sync_weights((k, v.float()) for k, v in setup["sd"].items())
    v_ids, h_ids = greedy(setup["eng"], setup["prompts"]), greedy(hf, setup["prompts"])
    agree = sum(a[:4] == b[:4] for a, b in zip(v_ids, h_ids))
    print(f"[vllm vs hf engine] greedy first 4 tokens agree for {agree}/{len(v_ids)} prompts")
    assert agree >= len(v_ids) // 2


def test_sync_weights_change_and_restore(setup):
    eng, sd, recs = setup["eng"], setup["sd"], setup["prompts"]
    base = greedy(eng, recs)
    eng.sync_weights(perturb(sd, lambda k: True).items())
    assert greedy(eng, recs) != base
    eng.sync_weights(sd.items())
    assert greedy(eng, recs) == base
    # vision-only update: only visible because sync_weights resets the encoder cache (image-hash keyed)
    eng.sync_weights(perturb(sd, lambda k: k.startswith("model.visual."), scale=2.0).items())
    assert greedy(eng, recs) != base
    eng.sync_weights(sd.items())
    assert greedy(eng, recs) == base
    with pytest.raises(Exception):
        eng.sync_weights([("model.not_a_layer.weight", torch.zeros(4))])


def test_sleep_frees_memory(setup):
    eng, sd, recs = setup["eng"], setup["sd"], setup["prompts"]
    base = greedy(eng, recs)
    for level in (1, 2):
        eng.sleep_level = level
        free0, mapped0 = torch.cuda.mem_get_info()[0], mapped_gib()
        eng.sleep()
        # side by side (GPU_TESTS_SHARED=1) the device's free memory also moves with the other engines' wake-ups: count
        # what this process's engine has mapped instead
        freed = mapped0 - mapped_gib() if SHARED else (torch.cuda.mem_get_info()[0] - free0) / 2 ** 30
        print(f"[vllm] sleep(level={level}) freed {freed:.2f} GiB")
        assert freed > 1.0
        if level == 2:
            with pytest.raises(RuntimeError):  # weights were discarded: refuse to sample from garbage
                eng.generate(recs, n=1, temperature=0, top_p=1.0, max_tokens=4, seeds=[0] * len(recs))
        eng.sync_weights(sd.items())  # wakes the weights only
        assert eng.asleep == {"kv_cache"}
        assert greedy(eng, recs) == base  # generate wakes the KV cache
    eng.sleep_level = 1


def test_requests_queued_while_asleep_run_as_generate_makes_them(setup):
    """VLLMRollout.submit, as grpo's prefetch thread calls it during the update: the requests queued on another
    thread with the engine asleep at level 2 (its scheduler paused), the weights then synced, the KV cache woken, and
    generate with the same arguments runs them: the samples and log-probs generate makes without the queue, the
    engine's queue empty after; a call with other arguments first drops them (validation's greedy answers stay)."""
    import threading
    eng, sd, recs = setup["eng"], setup["sd"], setup["prompts"]
    kw = dict(n=4, temperature=1.0, top_p=1.0, max_tokens=12, seeds=[31, 32, 33, 34][:len(recs)],
              logprobs=[1, 0, 2, 0][:len(recs)])
    plain, base = eng.generate(recs, **kw), greedy(eng, recs)
    eng.sleep_level = 2
    for other in (False, True):
        eng.sleep()
        thread = threading.Thread(target=lambda: eng.submit(recs, **kw))
        thread.start()
        thread.join()
        assert eng.queued is not None and eng.llm.llm_engine.get_num_unfinished_requests() > 0
        eng.sync_weights(sd.items())
        if other:
            assert greedy(eng, recs) == base
            continue
        got = eng.generate(recs, **kw)
        same = [a["response_ids"] == b["response_ids"] for g, w in zip(got, plain) for a, b in zip(g, w)]
        print(f"[vllm] queued requests: {sum(same)}/{len(same)} samples identical to generate's own")
        assert sum(same) >= len(same) - 2 and eng.llm.llm_engine.get_num_unfinished_requests() == 0
        for g, w, k in zip(got, plain, kw["logprobs"]):
            assert [a["logprobs"] is not None for a in g] == [j < k for j in range(4)]
            for a, b in zip(g[:k], w[:k]):
                if a["response_ids"] == b["response_ids"]:
                    assert torch.allclose(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=0.05)
    assert eng.queued is None and eng.llm.llm_engine.get_num_unfinished_requests() == 0
    eng.sleep_level = 1


# ------------------------------------------------------------------------------------------------ a KV cache too small
def preempt_main(mode):
    """Log-probs when the KV cache cannot hold every running sample, so vLLM preempts requests and recomputes them
    (a 40 GB card's engine on a 7B batch). mode: "default" | "sync" (async_scheduling off) | "v1" (the older model
    runner). Prints PREEMPT_OK when the engine's log-probs still match the HF recompute."""
    if mode == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    rollout._set_vllm_env()
    from vllm.v1.core.sched.scheduler import Scheduler
    count = {"preempted": 0}
    preempt = Scheduler._preempt_request

    def counting(self, request, timestamp):
        count["preempted"] += 1
        return preempt(self, request, timestamp)
    Scheduler._preempt_request = counting
    path = tiny_model.build_tiny_model()
    # 2 layers x 2 KV heads x 32 dims x (K, V) x 2 bytes = 512 bytes per token: 1,536 tokens of cache for 16
    # samples of ~700 tokens each
    extra = {} if mode != "sync" else {"async_scheduling": False}
    eng = rollout.VLLMRollout(path, **{**engine_memory(0.3), "kv_cache_memory_bytes": 1536 * 512}, max_model_len=1024,
                              enforce_eager=True, dtype="bfloat16", **extra)
    ref = rollout.load_hf_model(path, torch.bfloat16).float().cuda().eval()
    sd = {k: v.to(torch.bfloat16) for k, v in sharpen(ref.state_dict()).items()}
    eng.sync_weights(sd.items())
    ref.load_state_dict({k: v.float() for k, v in sd.items()})
    recs = make_prompts(path)
    L = 600
    out = eng.generate(recs, n=4, temperature=1.0, top_p=1.0, max_tokens=L, seeds=[1, 2, 3, 4],
                       lengths=[[L] * 4] * len(recs))
    diffs = []
    for rec, group in zip(recs, out, strict=True):
        for o in group:
            assert len(o["response_ids"]) == L
            r = ref_logprobs(ref, rec, o["response_ids"], 1.0, eng.forbidden_ids)
            diffs.append((torch.tensor(o["logprobs"]) - r).abs())  # [L]
    d = torch.stack(diffs)  # [16, L]
    quarters = [f"{q.mean().item():.4f}" for q in d.chunk(4, dim=1)]
    print(f"[vllm {mode}] {count['preempted']} preemptions; mean |logp diff| {d.mean().item():.4f}, by quarter of "
          f"the response {quarters}, worst sample {d.mean(1).max().item():.4f}", flush=True)
    assert count["preempted"] > 0, "the cache held every sample: nothing was tested"
    assert d.mean().item() < 0.1, d.mean(1).tolist()
    print(f"PREEMPT_OK {mode}", flush=True)


def test_logprobs_hold_when_requests_are_preempted(launch, tmp_path):
    pytest.importorskip("vllm")
    launch.script(__file__, "--preempt", tmp_path / "preempt.log", "PREEMPT_OK default")


# ------------------------------------------------------------------------------------------------ torchrun SPMD
def spmd_main(tp):
    """Each rank: own prompts, own seeds. DP replicas must not wait for each other; TP ranks gather."""
    import threading

    import torch.distributed as dist
    import tiny_model
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    path = tiny_model.build_tiny_model()  # cached: build once before launching torchrun
    eng = rollout.VLLMRollout(path, tensor_parallel_size=tp, gpu_memory_utilization=0.3, max_model_len=1024,
                              enforce_eager=True, dtype="bfloat16")
    recs = make_prompts(path)
    mine = recs[rank % len(recs)::world] or recs[:1]  # different prompts on each rank
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=16, seeds=[100 + rank] * len(mine))
    out = eng.generate(mine, **kw)
    assert len(out) == len(mine) and all(len(g) == 2 for g in out)
    # grpo's prefetch thread (--prefetch-requests auto): each rank queues its next call with its engine asleep; a TP
    # group declines (its prompt gather is a collective, the main thread's) and generate makes the requests itself
    eng.sleep()
    queued = []
    thread = threading.Thread(target=lambda: queued.append(eng.submit(mine, **kw)))
    thread.start()
    thread.join()
    again = eng.generate(mine, **kw)
    same = [a["response_ids"] == b["response_ids"] for g, w in zip(again, out) for a, b in zip(g, w)]
    assert queued == [tp == 1] and sum(same) >= len(same) - 2, (queued, same)
    # same prompt + same seed on every rank -> the same samples, whichever replica runs it
    same = eng.generate(recs[:1], n=2, temperature=1.0, top_p=1.0, max_tokens=16, seeds=[5])[0]
    got = [None] * world
    dist.all_gather_object(got, [o["response_ids"] for o in same])
    assert all(g == got[0] for g in got), got
    sd = rollout.load_hf_model(path, torch.bfloat16).state_dict()
    base = greedy(eng, recs)
    eng.sync_weights(perturb(sd, lambda k: True).items())
    assert greedy(eng, recs) != base
    eng.sleep()
    eng.sync_weights(sd.items())
    assert greedy(eng, recs) == base
    dist.barrier()
    if rank == 0:
        print(f"SPMD_OK world={world} tp={tp} dp={world // tp} vllm={eng.version}", flush=True)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--preempt", nargs="?", const="default", choices=["default", "sync", "v1"])
    a = ap.parse_args()
    preempt_main(a.preempt) if a.preempt else spmd_main(a.tp)
