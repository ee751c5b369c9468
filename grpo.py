"""grpo.py -- GRPO (and friends) for vision-language models, in one loop you can read top to bottom.

    python grpo.py                                    # the demo: tiny VLM built in code, synthetic colour task
    torchrun --nproc_per_node 8 grpo.py --model-path Qwen/Qwen2.5-VL-7B-Instruct --train-files hiyouga/geometry3k@train ...

One step:  sync -> sample -> score -> advantage -> (old / ref log-probs) -> clipped loss + KL -> optimizer step.
The algorithm lives in the middle section (advantages, KL estimators, policy losses, loss aggregation); the rest
is plumbing. dapo.py imports this file and swaps in dynamic sampling and overlong shaping.
"""
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

import torch
import torch.distributed as dist
import tyro

import data
import easyr1_config
import fsdp_actor as actor
import memory
import rollout
import rundir
import tiny_model
from data import UserError


# ================================================================================================ config
@dataclass
class Config:
    # --- model and data (empty model_path / train_files = the built-in demo) ---
    model_path: str = ""  # HF hub name or local folder; "" builds the tiny demo VLM in code
    # the demo's tiny model (no model_path): qwen2_5_vl / qwen3_vl (colour or video task), qwen3 / llama (largest digit)
    demo_model: Literal["qwen2_5_vl", "qwen3_vl", "qwen3", "llama"] = "qwen2_5_vl"
    demo_task: Literal["color", "video"] = "color"  # the VL demos' task: a picture's colour, or a clip's last colour
    train_files: str = ""  # hub "name@split", a parquet/json/jsonl file or a folder; "" = the synthetic colour task
    val_files: str = ""  # validation data, same forms; "" = none (the demo: 200 unseen pictures)
    prompt_key: str = "problem"  # column with the question text (<image> marks where each image goes)
    answer_key: str = "answer"  # column with the ground truth the reward function compares against
    image_key: str = "images"  # column with the list of images (bytes, paths or PIL images)
    image_dir: str | None = None  # folder that relative image (and video) paths in the data start from
    video_key: str = "videos"  # column with the list of videos (each a video file path or a list of frames)
    video_fps: float = 2.0  # frames per second taken from a video file; a list of frames is taken to be this far apart
    max_frames: int = 768  # frames per video at most (evenly spread over it when it has more)
    video_min_pixels: int | None = None  # pixels per frame at least (Qwen3-VL: per clip); None = min_pixels
    video_max_pixels: int | None = None  # pixels per frame at most (Qwen3-VL: per clip); None = max_pixels (EasyR1)
    format_prompt: str | None = None  # jinja template (string or .jinja file) around {{ content }}
    reward_function: str = "math"  # math | r1v | color | dapo | path/to/file.py:fn (an EasyR1 reward file)
    reward_function_kwargs: str = ""  # JSON object of keyword arguments for the reward function, as EasyR1's
    max_prompt_length: int = 2048  # prompt tokens, image tokens included
    max_response_length: int = 2048  # generated tokens per sample at most
    min_pixels: int = data.MIN_PIXELS  # smaller images are scaled up to this many pixels (keeping their aspect)
    max_pixels: int = data.MAX_PIXELS  # larger images are scaled down to this many pixels
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
    kv_cache_memory_gb: float = 0.0  # vLLM's KV cache (GiB) set, not profiled: runs can share a GPU; 0 = measured
    max_num_batched_tokens: int = 8192  # vLLM: tokens per engine step
    enforce_eager: bool = False  # vLLM without CUDA graphs (slower, starts faster)
    sleep_level: int = 1  # 1: engine weights wait in CPU memory while training; 2: dropped, re-sent before generating
    limit_images: int = 1  # images per prompt the engine accepts (EasyR1's limit_images); raise for multi-image data
    limit_videos: int = 0  # videos per prompt the engine accepts; 0 = the most any training or validation row has
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
    precision: Literal["amp", "bf16"] = "amp"  # amp: fp32 master weights, compute in --dtype; bf16: weights, gradients and AdamW state in bf16 (10 bytes per parameter against 16; README: Memory modes)
    bf16_rounding: Literal["kahan", "stochastic", "nearest"] = "kahan"  # how --precision bf16 keeps updates below half a bf16 ulp (nearest loses them; README: Memory modes)
    offload_params: bool = False  # policy weights, gradients and AdamW state on the host (FSDP2's CPUOffloadPolicy; the step runs there), and the reference model between its uses
    offload_optimizer: bool = False  # AdamW state on the host between optimizer steps (in for the step, out after it)
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
    torch_compile: Literal["auto", "on", "off"] = "auto"  # fused norm/MLP/rotary/log-prob kernels; auto: CUDA, bf16, hidden >= 1024
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
    logger: Annotated[list[Literal["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow"]], tyro.conf.arg(
        help="trackers; jsonl always on; wandb, swanlab offline without an API key; mlflow: output_dir/mlflow.db")] = field(
        default_factory=lambda: ["console", "jsonl"])
    project_name: str = "vlm_rl"  # for wandb
    experiment_name: str = ""  # for wandb; "" = the output folder's name
    debug_skip_sync: bool = False  # never send new weights to the engine: rollout/logprob_diff_* must then grow


# The defaults above are EasyR1's (examples/config.yaml); the demos (no --model-path) have their own, where a flag
# does not say otherwise: tiny_model.DEMO, and TEXT_DEMO / VIDEO_DEMO on top for the text and the video demo.
from tiny_model import DEMO, TEXT_DEMO, VIDEO_DEMO  # noqa: E402


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
        cnt, s = actor.all_reduce_cpu([w.sum(), (w * x).sum()]).tolist()
        if cnt <= 1:  # one token or none: nothing to whiten (veRL raises)
            return torch.zeros_like(rewards)
        mean = s / cnt  # veRL adds 1e-8 to this denominator; left out so that equal rewards give exactly 0
        var = float(actor.all_reduce_cpu((w * (x - mean).square()).sum())) / (cnt - 1)  # Bessel over tokens
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


# ================================================================================================ setup
@dataclass
class State:
    """What one run holds: set up by setup(), read by every stage. cursor, engine_stale and the skip counters
    change as it trains; the rest stays."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    reward_fn: Callable  # list of {"response", "response_length", "ground_truth"} -> list of score dicts
    ckpt: str | None  # the checkpoint this run resumes from
    model_path: str  # the policy's starting weights (the demo's tiny model when --model-path is empty)
    processor: Any = None  # the HF processor of a VLM, or the tokenizer of a text LLM
    tokenizer: Any = None
    pad_id: int = 0
    train: Any = None  # data.PromptDataset: encoded prompts, checked row by row
    val: Any = None
    done: bool = False  # the resumed run was already complete
    compute_dtype: torch.dtype = torch.float32  # what the matmuls run in (bf16 on GPUs)
    lora: dict | None = None  # the LoRA settings, or None for full fine-tuning
    model: Any = None  # fsdp_actor.LogProbModel: the policy, FSDP2-sharded, fp32 master weights
    ref: Any = None  # the frozen reference; None when kl_coef is 0 or with LoRA (the policy, adapters off)
    opt: Any = None
    sched: Any = None
    rollout: Any = None  # the generation engine (rollout.VLLMRollout or rollout.HFRollout)
    start_step: int = 0
    cursor: int = 0  # position in the endless stream of prompts (a checkpoint saves it: exact resume)
    engine_stale: bool = True  # the engine's weights are older than the policy's (synced before it generates)
    skipped_run: int = 0  # optimizer steps skipped in a row (non-finite gradient norm)
    skipped_total: int = 0
    best: tuple | None = None  # (step, val/mean) of the best checkpoint, never deleted

    def say(self, *a):  # rank 0 prints
        rundir.log0(self, *a)


def setup(cfg: Config):
    """Everything the loop needs: distributed state, data, reward, policy, reference, engine."""
    import rewards
    import video
    easyr1_config.check(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    reward_fn = rewards.get_reward_fn(cfg.reward_function, cfg.reward_function_kwargs)
    rank, world, device = actor.init_distributed()
    ckpt, state = rundir.find_resume(cfg)  # refuses a changed config before anything loads
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    ctx = State(cfg=cfg, rank=rank, world=world, device=device, reward_fn=reward_fn, ckpt=ckpt,
                model_path=cfg.model_path)
    if not ctx.model_path:  # the demo: rank 0 builds the tiny model (cached), the others wait and read it
        ctx.model_path = tiny_model.build_tiny_model(arch=cfg.demo_model, rank=rank)
    ctx.processor, ctx.train, ctx.val = data.load_datasets(cfg, ctx.model_path, say=ctx.say)
    ctx.tokenizer = getattr(ctx.processor, "tokenizer", ctx.processor)
    ctx.pad_id = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else 0
    if cfg.max_steps <= 0:  # EasyR1's total_epochs: an epoch is as many steps as whole rollout batches fit in the data
        cfg.max_steps = cfg.total_epochs * (len(ctx.train) // cfg.rollout_batch_size)
    ctx.done = bool(state and state["step"] >= cfg.max_steps)
    if ctx.done:
        ctx.say(f"[resume] {ckpt} is step {state['step']} of --max-steps {cfg.max_steps}: the run is already "
                "complete, nothing to do (raise --max-steps to train on, or start a new run in another --output-dir)")
        return ctx
    # --- policy (fp32 master weights, or bf16), reference (frozen, compute dtype), rollout engine (its own weights) ---
    pure_bf16 = cfg.precision == "bf16"
    use_bf16 = pure_bf16 or cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    ctx.compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
    ctx.lora = dict(r=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_target_modules, exclude_modules=
                    cfg.lora_exclude_modules, modules_to_save=cfg.lora_modules_to_save) if cfg.lora_rank > 0 else None
    ctx.model = actor.build_actor(ctx.model_path, device, torch.bfloat16 if pure_bf16 else torch.float32,
                                  ctx.compute_dtype, cfg.gradient_checkpointing, cfg.attn_implementation,
                                  freeze_vision_tower=cfg.freeze_vision_tower, lora=ctx.lora,
                                  padding_free=cfg.padding_free, vision_varlen=cfg.vision_varlen,
                                  torch_compile=cfg.torch_compile, offload=cfg.offload_params)
    ctx.ref = None
    if cfg.kl_coef > 0 and not ctx.lora:  # with LoRA the reference is the policy with its adapters switched off
        ctx.ref = actor.build_actor(ctx.model_path, device, ctx.compute_dtype, ctx.compute_dtype,
                                    attn_implementation=cfg.attn_implementation, trainable=False,
                                    padding_free=cfg.padding_free, vision_varlen=cfg.vision_varlen,
                                    torch_compile=cfg.torch_compile, offload=cfg.offload_params)
    ctx.opt, ctx.sched = actor.build_optimizer(ctx.model, cfg.lr, cfg.weight_decay, (0.9, 0.999), cfg.lr_warmup_steps,
                                               device, bf16_rounding=cfg.bf16_rounding if pure_bf16 else None,
                                               seed=cfg.seed)
    videos = max(video.most_videos(d) for d in (ctx.train, ctx.val) if d is not None)
    allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    ctx.rollout = rollout.make_rollout(cfg.rollout_engine, ctx.model_path, device, ctx.compute_dtype,
                                       **rollout.engine_options(cfg, limit_videos=videos))
    memory.engine_built(ctx.rollout, allocated)  # the engine's memory outside its pool: not the trainer's
    memory.check_host_memory(cfg, ctx.model, ctx.rollout)  # offload: one line now, not the kernel's kill at step 1
    ctx.engine_stale = True  # the engine loaded the same weights, but syncing on step 1 too keeps every step alike
    if ckpt:
        state = rundir.load_checkpoint(ckpt, ctx.model, ctx.opt, ctx.sched)
        ctx.start_step, ctx.cursor = state["step"], state["cursor"]  # the engine is synced before step 1 anyway
        ctx.say(f"resumed from {ckpt} at step {ctx.start_step}")
    return ctx


# ================================================================================================ the step
# A sample is one response to one prompt, a dict that the stages below fill in as the step goes:
#   prompt         the prompt record (data.encode_prompt), shared by the n samples of the prompt
#   response_ids   the generated tokens (cut after EOS); finished: stopped by EOS rather than by the length cap
#   rollout_logp   the engine's log-prob of each sampled token (None when the engine gives none)
#   text, scores, reward   the decoded response, the reward function's dict for it and its "overall" value
#   adv            the advantage (one number for every token of the response)
#   old_logp, ref_logp     per-token log-probs of the policy before this step's update (only when it takes several
#                  optimizer steps) and of the reference (kl_coef > 0), both 1-D like response_ids
#   loss_mask      0 leaves the sample out of the loss and its normalisers (DAPO's overlong filtering sets it)
# Samples travel as a flat list, n per prompt in prompt order: by_prompt() gives the groups.
def by_prompt(samples, n):
    """The groups of a flat sample list (n samples per prompt, in prompt order)."""
    return [samples[i:i + n] for i in range(0, len(samples), n)]


def generate_and_score(ctx, drawn, n, temperature, top_p=None, lengths=None):
    """Sample n responses per prompt and score them. Returns the flat list of sample dicts (n per prompt).
    lengths (bench.py's realistic workload): per prompt, n forced response lengths (EOS ignored)."""
    cfg = ctx.cfg
    prompts = [rec for _, rec in drawn]
    seeds = [(cfg.seed * 1_000_003 + pos) % 2**31 for pos, _ in drawn]
    outs = ctx.rollout.generate(prompts, n=n, temperature=temperature, top_p=cfg.top_p if top_p is None else top_p,
                                max_tokens=cfg.max_response_length, seeds=seeds,
                                **({"lengths": lengths} if lengths is not None else {}))
    samples = [dict(prompt=p, response_ids=list(o["response_ids"]), finished=o["finished"],
                    rollout_logp=o.get("logprobs")) for p, group in zip(prompts, outs) for o in group]
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
    drawn = data.draw_prompts(ctx.train, ctx.cursor, ctx.cfg.rollout_batch_size, ctx.rank, ctx.world, ctx.cfg.seed)
    ctx.cursor += ctx.cfg.rollout_batch_size
    return generate_and_score(ctx, drawn, ctx.cfg.n, ctx.cfg.temperature)


def update_policy(ctx, samples, step):
    """rollout_batch_size/global_batch_size mini-batches x ppo_epochs optimizer steps over this rank's samples."""
    cfg, dev = ctx.cfg, ctx.device
    n_mini = cfg.rollout_batch_size // cfg.global_batch_size
    per_mini = len(samples) // n_mini
    log, skipped = rundir.MetricSums(), 0
    if cfg.rollout_correction == "tis" and any(s.get("rollout_logp") is None for s in samples):
        raise ValueError("--rollout-correction tis needs the engine's log-probs of its samples, and this rollout "
                         "returned none; use --rollout-correction none")
    g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    for epoch in range(cfg.ppo_epochs):
        shuffle = n_mini > 1 or epoch > 0  # mini-batches see a fresh mix of samples
        order = torch.randperm(len(samples), generator=g).tolist() if shuffle else list(range(len(samples)))
        for m in range(n_mini):
            mini = [samples[i] for i in order[m * per_mini:(m + 1) * per_mini]]
            # global normalisers: the mini-batch's loss is the same whatever the micro-batching and rank count
            # (a sample with loss_mask 0, e.g. DAPO's truncated ones, takes no part in the loss or its normalisers)
            live = [s.get("loss_mask", 1) for s in mini]
            num_tokens, num_seqs = actor.all_reduce_cpu([sum(len(s["response_ids"]) * k for s, k in zip(mini, live)),
                                                         sum(live)]).clamp(min=1).tolist()
            norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=cfg.max_response_length)
            lengths = [len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in mini]
            for idx in actor.make_micro_batches(lengths, cfg.max_token_len_per_device, cfg.micro_batch_size_per_device,
                                                [id(s["prompt"]) for s in mini], packed=ctx.model.packed):
                mb = [mini[i] for i in idx]
                batch, resp_len = actor.collate(mb, ctx.pad_id, dev, ctx.model)
                log.add("perf/pad_fraction", batch["input_ids"].numel() - sum(lengths[i] for i in idx),
                        batch["input_ids"].numel())
                lp, ent = ctx.model(**batch, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)  # [N]
                logp, mask = actor.pad_responses(lp, resp_len)  # [b, R]
                loss, mask = micro_batch_loss(cfg, logp, mask, mb, norm, log, first_pass=epoch == 0 and m == 0)
                # FSDP averages gradients over ranks; the normalisers are already global, so undo the average
                (loss * ctx.world).backward()
                ent_p, _ = actor.pad_responses(ent, resp_len)
                log.add("actor/entropy", (ent_p * mask).sum(), mask.sum())
            grad_norm = actor.optimizer_step(ctx.model, ctx.opt, ctx.sched, cfg.max_grad_norm,  # the same on every rank
                                             offload_state=cfg.offload_optimizer and not cfg.offload_params)
            log.add("actor/grad_norm", grad_norm)
            log.add("actor/lr", ctx.sched.get_last_lr()[0])
            skipped += not math.isfinite(grad_norm)
            ctx.skipped_run = 0 if math.isfinite(grad_norm) else ctx.skipped_run + 1
            if cfg.max_skipped_steps and ctx.skipped_run >= cfg.max_skipped_steps:  # before any checkpoint is saved
                raise UserError(f"stopped at step {step + 1}: the last {ctx.skipped_run} optimizer steps were "
                                f"skipped (gradient norm {grad_norm}); nothing of this step was saved. Check the data "
                                "and reward, lower --lr, or raise --max-skipped-steps (0 = never stop)")
    out = log.reduce(dev, n_steps=n_mini * cfg.ppo_epochs)
    ctx.skipped_total += skipped
    out["actor/skipped_steps"], out["actor/skipped_steps_total"] = skipped, ctx.skipped_total
    return out


# ------------------------------------------------------------------------------------------ the loss (algorithm)
def micro_batch_loss(cfg, logp, mask, mb, norm, log, first_pass):
    """The loss of one micro-batch: logp [b, R] the policy's log-probs of the sampled tokens now (with gradient),
    mask [b, R] its response tokens, mb its samples (advantage; old, reference and engine log-probs where taken),
    norm the mini-batch's global normalisers. Returns the loss (a share of the mini-batch's) and the mask of the
    tokens that took part."""
    dev, R = logp.device, logp.shape[1]
    mask = mask & actor.to_device(torch.tensor([s.get("loss_mask", 1) > 0 for s in mb]), dev)[:, None]  # [b, R]
    if mb[0].get("old_logp") is not None:
        old = actor.stack_padded([s["old_logp"] for s in mb], R, dev)  # [b, R]
    else:  # on-policy: the first forward *is* the old policy
        old = logp.detach()
    adv = actor.to_device(torch.tensor([s["adv"] for s in mb], dtype=logp.dtype), dev)  # [b]
    tok_loss, clip = policy_loss(logp, old, adv, mask, cfg.loss_type, cfg.clip_ratio_low, cfg.clip_ratio_high,
                                 cfg.clip_ratio_dual, cfg.gspo_dual_clip, cfg.cispo_clip_low)  # [b, R]
    roll = None
    if all(s.get("rollout_logp") is not None for s in mb):
        roll = actor.stack_padded([s["rollout_logp"] for s in mb], R, dev)  # [b, R] the engine's
    if cfg.rollout_correction == "tis":
        w, st = rollout.correction_weights(old, roll, mask, cfg.rollout_correction_level, cfg.rollout_correction_cap)
        tok_loss = tok_loss * w
        log.add("rollout_corr/weight_mean", *st["mean"])
        log.add("rollout_corr/capped_frac", *st["capped_frac"])
        log.add_max("rollout_corr/weight_max", st["max"])
    pg_loss = agg_loss(tok_loss, mask, cfg.loss_avg_mode, **norm)
    loss = pg_loss
    if cfg.kl_coef > 0:
        ref = actor.stack_padded([s["ref_logp"] for s in mb], R, dev)  # [b, R]
        kl = kl_penalty(logp, ref, cfg.kl_penalty)  # [b, R]
        loss = loss + cfg.kl_coef * agg_loss(kl, mask, cfg.loss_avg_mode, **norm)
        log.add("actor/kl", (kl.detach() * mask).sum(), mask.sum())
    log.add("actor/pg_loss", pg_loss, 0.0)  # already a share of the global loss: just sum
    log.add("actor/loss", loss, 0.0)
    log.add("actor/clipfrac", (clip["clipfrac"] * mask).sum(), mask.sum())
    log.add("actor/dual_clipfrac", (clip["dual_clipfrac"] * mask).sum(), mask.sum())
    if first_pass and roll is not None:  # trainer/engine mismatch at the weights that generated the samples
        diff = ((logp.detach() - roll).abs() * mask)
        log.add("rollout/logprob_diff_mean", diff.sum(), mask.sum())
        log.add_max("rollout/logprob_diff_max", diff.max())
    return loss, mask
# ------------------------------------------------------------------------------------------ (end of the loss)


def train_step(ctx, step, collect=collect_rollouts):
    cfg, T, metrics = ctx.cfg, {}, {}
    t_step = time.time()
    peaks = {"start": memory.phase_peak_gb()}  # (the last step's validation and checkpoint: not this step's)
    # ---- 0. sync: the engine gets the weights of the last update (streamed, one tensor at a time) ----
    T["sync"] = sync_engine(ctx)
    # ---- 1. sample (generate n responses per prompt) and 2. score ----
    t = time.time()
    ctx.rollout.wake()
    samples = collect(ctx, step, metrics)
    metrics.update(memory.sleep(ctx.rollout))  # (and the GPU memory free with the engine awake and asleep)
    T["gen"] = time.time() - t
    peaks["gen"] = memory.phase_peak_gb(ctx.rollout)
    # ---- 3. advantages: normalise within each group of n ----
    groups = by_prompt(samples, cfg.n)
    rewards = torch.tensor([[s["reward"] for s in g] for g in groups])  # [G, n]
    lengths = torch.tensor([[len(s["response_ids"]) for s in g] for g in groups])  # [G, n]
    adv = compute_advantages(rewards, cfg.adv_estimator, lengths)  # [G, n]
    for s, a in zip(samples, adv.flatten().tolist()):
        s["adv"] = a
    # ---- 4. log-probs of the old policy (only when it differs from the first forward) and of the reference ----
    mb_kw = dict(pad_id=ctx.pad_id, device=ctx.device, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size,
                 max_tokens=cfg.max_token_len_per_device, max_samples=cfg.micro_batch_size_per_device)
    if cfg.rollout_batch_size // cfg.global_batch_size * cfg.ppo_epochs > 1:
        t = time.time()
        old, _ = actor.compute_logprobs(ctx.model, samples, **mb_kw)
        for s, o in zip(samples, old):
            s["old_logp"] = o
        T["old_logprob"] = time.time() - t
    if cfg.kl_coef > 0:
        t = time.time()
        # LoRA: the policy with its adapters off; else the reference model (on the GPU for this pass if offloaded)
        ref_model = memory.adapters_disabled(ctx.model) if ctx.lora else memory.resident(ctx.ref, ctx.device,
                                                                                     cfg.offload_params)
        with ref_model as m:
            ref, _ = actor.compute_logprobs(m, samples, **mb_kw)
        for s, r in zip(samples, ref):
            s["ref_logp"] = r
        T["ref_logprob"] = time.time() - t
    if "old_logprob" in T or "ref_logprob" in T:
        peaks["ref"] = memory.phase_peak_gb(ctx.rollout)  # old and reference log-probs
    # ---- 5. update the policy (the engine is now one update behind: synced before its next generation) ----
    t = time.time()
    metrics.update(update_policy(ctx, samples, step))
    ctx.engine_stale = True
    T["update"] = time.time() - t
    peaks["update"] = memory.phase_peak_gb(ctx.rollout)
    T["step"] = time.time() - t_step
    # ---- metrics: rewards, lengths, seconds, throughput, MFU, memory ----
    metrics.update(rundir.step_metrics(ctx, samples, T, peaks, metrics))
    metrics["step"] = step + 1
    return metrics, samples


def sync_engine(ctx):
    """Stream the policy's weights into the engine if it is behind (or dropped them in a level-2 sleep); every rank
    takes part (each DTensor is all-gathered). With LoRA only the merged LoRA layers change. Returns the seconds."""
    if ctx.cfg.debug_skip_sync or not (ctx.engine_stale or getattr(ctx.rollout, "weights_lost", False)):
        return 0.0
    t = time.time()
    lora_only = bool(ctx.lora) and not getattr(ctx.rollout, "weights_lost", False)
    ctx.rollout.sync_weights(actor.iter_full_params(ctx.model, ctx.compute_dtype, lora_only=lora_only))
    ctx.engine_stale = False
    return time.time() - t


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
    return rundir.sample_metrics(ctx, samples, "val")


# ================================================================================================ main loop
def train(cfg: Config, collect=collect_rollouts):
    ctx = setup(cfg)
    if ctx.done:
        return ctx
    rundir.print_batch_arithmetic(ctx)
    dist.barrier()  # every rank has read the folder (find_resume) before rank 0 changes it
    if ctx.rank == 0:  # logs cut back to the resumed step, config.json for a new run
        rundir.prepare(cfg, ctx.start_step, ctx.ckpt)
    dist.barrier()
    ctx.best = rundir.find_best(cfg.output_dir)  # (step, val/mean) of the best checkpoint: never deleted
    if ctx.rank == 0:
        rundir.write_best(cfg.output_dir, ctx.best)
    log = rundir.RunLog(cfg, ctx.rank, ctx.start_step)  # metrics.jsonl, samples.jsonl, trackers, console, reward.png
    if cfg.val_freq and cfg.val_before_train and ctx.val is not None and ctx.start_step == 0:
        val = validate(ctx)
        ctx.say("[val] step 0 " + " ".join(f"{k}={v:.3f}" for k, v in val.items()))
        log.write({"step": 0, **val})
    for step in range(ctx.start_step, cfg.max_steps):
        with memory.oom_explained(ctx, step):  # one line with the memory's shares, not a traceback per rank
            metrics, samples = train_step(ctx, step, collect)
        last = step + 1 == cfg.max_steps
        if cfg.val_freq and ctx.val is not None and ((step + 1) % cfg.val_freq == 0 or last):
            t = time.time()
            metrics.update(validate(ctx))
            metrics["timing/val"] = time.time() - t
        if cfg.save_freq >= 0 and ((cfg.save_freq and (step + 1) % cfg.save_freq == 0) or last):
            t = time.time()
            rundir.save(ctx, step + 1, metrics, say=log.say)  # keeps the best by val/mean
            metrics["timing/save"] = time.time() - t
        log.write(metrics, samples, last)
    log.close()
    dist.barrier()
    return ctx


def main(config_cls=Config, collect=collect_rollouts, demo=DEMO, text_demo=TEXT_DEMO, video_demo=VIDEO_DEMO):
    """The command line: defaults (EasyR1's, or the demo's), an EasyR1 --config, the flags; then train. A UserError
    (a bad option, file, row or reward) ends the run with one `error:` line and exit code 2."""
    with easyr1_config.one_line_errors():
        train(easyr1_config.cli(config_cls, demo, text_demo=text_demo, video_demo=video_demo), collect)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
