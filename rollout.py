"""Rollout engines: sample n responses per prompt with the current policy weights. One interface: generate(prompts,
n, temperature, top_p, max_tokens, seeds) -> per prompt, n dicts {"response_ids", "finished" (stopped by EOS),
"logprobs" (or None)}; sync_weights(iterable of (HF name, tensor)); sleep() / wake() around the trainer's phases.
HFRollout: transformers' generate on its own copy (CPU tests); VLLMRollout: vLLM colocated, SPMD under torchrun.
Log-probs in both: each sampled token's under the *processed* distribution it was drawn from (pads forbidden,
logits / T, top-p renormalised: vLLM's "processed_logprobs"); at top_p 1, the trainer's log_softmax(logits / T)."""
import dataclasses
from dataclasses import asdict
import hashlib
import importlib.util
import os
import warnings

import torch
import torch.distributed as dist
from PIL import Image
from transformers import (AutoConfig, GenerationConfig, LogitsProcessorList,
                          SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper)

import memory
import presets
from common import UserError, collector_paused
from families import QWEN_VL, engine_only, special_token_ids, vllm_overrides  # noqa: F401 (rollout.special_token_ids)
from fsdp_actor import load_hf_model, mm_token_types  # the same loading and M-RoPE inputs as the trainer
from tiny_moe import per_expert


# ------------------------------------------------------------------------------------------------ shared helpers
# vLLM seeds a request's j-th sample `seed + j`: the consecutive per-prompt seeds passed on as they were gave prompts
# pos and pos + 1 n - 1 noise streams in common (the Qwen3-VL demo never said "white": 0.755), hence request_seed(s).
SEED_STRIDE = 2**16  # more samples per prompt than any run asks for: the prompts' seed ranges never overlap


def _call_key(prompts, n, temperature, top_p, max_tokens, seeds, lengths, logprobs):
    """What makes two generate calls the same (the prompt records by identity: the drawn ones, not equal copies)."""
    return (tuple(map(id, prompts)), n, temperature, top_p, max_tokens, tuple(seeds), repr(lengths), repr(logprobs))


# What VLLMRollout._compose must make as vLLM would. Not the items' names: the pieces' (vLLM's keys, or with both its
# caches off, as Qwen3.5's no prefix caching, one name a picture where vLLM names each request's: encoded once)
_COMPOSED = ("prompt_token_ids", "mm_placeholders")


def request_seed(prompt_seed):
    return prompt_seed * SEED_STRIDE


def _to_result(ids, logprobs, eos):
    """Cut after the first EOS (kept): the result dict above; `finished` = stopped by EOS, the same test in both
    engines (vLLM's finish_reason would also say "stop" for stop strings, which we never set)."""
    ids = list(ids)
    cut = next((i + 1 for i, t in enumerate(ids) if t in eos), None)
    if cut is not None:
        ids = ids[:cut]
        logprobs = logprobs[:cut] if logprobs is not None else None
    return {"response_ids": ids, "finished": cut is not None, "logprobs": logprobs}


def _forced(ids, logprobs, max_tokens):
    """A forced-length response (benchmarks): generated with EOS ignored, so it is never cut; it counts as finished
    unless it reached max_tokens (the share of truncated responses is then the workload's, not the model's)."""
    return {"response_ids": list(ids), "finished": len(ids) < max_tokens, "logprobs": logprobs}


def unsent(named_params, loaded, unused=()):
    """The engine's parameters load_weights did not report loaded (names ending as `unused`: families.engine_only,
    aside). vLLM's MoE runner reports its experts without `routed_experts.` (fused_moe/runner): either name counts."""
    loaded = set(loaded)
    return sorted(n for n, _ in named_params if n not in loaded and n.replace(".routed_experts.", ".") not in loaded
                  and not n.endswith(unused))


# ------------------------------------------------------------------------------------------------ HF engine
class _SampledLogprobs:
    """Last logits processor: sees the scores HF samples from (after suppression, temperature, top-p). Step t's
    token appears in input_ids at t+1: each call gathers the previous step's log-prob, keeping one [rows, V]."""

    def __init__(self):
        self.prev, self.out = None, []

    def __call__(self, input_ids, scores):  # input_ids [rows, L], scores [rows, V]
        if self.prev is not None:
            self.out.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))  # [rows]
        self.prev = torch.log_softmax(scores.float(), dim=-1)  # [rows, V]
        return scores

    def finish(self, last_tokens):  # [rows] -> [rows, T]
        self.out.append(self.prev.gather(1, last_tokens[:, None]).squeeze(1))
        return torch.stack(self.out, dim=1)


class HFRollout:
    """transformers `generate` on an own unsharded copy of the policy, a prompt at a time (its n copies batched)
    under torch.manual_seed(seeds[i]) in fork_rng: samples depend on (weights, prompt, seed) only."""

    def __init__(self, model_path, device=None, dtype=torch.float32):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_hf_model(model_path, dtype).to(self.device).eval()
        self.dtype = dtype
        self.eos_ids, self.forbidden_ids = special_token_ids(model_path)
        # a clean generation config: a checkpoint's (Qwen-VL: top_k=1, top_p=0.001) would set every knob left unset
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0])
        # name -> tensor sharing storage with the model: sync_weights copies into these in place
        self._params = self.model.state_dict()
        # a folder without weights: placeholders (vLLM's load_format="dummy") until a sync sends every weight
        self.weights_lost = presets.random_init(model_path) is not None
        if self.weights_lost:
            g = torch.Generator(self.device).manual_seed(1234)
            for prm in self.model.parameters():
                prm.data.uniform_(-1e-3, 1e-3, generator=g)

    @torch.no_grad()
    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, lengths=None, logprobs=None):
        """lengths (benchmarks): per prompt, n forced response lengths, EOS ignored (_forced). logprobs: all, always."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        lengths = lengths or [None] * len(prompts)
        return [self._generate_one(p, n, temperature, top_p, max_tokens, s, L)
                for p, s, L in zip(prompts, seeds, lengths)]

    def _generate_one(self, prompt, n, temperature, top_p, max_tokens, seed, lengths=None):
        greedy = temperature == 0
        rows = 1 if greedy else n  # greedy samples are identical: compute one and copy it
        ids = torch.tensor([prompt["prompt_ids"]] * rows, device=self.device)  # [rows, Lp]
        # Qwen-VL packs a batch's patches along dim 0 (pixel_values [P, D]): n copies of each tensor, concatenated
        mm = {}
        for k, v in (prompt.get("mm_inputs") or {}).items():
            v = torch.cat([v] * rows).to(self.device)
            mm[k] = v.to(self.dtype) if v.is_floating_point() else v
        # Our own processors, in vLLM's order (ban -> temperature -> top-p), with the recorder last. HF would put
        # its own warpers *after* any custom processor, so they are all switched off in the generate() call below.
        procs = LogitsProcessorList()
        if self.forbidden_ids:
            procs.append(SuppressTokensLogitsProcessor(self.forbidden_ids, device=self.device))
        if not greedy and temperature != 1.0:
            procs.append(TemperatureLogitsWarper(temperature))
        if not greedy and top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p))
        rec = _SampledLogprobs()
        procs.append(rec)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            seqs = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **mm,
                                       **mm_token_types(self.model, ids, mm),
                                       do_sample=not greedy, temperature=1.0, top_p=1.0, top_k=0,
                                       max_new_tokens=max(lengths) if lengths else max_tokens,
                                       logits_processor=procs, pad_token_id=self.eos_ids[0],
                                       eos_token_id=None if lengths else self.eos_ids)  # None: never stop
        gen = seqs[:, ids.shape[1]:]  # [rows, T]
        logp = rec.finish(gen[:, -1])  # [rows, T]
        if lengths:
            return [_forced(g[:L].tolist(), lp[:L].tolist(), max_tokens) for g, lp, L in zip(gen, logp, lengths)]
        out = [_to_result(g.tolist(), lp.tolist(), self.eos_ids) for g, lp in zip(gen, logp)]
        return [dict(out[0]) for _ in range(n)] if greedy else out

    @torch.no_grad()
    def sync_weights(self, named_tensors):
        """Copy streamed (HF state_dict name, full tensor) pairs into the model, one tensor at a time."""
        seen = set()
        for name, t in named_tensors:
            dst = self._params.get(name)
            if dst is None:
                raise KeyError(f"sync_weights: {name!r} is not a parameter of {type(self.model).__name__}")
            if dst.shape != t.shape:  # copy_ would silently broadcast a wrong shape
                raise ValueError(f"sync_weights: {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(t)
            seen.add(name)
        missing = [n for n, _ in self.model.named_parameters() if n not in seen] if self.weights_lost else []
        if missing:  # (named_parameters: a tied weight once, under the name state_dict gives it first)
            raise RuntimeError(f"the engine started without weights and these were not sent: {missing[:5]}...")
        self.weights_lost = False

    def pool_bytes(self):  # the HF engine's weights are ordinary allocations: the trainer's peaks include them
        return 0

    def sleep(self, tags=None):  # the HF engine keeps its weights: nothing to free, nothing to map again
        pass

    wake = sleep


# ------------------------------------------------------------------------------------------------ vLLM engine
def _set_vllm_env():
    """Must run before `import vllm` (some settings are read at import or engine creation)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: sync_weights reaches the nn.Module
    # vLLM 0.26 builds FlashInfer's sampler by default (not installed here); processed log-probs and seeds skip it
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def _init_world_for_external_dp():
    """Data-parallel rollout under torchrun (vLLM's "ExternalDP"): the process group must span all ranks before LLM()
    is built (else vLLM's worker makes a world of TP x PP ranks); vLLM then carves TP groups of consecutive ranks,
    the rest independent replicas (as TRL, veRL, EasyR1)."""
    if dist.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cuda:nccl,cpu:gloo")  # gloo too: object collectives and vLLM's CPU groups


def _hashable(d):
    """vLLM keeps its HF processors in an lru_cache keyed by the processor keywords: a plain dict inside a keyword's
    list would not hash (vLLM wraps only the outer list and dicts)."""
    try:
        from vllm.transformers_utils.processor import HashableDict  # optional: the GPU engine
    except ImportError:  # another vLLM layout: the keywords then go as they are
        return d
    return HashableDict(d)


class VLLMRollout:
    """vLLM colocated with the trainer. Under torchrun every rank builds its own LLM (external_launcher): TP groups of
    consecutive ranks, WORLD_SIZE / TP independent replicas; a TP group's ranks call generate() together.
    sleep_level: 1 offloads the weights to the host while asleep; 2 discards them, valid only if sync_weights() runs
    between every sleep() and the next generate() (generate() raises otherwise)."""

    def __init__(self, model_path, tensor_parallel_size=1, gpu_memory_utilization=0.6, max_model_len=None,
                 max_num_batched_tokens=None, limit_mm_per_prompt=None, enable_sleep_mode=True, seed=0,
                 dtype="bfloat16", enforce_eager=False, sleep_level=1, hybrid_max_seqs=1024, **engine_kwargs):
        _set_vllm_env()
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("VLLMRollout needs the in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        import vllm  # optional: the GPU engine; imported after _set_vllm_env, which it reads
        from vllm import LLM  # (likewise)
        from vllm.engine.arg_utils import EngineArgs  # (likewise)
        self.version = vllm.__version__
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.tp = tensor_parallel_size
        if world % self.tp:
            raise ValueError(f"WORLD_SIZE={world} is not a multiple of tensor_parallel_size={self.tp}")
        self.eos_ids, self.forbidden_ids = special_token_ids(model_path)
        dtype = str(dtype).removeprefix("torch.")  # (torch.bfloat16 or "bfloat16")
        kw = dict(model=model_path, tensor_parallel_size=self.tp, dtype=dtype,
                  gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                  max_num_batched_tokens=max_num_batched_tokens, enable_sleep_mode=enable_sleep_mode, seed=seed,
                  enforce_eager=enforce_eager, logprobs_mode="processed_logprobs", disable_log_stats=True)
        hf_config = AutoConfig.from_pretrained(model_path)
        self.model_type = hf_config.model_type
        kw["hf_overrides"] = vllm_overrides(hf_config)  # Gemma 4's full-attention heads under vLLM's names ({} else)
        self.unused_params = engine_only(hf_config)
        if self.model_type not in QWEN_VL:  # min/max_pixels: Qwen-VL's image budget (other families: their own)
            engine_kwargs.pop("mm_processor_kwargs", None)
        if hasattr(hf_config, "vision_config"):  # text-only models reject these
            kw["limit_mm_per_prompt"] = limit_mm_per_prompt or {"image": 1, "video": 0}
            # Composed Qwen-VL inputs (_add; vLLM 0.26 run): no processor cache, its sender and engine halves must see
            # the same items. Videos neither: a Qwen2(.5)-VL prompt's video_metadata covers all, vLLM caches one by one
            composes = self.model_type in QWEN_VL and hasattr(LLM, "_render_and_add_requests")
            self.pad = getattr(hf_config, "image_token_id", None) if composes else None
            self.limit = kw["limit_mm_per_prompt"].get("image", 0)
            if kw["limit_mm_per_prompt"].get("video") or self.pad is not None:
                kw["mm_processor_cache_gb"] = 0
        else:
            engine_kwargs.pop("mm_processor_kwargs", None)
        if world > 1 or dist.is_initialized():  # SPMD whenever a trainer set up torch.distributed, even 1 rank
            _init_world_for_external_dp()
            kw["distributed_executor_backend"] = "external_launcher"
        text_cfg = hf_config.get_text_config()
        if "linear_attention" in (getattr(text_cfg, "layer_types", None) or []):  # Qwen3.5's Gated DeltaNet layers
            kw["max_num_seqs"] = min(hybrid_max_seqs, 1024)  # a state block a sequence: 1024 outran 578 (35B-A3B)
            if not importlib.util.find_spec("flashinfer"):  # vLLM 0.26's GDN prefill on Hopper: FlashInfer's kernel
                kw["additional_config"] = {"gdn_prefill_backend": "triton"}
        kw.update(engine_kwargs)
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        dropped = [k for k in kw if k not in known]
        if "logprobs_mode" in dropped:  # (without it the log-probs would be the raw model's, not the sampler's)
            raise UserError(f"vLLM {self.version} is older than 0.10.1 (no logprobs_mode): install vllm >= 0.10.1")
        if dropped:  # (a newer vLLM's)
            warnings.warn(f"vLLM {self.version} does not know {dropped}; ignoring them")
        self.llm = LLM(**{k: v for k, v in kw.items() if k in known})
        # V1's sampler draws a seeded request's noise in a Python loop: a kernel per sequence per step (_requests)
        self.v1_runner = not getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", False)
        self.sleep_mode, self.sleep_level = enable_sleep_mode, sleep_level
        # load_format="dummy" (make_rollout, for a folder without weights): placeholders until the first full sync
        self.asleep, self.weights_lost = set(), kw.get("load_format") == "dummy"
        # A gloo group per TP group (same consecutive-rank layout as vLLM's TP groups) to gather prompt records.
        self.tp_group = None
        if self.tp > 1:
            self.tp_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(r, r + self.tp)) for r in range(0, world, self.tp)], backend="gloo")

    # ---- generation
    per_prompt_seeds, v1_runner, unused_params, keys = True, False, (), {}  # (make_rollout, __init__, _items set them)
    pad, limit, pieces = None, 0, {}  # (__init__, _add)

    def _sampling_params(self, rows, temperature, top_p, max_tokens, seed, forced=False, logprobs=True, ban=True):
        """seed: the request's own (None: vLLM draws one); vLLM seeds its j-th of `rows` samples `seed + j` (hence
        request_seed). logprobs: the sampled token's (processed; FlatLogprobs measured slower); ban: pad tokens."""
        from vllm import SamplingParams  # optional: the GPU engine
        greedy = temperature == 0
        # logit_bias is clamped to [-100, 100] by vLLM: -100 is probability ~e-44, i.e. forbidden
        bias = {i: -100.0 for i in self.forbidden_ids} if ban and self.forbidden_ids else None
        # forced (benchmarks): exactly max_tokens tokens, EOS sampled like any token but never a stop
        stop = dict(ignore_eos=True) if forced else dict(stop_token_ids=list(self.eos_ids))
        lp = dict(logprobs=0) if logprobs else {}
        return SamplingParams(n=rows, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                              max_tokens=max_tokens, seed=seed, logit_bias=bias, detokenize=False, **lp, **stop)

    def _vllm_prompt(self, p):
        """One <|image_pad|> per image and <|video_pad|> per video (vLLM's processor expands them). Videos go as the
        trainer's frames with their frame rate: Qwen3-VL's parser takes (frames, metadata) pairs; Qwen2(.5)-VL's
        processor gets video_metadata (else it assumes 24 fps: other M-RoPE time positions than ours)."""
        out = {"prompt_token_ids": list(p["raw_prompt_ids"])}
        mm = {}
        if p.get("images"):
            mm["image"] = list(p["images"])
            out["multi_modal_uuids"] = {"image": [self._image_key(im) for im in mm["image"]]}
        if p.get("videos"):
            meta = [{"total_num_frames": len(v), "fps": f} for v, f in zip(p["videos"], p["video_fps"])]
            if self.model_type in ("qwen3_vl", "qwen3_vl_moe"):
                mm["video"] = [(v, {**m, "frames_indices": list(range(len(v))), "duration": len(v) / m["fps"],
                                    "do_sample_frames": False}) for v, m in zip(p["videos"], meta)]
            else:
                mm["video"] = list(p["videos"])
                out["mm_processor_kwargs"] = {"video_metadata": [_hashable(m) for m in meta]}
        if mm:
            out["multi_modal_data"] = mm
        return out

    def _image_key(self, img):
        """vLLM's key of a picture (multi_modal_uuids), hashed once per call where vLLM hashes it for each request that
        holds it (turn two's n trajectories hold their prompt's picture; a palette's colours with its bytes)."""
        if isinstance(img, Image.Image) and id(img) not in self.keys:  # (kept: its id stays)
            data = img.tobytes() + (img.palette.tobytes() if img.palette else b"")
            self.keys[id(img)] = (img, f"{img.mode}{img.size}" + hashlib.blake2b(data).hexdigest()[:32])
        return self.keys.get(id(img), (None, None))[1]

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, lengths=None, logprobs=None):
        """lengths (benchmarks): per prompt, n forced response lengths (each sample its own request, EOS ignored).
        logprobs: per prompt, how many of its samples return log-probs (True/None all). submit()'s requests are run."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if self.weights_lost:
            raise RuntimeError("sleep(level=2) discarded the weights: call sync_weights() before generate()")
        self.wake()
        queued, self.queued = self.queued, None
        if queued and queued[0] != _call_key(prompts, n, temperature, top_p, max_tokens, seeds, lengths, logprobs):
            self.llm.llm_engine.abort_request(queued[1], internal=True)  # another call first (validation): not these
            queued = None
        with collector_paused():
            if queued:
                _, ids, items, mine, per_item = queued
            else:
                items, mine = self._items(prompts, seeds, lengths, logprobs)
                reqs, params, per_item = self._requests(items, n, temperature, top_p, max_tokens)
            if self.per_prompt_seeds and self.v1_runner:  # unseeded requests (_requests): the call's seeds seed the
                torch.cuda.manual_seed(hash(tuple(s for _, s, _, _ in items)))  # sampler's stream (same on resume)
            added = not queued and self.pad is not None and self._add(reqs, params)  # (composed inputs: queued)
            outs = (self.llm.wait_for_completion(use_tqdm=False) if queued or added
                    else self.llm.generate(reqs, params, use_tqdm=False))
            # (enqueue gives vLLM's internal ids, "<id>-<8 random characters>"; the outputs carry <id>)
            if queued and (len(outs) != len(ids) or any(i != o.request_id and not i.startswith(f"{o.request_id}-")
                                                         for i, o in zip(ids, outs))):
                raise RuntimeError(f"vLLM returned {len(outs)} requests, not the {len(ids)} queued")
            return self._results(outs, items, per_item, mine, n, temperature, top_p, max_tokens)

    queued = None  # submit()'s requests: (call key, request ids, items, mine, requests per item)

    def submit(self, prompts, n, temperature, top_p, max_tokens, seeds, lengths=None, logprobs=None):
        """vLLM's intake of a later generate call's requests, now: input processing (the HF processor on its images)
        and into its queue, on prefetch_prompts' thread while the trainer computes (the scheduler paused until the
        wake). Not with tensor parallelism (gathering the group's prompts is the main thread's). -> whether queued."""
        if self.tp_group is not None or not hasattr(self.llm, "enqueue"):
            return False
        if self.queued:
            self.llm.llm_engine.abort_request(self.queued[1], internal=True)
        items, mine = self._items(prompts, seeds, lengths, logprobs)
        reqs, params, per_item = self._requests(items, n, temperature, top_p, max_tokens)
        key = _call_key(prompts, n, temperature, top_p, max_tokens, seeds, lengths, logprobs)
        self.queued = (key, self._add(reqs, params), items, mine, per_item)
        return True

    def _add(self, reqs, params):
        """Into vLLM's queue -> its request ids. Qwen-VL prompts go composed: vLLM processes each picture once, on
        its pad alone, and a prompt is its ids with each pad replaced by its picture's (vLLM's own processing: ~5 ms a
        request, 2.4-4.2 s before turn two of 512 trajectories). The call's first is checked against vLLM's own."""
        if self.pad is None:
            return list(self.llm.enqueue(reqs, params, use_tqdm=False))
        old, self.pieces = self.pieces, {}  # (the pictures of this call and the last: turn two finds turn one's)
        made = [self._compose(r, old) for r in reqs]
        first = next((i for i, m in enumerate(made) if m is not None), None)
        if first is not None:
            want = self.llm.renderer.render_cmpl([reqs[first]])[0]
            if [want[k] for k in _COMPOSED] != [made[first][k] for k in _COMPOSED]:
                warnings.warn(f"vLLM {self.version} expands {self.model_type}'s pictures unlike VLLMRollout._compose: "
                              "its own processing from here (slower: ~5 ms a request)")
                self.pad, made = None, [None] * len(made)
        rest = [r for r, m in zip(reqs, made) if m is None]
        own = iter(self.llm.renderer.render_cmpl(rest) if rest else [])
        return list(self.llm._render_and_add_requests(prompts=[m or next(own) for m in made], params=params))

    def _compose(self, req, old):
        """A request's processed input from its pictures' (None: one for vLLM's processor: no pictures, videos,
        pictures without keys, or other than one pad each)."""
        from vllm.multimodal.inputs import MultiModalKwargsItems  # optional: the GPU engine
        ids, keys = req["prompt_token_ids"], req.get("multi_modal_uuids", {}).get("image", [None])
        if (set(req.get("multi_modal_data", {})) != {"image"} or None in keys or len(keys) > self.limit
                or ids.count(self.pad) != len(keys)):
            return None
        out, items, hashes, ranges, at = [], [], [], [], 0
        for im, k in zip(req["multi_modal_data"]["image"], keys):
            if k not in self.pieces:
                self.pieces[k] = old.get(k) or self.llm.renderer.render_cmpl([{
                    "prompt_token_ids": [self.pad], "multi_modal_data": {"image": [im]},
                    "multi_modal_uuids": {"image": [k]}}])[0]
            piece, j = self.pieces[k], ids.index(self.pad, at)
            out += ids[at:j]
            ranges += [dataclasses.replace(r, offset=r.offset + len(out)) for r in piece["mm_placeholders"]["image"]]
            items, hashes = items + piece["mm_kwargs"]["image"], hashes + piece["mm_hashes"]["image"]
            out += piece["prompt_token_ids"]
            at = j + 1
        return {"type": "multimodal", "prompt_token_ids": out + ids[at:], "mm_hashes": {"image": hashes},
                "mm_kwargs": MultiModalKwargsItems({"image": items}), "mm_placeholders": {"image": ranges}}

    def _items(self, prompts, seeds, lengths=None, logprobs=None):
        """(vLLM prompt, seed, lengths, samples with log-probs) of the TP group's prompts; this rank's slice of them."""
        self.keys = {}
        mine = list(zip(map(self._vllm_prompt, prompts), seeds, lengths or [None] * len(prompts),
                        [True] * len(prompts) if logprobs is None else logprobs))
        everyone, offset = [mine], 0
        if self.tp_group is not None:
            everyone = [None] * self.tp
            dist.all_gather_object(everyone, mine, group=self.tp_group)
            offset = sum(len(x) for x in everyone[:dist.get_rank(self.tp_group)])
        return [it for part in everyone for it in part], slice(offset, offset + len(mine))

    def _requests(self, items, n, temperature, top_p, max_tokens, *, seeded=None, logprobs=True, ban=True):
        """(vLLM prompts, SamplingParams, requests per item) that generate sends. The switches are what it adds to a
        bare request, all on in generate (seeded: None = per_prompt_seeds); bench.py engine-ablation times each."""
        seeded = self.per_prompt_seeds and not self.v1_runner if seeded is None else seeded
        rows = 1 if temperature == 0 else n  # vLLM rejects n > 1 with greedy sampling; greedy copies are identical
        reqs, params, per_item = [], [], []
        for pr, s, L, want in items:
            kw = dict(ban=ban)
            k = 0 if not logprobs else (rows if L is None else len(L)) if want is True else int(want or 0)
            if L is None:  # the training path: one request, n samples; two when only the first k return log-probs
                # (log-probs cost vLLM's loop per token of each sample that asks). vLLM seeds a request's j-th sample
                # with seed + j, so the second request, seeded k further, draws the samples the one request would
                parts = [(k, True), (rows - k, False)] if 0 < k < rows else [(rows, k > 0)]
                for first, (m, lp) in zip((0, parts[0][0]), parts):
                    reqs.append(pr)
                    params.append(self._sampling_params(m, temperature, top_p, max_tokens, request_seed(s) + first
                                                        if seeded else None, logprobs=lp, **kw))
                per_item.append(len(parts))
            else:  # one request per sample, seeded as vLLM would seed the j-th sample of one request
                reqs += [pr] * len(L)
                params += [self._sampling_params(1, temperature, top_p, l, request_seed(s) + j if seeded else None,
                                                 forced=True, logprobs=j < k, **kw) for j, l in enumerate(L)]
                per_item.append(len(L))
        return reqs, params, per_item

    def _results(self, outs, items, per_item, mine, n, temperature, top_p, max_tokens):
        """generate's answer for this rank's items (`mine`) from vLLM's outputs of all items."""
        greedy = temperature == 0
        results, at = [], sum(per_item[:mine.start])
        for (_, _, L, _), k in zip(items[mine], per_item[mine]):
            group = []
            for o in outs[at:at + k]:
                for c in o.outputs:
                    ids = list(c.token_ids)
                    lp = ([c.logprobs[i][t].logprob for i, t in enumerate(ids)]  # the sampled ones' (a dict a token)
                          if c.logprobs else None)
                    group.append(_to_result(ids, lp, self.eos_ids) if L is None else _forced(ids, lp, max_tokens))
            at += k
            results.append([dict(group[0]) for _ in range(n)] if greedy and L is None else group)
        return results

    # ---- weights
    def _inner_model(self):
        """The nn.Module inside the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
        worker = self.llm.llm_engine.model_executor.driver_worker  # (in process: __init__ refused anything else)
        worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker
        return worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.get_model()

    def _reset_caches(self):
        """After a weight change: cached KV blocks and cached vision-encoder outputs (keyed by image hash) were
        computed with the old weights; without the encoder reset a vision-tower update is invisible."""
        self.llm.reset_prefix_cache()  # (below: vLLM >= 0.11-ish; older engines drop encoder outputs per request)
        getattr(self.llm.llm_engine, "reset_encoder_cache", lambda: None)()

    @torch.no_grad()
    def sync_weights(self, named_tensors):
        """Stream (HF name, full tensor) pairs into vLLM's load_weights, one tensor at a time (no state-dict copy;
        vLLM's hf_to_vllm_mapper knows transformers-5 names). Each TP rank keeps its shard; unknown names raise."""
        if "weights" in self.asleep:
            self.wake(["weights"])  # load_weights writes into the weight memory: it must be mapped again
        model = self._inner_model()
        dev = next(model.parameters()).device
        if self.model_type == "qwen3_5_moe":  # its loader takes the checkpoints' per-expert tensors
            named_tensors = per_expert(named_tensors)
        loaded = model.load_weights((name, t.to(dev, non_blocking=True)) for name, t in named_tensors)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if self.weights_lost and loaded is not None:  # after level-2 sleep (or dummy weights) every one is sent
            missing = unsent(model.named_parameters(), loaded, self.unused_params)
            if missing:
                raise RuntimeError(f"after sleep(level=2) or a start without weights these were not sent: "
                                   f"{missing[:5]}...")
        self.weights_lost = False
        self._reset_caches()

    # ---- memory
    def pool_bytes(self):
        """Bytes of vLLM's sleep-mode pool (weights and KV cache, mapped or not: torch counts them allocated). 0
        without sleep mode (the engine then allocates from torch's default pool)."""
        if not self.sleep_mode:
            return 0
        from vllm.device_allocator.cumem import CuMemAllocator  # optional: the GPU engine
        return CuMemAllocator.get_instance().get_current_usage()

    def sleep(self):
        """Free the GPU memory for training. The encoder cache is dropped every step (stale after the next
        sync anyway); the prefix cache goes with the KV cache."""
        self._reset_caches()
        if not self.sleep_mode or self.asleep:
            return
        self.queued = None  # (vLLM's sleep aborts every request it holds)
        try:
            self.llm.sleep(level=self.sleep_level)
        except AssertionError as e:
            # vLLM's worker checks the device's free memory grew: another process allocating meanwhile (matrix.py's
            # side-by-side rows) fails it, and wake_up would then leave the weights unmapped
            if "Memory usage increased after sleeping" not in str(e):
                raise
            executor = self.llm.llm_engine.model_executor
            executor.sleeping_tags, executor.is_sleeping = {"weights", "kv_cache"}, True
        self.asleep = {"weights", "kv_cache"}
        self.weights_lost = self.sleep_level >= 2

    def wake(self, tags=None):
        """Re-map memory for `tags` (default all): "weights" first when loading new weights keeps the KV cache
        unallocated until generation, lowering the peak during sync."""
        todo = [t for t in ("weights", "kv_cache") if t in self.asleep and (tags is None or t in tags)]
        if not todo:
            return
        torch.cuda.empty_cache()  # the trainer's cached-but-free blocks would otherwise stand in vLLM's way
        self.llm.wake_up(tags=todo)  # (tags: every vLLM this supports, >= 0.10.1)
        self.asleep -= set(todo)


# ------------------------------------------------------------------------------------------------ factory
def _vllm_usable():
    if not torch.cuda.is_available():
        return False
    _set_vllm_env()
    try:
        import vllm  # noqa: F401  (optional: does the GPU engine import here?)
        return True
    except Exception as e:  # a broken install falls back to HF with a note, rather than crashing "auto"
        warnings.warn(f"vLLM not usable ({e!r}); using the HF rollout engine")
        return False


def make_rollout(engine, model_path, device=None, dtype=torch.bfloat16, *, tensor_parallel_size=1,
                 gpu_memory_utilization=0.6, max_model_len=None, max_num_batched_tokens=None, limit_images=1,
                 limit_videos=0, seed=0, enforce_eager=False, sleep_level=1, min_pixels=None, max_pixels=None,
                 video_min_pixels=None, video_max_pixels=None, kv_cache_memory_gb=0, per_prompt_seeds=True,
                 **overrides):
    """engine: "auto" (vLLM where it imports and CUDA is there) | "vllm" | "hf"; the rest: vLLM's settings
    (engine_options), overrides to VLLMRollout as they are."""
    if engine == "auto":
        engine = "vllm" if _vllm_usable() else "hf"
    if engine == "hf":
        return HFRollout(model_path, device=device, dtype=dtype)
    if engine != "vllm":
        raise ValueError(f"unknown rollout engine {engine!r}: choose auto, vllm or hf")
    lo, hi = min_pixels, max_pixels
    vlo, vhi = video_min_pixels or lo, video_max_pixels or hi
    if limit_videos and lo and hi and not lo <= vlo <= vhi <= hi:
        raise UserError(f"--video-min-pixels {vlo} / --video-max-pixels {vhi}: with vLLM they must lie within "
                        f"--min-pixels {lo} and --max-pixels {hi} (vLLM's video processor gets the image bounds and "
                        "would resize frames outside them)")
    kw = dict(tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
              max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
              limit_mm_per_prompt={"image": limit_images, "video": limit_videos}, seed=seed, dtype=dtype,
              enforce_eager=enforce_eager, sleep_level=sleep_level)
    if presets.random_init(model_path):  # no weights on disk: placeholders, replaced in full by the first sync
        kw["load_format"] = "dummy"
    if kv_cache_memory_gb:  # vLLM then skips its memory profile, which assumes no other process allocates meanwhile
        kw["kv_cache_memory_bytes"] = int(kv_cache_memory_gb * 2**30)
    if lo and hi:
        # vLLM runs the HF image processor itself: the trainer's pixel bounds, so both make the same grid (its video
        # processor too: the trainer's frames lie within the video bounds, which lie within these: checked above)
        kw["mm_processor_kwargs"] = {"min_pixels": lo, "max_pixels": hi}
    kw.update(overrides)
    try:
        eng = VLLMRollout(model_path, **kw)
    except torch.OutOfMemoryError as e:  # one line, not vLLM's traceback (the 35B-A3B's, BENCHMARKS.md, 2026-12-04)
        raise UserError(f"vLLM ran out of GPU memory starting beside the trainer ({str(e)[:100]}...): give it less "
                        "(--kv-cache-memory-gb, --gpu-memory-utilization), the trainer less (--offload-params, "
                        "--lora-rank), or take more GPUs") from None
    eng.per_prompt_seeds = per_prompt_seeds
    return eng


def engine_options(cfg, limit_videos=0):
    """The engine's settings from grpo.Config, every option it reads named here. limit_videos: videos per prompt
    when --limit-videos is 0 (setup passes the most any row has)."""
    # full fine-tuning re-sends every weight each step, so level 1's copy to pinned host memory and back is waste (3B:
    # 8 GiB, wake 0.27-0.32 s vs 0.10-0.12, benchmarks/HISTORY.md); LoRA's sync and --debug-skip-sync need it
    auto_level, ranks = 1 if cfg.lora_rank > 0 or cfg.debug_skip_sync else 2, int(os.environ.get("WORLD_SIZE", 1))
    return dict(tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
                max_model_len=cfg.max_prompt_length + cfg.max_response_length,
                max_num_batched_tokens=cfg.max_num_batched_tokens, limit_images=cfg.limit_images,
                limit_videos=cfg.limit_videos or limit_videos, seed=cfg.seed, enforce_eager=cfg.enforce_eager,
                sleep_level=auto_level if cfg.sleep_level == "auto" else cfg.sleep_level, min_pixels=cfg.min_pixels,
                max_pixels=cfg.max_pixels, video_min_pixels=cfg.video_min_pixels, video_max_pixels=cfg.video_max_pixels,
                kv_cache_memory_gb=cfg.kv_cache_memory_gb, per_prompt_seeds=cfg.per_prompt_seeds,
                hybrid_max_seqs=max(1, cfg.rollout_batch_size * cfg.n * cfg.tensor_parallel_size // ranks),
                **({"max_num_seqs": seqs} if (seqs := memory.engine_max_seqs(  # long answers: as many as its KV holds
                    asdict(cfg), memory.known_dims(cfg.model_path), memory.this_gpu_gib())) else {}))
