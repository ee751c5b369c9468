"""grpo.py -- GRPO (and friends) for vision-language models, in one loop you can read top to bottom.

    python grpo.py                                    # the demo: tiny VLM built in code, synthetic colour task
    torchrun --nproc_per_node 8 grpo.py --model-path Qwen/Qwen2.5-VL-7B-Instruct --train-files hiyouga/geometry3k@train ...

One step:  sync -> sample -> score -> advantage -> (old / ref log-probs) -> clipped loss + KL -> optimizer step.
The algorithm lives in the middle section (advantages, KL estimators, policy losses, loss aggregation); the rest
is plumbing. dapo.py imports this file and swaps in dynamic sampling and overlong shaping.
"""
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import tyro

import fsdp_actor as A


# ================================================================================================ config
@dataclass
class Config:
    # --- model and data (empty model_path / train_files = the built-in demo) ---
    model_path: str = ""  # HF hub name or local folder; "" builds the tiny demo VLM in code
    # the tiny model built when model_path is "" (and its task when train_files is ""): qwen2_5_vl and qwen3_vl
    # answer the colour task, the text-only qwen3 the comparison task (with TEXT_DEMO's settings)
    demo_model: Literal["qwen2_5_vl", "qwen3_vl", "qwen3"] = "qwen2_5_vl"
    train_files: str = ""  # hub "name@split", a parquet/json/jsonl file or a folder; "" = the synthetic colour task
    val_files: str = ""
    prompt_key: str = "problem"
    answer_key: str = "answer"
    image_key: str = "images"
    image_dir: str | None = None  # root for relative image paths
    format_prompt: str | None = None  # jinja template (string or .jinja file) around {{ content }}
    reward_function: str = "color"  # math | r1v | color | number | dapo | path/to/file.py:fn
    max_prompt_length: int = 512
    max_response_length: int = 4  # the demo's: its answer is one word
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    filter_overlong_prompts: bool = True
    # --- rollout ---
    rollout_engine: Literal["auto", "vllm", "hf"] = "auto"
    n: Annotated[int, tyro.conf.arg(aliases=("--rollout-n", "--num-generations"), help=(
        "samples per prompt (the group); under torchrun spell it --rollout-n: torchrun reads --n as its --nnodes"))] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    val_temperature: float = 0.0  # 0 = greedy
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False
    sleep_level: int = 1  # 1: engine weights wait in CPU memory while training; 2: dropped, re-sent before generating
    limit_images: int = 1  # images per prompt the engine accepts (EasyR1's limit_images); raise for multi-image data
    # --- batch arithmetic (EasyR1's names: batch sizes count prompts, micro-batches count samples) ---
    rollout_batch_size: int = 16  # prompts per step, over all ranks
    global_batch_size: int = 16  # prompts per optimizer step; rollout_batch_size / global_batch_size updates per step
    ppo_epochs: int = 1
    micro_batch_size_per_device: int = 64  # samples per forward/backward, at most
    max_token_len_per_device: int = 16384  # padded tokens per forward/backward, at most
    # --- optimisation ---
    lr: float = 1e-3  # the demo's (a tiny model trained from scratch); real models want ~1e-6
    weight_decay: float = 1e-2
    lr_warmup_steps: int = 0
    max_grad_norm: float = 1.0
    # --- the algorithm ---
    adv_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus"] = "grpo"
    loss_type: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    loss_avg_mode: Literal["token", "seq", "seq-mean-token-sum-norm"] = "token"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.3
    clip_ratio_dual: float = 3.0  # dual clip: bounds the loss of negative-advantage tokens with huge ratios
    kl_coef: float = 1e-2  # 0 disables the reference model entirely
    kl_penalty: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = "low_var_kl"
    # --- engineering ---
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # compute dtype; auto = bf16 on GPU, fp32 on CPU
    freeze_vision_tower: bool = False  # train the language model only (the vision tower keeps its weights)
    gradient_checkpointing: bool = True
    attn_implementation: str | None = None  # e.g. flash_attention_2; None = transformers' default (sdpa)
    logprob_chunk_size: int = 4096
    # --- trainer ---
    max_steps: int = 150
    val_freq: int = 10  # validate every k steps (and before training); 0 = never
    val_max_rows: int = 0  # 0 = the whole validation set
    save_freq: int = 0  # checkpoint every k steps; 0 = only at the end; -1 = never (benchmarks)
    save_limit: int = 2  # keep the newest k checkpoints (each holds the optimizer state: 12 bytes/param); 0 = all
    output_dir: str = "outputs/demo"
    resume: bool = True  # continue from the newest checkpoint in output_dir
    seed: int = 1
    log_samples: int = 4  # generations written to samples.jsonl per step
    debug_skip_sync: bool = False  # never send new weights to the engine: rollout/logprob_diff_* must then grow


# The text demo's settings, applied where an option is left at its default: its own reward; answers of one digit,
# i.e. one token; and groups of 64, which keep every digit sampled (with 16 the tiny policy settles on a few digits
# before it has learned to read the question, and a digit it never samples again is never learned).
TEXT_DEMO = dict(reward_function="number", max_response_length=1, n=64)


# ================================================================================================ algorithm
def compute_advantages(rewards, estimator="grpo", eps=1e-6):
    """rewards [G, n] (n samples of each of G prompts) -> advantages [G, n], one scalar per sample."""
    G, n = rewards.shape
    if estimator == "grpo":  # group-normalised; a group of equal rewards gives 0, not NaN
        std = rewards.std(dim=1, keepdim=True) if n > 1 else torch.ones_like(rewards)
        return (rewards - rewards.mean(dim=1, keepdim=True)) / (std + eps)
    if estimator == "dr_grpo":  # Dr. GRPO: no std division (it favours too-easy / too-hard groups)
        return rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "rloo":  # leave-one-out baseline: the mean of the *other* n-1 samples
        if n == 1:
            return torch.zeros_like(rewards)
        return (rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1))
    if estimator == "reinforce_plus_plus":  # REINFORCE++-baseline: group baseline, then whitened over the batch
        adv = rewards - rewards.mean(dim=1, keepdim=True)
        # over the *global* batch (the paper's point), so the statistics are summed over ranks
        cnt, s, sq = A.all_reduce_cpu([adv.numel(), adv.sum(), adv.square().sum()]).tolist()
        mean = s / cnt
        std = math.sqrt(max(sq - cnt * mean * mean, 0.0) / max(cnt - 1, 1))  # unbiased, like torch.std
        return (adv - mean) / (std + eps)
    raise ValueError(f"adv_estimator={estimator!r}: choose grpo, dr_grpo, rloo or reinforce_plus_plus")


def kl_penalty(logp, ref_logp, kind="low_var_kl"):
    """Per-token estimate of KL(policy || reference) from samples of the policy. [B, R] -> [B, R]."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):  # Schulman's unbiased, low-variance, always >= 0 estimator
        kl = ref_logp - logp
        return (kl.clamp(-20, 20).exp() - kl - 1).clamp(-10, 10)
    raise ValueError(f"kl_penalty={kind!r}: choose k1, k2, k3 (= low_var_kl) or abs")


def policy_loss(logp, old_logp, adv, mask, loss_type="ppo_clip", clip_low=0.2, clip_high=0.3, clip_dual=3.0):
    """Per-token policy loss [B, R] for logp/old_logp [B, R], adv [B], mask [B, R]; plus clip metrics."""
    adv = adv[:, None]  # [B, 1]
    log_ratio = (logp - old_logp).clamp(-20, 20)
    if loss_type == "gspo":  # GSPO: one length-normalised ratio per sequence, gradient still flows per token
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()
    ratio = log_ratio.exp()
    if loss_type == "cispo":  # CISPO: clip (and detach) the importance weight, keep every token's gradient
        weight = ratio.clamp(max=1 + clip_high).detach()
        loss = -adv * weight * logp
        clipped = (ratio > 1 + clip_high).float()
        return loss, {"clipfrac": clipped, "dual_clipfrac": torch.zeros_like(ratio)}
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).float()
    if loss_type == "ppo_clip" and clip_dual > 1:  # dual clip (negative advantages only)
        loss3 = -adv * clip_dual
        dual = ((adv < 0) & (loss > loss3)).float()
        loss = torch.where(adv < 0, torch.minimum(loss, loss3), loss)
    else:
        dual = torch.zeros_like(ratio)
    return loss, {"clipfrac": clipfrac, "dual_clipfrac": dual}


def agg_loss(loss, mask, mode="token", num_tokens=None, num_seqs=None, max_len=None):
    """Reduce a per-token loss [B, R] to a scalar. The normalisers are passed in so that a mini-batch spread over
    micro-batches and ranks gets exactly the loss it would get in one piece (defaults: this batch alone)."""
    mask = mask.to(loss.dtype)
    num_seqs = num_seqs if num_seqs is not None else loss.shape[0]
    if mode == "token":  # every token of the mini-batch weighs the same (DAPO)
        return (loss * mask).sum() / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    if mode == "seq":  # every sequence weighs the same: mean over its tokens, then over sequences (GRPO paper)
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":  # Dr. GRPO: token sums over a constant, no length bias
        return (loss * mask).sum() / (num_seqs * (max_len or loss.shape[1]))
    raise ValueError(f"loss_avg_mode={mode!r}: choose token, seq or seq-mean-token-sum-norm")


# ================================================================================================ setup
def setup(cfg: Config):
    """Everything the loop needs, in one namespace: distributed state, data, reward, policy, reference, engine."""
    import data
    import rewards
    import rollout
    rank, world, device = A.init_distributed()
    if cfg.rollout_batch_size % world or cfg.rollout_batch_size % cfg.global_batch_size:
        raise ValueError(f"rollout_batch_size={cfg.rollout_batch_size} must be divisible by the number of ranks "
                         f"({world}) and by global_batch_size={cfg.global_batch_size}")
    if cfg.temperature <= 0:
        raise ValueError(f"temperature={cfg.temperature}: training samples need temperature > 0 (the log-probs "
                         "divide by it); greedy is for validation (--val-temperature 0)")
    if (cfg.global_batch_size % world):
        raise ValueError(f"global_batch_size={cfg.global_batch_size} must be divisible by the number of ranks "
                         f"({world})")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    ctx = SimpleNamespace(cfg=cfg, rank=rank, world=world, device=device)
    ctx.model_path = cfg.model_path
    if not ctx.model_path:  # the demo: rank 0 builds (cached), the others wait and read it
        import tiny_model
        if rank == 0:
            tiny_model.build_tiny_model(arch=cfg.demo_model)
        dist.barrier()
        ctx.model_path = tiny_model.build_tiny_model(arch=cfg.demo_model)
    train_files, val_files = cfg.train_files, cfg.val_files
    fmt = cfg.format_prompt
    if not train_files:
        text_demo = cfg.demo_model == "qwen3"
        for k, v in (TEXT_DEMO.items() if text_demo else ()):
            if getattr(cfg, k) == getattr(Config, k):
                setattr(cfg, k, v)
        make = data.demo_compare_data if text_demo else data.demo_data
        if rank == 0:
            make()
        dist.barrier()
        train_files, val_files = make()
        fmt = fmt if fmt is not None else data.NUMBER_FORMAT_PROMPT if text_demo else data.DEMO_FORMAT_PROMPT
    ctx.processor = data.load_processor(ctx.model_path, cfg.min_pixels, cfg.max_pixels)
    ctx.tokenizer = getattr(ctx.processor, "tokenizer", ctx.processor)
    ctx.pad_id = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else 0
    data_kw = dict(processor_or_tokenizer=ctx.processor, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                   image_key=cfg.image_key, image_dir=cfg.image_dir, format_prompt=fmt,
                   min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                   max_prompt_length=cfg.max_prompt_length, filter_overlong=cfg.filter_overlong_prompts)
    ctx.train = data.PromptDataset(train_files, **data_kw)
    ctx.val = data.PromptDataset(val_files, **data_kw) if val_files else None
    if len(ctx.train) < cfg.rollout_batch_size:
        raise ValueError(f"{train_files}: {len(ctx.train)} usable prompts < rollout_batch_size="
                         f"{cfg.rollout_batch_size}; lower --rollout-batch-size or add data")
    ctx.reward_fn = rewards.get_reward_fn(cfg.reward_function)
    # --- policy (fp32 master weights), reference (frozen, compute dtype), rollout engine (its own weights) ---
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    ctx.compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
    ctx.model = A.build_actor(ctx.model_path, device, torch.float32, ctx.compute_dtype,
                              cfg.gradient_checkpointing, cfg.attn_implementation,
                              freeze_vision_tower=cfg.freeze_vision_tower)
    ctx.ref = None
    if cfg.kl_coef > 0:
        ctx.ref = A.build_actor(ctx.model_path, device, ctx.compute_dtype, ctx.compute_dtype,
                                attn_implementation=cfg.attn_implementation, trainable=False)
    ctx.opt, ctx.sched = A.build_optimizer(ctx.model, cfg.lr, cfg.weight_decay, (0.9, 0.999), cfg.lr_warmup_steps,
                                           device)
    ctx.rollout = rollout.make_rollout(cfg.rollout_engine, model_path=ctx.model_path, device=device,
                                       dtype=ctx.compute_dtype, cfg=cfg)
    ctx.start_step, ctx.cursor = 0, 0
    ctx.engine_stale = True  # the engine loaded the same weights, but syncing on step 1 too keeps every step alike
    ckpt = A.latest_checkpoint(os.path.join(cfg.output_dir, "checkpoints")) if cfg.resume else None
    if ckpt:
        state = A.load_checkpoint(ckpt, ctx.model, ctx.opt, ctx.sched)
        ctx.start_step, ctx.cursor = state["step"], state["cursor"]  # the engine is synced before step 1 anyway
        log0(ctx, f"resumed from {ckpt} at step {ctx.start_step}")
    return ctx


def log0(ctx, *a):
    if ctx.rank == 0:
        print(*a, flush=True)


def print_batch_arithmetic(ctx):
    cfg, w = ctx.cfg, ctx.world
    updates = cfg.rollout_batch_size // cfg.global_batch_size * cfg.ppo_epochs
    log0(ctx, f"[batch] {w} rank(s); per step: {cfg.rollout_batch_size} prompts x n={cfg.n} = "
              f"{cfg.rollout_batch_size * cfg.n} samples ({cfg.rollout_batch_size * cfg.n // w} per rank); "
              f"{updates} optimizer step(s) per rollout step ({cfg.rollout_batch_size // cfg.global_batch_size} "
              f"mini-batches x {cfg.ppo_epochs} epoch(s)) of {cfg.global_batch_size} prompts = "
              f"{cfg.global_batch_size * cfg.n // w} samples per rank, in micro-batches of <= "
              f"{cfg.micro_batch_size_per_device} samples and <= {cfg.max_token_len_per_device} tokens; "
              f"old log-probs {'recomputed' if updates > 1 else 'taken from the first forward (on-policy)'}; "
              f"reference model {'on, kl_coef=' + str(cfg.kl_coef) if cfg.kl_coef > 0 else 'off'}")


# ================================================================================================ the step
def draw_prompts(ctx, cursor, count):
    """`count` prompts (all ranks together) from an endless stream of seeded epoch shuffles, starting at `cursor`.
    Returns this rank's share as (stream position, record): a pure function of the cursor, so resume is exact
    and the seed of each prompt does not depend on the number of ranks."""
    N, per = len(ctx.train), count // ctx.world
    out = []
    for pos in range(cursor + ctx.rank * per, cursor + (ctx.rank + 1) * per):
        epoch, k = divmod(pos, N)
        perm = _epoch_perm(N, ctx.cfg.seed + epoch)
        out.append((pos, ctx.train[int(perm[k])]))
    return out


@functools.lru_cache(maxsize=2)  # the current epoch (and the next, while a batch straddles them)
def _epoch_perm(N, seed):
    return torch.randperm(N, generator=torch.Generator().manual_seed(seed))


def generate_and_score(ctx, drawn, n, temperature):
    """Sample n responses per prompt and score them. Returns a flat list of sample dicts, grouped by prompt."""
    cfg = ctx.cfg
    prompts = [rec for _, rec in drawn]
    seeds = [(cfg.seed * 1_000_003 + pos) % 2**31 for pos, _ in drawn]
    outs = ctx.rollout.generate(prompts, n=n, temperature=temperature, top_p=cfg.top_p,
                                max_tokens=cfg.max_response_length, seeds=seeds)
    samples = [dict(prompt=p, response_ids=list(o["response_ids"]), finished=o["finished"],
                    rollout_logp=o.get("logprobs"), group=g)
               for g, (p, group) in enumerate(zip(prompts, outs)) for o in group]
    texts = ctx.tokenizer.batch_decode([s["response_ids"] for s in samples], skip_special_tokens=True)
    scores = ctx.reward_fn([{"response": t, "response_length": len(s["response_ids"]),
                             "ground_truth": s["prompt"]["answer"]} for t, s in zip(texts, samples)])
    if len(scores) != len(samples) or not all(isinstance(sc, dict) and "overall" in sc for sc in scores):
        raise ValueError(f"reward function {cfg.reward_function!r} must return one dict with an 'overall' score per "
                         f"response ({len(samples)} given); got {str(scores)[:200]}")
    for s, t, sc in zip(samples, texts, scores):
        s["text"], s["scores"], s["reward"] = t, sc, float(sc["overall"])
    return samples


def collect_rollouts(ctx, step, metrics):
    """GRPO's batch: rollout_batch_size prompts x n samples. (dapo.py replaces this with dynamic sampling.)"""
    drawn = draw_prompts(ctx, ctx.cursor, ctx.cfg.rollout_batch_size)
    ctx.cursor += ctx.cfg.rollout_batch_size
    return generate_and_score(ctx, drawn, ctx.cfg.n, ctx.cfg.temperature)


def update_policy(ctx, samples):
    """rollout_batch_size/global_batch_size mini-batches x ppo_epochs optimizer steps over this rank's samples."""
    cfg, dev = ctx.cfg, ctx.device
    n_mini = cfg.rollout_batch_size // cfg.global_batch_size
    per_mini = len(samples) // n_mini
    sums = {}  # metric -> [sum, count] over all micro-batches, all-reduced at the end
    diff_max = 0.0

    def add(k, v, c=1.0):
        s = sums.setdefault(k, [0.0, 0.0])
        s[0] += float(v)
        s[1] += float(c)

    g = torch.Generator().manual_seed(cfg.seed * 7919 + ctx.step)
    for epoch in range(cfg.ppo_epochs):
        shuffle = n_mini > 1 or epoch > 0  # mini-batches see a fresh mix of samples
        order = torch.randperm(len(samples), generator=g).tolist() if shuffle else list(range(len(samples)))
        for m in range(n_mini):
            mini = [samples[i] for i in order[m * per_mini:(m + 1) * per_mini]]
            # global normalisers: the mini-batch's loss is the same whatever the micro-batching and rank count
            # (a sample with loss_mask 0, e.g. DAPO's truncated ones, takes no part in the loss or its normalisers)
            num_tokens, num_seqs = A.all_reduce_cpu([sum(len(s["response_ids"]) * s.get("loss_mask", 1) for s in mini),
                                                     sum(s.get("loss_mask", 1) for s in mini)]).clamp(min=1).tolist()
            lengths = [len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in mini]
            for idx in A.make_micro_batches(lengths, cfg.max_token_len_per_device, cfg.micro_batch_size_per_device,
                                            [id(s["prompt"]) for s in mini]):
                mb = [mini[i] for i in idx]
                batch, resp_len = A.collate(mb, ctx.pad_id, dev)
                lp, ent = ctx.model(**batch, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)  # [N]
                logp, mask = A.pad_responses(lp, resp_len)  # [b, R]
                mask = mask & torch.tensor([s.get("loss_mask", 1) > 0 for s in mb], device=dev)[:, None]
                R = logp.shape[1]
                if mb[0].get("old_logp") is not None:
                    old = A.stack_padded([s["old_logp"] for s in mb], R, dev)
                else:  # on-policy: the first forward *is* the old policy
                    old = logp.detach()
                adv = torch.tensor([s["adv"] for s in mb], device=dev, dtype=logp.dtype)  # [b]
                tok_loss, clip = policy_loss(logp, old, adv, mask, cfg.loss_type, cfg.clip_ratio_low,
                                             cfg.clip_ratio_high, cfg.clip_ratio_dual)
                norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=cfg.max_response_length)
                pg_loss = agg_loss(tok_loss, mask, cfg.loss_avg_mode, **norm)
                loss = pg_loss
                if ctx.ref is not None:
                    ref = A.stack_padded([s["ref_logp"] for s in mb], R, dev)
                    kl = kl_penalty(logp, ref, cfg.kl_penalty)
                    loss = loss + cfg.kl_coef * agg_loss(kl, mask, cfg.loss_avg_mode, **norm)
                    add("actor/kl", (kl.detach() * mask).sum(), mask.sum())
                # FSDP averages gradients over ranks; the normalisers are already global, so undo the average
                (loss * ctx.world).backward()
                add("actor/pg_loss", pg_loss.detach(), 0.0)  # already a share of the global loss: just sum
                add("actor/loss", loss.detach(), 0.0)
                ent_p, _ = A.pad_responses(ent, resp_len)
                add("actor/entropy", (ent_p * mask).sum(), mask.sum())
                add("actor/clipfrac", (clip["clipfrac"] * mask).sum(), mask.sum())
                add("actor/dual_clipfrac", (clip["dual_clipfrac"] * mask).sum(), mask.sum())
                if epoch == 0 and m == 0 and mb[0].get("rollout_logp") is not None and len(mb[0]["rollout_logp"]):
                    # trainer/rollout mismatch at the weights that generated the samples (before any update)
                    roll = A.stack_padded([torch.tensor(s["rollout_logp"]) for s in mb], R, dev)
                    diff = ((logp.detach() - roll).abs() * mask)
                    add("rollout/logprob_diff_mean", diff.sum(), mask.sum())
                    diff_max = max(diff_max, float(diff.max()))
            add("actor/grad_norm", A.optimizer_step(ctx.model, ctx.opt, ctx.sched, cfg.max_grad_norm))
            add("actor/lr", ctx.sched.get_last_lr()[0])
    # losses are already global fractions: sum them over ranks and micro-batches, mean over optimizer steps
    keys = sorted(sums)
    red = A.all_reduce_cpu([[sums[k][0], sums[k][1]] for k in keys])
    out = {}
    n_steps = n_mini * cfg.ppo_epochs
    for k, (v, c) in zip(keys, red.tolist()):
        if k in ("actor/pg_loss", "actor/loss"):
            out[k] = v / n_steps
        elif k in ("actor/grad_norm", "actor/lr"):
            out[k] = v / c  # same on every rank
        else:
            out[k] = v / max(c, 1)
    if "rollout/logprob_diff_mean" in out:
        out["rollout/logprob_diff_max"] = float(A.all_reduce_cpu(diff_max, op=dist.ReduceOp.MAX))
    return out


def train_step(ctx, step, collect=collect_rollouts):
    cfg, T, metrics = ctx.cfg, {}, {}
    ctx.step = step
    t_step = time.time()
    # ---- 0. sync: the engine gets the weights of the last update (streamed, one tensor at a time) ----
    T["sync"] = sync_engine(ctx)
    # ---- 1. sample (generate n responses per prompt) and 2. score ----
    t = time.time()
    ctx.rollout.wake()
    samples = collect(ctx, step, metrics)
    free_awake = cuda_free_gb()
    ctx.rollout.sleep()
    metrics["memory/free_engine_awake_gb"], metrics["memory/free_engine_asleep_gb"] = free_awake, cuda_free_gb()
    T["gen"] = time.time() - t
    # ---- 3. advantages: normalise within each group of n ----
    rewards = torch.tensor([s["reward"] for s in samples]).view(-1, cfg.n)  # [G, n]
    adv = compute_advantages(rewards, cfg.adv_estimator)  # [G, n]
    for s, a in zip(samples, adv.flatten().tolist()):
        s["adv"] = a
    # ---- 4. log-probs of the old policy (only when it differs from the first forward) and of the reference ----
    mb_kw = dict(pad_id=ctx.pad_id, device=ctx.device, temperature=cfg.temperature,
                 max_tokens=cfg.max_token_len_per_device, max_samples=cfg.micro_batch_size_per_device,
                 chunk_size=cfg.logprob_chunk_size)
    if cfg.rollout_batch_size // cfg.global_batch_size * cfg.ppo_epochs > 1:
        t = time.time()
        old, _ = A.compute_logprobs(ctx.model, samples, **mb_kw)
        for s, o in zip(samples, old):
            s["old_logp"] = o
        T["old_logprob"] = time.time() - t
    if ctx.ref is not None:
        t = time.time()
        ref, _ = A.compute_logprobs(ctx.ref, samples, **mb_kw)
        for s, r in zip(samples, ref):
            s["ref_logp"] = r
        T["ref_logprob"] = time.time() - t
    # ---- 5. update the policy (the engine is now one update behind: synced before its next generation) ----
    t = time.time()
    metrics.update(update_policy(ctx, samples))
    ctx.engine_stale = True
    T["update"] = time.time() - t
    T["step"] = time.time() - t_step
    # ---- metrics ----
    metrics.update(sample_metrics(ctx, samples, "reward"))
    n_tok = float(A.all_reduce_cpu(sum(len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in samples)))
    metrics.update({f"timing/{k}": v for k, v in T.items()})
    metrics["throughput/tokens_per_s"] = n_tok / T["step"] / ctx.world  # per device, like EasyR1
    metrics["throughput/tokens_per_s_total"] = n_tok / T["step"]
    metrics.update(memory_metrics(ctx))
    metrics["step"] = step + 1
    return metrics, samples


def sync_engine(ctx):
    """Stream the policy's weights into the engine if it is behind (or dropped them in a level-2 sleep). Returns
    the seconds spent. Every rank takes part: each DTensor is all-gathered."""
    if ctx.cfg.debug_skip_sync or not (ctx.engine_stale or getattr(ctx.rollout, "weights_lost", False)):
        return 0.0
    t = time.time()
    ctx.rollout.sync_weights(A.iter_full_params(ctx.model, ctx.compute_dtype))
    ctx.engine_stale = False
    return time.time() - t


def cuda_free_gb():
    return torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else 0.0


def memory_metrics(ctx):
    """Peaks since the last call (GPU allocated by torch, GPU reserved by torch's caching allocator; vLLM's pool
    is separate) and the process's peak resident host memory."""
    import resource
    out = {"memory/host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available():
        out["memory/gpu_peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["memory/gpu_reserved_gb"] = torch.cuda.memory_reserved() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return out


def sample_metrics(ctx, samples, prefix):
    """Rewards and their parts, prompt and response lengths, truncation rate: means over all ranks."""
    keys = sorted(samples[0]["scores"])
    rows = [[s["scores"][k] for k in keys] + [len(s["response_ids"]), 0.0 if s["finished"] else 1.0,
                                               len(s["prompt"]["prompt_ids"]), 1.0] for s in samples]
    tot = A.all_reduce_cpu(torch.tensor(rows, dtype=torch.float64).sum(0))
    mx = A.all_reduce_cpu(max(len(s["response_ids"]) for s in samples), op=dist.ReduceOp.MAX)
    cnt = float(tot[-1])
    out = {f"{prefix}/{'mean' if k == 'overall' else k}": float(v) / cnt for k, v in zip(keys, tot[:len(keys)])}
    out["response_length/mean" if prefix == "reward" else f"{prefix}/response_length"] = float(tot[len(keys)]) / cnt
    if prefix == "reward":
        out["response_length/max"] = float(mx)
        out["response_length/clip_ratio"] = float(tot[len(keys) + 1]) / cnt
        out["prompt_length/mean"] = float(tot[len(keys) + 2]) / cnt  # image tokens included
    return out


def validate(ctx):
    """Greedy (val_temperature) answers to the validation prompts, split over ranks; mean scores."""
    cfg = ctx.cfg
    rows = len(ctx.val) if not cfg.val_max_rows else min(cfg.val_max_rows, len(ctx.val))
    mine = list(range(ctx.rank, rows, ctx.world))
    sync_engine(ctx)
    ctx.rollout.wake()
    samples = []
    for i in range(0, len(mine), 64):  # bounded batches keep the HF engine's memory flat
        drawn = [(-1 - j, ctx.val[j]) for j in mine[i:i + 64]]
        samples += generate_and_score(ctx, drawn, 1, cfg.val_temperature)
    ctx.rollout.sleep()
    return sample_metrics(ctx, samples, "val")


# ================================================================================================ main loop
def train(cfg: Config, collect=collect_rollouts):
    ctx = setup(cfg)
    print_batch_arithmetic(ctx)
    os.makedirs(cfg.output_dir, exist_ok=True)
    if ctx.rank == 0:
        with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
    metrics_f = open(os.path.join(cfg.output_dir, "metrics.jsonl"), "a") if ctx.rank == 0 else None
    samples_f = open(os.path.join(cfg.output_dir, "samples.jsonl"), "a") if ctx.rank == 0 else None
    bar = None
    if ctx.rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.max_steps, initial=ctx.start_step, dynamic_ncols=True,
                   desc=os.path.basename(sys.argv[0]).removesuffix(".py") or "train")
    if cfg.val_freq and ctx.val is not None and ctx.start_step == 0:
        val = validate(ctx)
        log0(ctx, "[val] step 0 " + " ".join(f"{k}={v:.3f}" for k, v in val.items()))
        if metrics_f:
            metrics_f.write(json.dumps({"step": 0, **val}) + "\n")
            metrics_f.flush()
    for step in range(ctx.start_step, cfg.max_steps):
        metrics, samples = train_step(ctx, step, collect)
        last = step + 1 == cfg.max_steps
        if cfg.val_freq and ctx.val is not None and ((step + 1) % cfg.val_freq == 0 or last):
            t = time.time()
            metrics.update(validate(ctx))
            metrics["timing/val"] = time.time() - t
        if cfg.save_freq >= 0 and ((cfg.save_freq and (step + 1) % cfg.save_freq == 0) or last):
            t = time.time()
            A.save_checkpoint(os.path.join(cfg.output_dir, "checkpoints", f"step_{step + 1}"), ctx.model, ctx.opt,
                              ctx.sched, {"step": step + 1, "cursor": ctx.cursor, "config": asdict(cfg)},
                              keep=cfg.save_limit)
            metrics["timing/save"] = time.time() - t
        if ctx.rank == 0:
            metrics_f.write(json.dumps(metrics) + "\n")
            metrics_f.flush()
            for s in samples[:cfg.log_samples]:
                samples_f.write(json.dumps({"step": step + 1, "prompt": s["prompt"]["prompt_text"],
                                            "response": s["text"], "answer": s["prompt"]["answer"],
                                            "reward": s["reward"]}) + "\n")
            samples_f.flush()
            bar.update(1)
            bar.write(format_line(metrics))
    if bar:
        bar.close()
    dist.barrier()
    return ctx


def format_line(m):
    keys = [("reward/mean", "reward"), ("reward/accuracy", "acc"), ("val/mean", "val"),
            ("response_length/mean", "len"), ("actor/kl", "kl"), ("actor/entropy", "ent"),
            ("actor/grad_norm", "gnorm"), ("rollout/logprob_diff_mean", "lpdiff"),
            ("dapo/tries", "tries"), ("dapo/generated_accuracy", "gen_acc"),
            ("timing/gen", "t_gen"), ("timing/update", "t_upd"), ("timing/step", "t_step"),
            ("throughput/tokens_per_s", "tok/s/dev")]
    return f"step {m['step']:4d} | " + " ".join(f"{n}={m[k]:.3g}" for k, n in keys if k in m)


if __name__ == "__main__":
    train(tyro.cli(Config))
    dist.destroy_process_group()
