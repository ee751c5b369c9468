"""grpo.py -- GRPO (and friends) for vision-language models, in one loop you can read top to bottom.

    python grpo.py                                    # the demo: tiny VLM built in code, synthetic colour task
    torchrun --nproc_per_node 8 grpo.py --model-path Qwen/Qwen2.5-VL-7B-Instruct --train-files hiyouga/geometry3k@train ...

One step:  sync -> sample -> score -> (old / ref log-probs) -> advantage -> clipped loss + KL -> optimizer step.
The step below calls the algorithm's formulas (algos.py) in that order; the rest is plumbing. The options are
config.py's. dapo.py imports this file, turns dynamic sampling on and adds overlong shaping."""
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import data
import easyr1_config
import families
import fsdp_actor as actor
import memory
import presets
import rewards
import rollout
import rundir
import tiny_model
import tools
import ulysses
import video
from algos import (adaptive_kl_coef, agg_loss, compute_advantages, correction_weights, kl_penalty,  # the formulas
                   lr_factor, policy_loss, select_groups)
from common import UserError, heap_freezer, one_line_errors
from data import prefetch_prompts, take_prompts  # the prompt stream (drawn ahead on a thread)
from config import Config, bf16_compute  # the options; their defaults are EasyR1's (examples/config.yaml)
from tiny_model import DEMO, FAMILY_DEMO, TEXT_DEMO, TOOLS_DEMO, VIDEO_DEMO  # the demos' defaults; flags win


# ================================================================================================ setup
@dataclass
class State:
    """What one run holds: set up by setup(), read by every stage; cursor, engine_stale, the skip counters change."""
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
    tools: dict | None = None  # --tools: name -> function; the rollouts are then multi-turn (tools.rollout)
    start_step: int = 0
    cursor: int = 0  # position in the endless stream of prompts (a checkpoint saves it: exact resume)
    engine_stale: bool = True  # the engine's weights are older than the policy's (synced before it generates)
    skipped_run: int = 0  # optimizer steps skipped in a row (non-finite gradient norm)
    skipped_total: int = 0
    best: tuple | None = None  # (step, val/mean) of the best checkpoint, never deleted
    kl_coef: float = 0.0  # the KL penalty's coefficient now (an adaptive one moves; a checkpoint saves it)
    prefetch: Any = None  # the next prompts being drawn on a second thread: .cursor, .count, .thread, .box (results)
    prefetch_count: int = 0  # how many prompts the last draw asked for (the next step's first asks for as many)
    prompt_seconds: float = 0.0  # this step's main-thread seconds in take_prompts (timing/prompts)
    sp: Any = None  # this rank's Ulysses group (--ulysses-size > 1): its K ranks train their samples together

    def say(self, *a):  # rank 0 prints
        rundir.log0(self, *a)


def setup(cfg: Config):
    """Everything the loop needs: distributed state, data, reward, policy, reference, engine."""
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    easyr1_config.check(cfg, ranks)
    families.check_family(cfg.model_path, cfg.rollout_engine)  # a model neither path trains: one line, now
    # can these GPUs hold it (memory model)? one line now, not out of memory after minutes of loading
    memory.check_before_loading(cfg, ranks)
    ulysses.check_model(presets.known_config(cfg.model_path), cfg.ulysses_size)  # (a model known before loading)
    cfg.checkpoint_layers, layers_note = memory.resolve_checkpoint_layers(cfg, ranks)
    reward_fn = rewards.get_reward_fn(cfg.reward_function, cfg.reward_function_kwargs)
    rank, world, device = actor.init_distributed()
    sp = ulysses.make_group(cfg.ulysses_size)  # (collective: before any rank can stop on its own)
    ckpt, state = rundir.find_resume(cfg)  # refuses a changed config before anything loads
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    ctx = State(cfg=cfg, rank=rank, world=world, device=device, reward_fn=reward_fn, ckpt=ckpt,
                model_path=cfg.model_path, kl_coef=cfg.kl_coef, sp=sp)
    if not ctx.model_path:  # the demo: rank 0 builds the tiny model (cached), the others wait and read it
        ctx.model_path = tiny_model.build_tiny_model(arch=cfg.demo_model, rank=rank, extra_tokens=(
            [tools.ZOOM_CALL] if cfg.demo_task == "zoom" else []))  # (the zoom demo's call: one token)
    ctx.tools = tools.load_tools(cfg.tools) if cfg.tools else None
    if layers_note:
        ctx.say(f"[memory] {layers_note}")
    ctx.processor, ctx.train, ctx.val = data.load_datasets(cfg, ctx.model_path, say=ctx.say,
                                                           tools=tools.schemas(ctx.tools))  # (their JSON schemas)
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
    ctx.compute_dtype = torch.bfloat16 if bf16_compute(cfg, device.type == "cuda") else torch.float32
    ctx.lora = dict(r=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_target_modules, exclude_modules=
                    cfg.lora_exclude_modules, modules_to_save=cfg.lora_modules_to_save,
                    target_experts=cfg.lora_target_experts) if cfg.lora_rank > 0 else None
    ctx.model = actor.build_actor(ctx.model_path, device, torch.bfloat16 if pure_bf16 else torch.float32,
                                  ctx.compute_dtype, cfg.gradient_checkpointing, cfg.attn_implementation,
                                  freeze_vision_tower=cfg.freeze_vision_tower, lora=ctx.lora,
                                  padding_free=cfg.padding_free, vision_varlen=cfg.vision_varlen,
                                  torch_compile=cfg.torch_compile, offload=cfg.offload_params,
                                  router_aux_loss_coef=cfg.router_aux_loss_coef,
                                  checkpoint_layers=cfg.checkpoint_layers, share_prompts=cfg.share_prompts,
                                  ulysses_group=sp)
    if cfg.kl_coef > 0 and not ctx.lora:  # with LoRA the reference is the policy with its adapters switched off
        ctx.ref = actor.build_actor(ctx.model_path, device, ctx.compute_dtype, ctx.compute_dtype,
                                    attn_implementation=cfg.attn_implementation, trainable=False,
                                    padding_free=cfg.padding_free, vision_varlen=cfg.vision_varlen,
                                    torch_compile=cfg.torch_compile, offload=cfg.offload_params,
                                    share_prompts=cfg.share_prompts, ulysses_group=sp)
    # the schedule counts optimizer steps: rollout_batch_size / global_batch_size x ppo_epochs per training step
    total = cfg.max_steps * cfg.rollout_batch_size // cfg.global_batch_size * cfg.ppo_epochs
    warmup = cfg.lr_warmup_steps or int(cfg.lr_warmup_ratio * total)  # EasyR1's rounding of the ratio
    ctx.opt, ctx.sched = actor.build_optimizer(ctx.model, cfg.lr, cfg.weight_decay, (0.9, 0.999), warmup,
                                               device, bf16_rounding=cfg.bf16_rounding if pure_bf16 else None,
                                               seed=cfg.seed, schedule=lr_factor(cfg.lr_scheduler_type, warmup, total,
                                                                                 cfg.min_lr_ratio))
    videos = max(video.most_videos(d) for d in (ctx.train, ctx.val) if d is not None)
    allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    ctx.rollout = rollout.make_rollout(cfg.rollout_engine, ctx.model_path, device, ctx.compute_dtype,
                                       **rollout.engine_options(cfg, limit_videos=videos))
    memory.engine_built(ctx.rollout, allocated)  # the engine's memory outside its pool: not the trainer's
    intake = hasattr(ctx.rollout, "submit") and getattr(ctx.rollout, "tp_group", None) is None
    if cfg.prefetch_requests == "on" and not intake:  # one line, not an option asked for that does nothing
        ctx.say("[rollout] --prefetch-requests does nothing here: the HF engine has no intake to move, and a tensor-"
                "parallel vLLM group gathers its prompts on the main thread")
    memory.check_host_memory(cfg, ctx.model, ctx.rollout)  # offload: one line now, not the kernel's kill at step 1
    ctx.engine_stale = True  # the engine loaded the same weights, but syncing on step 1 too keeps every step alike
    if ckpt:
        state = rundir.load_checkpoint(ckpt, ctx.model, ctx.opt, ctx.sched)
        ctx.start_step, ctx.cursor = state["step"], state["cursor"]  # the engine is synced before step 1 anyway
        ctx.kl_coef = state.get("kl_coef", cfg.kl_coef)  # an adaptive KL coefficient goes on where it was
        ctx.say(f"resumed from {ckpt} at step {ctx.start_step}")
    return ctx


# ================================================================================================ the step
# A sample is one response to one prompt, a dict that the stages below fill in as the step goes:
#   prompt         the prompt record (data.encode_prompt), shared by the n samples of the prompt
#   response_ids   the generated tokens (cut after EOS); finished: stopped by EOS rather than by the length cap
#   policy_mask    (--tools) 1 on the tokens the engine sampled, 0 on the tools' answers and the template's between
#                  turns: the loss, KL, entropy and agreement cover the 1s only (tools.rollout adds its own keys too)
#   rollout_logp   the engine's log-prob of each sampled token (None when the engine gives none)
#   text, scores, reward   the decoded response, the reward function's dict for it and its "overall" value
#   adv            the advantage (one number for every token of the response)
#   old_logp, ref_logp     per-token log-probs of the policy before this step's update (when it takes several
#                  optimizer steps) and of the reference (kl_coef > 0)
#   loss_mask      0 leaves the sample out of the loss and its normalisers (DAPO's overlong filtering sets it)
# Samples travel as a flat list, n per prompt in prompt order: by_prompt() gives the groups.
def by_prompt(samples, n):
    """The groups of a flat sample list (n samples per prompt, in prompt order)."""
    return [samples[i:i + n] for i in range(0, len(samples), n)]


def logprobs_every(cfg):
    """One training prompt in K gets the engine's log-probs (--rollout-logprobs-every; 0: all with tis, else 8)."""
    return cfg.rollout_logprobs_every or (1 if cfg.rollout_correction == "tis" else 8)


def logprob_samples(cfg):
    """How many of such a prompt's samples (its first) get them: all with tis, which weights each by them; else one,
    for the agreement metric (rollout/logprob_diff_*). Each costs vLLM's loop ~7 us a token (BENCHMARKS, 2026-12-02)."""
    return cfg.n if cfg.rollout_correction == "tis" else 1


def rollout_call(cfg, drawn, n, temperature, top_p=None, lengths=None, logprobs=True):
    """rollout.generate's arguments for the drawn prompts: a seed per stream position, and log-probs for the first
    logprob_samples of the prompts at every logprobs_every-th position (logprobs False: none)."""
    k = min(n, logprob_samples(cfg)) if logprobs else 0
    return dict(prompts=[rec for _, rec in drawn], n=n, temperature=temperature,
                top_p=cfg.top_p if top_p is None else top_p,  # (max_tokens: with --tools, those of turn 1)
                max_tokens=min(cfg.max_turn_tokens or cfg.max_response_length, cfg.max_response_length),
                seeds=[(cfg.seed * 1_000_003 + pos) % 2**31 for pos, _ in drawn],
                logprobs=[k if pos % logprobs_every(cfg) == 0 else 0 for pos, _ in drawn],  # per prompt: its first k
                **({"lengths": lengths} if lengths is not None else {}))


def generate_and_score(ctx, drawn, n, temperature, top_p=None, lengths=None, logprobs=True):
    """Sample n responses per prompt and score them -> the flat list of samples (n per prompt). lengths (bench.py):
    per prompt, n forced response lengths. logprobs: the engine's as rollout_call picks them (none for validation)."""
    cfg = ctx.cfg
    call = rollout_call(cfg, drawn, n, temperature, top_p, lengths, logprobs)
    if getattr(ctx, "tools", None):  # multi-turn: the trajectories after the prompts, their policy_mask (tools.py)
        samples = tools.rollout(ctx, call)
    else:
        outs = ctx.rollout.generate(**call)
        samples = [dict(prompt=p, response_ids=list(o["response_ids"]), finished=o["finished"],
                        rollout_logp=o.get("logprobs") if j < w else None)  # (the HF engine gives every sample's)
                   for p, w, group in zip(call["prompts"], call["logprobs"], outs) for j, o in enumerate(group)]
    # the answer: the (last) turn's text; with tools the reward also sees the trajectory (messages, tool_calls)
    texts = ctx.tokenizer.batch_decode([s.get("last_turn", s["response_ids"]) for s in samples],
                                       skip_special_tokens=True)
    items = [{"response": t, "response_length": len(s["response_ids"]), "ground_truth": s["prompt"]["answer"],
              **s.get("trajectory", {})} for t, s in zip(texts, samples)]
    scores = ctx.reward_fn(items)
    rewards.check_scores(scores, items, [s["prompt"]["prompt_text"] for s in samples], cfg.reward_function)
    for s, t, sc in zip(samples, texts, scores):
        s["text"], s["scores"], s["reward"] = t, sc, float(sc["overall"])
    return samples


def sample(ctx, drawn, shape=None):
    """The training rollouts of the drawn prompts, scored (and shaped: dapo.py's overlong penalty). ReMax also
    generates one greedy response per prompt: its reward is the baseline of the prompt's samples."""
    cfg = ctx.cfg
    samples = generate_and_score(ctx, drawn, cfg.n, cfg.temperature)
    samples = shape(samples, cfg) if shape else samples
    if cfg.adv_estimator == "remax":
        greedy = generate_and_score(ctx, drawn, 1, 0.0, top_p=1.0, logprobs=False)
        greedy = shape(greedy, cfg) if shape else greedy  # the baseline's reward is shaped as the samples' are
        for i, s in enumerate(samples):
            s["reward_baseline"] = greedy[i // cfg.n]["reward"]
    return samples


def collect_rollouts(ctx, step, metrics, shape=None, gen_factor=1):
    """The step's batch: rollout_batch_size prompts x n; with filter_groups, DAPO's dynamic sampling: tries until every
    rank holds its share of mixed groups, each rank making as many generate calls (all-reduced MIN of "enough")."""
    cfg = ctx.cfg
    if not cfg.filter_groups:
        return sample(ctx, take_prompts(ctx, cfg.rollout_batch_size), shape)
    gen = cfg.gen_batch_size or gen_factor * cfg.rollout_batch_size
    share = cfg.rollout_batch_size // ctx.world  # groups this rank must return
    if gen % ctx.world:
        raise UserError(f"--gen-batch-size {gen}: must be a multiple of the number of ranks ({ctx.world})")
    low, high = (-math.inf if cfg.filter_low is None else cfg.filter_low,
                 math.inf if cfg.filter_high is None else cfg.filter_high)
    bounds = None if cfg.filter_low is None and cfg.filter_high is None else (low, high)  # None: not all equal
    kept, tries = [], 0
    counts = [0.0] * 5  # groups generated, failed the filter, passed, samples truncated, sum of filter_key
    while True:
        samples = sample(ctx, take_prompts(ctx, gen), shape)  # (every rank advances the same stream)
        tries += 1
        if cfg.filter_key not in samples[0]["scores"]:
            raise UserError(f"--filter-key {cfg.filter_key}: not a score of reward {cfg.reward_function!r}; "
                            f"choose one of {sorted(samples[0]['scores'])}")
        new, failed = select_groups(samples, cfg.n, cfg.filter_key, share - len(kept) // cfg.n, bounds)
        passed = len(samples) // cfg.n - failed
        kept += new
        for i, v in enumerate([len(samples) // cfg.n, failed, passed, sum(not s["finished"] for s in samples),
                               sum(float(s["scores"][cfg.filter_key]) for s in samples)]):
            counts[i] += v
        if actor.all_reduce_cpu(float(len(kept) >= share * cfg.n), op=dist.ReduceOp.MIN).item() == 1:
            break
        if cfg.max_try_make_batch and tries >= cfg.max_try_make_batch:
            tot = actor.all_reduce_cpu(counts).tolist()
            raise UserError(
                f"dynamic sampling: after {tries} tries (max_try_make_batch={cfg.max_try_make_batch}) of "
                f"{gen} prompts, {int(tot[2])} of {int(tot[0])} groups had mixed {cfg.filter_key!r} "
                f"({int(tot[1])} were all-equal) but a step needs {cfg.rollout_batch_size} on every rank. Raise "
                f"--max-try-make-batch (0 = unlimited) or --gen-batch-size, or check the reward/task: nearly every "
                f"group is all-correct or all-wrong (mean {cfg.filter_key}={tot[4] / max(tot[0] * cfg.n, 1):.3f}).")
    tot = actor.all_reduce_cpu(counts).tolist()
    metrics.update({"dapo/tries": tries, "dapo/groups_generated": tot[0], "dapo/groups_filtered": tot[1],
                    "dapo/groups_kept": float(cfg.rollout_batch_size),
                    "dapo/groups_surplus": tot[2] - cfg.rollout_batch_size,  # passed, but the batch was full
                    "dapo/truncated_ratio": tot[3] / max(tot[0] * cfg.n, 1),
                    # the filtered batch's reward/* is biased towards 0.5: this is the policy's real accuracy
                    f"dapo/generated_{cfg.filter_key}": tot[4] / max(tot[0] * cfg.n, 1)})
    return kept


def early_requests(ctx, step, collect):
    """prefetch_prompts' submit: vLLM's intake of the next step's requests, off the critical path. None with
    --prefetch-requests off, an engine without an intake (HF), or a validation after this step (it comes first)."""
    cfg = ctx.cfg
    if (cfg.prefetch_requests == "off" or not hasattr(ctx.rollout, "submit")
            or (cfg.val_freq and ctx.val is not None and (step + 1) % cfg.val_freq == 0)):
        return None
    plan = getattr(collect, "requests", None) or (lambda c, d: rollout_call(c.cfg, d, c.cfg.n, c.cfg.temperature))
    return lambda drawn: ctx.rollout.submit(**plan(ctx, drawn))


def update_policy(ctx, samples, step):
    """rollout_batch_size/global_batch_size mini-batches x ppo_epochs optimizer steps over this rank's samples."""
    cfg, dev = ctx.cfg, ctx.device
    # Ulysses: samples are the K ranks' shares of S, each cut into mini-batches as its rank alone would (as K = 1)
    n_mini, K, S = cfg.rollout_batch_size // cfg.global_batch_size, cfg.ulysses_size, len(samples) // cfg.ulysses_size
    per_mini = S // n_mini
    log, skipped = rundir.MetricSums(), 0
    if cfg.rollout_correction == "tis" and any(s.get("rollout_logp") is None for s in samples):
        raise ValueError("--rollout-correction tis needs the engine's log-probs of its samples, and this rollout "
                         "returned none; use --rollout-correction none")
    g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    for epoch in range(cfg.ppo_epochs):
        shuffle = n_mini > 1 or epoch > 0  # mini-batches see a fresh mix of samples
        order = torch.randperm(S, generator=g).tolist() if shuffle else list(range(S))
        for m in range(n_mini):
            mini = [samples[p * S + i] for p in range(K) for i in order[m * per_mini:(m + 1) * per_mini]]
            # global normalisers: the loss is the same whatever the micro-batching and rank count (loss_mask 0, e.g.
            # DAPO's truncated samples, count in neither; Ulysses: each sample is on the K ranks of its group)
            live = [s.get("loss_mask", 1) for s in mini]
            num_tokens, num_seqs = (actor.all_reduce_cpu([sum(tools.policy_tokens(s) * k for s, k in zip(mini, live)),
                                                          sum(live)]) / cfg.ulysses_size).clamp(min=1).tolist()
            norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=cfg.max_response_length)
            for idx in actor.plan_micro_batches(ctx.model, mini, cfg.max_token_len_per_device,
                                                cfg.micro_batch_size_per_device):
                mb = [mini[i] for i in idx]
                batch, resp_len = actor.collate(mb, ctx.pad_id, dev, ctx.model)
                pads = 0 if ctx.model.packed else batch["input_ids"].numel() - sum(  # (a packed row has none)
                    len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in mb)
                log.add("perf/pad_fraction", pads, batch["input_ids"].numel())
                lp, ent = ctx.model(**batch, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)  # [N]
                logp, mask = actor.pad_responses(lp, resp_len)  # [b, R]
                ent_p, _ = actor.pad_responses(ent, resp_len)  # [b, R]
                loss, mask = micro_batch_loss(cfg, logp, ent_p, mask, mb, norm, log, first_pass=epoch + m == 0)
                if ctx.model.aux_loss is not None:  # MoE balancing, this micro-batch's share by its samples
                    aux = ctx.model.aux_loss * len(mb) / num_seqs
                    loss = loss + cfg.router_aux_loss_coef * aux
                    log.add("actor/router_aux_loss", aux.detach(), 0.0)  # (a share: summed like the loss)
                    log.add("actor/loss", cfg.router_aux_loss_coef * aux.detach(), 0.0)
                # FSDP averages gradients over ranks; the normalisers are already global, so undo the average
                (loss * ctx.world).backward()
                log.add("actor/entropy", (ent_p.detach() * mask).sum(), mask.sum())
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
    for k in {"actor/pg_loss", "actor/loss"} & out.keys():  # sums, to which a Ulysses group's K ranks add the same
        out[k] /= K
    if out.get("rollout/logprob_tokens") == 0:  # no sample of the step had the engine's log-probs: no agreement
        del out["rollout/logprob_diff_mean"], out["rollout/logprob_diff_max"]
    ctx.skipped_total += skipped
    out["actor/skipped_steps"], out["actor/skipped_steps_total"] = skipped, ctx.skipped_total
    return out


# ------------------------------------------------------------------------------------------ the loss (algorithm)
def micro_batch_loss(cfg, logp, ent, mask, mb, norm, log, first_pass):
    """One micro-batch's loss: logp and ent [b, R] the policy's log-probs and entropies (with gradient); mask [b, R]
    its response tokens; mb its samples; norm the global normalisers. -> (its share of the loss, the mask used)"""
    dev, R = logp.device, logp.shape[1]
    mask = mask & actor.to_device(torch.tensor([s.get("loss_mask", 1) > 0 for s in mb]), dev)[:, None]  # [b, R]
    if "policy_mask" in mb[0]:  # multi-turn: the tokens the policy sampled only, not the tools' answers
        mask = mask & actor.stack_padded([s["policy_mask"] for s in mb], R, dev).bool()  # [b, R]
        logp = torch.where(mask, logp, 0.0)  # (a tool image's pads have log-prob -inf, and 0 x -inf is nan)
    # [b, R]; on-policy (no old_logp) the first forward *is* the old policy
    old = logp.detach() if mb[0].get("old_logp") is None else actor.stack_padded([s["old_logp"] for s in mb], R, dev)
    if isinstance(mb[0]["adv"], list):  # per token (REINFORCE++ with the KL penalty in the reward)
        adv = actor.stack_padded([s["adv"] for s in mb], R, dev).to(logp.dtype)  # [b, R]
    else:
        adv = actor.to_device(torch.tensor([s["adv"] for s in mb], dtype=logp.dtype), dev)  # [b]
    tok_loss, clip = policy_loss(logp, old, adv, mask, cfg.loss_type, cfg.clip_ratio_low, cfg.clip_ratio_high,
                                 cfg.clip_ratio_dual, cfg.gspo_dual_clip, cfg.cispo_clip_low, cfg.tau_positive,
                                 cfg.tau_negative)  # [b, R]
    has = [s.get("rollout_logp") is not None for s in mb]  # the engine's log-probs: one prompt in K has them
    roll = actor.stack_padded([s["rollout_logp"] or [] for s in mb], R, dev) if any(has) else None  # [b, R]
    if cfg.rollout_correction == "tis":
        w, st = correction_weights(old, roll, mask, cfg.rollout_correction_level, cfg.rollout_correction_cap)
        tok_loss = tok_loss * w
        log.add("rollout_corr/weight_mean", *st["mean"])
        log.add("rollout_corr/capped_frac", *st["capped_frac"])
        log.add_max("rollout_corr/weight_max", st["max"])
    loss = pg_loss = agg_loss(tok_loss, mask, cfg.loss_avg_mode, **norm)
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        ref = actor.stack_padded([s["ref_logp"] for s in mb], R, dev)  # [b, R]
        kl = kl_penalty(logp, ref, cfg.kl_penalty)  # [b, R]
        loss = loss + cfg.kl_coef * agg_loss(kl, mask, cfg.loss_avg_mode, **norm)
        log.add("actor/kl", (kl.detach() * mask).sum(), mask.sum())
    if cfg.entropy_coeff:  # veRL's entropy bonus (its gradient: varlen.logits_grad)
        loss = loss - cfg.entropy_coeff * agg_loss(ent, mask, cfg.loss_avg_mode, **norm)
    log.add("actor/pg_loss", pg_loss, 0.0)  # already a share of the global loss: just sum
    log.add("actor/loss", loss, 0.0)
    log.add("actor/clipfrac", (clip["clipfrac"] * mask).sum(), mask.sum())
    log.add("actor/dual_clipfrac", (clip["dual_clipfrac"] * mask).sum(), mask.sum())
    # trainer/engine mismatch at the weights that generated the samples; with K > 1 logged by every micro-batch, with
    # or without such samples (0 of 0), so that every rank reduces the same keys
    if first_pass and (roll is not None or logprobs_every(cfg) > 1):
        m = mask & actor.to_device(torch.tensor(has), dev)[:, None]  # [b, R]
        diff = (logp.detach() - roll).abs() * m if roll is not None else torch.zeros_like(logp)
        log.add("rollout/logprob_diff_mean", diff.sum(), m.sum())
        log.add("rollout/logprob_tokens", m.sum(), 0.0)  # (summed: the tokens the agreement was measured on)
        log.add_max("rollout/logprob_diff_max", diff.max())
    return loss, mask
# ------------------------------------------------------------------------------------------ (end of the loss)


def train_step(ctx, step, collect=collect_rollouts):
    cfg, T, metrics = ctx.cfg, {}, {}
    t_step = time.time()
    peaks = {"start": memory.phase_peak_gb()}  # (the last step's validation and checkpoint: not this step's)
    # ---- 0. sync: the engine gets the weights of the last update (streamed, one tensor at a time) ----
    T["sync"] = sync_engine(ctx)
    start = {"sync": t_step}  # each phase's wall-clock start (bench.py phases: the GPU's clocks and power per phase)
    # ---- 1. sample (generate n responses per prompt) and 2. score ----
    t = start["gen"] = time.time()
    ctx.prompt_seconds = 0.0
    ctx.rollout.wake()
    samples = collect(ctx, step, metrics)
    metrics.update(tools.metrics(samples) if ctx.tools else {})  # turns, calls, errors, timeouts, seconds, tokens
    metrics.update(memory.sleep(ctx.rollout))  # (and the GPU memory free with the engine awake and asleep)
    T["gen"], T["prompts"] = time.time() - t, ctx.prompt_seconds  # (drawing the prompts: part of gen)
    if step + 1 < cfg.max_steps:
        prefetch_prompts(ctx, early_requests(ctx, step, collect))  # the next step's, while the GPU computes this one's
    peaks["gen"] = memory.phase_peak_gb(ctx.rollout)
    mine, samples = samples, ulysses.gather_samples(samples, ctx.sp)  # Ulysses: the group's samples, trained together
    # ---- 3. log-probs of the old policy (several updates follow, or the reward needs them) and of the reference ----
    mb_kw = dict(pad_id=ctx.pad_id, device=ctx.device, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size,
                 **logprob_bounds(cfg))
    if cfg.rollout_batch_size // cfg.global_batch_size * cfg.ppo_epochs > 1 or kl_in_reward(cfg):
        t = start["old_logprob"] = time.time()
        old, _ = actor.compute_logprobs(ctx.model, samples, **mb_kw, entropy=False)
        for s, o in zip(samples, old):
            s["old_logp"] = tools.masked(o, s)
        T["old_logprob"] = time.time() - t
    if cfg.kl_coef > 0:
        t = start["ref_logprob"] = time.time()
        # LoRA: the policy with its adapters off; else the reference model (on the GPU for this pass if offloaded)
        ref_model = memory.adapters_disabled(ctx.model) if ctx.lora else memory.resident(ctx.ref, ctx.device,
                                                                                     cfg.offload_params)
        with ref_model as m:
            ref, _ = actor.compute_logprobs(m, samples, **mb_kw, entropy=False)
        for s, r in zip(samples, ref):
            s["ref_logp"] = tools.masked(r, s)
        T["ref_logprob"] = time.time() - t
    if "old_logprob" in T or "ref_logprob" in T:
        peaks["ref"] = memory.phase_peak_gb(ctx.rollout)  # old and reference log-probs
    # ---- 4. advantages: rewards (less the KL penalty, when it is in the reward) normalised within each group ----
    groups = by_prompt(samples, cfg.n)
    rewards = torch.tensor([[s["reward"] for s in g] for g in groups])  # [G, n]
    lengths = torch.tensor([[len(s["response_ids"]) for s in g] for g in groups])  # [G, n]
    token_kl = reward_kl(ctx, samples, metrics) if kl_in_reward(cfg) else None  # [G, n, T]
    baselines = [g[0]["reward_baseline"] for g in groups] if cfg.adv_estimator == "remax" else None  # [G]
    adv = compute_advantages(rewards, cfg.adv_estimator, lengths, token_kl=token_kl, baselines=baselines)
    for s, a in zip(samples, adv.flatten(0, 1)):  # [n] or [n, T]
        s["adv"] = a.item() if a.dim() == 0 else a[:len(s["response_ids"])].tolist()
    # ---- 5. update the policy (the engine is now one update behind: synced before its next generation) ----
    t = start["update"] = time.time()
    metrics.update(update_policy(ctx, samples, step))
    ctx.engine_stale = True
    T["update"] = time.time() - t
    peaks["update"] = memory.phase_peak_gb(ctx.rollout)
    if ctx.prefetch:
        ctx.prefetch.thread.join()  # (drawn and queued long before: the update takes longer)
    T["step"] = time.time() - t_step
    # ---- metrics: rewards, lengths, seconds, throughput, MFU, memory ----
    metrics.update(rundir.step_metrics(ctx, mine, T, peaks, metrics))
    metrics.update({f"time/{k}_start": v for k, v in start.items()})
    metrics["step"] = step + 1
    return metrics, mine


def logprob_bounds(cfg):
    """The no-grad log-prob passes' micro-batch bounds: --logprob-max-token-len-per-device tokens and no sample cap
    (veRL's log_prob_max_token_len_per_gpu: no activations kept, tokens alone size it); 0: the update's bounds."""
    if cfg.logprob_max_token_len_per_device:
        return dict(max_tokens=cfg.logprob_max_token_len_per_device, max_samples=math.inf)
    return dict(max_tokens=cfg.max_token_len_per_device, max_samples=cfg.micro_batch_size_per_device)


def kl_in_reward(cfg):
    """The KL penalty goes into the reward (EasyR1's use_kl_loss: false) rather than into the loss."""
    return cfg.kl_in_reward and cfg.kl_coef > 0


def reward_kl(ctx, samples, metrics):
    """The KL penalty in the reward (EasyR1's apply_kl_penalty): kl_coef x the per-token KL of the old policy against
    the reference -> [G, n, T]. Logs the batch's KL and the coefficient, then moves an adaptive one."""
    cfg = ctx.cfg
    kls = [kl_penalty(s["old_logp"].double(), s["ref_logp"].double(), cfg.kl_penalty) for s in samples]  # [L_i]
    T = max(1, max(len(k) for k in kls))
    tok = torch.zeros(len(samples), T, dtype=torch.float64)  # [B, T]
    for i, k in enumerate(kls):
        tok[i, :len(k)] = k
    per_sample = sum(float(k.sum()) / max(len(k), 1) for k in kls)
    total, count = actor.all_reduce_cpu([per_sample, len(samples)]).tolist()
    metrics["actor/kl_penalty"], metrics["actor/kl_coef"] = total / count, ctx.kl_coef
    out = (ctx.kl_coef * tok).view(-1, cfg.n, T)  # [G, n, T]
    if cfg.kl_type == "adaptive":  # the next step's coefficient (saved with the checkpoint)
        ctx.kl_coef = adaptive_kl_coef(ctx.kl_coef, total / count, cfg.kl_target, cfg.kl_horizon, count)
    return out


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
    """val_n answers to each validation prompt, split over ranks: the mean scores and, with several, pass@val_n (the
    share of prompts with a right answer: the best accuracy, or overall score, among their val_n)."""
    cfg = ctx.cfg
    rows = len(ctx.val) if not cfg.val_max_rows else min(cfg.val_max_rows, len(ctx.val))
    mine = list(range(ctx.rank, rows, ctx.world))
    sync_engine(ctx)
    ctx.rollout.wake()
    samples, per = [], max(1, 64 // cfg.val_n)
    for i in range(0, len(mine), per):  # bounded batches keep the HF engine's memory flat
        drawn = [(-1 - j, ctx.val[j]) for j in mine[i:i + per]]
        samples += generate_and_score(ctx, drawn, cfg.val_n, cfg.val_temperature, cfg.val_top_p, logprobs=False)
    ctx.rollout.sleep()
    out = rundir.sample_metrics(ctx, samples, "val")
    out.update(tools.metrics(samples, "val/tool_") if ctx.tools else {})
    ctx.val_rows = rundir.gather_val_rows(samples)  # rank 0: every answer, for val_samples.jsonl (a mean hides a class)
    if cfg.val_n > 1:
        key = "accuracy" if "accuracy" in samples[0]["scores"] else "overall"
        best = sum(max(float(s["scores"][key]) for s in g) for g in by_prompt(samples, cfg.val_n))
        total, prompts = actor.all_reduce_cpu([best, len(samples) // cfg.val_n]).tolist()
        out[f"val/pass@{cfg.val_n}"] = total / prompts
    return out


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
        log.write({"step": 0, **val}, val_rows=ctx.val_rows)
    with heap_freezer() as freeze:
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
            log.write(metrics, samples, last, val_rows=ctx.val_rows if "val/mean" in metrics else None)
            if step == ctx.start_step:  # the run's long-lived objects now exist: out of the collector's walks
                del metrics, samples
                freeze()
    log.close()
    dist.barrier()
    return ctx


def main(config_cls=Config, collect=collect_rollouts, demo=DEMO, text_demo=TEXT_DEMO, video_demo=VIDEO_DEMO,
         tools_demo=TOOLS_DEMO, family_demo=FAMILY_DEMO):
    """The command line: defaults (EasyR1's, or the demo's), an EasyR1 --config, the flags; then train. A UserError
    (a bad option, file, row or reward) ends the run with one `error:` line and exit code 2."""
    with one_line_errors():
        train(easyr1_config.cli(config_cls, demo, text_demo=text_demo, video_demo=video_demo, tools_demo=tools_demo,
                                family_demo=family_demo), collect)
    sys.stdout.flush(), sys.stderr.flush()  # every rank passed train's last barrier; the trackers are closed: then
    os._exit(0)  # no interpreter teardown, where torch 2.13's gloo at times aborts a finished run (SIGABRT, CI)


if __name__ == "__main__":
    main()
