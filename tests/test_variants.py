"""The policy-optimisation family's edge cases (groups of identical rewards, fully masked rows) against numbers worked
out by hand, and a one-step run of grpo.py with each adv_estimator, loss_type and loss_avg_mode."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from grpo import agg_loss, compute_advantages, policy_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
LOSSES = ("ppo_clip", "gspo", "cispo")
MODES = ("token", "seq", "seq-mean-token-sum-norm")


# ------------------------------------------------------------------------------------------------ advantages
@pytest.mark.parametrize("est", ESTIMATORS)
def test_identical_reward_groups_give_zero_advantage(est):
    for r in (torch.ones(3, 4), torch.zeros(1, 2), torch.full((2, 5), -1.0)):
        adv = compute_advantages(r, est)
        assert torch.equal(adv, torch.zeros_like(r)), est  # exactly 0: no NaN from a zero std


def test_mixed_batch_hand_computed():
    # group 0 all equal, group 1 = [0, 1, 2] (mean 1, unbiased std 1)
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0]])
    z = [0.0, 0.0, 0.0]
    expect = {
        "grpo": [z, [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)]],
        "dr_grpo": [z, [-1.0, 0.0, 1.0]],
        "rloo": [z, [0 - 1.5, 1 - 1.0, 2 - 0.5]],  # r_i - mean of the other two
        # group means removed -> [0,0,0,-1,0,1]: batch mean 0, unbiased batch std sqrt(2/5)
        "reinforce_plus_plus_baseline": [z, [-1 / math.sqrt(0.4), 0.0, 1 / math.sqrt(0.4)]],
        # no baseline: [1,1,1,0,1,2] - its mean 1 -> the same deviations, the same numbers
        "reinforce_plus_plus": [z, [-1 / math.sqrt(0.4), 0.0, 1 / math.sqrt(0.4)]],
    }
    for est, e in expect.items():
        assert torch.allclose(compute_advantages(r, est), torch.tensor(e), atol=1e-5), est


# ------------------------------------------------------------------------------------------------ losses
def _case(loss_type, mode, adv, logp_rows, mask_rows, old=None, clip=(0.2, 0.28), max_len=4, num_seqs=None):
    logp = torch.tensor(logp_rows, requires_grad=True)
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    old = torch.zeros_like(logp) if old is None else torch.tensor(old)
    tok, m = policy_loss(logp, old, torch.tensor(adv), mask, loss_type, *clip, 3.0)
    # the normalisers as update_policy passes them: live tokens and live rows, at least 1
    num_seqs = max(num_seqs if num_seqs is not None else mask.shape[0], 1)
    loss = agg_loss(tok, mask, mode, num_tokens=mask.sum().clamp(min=1), num_seqs=num_seqs, max_len=max_len)
    loss.backward()
    return loss, logp.grad, m


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_row_takes_no_part(loss_type, mode):
    # row 1 is a sample with loss_mask 0 (e.g. DAPO's overlong filtering): real, wild log-probs, all masked.
    # With the normalisers counting only live rows (as update_policy does) the loss and the gradient of row 0
    # are those of row 0 alone, and row 1 gets exactly zero gradient.
    live = [[0.05, -0.1, 0.02, 0.0]]
    both, g_both, _ = _case(loss_type, mode, [1.5, -2.0], live + [[3.0, -9.0, 8.0, 1.0]],
                            [[1, 1, 1, 0], [0, 0, 0, 0]], num_seqs=1)
    alone, g_alone, _ = _case(loss_type, mode, [1.5], live, [[1, 1, 1, 0]], num_seqs=1)
    assert torch.isfinite(both) and both.item() == pytest.approx(alone.item(), abs=1e-6)
    assert torch.equal(g_both[1], torch.zeros(4))
    assert torch.allclose(g_both[0], g_alone[0], atol=1e-6)
    # nothing live at all: zero loss, zero gradient, no NaN
    none, g_none, _ = _case(loss_type, mode, [1.0], [[0.3, 0.1, 0.0, 0.0]], [[0, 0, 0, 0]], num_seqs=0)
    assert none.item() == 0.0 and torch.equal(g_none, torch.zeros(1, 4))


@pytest.mark.parametrize("loss_type", LOSSES)
def test_zero_advantage_group_has_no_gradient(loss_type):
    loss, g, _ = _case(loss_type, "token", [0.0, 0.0], [[0.1, -0.2], [0.3, 0.0]], [[1, 1], [1, 0]])
    assert loss.item() == 0.0 and torch.equal(g, torch.zeros(2, 2))


def test_dr_grpo_constant_normaliser_hand_computed():
    # on-policy (ratio 1): token loss = -A. Rows of 1 and 3 tokens, A = +1 / -1, max_len 4, 2 sequences:
    # loss = (-1 + 3) / (2 * 4) = 0.25, and every token's gradient is -A / 8 whatever its sequence's length
    lp = [[-1.0, 0.0, 0.0], [-1.0, -2.0, -0.5]]
    lp_old = [[-1.0, 0.0, 0.0], [-1.0, -2.0, -0.5]]
    mask = [[1, 0, 0], [1, 1, 1]]
    loss, g, _ = _case("ppo_clip", "seq-mean-token-sum-norm", [1.0, -1.0], lp, mask, old=lp_old)
    assert loss.item() == pytest.approx(0.25)
    assert torch.allclose(g, torch.tensor([[-1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8]]))
    # the token mode instead divides by the 4 live tokens; the seq mode by each row's length, then 2 rows
    _, g_tok, _ = _case("ppo_clip", "token", [1.0, -1.0], lp, mask, old=lp_old)
    assert torch.allclose(g_tok, torch.tensor([[-1 / 4, 0, 0], [1 / 4, 1 / 4, 1 / 4]]))
    _, g_seq, _ = _case("ppo_clip", "seq", [1.0, -1.0], lp, mask, old=lp_old)
    assert torch.allclose(g_seq, torch.tensor([[-1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))


def test_gspo_gradient_is_sequence_ratio_over_length():
    # GSPO: grad = -A * s_i * (1/|y_i|) sum_t grad log pi. Inside the clip range (geometric mean ratio exactly 1):
    # with the seq mode every live token of the 2-token row gets -A * 1 / 2.
    loss, g, m = _case("gspo", "seq", [2.0], [[1e-4, -1e-4, 5.0]], [[1, 1, 0]], clip=(3e-4, 4e-4))
    assert loss.item() == pytest.approx(-2.0, abs=1e-6)
    assert torch.allclose(g, torch.tensor([[-1.0, -1.0, 0.0]]), atol=1e-6)
    assert m["clipfrac"][0, :2].tolist() == [0.0, 0.0]
    # negative advantage, sequence ratio exp(-0.2) < 1 - 3e-4: clipped at 0.9997, no gradient
    loss, g, m = _case("gspo", "seq", [-1.0], [[-0.2, -0.2]], [[1, 1]], clip=(3e-4, 4e-4))
    assert loss.item() == pytest.approx(0.9997, abs=1e-6) and torch.equal(g, torch.zeros(1, 2))
    assert m["clipfrac"].tolist() == [[1.0, 1.0]]


def test_cispo_negative_advantage_has_no_lower_clip():
    # ratio 0.5 < 1 - eps_low: PPO would clip it (no gradient); CISPO keeps the weight 0.5 and the gradient
    loss, g, m = _case("cispo", "token", [-1.0], [[math.log(0.5)]], [[1]])
    assert loss.item() == pytest.approx(0.5 * math.log(0.5))  # -A * w * logp
    assert g.item() == pytest.approx(0.5) and m["clipfrac"].item() == 0.0
    _, g_ppo, _ = _case("ppo_clip", "token", [-1.0], [[math.log(0.5)]], [[1]])
    assert g_ppo.item() == 0.0


# ------------------------------------------------------------------------------------------------ end to end
def _run(args, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    small = ["--max-steps", "1", "--rollout-batch-size", "2", "--rollout-n", "4", "--global-batch-size", "2",
             "--max-response-length", "4", "--val-freq", "0", "--output-dir", str(out)]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py")] + small + args, cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))][-1]


@pytest.mark.parametrize("args", [["--adv-estimator", e] for e in ESTIMATORS[1:]]
                         + [["--loss-type", t] for t in LOSSES[1:]]
                         + [["--loss-avg-mode", m] for m in MODES[1:]], ids=lambda a: a[1])
def test_grpo_runs_with_each_variant(args, tmp_path):
    m = _run(args, tmp_path)
    assert m["step"] == 1
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/clipfrac", "reward/mean"):
        assert math.isfinite(m[k]), k
