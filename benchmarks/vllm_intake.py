"""vLLM's intake of turn two's requests, timed on the CPU: the host's work while the GPU idles between two turns of
tools.rollout (multi-turn tools; the two-turn bar's ~2.4-4.4 s on the H200's host, BENCHMARKS.md,
2026-12-05). No GPU and no engine: vLLM's input processing (InputProcessor.process_inputs: its multimodal processor and
cache, the placeholders) and the engine core's Request (the prefix cache's block hashes) for `--requests` requests as
turn two sent them before VLLMRollout composed Qwen-VL inputs (2026-12-06; its _vllm_prompt, what vLLM still
processes for other families): ~100 prompt tokens around the prompt's picture, the first turn's 512 tokens, the
tool's answer with its picture, each picture one <|image_pad|> that vLLM expands. Rows:
- alone: one tool picture for all (the two-turn bar's: vLLM's processor cache serves all from the first);
- uuids: the same with `multi_modal_uuids` given for both pictures (vLLM hashes neither; fixed names: the floor);
- keys: the same with the keys rollout.VLLMRollout gives (multi_modal_uuids: each picture's bytes hashed once per call,
  here timed with the intake; since 2026-12-06);
- keys_distinct: `distinct` with those keys (each tool picture hashed by us instead of by vLLM);
- distinct: a picture of its own per request, new each round (each one through vLLM's HF processor);
- beside_pixels: `alone` while tools.render_answers' threads make the trainer's pixels of as many tool answers
  (`--workers` threads, `--backend` pil or torchvision image processor): what the deferred pixels cost the intake;
- beside_processes: the same with render_answers' `pool` (tools.pixel_pool: `--workers` processes, the processor
  data.load_processor gives, torchvision's where it is installed: compare with `--backend torchvision`).

Setup, once (vLLM 0.26's wheel brings the device's torch 2.11, torchvision and the rest; its compiled ops are not
used: the platform is forced to the CPU's):
    python -m venv /tmp/v26env && /tmp/v26env/bin/pip install vllm==0.26.0 transformers==5.17.0 -r requirements.txt
    python -c "from benchmarks import bench; bench.build_random_model('/tmp/b3', 'qwen2_5_vl_3b', weights=False)"
    /tmp/v26env/bin/python -m benchmarks.vllm_intake /tmp/b3 [--requests 256] [--rounds 3]
"""
import argparse
import os
import time

import numpy as np

import rollout
import tools
from benchmarks import two_turn


def engine_pieces(model_path):
    """(vLLM's InputProcessor, the block hasher) for the model, on the CPU platform."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform
    vllm.platforms._current_platform = CpuPlatform()  # (no CUDA here: vLLM would find no platform)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine.input_processor import InputProcessor
    cfg = EngineArgs(model=model_path, load_format="dummy", enforce_eager=True, max_model_len=4096,
                     limit_mm_per_prompt={"image": 2}, enable_prefix_caching=True).create_engine_config()
    fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return InputProcessor(cfg), get_request_block_hasher(16, fn)  # (the CUDA default; the CPU's is larger)


def requests(tok, tool_pictures, uuids=False):
    """Turn two's vLLM prompts: prompt text around its picture, 512 sampled tokens, the tool's answer and picture."""
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    rng, question = np.random.default_rng(0), two_turn.picture(512, seed=100)
    text = [int(x) for x in rng.integers(1000, 20000, 100)]
    out = []
    for i, tool in enumerate(tool_pictures):
        ids = (text[:20] + [start, pad, end] + text[20:] + [int(x) for x in rng.integers(1000, 20000, 512)]
               + text[:10] + [start, pad, end] + text[10:20])
        out.append({"prompt_token_ids": ids, "multi_modal_data": {"image": [question, tool]}})
        if uuids:
            out[-1]["multi_modal_uuids"] = {"image": ["question", f"tool-{id(tool)}"]}
    return out


def keyed(reqs):
    """The requests with the keys rollout.VLLMRollout's _items gives their pictures (one call's: made once each)."""
    eng = object.__new__(rollout.VLLMRollout)
    eng.keys = {}
    for r in reqs:
        r["multi_modal_uuids"] = {"image": [eng._image_key(im) for im in r["multi_modal_data"]["image"]]}
    return reqs


def intake(ip, hasher, reqs, tag, keys=False):
    """Seconds of process_inputs for every request (with keys: and of making their keys), then of the engine core's
    Requests (their block hashes)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request
    params = SamplingParams(max_tokens=512, ignore_eos=True, logprobs=0, detokenize=False, seed=1)
    t = time.perf_counter()
    reqs = keyed(reqs) if keys else reqs
    core = [ip.process_inputs(f"{tag}-{i}", r, params, supported_tasks=("generate",)) for i, r in enumerate(reqs)]
    t1 = time.perf_counter()
    [Request.from_engine_core_request(r, hasher) for r in core]
    return t1 - t, time.perf_counter() - t1


def pixel_processor(model_path, backend):
    import transformers
    proc = transformers.AutoProcessor.from_pretrained(model_path)
    if backend == "pil":  # (the device's image had no torchvision: transformers took this one there)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        proc.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
    return proc


def main(model_path, n=256, rounds=3, workers=1, backend="pil", profile=False):
    ip, hasher = engine_pieces(model_path)
    tok, one = ip.tokenizer, two_turn.picture(512, seed=1)
    proc = pixel_processor(model_path, backend)
    os.cpu_count = lambda: workers  # render_answers' pool: min(8, os.cpu_count()) threads
    pool = tools.pixel_pool(model_path, 3136, 1 << 22, [one] * n, workers)  # (None: /dev/shm too small for them)
    times = {k: [] for k in ("alone", "uuids", "keys", "distinct", "keys_distinct", "beside_pixels",
                             "beside_processes")[:7 if pool else 6]}
    if pool:
        pool.submit(int, 1).result()  # (its processes started: once per run)
    else:
        print("beside_processes left out: /dev/shm can't hold the pixels", flush=True)
    intake(ip, hasher, requests(tok, [one] * n), "warm")  # the processor cache holds both pictures from here
    if profile:  # where `alone`'s time goes: vLLM's functions by their own and cumulative seconds
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.runcall(intake, ip, hasher, requests(tok, [one] * n), "profile")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(r"vllm|transformers", 30)
    for k in range(rounds):
        times["alone"].append(intake(ip, hasher, requests(tok, [one] * n), f"a{k}"))
        times["uuids"].append(intake(ip, hasher, requests(tok, [one] * n, uuids=True), f"u{k}"))
        times["keys"].append(intake(ip, hasher, requests(tok, [one] * n), f"k{k}", keys=True))
        fresh = [two_turn.picture(512, seed=1000 * (k + 1) + i) for i in range(n)]
        times["distinct"].append(intake(ip, hasher, requests(tok, fresh), f"d{k}"))
        fresh = [two_turn.picture(512, seed=1000 * (k + 1) + 500 + i) for i in range(n)]
        times["keys_distinct"].append(intake(ip, hasher, requests(tok, fresh), f"e{k}", keys=True))
        answers = tools.render_answers(proc, [[{"name": "zoom", "result": one}]] * n, [""] * n, 3136, 1 << 22)
        times["beside_pixels"].append(intake(ip, hasher, requests(tok, [one] * n), f"b{k}"))
        t = time.perf_counter()
        [tools.pixels([a[3]]) for a in answers]
        waits = [time.perf_counter() - t]
        if pool:
            answers = tools.render_answers(proc, [[{"name": "zoom", "result": one}]] * n, [""] * n, 3136, 1 << 22,
                                           pool=pool)
            times["beside_processes"].append(intake(ip, hasher, requests(tok, [one] * n), f"p{k}"))
            t = time.perf_counter()
            [tools.pixels([a[3]]) for a in answers]
            waits.append(time.perf_counter() - t)
        print(f"round {k + 1}: " + ", ".join(f"{name} {v[-1][0]:.3f} + {v[-1][1]:.3f} s" for name, v in times.items())
              + "; the pixels' wait after it: " + ", ".join(f"{w} {s:.3f} s" for w, s in zip(("threads", "processes"),
                                                                                            waits)), flush=True)
    print(f"\n{n} turn-two requests, {rounds} rounds, {workers} pixel thread(s) or process(es), {backend} image "
          "processor in the threads\n\n"
          "| row | process_inputs s (rounds) | Requests + block hashes s | x alone |\n|---|---|---|---|")
    base = sum(a for a, _ in times["alone"]) / rounds
    for name, v in times.items():
        mean = sum(a for a, _ in v) / rounds
        print(f"| {name} | {mean:.3f} ({', '.join(f'{a:.3f}' for a, _ in v)}) | {sum(b for _, b in v) / rounds:.3f} "
              f"| {mean / base:.2f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_intake")
    ap.add_argument("model_path")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="render_answers' pixel threads (processes) beside it")
    ap.add_argument("--backend", choices=["pil", "torchvision"], default="pil")
    ap.add_argument("--profile", action="store_true", help="first, a profile of one `alone` intake")
    a = ap.parse_args()
    main(a.model_path, a.requests, a.rounds, a.workers, a.backend, a.profile)
