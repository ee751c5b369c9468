"""The rollout engines: HF on CPU with the tiny Qwen2.5-VL (seeding, EOS handling, forbidden tokens, log-probs, weight
sync) and VLLMRollout against a stand-in vLLM (tests/vllm_standin.py): requests, seeds, log-probs, sleep, queue."""
import gc
import sys
import types

import pytest
import torch

from fsdp_actor import mm_token_types
from PIL import Image

import rollout
import tiny_model
from vllm_standin import standin_vllm


def make_record(path, image, question):
    """A prompt record as data.encode_prompt makes it, built from the tokenizer and the image processor directly
    (AutoProcessor needs torchvision for the video processor, which this box lacks)."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ImgProc = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)
    ip = ImgProc.from_pretrained(path)
    mm = dict(ip(images=[image], return_tensors="pt"))  # pixel_values [P, D], image_grid_thw [1, 3]
    n_pad = int(mm["image_grid_thw"].prod()) // ip.merge_size ** 2
    text = (f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
            "<|im_start|>assistant\n")
    raw = tok(text)["input_ids"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = [x for t in raw for x in ([pad] * n_pad if t == pad else [t])]
    return dict(prompt_ids=ids, raw_prompt_ids=raw, images=[image], mm_inputs=mm, answer="red", prompt_text=question)


@pytest.fixture(scope="module")
def path():
    return tiny_model.build_tiny_model()


@pytest.fixture(scope="module")
def engine(path):
    return rollout.make_rollout("hf", model_path=path, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(path):
    return [make_record(path, Image.new("RGB", (84, 56), (220, 40, 40)), "What is the color of the shape?"),
            make_record(path, Image.new("RGB", (56, 112), (40, 70, 220)), "Which color?")]


def test_auto_picks_hf_without_cuda(path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert isinstance(rollout.make_rollout("auto", model_path=path, dtype=torch.float32), rollout.HFRollout)


def test_engine_options_reach_vllm(path, monkeypatch):
    """Every option engine_options names arrives in the vLLM engine's keywords; --kv-cache-memory-gb as vLLM's bytes."""
    import grpo
    seen = {}
    monkeypatch.setattr(rollout, "VLLMRollout", lambda model_path, **kw: seen.update(kw) or types.SimpleNamespace())
    cfg = grpo.Config(gpu_memory_utilization=0.07, kv_cache_memory_gb=1.5, min_pixels=3136, max_pixels=12544,
                      enforce_eager=True, sleep_level=2)
    rollout.make_rollout("vllm", path, **rollout.engine_options(cfg))
    assert seen["kv_cache_memory_bytes"] == int(1.5 * 2**30) and seen["gpu_memory_utilization"] == 0.07
    assert seen["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 12544}
    assert seen["enforce_eager"] and seen["sleep_level"] == 2
    seen.clear()
    rollout.make_rollout("vllm", path, **rollout.engine_options(grpo.Config()))
    assert "kv_cache_memory_bytes" not in seen  # 0: vLLM measures what gpu_memory_utilization leaves
    # --sleep-level auto: full fine-tuning re-sends every weight, so the engine drops its own (2); LoRA's sync and
    # --debug-skip-sync leave the engine's weights in use (1); a level given is kept
    for kw, level in ((dict(), 2), (dict(lora_rank=8), 1), (dict(debug_skip_sync=True), 1),
                      (dict(sleep_level=1), 1), (dict(lora_rank=8, sleep_level=2), 2)):
        assert rollout.engine_options(grpo.Config(**kw))["sleep_level"] == level, kw


def test_an_engine_out_of_memory_at_start_is_one_line(path, monkeypatch):
    """vLLM out of GPU memory while it starts (the 35B-A3B beside its trainer: benchmarks/HISTORY.md) is one line
    naming the options that give it room, not vLLM's traceback."""
    def oom(model_path, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 616.00 MiB.")
    monkeypatch.setattr(rollout, "VLLMRollout", oom)
    with pytest.raises(rollout.UserError, match="--kv-cache-memory-gb.*--offload-params"):
        rollout.make_rollout("vllm", path)


def test_sleep_level_is_checked_and_parsed(tmp_path):
    """--sleep-level takes 1, 2 or auto from the command line; anything else stops with one line naming it."""
    import easyr1_config
    import grpo
    from common import UserError
    from config import Config
    with pytest.raises(UserError, match="--sleep-level 3"):
        easyr1_config.check(Config(output_dir=str(tmp_path), sleep_level=3), 1)
    for arg, want in (("2", 2), ("auto", "auto")):
        cfg = easyr1_config.cli(grpo.Config, grpo.DEMO, args=["--sleep-level", arg, "--output-dir", str(tmp_path)])
        assert cfg.sleep_level == want


def test_seeded_and_independent_of_other_prompts(engine, prompts):
    state = torch.random.get_rng_state()
    kw = dict(n=3, temperature=1.0, top_p=0.9, max_tokens=12)
    both = engine.generate(prompts, seeds=[11, 22], **kw)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG stream is untouched
    again = engine.generate(prompts, seeds=[11, 22], **kw)
    alone = engine.generate(prompts[1:], seeds=[22], **kw)
    assert both == again
    assert alone[0] == both[1]  # prompt 1's samples do not depend on prompt 0 being in the call
    other = engine.generate(prompts[1:], seeds=[23], **kw)
    assert [o["response_ids"] for o in other[0]] != [o["response_ids"] for o in alone[0]]
    assert len(both) == 2 and all(len(g) == 3 for g in both)
    samples = [o["response_ids"] for o in both[0]]
    assert len({tuple(s) for s in samples}) > 1  # the n copies are different samples


def test_eos_iff_finished_and_no_pad_tokens(engine, prompts):
    # temperature 3 flattens the random model's distribution: EOS (2 of 512 ids) shows up in some samples,
    # and so would the image/video pad ids if they were not forbidden
    out = engine.generate(prompts, n=8, temperature=3.0, top_p=1.0, max_tokens=40, seeds=[5, 6])
    flat = [o for g in out for o in g]
    eos = set(engine.eos_ids)
    for o in flat:
        ids = o["response_ids"]
        assert o["finished"] == (ids[-1] in eos)
        assert not any(t in eos for t in ids[:-1])  # cut right after the first EOS
        assert o["finished"] or len(ids) == 40
        assert len(o["logprobs"]) == len(ids)
        assert not set(ids) & set(engine.forbidden_ids)
    assert any(o["finished"] for o in flat) and not all(o["finished"] for o in flat)
    assert sum(len(o["response_ids"]) for o in flat) > 300  # enough draws for a pad id to have shown up


def _manual_logprobs(engine, prompt, response, temperature, ban=True):
    """log_softmax(logits / T) of the response tokens from one full forward pass (what the trainer computes)."""
    ids = torch.tensor([prompt["prompt_ids"] + response])  # [1, L]
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=torch.ones_like(ids), **prompt["mm_inputs"],
                              **mm_token_types(engine.model, ids, prompt["mm_inputs"])).logits[0]
    Lp = len(prompt["prompt_ids"])
    logits = logits[Lp - 1:Lp - 1 + len(response)].float()  # [T, V]: position t predicts token t+1
    if ban:
        logits[:, engine.forbidden_ids] = float("-inf")
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None]).squeeze(1)  # [T]


def test_logprobs_match_forward_pass(engine, prompts):
    T = 0.7
    out = engine.generate(prompts[:1], n=2, temperature=T, top_p=1.0, max_tokens=10, seeds=[3])[0]
    for o in out:
        manual = _manual_logprobs(engine, prompts[0], o["response_ids"], T)
        assert torch.allclose(torch.tensor(o["logprobs"]), manual, atol=1e-4), (o["logprobs"], manual)
        # without the pad ids banned (an engine or trainer that forgot them), their probability mass is the only
        # difference: small for this model, but not zero
        unbanned = _manual_logprobs(engine, prompts[0], o["response_ids"], T, ban=False)
        assert (torch.tensor(o["logprobs"]) - unbanned).abs().max() < 0.05


def test_greedy_and_top_p(engine, prompts):
    g = engine.generate(prompts[:1], n=3, temperature=0, top_p=1.0, max_tokens=8, seeds=[0])[0]
    assert g[0] == g[1] == g[2]
    manual = _manual_logprobs(engine, prompts[0], g[0]["response_ids"], 1.0)
    assert torch.allclose(torch.tensor(g[0]["logprobs"]), manual, atol=1e-4)
    # greedy tokens are the argmax of the forward pass
    ids = torch.tensor([prompts[0]["prompt_ids"] + g[0]["response_ids"]])
    with torch.no_grad():
        logits = engine.model(input_ids=ids, **prompts[0]["mm_inputs"],
                              **mm_token_types(engine.model, ids, prompts[0]["mm_inputs"])).logits[0]
    Lp = len(prompts[0]["prompt_ids"])
    assert logits[Lp - 1:-1].argmax(-1).tolist() == g[0]["response_ids"]
    # top-p: log-probs are renormalised over the nucleus, so they are >= the untruncated ones
    p = engine.generate(prompts[:1], n=2, temperature=1.0, top_p=0.5, max_tokens=8, seeds=[1])[0]
    for o in p:
        full = _manual_logprobs(engine, prompts[0], o["response_ids"], 1.0)
        assert (torch.tensor(o["logprobs"]) >= full - 1e-5).all()


def test_sync_weights(engine, prompts):
    kw = dict(n=1, temperature=0, top_p=1.0, max_tokens=8, seeds=[0, 0])
    before = engine.generate(prompts, **kw)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    engine.sync_weights((k, v + 0.5 * torch.randn(v.shape, generator=g)) for k, v in original.items())
    changed = engine.generate(prompts, **kw)
    assert changed != before
    # vision-only change: same text weights, different image features -> different answer
    engine.sync_weights(original.items())
    assert engine.generate(prompts, **kw) == before
    engine.sync_weights((k, v * 3.0) for k, v in original.items() if k.startswith("model.visual.") and v.dim() > 1)
    assert engine.generate(prompts, **kw) != before
    engine.sync_weights(original.items())
    assert engine.generate(prompts, **kw) == before
    with pytest.raises(KeyError):
        engine.sync_weights([("model.not_a_layer.weight", torch.zeros(1))])
    with pytest.raises(ValueError):
        engine.sync_weights([("lm_head.weight", torch.zeros(3, 3))])
    engine.sleep()
    engine.wake()


def test_text_only_model():
    path = tiny_model.build_tiny_model(arch="qwen2")
    eng = rollout.HFRollout(path, device="cpu", dtype=torch.float32)
    assert eng.forbidden_ids == []
    ids = [1, 2, 3, 4]
    rec = dict(prompt_ids=ids, raw_prompt_ids=ids, images=[], mm_inputs={}, answer="", prompt_text="")
    out = eng.generate([rec], n=2, temperature=1.0, top_p=1.0, max_tokens=6, seeds=[0])[0]
    assert len(out) == 2 and all(len(o["response_ids"]) == len(o["logprobs"]) for o in out)


def test_vllm_samples_of_a_run_never_share_a_seed(monkeypatch):
    """vLLM seeds the j-th sample of a request with `seed + j` (vllm/v1/engine/parallel_sampling.py). With the
    trainer's consecutive per-prompt seeds passed on as they were, prompts pos and pos + 1 shared n - 1 noise streams
    and the next step reused them (the Qwen3-VL demo with vLLM never sampled "white": validation stuck at 0.755).
    VLLMRollout.generate runs here against a stand-in LLM that applies vLLM's rule; every sample of 30 steps of the
    demo's batch (training, validation and the forced benchmark path) must get its own seed."""
    import sys
    import types

    import grpo

    class SamplingParams:
        def __init__(self, n=1, seed=None, max_tokens=1, **kw):
            self.n, self.seed, self.max_tokens = n, seed, max_tokens

    seen = []  # one seed per sample, as vLLM derives them

    class LLM:
        def generate(self, reqs, params, use_tqdm=False):
            outs = []
            for p in params:
                seen.extend(p.seed + j for j in range(p.n))
                outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[5] * p.max_tokens,
                                                                                 logprobs=None)] * p.n))
            return outs

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=SamplingParams))
    eng = object.__new__(rollout.VLLMRollout)
    eng.llm, eng.tp_group, eng.weights_lost, eng.asleep = LLM(), None, False, set()
    eng.eos_ids, eng.forbidden_ids, eng.model_type = [1], [], "qwen2_5_vl"
    cfg = grpo.Config(seed=1)
    prompt = {"raw_prompt_ids": [3, 4]}
    n, batch = 16, 16

    def seeds(positions):  # what grpo.generate_and_score passes
        return [(cfg.seed * 1_000_003 + pos) % 2**31 for pos in positions]

    for step in range(30):
        pos = list(range(step * batch, (step + 1) * batch))
        eng.generate([prompt] * batch, n, 1.0, 1.0, 4, seeds(pos))
    val = [-1 - j for j in range(200)]
    eng.generate([prompt] * 200, 1, 0.7, 1.0, 4, seeds(val))
    eng.generate([prompt] * 8, 8, 1.0, 1.0, 4, seeds(range(10_000, 10_008)), lengths=[[2] * 8] * 8)
    assert len(seen) == 30 * batch * n + 200 + 64
    assert len(set(seen)) == len(seen), f"{len(seen) - len(set(seen))} samples reuse another sample's seed"


def test_vllm_gets_each_pictures_key_made_once_a_call(monkeypatch):
    """vLLM hashes a request's pictures' bytes for its caches (processor, encoder, prefix); turn two's n trajectories
    each hold their prompt's picture, so it hashed that picture n times. _vllm_prompt gives multi_modal_uuids instead:
    a picture's key made once per call, equal for equal bytes, apart for other bytes, another size or palette."""
    eng = object.__new__(rollout.VLLMRollout)
    eng.model_type, eng.tp_group = "qwen2_5_vl", None
    hashed, blake2b = [], rollout.hashlib.blake2b
    monkeypatch.setattr(rollout.hashlib, "blake2b", lambda b: hashed.append(len(b)) or blake2b(b))
    blue, tool = Image.new("RGB", (8, 8), "blue"), Image.new("RGB", (8, 8), "red")
    pics = [[blue, tool], [blue, tool], [Image.new("RGB", (8, 8), "blue"), Image.new("RGB", (4, 16), "blue")],
            [Image.new("P", (8, 8)), Image.new("P", (8, 8), 1)]]
    items, _ = eng._items([{"raw_prompt_ids": [1, 2], "images": p} for p in pics], [1, 2, 3, 4])
    keys = [pr["multi_modal_uuids"]["image"] for pr, *_ in items]
    assert len(hashed) == 6  # blue, tool, the other blue, the 4 x 16 one and the palette pictures: once each
    assert keys[0] == keys[1] and keys[2][0] == keys[0][0] and len({keys[0][0], keys[0][1], keys[2][1]}) == 3
    red, green = Image.new("P", (8, 8)), Image.new("P", (8, 8))  # (a palette picture's bytes are indices)
    red.putpalette([255, 0, 0] * 256), green.putpalette([0, 255, 0] * 256)
    assert keys[3][0] != keys[3][1] and eng._image_key(red) != eng._image_key(green)
    eng._items([{"raw_prompt_ids": [1], "images": [blue]}], [1])
    assert len(hashed) == 9  # the next call makes its own keys (none kept from call to call)


def test_sleep_survives_another_process_allocating(monkeypatch):
    """vLLM's sleep asserts that the device's free memory grew, which another process on the GPU can break after the
    engine freed its memory (two matrix rows died of it at steps 42 and 135); the engine must then still count as
    asleep, so that wake() maps its weights back, while any other assertion still stops the run."""
    import types

    class Executor:
        is_sleeping, sleeping_tags = False, set()

    class LLM:
        def __init__(self, message):
            self.llm_engine = types.SimpleNamespace(model_executor=Executor())
            self.message, self.woken = message, []

        def reset_prefix_cache(self):
            pass

        def sleep(self, level):
            raise AssertionError(self.message)

        def wake_up(self, tags=None):
            self.woken.append(tags)

    eng = object.__new__(rollout.VLLMRollout)
    eng.sleep_mode, eng.sleep_level, eng.asleep, eng.weights_lost = True, 1, set(), False
    eng.llm = LLM("Memory usage increased after sleeping.")
    monkeypatch.setattr(rollout.torch.cuda, "empty_cache", lambda: None)
    eng.sleep()
    assert eng.asleep == {"weights", "kv_cache"} and eng.llm.llm_engine.model_executor.is_sleeping
    eng.wake()
    assert eng.llm.woken == [["weights", "kv_cache"]] and not eng.asleep
    eng.llm, eng.asleep = LLM("something else"), set()
    with pytest.raises(AssertionError):
        eng.sleep()


def test_vllm_asks_each_sampled_tokens_logprob_and_forced_lengths_keep_theirs(path, monkeypatch):
    """generate asks vLLM for the sampled token's log-prob only (logprobs=0, the dict container: FlatLogprobs measured
    slower, benchmarks/HISTORY.md); the benchmarks' forced lengths return one log-prob per forced token."""
    prompts = [{"raw_prompt_ids": [3, 4, 5]}, {"raw_prompt_ids": [6, 7]}]
    kw = dict(n=3, temperature=1.0, top_p=1.0, max_tokens=5, seeds=[11, 12])
    standin_vllm(monkeypatch)
    eng = rollout.make_rollout("vllm", path)
    out = eng.generate(prompts, **kw)
    sent = eng.llm.calls[-1]["params"]
    assert [p.flat_logprobs for p in sent] == [False] * 2 and all(p.logprobs == 0 for p in sent)
    forced = eng.generate(prompts, lengths=[[2, 5, 4], [5, 5, 1]], **kw)
    assert [[len(o["logprobs"]) for o in g] for g in forced] == [[2, 5, 4], [5, 5, 1]]
    lps = [o["logprobs"] for g in out for o in g]
    assert all(len(x) == 5 and all(-1 <= v <= 0 for v in x) for x in lps) and len({tuple(x) for x in lps}) == 6


def test_per_prompt_seeds_option_reaches_the_requests(path, monkeypatch):
    """--per-prompt-seeds (default on) gives each request rollout.request_seed of its prompt's seed; off, vLLM gets
    no seed (it draws its own): through grpo.Config, engine_options and make_rollout. The HF engine ignores it."""
    import grpo
    seen, _ = standin_vllm(monkeypatch)
    prompts = [{"raw_prompt_ids": [3, 4, 5]}, {"raw_prompt_ids": [6, 7]}]
    for on in (True, False):
        eng = rollout.make_rollout("vllm", path, **rollout.engine_options(grpo.Config(per_prompt_seeds=on)))
        assert "per_prompt_seeds" not in seen and eng.per_prompt_seeds is on
        eng.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=3, seeds=[7, 8])
        want = [rollout.request_seed(7), rollout.request_seed(8)] if on else [None, None]
        assert [p.seed for p in eng.llm.calls[-1]["params"]] == want
    assert isinstance(rollout.make_rollout("hf", path, device="cpu", dtype=torch.float32, per_prompt_seeds=False),
                      rollout.HFRollout)


def test_v1_runner_seeds_the_call_not_each_request(path, monkeypatch):
    """On vLLM's V1 runner (Qwen3.5, MoE models) a seeded request costs a kernel per sequence per decode step, so
    with --per-prompt-seeds the requests go unseeded and the call's seeds seed the sampler's one CUDA stream: the same
    seeds give the same stream (a resumed run repeats itself), other seeds another; off, nothing is seeded."""
    standin_vllm(monkeypatch)
    seeded = []
    monkeypatch.setattr(rollout.torch.cuda, "manual_seed", seeded.append)
    prompts = [{"raw_prompt_ids": [3, 4, 5]}, {"raw_prompt_ids": [6, 7]}]
    for on in (True, False):
        eng = rollout.make_rollout("vllm", path, per_prompt_seeds=on)
        eng.v1_runner = True
        for seeds in ([7, 8], [7, 8], [8, 7]):
            eng.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=3, seeds=seeds)
            assert [p.seed for p in eng.llm.calls[-1]["params"]] == [None, None]
        if on:
            assert len(seeded) == 3 and seeded[0] == seeded[1] != seeded[2]
    assert len(seeded) == 3


def test_unsent_counts_vllm_moe_expert_names():
    """After a level-2 sleep (or dummy weights) every engine parameter must be re-sent. vLLM's MoE runner reports its
    experts as `experts.w13_weight` while the parameter is `experts.routed_experts.w13_weight` (the 30B-A3B's first
    sync stopped on it); a parameter nobody sent is still reported."""
    params = [(n, None) for n in ("lm.layers.0.mlp.experts.routed_experts.w13_weight",
                                  "lm.layers.0.mlp.experts.routed_experts.w2_weight", "lm.layers.0.mlp.gate.weight")]
    loaded = ["lm.layers.0.mlp.experts.w13_weight", "lm.layers.0.mlp.experts.w2_weight", "lm.layers.0.mlp.gate.weight"]
    assert rollout.unsent(params, loaded) == []
    assert rollout.unsent(params, loaded[1:]) == ["lm.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert rollout.unsent(params, loaded[:2]) == ["lm.layers.0.mlp.gate.weight"]


def test_unsent_spares_gemma4s_kv_shared_k_norms_only():
    """A Gemma 4 checkpoint (and vLLM's model) has a k norm in its KV-shared layers, transformers' model has none, so
    a sync never sends them and the level-2 check stopped the H200's gemma4 row at its first sync; vLLM never computes
    with them (those layers read an earlier layer's keys). Exactly the folder's names the HF model lacks are spared."""
    import os

    import families
    from safetensors import safe_open
    from transformers import AutoConfig
    path = tiny_model.build_tiny_model(arch="gemma4")
    cfg = AutoConfig.from_pretrained(path)
    folder = [k for f in os.listdir(path) if f.endswith(".safetensors")
              for k in safe_open(os.path.join(path, f), "pt").keys()]
    hf = set(rollout.load_hf_model(path, torch.float32).state_dict())
    vllm_names = [(k.replace("model.language_model.", "language_model.model."), None) for k in folder]
    sent = [k.replace("model.language_model.", "language_model.model.") for k in folder if k in hf]
    lacking = rollout.unsent(vllm_names, sent)
    assert lacking and all(k.endswith("self_attn.k_norm.weight") for k in lacking)
    assert rollout.unsent(vllm_names, sent, families.engine_only(cfg)) == []
    assert rollout.unsent(vllm_names, sent[1:], families.engine_only(cfg)) == [sent[0]]  # a real one still counts


def test_engine_logprobs_for_one_prompt_in_k(path, monkeypatch):
    """--rollout-logprobs-every (auto: 8, or 1 with tis): vLLM is asked for log-probs (logprobs=0) on the training
    prompts at every K-th position only, the other samples carry none, validation and ReMax's greedy never ask; the
    agreement metric is then the mean over the samples that have them, and is left out of a step that has none."""
    import grpo
    import rundir
    standin_vllm(monkeypatch)
    eng = rollout.make_rollout("vllm", path)
    ctx = types.SimpleNamespace(rollout=eng, cfg=grpo.Config(max_response_length=3),
                                tokenizer=types.SimpleNamespace(batch_decode=lambda ids, **k: ["x"] * len(ids)),
                                reward_fn=lambda items: [{"overall": 0.0, "accuracy": 0.0} for _ in items])
    drawn = [(pos, {"raw_prompt_ids": [3, 4 + pos], "answer": "a", "prompt_text": "p"}) for pos in range(16, 32)]

    def asked(**kw):
        samples = grpo.generate_and_score(ctx, drawn, 2, 1.0, **kw)
        sent = [p.logprobs for p in eng.llm.calls[-1]["params"]]
        return sent, [s["rollout_logp"] is not None for s in samples]

    # a chosen prompt's first sample only: its request split in two, seeded so that every sample stays the same
    assert asked() == ([x for p in range(16, 32) for x in ([0, None] if p % 8 == 0 else [None])],
                       [p % 8 == 0 and j == 0 for p in range(16, 32) for j in range(2)])
    assert asked(logprobs=False) == ([None] * 16, [False] * 32)
    kw = dict(n=4, temperature=1.0, top_p=1.0, max_tokens=5, seeds=[11, 12])
    whole = eng.generate(drawn[0][1:] + drawn[1][1:], **kw)
    for want in ([1, 0], [3, 4], [0, 2]):
        got = eng.generate(drawn[0][1:] + drawn[1][1:], logprobs=want, **kw)
        assert [[o["response_ids"] for o in g] for g in got] == [[o["response_ids"] for o in g] for g in whole]
        assert [[o["logprobs"] is not None for o in g] for g in got] == [[j < k for j in range(4)] for k in want]
        assert [o["logprobs"] for g, k in zip(got, want) for o in g[:k]] == \
            [o["logprobs"] for g, k in zip(whole, want) for o in g[:k]]
    every = types.SimpleNamespace(generate=lambda prompts, n, **k: [[dict(response_ids=[5], finished=True,
                                                                            logprobs=[-0.1])] * n for _ in prompts])
    hf_like = grpo.generate_and_score(types.SimpleNamespace(**dict(vars(ctx), rollout=every)), drawn, 2, 1.0)
    assert [s["rollout_logp"] is not None for s in hf_like] == [p % 8 == 0 and j == 0 for p in range(16, 32)
                                                                 for j in range(2)]  # an engine that gives them all
    sent = eng.llm.calls[-1]["params"]  # [0, 2]: the first prompt's 4 samples, the second's 2 + 2
    assert [(p.n, p.seed, p.logprobs) for p in sent] == [
        (4, rollout.request_seed(11), None), (2, rollout.request_seed(12), 0), (2, rollout.request_seed(12) + 2, None)]
    ctx.cfg = grpo.Config(max_response_length=3, rollout_correction="tis")
    assert asked() == ([0] * 16, [True] * 32)
    # the metric: |trainer - engine| over the tokens of the samples that have the engine's log-probs
    ctx.cfg = grpo.Config(kl_coef=0.0)
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-3.0, -3.0]])  # [b, R]
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    mb = [dict(adv=1.0, rollout_logp=[-1.5, -2.0]), dict(adv=0.0, rollout_logp=None),
          dict(adv=-1.0, rollout_logp=[-3.0, -2.0])]
    log = rundir.MetricSums()
    grpo.micro_batch_loss(ctx.cfg, logp, 0 * logp, mask, mb, {}, log, first_pass=True)
    out = log.reduce(torch.device("cpu"), 1)
    assert out["rollout/logprob_diff_mean"] == pytest.approx((0.5 + 0 + 0 + 1.0) / 4)
    assert out["rollout/logprob_diff_max"] == 1.0 and out["rollout/logprob_tokens"] == 4
    log = rundir.MetricSums()  # none of them: 0 of 0 tokens, logged so that every rank reduces the same keys
    grpo.micro_batch_loss(ctx.cfg, logp, 0 * logp, mask, [dict(s, rollout_logp=None) for s in mb], {}, log, True)
    assert log.reduce(torch.device("cpu"), 1)["rollout/logprob_tokens"] == 0


def test_tis_needs_every_samples_engine_logprobs(tmp_path):
    """The option checks refuse --rollout-correction tis with --rollout-logprobs-every K > 1 (it weights every sample
    by the engine's log-probs), and a negative K: one line before anything loads."""
    import easyr1_config
    from common import UserError
    from config import Config
    for kw in (dict(rollout_correction="tis", rollout_logprobs_every=8), dict(rollout_logprobs_every=-1)):
        with pytest.raises(UserError, match="--rollout-logprobs-every"):
            easyr1_config.check(Config(output_dir=str(tmp_path), **kw), 1)
    for k in (0, 1):
        easyr1_config.check(Config(output_dir=str(tmp_path), rollout_correction="tis", rollout_logprobs_every=k), 1)


def test_vllm_generate_runs_with_the_collector_paused(path, monkeypatch):
    """VLLMRollout.generate turns Python's cyclic collector off for vLLM's engine loop and the reading of its
    outputs (a full collection walks the trainer's whole heap: benchmarks/HISTORY.md) and back on after, also
    when the engine raises; a caller that had it off keeps it off."""
    standin_vllm(monkeypatch)
    eng = rollout.make_rollout("vllm", path)
    seen, generate = [], eng.llm.generate
    eng.llm.generate = lambda *a, **k: seen.append(gc.isenabled()) or generate(*a, **k)
    prompts = [{"raw_prompt_ids": [3, 4, 5]}]
    assert gc.isenabled()
    eng.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=3, seeds=[1])
    assert seen == [False] and gc.isenabled()

    def boom(*a, **k):
        seen.append(gc.isenabled())
        raise RuntimeError("engine died")
    eng.llm.generate = boom
    with pytest.raises(RuntimeError, match="engine died"):
        eng.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=3, seeds=[1])
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        eng.llm.generate = generate
        eng.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=3, seeds=[1])
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_vllm_without_enqueue_queues_nothing_ahead_and_generate_takes_the_requests_in(path, monkeypatch):
    """LLM.enqueue is newer than some vLLMs the code guards for: there submit queues nothing (returns False, no
    error) and the generate call takes its requests in itself."""
    standin_vllm(monkeypatch)
    eng = rollout.make_rollout("vllm", path)
    prompts = [{"raw_prompt_ids": [3 + i, 4, 5]} for i in range(3)]
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=4, seeds=[11, 12, 13])
    whole = eng.generate(prompts, **kw)
    monkeypatch.delattr(type(eng.llm), "enqueue")
    assert not eng.submit(prompts, **kw) and eng.queued is None
    assert eng.generate(prompts, **kw) == whole and eng.llm.events[-1] == "generate"


def test_requests_queued_ahead_are_the_ones_generate_runs(path, monkeypatch):
    """VLLMRollout.submit hands vLLM a later generate call's requests ahead (its intake: grpo's prefetch thread does
    it while the trainer updates). The generate with the same arguments runs them, with no second intake, and returns
    what it would have made itself; any other call (validation's, or equal copies of the prompts) first drops them
    (vLLM would otherwise run them with its own); a sleep drops them (vLLM's aborts what it holds); with tensor
    parallelism nothing is queued (_items' gather is a collective of the main thread)."""
    standin_vllm(monkeypatch)
    eng = rollout.make_rollout("vllm", path)
    prompts = [{"raw_prompt_ids": [3, 4, 5]}, {"raw_prompt_ids": [6, 7]}]
    kw = dict(n=3, temperature=1.0, top_p=1.0, max_tokens=4, seeds=[11, 12], logprobs=[1, 0])
    plain = eng.generate(prompts, **kw)
    ev = eng.llm.events
    assert eng.submit(prompts, **kw) and ev[-1] == "enqueue"
    n_calls = len(eng.llm.calls)
    assert eng.generate(prompts, **kw) == plain
    assert ev[-2:] == ["enqueue", "wait"] and len(eng.llm.calls) == n_calls and eng.queued is None
    one = dict(kw, seeds=[11], logprobs=[1])
    first = eng.generate(prompts[:1], **one)
    for queued, asked, asked_kw, want in (([dict(p) for p in prompts], prompts, kw, plain),  # equal copies
                                          (prompts, prompts[:1], one, first)):  # another call (validation's)
        assert eng.submit(queued, **kw)
        assert eng.generate(asked, **asked_kw) == want  # and not the queued ones too
        assert ev[-3:] == ["enqueue", "abort", "generate"] and not eng.llm.queue
        assert len(eng.llm.ran[-1]) == len(eng.llm.calls[-1]["params"])  # the call's requests ran, nothing else
    eng.submit(prompts, **kw)
    eng.sleep()
    assert eng.queued is None and not eng.llm.queue
    assert eng.generate(prompts, **kw) == plain and ev[-1] == "generate"
    eng.tp_group = object()
    assert not eng.submit(prompts, **kw) and ev[-1] == "generate"


def test_vllm_inputs_are_composed_from_each_pictures_own(monkeypatch):
    """VLLMRollout._add: a Qwen-VL request's input is its ids with each pad replaced by its picture's input (vLLM's
    renderer on the pad alone, once a call; the last call's kept: turn two finds turn one's pictures). Requests it
    cannot compose go to vLLM's renderer whole; where the call's first composed input is not vLLM's own, all do."""
    import dataclasses
    import warnings

    @dataclasses.dataclass
    class Range:  # vLLM's PlaceholderRange
        offset: int
        length: int

    pad, rendered, added = 9, [], []

    def render(p, wider=0, names=None):  # vLLM's processor: each pad -> one per 4 pixels of its picture's width
        ids, keys, out, ranges = p["prompt_token_ids"], (p.get("multi_modal_uuids") or {}).get("image", []), [], []
        keys = keys if names is None else [f"request {next(names)}" for _ in keys]  # (both caches off: its own)
        widths = iter([im.width // 4 + wider for im in (p.get("multi_modal_data") or {}).get("image", [])])
        for t in ids:
            if t == pad:
                ranges.append(Range(len(out), next(widths)))
            out += [t] * (ranges[-1].length if t == pad else 1)
        return {"type": "multimodal", "prompt_token_ids": out, "mm_hashes": {"image": list(keys)},
                "mm_placeholders": {"image": ranges}, "mm_kwargs": {"image": [f"item {k}" for k in keys]}}

    class Renderer:
        wider, names = 0, None

        def render_cmpl(self, prompts):
            rendered.extend(len(p["prompt_token_ids"]) for p in prompts)
            return [render(p, self.wider if len(p["prompt_token_ids"]) > 1 else 0, self.names) for p in prompts]

    inputs = types.SimpleNamespace(MultiModalKwargsItems=dict)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(multimodal=types.SimpleNamespace(inputs=inputs)))
    monkeypatch.setitem(sys.modules, "vllm.multimodal", types.SimpleNamespace(inputs=inputs))
    monkeypatch.setitem(sys.modules, "vllm.multimodal.inputs", inputs)
    eng = object.__new__(rollout.VLLMRollout)
    eng.llm = types.SimpleNamespace(renderer=Renderer(), _render_and_add_requests=lambda prompts, params: (
        added.extend(prompts) or [str(i) for i in range(len(prompts))]))
    eng.pad, eng.limit, eng.pieces, eng.model_type, eng.version = pad, 2, {}, "qwen2_5_vl", "stand-in"
    blue, tool, tool2 = Image.new("RGB", (8, 8), "blue"), Image.new("RGB", (12, 8), "red"), Image.new("RGB", (4, 8))

    def req(ids, pics):
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": pics},
                "multi_modal_uuids": {"image": [eng._image_key(p) for p in pics]}}

    eng.keys = {}
    reqs = [req([1, pad, 2, 3, pad, 4], [blue, tool]), req([1, pad, 5, 6, 7, pad], [blue, tool]),
            {"prompt_token_ids": [1, 2]}, req([pad, pad, pad], [blue, tool, tool2]), req([1, pad], [tool2])]
    assert eng._add(reqs, None) == ["0", "1", "2", "3", "4"]
    assert added == [render(r) for r in reqs]
    assert rendered == [1, 1, 1, 6, 2, 3]  # blue, tool, tool2: once; the check of the first; text, 3 pictures > 2
    rendered.clear(), added.clear()
    eng._add([req([pad, 8, pad], [blue, tool2])], None)
    assert added == [render(req([pad, 8, pad], [blue, tool2]))] and rendered == [3]  # the last call's pictures kept
    rendered.clear(), added.clear()
    eng.llm.renderer.names, eng.pieces = iter(range(100)), {}  # a vLLM naming each request's items (no pieces kept):
    # the composed inputs carry the pieces' names, one a picture
    eng._add([req([pad, 8, pad], [tool, blue]), req([pad, pad], [tool, tool])], None)
    assert [a["mm_hashes"]["image"] for a in added] == [["request 0", "request 1"], ["request 0", "request 0"]]
    assert eng.pad is not None and added[0]["prompt_token_ids"] == [pad] * 3 + [8] + [pad] * 2  # (12, 8 wide)
    rendered.clear(), added.clear()
    eng.llm.renderer.names, eng.llm.renderer.wider = None, 1  # a vLLM that expands a picture in a prompt unlike alone
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng._add(reqs[:2], None)
    assert "unlike VLLMRollout._compose" in str(w[-1].message) and eng.pad is None
    assert added == [render(r, 1) for r in reqs[:2]] and rendered == [6, 6, 6]  # (both pictures kept) the check, both
