"""dapo.py -- DAPO (arXiv 2503.14476) as a small layer on top of grpo.py.

    python dapo.py                                    # the demo, with DAPO's recipe
    torchrun --nproc_per_node 8 dapo.py --model-path Qwen/Qwen2.5-VL-7B-Instruct --reward-function dapo \
        --max-response-length 20480 --overlong-buffer-length 4096 --gen-batch-size 1536 --rollout-batch-size 512 ...

DAPO = GRPO plus four changes. Two are options of grpo.py, set here as defaults: clip-higher (eps_low 0.2,
eps_high 0.28) and the token-level loss (grpo.py's default already); and no KL, so no reference model. Two live in this file's collect step:
  * dynamic sampling: a group whose samples all score the same (all right or all wrong) has zero advantage and
    teaches nothing, so keep generating prompts and keep only groups with mixed `filter_key` until the batch is full;
  * overlong shaping: the soft length penalty is added to the reward, and optionally truncated samples are masked
    out of the loss (their reward says "wrong" when the answer was only cut off).
"""
from dataclasses import dataclass

import torch.distributed as dist

import data
import fsdp_actor as actor
import grpo
import rewards
import rundir


@dataclass
class DAPOConfig(grpo.Config):
    clip_ratio_high: float = 0.28  # clip-higher: room for low-probability tokens to grow (entropy stays up)
    kl_coef: float = 0.0  # no KL term and no reference model: long-CoT policies drift far from the start anyway
    # soft overlong punishment: 0 up to max_response_length - buffer, then down to -factor at max_response_length
    overlong_buffer_length: int = 0  # overlong shaping's buffer in tokens (paper: 4096 of 20480); 0 = off (the demo)
    overlong_penalty_factor: float = 1.0  # the overlong penalty at max_response_length
    overlong_filtering: bool = False  # truncated samples take no part in the loss (kept for the advantages)
    filter_groups: bool = True  # dynamic sampling: keep only groups whose filter_key scores differ
    filter_key: str = "accuracy"  # the score a group must vary in (EasyR1's filter_key; veRL's "acc")
    gen_batch_size: int = 0  # prompts generated per try, all ranks together; 0 = 3 x rollout_batch_size (the paper's)
    max_try_make_batch: int = 20  # tries before giving up with an error; 0 = unlimited


# 60 steps: the demo is solved by then: past it nearly every group is all-correct, and dynamic sampling needs ever
# more tries per step until max_try_make_batch stops the run (that error is the intended end of a solved task)
DEMO = {**grpo.DEMO, "max_steps": 60, "output_dir": "outputs/dapo"}
rundir.CONSOLE[8:8] = [("dapo/tries", "tries"), ("dapo/generated_accuracy", "gen_acc")]  # before the timings


def shape_overlong(samples, cfg):
    """Add DAPO's soft overlong penalty to each sample's reward (and its "overall" score); mask truncated samples
    out of the loss when overlong_filtering is on. In place; every sample gets scores["overlong_penalty"]."""
    for s in samples:
        pen = 0.0
        if cfg.overlong_buffer_length > 0:
            pen = rewards.overlong_penalty(len(s["response_ids"]), cfg.max_response_length,
                                           cfg.overlong_buffer_length, cfg.overlong_penalty_factor)
        s["scores"]["overlong_penalty"] = pen
        s["scores"]["overall"] = s["reward"] = s["reward"] + pen
        if cfg.overlong_filtering and not s["finished"]:
            s["loss_mask"] = 0
    return samples


def select_groups(samples, n, key="accuracy", limit=None):
    """Dynamic sampling's filter, a pure function. samples: flat, n per group, in group order. Returns the samples of
    the groups whose `key` scores are not all equal (for 0/1 accuracy: mean strictly between 0 and 1), at most
    `limit` groups, and the number of groups that failed the filter."""
    kept, failed = [], 0
    for group in grpo.by_prompt(samples, n):
        if len({float(s["scores"][key]) for s in group}) > 1:  # zero variance = zero advantage = no gradient
            if limit is None or len(kept) < limit * n:
                kept += group
        else:
            failed += 1
    return kept, failed


def collect_dynamic(ctx, step, metrics):
    """DAPO's batch: generate gen_batch_size prompts per try until every rank holds its share of groups with mixed
    `filter_key`. All ranks make the same number of generate calls (the engines of a tensor-parallel group
    generate together), so the loop ends on an all-reduced MIN of "I have enough"."""
    cfg = ctx.cfg
    gen = cfg.gen_batch_size or 3 * cfg.rollout_batch_size
    share = cfg.rollout_batch_size // ctx.world  # groups this rank must return
    if gen % ctx.world:
        raise grpo.UserError(f"--gen-batch-size {gen}: must be a multiple of the number of ranks ({ctx.world})")
    kept, tries = [], 0
    counts = [0.0] * 5  # groups generated, failed the filter, passed, samples truncated, sum of filter_key
    while True:
        drawn = data.draw_prompts(ctx.train, ctx.cursor, gen, ctx.rank, ctx.world, cfg.seed)
        ctx.cursor += gen  # every rank advances the same stream, so resume stays exact
        samples = shape_overlong(grpo.generate_and_score(ctx, drawn, cfg.n, cfg.temperature), cfg)
        tries += 1
        if cfg.filter_groups and cfg.filter_key not in samples[0]["scores"]:
            raise grpo.UserError(f"--filter-key {cfg.filter_key}: not a score of reward {cfg.reward_function!r}; "
                                 f"choose one of {sorted(samples[0]['scores'])}")
        if cfg.filter_groups:
            new, failed = select_groups(samples, cfg.n, cfg.filter_key, limit=share - len(kept) // cfg.n)
        else:
            new, failed = samples[:(share * cfg.n - len(kept))], 0
        passed = len(samples) // cfg.n - failed
        kept += new
        for i, v in enumerate([len(samples) // cfg.n, failed, passed, sum(not s["finished"] for s in samples),
                               sum(float(s["scores"].get(cfg.filter_key, 0)) for s in samples)]):
            counts[i] += v
        if actor.all_reduce_cpu(float(len(kept) >= share * cfg.n), op=dist.ReduceOp.MIN).item() == 1:
            break
        if cfg.max_try_make_batch and tries >= cfg.max_try_make_batch:
            tot = actor.all_reduce_cpu(counts).tolist()
            raise grpo.UserError(
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


if __name__ == "__main__":
    grpo.main(DAPOConfig, collect_dynamic, DEMO)
