"""EasyR1's algorithms brought here (2026-12-01), each against EasyR1's own formula written out below as
EasyR1 computes it, in float64: SAPO, gspo / gspo_token / cispo with EasyR1's clipping, grpo_passk, ReMax, the KL
penalty in the reward with the adaptive controller, the cosine schedule and online filtering's rule. The references
transcribe hiyouga/EasyR1 at commit b44b311b669bf1fd1aa2fc36f2251482ba33cb16: verl/trainer/core_algos.py
(compute_policy_loss, average_loss, compute_kl, the advantage estimators, AdaptiveKLController), verl/trainer/
ray_trainer.py (apply_kl_penalty, _make_batch_data's filter), verl/utils/torch_functional.py (masked_mean,
masked_whiten, get_cosine_schedule_with_warmup). Then each one end to end: EasyR1's command line trains 3 steps on the
CPU with the key that turns it on."""
import json
import math
import os
import sys
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import easyr1_config as E
import grpo
import tiny_model
from algos import adaptive_kl_coef, agg_loss, compute_advantages, lr_factor, policy_loss, select_groups
from benchmarks import matrix
from config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F64 = torch.float64


# ------------------------------------------------------------------------------------------------ EasyR1's code
def r1_masked_mean(values, mask, dim=None, eps=1e-8):
    return (values * mask).sum(dim=dim) / (mask.sum(dim=dim) + eps)


def r1_masked_whiten(values, mask, eps=1e-8):
    mean = r1_masked_mean(values, mask)
    var = r1_masked_mean((values - mean) ** 2, mask)
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + eps)


def r1_average_loss(values, mask, mode, eps=1e-8):
    if mode == "token":
        return r1_masked_mean(values, mask, eps=eps)
    return ((values * mask).sum(-1) / (mask.sum(-1) + eps)).mean()


def r1_policy_loss(old_log_probs, log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                   clip_ratio_dual, tau_positive, tau_negative, loss_type, loss_avg_mode):
    """core_algos.compute_policy_loss: the loss (advantages [B, R], one per token)."""
    negative_approx_kl = log_probs - old_log_probs
    if loss_type in ["gspo", "gspo_token"]:
        seq = r1_masked_mean(negative_approx_kl, response_mask, dim=-1)
        if loss_type == "gspo_token":
            log_importance_ratio = seq.detach().unsqueeze(-1) + log_probs - log_probs.detach()
        else:
            log_importance_ratio = seq.unsqueeze(-1) * response_mask
    else:
        log_importance_ratio = negative_approx_kl
    ratio = torch.exp(torch.clamp(log_importance_ratio, -20.0, 20.0))
    clipped_ratio = torch.exp(torch.clamp(log_importance_ratio, np.log(1.0 - clip_ratio_low),
                                          np.log(1.0 + clip_ratio_high)))
    if loss_type == "cispo":
        final = -advantages * log_probs * clipped_ratio.detach()
    elif loss_type == "sapo":
        pos, neg = (advantages >= 0).to(F64), (advantages < 0).to(F64)
        gate_negative = 4.0 / tau_negative * torch.sigmoid(tau_negative * (ratio - 1.0))
        gate_positive = 4.0 / tau_positive * torch.sigmoid(tau_positive * (ratio - 1.0))
        final = -advantages * (pos * gate_positive + neg * gate_negative)
    else:
        pg_loss = -advantages * ratio
        pg_loss2 = -advantages * clipped_ratio
        pg_loss3 = -advantages * clip_ratio_dual
        higher = torch.max(pg_loss, pg_loss2)
        lower = torch.min(higher, pg_loss3)
        final = torch.where(advantages < 0, lower, higher)
    return r1_average_loss(final, response_mask, loss_avg_mode)


def r1_passk(token_level_rewards, index, eps=1e-6):
    """core_algos.compute_grpo_passk_outcome_advantage (after EasyR1's fix)."""
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    id2score, id2indices = defaultdict(list), defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
        id2indices[index[i]].append(i)
    for idx in id2score:
        rewards = torch.tensor(id2score[idx], dtype=F64)
        topk, topk_idx = torch.topk(rewards, k=2)
        i_max = id2indices[idx][topk_idx[0]]
        advantages[i_max] = (topk[0] - topk[1]) / (torch.std(torch.tensor(id2score[idx], dtype=F64)) + eps)
    return advantages


def r1_grpo(token_level_rewards, index, eps=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    groups = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(scores[i])
    stats = {g: (torch.stack(v).mean(), torch.stack(v).std()) for g, v in groups.items()}
    return torch.stack([(scores[i] - stats[index[i]][0]) / (stats[index[i]][1] + eps) for i in range(len(scores))])


def r1_reinforce_pp(token_level_rewards, response_mask, gamma=1.0):
    returns, running = torch.zeros_like(token_level_rewards), 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    return r1_masked_whiten(returns, response_mask)


def r1_remax(token_level_rewards, reward_baselines, response_mask):
    return (token_level_rewards.sum(dim=-1) - reward_baselines)[:, None] * response_mask


def r1_compute_kl(log_probs, ref_log_probs, kl_penalty):
    if kl_penalty == "kl":
        return log_probs - ref_log_probs
    if kl_penalty == "abs":
        return (log_probs - ref_log_probs).abs()
    if kl_penalty == "mse":
        return 0.5 * (log_probs - ref_log_probs).square()
    kl = (ref_log_probs - log_probs).clamp(-20.0, 20.0)  # low_var_kl
    return torch.clamp(kl.exp() - kl - 1, min=-10.0, max=10.0)


class R1AdaptiveKL:
    def __init__(self, init_kl_coef, target_kl, horizon):
        self.kl_coef, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.kl_coef *= 1 + proportional_error * n_steps / self.horizon


def r1_apply_kl_penalty(token_level_scores, old_log_probs, ref_log_probs, response_mask, kl_ctrl, kl_penalty):
    kld = r1_compute_kl(old_log_probs, ref_log_probs, kl_penalty) * response_mask
    rewards = token_level_scores - kl_ctrl.kl_coef * kld
    current_kl = torch.mean(r1_masked_mean(kld, mask=response_mask, dim=-1)).item()
    metrics = {"actor/kl_penalty": current_kl, "actor/kl_coef": kl_ctrl.kl_coef}
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, metrics


def r1_cosine(current_step, num_warmup_steps, num_training_steps, min_lr_ratio=0.0, num_cycles=0.5):
    min_lr_ratio = 0.0 if min_lr_ratio is None else min_lr_ratio
    coef, intercept = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(min_lr_ratio, math.cos(math.pi * float(num_cycles) * 2.0 * progress) * coef + intercept)


def r1_filter(scores, uids, low, high):
    """ray_trainer._make_batch_data's online filter: the indices of the kept samples."""
    uid2scores = defaultdict(list)
    for uid, score in zip(uids, scores):
        uid2scores[uid].append(score)
    kept = [uid for uid, s in uid2scores.items() if low < np.mean(s) < high]
    return [i for i, uid in enumerate(uids) if uid in kept]


# ------------------------------------------------------------------------------------------------ helpers
def batch(seed=0, B=6, R=7):
    """Log-probs far enough from the old ones that every clip (low, high, dual) happens, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, R, generator=g, dtype=F64) * 3
    old = logp + torch.randn(B, R, generator=g, dtype=F64) * 0.7
    old[0] = logp[0] - 1.5  # ratio e^1.5 > clip_ratio_dual 3: with a negative advantage, dual-clipped
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])[:B]
    mask = (torch.arange(R)[None, :] < lengths[:, None]).to(F64)
    adv = torch.tensor([-1.3, 0.7, -0.2, 1.1, 0.0, -0.9], dtype=F64)[:B]
    return logp, old, adv, mask


# EasyR1's loss_type -> what an EasyR1 config sets here
AS_EASYR1 = {"default": dict(loss_type="ppo_clip"), "gspo": dict(loss_type="gspo", gspo_dual_clip=True),
             "gspo_token": dict(loss_type="gspo_token"), "cispo": dict(loss_type="cispo", cispo_clip_low=True),
             "sapo": dict(loss_type="sapo")}


@pytest.mark.parametrize("mode", ["token", "seq"])
@pytest.mark.parametrize("r1_type", list(AS_EASYR1))
def test_policy_losses_match_easyr1_in_float64(r1_type, mode):
    """Loss and gradient of each EasyR1 loss_type, as an EasyR1 config sets it here, against EasyR1's own."""
    logp, old, adv, mask = batch()
    clip, tau = dict(clip_low=0.2, clip_high=0.28, clip_dual=3.0), dict(tau_positive=1.0, tau_negative=1.05)
    opts = E.translate({"worker": {"actor": {"loss_type": r1_type}}}, Config)[0]
    assert {k: v for k, v in opts.items() if k in ("loss_type", "gspo_dual_clip", "cispo_clip_low")} == \
        AS_EASYR1[r1_type]
    ours_lp, ref_lp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    tok, m = policy_loss(ours_lp, old, adv, mask, **clip, **tau, **{"gspo_dual_clip": False, **AS_EASYR1[r1_type]})
    ours = agg_loss(tok, mask, mode, num_tokens=mask.sum(), num_seqs=mask.shape[0])
    ref = r1_policy_loss(old, ref_lp, adv[:, None].expand_as(logp), mask, 0.2, 0.28, 3.0, 1.0, 1.05, r1_type, mode)
    ours.backward()
    ref.backward()
    assert torch.allclose(ours, ref, rtol=1e-7, atol=1e-12), (ours, ref)
    assert torch.allclose(ours_lp.grad, ref_lp.grad, rtol=1e-7, atol=1e-12)
    assert ours_lp.grad.abs().sum() > 0


def test_the_cases_tell_the_losses_apart():
    """The batch above is not one where the variants coincide: each pair of EasyR1's losses differs on it (gspo and
    gspo_token are one loss here: the next test), and the papers' GSPO and CISPO (no dual clip, no lower bound)
    differ from EasyR1's."""
    logp, old, adv, mask = batch()
    loss = {t: r1_policy_loss(old, logp, adv[:, None].expand_as(logp), mask, 0.2, 0.28, 3.0, 1.0, 1.05, t, "token")
            for t in AS_EASYR1 if t != "gspo_token"}
    vals = sorted(float(v) for v in loss.values())
    assert min(b - a for a, b in zip(vals, vals[1:])) > 1e-3, loss
    for t, paper in (("gspo", dict(loss_type="gspo")), ("cispo", dict(loss_type="cispo"))):
        tok, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_dual=3.0, **paper)
        assert abs(float(agg_loss(tok, mask)) - float(loss[t])) > 1e-3, t


def test_gspo_and_gspo_token_are_one_loss_for_sequence_advantages():
    """EasyR1's gspo (gradient through the sequence mean) and gspo_token (the sequence ratio with each token's own
    gradient) give the same loss and gradient when every token of a response shares its advantage, as here."""
    logp, old, adv, mask = batch(seed=3)
    grads = []
    for t in ("gspo", "gspo_token"):
        lp = logp.clone().requires_grad_()
        r1_policy_loss(old, lp, adv[:, None].expand_as(logp), mask, 0.2, 0.28, 3.0, 1.0, 1.05, t, "seq").backward()
        grads.append(lp.grad)
    assert torch.allclose(*grads, rtol=1e-7, atol=1e-14)  # (EasyR1 adds 1e-8 to the token count of the mean)


def test_sapo_by_hand():
    # on-policy (ratio 1) the gate's slope is 1: the gradient is -A per token, as the plain policy gradient
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    tok, m = policy_loss(logp, logp.detach(), torch.tensor([2.0], dtype=F64), torch.ones(1, 2), "sapo")
    tok.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, -2.0]], dtype=F64))
    assert torch.allclose(tok, torch.full((1, 2), -2.0 * 4 / 1.0 * 0.5, dtype=F64))  # -A * 4/tau * sigmoid(0)
    assert m["clipfrac"].sum() == 0
    # ratio 2, A = -1: the negative temperature's gate, 4/1.05 * sigmoid(1.05)
    tok, _ = policy_loss(torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
                         "sapo", tau_positive=1.0, tau_negative=1.05)
    assert tok.item() == pytest.approx(4 / 1.05 / (1 + math.exp(-1.05)), rel=1e-6)


def test_easyr1_config_gives_easyr1s_clipping_and_a_flag_the_papers(capsys):
    cfg = E.cli(Config, grpo.DEMO, args=["worker.actor.loss_type=gspo"])
    assert (cfg.loss_type, cfg.gspo_dual_clip) == ("gspo", True)
    cfg = E.cli(Config, grpo.DEMO, args=["worker.actor.loss_type=cispo", "--no-cispo-clip-low"])
    assert (cfg.loss_type, cfg.cispo_clip_low) == ("cispo", False)
    assert "flags win: --cispo-clip-low False over worker.actor.loss_type='cispo'" in capsys.readouterr().out
    cfg = E.cli(Config, grpo.DEMO, args=["worker.actor.loss_type=sapo", "worker.actor.tau_negative=2.0"])
    assert (cfg.loss_type, cfg.tau_positive, cfg.tau_negative) == ("sapo", 1.0, 2.0)
    assert E.cli(Config, grpo.DEMO, args=["--loss-type", "gspo"]).gspo_dual_clip is False  # flags alone: the paper's


# ------------------------------------------------------------------------------------------------ advantages
def test_grpo_passk_matches_easyr1_in_float64():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.5],  # one best
                            [1.0, 1.0, 0.0, 0.0],  # a tie at the top: everyone 0
                            [0.3, 0.3, 0.3, 0.3],  # all equal
                            [0.2, 0.9, 0.4, 0.4],  # a tie for second
                            [0.0, 0.0, 0.0, 0.7]], dtype=F64)
    G, n = rewards.shape
    index = [g for g in range(G) for _ in range(n)]
    ref = r1_passk(rewards.reshape(-1, 1), index)
    ours = compute_advantages(rewards, "grpo_passk")
    assert torch.allclose(ours.flatten(), ref, atol=1e-12), (ours, ref)
    assert (ours != 0).sum(dim=1).tolist() == [1, 0, 0, 1, 1]  # only each group's best, when there is one
    assert torch.equal(compute_advantages(rewards[:, :1], "grpo_passk"), torch.zeros(G, 1))  # n = 1: no runner-up


def test_remax_matches_easyr1_in_float64():
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.9, 0.9]], dtype=F64)
    baselines = torch.tensor([0.5, 1.0], dtype=F64)
    mask = torch.ones(6, 3, dtype=F64)
    tok = torch.zeros(6, 3, dtype=F64)
    tok[:, -1] = rewards.flatten()
    ref = r1_remax(tok, baselines.repeat_interleave(3), mask)[:, 0]
    assert torch.allclose(compute_advantages(rewards, "remax", baselines=baselines).flatten(), ref, atol=1e-12)
    with pytest.raises(ValueError, match="remax needs"):
        compute_advantages(rewards, "remax")


def test_remax_generates_one_greedy_response_per_prompt(monkeypatch):
    """The sampled responses, then one greedy (temperature 0) response per prompt, whose reward is the baseline of
    that prompt's samples."""
    calls = []

    def fake_generate(ctx, drawn, n, temperature, top_p=None, logprobs=True):
        calls.append((len(drawn), n, temperature, logprobs))
        return [dict(reward=float(10 * p + (k if temperature else 0.5))) for p, _ in drawn for k in range(n)]
    monkeypatch.setattr(grpo, "generate_and_score", fake_generate)
    ctx = SimpleNamespace(cfg=Config(n=3, adv_estimator="remax", temperature=1.0))
    out = grpo.sample(ctx, [(0, {}), (1, {})])
    assert calls == [(2, 3, 1.0, True), (2, 1, 0.0, False)]  # the baseline needs no engine log-probs
    assert [s["reward_baseline"] for s in out] == [0.5] * 3 + [10.5] * 3
    # a shaped reward (dapo.py's overlong penalty) is shaped in the baseline too, as EasyR1's reward function does
    out = grpo.sample(ctx, [(0, {})], shape=lambda ss, cfg: [dict(s, reward=s["reward"] - 1) for s in ss])
    assert [s["reward_baseline"] for s in out] == [-0.5] * 3
    calls.clear()
    grpo.sample(SimpleNamespace(cfg=Config(n=3)), [(0, {})])
    assert calls == [(1, 3, 1.0, True)]  # no extra generation for the other estimators


# ------------------------------------------------------------------------------------------------ KL in the reward
def samples_for_kl(seed=0, G=3, n=2):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (G * n,), generator=g)
    out = []
    for i, L in enumerate(lengths.tolist()):
        old = -torch.rand(L, generator=g, dtype=F64) * 2
        out.append(dict(old_logp=old, ref_logp=old + torch.randn(L, generator=g, dtype=F64) * 0.5,
                        reward=float(torch.rand(1, generator=g)), response_ids=[0] * L))
    return out, lengths


def padded(rows, T):
    out = torch.zeros(len(rows), T, dtype=F64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@pytest.mark.parametrize("est", ["reinforce_plus_plus", "grpo"])
@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "abs", "mse"])
def test_kl_in_the_reward_matches_easyr1_in_float64(kind, est):
    """EasyR1's apply_kl_penalty then its estimator: REINFORCE++'s returns differ per token (each token carries the
    penalty of itself and the tokens after it), GRPO sees the reward less the summed penalty."""
    n, G = 3, 3  # (with 2 samples a group's GRPO advantages are +-0.707 whatever the rewards)
    samples, lengths = samples_for_kl(G=G, n=n)
    ours_kind = E.translate({"algorithm": {"kl_penalty": kind}}, Config)[0]["kl_penalty"]
    cfg = Config(n=n, kl_penalty=ours_kind, kl_coef=0.05, kl_in_reward=True)
    ctx, metrics = SimpleNamespace(cfg=cfg, kl_coef=cfg.kl_coef), {}
    token_kl = grpo.reward_kl(ctx, samples, metrics)
    rewards = torch.tensor([s["reward"] for s in samples], dtype=F64).view(G, n)
    ours = compute_advantages(rewards, est, lengths.view(G, n), token_kl=token_kl)

    T = int(lengths.max())
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    scores = torch.zeros(G * n, T, dtype=F64)
    scores[torch.arange(G * n), lengths - 1] = rewards.flatten()  # the outcome reward on the last token
    ctrl = SimpleNamespace(kl_coef=0.05, update=lambda **k: None)  # EasyR1's FixedKLController
    tok_rewards, r1_metrics = r1_apply_kl_penalty(scores, padded([s["old_logp"] for s in samples], T),
                                                  padded([s["ref_logp"] for s in samples], T), mask, ctrl, kind)
    assert metrics["actor/kl_penalty"] == pytest.approx(r1_metrics["actor/kl_penalty"], rel=1e-7)
    assert metrics["actor/kl_coef"] == 0.05
    if est == "grpo":
        ref = r1_grpo(tok_rewards, [i // n for i in range(G * n)])
        assert torch.allclose(ours.flatten().double(), ref, atol=1e-9)
        assert (compute_advantages(rewards, est) - ours).abs().max() > 1e-3  # the penalty changed them
    else:
        ref = r1_reinforce_pp(tok_rewards, mask) * mask
        assert ours.shape == (G, n, T)
        assert torch.allclose(ours.view(G * n, T).double(), ref, atol=1e-9)
        assert (ours[..., 0] - ours.view(G * n, T).gather(1, (lengths - 1)[:, None]).view(G, n)).abs().max() > 1e-4


def test_adaptive_kl_controller_matches_easyr1():
    ref, coef = R1AdaptiveKL(0.01, 0.1, 500.0), 0.01
    for kl in (0.5, 0.3, 0.12, 0.05, 0.0, 0.1, 0.09):
        ref.update(current_kl=kl, n_steps=64)
        coef = adaptive_kl_coef(coef, kl, 0.1, 500.0, 64)
        assert coef == pytest.approx(ref.kl_coef, rel=1e-12)
    assert coef != 0.01


def test_adaptive_kl_moves_the_coefficient_of_the_next_step():
    samples, _ = samples_for_kl()
    cfg = Config(n=2, kl_penalty="low_var_kl", kl_coef=0.05, kl_in_reward=True, kl_type="adaptive", kl_target=0.01,
                 kl_horizon=100.0)
    ctx, m = SimpleNamespace(cfg=cfg, kl_coef=0.05), {}
    first = grpo.reward_kl(ctx, samples, m)
    assert m["actor/kl_coef"] == 0.05 and ctx.kl_coef == pytest.approx(
        adaptive_kl_coef(0.05, m["actor/kl_penalty"], 0.01, 100.0, len(samples)))
    coef = ctx.kl_coef  # the measured KL (k3 > 0, ~0.1) is above target: the coefficient grew
    assert coef > 0.05
    m2 = {}
    second = grpo.reward_kl(ctx, samples, m2)
    assert m2["actor/kl_coef"] == coef and torch.allclose(second, first * coef / 0.05, rtol=1e-12)


# ------------------------------------------------------------------------------------------------ schedule, filter
@pytest.mark.parametrize("warmup, total, min_ratio", [(0, 10, 0.0), (3, 10, 0.1), (2, 7, None), (5, 5, 0.2)])
def test_cosine_schedule_matches_easyr1(warmup, total, min_ratio):
    ours = lr_factor("cosine", warmup, total, min_ratio or 0.0)
    for s in range(total + 3):
        assert ours(s) == pytest.approx(r1_cosine(s, warmup, total, min_ratio), abs=1e-12), s


def test_online_filtering_rule_matches_easyr1():
    g = torch.Generator().manual_seed(0)
    n = 4
    for low, high in ((0.01, 0.99), (0.2, 0.7)):
        scores = (torch.rand(40, generator=g) > 0.5).double() * torch.rand(40, generator=g).round(decimals=1)
        samples = [dict(scores={"overall": float(s)}) for s in scores]
        kept, failed = select_groups(samples, n, "overall", bounds=(low, high))
        ref = r1_filter(scores.tolist(), [i // n for i in range(40)], low, high)
        assert [id(s) for s in kept] == [id(samples[i]) for i in ref] and failed == 10 - len(ref) // n
        assert 0 < len(ref) < 40
    # the bounds themselves are out: with 0/1 scores in groups of 4 and bounds 0.25 / 0.75 only a mean of 0.5 stays
    scores = [1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1]
    samples = [dict(scores={"accuracy": float(a)}) for a in scores]
    kept, failed = select_groups(samples, 4, "accuracy", bounds=(0.25, 0.75))
    assert kept == samples[4:8] and failed == 3 and r1_filter(scores, [i // 4 for i in range(16)], 0.25, 0.75) == [
        4, 5, 6, 7]


def test_validation_with_n_answers_reports_mean_and_pass_at_n(monkeypatch):
    """3 prompts x 4 answers at the validation temperature: val/accuracy averages the 12 answers, val/pass@4 counts
    the prompts with at least one right answer (2 of 3)."""
    acc = {0: [0, 0, 1, 0], 1: [0, 0, 0, 0], 2: [1, 1, 0, 1]}
    calls = []

    def fake_generate(ctx, drawn, n, temperature, top_p=None, logprobs=True):
        calls.append((len(drawn), n, temperature, top_p, logprobs))
        return [dict(scores={"overall": a + 0.1, "accuracy": float(a)}, response_ids=[1, 2], finished=True,
                     prompt=dict(prompt_ids=[0] * 5, answer=f"p{row}"), text="x", reward=a + 0.1)
                for pos, row in drawn for a in acc[row]]
    monkeypatch.setattr(grpo, "generate_and_score", fake_generate)
    rollout = SimpleNamespace(wake=lambda: None, sleep=lambda: None)
    cfg = Config(val_n=4, val_temperature=1.0, val_top_p=0.7)
    ctx = SimpleNamespace(cfg=cfg, rank=0, world=1, val=[0, 1, 2], rollout=rollout, engine_stale=False,
                          tools=None)
    out = grpo.validate(ctx)
    assert calls == [(3, 4, 1.0, 0.7, False)]  # validation asks no engine log-probs
    assert out["val/accuracy"] == pytest.approx(4 / 12) and out["val/mean"] == pytest.approx(4 / 12 + 0.1)
    assert out["val/pass@4"] == pytest.approx(2 / 3)
    # every answer kept for val_samples.jsonl: the accuracy per class of prompt (here: per prompt)
    assert len(ctx.val_rows) == 12 and matrix.accuracy_by_answer(ctx.val_rows) == {"p0": 0.25, "p1": 0.0, "p2": 0.75}
    ctx.cfg = Config(val_n=1)
    acc.update({0: [1], 1: [0], 2: [1]})
    assert "val/pass@1" not in grpo.validate(ctx)  # one answer: the mean is all there is


# ------------------------------------------------------------------------------------------------ end to end
OVERRIDES = ["worker.actor.loss_type=sapo", "algorithm.adv_estimator=remax", "algorithm.adv_estimator=grpo_passk",
             # the REINFORCE++ example's keys: per-token advantages reach the loss
             "algorithm.use_kl_loss=false algorithm.adv_estimator=reinforce_plus_plus algorithm.kl_penalty=kl",
             "worker.actor.optim.lr_scheduler_type=cosine", "algorithm.online_filtering=true"]


def easyr1_words(tmp_path, *more):
    """EasyR1's command line over its config.yaml for the tiny Llama on the digit task; the output folder."""
    path = tiny_model.build_tiny_model(str(tmp_path / "llama"), arch="llama")
    train, val = tiny_model.demo_max_data(str(tmp_path / "max"), n_train=64, n_val=4)
    out, fmt = tmp_path / "out", tmp_path / "number.jinja"
    fmt.write_text(tiny_model.NUMBER_FORMAT_PROMPT)
    words = [f"config={os.path.join(ROOT, 'tests', 'easyr1_config.yaml')}", f"data.train_files={train}",
             f"data.val_files={val}", f"worker.actor.model.model_path={path}", "worker.reward.reward_function=number",
             f"data.format_prompt={fmt}", "data.max_response_length=2", "data.rollout_batch_size=2",
             "worker.actor.global_batch_size=2", "worker.rollout.n=4", "worker.actor.optim.lr=1e-3",
             "trainer.max_steps=3", "trainer.val_freq=3", "trainer.logger=[console]", "trainer.save_freq=-1",
             "worker.actor.offload.offload_params=false", "worker.actor.offload.offload_optimizer=false",
             f"trainer.save_checkpoint_path={out}", "worker.rollout.tensor_parallel_size=1",
             "worker.rollout.val_override_config.n=2", "algorithm.filter_key=accuracy", "trainer.max_try_make_batch=-1",
             "worker.actor.optim.lr_warmup_ratio=0.34", *more]
    return words, out


@pytest.mark.parametrize("override", OVERRIDES)
def test_easyr1_command_line_trains_with_each_algorithm(override, tmp_path, launch):
    """`python grpo.py config=<EasyR1's config.yaml> data.train_files=... worker.actor.model.model_path=<tiny>`
    plus the key, 3 steps on the CPU (batches shrunk for two cores; the digit task's reward and prompt)."""
    words, out = easyr1_words(tmp_path, *override.split())
    p = launch.run([sys.executable, "grpo.py", *words, "--rollout-engine", "hf"], tmp_path / "log", timeout=600)
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    cfg = json.load(open(out / "config.json"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "val/pass@2" in rows[-1]
    assert rows[-1]["val/pass@2"] >= rows[-1]["val/accuracy"]
    assert all(math.isfinite(r["actor/grad_norm"]) for r in rows[1:]) and "flags win" not in p.out
    key, value = override.split()[0].split("=")
    if key.endswith("loss_type"):
        assert cfg["loss_type"] == "sapo"
    elif key.endswith("adv_estimator"):
        assert cfg["adv_estimator"] == value
    elif key.endswith("use_kl_loss"):
        assert (cfg["kl_in_reward"], cfg["adv_estimator"], cfg["kl_penalty"]) == (True, "reinforce_plus_plus", "k1")
        assert all(r["actor/kl_coef"] == 0.01 and "actor/kl" not in r for r in rows[1:])
    elif key.endswith("lr_scheduler_type"):  # 1 warm-up step (0.34 x 3 optimizer steps), then the cosine to 0
        lrs = [r["actor/lr"] for r in rows[1:]]  # logged after each step: the next step's
        assert lrs == pytest.approx([1e-3 * r1_cosine(s, 1, 3) for s in (1, 2, 3)], abs=1e-12)
    else:
        assert cfg["filter_groups"] and all(r["dapo/groups_kept"] == 2 for r in rows[1:])


def test_adaptive_kl_coefficient_is_saved_and_resumed(tmp_path, launch):
    """The adaptive coefficient moves every step (a target far above the KL: down by the most it may), a checkpoint
    saves it, and a resumed run goes on from it rather than from kl_coef."""
    words, out = easyr1_words(tmp_path, "algorithm.use_kl_loss=false", "algorithm.kl_type=adaptive",
                              "algorithm.kl_target=100", "algorithm.kl_horizon=10", "trainer.val_freq=-1",
                              "trainer.val_before_train=false", "trainer.save_freq=1",
                              "worker.actor.optim.lr_warmup_ratio=0")  # made longer below: no warm-up spanning the run
    cmd = [sys.executable, "grpo.py", "--rollout-engine", "hf"]
    launch.run(cmd + [w.replace("trainer.max_steps=3", "trainer.max_steps=2") for w in words], tmp_path / "a.log",
               timeout=600)
    launch.run(cmd + words, tmp_path / "b.log", timeout=600)  # resumes from step 2
    coefs = [json.loads(x)["actor/kl_coef"] for x in open(out / "metrics.jsonl")]
    saved = [json.load(open(out / "checkpoints" / f"step_{s}" / "trainer_state.json"))["kl_coef"] for s in (1, 2)]
    # each step shrinks it by 1 - 0.2 x 8 samples / horizon 10
    assert coefs == pytest.approx([0.01 * 0.84 ** k for k in range(3)], rel=1e-9)
    assert saved == pytest.approx(coefs[1:], rel=1e-12)
