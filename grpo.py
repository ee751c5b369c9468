"""grpo.py -- GRPO (and friends) for vision-language models, in one loop you can read top to bottom.

    python grpo.py                                    # the demo: tiny VLM built in code, synthetic colour task
    torchrun --nproc_per_node 8 grpo.py --model-path Qwen/Qwen2.5-VL-7B-Instruct --train-files hiyouga/geometry3k@train ...

One step:  sync -> sample -> score -> advantage -> (old / ref log-probs) -> clipped loss + KL -> optimizer step.
The algorithm lives in the middle section (advantages, KL estimators, policy losses, loss aggregation); the rest
is plumbing. dapo.py imports this file and swaps in dynamic sampling and overlong shaping.
"""
import contextlib
import functools
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import tyro

import data
import flops
import fsdp_actor as A
from data import UserError
import rundir


# ================================================================================================ config
@dataclass
class Config:
    # --- model and data (empty model_path / train_files = the built-in demo) ---
    model_path: str = ""  # HF hub name or local folder; "" builds the tiny demo VLM in code
    # the tiny model built when model_path is "" (and its task when train_files is ""): qwen2_5_vl and qwen3_vl
    # answer the colour task, the text-only qwen3 the largest-digit task (with TEXT_DEMO's settings)
    demo_model: Literal["qwen2_5_vl", "qwen3_vl", "qwen3"] = "qwen2_5_vl"
    train_files: str = ""  # hub "name@split", a parquet/json/jsonl file or a folder; "" = the synthetic colour task
    val_files: str = ""  # validation data, same forms; "" = none (the demo: 200 unseen pictures)
    prompt_key: str = "problem"  # column with the question text (<image> marks where each image goes)
    answer_key: str = "answer"  # column with the ground truth the reward function compares against
    image_key: str = "images"  # column with the list of images (bytes, paths or PIL images)
    image_dir: str | None = None  # folder that relative image paths in the data start from
    format_prompt: str | None = None  # jinja template (string or .jinja file) around {{ content }}
    reward_function: str = "math"  # math | r1v | color | dapo | path/to/file.py:fn (an EasyR1 reward file)
    reward_function_kwargs: str = ""  # JSON object of keyword arguments for the reward function, as EasyR1's
    max_prompt_length: int = 2048  # prompt tokens, image tokens included
    max_response_length: int = 2048  # generated tokens per sample at most
    min_pixels: int = 262144  # smaller images are scaled up to this many pixels (keeping their aspect)
    max_pixels: int = 4194304  # larger images are scaled down to this many pixels
    filter_overlong_prompts: bool = True  # drop (and list) prompts over max_prompt_length; off: they are bad rows
    skip_bad_rows: bool = False  # drop rows the data check rejects (and list them) instead of stopping
    # --- rollout ---
    rollout_engine: Literal["auto", "vllm", "hf"] = "auto"  # auto = vllm when it imports and CUDA is there, else hf
    n: Annotated[int, tyro.conf.arg(aliases=("--rollout-n", "--num-generations"), help=(
        "samples per prompt (the group); under torchrun spell it --rollout-n: torchrun reads --n as its --nnodes"))] = 5
    temperature: float = 1.0  # sampling temperature of the training rollouts (> 0)
    top_p: float = 1.0  # nucleus sampling of the training rollouts; 1 = off
    val_temperature: float = 0.0  # sampling temperature of validation; 0 = greedy (EasyR1's example: 0.6, top_p 0.95)
    val_top_p: float = 1.0  # nucleus sampling of validation
    tensor_parallel_size: int = 1  # vLLM tensor parallelism; data parallel engines = world size / this
    gpu_memory_utilization: float = 0.6  # share of GPU memory vLLM may take for weights and KV cache
    max_num_batched_tokens: int = 8192  # vLLM: tokens per engine step
    enforce_eager: bool = False  # vLLM without CUDA graphs (slower, starts faster)
    sleep_level: int = 1  # 1: engine weights wait in CPU memory while training; 2: dropped, re-sent before generating
    limit_images: int = 1  # images per prompt the engine accepts (EasyR1's limit_images); raise for multi-image data
    # --- batch arithmetic (EasyR1's names: batch sizes count prompts, micro-batches count samples) ---
    rollout_batch_size: int = 512  # prompts per step, over all ranks
    global_batch_size: int = 128  # prompts per optimizer step; rollout_batch_size / global_batch_size updates per step
    ppo_epochs: int = 1  # passes over each rollout batch
    micro_batch_size_per_device: int = 64  # samples per forward/backward, at most
    max_token_len_per_device: int = 16384  # padded tokens per forward/backward, at most
    # --- optimisation ---
    lr: float = 1e-6  # AdamW learning rate; the demo's tiny model, trained from scratch, uses 1e-3
    weight_decay: float = 1e-2  # AdamW's decoupled weight decay
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup, then constant
    max_grad_norm: float = 1.0  # clip the gradient norm; a step with a non-finite norm is skipped
    max_skipped_steps: int = 3  # stop when this many optimizer steps in a row were skipped; 0 = never stop
    # --- the algorithm ---
    adv_estimator: Annotated[Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"],
                             tyro.conf.arg(help="rewards -> advantages; veRL's names and formulas: reinforce_plus_plus "
                                           "has no group baseline, reinforce_plus_plus_baseline removes the group mean "
                                           "(README: Algorithms)")] = "grpo"
    loss_type: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"  # policy loss: per-token / sequence ratio / CISPO
    loss_avg_mode: Literal["token", "seq", "seq-mean-token-sum-norm"] = "token"  # how token losses are averaged
    clip_ratio_low: float = 0.2  # PPO clip: the ratio may fall to 1 - this
    clip_ratio_high: float = 0.3  # PPO clip: the ratio may rise to 1 + this
    clip_ratio_dual: float = 3.0  # dual clip: bounds the loss of negative-advantage tokens with huge ratios
    gspo_dual_clip: bool = False  # also dual-clip GSPO's sequence ratio, as EasyR1 does (the paper and veRL do not)
    cispo_clip_low: bool = False  # bound CISPO's weight below by 1 - clip_ratio_low, as EasyR1/veRL (the paper: none)
    kl_coef: float = 1e-2  # weight of the KL-to-reference loss term; 0 drops the reference model entirely
    kl_penalty: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = "low_var_kl"  # KL estimator (k3 = low_var_kl)
    # truncated importance sampling from the engine's own log-probs (veRL's rollout_is, TRL's vllm_importance_sampling)
    rollout_correction: Literal["none", "tis"] = "none"  # tis: weight each token's loss by pi_old / pi_engine, capped
    rollout_correction_level: Literal["token", "sequence"] = "token"  # one weight per token, or per sequence
    rollout_correction_cap: float = 2.0  # weights above it are truncated to it (veRL's rollout_is_threshold)
    # --- engineering ---
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # compute dtype; auto = bf16 on GPU, fp32 on CPU
    freeze_vision_tower: bool = False  # train the language model only (the vision tower keeps its weights)
    lora_rank: int = 0  # LoRA (peft) rank; 0 = full fine-tuning. With LoRA only adapters train: the vision tower is frozen unless targeted
    lora_alpha: int = 64  # LoRA scale = alpha / rank (EasyR1's default)
    lora_target_modules: str = "all-linear"  # comma-separated module names, or peft's "all-linear"
    lora_exclude_modules: str = r".*visual.*"  # regex of modules left without adapters (vLLM has no vision LoRA)
    lora_modules_to_save: str = ""  # comma-separated modules trained in full beside the adapters (peft's), e.g. lm_head
    gradient_checkpointing: bool = True  # recompute activations in backward: less memory, ~1/3 more compute
    attn_implementation: str | None = None  # e.g. flash_attention_2; None = transformers' default (sdpa)
    padding_free: Literal["auto", "on", "off"] = "auto"  # one packed row per micro-batch (varlen attention); auto: where a fast kernel runs
    vision_varlen: Literal["auto", "on", "off"] = "auto"  # the vision tower's windows in one attention call per layer
    logprob_chunk_size: int = 4096  # tokens per chunk of the vocabulary projection (memory vs speed)
    peak_tflops: float = 989.0  # per GPU, for perf/mfu_*: H100/H200 dense bf16 (the figure veRL and EasyR1 use)
    # --- trainer ---
    max_steps: int = 0  # training steps (one rollout batch each); 0 = total_epochs passes over the training data
    total_epochs: int = 15  # EasyR1's: used when max_steps is 0
    val_freq: int = 5  # validate every k steps and at the end; 0 = never
    val_before_train: bool = True  # validate once before the first step
    val_max_rows: int = 0  # validate on the first k rows; 0 = the whole validation set
    save_freq: int = 5  # checkpoint every k steps and at the end; 0 = only at the end; -1 = never (benchmarks)
    save_limit: int = 3  # keep the newest k checkpoints (12 bytes/param each) and the best by val/mean; 0 = all
    output_dir: str = "outputs/run"  # metrics, samples, config and checkpoints go here
    resume: str = "auto"  # auto (the newest checkpoint of output_dir) | never (a new run only) | checkpoints/step_N
    config: str | None = None  # an EasyR1 YAML config (examples/config.yaml, unchanged); flags override it
    seed: int = 1  # data order, sampling seeds and initialisation
    log_samples: int = 4  # generations written to samples.jsonl per step
    logger: Annotated[list[Literal["console", "jsonl", "tensorboard", "wandb"]], tyro.conf.arg(
        help="experiment trackers; jsonl is always on; wandb runs offline without an API key")] = field(
        default_factory=lambda: ["console", "jsonl"])
    project_name: str = "vlm_rl"  # for wandb
    experiment_name: str = ""  # for wandb; "" = the output folder's name
    debug_skip_sync: bool = False  # never send new weights to the engine: rollout/logprob_diff_* must then grow


# The defaults above are EasyR1's (examples/config.yaml). The demo (no --model-path) trains a tiny model from scratch
# on one-word answers about small pictures, so it gets its own; a value given on the command line wins in both.
DEMO = dict(reward_function="color", max_prompt_length=512, max_response_length=4, min_pixels=56 * 56,
            max_pixels=112 * 112, n=16, rollout_batch_size=16, global_batch_size=16, lr=1e-3, max_steps=150,
            val_freq=10, save_freq=10, output_dir="outputs/demo")
# The text demo (--demo-model qwen3) changes five more: its own reward; answers of one digit, i.e. one token; groups
# of 32; half the colour demo's lr; rollouts sampled at temperature 1.5. A digit the policy stops sampling is never
# learned: at lr 1e-3 (groups of 64; lists of different digits) it stopped answering 2 and 8, validation stuck at
# 0.765; at lr 5e-4 and temperature 1 it lost only the 2 (0.94); at 1.5 it kept every digit (1.0; README).
TEXT_DEMO = dict(reward_function="number", max_response_length=1, n=32, lr=5e-4, temperature=1.5)


# ================================================================================================ algorithm
def compute_advantages(rewards, estimator="grpo", lengths=None, eps=1e-6):
    """rewards [G, n] (n samples of each of G prompts) -> advantages [G, n], one scalar per sample (every token of
    a response shares it). lengths [G, n]: response tokens per sample, the REINFORCE++ whitening weights (default:
    all equal)."""
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
    if estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        # veRL's compute_reinforce_plus_plus(_baseline)_outcome_advantage. With one outcome reward and gamma 1
        # every response token's return is its sample's reward (the baseline variant first removes the group
        # mean; a lone sample keeps its reward, as veRL's mean of 0). Then masked_whiten over all response tokens
        # of the global batch: a token-weighted mean and unbiased variance, summed over ranks.
        x = rewards.double()
        if estimator == "reinforce_plus_plus_baseline" and n > 1:
            x = x - x.mean(dim=1, keepdim=True)
        w = torch.ones_like(x) if lengths is None else torch.as_tensor(lengths, dtype=torch.float64).view(G, n)
        cnt, s = A.all_reduce_cpu([w.sum(), (w * x).sum()]).tolist()
        if cnt <= 1:  # one token or none: nothing to whiten (veRL raises)
            return torch.zeros_like(rewards)
        mean = s / cnt  # veRL adds 1e-8 to this denominator; left out so that equal rewards give exactly 0
        var = float(A.all_reduce_cpu((w * (x - mean).square()).sum())) / (cnt - 1)  # Bessel over tokens
        return ((x - mean) / math.sqrt(var + 1e-8)).to(rewards.dtype)
    raise ValueError(f"adv_estimator={estimator!r}: choose grpo, dr_grpo, rloo, reinforce_plus_plus or "
                     "reinforce_plus_plus_baseline")


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


def policy_loss(logp, old_logp, adv, mask, loss_type="ppo_clip", clip_low=0.2, clip_high=0.3, clip_dual=3.0,
                gspo_dual_clip=False, cispo_clip_low=False):
    """Per-token policy loss [B, R] for logp/old_logp [B, R], adv [B], mask [B, R]; plus clip metrics.
    gspo_dual_clip / cispo_clip_low: EasyR1's versions of GSPO (dual-clipped) and CISPO (weight bounded below)."""
    adv = adv[:, None]  # [B, 1]
    log_ratio = (logp - old_logp).clamp(-20, 20)
    if loss_type == "gspo":  # GSPO: one length-normalised ratio per sequence, gradient still flows per token
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()
    ratio = log_ratio.exp()
    if loss_type == "cispo":  # CISPO: clip (and detach) the importance weight, keep every token's gradient
        lo = 1 - clip_low if cispo_clip_low else None  # the paper leaves small weights unbounded
        weight = ratio.clamp(min=lo, max=1 + clip_high).detach()
        loss = -adv * weight * logp
        clipped = (weight != ratio).float()
        return loss, {"clipfrac": clipped, "dual_clipfrac": torch.zeros_like(ratio)}
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).float()
    if (loss_type == "ppo_clip" or gspo_dual_clip) and clip_dual > 1:  # dual clip (negative advantages only)
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


def rollout_correction_weights(old_logp, rollout_logp, mask, level="token", cap=2.0):
    """Truncated importance sampling (TIS) for the trainer/engine mismatch: the engine sampled from pi_rollout, the
    loss assumes pi_old (the trainer's log-probs at the same weights). Weights pi_old / pi_rollout per token (or
    their product per sequence), truncated at `cap`, no gradient; they multiply the per-token policy loss. The
    formula of veRL (compute_rollout_correction_weights: exp of the log-ratio clamped to +-20, masked, clamp(max=cap),
    detached) and TRL (token_truncate / sequence_truncate). Returns (weights [B, R], stats: sums and counts)."""
    log_ratio = (old_logp - rollout_logp) * mask  # [B, R]
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)  # [B, 1]
    elif level != "token":
        raise ValueError(f"rollout_correction_level={level!r}: choose token or sequence")
    raw = log_ratio.clamp(-20, 20).exp()  # [B, R] or [B, 1]
    units = mask if level == "token" else mask.any(-1, keepdim=True)  # tokens, or sequences with a token
    w = (raw.clamp(max=cap) * mask).detach()  # [B, R]
    units_f = units.to(raw.dtype)
    stats = {"mean": ((w * mask).sum(), mask.sum()), "capped_frac": (((raw > cap) * units_f).sum(), units_f.sum()),
             "max": raw.detach().masked_fill(~units, 0).max()}
    return w, stats


# ================================================================================================ setup
def check_config(cfg: Config, world: int):
    """What can be checked before any process group or model loads: every rank raises the same UserError."""
    positive = {"lr": cfg.lr, "max-response-length": cfg.max_response_length,
                "max-prompt-length": cfg.max_prompt_length, "temperature": cfg.temperature}  # log-probs divide by it
    for opt, v in positive.items():
        if not v > 0:
            raise UserError(f"--{opt} {v}: must be > 0" + " (greedy is for --val-temperature)" * (opt == "temperature"))
    for opt, v in {"rollout-n": cfg.n, "rollout-batch-size": cfg.rollout_batch_size,
                   "global-batch-size": cfg.global_batch_size, "ppo-epochs": cfg.ppo_epochs}.items():
        if v < 1:
            raise UserError(f"--{opt} {v}: must be at least 1")
    rb, gb = cfg.rollout_batch_size, cfg.global_batch_size
    if gb > rb:
        raise UserError(f"--global-batch-size {gb} is larger than --rollout-batch-size {rb}: an optimizer step cannot "
                        "use more prompts than a rollout step makes; lower it")
    if rb % gb or gb % world:  # then world divides rollout_batch_size too
        raise UserError(f"--global-batch-size {gb} must divide --rollout-batch-size {rb} and be a multiple of the "
                        f"number of ranks ({world})")
    data.check_model_path(cfg.model_path)
    data.check_source(cfg.train_files, "--train-files")
    data.check_source(cfg.val_files, "--val-files")
    try:  # a run that cannot write its checkpoints should fail now, not after its first hour
        os.makedirs(cfg.output_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=cfg.output_dir).close()
    except OSError as e:
        raise UserError(f"--output-dir {cfg.output_dir}: cannot write there ({e.strerror or e})") from e


def setup(cfg: Config):
    """Everything the loop needs, in one namespace: distributed state, data, reward, policy, reference, engine."""
    import data
    import rewards
    import rollout
    check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    text_demo = not cfg.model_path and not cfg.train_files and cfg.demo_model == "qwen3"  # the largest-digit task
    reward_fn = rewards.get_reward_fn(cfg.reward_function, cfg.reward_function_kwargs)
    rank, world, device = A.init_distributed()
    ckpt, state = rundir.find_resume(cfg)  # refuses a changed config before anything loads
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    ctx = SimpleNamespace(cfg=cfg, rank=rank, world=world, device=device, reward_fn=reward_fn, ckpt=ckpt,
                          start_step=0, cursor=0, skipped_run=0, skipped_total=0)
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
        make = data.demo_max_data if text_demo else data.demo_data
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
                   min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, max_prompt_length=cfg.max_prompt_length,
                   filter_overlong=cfg.filter_overlong_prompts, skip_bad_rows=cfg.skip_bad_rows)
    # every row is checked here, before the model loads; the same on every rank, so all raise together
    ctx.train = data.PromptDataset(train_files, option="--train-files", **data_kw)
    ctx.val = data.PromptDataset(val_files, option="--val-files", **data_kw) if val_files else None
    for note in ctx.train.notes + (ctx.val.notes if ctx.val else []):
        log0(ctx, note)
    if len(ctx.train) < cfg.rollout_batch_size:
        raise UserError(f"--train-files {train_files}: {len(ctx.train)} usable prompts < --rollout-batch-size "
                        f"{cfg.rollout_batch_size}; lower --rollout-batch-size or add data")
    if cfg.max_steps <= 0:  # EasyR1's total_epochs: an epoch is as many steps as whole rollout batches fit in the data
        cfg.max_steps = cfg.total_epochs * (len(ctx.train) // cfg.rollout_batch_size)
    ctx.done = bool(state and state["step"] >= cfg.max_steps)
    if ctx.done:
        log0(ctx, f"[resume] {ckpt} is step {state['step']} of --max-steps {cfg.max_steps}: the run is already "
                  "complete, nothing to do (raise --max-steps to train on, or start a new run in another --output-dir)")
        return ctx
    # --- policy (fp32 master weights), reference (frozen, compute dtype), rollout engine (its own weights) ---
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    ctx.compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
    ctx.lora = dict(r=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_target_modules,
                    exclude_modules=cfg.lora_exclude_modules, modules_to_save=cfg.lora_modules_to_save
                    ) if cfg.lora_rank > 0 else None
    ctx.model = A.build_actor(ctx.model_path, device, torch.float32, ctx.compute_dtype,
                              cfg.gradient_checkpointing, cfg.attn_implementation,
                              freeze_vision_tower=cfg.freeze_vision_tower, lora=ctx.lora,
                              padding_free=cfg.padding_free, vision_varlen=cfg.vision_varlen)
    ctx.ref = None
    if cfg.kl_coef > 0 and not ctx.lora:  # with LoRA the reference is the policy with its adapters switched off
        ctx.ref = A.build_actor(ctx.model_path, device, ctx.compute_dtype, ctx.compute_dtype,
                                attn_implementation=cfg.attn_implementation, trainable=False,
                                padding_free=cfg.padding_free, vision_varlen=cfg.vision_varlen)
    ctx.opt, ctx.sched = A.build_optimizer(ctx.model, cfg.lr, cfg.weight_decay, (0.9, 0.999), cfg.lr_warmup_steps,
                                           device)
    ctx.rollout = rollout.make_rollout(cfg.rollout_engine, model_path=ctx.model_path, device=device,
                                       dtype=ctx.compute_dtype, cfg=cfg)
    ctx.engine_stale = True  # the engine loaded the same weights, but syncing on step 1 too keeps every step alike
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


def generate_and_score(ctx, drawn, n, temperature, top_p=None, lengths=None):
    """Sample n responses per prompt and score them. Returns a flat list of sample dicts, grouped by prompt.
    lengths (bench.py's realistic workload): per prompt, n forced response lengths (EOS ignored)."""
    cfg = ctx.cfg
    prompts = [rec for _, rec in drawn]
    seeds = [(cfg.seed * 1_000_003 + pos) % 2**31 for pos, _ in drawn]
    outs = ctx.rollout.generate(prompts, n=n, temperature=temperature, top_p=cfg.top_p if top_p is None else top_p,
                                max_tokens=cfg.max_response_length, seeds=seeds,
                                **({"lengths": lengths} if lengths is not None else {}))
    samples = [dict(prompt=p, response_ids=list(o["response_ids"]), finished=o["finished"],
                    rollout_logp=o.get("logprobs"), group=g)
               for g, (p, group) in enumerate(zip(prompts, outs)) for o in group]
    texts = ctx.tokenizer.batch_decode([s["response_ids"] for s in samples], skip_special_tokens=True)
    items = [{"response": t, "response_length": len(s["response_ids"]), "ground_truth": s["prompt"]["answer"]}
             for t, s in zip(texts, samples)]
    scores = ctx.reward_fn(items)
    import rewards  # a NaN or missing score stops the run here, naming the sample
    rewards.check_scores(scores, items, [s["prompt"]["prompt_text"] for s in samples], cfg.reward_function)
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
    # metric -> [sum, count] over all micro-batches, all-reduced at the end; max metric -> running max. Values stay
    # tensors on the device until then: a float() per micro-batch would make the host wait for the GPU each time.
    sums, maxes, skipped = {}, {}, 0

    def add(k, v, c=1.0):
        s = sums.setdefault(k, [0.0, 0.0])
        s[0], s[1] = s[0] + (v.detach().double() if torch.is_tensor(v) else v), s[1] + c

    def add_max(k, v):
        maxes[k] = torch.maximum(maxes[k], v.detach().double()) if k in maxes else v.detach().double()

    if cfg.rollout_correction == "tis" and any(s.get("rollout_logp") is None for s in samples):
        raise ValueError("--rollout-correction tis needs the engine's log-probs of its samples, and this rollout "
                         "returned none; use --rollout-correction none")
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
                                            [id(s["prompt"]) for s in mini], packed=ctx.model.packed):
                mb = [mini[i] for i in idx]
                batch, resp_len = A.collate(mb, ctx.pad_id, dev, ctx.model)
                add("perf/pad_fraction", batch["input_ids"].numel() - sum(lengths[i] for i in idx),
                    batch["input_ids"].numel())
                lp, ent = ctx.model(**batch, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)  # [N]
                logp, mask = A.pad_responses(lp, resp_len)  # [b, R]
                mask = mask & A.to_device(torch.tensor([s.get("loss_mask", 1) > 0 for s in mb]), dev)[:, None]
                R = logp.shape[1]
                if mb[0].get("old_logp") is not None:
                    old = A.stack_padded([s["old_logp"] for s in mb], R, dev)
                else:  # on-policy: the first forward *is* the old policy
                    old = logp.detach()
                adv = A.to_device(torch.tensor([s["adv"] for s in mb], dtype=logp.dtype), dev)  # [b]
                tok_loss, clip = policy_loss(logp, old, adv, mask, cfg.loss_type, cfg.clip_ratio_low,
                                             cfg.clip_ratio_high, cfg.clip_ratio_dual, cfg.gspo_dual_clip,
                                             cfg.cispo_clip_low)
                roll = None
                if all(s.get("rollout_logp") is not None for s in mb):
                    roll = A.stack_padded([s["rollout_logp"] for s in mb], R, dev)  # [b, R] the engine's
                if cfg.rollout_correction == "tis":
                    w, st = rollout_correction_weights(old, roll, mask, cfg.rollout_correction_level,
                                                       cfg.rollout_correction_cap)
                    tok_loss = tok_loss * w
                    add("rollout_corr/weight_mean", *st["mean"])
                    add("rollout_corr/capped_frac", *st["capped_frac"])
                    add_max("rollout_corr/weight_max", st["max"])
                norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=cfg.max_response_length)
                pg_loss = agg_loss(tok_loss, mask, cfg.loss_avg_mode, **norm)
                loss = pg_loss
                if cfg.kl_coef > 0:
                    ref = A.stack_padded([s["ref_logp"] for s in mb], R, dev)
                    kl = kl_penalty(logp, ref, cfg.kl_penalty)
                    loss = loss + cfg.kl_coef * agg_loss(kl, mask, cfg.loss_avg_mode, **norm)
                    add("actor/kl", (kl.detach() * mask).sum(), mask.sum())
                # FSDP averages gradients over ranks; the normalisers are already global, so undo the average
                (loss * ctx.world).backward()
                add("actor/pg_loss", pg_loss, 0.0)  # already a share of the global loss: just sum
                add("actor/loss", loss, 0.0)
                ent_p, _ = A.pad_responses(ent, resp_len)
                add("actor/entropy", (ent_p * mask).sum(), mask.sum())
                add("actor/clipfrac", (clip["clipfrac"] * mask).sum(), mask.sum())
                add("actor/dual_clipfrac", (clip["dual_clipfrac"] * mask).sum(), mask.sum())
                if epoch == 0 and m == 0 and roll is not None:
                    # trainer/rollout mismatch at the weights that generated the samples (before any update)
                    diff = ((logp.detach() - roll).abs() * mask)
                    add("rollout/logprob_diff_mean", diff.sum(), mask.sum())
                    add_max("rollout/logprob_diff_max", diff.max())
            grad_norm = A.optimizer_step(ctx.model, ctx.opt, ctx.sched, cfg.max_grad_norm)  # the same on every rank
            add("actor/grad_norm", grad_norm)
            add("actor/lr", ctx.sched.get_last_lr()[0])
            skipped += not math.isfinite(grad_norm)
            ctx.skipped_run = 0 if math.isfinite(grad_norm) else ctx.skipped_run + 1
            if cfg.max_skipped_steps and ctx.skipped_run >= cfg.max_skipped_steps:  # before any checkpoint is saved
                raise UserError(f"stopped at step {ctx.step + 1}: the last {ctx.skipped_run} optimizer steps were "
                                f"skipped (gradient norm {grad_norm}); nothing of this step was saved. Check the data "
                                "and reward, lower --lr, or raise --max-skipped-steps (0 = never stop)")
    # losses are already global fractions: sum them over ranks and micro-batches, mean over optimizer steps
    keys, mkeys = sorted(sums), sorted(maxes)
    local = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=dev) for k in keys for x in sums[k]]
                        + [maxes[k] for k in mkeys]).cpu()  # the one wait for the GPU
    red = A.all_reduce_cpu(local[:2 * len(keys)].view(-1, 2))
    out = {}
    n_steps = n_mini * cfg.ppo_epochs
    for k, (v, c) in zip(keys, red.tolist()):
        if k in ("actor/pg_loss", "actor/loss"):
            out[k] = v / n_steps
        elif k in ("actor/grad_norm", "actor/lr"):
            out[k] = v / c  # same on every rank
        else:
            out[k] = v / max(c, 1)
    if mkeys:
        out.update(zip(mkeys, A.all_reduce_cpu(local[2 * len(keys):], op=dist.ReduceOp.MAX).tolist()))
    ctx.skipped_total += skipped
    out["actor/skipped_steps"], out["actor/skipped_steps_total"] = skipped, ctx.skipped_total
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
    lengths = torch.tensor([len(s["response_ids"]) for s in samples]).view(-1, cfg.n)  # [G, n]
    adv = compute_advantages(rewards, cfg.adv_estimator, lengths)  # [G, n]
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
    if cfg.kl_coef > 0:
        t = time.time()
        with A.adapters_disabled(ctx.model) if ctx.lora else contextlib.nullcontext():
            ref, _ = A.compute_logprobs(ctx.ref or ctx.model, samples, **mb_kw)
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
    # MFU: model FLOPs of the step's real tokens (veRL's convention, flops.py) over the phase's seconds x peak
    fwd = float(A.all_reduce_cpu(flops.forward_flops(ctx.model.hf.config, samples)))  # one pass, all ranks
    peak = cfg.peak_tflops * 1e12 * ctx.world
    metrics["perf/mfu_update"] = 3 * cfg.ppo_epochs * fwd / (T["update"] * peak)  # forward + backward per epoch
    if "ref_logprob" in T:
        metrics["perf/mfu_ref"] = fwd / (T["ref_logprob"] * peak)
    metrics.update(memory_metrics(ctx))
    metrics["step"] = step + 1
    return metrics, samples


def sync_engine(ctx):
    """Stream the policy's weights into the engine if it is behind (or dropped them in a level-2 sleep). Returns
    the seconds spent. Every rank takes part: each DTensor is all-gathered."""
    if ctx.cfg.debug_skip_sync or not (ctx.engine_stale or getattr(ctx.rollout, "weights_lost", False)):
        return 0.0
    t = time.time()
    # LoRA: the engine loaded the base weights itself; only the merged LoRA layers change (unless a level-2
    # sleep dropped everything)
    lora_only = bool(ctx.lora) and not getattr(ctx.rollout, "weights_lost", False)
    ctx.rollout.sync_weights(A.iter_full_params(ctx.model, ctx.compute_dtype, lora_only=lora_only))
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
        samples += generate_and_score(ctx, drawn, 1, cfg.val_temperature, cfg.val_top_p)
    ctx.rollout.sleep()
    return sample_metrics(ctx, samples, "val")


# ================================================================================================ main loop
def train(cfg: Config, collect=collect_rollouts):
    ctx = setup(cfg)
    if ctx.done:
        return ctx
    print_batch_arithmetic(ctx)
    dist.barrier()  # every rank has read the folder (find_resume) before rank 0 changes it
    if ctx.rank == 0:  # logs cut back to the resumed step, config.json for a new run
        rundir.prepare(cfg, ctx.start_step, ctx.ckpt)
    dist.barrier()
    ctx.best = rundir.find_best(cfg.output_dir)  # (step, val/mean) of the best checkpoint: never deleted
    metrics_f = open(os.path.join(cfg.output_dir, "metrics.jsonl"), "a") if ctx.rank == 0 else None
    samples_f = open(os.path.join(cfg.output_dir, "samples.jsonl"), "a") if ctx.rank == 0 else None
    bar = None
    if ctx.rank == 0:
        from tqdm import tqdm
        rundir.write_best(cfg.output_dir, ctx.best)
        track, close_trackers = rundir.open_trackers(cfg, ctx.start_step)
        bar = tqdm(total=cfg.max_steps, initial=ctx.start_step, dynamic_ncols=True,
                   desc=os.path.basename(sys.argv[0]).removesuffix(".py") or "train")
    if cfg.val_freq and cfg.val_before_train and ctx.val is not None and ctx.start_step == 0:
        val = validate(ctx)
        log0(ctx, "[val] step 0 " + " ".join(f"{k}={v:.3f}" for k, v in val.items()))
        if metrics_f:
            metrics_f.write(json.dumps({"step": 0, **val}) + "\n")
            metrics_f.flush()
            track(val, 0)
    for step in range(ctx.start_step, cfg.max_steps):
        metrics, samples = train_step(ctx, step, collect)
        last = step + 1 == cfg.max_steps
        if cfg.val_freq and ctx.val is not None and ((step + 1) % cfg.val_freq == 0 or last):
            t = time.time()
            metrics.update(validate(ctx))
            metrics["timing/val"] = time.time() - t
        if cfg.save_freq >= 0 and ((cfg.save_freq and (step + 1) % cfg.save_freq == 0) or last):
            t = time.time()
            rundir.save(ctx, step + 1, metrics, say=bar.write if bar else print)  # keeps the best by val/mean
            metrics["timing/save"] = time.time() - t
        if ctx.rank == 0:
            metrics_f.write(json.dumps(metrics) + "\n")
            metrics_f.flush()
            for s in samples[:cfg.log_samples]:
                samples_f.write(json.dumps({"step": step + 1, "prompt": s["prompt"]["prompt_text"],
                                            "response": s["text"], "answer": s["prompt"]["answer"],
                                            "reward": s["reward"]}) + "\n")
            samples_f.flush()
            track(metrics, step + 1)
            if "val/mean" in metrics or (step + 1) % 10 == 0 or last:
                rundir.plot_rewards(cfg)  # ~0.3 s: reward.png follows the run
            bar.update(1)
            if "console" in cfg.logger:
                bar.write(format_line(metrics))
    if bar:
        bar.close()
        close_trackers()
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


def main(config_cls=Config, collect=collect_rollouts, demo=DEMO, text_demo=TEXT_DEMO):
    """The command line: defaults (EasyR1's, or the demo's), an EasyR1 --config, the flags; then train. A UserError
    (a bad option, file, row or reward) ends the run with one `error:` line and exit code 2."""
    from easyr1_config import cli
    with data.one_line_errors():
        train(cli(config_cls, demo, text_demo=text_demo), collect)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
