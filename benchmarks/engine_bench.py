"""engine_bench.py -- `python -m benchmarks.bench engine-ablation`: a step's generation with the engine alone, then
with each of our additions to it, in one run (one engine, the same prompts). From the repository root:

    python -m benchmarks.bench engine-ablation --preset qwen2_5_vl_3b              # the 3B bar's step: 64 x 8 x 1024
    python -m benchmarks.bench engine-ablation --preset qwen2_5_vl_3b --repeats 2  # each row twice (the second round
                                                                                   # reversed)
    python -m benchmarks.bench engine-ablation --bare-memory-share 0               # no second engine (no memory-share
                                                                                   # row)
    python -m benchmarks.bench engine-ablation --rows bare,all_ours --sample-stacks 5  # + the engine loop's stack,
                                                                                       # sampled

The requests are the step's: the prompts and seeds grpo.generate_and_score hands VLLMRollout.generate for step 1 of
`bench.py` with the same options, turned into vLLM requests by VLLMRollout._requests, whose switches take away what
generate adds to a bare request (so no row is a copy of generate's request building that could drift from it):

  bare            n, temperature, top_p, max_tokens, stop at EOS, detokenize off: nothing else (engine awake)
  logprobs        + the sampled tokens' processed log-probs, one dict and one Logprob object per token (vLLM's
                  default container: what generate asks for)
  seeds           + a seed per prompt (rollout.request_seed)
  banned          + the image/video pad tokens banned (logit_bias)
  sleep_wake      bare, the engine woken before and put to sleep after it, as every training step does
  sync_sleep1     sleep_wake at sleep level 1 with a step's weight sync first (the checkpoint's tensors, on the GPU)
  sync_sleep2     the same at level 2: nothing copied to the host, every weight re-sent (the sync does that anyway
                  in full fine-tuning; with LoRA only the adapted layers are, which level 1 makes possible)
  all_ours        VLLMRollout.generate itself, its KV cache woken before and put to sleep after (memory.sleep; the
                  weights woken untimed, as a step's sync leaves them): a step's engine time
  all_ours_scored the same run with grpo.generate_and_score's decoding and reward: bench.py's timing/gen
  all_ours_gc_on  all_ours with Python's cyclic collector left on while vLLM's loop runs (generate pauses it)
  all_ours_lp_all_n  all_ours with log-probs from every sample of a chosen prompt (generate asks its first only)
  all_ours_no_lp  all_ours with no log-probs at all: what the agreement metric costs the engine loop
  all_ours_early  all_ours with its requests queued before the clock starts (VLLMRollout.submit: vLLM's intake, the
                  HF processor on every image), as grpo's prefetch thread queues them while the trainer updates
  memory_share    bare in a second engine (a child process, after this one sleeps) at --bare-memory-share, the share
                  of GPU memory of the bare vLLM engine the issue compared with (0.6), instead of ours

Every row starts cold, as a training step does: prefix, encoder and multimodal-processor caches emptied. A warm-up
runs each row once with --warmup-tokens tokens first (the Triton kernels of the log-prob and logit-bias paths compile
on their first use). Each row reports seconds, its ratio to bare, the tokens generated (every row stops at EOS as
training does: a random model emits it in ~1 % of samples) and the seconds Python's garbage collector ran meanwhile
(a process without a trainer holds fewer objects for it to walk than bench.py's), and where the engine loop's time
went (engine_loop_timers: Python on the host, or waiting on the GPU). Writes
<output_dir>/engine_ablation.json and prints the table.
"""
import collections
import contextlib
import gc
import json
import lzma
import os
import subprocess
import sys
import threading
import time
import types
import unittest.mock
from dataclasses import replace

import torch
from safetensors.torch import load_file

import data
import fsdp_actor as actor
import grpo
import memory
import rewards
import rollout
from common import UserError, heap_freezer

# name -> (what it adds to bare, VLLMRollout._requests switches; None: not an engine-level row)
ROWS = {
    "bare": ("nothing: n, temperature, top_p, max_tokens, stop at EOS",
             dict(seeded=False, logprobs=False, ban=False)),
    "logprobs": ("+ the sampled tokens' log-probs (processed; a dict and a Logprob object per token)",
                 dict(seeded=False, logprobs=True, ban=False)),
    "seeds": ("+ a seed per prompt", dict(seeded=True, logprobs=False, ban=False)),
    "banned": ("+ the image/video pad tokens banned (logit_bias)", dict(seeded=False, logprobs=False, ban=True)),
    "sleep_wake": ("+ wake before and sleep after", dict(seeded=False, logprobs=False, ban=False)),
    "sync_sleep1": ("+ a weight sync, asleep at level 1 before and after (weights copied to the host and back)",
                    dict(seeded=False, logprobs=False, ban=False)),
    "sync_sleep2": ("+ a weight sync, asleep at level 2 before and after (weights dropped, all re-sent)",
                    dict(seeded=False, logprobs=False, ban=False)),
    "all_ours": ("VLLMRollout.generate, its KV cache woken before and asleep after", None),
    "all_ours_scored": ("all_ours + decoding and reward (bench's timing/gen)", None),
    "all_ours_gc_on": ("all_ours with Python's collector left on in generate (its pause's before)", None),
    "all_ours_lp_all_n": ("all_ours with log-probs from all n samples of a chosen prompt, not its first (before "
                          "2026-12-02)", None),
    "all_ours_no_lp": ("all_ours with no log-probs asked (the agreement metric's cost: all_ours against this)", None),
    "all_ours_early": ("all_ours with its requests queued before, off the clock (vLLM's intake: grpo's prefetch "
                       "thread runs it during the update)", None),
    "memory_share": ("bare, at the bare engine's share of GPU memory", None),
}
ENGINE_ROWS = ("bare", "logprobs", "seeds", "banned", "sleep_wake", "sync_sleep1", "sync_sleep2")
SYNC_LEVEL = {"sync_sleep1": 1, "sync_sleep2": 2}

_GC = {"seconds": 0.0, "start": 0.0}


def gc_seconds():
    """The seconds Python's collector has run since the first call (which installs _gc_timer)."""
    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)
    return _GC["seconds"]


def _gc_timer(phase, info):
    """gc.callbacks hook: the seconds Python's collector runs, summed (logprob containers are its objects)."""
    if phase == "start":
        _GC["start"] = time.perf_counter()
    else:
        _GC["seconds"] += time.perf_counter() - _GC["start"]


@contextlib.contextmanager
def sampled_stacks(counts, interval):
    """While the block runs, a daemon thread looks at the calling thread's Python stack every `interval` seconds
    (0: never) and adds to `counts` (a Counter) under its innermost three frames the seconds since its last look ("*":
    all of them). Seconds, not looks: a thread busy in Python holds the GIL and delays the next look, so a count of
    looks would understate it. With vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) that thread runs the
    engine's loop: the shares say whether a slow generation waited on the GPU (a synchronising call innermost) or on
    Python (scheduling, output handling)."""
    if not interval:
        yield counts
        return
    tid, stop = threading.get_ident(), threading.Event()

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the repository's root

    def where(f):  # vllm/v1/engine/llm_engine.py:301 step (a package's path from its top folder; ours bare)
        path = f.f_code.co_filename.split("site-packages" + os.sep)[-1].replace(here, "")
        return f"{path}:{f.f_lineno} {f.f_code.co_name}"

    def look():
        last = time.perf_counter()
        while not stop.wait(interval):
            f, chain = sys._current_frames().get(tid), []
            while f is not None and len(chain) < 3:
                chain.append(where(f))
                f = f.f_back
            now = time.perf_counter()
            counts[" < ".join(chain) or "?"] += now - last
            counts["*"] += now - last
            last = now
    t = threading.Thread(target=look, daemon=True)
    t.start()
    try:
        yield counts
    finally:
        stop.set()
        t.join()


# engine_loop_timers' parts: the loop's (step and what it calls), then the requests' intake before it
LOOP = ("step", "schedule", "launch", "sample_launch", "wait", "update", "outputs", "add")


@contextlib.contextmanager
def engine_loop_timers(llm, totals):
    """While the block runs, the in-process vLLM engine loop's parts are timed (totals: a dict of seconds, plus
    "steps"): each engine step, and inside it the scheduler (schedule, update from the output), the executor's
    launches (the forward, the sampling) and the wait for a step's sampled tokens (the future's result: the GPU
    sync), and the output processor; outside the loop, the requests' intake before it (LLMEngine.add_request: vLLM's
    input processing, the images through the HF processor). Unlike sampled_stacks these are not sampled, so not biased
    towards the calls that let go of the GIL. host = step - wait: a loop that never waits kept the GPU waiting on Python.
    Parts this vLLM lacks (another version, or not vLLM: llm None) are left out."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient's EngineCore
    sched, executor = getattr(core, "scheduler", None), getattr(core, "model_executor", None)
    patched = []

    def timed(key, fn, wrap_result=False):
        def run(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t
            if key == "step":
                totals["steps"] = totals.get("steps", 0) + 1
            if wrap_result and hasattr(out, "result") and hasattr(out, "__dict__"):
                out.result = timed("wait", out.result)  # (this future only)
            return out
        return run

    for obj, name, key in ((engine, "step", "step"), (engine, "add_request", "add"),
                           (getattr(engine, "output_processor", None), "process_outputs", "outputs"),
                           (sched, "schedule", "schedule"), (sched, "update_from_output", "update"),
                           (executor, "execute_model", "launch"), (executor, "sample_tokens", "sample_launch")):
        if obj is not None and callable(getattr(obj, name, None)):
            patched.append((obj, name, obj.__dict__.get(name)))
            setattr(obj, name, timed(key, getattr(obj, name), wrap_result=key in ("launch", "sample_launch")))
    try:
        yield totals
    finally:
        for obj, name, old in reversed(patched):
            if old is None:
                delattr(obj, name)  # the class's method again
            else:
                setattr(obj, name, old)


def loop_table(result):
    """Per row with engine_loop_timers' totals: seconds per part, and the host's share (step - wait) of the loop."""
    rows = [(n, r["loop"]) for n, r in result["rows"].items() if r.get("loop", {}).get("steps")]
    if not rows:
        return ""
    out = ["| row | steps | " + " | ".join(f"{k} s" for k in LOOP) + " | host (step - wait) / step |",
           "|---|---|" + "---|" * (len(LOOP) + 1)]
    for name, lp in rows:
        out.append(f"| {name} | {lp['steps']} | " + " | ".join(f"{lp.get(k, 0.0):.2f}" for k in LOOP)
                   + f" | {1 - lp.get('wait', 0.0) / lp['step']:.0%} |")
    return "\n".join(out)


def stack_table(result, top=12):
    """Per row that was sampled (--sample-stacks): its innermost frames that held the most time, as shares of it."""
    out = []
    for name, r in result["rows"].items():
        st = r.get("stacks") or {}
        total = st.get("*", 0)
        if total:
            out += [f"{name} ({total:.1f} s looked at):"] + [f"  {c / total:6.1%}  {k}" for k, c in
                                                   collections.Counter({k: v for k, v in st.items() if k != "*"})
                                                   .most_common(top)]
    return "\n".join(out)


def pyspy_table(path, root="LLMEngine.step", top=30):
    """py-spy's collapsed stacks (`py-spy record --format raw`, optionally .xz; benchmarks/gpu_speed.sh pyspy) cut
    to the samples inside `root` (vLLM's engine step): each function's inclusive share of them (a function counted
    once per sample however deep it recurses), the most first. py-spy reads the stacks from outside the process, so
    unlike --sample-stacks no look waits for the GIL."""
    seen, total = collections.Counter(), 0
    with (lzma.open if path.endswith(".xz") else open)(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = [fr.split(" (")[0] + " (" + fr.split(" (")[-1].rsplit(":", 1)[0].rstrip(")") + ")"
                      for fr in stack.split(";")[1:]]  # (the first is the thread; line numbers dropped)
            inside = [i for i, fr in enumerate(frames) if fr.startswith(root + " (")]
            if not inside or not count.isdigit():
                continue
            total += int(count)
            for fr in set(frames[inside[0]:]):
                seen[fr] += int(count)
    if not total:
        return f"{path}: no samples inside {root}"
    return "\n".join([f"{total} samples inside {root}; share of them in each function (inclusive):"]
                     + [f"  {c / total:6.1%}  {k}" for k, c in seen.most_common(top)])


def cold(eng):
    """Empty what a training step never finds warm: the prefix cache (KV blocks of these prompts), the encoder cache
    (their image embeddings) and vLLM's multimodal-processor cache (their processed images; sleep empties it too)."""
    eng._reset_caches()
    eng.pieces = {}  # (the pictures VLLMRollout._add composes from: the last call's kept)
    reset_mm = getattr(eng.llm, "reset_mm_cache", None)
    if reset_mm is not None:  # vLLM >= 0.10-ish
        reset_mm()


def engine_row(eng, call, switches, sleep_wake=False, weights=None, level=1):
    """One engine-level row: the captured call's requests with `switches`, generated straight by vLLM; with
    sleep_wake the engine sleeps first (untimed) and the timed span is wake, generate, sleep. With `weights` (HF name
    -> tensor on the GPU, as the trainer's gathered ones are) the sleeps are at `level` and the timed span starts with
    a step's weight sync: at level 1 the weights go to the host and back although the sync re-sends every one."""
    eng.wake()
    cold(eng)
    items, _ = eng._items(call["prompts"], call["seeds"])
    reqs, params, _ = eng._requests(items, call["n"], call["temperature"], call["top_p"], call["max_tokens"],
                                    **switches)
    eng.sleep_level = level
    if sleep_wake or weights is not None:
        eng.sleep()
    gc0, t = _GC["seconds"], time.perf_counter()
    if weights is not None:
        eng.sync_weights(iter(weights.items()))
    if sleep_wake or weights is not None:
        eng.wake()
    outs = eng.llm.generate(reqs, params, use_tqdm=False)
    if sleep_wake or weights is not None:
        eng.sleep()
    seconds = time.perf_counter() - t
    eng.sleep_level = 1
    if eng.weights_lost:  # (untimed) the next row needs them
        eng.sync_weights(iter(weights.items()))
    return dict(seconds=seconds, gc_seconds=_GC["seconds"] - gc0, params=params_summary(params[0]),
                tokens=sum(len(c.token_ids) for o in outs for c in o.outputs))


def checkpoint_on_gpu(model_path, device):
    """The model folder's weights (HF names) on `device`, what a step's sync streams; None for a preset written
    without weights (presets.random_init)."""
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        return None
    out = {}
    for f in files:
        out.update(load_file(os.path.join(model_path, f), device=str(device)))
    return out


def ours_row(ctx, drawn, early=False):
    """all_ours and all_ours_scored from one run of a step's generation phase as grpo.train_step has it (its
    timing/gen): the engine asleep, its weights woken (untimed: a step's sync wakes them, in timing/sync), then the
    KV cache's wake, grpo.generate_and_score (VLLMRollout.generate, decoding, reward) and memory.sleep. all_ours is
    that span less the decoding and scoring, which run between generate's return and the sleep (ctx.rollout, an
    engine_recorder, times them). early: the requests submitted while asleep, untimed (grpo's prefetch thread does it
    during the update): all_ours_early."""
    eng = ctx.rollout.engine
    eng.wake()
    cold(eng)
    eng.sleep()
    if early and not ctx.rollout.submit(**grpo.rollout_call(ctx.cfg, drawn, ctx.cfg.n, ctx.cfg.temperature)):
        raise UserError("all_ours_early: this engine does not queue requests ahead (tensor parallelism)")
    eng.wake(["weights"])
    gc0, t = _GC["seconds"], time.perf_counter()
    ctx.rollout.wake()
    samples = grpo.generate_and_score(ctx, drawn, ctx.cfg.n, ctx.cfg.temperature)
    memory.sleep(ctx.rollout)
    total = time.perf_counter() - t
    call = ctx.rollout.calls[-1]
    r = dict(tokens=sum(len(s["response_ids"]) for s in samples), gc_seconds=_GC["seconds"] - gc0,
             params=params_summary(call["sent"][0]))
    return dict(r, seconds=total - call["after_seconds"]), dict(r, seconds=total)


# all_ours with one of generate's parts undone, each its before and after in one run: (module, name, stand-in)
VARIANTS = {"all_ours_gc_on": (rollout, "collector_paused", contextlib.nullcontext),  # the collector's pause
            "all_ours_lp_all_n": (grpo, "logprob_samples", lambda cfg: cfg.n),  # the first sample's log-probs only
            "all_ours_no_lp": (grpo, "logprob_samples", lambda cfg: 0)}  # none: what the log-probs cost


def engine_recorder(eng):
    """What grpo.generate_and_score sees as ctx.rollout: the engine, with each generate call's arguments (the step's
    prompts and seeds as grpo makes them), the SamplingParams it sent to vLLM (in generate, or in submit before it)
    and the seconds from its return to the next sleep (decoding and scoring) kept in .calls."""
    calls, sent = [], []

    def spying(fn):  # what the engine really sends vLLM
        def run(reqs, params, **k):
            sent.append(params)
            return fn(reqs, params, **k)
        return run

    def generate(prompts, **kw):
        with unittest.mock.patch.object(eng.llm, "generate", spying(eng.llm.generate)):
            out = eng.generate(prompts, **kw)
        calls.append(dict(kw, prompts=prompts, sent=sent[-1], returned=time.perf_counter(), after_seconds=0.0))
        return out

    def submit(**kw):
        with unittest.mock.patch.object(eng.llm, "enqueue", spying(eng.llm.enqueue)):
            return eng.submit(**kw)

    def sleep():
        if calls:
            calls[-1]["after_seconds"] = time.perf_counter() - calls[-1]["returned"]
        eng.sleep()

    return types.SimpleNamespace(engine=eng, calls=calls, generate=generate, submit=submit, sleep=sleep,
                                 wake=eng.wake)


PARAM_FIELDS = ("n", "temperature", "top_p", "max_tokens", "seed", "logprobs", "flat_logprobs", "logit_bias",
                "stop_token_ids", "ignore_eos", "detokenize")


def params_summary(p):
    """The fields of one SamplingParams that the rows differ in (and the workload's), as JSON-ready values."""
    out = {}
    for f in PARAM_FIELDS:
        v = getattr(p, f, None)
        out[f] = {str(k): x for k, x in v.items()} if isinstance(v, dict) else (list(v) if isinstance(v, (list, tuple))
                                                                                   else v)
    return out


def model_runner(eng):
    """vLLM's model runner behind the engine ("V2": vllm/v1/worker/gpu/, "V1": gpu_model_runner.py): where seeds,
    logit bias and log-probs are computed differs between them (README, Speed)."""
    try:
        return "V2" if eng.llm.llm_engine.vllm_config.use_v2_model_runner else "V1"
    except AttributeError:
        return "unknown"


def child_command(argv, share, out_dir):
    """The memory_share row's command: this run's bench.py arguments with the bare engine's memory share, the bare
    row alone, once, into out_dir (earlier spellings of those options removed: bench.py reads the first)."""
    drop = {"--gpu-memory-utilization", "--rows", "--repeats", "--output-dir", "--bare-memory-share"}
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif a.split("=")[0] not in drop:
            keep.append(a)
    return [sys.executable, "-m", "benchmarks.bench"] + keep + [  # (from the root, where this run started)
        "--rows", "bare", "--repeats", "1", "--bare-memory-share", "0", "--gpu-memory-utilization", str(share),
        "--output-dir", out_dir]


def run_child(cmd, out_dir, limit_s=300):
    """Run the memory_share child (a fresh process: one vLLM engine per process) in its own torch.distributed
    world; its bare row, or None if it failed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    path = os.path.join(out_dir, "engine_ablation.json")
    if os.path.exists(path):
        os.remove(path)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "child.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not os.path.exists(path):
        print(f"[engine-ablation] memory_share: the second engine failed ({rc}); see {out_dir}/child.log", flush=True)
        return None
    return json.load(open(path))["rows"]["bare"]


def table(result):
    """The markdown table of a result: row, what it adds, seconds (mean; each run), x bare (of the means; and round by
    round, each run against bare's of the same round: the engine's speed drifts between rounds by more than most
    additions, benchmarks/HISTORY.md), tokens, GC seconds."""
    bare = result["rows"].get("bare", {})
    out = ["| row | adds to bare | seconds | x bare | x bare by round | tokens | GC s |",
           "|---|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        runs = r.get("runs", [])
        each = f" ({', '.join(f'{x:.2f}' for x in runs)})" if len(runs) > 1 else ""
        ratio = f"{r['seconds'] / bare['seconds']:.3f}" if bare else "-"
        paired = bare.get("runs", []) if name != "memory_share" else []  # (memory_share: another engine's rounds)
        rounds = ", ".join(f"{x / b:.3f}" for x, b in zip(runs, paired)) if len(runs) == len(paired) > 1 else "-"
        what = ROWS[name][0] + (f" ({r['gpu_memory_utilization']} instead of {result['gpu_memory_utilization']})"
                                if name == "memory_share" else "")
        out.append(f"| {name} | {what} | {r['seconds']:.2f}{each} | {ratio} | {rounds} | {r['tokens']} | "
                   f"{r['gc_seconds']:.2f} |")
    return "\n".join(out)


def setup(cfg):
    """The engine and the step's data, as grpo.setup builds them (no policy, no reference model)."""
    rank, world, device = actor.init_distributed()
    if world > 1:
        raise UserError("bench.py engine-ablation runs one process and one engine: start it with python, not torchrun")
    processor, train, _ = data.load_datasets(replace(cfg, val_files=""), cfg.model_path)
    # the compute dtype as grpo.setup chooses it
    bf16 = cfg.precision == "bf16" or cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    eng = rollout.make_rollout(cfg.rollout_engine, cfg.model_path, device, torch.bfloat16 if bf16 else torch.float32,
                               **rollout.engine_options(cfg))
    if not isinstance(eng, rollout.VLLMRollout):
        raise UserError("bench.py engine-ablation times vLLM: it needs CUDA and vLLM (--rollout-engine vllm)")
    if eng.sleep_level > 1:  # level 2 drops the weights, which only a trainer could send back
        print("[engine-ablation] --sleep-level 2: the rows that sleep use level 1 (no trainer re-sends weights)")
        eng.sleep_level = 1
    ctx = types.SimpleNamespace(cfg=cfg, rollout=engine_recorder(eng), tokenizer=getattr(processor, "tokenizer",
                                                                                          processor),
                                reward_fn=rewards.get_reward_fn(cfg.reward_function, cfg.reward_function_kwargs))
    drawn = data.draw_prompts(train, 0, cfg.rollout_batch_size, rank, world, cfg.seed)  # step 1's prompts
    return ctx, drawn


def run(cfg, rows=None, repeats=1, warmup_tokens=32, bare_memory_share=0.6, argv=(), sample_ms=0.0):
    """The ablation (README Speed): `rows` (default all) of ROWS, each `repeats` times (every other round in reverse
    order), after a warm-up; with sample_ms, the engine loop's stack looked at every sample_ms ms in the timed rows
    (sampled_stacks). Returns the result dict, also written to <output_dir>/engine_ablation.json."""
    rows = list(rows or ROWS)
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise UserError(f"--rows {','.join(unknown)}: choose among {', '.join(ROWS)}")
    gc_seconds()  # (installs the collector's timer)
    ctx, drawn = setup(cfg)
    eng = ctx.rollout.engine
    warm = replace(cfg, max_response_length=warmup_tokens)
    weights = None
    if any(r in SYNC_LEVEL for r in rows):
        weights = checkpoint_on_gpu(cfg.model_path, next(eng._inner_model().parameters()).device)
        if weights is None:
            print("[engine-ablation] the model folder has no weights: no sync_sleep rows", flush=True)
            rows = [r for r in rows if r not in SYNC_LEVEL]

    def one(name, c):
        return engine_row(eng, c, ROWS[name][1], sleep_wake=name == "sleep_wake",
                          weights=weights if name in SYNC_LEVEL else None, level=SYNC_LEVEL.get(name, 1))
    ctx.cfg = warm  # the warm-up: every row once, short; it also records the step's call (prompts, seeds)
    ours_row(ctx, drawn)
    call = dict(ctx.rollout.calls[0], max_tokens=cfg.max_response_length)
    for name in ENGINE_ROWS:
        if name in rows:
            one(name, dict(call, max_tokens=warmup_tokens))
    ctx.cfg = cfg
    runs, stacks, loops = {}, collections.defaultdict(collections.Counter), collections.defaultdict(dict)
    ours_sent = ctx.rollout.calls[-1]["sent"]  # the warm-up's all_ours (short), until a timed one runs
    timed = [r for r in rows if r in ENGINE_ROWS or r in ("all_ours", "all_ours_early") or r in VARIANTS]
    if "all_ours_scored" in rows and "all_ours" not in timed:
        timed.append("all_ours")
    with heap_freezer() as freeze:
        freeze()  # what the warm-up left, out of the collector's walks (grpo.train: after its first step)
        for k in range(repeats):
            for name in (timed if k % 2 == 0 else timed[::-1]):
                with sampled_stacks(stacks[name], sample_ms / 1e3), engine_loop_timers(eng.llm, loops[name]):
                    if name == "all_ours":
                        got = dict(zip(("all_ours", "all_ours_scored"), ours_row(ctx, drawn)))
                        ours_sent = ctx.rollout.calls[-1]["sent"]  # (the variants' rows send otherwise)
                    elif name == "all_ours_early":
                        got = {name: ours_row(ctx, drawn, early=True)[0]}
                    elif name in VARIANTS:
                        with unittest.mock.patch.object(*VARIANTS[name]):  # module.name swapped meanwhile
                            got = {name: ours_row(ctx, drawn)[0]}
                    else:
                        got = {name: one(name, call)}
                for key, r in got.items():
                    if key in rows:
                        runs.setdefault(key, []).append(r)
                print(f"[engine-ablation] round {k + 1}: " + ", ".join(f"{key} {r['seconds']:.2f} s" for key, r in
                                                                         got.items()), flush=True)
    result = dict(rows={}, model_runner=model_runner(eng), vllm=getattr(eng, "version", None),
                  gpu_memory_utilization=cfg.gpu_memory_utilization, repeats=repeats, warmup_tokens=warmup_tokens,
                  prompts=len(drawn), n=cfg.n, max_tokens=cfg.max_response_length,
                  ours_sent=[params_summary(p) for p in ours_sent])
    for name in ROWS:  # in ROWS' order
        if name in runs:
            rs = runs[name]
            result["rows"][name] = dict(seconds=sum(r["seconds"] for r in rs) / len(rs),
                                        runs=[r["seconds"] for r in rs], tokens=rs[-1]["tokens"],
                                        gc_seconds=sum(r["gc_seconds"] for r in rs) / len(rs), params=rs[-1]["params"],
                                        **({"stacks": dict(stacks[name])} if stacks[name] else {}),
                                        **({"loop": {k: v / len(rs) for k, v in loops[name].items()}}
                                           if loops.get(name) and name != "all_ours_scored" else {}))
    write(cfg, result)
    if "memory_share" in rows and bare_memory_share and bare_memory_share != cfg.gpu_memory_utilization:
        eng.sleep()  # (level 1: the weights to the host, the KV cache freed) room for the second engine
        share = os.path.join(cfg.output_dir, "memory_share")
        got = run_child(child_command(list(argv), bare_memory_share, share), share)
        if got is not None:
            result["rows"]["memory_share"] = dict(got, gpu_memory_utilization=bare_memory_share)
            write(cfg, result)
    return result


def write(cfg, result):
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "engine_ablation.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result), flush=True)
    print(loop_table(result), flush=True)
    print(stack_table(result), flush=True)
    print("ENGINE_ABLATION " + json.dumps({k: round(r["seconds"], 3) for k, r in result["rows"].items()}), flush=True)
