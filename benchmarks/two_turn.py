"""A two-turn rollout with a tool that returns a picture, timed beside one turn of as many generated tokens (the bar for
multi-turn tools: at most 1.3x, prefix caching making turn two's prompt cheap).

    python -m benchmarks.bench two-turn --preset qwen2_5_vl_3b [--repeats 2] [--first 512]
        [--second 512] [--image 512]

The step's prompts (bench.py's geometry data, rollout batch x n samples), forced lengths as bench.py's forced
workload has them (EOS ignored: every run generates the same tokens). one_turn: one engine call of first + second
tokens per sample. two_turn: the engine call of `first` tokens, then per trajectory what tools.rollout does after a
call: the tool's picture (image x image pixels) rendered by the model's chat template (tools.render_answers: the tool
message and the next assistant header, the processor on the picture) and the trajectory continued (tools.continuation),
then one engine call of `second` tokens for every trajectory. Both start cold (prefix, encoder and processor caches
emptied); their order alternates by round. Results: <output_dir>/two_turn.json and a table, with two turns' parts
(turn one, the render, the continuations, vLLM's intake of turn two, turn two, the wait for the pixels made meanwhile).
The JSON is written after every round, so a run stopped by its time limit keeps the rounds it finished. `--rows
one_turn,two_turn,...` adds variants of two_turn (the bar's ratio stays two_turn's). two_turn makes the trainer's pixels
as tools.rollout does: with vLLM in processes (tools.pixel_pool, since 2026-12-06) where /dev/shm holds them, else on
threads:
- two_turn_distinct: each trajectory gets a picture of its own, as a real tool's crops are. two_turn's one picture
  lets vLLM's processor cache and encoder cache serve every trajectory from the first (same bytes, same hash), while
  render_answers makes the trainer's pixels for each;
- two_turn_pixels_first: the pixels made before turn two starts (turn two's intake then has the host to itself);
- two_turn_pixels_on_threads: the pixels made on render_answers' threads (tools.rollout's way until 2026-12-06), which
  share the GIL with vLLM's intake and its engine loop (on an H100's host, beside vLLM 0.26's intake of 256 turn-two
  requests, 8 threads made it 2.0-2.2x slower, 8 processes 1.0-1.2x: benchmarks/vllm_intake.py, BENCHMARKS.md).

    python -m benchmarks.two_turn host MODEL_PATH [--samples 512] [--image 512]

The host's part alone (no engine; CPU is enough): the work between the two calls for `samples` trajectories, the GPU
idle meanwhile: the tools' answers rendered one at a time and all at once (render_answers: alike ones together, on
threads), the continuations with the trainer's pixel tensors (the HF engine's) and without (vLLM's).
"""
import cProfile
import datetime
import json
import os
import pstats
import time
from dataclasses import replace

import numpy as np
import torch
from PIL import Image

from common import UserError
import data
import fsdp_actor as actor
import rollout
import tools
from benchmarks import engine_bench, host_log


def picture(size, seed=0):
    """The tool's answer: a size x size picture of seeded noise (no two patches alike: nothing for a cache to
    share)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def setup(cfg):
    """The engine, the processor and the step's prompts, as grpo.setup builds them (no policy)."""
    rank, world, device = actor.init_distributed()
    processor, train, _ = data.load_datasets(replace(cfg, val_files=""), cfg.model_path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    eng = rollout.make_rollout(cfg.rollout_engine, cfg.model_path, device, dtype, **rollout.engine_options(cfg))
    return eng, processor, data.draw_prompts(train, 0, cfg.rollout_batch_size, rank, world, cfg.seed)


def one_turn(eng, prompts, seeds, n, tokens):
    outs = eng.generate(prompts, n, 1.0, 1.0, tokens, seeds, lengths=[[tokens] * n for _ in prompts])
    return sum(len(o["response_ids"]) for g in outs for o in g), {}


def two_turn(eng, proc, prompts, seeds, n, first, second, image, cfg, pixels_first=False, pool=None, profile=None):
    """Returns (generated tokens, the seconds of each part: turn one, the render between the calls, the
    continuations, vLLM's intake of turn two's requests (its submit: their input processing, the GPU idle; None for
    the HF engine) and turn two, and the prompt tokens turn two added). image: one picture for every trajectory, or a
    list of one each; pixels_first: the render waits for the trainer's pixels too; pool: processes make them
    (tools.pixel_pool), not threads; profile: a cProfile.Profile that records the intake."""
    t0 = time.perf_counter()
    outs = eng.generate(prompts, n, 1.0, 1.0, first, seeds, lengths=[[first] * n for _ in prompts])
    t, trajs = time.perf_counter(), []
    done = [(p, list(o["response_ids"])) for p, group in zip(prompts, outs) for o in group]
    images = image if isinstance(image, list) else [image] * len(done)
    vllm = isinstance(eng, rollout.VLLMRollout)
    answers = tools.render_answers(proc, [[{"name": "zoom", "result": im}] for im in images[:len(done)]],
                                   [""] * len(done), cfg.min_pixels, cfg.max_pixels, pool)
    for (p, ids), (raw, exp, imgs, mm) in zip(done, answers):
        trajs.append(dict(prompt=p, ids=ids + exp, raw=ids + raw, images=imgs, mm=[mm], first=len(ids),
                          added=len(exp)))
    if pixels_first:
        [tools.pixels(x["mm"]) for x in trajs]
    t1 = time.perf_counter()
    conts = [tools.continuation(x, expand=not vllm) for x in trajs]
    call = (conts, 1, 1.0, 1.0, second, [s * n + j for s in seeds for j in range(n)])
    t2 = time.perf_counter()
    profile and profile.enable()
    queued = vllm and eng.submit(*call, lengths=[[second]] * len(conts))
    profile and profile.disable()
    t3 = time.perf_counter()
    outs2 = eng.generate(*call, lengths=[[second]] * len(conts))  # (runs what submit queued)
    t4 = time.perf_counter()
    [tools.pixels(x["mm"]) for x in trajs]  # what tools.rollout's samples wait for: the pixels made meanwhile
    tokens = sum(x["first"] for x in trajs) + sum(len(g[0]["response_ids"]) for g in outs2)
    return tokens, dict(first_seconds=t - t0, render_seconds=t1 - t, continue_seconds=t2 - t1,
                        intake_seconds=t3 - t2 if queued else None, second_seconds=t4 - t3,
                        pixels_seconds=time.perf_counter() - t4, tool_tokens=trajs[0]["added"] if trajs else 0)


def cold(eng):
    if isinstance(eng, rollout.VLLMRollout):
        engine_bench.cold(eng)


ROWS = ("one_turn", "two_turn", "two_turn_distinct", "two_turn_pixels_first", "two_turn_pixels_on_threads")


def run(cfg, repeats=2, first=512, second=512, size=512, rows=ROWS[:2], profile=False):
    """profile (bench.py's --profile): two_turn's intake of turn two under cProfile in every timed round (its times
    then the profiler's, not the bar's), vLLM's functions by their own seconds in <output_dir>/intake_profile.txt."""
    if not {"one_turn", "two_turn"} <= set(rows) <= set(ROWS):
        raise UserError(f"--rows {','.join(rows)}: give one_turn, two_turn and any of {', '.join(ROWS[2:])}")
    cfg = replace(cfg, limit_images=max(cfg.limit_images, 2))  # the tool's picture: a second image per prompt
    eng, proc, drawn = setup(cfg)
    prompts, seeds, n, image = [p for _, p in drawn], [pos for pos, _ in drawn], cfg.n, picture(size)
    distinct = ([picture(size, seed=1 + i) for i in range(len(prompts) * n)]  # (~0.4 GB at the bar's 512 x 512^2)
                if "two_turn_distinct" in rows else None)
    pool = (tools.pixel_pool(cfg.model_path, cfg.min_pixels, cfg.max_pixels, [image] * (len(prompts) * n))
            if isinstance(eng, rollout.VLLMRollout) else None)  # (tools.rollout's: the HF engine waits for them)
    if isinstance(eng, rollout.VLLMRollout) and pool is None:
        print("[two-turn] /dev/shm can't hold the pixels of the pictures: threads make them, as tools.rollout's would")
    variant = {"two_turn": dict(image=image, pool=pool), "two_turn_distinct": dict(image=distinct, pool=pool),
               "two_turn_pixels_first": dict(image=image, pixels_first=True, pool=pool),  # name -> two_turn's kwargs
               "two_turn_pixels_on_threads": dict(image=image)}
    runs = {name: [] for name in rows}

    def save():  # after every round (atomic): a run its time limit stops keeps the rounds it finished
        done = {k: v for k, v in runs.items() if v}
        mean = {k: sum(r["seconds"] for r in v) / len(v) for k, v in done.items()}
        result = dict(runs=done, seconds=mean, ratio=mean["two_turn"] / mean["one_turn"], prompts=len(prompts), n=n,
                      first=first, second=second, image=size, engine=type(eng).__name__,
                      vllm=getattr(eng, "version", None), model=cfg.model_path, rounds=min(map(len, runs.values())))
        os.makedirs(cfg.output_dir, exist_ok=True)
        path = os.path.join(cfg.output_dir, "two_turn.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)
        return result

    prof = cProfile.Profile() if profile else None

    def call(name, first=first, second=second, timed=False):
        if name == "one_turn":
            return one_turn(eng, prompts, seeds, n, first + second)
        return two_turn(eng, proc, prompts, seeds, n, first, second, cfg=cfg, **variant[name],
                        profile=prof if timed and name == "two_turn" else None)

    for name in rows:  # warm-up, untimed, at full length (until 2026-12-06 4-token turns, after which round 1's one
        cold(eng)  # turn was its run's slowest in 7 of 11 runs: perhaps a first long call pays what short ones don't)
        call(name)
    for k in range(repeats):
        for name in (rows if k % 2 == 0 else rows[::-1]):
            cold(eng)
            if hasattr(eng, "wake"):
                eng.wake()
            t = time.perf_counter()
            tokens, extra = call(name, timed=True)
            runs[name].append(dict(seconds=time.perf_counter() - t, tokens=tokens, **extra))
            runs[name][-1]["ended"] = time.strftime("%H:%M:%S")  # (beside the GPU's clocks: gpu_speed.sh's csv)
            print(f"[two-turn] round {k + 1}: {name} {runs[name][-1]['seconds']:.2f} s, {tokens} tokens, ended "
                  f"{runs[name][-1]['ended']}", flush=True)
        result = save()
    if prof:
        with open(os.path.join(cfg.output_dir, "intake_profile.txt"), "w") as f:
            for order in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=f).sort_stats(order).print_stats(45)
    print(table(result), flush=True)
    return result


def table(result):
    r = result
    out = [f"{r['prompts']} prompts x {r['n']}, {r['engine']} (vLLM {r['vllm']}): one turn of "
           f"{r['first'] + r['second']} tokens against {r['first']} + a {r['image']}^2 picture + {r['second']}", "",
           "| run | seconds (rounds) | tokens | x one turn |", "|---|---|---|---|"]
    for name, rs in r["runs"].items():
        rounds = ", ".join(f"{x['seconds']:.2f}" for x in rs)
        out.append(f"| {name} | {r['seconds'][name]:.2f} ({rounds}) | {rs[-1]['tokens']} | "
                   f"{r['seconds'][name] / r['seconds']['one_turn']:.3f} |")
    for name in [x for x in r["runs"] if x.startswith("two_turn")]:
        parts = [(k[:-8], [x[k] for x in r["runs"][name] if x.get(k) is not None]) for k in PARTS]
        out += ["", f"{name}, by part (mean s): " + ", ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in parts if v)]
    return "\n".join(out)


PARTS = ("first_seconds", "render_seconds", "continue_seconds", "intake_seconds", "second_seconds", "pixels_seconds")


def busy(result, csv_path, column=6, rows=("one_turn", "two_turn")):
    """{row: a once-a-second log's column, its mean per round while the row generated}: one_turn's whole call,
    two_turn's turn one (the same prompts, seeds and engine state); each window's first and last second left out.
    Column 6 of nvidia-smi's log (gpu_speed.sh's <run>_gpu.csv): the GPU's utilisation; column 5 of the host's
    (benchmarks/host_log.py, <run>_host.csv): the run's busiest thread's share of a core. The GPU's low and that
    thread's ~100 %: vLLM's engine loop (Python, one host core) fed the GPU too slowly; the same work took longer."""
    log = _log(csv_path, column)
    out = {}
    for name in rows:
        for x in result["runs"].get(name, []):
            start, end = _span(log, x)
            end = start + x["first_seconds"] if "first_seconds" in x else end
            inside = [u for t, u in log if start + 1 <= t <= end - 1]
            out.setdefault(name, []).append(sum(inside) / len(inside) if inside else float("nan"))
    return out


def _log(csv_path, column):
    return [(t, float(r[column].split()[0])) for t, r in host_log._timed_rows(csv_path)]  # (unix time, value)


def _span(log, x):
    """(start, end) unix times of a timed call: "ended" is the run's clock time in whole seconds, on the log's day."""
    end = datetime.datetime.combine(datetime.date.fromtimestamp(log[0][0]),
                                    datetime.time.fromisoformat(x["ended"])).timestamp() + 0.5
    return end - x["seconds"], end


def seconds_table(result, csv_path, k=1):
    """Round k's (from 0) one turn and two turns second by second: the GPU's utilisation from nvidia-smi's log (column
    6) from each call's start, and where two turns' parts begin (the render and continuations counted in the intake).
    A 0 at a call's start: vLLM's intake of its requests, before the first step."""
    log, out = _log(csv_path, 6), ["| call | parts, s from its start | GPU busy % each second from its start |",
                                   "|---|---|---|"]
    for name in ("one_turn", "two_turn"):
        x = result["runs"][name][k]
        start, end = _span(log, x)
        t1 = x.get("first_seconds", 0)
        t2 = t1 + sum(x.get(p) or 0 for p in ("render_seconds", "continue_seconds", "intake_seconds"))
        parts = (f"turn one 0-{t1:.1f}, intake -{t2:.1f}, turn two -" if t1 else "0-") + f"{x['seconds']:.1f}"
        out.append(f"| {name}, round {k + 1} | {parts} | " + " ".join(f"{u:.0f}" for t, u in log if start <= t <= end)
                   + " |")
    return "\n".join(out)


def runs_table(runs):
    """One row per run ((file name, result, its GPU log or None, its host log or None) quadruples): one turn and two
    turns, mean (rounds), their ratio (and the variants'), vLLM's intake of turn two (and the variants'), and from
    the logs (busy) per round while one turn and turn one generated: the GPU's utilisation and the engine loop's share
    of its core."""
    out = [f"{r['prompts']} prompts x {r['n']}, {r['engine']} (vLLM {r['vllm']}): one turn of "
           f"{r['first'] + r['second']} tokens against {r['first']} + a {r['image']}^2 picture + {r['second']}"
           for _, r, _, _ in runs[:1]]
    out += ["", "| run | one turn s (rounds) | two turns s (rounds) | x one turn | intake s | GPU busy % while one "
            "turn / turn one generated (rounds) | loop thread % of a core, the same |", "|---|---|---|---|---|---|---|"]
    for name, r, gpu_path, host_path in runs:
        def cell(row):
            return f"{r['seconds'][row]:.2f} (" + ", ".join(f"{x['seconds']:.2f}" for x in r["runs"][row]) + ")"

        def rounds(path, column):
            b = busy(r, path, column) if path else {}
            return " / ".join(", ".join(f"{u:.0f}" for u in b[k]) for k in ("one_turn", "two_turn")) if b else "-"
        ratios = [f"{r['seconds'][v] / r['seconds']['one_turn']:.3f}" + ("" if v == "two_turn" else f" ({v})")
                  for v in r["runs"] if v.startswith("two_turn")]
        intake = [(v, t) for v in r["runs"] if v.startswith("two_turn") and (t := [  # (none: the HF engine's)
            x["intake_seconds"] for x in r["runs"][v] if x.get("intake_seconds") is not None])]
        intake = ", ".join(f"{sum(t) / len(t):.2f}" + ("" if v == "two_turn" else f" ({v})") for v, t in intake) or "-"
        out.append(f"| {name} | {cell('one_turn')} | {cell('two_turn')} | {', '.join(ratios)} | {intake} | "
                   f"{rounds(gpu_path, 6)} | {rounds(host_path, 5)} |")
    return "\n".join(out)


def host(model_path, samples=512, size=512):
    """Seconds of the host's work between two turns for `samples` trajectories of one prompt with a size^2 picture."""
    proc = data.load_processor(model_path)
    img = picture(size)
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                                    tokenize=False, add_generation_prompt=True)
    enc = proc(text=[text], images=[data.resize_image(img, 3136, 262144)], return_tensors="pt")
    prompt = dict(prompt_ids=enc["input_ids"][0].tolist(), raw_prompt_ids=[1, 2, 3], images=[img],
                  mm_inputs={k: v for k, v in enc.items() if k not in data.TOKEN_KEYS})
    recs, ends, out = [[{"name": "zoom", "result": img}]] * samples, [""] * samples, {}
    t = time.perf_counter()
    answers = [tools.render_answers(proc, [r], [e], 3136, 262144)[0] for r, e in zip(recs, ends)]
    out["render_one_by_one"] = time.perf_counter() - t
    t = time.perf_counter()
    together = tools.render_answers(proc, recs, ends, 3136, 262144)
    out["render_answers"] = time.perf_counter() - t  # (the GPU idle: until the next turn can start)
    [tools.pixels([a[3]]) for a in together]
    out["render_answers_with_pixels"] = time.perf_counter() - t
    trajs = [dict(prompt=prompt, ids=exp, raw=raw, images=imgs, mm=[mm]) for raw, exp, imgs, mm in answers]
    for expand in (True, False):
        t = time.perf_counter()
        [tools.continuation(x, expand) for x in trajs]
        out[f"continuation_expand_{expand}"] = time.perf_counter() - t
    return out


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="python -m benchmarks.two_turn")
    ap.add_argument("mode", choices=["host"])
    ap.add_argument("model_path")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--image", type=int, default=512)
    a = ap.parse_args()
    print(json.dumps({k: round(v, 3) for k, v in host(a.model_path, a.samples, a.image).items()}))
