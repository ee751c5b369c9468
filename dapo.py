"""dapo.py -- DAPO (arXiv 2503.14476) as a small layer on top of grpo.py.

    python dapo.py                                    # the demo, with DAPO's recipe
    torchrun --nproc_per_node 8 dapo.py --model-path Qwen/Qwen2.5-VL-7B-Instruct --reward-function dapo \
        --max-response-length 20480 --overlong-buffer-length 4096 --gen-batch-size 1536 --rollout-batch-size 512 ...

DAPO = GRPO with clip-higher (eps_high 0.28), the token-level loss, no KL, and two changes in the collect step:
dynamic sampling (filter_groups: generate until every group's `filter_key` varies; a group that scores alike has no
advantage) and overlong shaping (a soft length penalty in the reward; optionally truncated samples out of the loss)."""
from dataclasses import dataclass

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
    filter_groups: bool = True  # dynamic sampling (grpo.py's collect_rollouts): on
    filter_key: str = "accuracy"  # the paper's: groups all right or all wrong teach nothing
    filter_low: float | None = None  # no bounds: keep the groups whose scores are not all equal (any score, any n)
    filter_high: float | None = None  # (EasyR1's bounds, 0.01 / 0.99, say the same for a 0/1 score and n < 100)


# 60 steps: then nearly every group is all-correct and dynamic sampling stops at max_try_make_batch (a solved task's
# end). Groups of 32: with no KL nothing brings back a colour no sample says (at 16 one GPU run never said blue: 0.77).
# A constant lr: a cosine's over 60 steps sums to 30 steps' (on the CPU it ended at 0.74; constant: 1.0 from step 40)
DEMO = {**grpo.DEMO, "n": 32, "max_steps": 60, "output_dir": "outputs/dapo", "lr_scheduler_type": "constant"}
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


def collect_dynamic(ctx, step, metrics):
    """DAPO's batch: grpo.py's dynamic sampling (filter_groups, on here), each try's rewards shaped first; a try
    draws 3 x rollout_batch_size prompts unless gen_batch_size says otherwise (the paper's ratio)."""
    return grpo.collect_rollouts(ctx, step, metrics, shape=shape_overlong, gen_factor=3)


if __name__ == "__main__":
    grpo.main(DAPOConfig, collect_dynamic, DEMO)
