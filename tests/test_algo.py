"""The algorithm's formulas against numbers worked out by hand."""
import math
import os

import pytest
import torch

from grpo import agg_loss, compute_advantages, kl_penalty, policy_loss
from rundir import sample_metrics

S = 1 / math.sqrt(1 / 3)  # 1/std of [1,0,0,1] (unbiased std = sqrt(1/3))


def test_grpo_advantages_hand_computed():
    adv = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) * S, atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))  # equal rewards: zero, not NaN


def test_single_sample_groups_are_finite():
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv = compute_advantages(torch.tensor([[1.0], [0.0]]), est)
        assert torch.isfinite(adv).all(), est


def test_other_estimators_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(compute_advantages(r, "dr_grpo"), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # RLOO: r_i - mean of the other three
    assert torch.allclose(compute_advantages(r, "rloo"), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    r2 = torch.tensor([[1.0, 0.0], [3.0, 3.0]])
    # REINFORCE++-baseline: group mean removed -> [.5,-.5,0,0], then whitened over the batch (std = sqrt(1/6))
    expect = torch.tensor([[0.5, -0.5], [0.0, 0.0]]) / math.sqrt(1 / 6)
    assert torch.allclose(compute_advantages(r2, "reinforce_plus_plus_baseline"), expect, atol=1e-5)
    # plain REINFORCE++: no group baseline, [1,0,3,3] whitened (mean 7/4, unbiased var 6.75 / 3 = 9/4)
    expect = (r2 - 7 / 4) / 1.5
    assert torch.allclose(compute_advantages(r2, "reinforce_plus_plus"), expect, atol=1e-5)
    assert torch.equal(compute_advantages(torch.ones(2, 3), "rloo"), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="adv_estimator"):
        compute_advantages(r, "nope")


# veRL's REINFORCE++ advantages, written out as veRL computes them (verl/trainer/ppo/core_algos.py and
# verl/utils/torch_functional.py masked_whiten), in float64 on [B, T] token tensors
def _verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = ((values - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8)
    var = var * mask.sum() / (mask.sum() - 1)  # unbiased
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_reinforce_pp(rewards, lengths, baseline, gamma=1.0):
    """rewards, lengths [G, n] -> veRL's per-token advantages [G*n, T] and the response mask."""
    r, L = rewards.flatten().double(), lengths.flatten()
    T = int(L.max())
    mask = (torch.arange(T)[None, :] < L[:, None]).double()  # [B, T]
    tok = torch.zeros(len(r), T, dtype=torch.float64)
    tok[torch.arange(len(r)), L - 1] = r  # the outcome reward sits on the last response token
    if baseline:  # compute_reinforce_plus_plus_baseline_outcome_advantage
        index = torch.arange(rewards.shape[0]).repeat_interleave(rewards.shape[1]).tolist()
        scores = tok.sum(-1)
        groups = {}
        for i, g in enumerate(index):
            groups.setdefault(g, []).append(scores[i])
        means = {g: torch.tensor(0.0) if len(v) == 1 else torch.stack(v).mean() for g, v in groups.items()}
        scores = torch.stack([scores[i] - means[g] for i, g in enumerate(index)])
        scores = scores.unsqueeze(-1).tile([1, T]) * mask
        return _verl_masked_whiten(scores, mask) * mask, mask
    returns, running = torch.zeros_like(tok), 0  # compute_reinforce_plus_plus_outcome_advantage
    for t in reversed(range(T)):
        running = tok[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return _verl_masked_whiten(returns, mask) * mask, mask


@pytest.mark.parametrize("est", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_matches_verl_in_float64(est):
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.9, 0.9], [0.0, 0.0, 1.0]])
    lengths = torch.tensor([[3, 1, 5], [2, 4, 1], [6, 2, 2]])
    ref, mask = _verl_reinforce_pp(rewards, lengths, est.endswith("baseline"))
    ours = compute_advantages(rewards, est, lengths)  # [G, n]: one scalar per sample
    assert ours.shape == rewards.shape
    tok = ours.flatten().double()[:, None] * mask  # every response token carries its sample's advantage
    assert torch.allclose(tok, ref, atol=1e-6)
    # the whitening is token-weighted: ignoring the lengths (per-sample statistics) gives other numbers
    assert (compute_advantages(rewards, est) - ours).abs().max() > 0.05
    # veRL's baseline variant gives a prompt with one sample a baseline of 0: its reward, whitened
    ref1, mask1 = _verl_reinforce_pp(rewards[:, :1], lengths[:, :1], est.endswith("baseline"))
    ours1 = compute_advantages(rewards[:, :1], est, lengths[:, :1])
    assert torch.allclose(ours1.flatten().double()[:, None] * mask1, ref1, atol=1e-6)
    assert ours1.abs().min() > 0.1


RPP = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _whiten_on_two_ranks(rank, rewards, lengths, out):
    import torch.distributed as dist
    # a file store, not rank 0's TCP store: rank 0 leaving first aborted rank 1's store client thread at teardown even
    # after a barrier (CI: SIGABRT, "terminate called without an active exception"), as test_memory's two-rank test saw
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=2)
    h = rewards.shape[0] // 2
    for est in RPP:
        adv = compute_advantages(rewards[rank * h:(rank + 1) * h], est, lengths[rank * h:(rank + 1) * h])
        torch.save(adv, os.path.join(out, f"{est}_{rank}.pt"))
    dist.barrier()
    # and no teardown: with the file store too, CI saw a rank abort at exit once more (SIGABRT, "terminate called
    # without an active exception", rank 0 this time): both ranks have written their results and passed the barrier
    os._exit(0)


def test_reinforce_plus_plus_whitens_over_all_ranks(tmp_path):
    # two gloo ranks, each with half the prompts (the second half much longer and better rewarded): the statistics
    # are those of the whole batch, as if one process held it
    import torch.multiprocessing as mp
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.5], [1.0, 1.0]])
    lengths = torch.tensor([[2, 1], [1, 3], [8, 5], [7, 9]])
    mp.spawn(_whiten_on_two_ranks, args=(rewards, lengths, str(tmp_path)), nprocs=2)
    for est in RPP:
        split = torch.cat([torch.load(tmp_path / f"{est}_{r}.pt") for r in range(2)])
        whole = compute_advantages(rewards, est, lengths)
        assert torch.allclose(split, whole, atol=1e-6), est
        per_rank = torch.cat([compute_advantages(rewards[:2], est, lengths[:2]),
                              compute_advantages(rewards[2:], est, lengths[2:])])
        assert (per_rank - whole).abs().max() > 0.1  # the test can tell global from per-rank statistics


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(lp, ref, "abs").item() == pytest.approx(math.log(2))
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert kl_penalty(lp, lp, "k3").item() == 0.0
    # k3 is an unbiased KL estimate: E_p[k3] over samples of p equals KL(p||q) for two categoricals
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    exact = (p * (p / q).log()).sum()
    est = (p * kl_penalty(p.log(), q.log(), "k3")).sum()
    assert est.item() == pytest.approx(exact.item(), rel=1e-5)


def test_ppo_clip_and_dual_clip_hand_computed():
    old = torch.zeros(1, 4)
    ratio = torch.tensor([[1.5, 0.5, 5.0, 1.1]])
    adv_tok = torch.tensor([1.0, -1.0, -1.0, 1.0])
    # one token per sequence, so each row is its own case
    logp = ratio.log().T  # [4, 1]
    loss, m = policy_loss(logp, old.T, adv_tok, torch.ones(4, 1), "ppo_clip", 0.2, 0.3, 3.0)
    # A=+1 r=1.5: max(-1.5, -1.3) = -1.3 ; A=-1 r=0.5: max(0.5, 0.8) = 0.8 ;
    # A=-1 r=5: max(5, 1.3) = 5 -> dual clip min(5, 3) = 3 ; A=+1 r=1.1: -1.1 (inside the range)
    assert torch.allclose(loss.flatten(), torch.tensor([-1.3, 0.8, 3.0, -1.1]), atol=1e-6)
    assert m["clipfrac"].flatten().tolist() == [1.0, 1.0, 0.0, 0.0]
    assert m["dual_clipfrac"].flatten().tolist() == [0.0, 0.0, 1.0, 0.0]
    # without dual clip the third token keeps its loss of 5
    loss_nd, _ = policy_loss(logp, old.T, adv_tok, torch.ones(4, 1), "ppo_clip", 0.2, 0.3, 0.0)
    assert loss_nd.flatten()[2].item() == pytest.approx(5.0)


def test_on_policy_gradient_is_minus_advantage():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2))
    agg_loss(loss, torch.ones(1, 2), "token").backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]]))  # -A / num_tokens * ratio(=1)


def test_gspo_sequence_ratio_hand_computed():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, 0.0, 0.3], [0.1, 0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, m = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask, "gspo", 3e-4, 4e-4)
    # seq ratios exp(0.2) and exp(0.1): both above 1+4e-4 and A>0, so both clipped to 1.0004, no gradient
    assert torch.allclose(loss, torch.full((2, 3), -1.0004), atol=1e-6)
    assert m["clipfrac"][0].tolist() == [1.0, 1.0, 1.0]
    loss_in, _ = policy_loss(torch.tensor([[1e-4, -1e-4]]), torch.zeros(1, 2), torch.tensor([1.0]),
                             torch.ones(1, 2), "gspo", 3e-4, 4e-4)
    assert torch.allclose(loss_in, torch.full((1, 2), -1.0), atol=1e-7)  # geometric mean ratio exactly 1


def test_cispo_hand_computed():
    logp = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), "cispo", 0.2, 0.28)
    # weights: min(2, 1.28) = 1.28 and 0.5 (no lower clip), detached; loss = -A * w * logp
    assert torch.allclose(loss, torch.tensor([[-1.28 * math.log(2.0), -0.5 * math.log(0.5)]]), atol=1e-6)
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.28, -0.5]]))  # clipped tokens keep a gradient
    assert m["clipfrac"].tolist() == [[1.0, 0.0]]


def test_loss_aggregation_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss, mask, "token").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq").item() == pytest.approx((2.0 + 4.0) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx(10 / (2 * 5))
    # a fully masked row contributes nothing and makes no NaN
    mask0 = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert agg_loss(loss, mask0, "token").item() == pytest.approx(2.0)
    assert agg_loss(loss, mask0, "seq").item() == pytest.approx(1.0)
    assert agg_loss(loss, torch.zeros(2, 3), "token").item() == 0.0
    # splitting a batch and passing the global normalisers reproduces the whole
    for mode in ("token", "seq", "seq-mean-token-sum-norm"):
        whole = agg_loss(loss, mask, mode, max_len=3)
        parts = sum(agg_loss(loss[i:i + 1], mask[i:i + 1], mode, num_tokens=4, num_seqs=2, max_len=3)
                    for i in range(2))
        assert parts.item() == pytest.approx(whole.item()), mode


def test_sample_metrics_by_hand():
    from types import SimpleNamespace
    s = lambda sc, r, p, fin: {"scores": {"overall": sc, "accuracy": sc}, "response_ids": [0] * r,  # noqa: E731
                               "prompt": {"prompt_ids": [0] * p}, "finished": fin}
    out = sample_metrics(SimpleNamespace(), [s(1.0, 4, 10, True), s(0.0, 8, 30, False)], "reward")
    assert out["reward/mean"] == out["reward/accuracy"] == 0.5
    assert out["response_length/mean"] == 6 and out["response_length/max"] == 8
    assert out["response_length/clip_ratio"] == 0.5
    assert out["prompt_length/mean"] == 20


def test_gspo_dual_clip_option_hand_computed():
    # A = -1 and a sequence ratio of e^2 = 7.39 (every token's log-ratio 2): the paper's and veRL's GSPO keeps the
    # loss 7.39; EasyR1's dual-clips it at clip_ratio_dual = 3 (and the gradient vanishes)
    logp = torch.full((1, 3), 2.0, requires_grad=True)
    mask, adv = torch.ones(1, 3), torch.tensor([-1.0])
    loss, m = policy_loss(logp, torch.zeros(1, 3), adv, mask, "gspo", 3e-4, 4e-4, 3.0)
    assert torch.allclose(loss, torch.full((1, 3), math.exp(2.0)), atol=1e-5) and m["dual_clipfrac"].sum() == 0
    loss_d, m_d = policy_loss(logp, torch.zeros(1, 3), adv, mask, "gspo", 3e-4, 4e-4, 3.0, gspo_dual_clip=True)
    assert torch.allclose(loss_d, torch.full((1, 3), 3.0)) and m_d["dual_clipfrac"].tolist() == [[1.0, 1.0, 1.0]]
    loss_d.sum().backward()
    assert torch.equal(logp.grad, torch.zeros(1, 3))


def test_cispo_clip_low_option_hand_computed():
    # ratio 0.5, A = -1: the paper's CISPO keeps the weight 0.5; EasyR1's and veRL's bound it at 1 - 0.2 = 0.8
    logp = torch.tensor([[math.log(0.5), math.log(2.0)]], requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), "cispo", 0.2, 0.28,
                          cispo_clip_low=True)
    assert torch.allclose(loss, torch.tensor([[0.8 * math.log(0.5), 1.28 * math.log(2.0)]]), atol=1e-6)
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.8, 1.28]]))  # -A * clipped weight, gradient kept
    assert m["clipfrac"].tolist() == [[1.0, 1.0]]
