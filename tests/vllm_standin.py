"""A stand-in for vLLM (no GPU): `import vllm` gives StandInSamplingParams and VLLMRollout(...) an engine around a
StandInLLM that behaves as vLLM 0.26 does where VLLMRollout and engine_bench touch it (tests/test_rollout.py,
tests/test_engine_bench.py)."""
import sys
import types

import torch

import rollout


SP_DEFAULTS = dict(n=1, temperature=1.0, top_p=1.0, max_tokens=16, seed=None, logprobs=None, flat_logprobs=False,
                   logit_bias=None, stop_token_ids=None, ignore_eos=False, detokenize=True)


class StandInSamplingParams:
    """vLLM's SamplingParams as far as VLLMRollout uses it: keyword fields with vLLM's defaults; like vLLM's msgspec
    Struct it refuses a keyword it does not know and lists its fields in __struct_fields__."""
    __struct_fields__ = tuple(SP_DEFAULTS)

    def __init__(self, **kw):
        unknown = set(kw) - set(self.__struct_fields__)
        if unknown:
            raise TypeError(f"Unexpected keyword arguments {sorted(unknown)}")
        for k, v in {**SP_DEFAULTS, **kw}.items():
            setattr(self, k, v)


class StandInModel(torch.nn.Module):
    """The nn.Module inside the stand-in engine: load_weights records the names each sync streams (in the LLM's
    .loaded, events "load") and reports its one parameter loaded when anything came."""

    def __init__(self, llm):
        super().__init__()
        self.w, self.llm = torch.nn.Parameter(torch.zeros(1)), [llm]  # (a list: not a submodule)

    def load_weights(self, weights):
        names = [n for n, _ in weights]
        self.llm[0].loaded.append(names)
        self.llm[0].events.append("load")
        return {"w"} if names else set()


class StandInLLM:
    """vLLM's LLM as VLLMRollout and engine_bench use it. Records each generate (and enqueue) call's prompts and
    SamplingParams and each cache reset, sleep, wake, enqueue, abort and run of the queue (in .events); answers
    deterministically from (prompt, seed + j) (a request without a seed: from its place in the run), with the
    log-probs as a {token: Logprob} dict per position when asked. Tokens are drawn from 10..499 (the
    tiny model's EOS and pad ids lie above)."""

    def __init__(self):
        self.calls, self.events, self.levels, self.loaded, self.woken = [], [], [], [], []
        self.queue, self.ids = [], iter(range(10**9))  # (request id, prompt, params) held, as vLLM's waiting queue
        self.ran = []  # the request ids of each run of the queue
        model = StandInModel(self)
        self.llm_engine = types.SimpleNamespace(reset_encoder_cache=lambda: self.events.append("reset_encoder"),
                                                abort_request=self.abort,
                                                vllm_config=types.SimpleNamespace(use_v2_model_runner=True),
                                                model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(
                                                    get_model=lambda: model)))

    def enqueue(self, reqs, params, use_tqdm=False):
        """As vLLM's: returns the requests' internal ids ("<id>-<8 random characters>"); the outputs carry <id>."""
        self.calls.append(dict(reqs=list(reqs), params=list(params), queued=True))
        self.events.append("enqueue")
        ids = [str(next(self.ids)) for _ in reqs]
        self.queue += zip(ids, reqs, params)
        return [f"{i}-{abs(hash(i)) % 10**8:08d}" for i in ids]

    def abort(self, ids, internal=False):  # (vLLM takes ids as external ones unless told: internal ones match none)
        self.events.append("abort")
        drop = {i.rsplit("-", 1)[0] if internal else i for i in ids}
        self.queue = [q for q in self.queue if q[0] not in drop]

    def wait_for_completion(self, use_tqdm=False):
        self.events.append("wait")
        return self.run()

    def generate(self, reqs, params, use_tqdm=False):
        """As vLLM's: these requests added, then every request held run (queued ones too), sorted by id."""
        self.calls.append(dict(reqs=list(reqs), params=list(params)))
        self.events.append("generate")
        self.queue += [(str(next(self.ids)), r, p) for r, p in zip(reqs, params)]
        return self.run()

    def run(self):
        outs, held, self.queue = [], self.queue, []
        self.ran.append([q[0] for q in held])
        for i, (rid, r, p) in enumerate(held):
            comps = []
            for j in range(p.n):
                g = torch.Generator().manual_seed(sum(r["prompt_token_ids"]) * 7919 + (
                    p.seed + j if p.seed is not None else 10**9 + 1000 * i + j))
                ids = torch.randint(10, 500, (p.max_tokens,), generator=g).tolist()
                lps = (-torch.rand(p.max_tokens, generator=g, dtype=torch.float64)).tolist()
                lp = None if p.logprobs is None else [{t: types.SimpleNamespace(logprob=x)} for t, x in zip(ids, lps)]
                comps.append(types.SimpleNamespace(token_ids=ids, logprobs=lp))
            outs.append(types.SimpleNamespace(request_id=rid, outputs=comps))
        return outs

    def reset_prefix_cache(self):
        self.events.append("reset_prefix")

    def reset_mm_cache(self):
        self.events.append("reset_mm")

    def sleep(self, level=1):  # (mode "abort": the requests it holds are dropped)
        self.events.append("sleep")
        self.levels.append(level)
        self.queue = []

    def wake_up(self, tags=None):
        self.events.append("wake")
        self.woken.append(tags)


def standin_vllm(monkeypatch, sampling_params=StandInSamplingParams):
    """`import vllm` gives the stand-in SamplingParams, and VLLMRollout(...) an engine around a StandInLLM (no GPU):
    make_rollout("vllm", ...) then runs as it does on a GPU. Returns the keywords VLLMRollout got and the list of
    engines built."""
    seen, built = {}, []

    def init(self, model_path, tensor_parallel_size=1, sleep_level=1, **kw):
        seen.update(kw, tensor_parallel_size=tensor_parallel_size, sleep_level=sleep_level)
        built.append(self)
        self.llm, self.tp, self.tp_group, self.weights_lost, self.asleep = StandInLLM(), 1, None, False, set()
        self.eos_ids, self.forbidden_ids = rollout.special_token_ids(model_path)
        self.model_type, self.version = "qwen2_5_vl", "stand-in"
        self.sleep_mode, self.sleep_level = True, sleep_level

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=sampling_params))
    monkeypatch.setattr(rollout.VLLMRollout, "__init__", init)
    monkeypatch.setattr(rollout.torch.cuda, "empty_cache", lambda: None)
    return seen, built
