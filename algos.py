"""algos.py -- the formulas, pure functions of tensors: advantages, KL estimators (and EasyR1's adaptive KL
coefficient), policy losses, TIS weights, loss aggregation, learning-rate schedules and dynamic sampling's filter.
Each is checked against numbers worked out by hand and against EasyR1's / veRL's code (tests/test_*algo*.py)."""
import math

import torch

from common import all_reduce_cpu

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk", "remax")


# ------------------------------------------------------------------------------------------------ advantages
def compute_advantages(rewards, estimator="grpo", lengths=None, eps=1e-6, token_kl=None, baselines=None):
    """rewards [G, n] (n samples of each of G prompts) -> advantages [G, n], one per sample. lengths [G, n]: the
    REINFORCE++ whitening weights (default: all equal). token_kl [G, n, T]: the KL penalty in the reward, or None;
    with it REINFORCE++'s advantages are per token, [G, n, T]. baselines [G]: ReMax's greedy responses' rewards."""
    G, n = rewards.shape
    if token_kl is not None and estimator != "reinforce_plus_plus":
        # an outcome estimator sees the sum of the token rewards: the reward less the response's summed penalty
        rewards = rewards - token_kl.sum(-1).to(rewards.dtype)
    if estimator == "grpo":  # group-normalised; a group of equal rewards gives 0, not NaN
        std = rewards.std(dim=1, keepdim=True) if n > 1 else torch.ones_like(rewards)
        return (rewards - rewards.mean(dim=1, keepdim=True)) / (std + eps)
    if estimator == "dr_grpo":  # Dr. GRPO: no std division (it favours too-easy / too-hard groups)
        return rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "rloo":  # leave-one-out baseline: the mean of the *other* n-1 samples
        if n == 1:
            return torch.zeros_like(rewards)
        return (rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1))
    if estimator == "grpo_passk":
        # pass@k training (arXiv 2503.19595, EasyR1's fixed version): only the group's best response is credited,
        # by its margin over the runner-up; a tie at the top gives the whole group 0
        if n == 1:
            return torch.zeros_like(rewards)
        top = rewards.topk(2, dim=1).values  # [G, 2]
        margin = (top[:, 0] - top[:, 1]) / (rewards.std(dim=1) + eps)  # [G]
        best = torch.nn.functional.one_hot(rewards.argmax(dim=1), n).to(rewards.dtype)  # [G, n]
        return best * margin[:, None]
    if estimator == "remax":  # ReMax: the greedy response's reward is the baseline (one more generation per prompt)
        if baselines is None:
            raise ValueError("adv_estimator=remax needs the greedy responses' rewards (baselines)")
        return rewards - torch.as_tensor(baselines, dtype=rewards.dtype)[:, None]
    if estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        return _reinforce_plus_plus(rewards, estimator, lengths, token_kl)
    raise ValueError(f"adv_estimator={estimator!r}: choose one of {', '.join(ESTIMATORS)}")


def _reinforce_plus_plus(rewards, estimator, lengths, token_kl):
    # veRL's compute_reinforce_plus_plus(_baseline)_outcome_advantage: with one outcome reward and gamma 1 each token's
    # return is its sample's reward (the baseline variant less the group mean), less, with the KL in the reward, the
    # penalty of that token and all after it; then masked_whiten over the global batch's response tokens.
    G, n = rewards.shape
    x = rewards.double()
    if estimator == "reinforce_plus_plus_baseline" and n > 1:
        x = x - x.mean(dim=1, keepdim=True)
    w = torch.ones_like(x) if lengths is None else torch.as_tensor(lengths, dtype=torch.float64).view(G, n)
    if token_kl is not None:  # [G, n, T] returns, T tokens (the mask: t < length)
        T = token_kl.shape[-1]
        mask = (torch.arange(T)[None, None, :] < w[..., None]).double()  # [G, n, T]
        x = (x[..., None] - token_kl.double().flip(-1).cumsum(-1).flip(-1)) * mask
        w = mask
    cnt, s = all_reduce_cpu([w.sum(), (w * x).sum()]).tolist()
    if cnt <= 1:  # one token or none: nothing to whiten (veRL raises)
        return torch.zeros(x.shape, dtype=rewards.dtype)
    mean = s / cnt  # veRL adds 1e-8 to this denominator; left out so that equal rewards give exactly 0
    var = float(all_reduce_cpu((w * (x - mean).square()).sum())) / (cnt - 1)  # Bessel over tokens
    adv = (x - mean) / math.sqrt(var + 1e-8)
    return (adv * (w > 0) if token_kl is not None else adv).to(rewards.dtype)


# ------------------------------------------------------------------------------------------------ KL
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


def adaptive_kl_coef(coef, current_kl, target, horizon, n_samples):
    """The next step's coefficient of the KL penalty in the reward (Ziegler et al. 2019, as EasyR1 and TRL): it grows
    while the measured KL is above target and shrinks below, by at most 20% x n_samples / horizon per step."""
    error = min(max(current_kl / target - 1, -0.2), 0.2)
    return coef * (1 + error * n_samples / horizon)


# ------------------------------------------------------------------------------------------------ losses
def policy_loss(logp, old_logp, adv, mask, loss_type="ppo_clip", clip_low=0.2, clip_high=0.3, clip_dual=3.0,
                gspo_dual_clip=False, cispo_clip_low=False, tau_positive=1.0, tau_negative=1.05):
    """Per-token policy loss [B, R] for logp/old_logp [B, R], adv [B] (or [B, R]), mask [B, R]; plus clip metrics.
    gspo_dual_clip / cispo_clip_low: EasyR1's versions of GSPO (dual-clipped) and CISPO (weight bounded below);
    gspo_token is EasyR1's name for GSPO with its dual clip. tau_*: SAPO's gate temperatures."""
    adv = adv[:, None] if adv.dim() == 1 else adv  # [B, 1] or [B, R]
    log_ratio = (logp - old_logp).clamp(-20, 20)
    if loss_type in ("gspo", "gspo_token"):  # GSPO: one length-normalised ratio per sequence, gradient per token
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()
    ratio = log_ratio.exp()
    zeros = torch.zeros_like(ratio)
    if loss_type == "cispo":  # CISPO: clip (and detach) the importance weight, keep every token's gradient
        lo = 1 - clip_low if cispo_clip_low else None  # the paper leaves small weights unbounded
        weight = ratio.clamp(min=lo, max=1 + clip_high).detach()
        loss = -adv * weight * logp
        clipped = (weight != ratio).float()
        return loss, {"clipfrac": clipped, "dual_clipfrac": zeros}
    if loss_type == "sapo":
        # SAPO (arXiv 2511.20347): no hard clip; a sigmoid gate of the ratio, slope 1 at ratio 1 (the plain policy
        # gradient on-policy) and fading as the ratio moves away; negative advantages fade faster (tau_negative)
        tau = torch.full_like(adv, tau_negative).masked_fill(adv >= 0, tau_positive)  # [B, 1], adv's dtype
        return -adv * 4 / tau * torch.sigmoid(tau * (ratio - 1)), {"clipfrac": zeros, "dual_clipfrac": zeros}
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipfrac, dual = (loss2 > loss1).float(), zeros
    if (loss_type in ("ppo_clip", "gspo_token") or gspo_dual_clip) and clip_dual > 1:  # negative advantages only
        loss3 = -adv * clip_dual
        dual = ((adv < 0) & (loss > loss3)).float()
        loss = torch.where(adv < 0, torch.minimum(loss, loss3), loss)
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


# ------------------------------------------------------------------------------------------------ schedule
def lr_factor(kind, warmup, total, min_lr_ratio=0.0):
    """The learning rate's factor at optimizer step s (0 = the first). constant: linear warm-up from 1/warmup, then
    1. cosine: EasyR1's, warm-up from 0, then half a cosine from 1 down to min_lr_ratio at step `total`."""
    if kind == "constant":
        return lambda s: min(1.0, (s + 1) / max(1, warmup))
    if kind != "cosine":
        raise ValueError(f"lr_scheduler_type={kind!r}: choose constant or cosine")

    def cosine(s):
        if s < warmup:
            return s / max(1, warmup)
        progress = (s - warmup) / max(1, total - warmup)
        return max(min_lr_ratio, min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return cosine


# ------------------------------------------------------------------------------------------------ dynamic sampling
def select_groups(samples, n, key="accuracy", limit=None, bounds=None):
    """Dynamic sampling's filter. samples: flat, n per group. Keeps the groups whose `key` scores are not all equal,
    or, with bounds (low, high), EasyR1's rule: those whose mean `key` lies strictly between them. Returns the
    samples of at most `limit` kept groups, and the number of groups that failed the filter."""
    kept, failed = [], 0
    for i in range(0, len(samples), n):
        group = samples[i:i + n]
        scores = [float(s["scores"][key]) for s in group]
        # not all equal (zero variance = zero advantage = no gradient), or EasyR1's bounds on the mean
        ok = len(set(scores)) > 1 if bounds is None else bounds[0] < sum(scores) / len(scores) < bounds[1]
        if not ok:
            failed += 1
        elif limit is None or len(kept) < limit * n:
            kept += group
    return kept, failed


# ------------------------------------------------------------------------------------------------ rollout correction
def correction_weights(old_logp, rollout_logp, mask, level="token", cap=2.0):
    """Truncated importance sampling (TIS) for the trainer/engine mismatch: weights pi_old / pi_rollout per token (or
    their product per sequence), truncated at `cap`, detached, times the per-token loss (veRL's and TRL's). Returns
    (weights [B, R], stats: sums and counts)."""
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
