"""The policy-optimisation family's edge cases (groups of identical rewards, fully masked rows) against numbers worked
out by hand, and a one-step training run with each adv_estimator, loss_type and loss_avg_mode that shows the option
reaches its function."""
import inspect
import json
import math

import pytest
import torch

import grpo
from grpo import agg_loss, compute_advantages, policy_loss
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
SPIED = {"adv_estimator": ("compute_advantages", "estimator"), "loss_type": ("policy_loss", "loss_type"),
         "loss_avg_mode": ("agg_loss", "mode")}  # option -> (grpo's function, its parameter)


@pytest.mark.parametrize("option, value", [("adv_estimator", e) for e in ESTIMATORS[1:]]
                         + [("loss_type", t) for t in LOSSES[1:]]
                         + [("loss_avg_mode", m) for m in MODES[1:]], ids=lambda v: v)
def test_each_variant_reaches_its_function(option, value, tmp_path, monkeypatch):
    """The option on grpo.py's command line, one training step in this process (the demo's settings, tiny sizes)
    with spies on the three functions: each got the configured variant on every call (an option dropped on the way
    would reach it as the default), and the step finished with finite numbers. The math of each variant is the
    hand-computed tests above."""
    from easyr1_config import cli
    seen = {fn: [] for fn, _ in SPIED.values()}
    for fn, param in SPIED.values():
        real = getattr(grpo, fn)

        def spy(*args, _real=real, _fn=fn, _param=param, **kwargs):
            seen[_fn].append(inspect.signature(_real).bind(*args, **kwargs).arguments.get(_param))
            return _real(*args, **kwargs)
        monkeypatch.setattr(grpo, fn, spy)
    args = ["--" + option.replace("_", "-"), value, "--rollout-engine", "hf", "--rollout-batch-size", "2",
            "--global-batch-size", "2", "--rollout-n", "4", "--max-steps", "1", "--val-freq", "0", "--save-freq", "-1",
            "--resume", "never", "--output-dir", str(tmp_path)]
    cfg = cli(grpo.Config, grpo.DEMO, args=args)  # as grpo.main makes it
    grpo.train(cfg)
    for opt, (fn, _) in SPIED.items():  # the varied option, and the defaults of the other two
        assert seen[fn] and set(seen[fn]) == {value if opt == option else getattr(grpo.Config(), opt)}, (fn, seen[fn])
    (m,) = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert m["step"] == 1
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/clipfrac", "reward/mean"):
        assert math.isfinite(m[k]), k
