"""bench.py -- seconds per phase of a GRPO step on a real-sized, randomly initialised model (presets.py).

From the repository root (the trainer's files import from there):
    python -m benchmarks.bench --preset qwen2_5_vl_3b --max-steps 3       # one GPU (the design card's speed bar)
    python -m benchmarks.bench --preset qwen3_vl_8b --max-steps 3         # Qwen3-VL-8B's dimensions (deepstack)
    python -m benchmarks.bench report benchmarks/h200/*.jsonl             # the tables of benchmarks/BENCHMARKS.md
    python -m benchmarks.bench phases RUN_metrics.jsonl RUN_gpu.csv [RUN_host.csv]  # the GPU's, host's side
    python -m benchmarks.bench compare AMP_CKPT BF16_CKPT...              # pure-bf16 demo runs against AMP's
    python -m benchmarks.bench pyspy pyspy_raw.txt.xz [root=FUNCTION]     # py-spy's stacks inside vLLM's engine step
    torchrun --nproc_per_node 8 -m benchmarks.bench --preset qwen2_5_vl_7b --tensor-parallel-size 2
    python -m benchmarks.bench --trainer-only --profile --max-steps 2     # no engine: log-probs + update, kernels
    python -m benchmarks.bench --workload realistic --padding-free off    # real response lengths, padded training
    python -m benchmarks.bench --prepare-only                             # just build the random model and the data
    python -m benchmarks.bench --preset qwen2_5_vl_7b --lora-rank 64 --gpu-memory-cap-gb 40  # as if on a 40 GB card
    python -m benchmarks.bench engine-ablation --preset qwen2_5_vl_3b     # a step's generation: the engine alone,
                                                                          # then each of our additions (engine_bench)
    python -m benchmarks.bench two-turn [--rows one_turn,two_turn,two_turn_distinct]  # a tool's picture between turns
    python -m benchmarks.bench two-turn --repeats 1 --profile            # where turn two's intake goes (cProfile)
    python -m benchmarks.bench --sample-stacks 5                          # + the generation loop's stacks
    bash benchmarks/gpu_moe30b.sh                                         # Qwen3-VL-30B-A3B on one H200 (no weights)
    bash benchmarks/gpu_qwen3_5.sh 9b; bash benchmarks/gpu_gemma4.sh e2b  # Qwen3.5-9B's, Gemma 4 E2B's shapes

Random weights with the real dimensions (no download), geo3k-like prompts (a 512x512 figure, ~100 text tokens); above
RANDOM_INIT_ABOVE parameters, or with --random-init, no weights on disk (presets.py: how trainer and vLLM start).
A run that by the memory model cannot fit this GPU count stops first with one line naming the GPUs it needs.
Two workloads, each the same work on every run:
- forced (default): a random policy almost never emits EOS: every response runs to max_response_length (worst case);
- realistic: each sample's length drawn from a seeded log-normal shaped like geo3k RL runs (median 0.3 x
  max_response_length, sigma 0.65, ~3% truncated), enforced per request (vLLM: max_tokens = the length, ignore_eos).
Any flag of grpo.Config can be given (defaults below: the benchmark's). Writes <output_dir>/metrics.jsonl and a
summary line per phase (mean over the steps after the first, which pays for warm-up).
"""
import collections
import json
import lzma
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import tyro
from PIL import Image, ImageDraw

import grpo
import memory
import presets
import tiny_families
import tiny_model
import tiny_moe
from benchmarks import engine_bench, host_log, two_turn
from common import UserError, one_line_errors


def occupy(gb):
    """Hold `gb` GiB of GPU memory until the process ends (a smaller card); the memory/* keys leave it out."""
    memory.BALLAST.append(torch.empty(int(gb * 2**30), dtype=torch.uint8, device="cuda"))


def model_dims(preset):
    """memory.dims_from_config of a preset (presets.py: the real checkpoints' dimensions)."""
    return memory.dims_from_config(presets.preset_config(preset, tiny_model._token_ids(tiny_model.build_tokenizer())))


CARDS_GIB = (40, 80, 140)  # 40 and 80 GB cards (as --gpu-memory-cap-gb measures them), an H200


def smallest_card(m, dims, world):
    """The smallest of CARDS_GIB that holds a memory_model() cell with the engine at its least, keeping ~1 GiB for
    the CUDA context; None if none."""
    return next((c for c in CARDS_GIB if memory.need_gib(m, dims, world) <= c - 1), None)


RANDOM_INIT_ABOVE = 20e9  # no weights written for a preset above this many parameters (bf16: 40 GB and more)


def too_big_for_disk(preset):
    """Whether the preset is written without weights (above RANDOM_INIT_ABOVE parameters)."""
    ids = tiny_model._token_ids(tiny_model.build_tokenizer())
    return presets.count_params(presets.preset_config(preset, ids)) > RANDOM_INIT_ABOVE


def build_random_model(out_dir, preset, seed=0, device=None, weights=True) -> str:
    """A preset with random bf16 weights (cached). weights=False: the folder without them (config, tokenizer,
    processor, presets.RANDOM_INIT); presets.random_model builds them where they are used."""
    arch = presets.PRESETS.get(preset, {}).get("arch", "qwen2_5_vl")

    def build(tmp):
        if arch == "gemma4":  # Gemma 4's special tokens and turn format (tiny_families)
            tok, ids = tiny_families.gemma4_tokenizer(tiny_model.build_tokenizer)
        else:
            tok = tiny_model.build_tokenizer(split_digits=arch in tiny_model.QWEN3_VISION + ("qwen3",))
            ids = tiny_model._token_ids(tok)
        cfg = presets.preset_config(preset, ids)
        if weights:
            model = presets.init_model(presets.model_class(arch), cfg, seed, device)
            if arch == "gemma4":  # q/k norms as tiny_families.build's: ones leave every random head near one-hot
                for name, w in model.named_parameters():
                    if name.endswith(("q_norm.weight", "k_norm.weight")):
                        torch.nn.init.constant_(w, w.numel() ** -0.25)
            model.save_pretrained(tmp)
            tiny_families.complete_for_vllm(tmp)  # (Gemma 4's k norms of its KV-shared layers)
        else:
            cfg.dtype = torch.bfloat16  # what save_pretrained of the bf16 model records
            cfg.save_pretrained(tmp)
            tiny_model._write_json(os.path.join(tmp, presets.RANDOM_INIT), {"preset": preset, "seed": seed})
        if arch == "gemma4":  # its processor: 280 soft tokens an image (patch 16, 3x3 pooling: the class's defaults)
            return tiny_families.save_gemma4(tmp, tok, ids, max_soft_tokens=cfg.vision_soft_tokens_per_image)
        tiny_moe.hub_layout(tmp)
        tiny_families.generation_config(tmp, [ids["<|im_end|>"], ids["<|endoftext|>"]], *[ids["<|endoftext|>"]] * 2)
        tok.save_pretrained(tmp)
        if arch not in tiny_model.TEXT_ARCHS:
            tiny_model._save_processor(arch, tok, tmp, min_pixels=3136, max_pixels=512 * 512)

    return tiny_model._atomic_build(out_dir, build, {"preset": preset, "seed": seed, "version": 1, "weights": weights})


WORDS = ("in the figure triangle circle angle line segment point length area radius chord tangent find the value "
         "of x if is parallel to perpendicular measure degrees round answer nearest tenth").split()


def make_geo_dataset(path, n_rows, tokenizer, seed=0, size=512, text_tokens=100, images=True):
    """EasyR1-format parquet: one size x size line drawing per row (none: `images` False, a text LLM's) and a
    question of about `text_tokens` tokens under `tokenizer` (the model's: the BPE built in code splits these words
    finer than Qwen's would)."""
    rng = random.Random(seed)
    rows = {"problem": [], "answer": [], "images": []}
    for _ in range(n_rows):
        im = Image.new("RGB", (size, size), "white")
        d = ImageDraw.Draw(im)
        for _ in range(rng.randint(3, 8)):
            d.line([rng.randint(0, size) for _ in range(4)], fill="black", width=3)
        r = rng.randint(size // 12, size // 3)
        d.ellipse([size // 2 - r, size // 2 - r, size // 2 + r, size // 2 + r], outline="black", width=3)
        words = []
        while len(tokenizer(" ".join(words) + "?")["input_ids"]) < text_tokens:
            words.append(rng.choice(WORDS))
        rows["problem"].append("<image>" * images + " ".join(words) + "?")
        rows["answer"].append(str(rng.randint(1, 90)))
        rows["images"].append([tiny_model.png_item(im)] * images)
    return tiny_model.write_parquet(rows, path)


# realistic workload: log-normal response lengths (median as a fraction of max_response_length, sigma of the log)
REALISTIC_MEDIAN, REALISTIC_SIGMA = 0.3, 0.65


def response_lengths(seed, pos, n, max_len):
    """The n forced response lengths of the prompt at stream position `pos`: a pure function of (seed, pos), so
    the same prompt gets the same lengths whatever the rank count, engine or run."""

    g = torch.Generator().manual_seed(seed * 1_000_003 + pos * 7 + 11)
    x = torch.empty(n, dtype=torch.float64).log_normal_(math.log(REALISTIC_MEDIAN * max_len), REALISTIC_SIGMA,
                                                         generator=g)
    return x.round().clamp(1, max_len).long().tolist()


def realistic_collect(ctx, step, metrics):
    """grpo.collect_rollouts with forced per-sample response lengths (the realistic workload)."""
    cfg = ctx.cfg
    drawn = grpo.take_prompts(ctx, cfg.rollout_batch_size)  # (drawn while the last step's update ran)
    return grpo.generate_and_score(ctx, drawn, cfg.n, cfg.temperature,
                                   lengths=realistic_requests(ctx, drawn)["lengths"])


def realistic_requests(ctx, drawn):
    """The generate call realistic_collect makes for the drawn prompts (what grpo's prefetch hands vLLM ahead)."""
    cfg = ctx.cfg
    return grpo.rollout_call(cfg, drawn, cfg.n, cfg.temperature, lengths=[
        response_lengths(cfg.seed, pos, cfg.n, cfg.max_response_length) for pos, _ in drawn])


realistic_collect.requests = realistic_requests


def defaults(workdir, model_path, data_path):
    return grpo.Config(
        model_path=model_path, train_files=data_path, val_files="", reward_function="math",
        format_prompt="{{ content }} Put the final answer in \\boxed{}.",
        max_prompt_length=1024, max_response_length=1024, min_pixels=3136, max_pixels=512 * 512,
        rollout_batch_size=64, global_batch_size=64, n=8, temperature=1.0, lr=1e-6, kl_coef=1e-2,
        micro_batch_size_per_device=256, max_token_len_per_device=65536, gpu_memory_utilization=0.5,
        max_num_batched_tokens=16384, max_steps=3, val_freq=0, save_freq=-1, resume="never",
        checkpoint_layers="auto",  # as few recomputed layers as fit (the 3B on one H200: 29 of 36)
        output_dir=os.path.join(workdir, "run"))


def read_lines(path):
    """A text file's lines; an .xz file's decompressed (benchmarks/cpu keeps its metrics.jsonl so)."""
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        return f.read().splitlines()


def summarize(metrics_path):
    rows = [json.loads(x) for x in read_lines(metrics_path) if '"timing/step"' in x]
    steady = rows[1:] or rows
    keys = sorted({k for r in steady for k in r if k.startswith(("timing/", "throughput/", "memory/", "perf/",
                                                                  "response_length/", "gen_loop/"))})
    return {k: sum(r[k] for r in steady if k in r) / sum(1 for r in steady if k in r) for k in keys}


def report(paths):
    """Markdown summary of metrics.jsonl files (benchmarks/BENCHMARKS.md is pasted from this output, never typed)."""
    out = ["| run | steps | reward first -> last (mean of 5) | val first -> last | logprob diff mean / max "
           "(over steps) | free GPU GiB engine awake / asleep | torch reserved GiB min / max | s/step (after 1st) |",
           "|---|---|---|---|---|---|---|---|"]
    phases = []
    for p in [p for p in paths if os.path.exists(p)]:  # (a recipe's unmatched glob: a run that made no metrics)
        rows = [json.loads(x) for x in read_lines(p)]
        tr = [r for r in rows if "timing/step" in r]
        val = [r["val/mean"] for r in rows if "val/mean" in r]
        f = lambda k, rs=tr: [r[k] for r in rs if k in r]  # noqa: E731
        rew = f("reward/mean")
        d_mean, d_max = f("rollout/logprob_diff_mean"), f("rollout/logprob_diff_max")
        res = f("memory/gpu_reserved_gb")
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        name = os.path.basename(p) if os.path.basename(p) != "metrics.jsonl" else os.path.basename(os.path.dirname(p))
        out.append(f"| {name} | {len(tr)} | {mean(rew[:5]):.3f} -> {mean(rew[-5:]):.3f} | "
                   + (f"{val[0]:.3f} -> {val[-1]:.3f}" if val else "-") + " | "
                   + (f"{mean(d_mean):.2e} / {max(d_max):.2e}" if d_mean else "-") + " | "
                   + f"{mean(f('memory/free_engine_awake_gb')):.1f} / {mean(f('memory/free_engine_asleep_gb')):.1f} | "
                   + (f"{min(res):.1f} / {max(res):.1f}" if res else "-") + f" | {mean(f('timing/step')[1:]):.2f} |")
        phases.append((name, summarize(p)))
    out += ["", "| run | " + " | ".join(k for k in PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for name, s in phases:
        out.append(f"| {name} | " + " | ".join(f"{s[k]:.2f}" if k in s else "-" for k in PHASES) + " |")
    return "\n".join(out)


PHASES = ["timing/gen", "timing/old_logprob", "timing/ref_logprob", "timing/update", "timing/sync", "timing/step",
          "throughput/tokens_per_s", "perf/pad_fraction", "perf/mfu_ref", "perf/mfu_update",
          "memory/gpu_peak_allocated_gb", "memory/trainer_peak_gen_gb", "memory/trainer_peak_ref_gb",
          "memory/trainer_peak_update_gb", "memory/engine_pool_gb", "memory/engine_awake_gb", "memory/host_peak_rss_gb"]


def synthetic_collect(ctx, step, metrics, realistic=False):
    """--trainer-only: this rank's prompts with random responses (full length, or the realistic workload's lengths)
    and random 0/1 rewards in place of generation, so the trainer's phases can be timed (and profiled) without an
    inference engine."""
    cfg = ctx.cfg
    drawn = grpo.take_prompts(ctx, cfg.rollout_batch_size)  # (drawn while the last step's update ran)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 8191 + ctx.rank)
    special = set(ctx.tokenizer.all_special_ids) | set(ctx.model.forbidden)
    allowed = torch.tensor([i for i in range(256) if i not in special])  # byte tokens: in every vocabulary
    samples = []
    M = cfg.max_response_length
    for pos, rec in drawn:
        for L in (response_lengths(cfg.seed, pos, cfg.n, M) if realistic else [M] * cfg.n):
            ids = allowed[torch.randint(len(allowed), (L,), generator=g)].tolist()
            r = float(torch.randint(2, (1,), generator=g))
            samples.append(dict(prompt=rec, response_ids=ids, finished=L < M, rollout_logp=None, text="",
                                scores={"overall": r}, reward=r))
    return samples


def run(cfg, trainer_only=False, profile=False, workload="forced", sample_ms=0.0):
    """Train cfg.max_steps steps; with `profile`, the last step runs under torch.profiler and its kernel table
    (sorted by device time) goes to <output_dir>/profile.txt; with `sample_ms` (--sample-stacks), each step's
    generation phase has the engine loop's stack looked at every sample_ms ms (engine_bench.sampled_stacks), the
    counts per step in <output_dir>/gen_stacks.json. Returns the summary (steady-state means)."""
    if workload not in ("forced", "realistic"):
        raise ValueError(f"--workload {workload}: choose forced or realistic")
    if trainer_only:
        cfg = replace(cfg, rollout_engine="hf")  # built but never asked to generate: only weight syncs reach it
    rank = grpo.actor.init_distributed()[0]
    if rank == 0:  # a benchmark starts over every time (--resume never refuses a folder that holds a run)
        shutil.rmtree(cfg.output_dir, ignore_errors=True)
    grpo.dist.barrier()
    realistic = workload == "realistic"
    if trainer_only:
        base = lambda ctx, step, metrics: synthetic_collect(ctx, step, metrics, realistic)  # noqa: E731
    else:
        base = realistic_collect if realistic else grpo.collect_rollouts
    prof = None
    if profile:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                        if torch.cuda.is_available() else [])
        prof = torch.profiler.profile(activities=acts)

    t_prof = []

    stacks = []

    def collect(ctx, step, metrics):  # the profiled span's wall time too: the GPU's busy share
        if prof is not None and step == cfg.max_steps - 1:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            t_prof.append(time.perf_counter())
            prof.start()  # from here to the end of train(): the last step's collect, log-probs and update
        gc0 = engine_bench.gc_seconds()
        with engine_bench.sampled_stacks(collections.Counter(), sample_ms / 1e3) as counts, \
                engine_bench.engine_loop_timers(getattr(ctx.rollout, "llm", None), {}) as loop:
            out = base(ctx, step, metrics)
        if loop.get("steps"):  # vLLM's loop: Python on the host, or a wait on the GPU (README Speed)
            metrics.update({f"gen_loop/{k}": v for k, v in loop.items()})
        metrics["gen_loop/gc"] = engine_bench.gc_seconds() - gc0  # Python's collector, with the trainer's heap
        if counts and ctx.rank == 0:
            stacks.append(dict(step=step + 1, stacks=dict(counts.most_common(40))))
            with open(os.path.join(cfg.output_dir, "gen_stacks.json"), "w") as f:
                json.dump(stacks, f, indent=1)
        return out
    collect.requests = getattr(base, "requests", None)  # (grpo.early_requests: the requests of base's generate)

    grpo.train(cfg, collect=collect)
    wall = 0.0
    if t_prof:
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        wall = time.perf_counter() - t_prof[0]
    summary = {}
    if rank == 0:
        summary = summarize(os.path.join(cfg.output_dir, "metrics.jsonl"))
    if prof is not None:
        prof.stop()
        if rank == 0:
            key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            avg = prof.key_averages()
            # seconds of kernels (device events only: an aten op's device time repeats its kernels'), or of CPU ops
            busy = sum(getattr(e, key) for e in avg if not torch.cuda.is_available()
                       or e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
            with open(os.path.join(cfg.output_dir, "profile.txt"), "w") as f:
                f.write(f"profiled wall {wall:.2f} s, {key} {busy:.2f} s: busy {busy / max(wall, 1e-9):.0%}\n")
                f.write(avg.table(sort_by=key, row_limit=60))
    return summary


def _flat_checkpoint(path):
    """(model tensors, optimizer state) of a checkpoint folder, read on one process (a temporary torch.save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # only `bench compare` reads one
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(path, os.path.join(d, "ck.pt"))
        ck = torch.load(os.path.join(d, "ck.pt"), weights_only=False)
    return ck["model"], ck["optim"]["state"]


def compare_runs(init, amp, others):
    """How far pure-bf16 runs moved compared with an AMP run of the same steps: init the HF state dict the runs
    started from (fp32), amp and others checkpoint folders. Each bf16 run is measured from its own start (init
    rounded to bf16): `carried` = <its movement, AMP's> / |AMP's|^2 (1: all of AMP's step arrived), `rel_err` =
    |its movement - AMP's| / |AMP's|, and with Kahan the same for weights + compensation (what the weights hold)."""
    ref, _ = _flat_checkpoint(amp)
    keys = sorted(ref)
    cat = lambda d, f=lambda t: t.float(): torch.cat([f(d[k]).flatten() for k in keys])  # noqa: E731
    w0 = {"hf." + k: v for k, v in init.items()}
    d_amp = cat(ref) - cat(w0)
    rows = [f"AMP moved |w - w0| = {float(d_amp.norm()):.5f}"]
    for path in others:
        model, state = _flat_checkpoint(path)
        d = cat(model) - cat(w0, lambda t: t.bfloat16().float())
        row = (f"{path}: carried {float(d @ d_amp / (d_amp @ d_amp)):.3f}, "
               f"rel_err {float((d - d_amp).norm() / d_amp.norm()):.3f}, weights moved {float((d != 0).float().mean()):.3f}")
        if all(k in state and "comp" in state[k] for k in keys):
            dc = d + torch.cat([state[k]["comp"].float().flatten() for k in keys])
            row += (f"; weights + compensation: carried {float(dc @ d_amp / (d_amp @ d_amp)):.3f}, "
                    f"rel_err {float((dc - d_amp).norm() / d_amp.norm()):.3f}")
        rows.append(row)
    return "\n".join(rows)


def cap_gpu_memory(cfg, cap_gb, engine_share=0.5):
    """Run as if the GPU had only `cap_gb` (a smaller card): the rest of it is taken by a ballast tensor held for
    the whole run (occupy: left out of the memory/* keys), and vLLM's gpu_memory_utilization, a share of the
    *whole* card, becomes `engine_share` of the cap (its weights and KV cache), unless --gpu-memory-utilization
    already asks for less. Not torch.cuda.set_per_process_memory_fraction: that limit counts reserved segments, and
    vLLM's sleep-mode pool stays reserved while asleep (only its physical pages are freed), so the trainer could
    never reuse what the sleeping engine gave back, as it can on a real card of that size."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # (before init_distributed: this rank's GPU)
    free, total = (x / 2**30 for x in torch.cuda.mem_get_info())
    occupy(max(0.0, total - cap_gb))
    util = min(cfg.gpu_memory_utilization, engine_share * cap_gb / total)
    print(f"[bench] GPU memory capped to {cap_gb:.0f} of {total:.0f} GiB ({free:.0f} were free); vLLM "
          f"gpu_memory_utilization {util:.3f} ({util * total:.1f} GiB)", flush=True)
    return replace(cfg, gpu_memory_utilization=util)


def run_model(summary):
    """The memory model for one bench run, from its bench_summary.json."""
    return memory.memory_model(model_dims(summary["preset"]),
                               **memory.config_mode(summary["config"], summary["world"]),
                               engine_gb=summary.get("memory/engine_pool_gb") or 0.0)


def table(paths):
    """The README's memory table: computed cells for each preset x mode x GPUs, and a row per measured run (its
    bench_summary.json, or the metrics file next to one: X_metrics.jsonl -> X_summary.json) with the model's
    error on every measured number."""
    modes = [("AMP", dict()), ("AMP + offload", dict(offload_params=True)),
             ("AMP + optimizer offload", dict(offload_optimizer=True)), ("bf16 (Kahan)", dict(precision="bf16")),
             ("LoRA r64, AMP", dict(lora_rank=64)), ("LoRA r64, bf16", dict(lora_rank=64, precision="bf16"))]
    out = ["Computed (GiB per GPU: trainer during generation / update, bench workload 1470 tokens per sample, "
           "16384-token micro-batches; the engine's pool comes on top while it generates. In brackets the smallest "
           f"card of {', '.join(map(str, CARDS_GIB))} GiB that holds it with the engine at its least "
           f"(tensor-parallel over the cell's GPUs, {memory.ENGINE_LEAST_GIB} GiB beside its weights: a 1.5 GiB KV "
           "cache via --kv-cache-memory-gb), '-' if none; offload takes host memory instead: 16 bytes per "
           "parameter):", "",
           "| model | mode | 1 GPU | 2 GPUs | 4 GPUs | 8 GPUs |", "|---|---|---|---|---|---|"]
    for preset in ("qwen2_5_vl_3b", "qwen2_5_vl_7b", "qwen3_vl_8b", "qwen2_5_vl_32b", "qwen2_5_vl_72b",
                   "qwen3_vl_30b_a3b", "qwen3_5_9b", "qwen3_5_27b", "qwen3_5_35b_a3b", "gemma4_e2b"):
        dims = model_dims(preset)
        for name, kw in modes:
            cells = [memory.memory_model(dims, world=w, mb_tokens=11 * memory.TOKENS_PER_SAMPLE, **kw)
                     for w in (1, 2, 4, 8)]
            out.append(f"| {preset} ({dims['params'] / 1e9:.2f}B) | {name} | "
                       + " | ".join(f"{m['gen']:.1f} / {m['update']:.1f} ({smallest_card(m, dims, w) or '-'})"
                                    for m, w in zip(cells, (1, 2, 4, 8))) + " |")
    out += ["", "Measured (GiB per GPU; each cell: measured, model, error):", "",
            "| run | date, command | trainer gen | trainer ref | trainer update | engine pool | s/step "
            "| tokens/s/GPU |",
            "|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for p in paths:
        sp = p.replace("_metrics.jsonl", "_summary.json") if p.endswith("_metrics.jsonl") else p
        if not os.path.exists(sp):  # a run that did not finish: its last logged step, measured values only
            rows = [json.loads(x) for x in open(p)] if p.endswith(".jsonl") and os.path.exists(p) else []
            last = next((r for r in reversed(rows) if "memory/trainer_peak_gen_gb" in r), None)
            if last is None:
                out.append(f"| {os.path.basename(p)} | no summary file next to it | | | | | | |")
                continue
            got = [f"{last[f'memory/trainer_peak_{ph}_gb']:.1f}" for ph in ("gen", "ref", "update")]
            out.append(f"| {os.path.basename(p).removesuffix('_metrics.jsonl')} | did not finish (no summary): "
                       f"step {last['step']} is its last | {' | '.join(got)} | {last['memory/engine_pool_gb']:.1f} | "
                       f"step {last['step']}: {last['timing/step']:.1f} | "
                       f"{last.get('throughput/tokens_per_s', nan):.0f} |")
            continue
        s = json.load(open(sp))
        m = run_model(s)

        def cell(key, phase):
            got = s.get(key)
            if got is None:
                return "-"
            want = m[phase]
            return f"{got:.1f}, {want:.1f}, {100 * (want - got) / got:+.0f}%" if got else f"{got:.1f}, {want:.1f}"
        out.append(f"| {os.path.basename(sp).removesuffix('_summary.json')} | {s.get('date', '?')}, "
                   f"`{s.get('command', '?')}` | {cell('memory/trainer_peak_gen_gb', 'gen')} | "
                   f"{cell('memory/trainer_peak_ref_gb', 'ref')} | {cell('memory/trainer_peak_update_gb', 'update')} | "
                   f"{s.get('memory/engine_pool_gb', nan):.1f} | {s.get('timing/step', nan):.1f} | "
                   f"{s.get('throughput/tokens_per_s', nan):.0f} |")
    return "\n".join(out)


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["report"]:
        print(report(argv[1:]))
        return
    if argv[:1] == ["phases"]:
        with one_line_errors():
            files = argv[1:]
            if not 2 <= len(files) <= 3 or not all(map(os.path.isfile, files)):
                missing = [f for f in files if not os.path.isfile(f)]
                raise UserError("usage: python -m benchmarks.bench phases RUN_metrics.jsonl RUN_gpu.csv [RUN_host.csv]"
                                + (f" ({', '.join(missing)}: no such file)" if missing else ""))
            print(host_log.phases(*files))
        return
    if argv[:1] == ["table"]:
        print(table(argv[1:]))
        return
    if argv[:1] == ["pyspy"]:  # benchmarks/gpu_speed.sh pyspy's raw stacks: where vLLM's engine loop spends its time
        with one_line_errors():
            opts = dict(a.split("=", 1) for a in argv[2:] if "=" in a)
            if len(argv) < 2 or not os.path.isfile(argv[1]) or set(opts) - {"root", "top"} \
                    or len(opts) != len(argv) - 2 or not opts.get("top", "1").isdigit():
                raise UserError("usage: python -m benchmarks.bench pyspy RAW[.xz] [root=FUNCTION] [top=N] (RAW: "
                                "py-spy's --format raw output, an existing file)")
            print(engine_bench.pyspy_table(argv[1], opts.get("root", "LLMEngine.step"), int(opts.get("top", 30))))
        return
    if argv[:1] == ["compare"]:  # pure-bf16 runs of the demo model against its AMP run (README: Memory modes)
        with one_line_errors():
            if len(argv) < 3 or not all(map(os.path.isdir, argv[1:])):
                raise UserError("usage: python -m benchmarks.bench compare AMP_CHECKPOINT BF16_CHECKPOINT... "
                                "(checkpoint folders of demo runs)")
        from transformers import AutoModelForImageTextToText  # slow to import (~2 s)
        start = AutoModelForImageTextToText.from_pretrained(tiny_model.build_tiny_model(),
                                                            dtype=torch.float32).state_dict()
        print(compare_runs(start, argv[1], argv[2:]))
        return
    ablation, two = argv[:1] == ["engine-ablation"], argv[:1] == ["two-turn"]
    argv = argv[1:] if ablation or two else argv
    flags = {f: f in argv for f in ("--trainer-only", "--profile", "--prepare-only", "--random-init")}
    argv = [a for a in argv if a not in flags]
    opts = {"--preset": "qwen2_5_vl_3b", "--workload": "forced", "--gpu-memory-cap-gb": "",  # bench.py's own
            "--rows": "", "--repeats": "1", "--warmup-tokens": "32", "--bare-memory-share": "0.6",  # engine-ablation's
            "--sample-stacks": "0", "--first": "512", "--second": "512", "--image": "512"}  # (both), two-turn's
    for flag in opts:
        if flag in argv:
            i = argv.index(flag)
            opts[flag] = argv[i + 1]
            del argv[i:i + 2]
    preset, workload = opts["--preset"], opts["--workload"]
    workdir = os.environ.get("BENCH_DIR", os.path.expanduser(f"~/.cache/vlm_rl/bench-{preset}"))
    rank = int(os.environ.get("RANK", "0"))
    # v2: ~100 text tokens under the model's own tokenizer (v1 had ~360: 95 words, split finely by the BPE)
    on_disk = not (flags["--random-init"] or too_big_for_disk(preset))  # else: no weights written
    model_path = os.path.join(workdir, "model" if on_disk else "model-random")
    data_path = os.path.join(workdir, "geo-v2.parquet")
    if "-h" in argv or "--help" in argv:  # the usage above, then grpo's flags with the benchmark's defaults
        print(__doc__)
        tyro.cli(grpo.Config, args=["--help"], default=defaults(workdir, model_path, data_path))
    if rank == 0:  # rank 0 builds (once, cached); the others wait for its marker file
        os.makedirs(workdir, exist_ok=True)
        build_random_model(model_path, preset, weights=on_disk)
        if not os.path.exists(data_path):
            from transformers import AutoTokenizer  # slow to import (~2 s)
            make_geo_dataset(data_path, 256, AutoTokenizer.from_pretrained(model_path),
                             images=presets.PRESETS[preset].get("arch") not in tiny_model.TEXT_ARCHS)
    else:
        while not (os.path.exists(os.path.join(model_path, "BUILD_COMPLETE.json")) and os.path.exists(data_path)):
            time.sleep(2)
    if flags["--prepare-only"]:  # build the model and the data set, nothing else (before parallel runs)
        return
    cfg = tyro.cli(grpo.Config, args=argv, default=defaults(workdir, model_path, data_path))
    card = memory.this_gpu_gib()  # (no ballast yet: the whole card)
    if card is not None:  # one line now, rather than out of memory after minutes of loading
        with one_line_errors():
            memory.check_fits(asdict(cfg), model_dims(preset), int(os.environ.get("WORLD_SIZE", "1")),
                              float(opts["--gpu-memory-cap-gb"] or card), f"--preset {preset}")
    if opts["--gpu-memory-cap-gb"]:
        cfg = cap_gpu_memory(cfg, float(opts["--gpu-memory-cap-gb"]))
    layers, note = memory.resolve_checkpoint_layers(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    cfg = replace(cfg, checkpoint_layers=layers)  # (auto: on this card, less the cap's ballast)
    if note and rank == 0:
        print(f"[bench] {note}", flush=True)
    if two:
        with one_line_errors():  # (a bad --rows: one line)
            two_turn.run(cfg, int(opts["--repeats"]), int(opts["--first"]), int(opts["--second"]),
                         int(opts["--image"]), tuple(r for r in opts["--rows"].split(",") if r) or two_turn.ROWS[:2],
                         flags["--profile"])
    elif ablation:
        engine_bench.run(cfg, [r for r in opts["--rows"].split(",") if r], int(opts["--repeats"]),
                         int(opts["--warmup-tokens"]), float(opts["--bare-memory-share"]), sys.argv[1:],
                         float(opts["--sample-stacks"]))
    if two or ablation:
        dist.destroy_process_group()
        return
    summary = run(replace(cfg, resume="never"), flags["--trainer-only"], flags["--profile"], workload,
                  float(opts["--sample-stacks"]))
    if rank == 0:
        summary.update(preset=preset, workload=workload, padding_free=cfg.padding_free, config=asdict(cfg),
                       world=grpo.dist.get_world_size(), date=time.strftime("%Y-%m-%d", time.gmtime()),
                       command=" ".join(["bench.py"] + sys.argv[1:]), gpu_memory_cap_gb=opts["--gpu-memory-cap-gb"],
                       device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        print("BENCH_RESULT " + json.dumps(summary), flush=True)
        with open(os.path.join(cfg.output_dir, "bench_summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
