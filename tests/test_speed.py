"""The speed issue's pieces that are not attention: FLOPs for MFU, the realistic benchmark workload (forced
response lengths), truncated importance sampling (rollout correction)."""
import json
import threading
from types import SimpleNamespace

import pytest
import torch

import algos
import data
import flops
import fsdp_actor as actor
import grpo
import rollout
import tiny_model
from benchmarks import bench
from common import UserError
from easyr1_config import cli


# ------------------------------------------------------------------------------------------------------- FLOPs
def test_lm_flops_hand_computed_and_verl_convention():
    cfg = SimpleNamespace(hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=2, vocab_size=10)
    # per layer: MLP 3*4*6 = 72, q/o 2 * 4*4 = 32, k/v 2 * 4*2 = 16 -> 120; x 2 layers + embedding and head 2*10*4
    weights = 2 * 120 + 80
    assert flops.lm_forward_flops(cfg, [3, 5]) == 2 * weights * 8 + 2 * 2 * 2 * 2 * (9 + 25)
    # veRL's _estimate_qwen2_flops (training, fwd + bwd): 6 * dense_N * tokens + 6 * sum(s^2) * head_dim * heads * L
    assert 3 * flops.lm_forward_flops(cfg, [3, 5]) == 6 * 320 * 8 + 6 * 34 * 2 * 2 * 2


def _matrices(module):
    return sum(p.numel() for n, p in module.named_parameters() if p.dim() >= 2)


def test_flops_count_the_models_own_weights_and_attention_windows():
    """2 FLOPs per weight-matrix entry per token (the tiny model's actual matrices), and the vision attention
    term from the window lengths of transformers' own per-window attention calls."""
    from test_varlen import _vision_run
    path = tiny_model.build_tiny_model()
    grid = torch.tensor([[1, 16, 16], [1, 6, 10], [2, 4, 4]])
    _, _, _, calls, hf = _vision_run(path, False, grid)
    cfg, vc, vis = hf.config, hf.config.vision_config, hf.model.visual
    lm = hf.model.language_model
    per_token = _matrices(lm) - lm.embed_tokens.weight.numel() + 2 * cfg.text_config.vocab_size * 128
    assert flops.lm_forward_flops(cfg, [7]) == 2 * per_token * 7 + 2 * 2 * 4 * 32 * 49
    m2 = vc.spatial_merge_size ** 2
    per_patch = _matrices(vis.patch_embed) + _matrices(vis.blocks) + _matrices(vis.merger) / m2
    s2 = sum(q[-2] ** 2 for q in calls)  # q [1, heads, s, head_dim]: one call per window / frame
    tokens = int(grid.prod(-1).sum())
    assert flops.vision_forward_flops(vc, grid.tolist()) == pytest.approx(2 * per_patch * tokens
                                                                          + 4 * vc.hidden_size * s2, rel=1e-12)


# ------------------------------------------------------------------------------------------- realistic workload
def test_realistic_lengths_are_seeded_and_shaped_like_geo3k():
    a = bench.response_lengths(1, 42, 8, 1024)
    assert a == bench.response_lengths(1, 42, 8, 1024) and a != bench.response_lengths(1, 43, 8, 1024)
    ls = torch.tensor([x for p in range(1000) for x in bench.response_lengths(1, p, 8, 1024)], dtype=torch.float)
    assert 270 <= ls.median() <= 340 and 330 <= ls.mean() <= 410  # a few hundred tokens
    assert 0.02 <= (ls == 1024).float().mean() <= 0.05  # a few percent truncated
    assert (ls > 800).float().mean() > 0.05 and ls.min() >= 1  # a tail to the maximum


def test_hf_engine_forced_lengths_ignore_eos():
    """Forced lengths: exactly L tokens each, EOS sampled like any token but never a stop; up to the first EOS the
    samples are those of the normal path (same seed), and `finished` means "shorter than max_tokens"."""
    from test_rollout import make_record
    from PIL import Image
    path = tiny_model.build_tiny_model()
    eng = rollout.make_rollout("hf", model_path=path, device="cpu", dtype=torch.float32)
    p = make_record(path, Image.new("RGB", (84, 56), (220, 40, 40)), "What is the color of the shape?")
    lengths = [[40, 3, 40, 64, 40, 40, 40, 40]]
    kw = dict(n=8, temperature=1.0, top_p=1.0, max_tokens=64, seeds=[5])
    forced = eng.generate([p], lengths=lengths, **kw)[0]
    normal = eng.generate([p], **kw)[0]
    assert [len(o["response_ids"]) for o in forced] == lengths[0]
    assert [o["finished"] for o in forced] == [L < 64 for L in lengths[0]]
    assert all(len(o["logprobs"]) == len(o["response_ids"]) for o in forced)
    eos_mid = [o for o in forced if any(t in eng.eos_ids for t in o["response_ids"][:-1])]
    assert eos_mid  # (seed 5: some sample draws an EOS and carries on, sampling real tokens after it)
    for o in eos_mid:
        ids = o["response_ids"]
        first = next(i for i, t in enumerate(ids) if t in eng.eos_ids)
        assert any(t not in eng.eos_ids for t in ids[first + 1:]), ids
    for f, o in zip(forced, normal):
        k = min(len(f["response_ids"]), len(o["response_ids"]))
        assert f["response_ids"][:k] == o["response_ids"][:k]
        assert f["logprobs"][:k] == pytest.approx(o["logprobs"][:k], abs=1e-6)


# ------------------------------------------------------------------------------------------- rollout correction
def test_tis_weights_hand_computed():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.3], [0.4, 0.9, 0.1]]))
    roll = torch.log(torch.tensor([[0.25, 0.4, 0.3], [0.1, 0.9, 0.7]]))
    mask = torch.tensor([[True, True, False], [True, True, True]])  # the first row has 2 tokens
    w, st = algos.correction_weights(old, roll, mask, "token", cap=1.5)
    # token ratios: 2.0 -> 1.5 (capped), 0.5; 4.0 -> 1.5 (capped), 1.0, 1/7
    want = torch.tensor([[1.5, 0.5, 0.0], [1.5, 1.0, 1 / 7]])
    assert torch.allclose(w, want, atol=1e-6)
    assert float(st["mean"][0] / st["mean"][1]) == pytest.approx((1.5 + 0.5 + 1.5 + 1 + 1 / 7) / 5, abs=1e-6)
    assert float(st["capped_frac"][0] / st["capped_frac"][1]) == pytest.approx(2 / 5)
    assert float(st["max"]) == pytest.approx(4.0, rel=1e-5)  # before truncation
    w, st = algos.correction_weights(old, roll, mask, "sequence", cap=1.5)
    # sequence ratios: 2.0 * 0.5 = 1.0; 4.0 * 1.0 * 1/7 = 4/7
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 0.0], [4 / 7] * 3]), atol=1e-6)
    assert float(st["capped_frac"][0]) == 0 and float(st["capped_frac"][1]) == 2
    assert float(st["max"]) == pytest.approx(1.0, rel=1e-5)
    assert not w.requires_grad


@pytest.fixture(scope="module")
def update_setup():
    actor.init_distributed()
    path = tiny_model.build_tiny_model()
    from test_varlen import _samples
    samples, pad = _samples(path)
    return path, samples, pad


def _update(path, samples, pad, **cfg_kw):
    cfg = grpo.Config(rollout_batch_size=1, global_batch_size=1, n=len(samples), kl_coef=0.0, lr=0.0,
                      max_response_length=16, **cfg_kw)
    torch.manual_seed(0)
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
    opt, sched = actor.build_optimizer(model, 0.0, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    ctx = SimpleNamespace(cfg=cfg, model=model, ref=None, opt=opt, sched=sched, device=torch.device("cpu"), world=1,
                          pad_id=pad, skipped_run=0, skipped_total=0)
    return grpo.update_policy(ctx, samples, step=0)


def test_tis_in_the_update_matches_the_hand_formula(update_setup):
    """On-policy the clipped loss is -adv per token, so with TIS the policy loss is -sum(adv * w) / tokens with
    w = min(cap, pi_trainer / pi_engine): built here from the trainer's own log-probs and made-up engine ones."""
    path, samples, pad = update_setup
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
    lps, _ = actor.compute_logprobs(model, samples, pad, torch.device("cpu"), 1.0, 10_000, 64)
    g = torch.Generator().manual_seed(3)
    samples = [dict(s, adv=float(a), rollout_logp=(lp + torch.randn(len(lp), generator=g)).tolist())
               for s, a, lp in zip(samples, torch.linspace(-1, 1, len(samples)), lps)]
    none = _update(path, samples, pad)
    tis = _update(path, samples, pad, rollout_correction="tis", rollout_correction_cap=1.5)
    N = sum(len(s["response_ids"]) for s in samples)
    w = [(lp - torch.tensor(s["rollout_logp"])).exp().clamp(max=1.5) for s, lp in zip(samples, lps)]
    assert none["actor/pg_loss"] == pytest.approx(-sum(s["adv"] * len(lp) for s, lp in zip(samples, lps)) / N,
                                                  abs=1e-5)
    assert tis["actor/pg_loss"] == pytest.approx(-sum(s["adv"] * float(x.sum()) for s, x in zip(samples, w)) / N,
                                                 abs=1e-5)
    raw = torch.cat([(lp - torch.tensor(s["rollout_logp"])).exp() for s, lp in zip(samples, lps)])
    assert tis["rollout_corr/weight_mean"] == pytest.approx(float(torch.cat(w).mean()), abs=1e-5)
    assert tis["rollout_corr/capped_frac"] == pytest.approx(float((raw > 1.5).double().mean()), abs=1e-9)
    assert tis["rollout_corr/weight_max"] == pytest.approx(float(raw.max()), rel=1e-4)
    assert "rollout_corr/weight_mean" not in none
    assert 0 < none["perf/pad_fraction"] < 1  # padded rows on the CPU


def test_entropy_coeff_adds_the_bonus_to_the_loss_and_its_gradient(update_setup):
    """--entropy-coeff c: with every advantage 0 the loss is -c x the mean entropy of the policy's tokens, and it has
    a gradient (none without the bonus: the advantages are all 0)."""
    path, samples, pad = update_setup
    samples = [dict(s, adv=0.0) for s in samples]
    none, bonus = _update(path, samples, pad), _update(path, samples, pad, entropy_coeff=0.5)
    assert none["actor/loss"] == 0 and none["actor/grad_norm"] == 0
    assert bonus["actor/loss"] == pytest.approx(-0.5 * bonus["actor/entropy"], rel=1e-6)
    assert bonus["actor/grad_norm"] > 0 and bonus["actor/entropy"] == pytest.approx(none["actor/entropy"], rel=1e-6)


def test_tis_needs_engine_logprobs(update_setup):
    path, samples, pad = update_setup
    with pytest.raises(ValueError, match="rollout-correction"):
        _update(path, [dict(s, adv=0.0, rollout_logp=None) for s in samples], pad, rollout_correction="tis")


# ------------------------------------------------------------------------------------------------ prompts prefetched
def test_the_next_prompts_are_drawn_during_the_update_and_change_nothing(tmp_path, monkeypatch):
    """grpo.train draws step k+1's prompts on a second thread while step k's log-prob passes and update run: the
    same metrics step for step as drawing each step's at its start (the HF engine on the CPU repeats itself), steps
    2 and 3 take theirs from that thread, and a bad row met there stops the run with the draw's own error."""
    real, who = data.draw_prompts, []

    def spy(*a, **k):
        who.append((threading.current_thread().name, a[1]))  # (thread, cursor)
        return real(*a, **k)
    monkeypatch.setattr(data, "draw_prompts", spy)
    args = ["--rollout-engine", "hf", "--rollout-batch-size", "2", "--global-batch-size", "2", "--rollout-n", "2",
            "--max-steps", "3", "--val-freq", "0", "--save-freq", "-1", "--resume", "never", "--max-response-length",
            "6"]

    def run(out):
        grpo.train(cli(grpo.Config, grpo.DEMO, args=args + ["--output-dir", str(out)]))
        return [json.loads(x) for x in open(out / "metrics.jsonl")]
    got = run(tmp_path / "prefetched")
    assert who == [("MainThread", 0), ("prefetch_prompts", 2), ("prefetch_prompts", 4)], who
    # timing/prompts: the main thread's seconds getting them, the whole draw at step 1, a look-up after
    assert all(0 <= m["timing/prompts"] < got[0]["timing/prompts"] / 10 for m in got[1:]), got
    with monkeypatch.context() as m:
        m.setattr(grpo, "prefetch_prompts", lambda ctx, submit=None: None)
        who.clear()
        plain = run(tmp_path / "plain")
    assert who == [("MainThread", 0), ("MainThread", 2), ("MainThread", 4)], who
    def computed(m):  # what the step computed, without its clocks
        return {k: v for k, v in m.items() if not k.startswith(("timing/", "time/", "throughput/", "perf/", "memory/"))}
    assert len(computed(plain[0])) > 20 and list(map(computed, got)) == list(map(computed, plain))

    def bad_on_the_thread(*a, **k):
        if threading.current_thread().name == "prefetch_prompts":
            raise UserError("dataset row 3: no such image (images[0] = 'x.png')")
        return real(*a, **k)
    monkeypatch.setattr(data, "draw_prompts", bad_on_the_thread)
    with pytest.raises(UserError, match="dataset row 3: no such image"):
        run(tmp_path / "bad")
    assert len(open(tmp_path / "bad" / "metrics.jsonl").readlines()) == 1  # step 1 finished; step 2 took the error


def test_the_next_steps_requests_reach_the_engine_during_the_update(tmp_path, monkeypatch, capsys):
    """With an engine that takes requests ahead (VLLMRollout.submit; here the HF engine given a recording one), the
    prefetch thread hands it each next step's generate call: exactly the call that step then makes (the same prompt
    records, seeds, log-prob choices), none before a validation (its generate comes first), none with
    --prefetch-requests off, the same with auto (the default) as with on, and with an engine that has no intake `on`
    says in one line that it does nothing (auto says nothing); the drawn prompts are those of a run without."""
    calls, generate = [], rollout.HFRollout.generate

    def submit(self, **kw):
        calls.append(("submit", threading.current_thread().name, kw))
        return True

    def spy(self, prompts, **kw):
        calls.append(("generate", threading.current_thread().name, dict(kw, prompts=prompts)))
        return generate(self, prompts, **kw)
    monkeypatch.setattr(rollout.HFRollout, "submit", submit, raising=False)
    monkeypatch.setattr(rollout.HFRollout, "generate", spy)
    args = ["--rollout-engine", "hf", "--rollout-batch-size", "2", "--global-batch-size", "2", "--rollout-n", "2",
            "--max-steps", "4", "--val-freq", "2", "--val-max-rows", "2", "--save-freq", "-1", "--resume", "never",
            "--max-response-length", "4"]
    grpo.train(cli(grpo.Config, grpo.DEMO, args=args + ["--output-dir", str(tmp_path / "a"),
                                                        "--prefetch-requests", "on"]))
    # validation, steps 1, 2 (+ validation), 3, 4 (+ validation): after steps 1 and 3 the next step's call goes ahead
    order = [("generate", "MainThread")] * 2 + [("submit", "prefetch_prompts")] + [("generate", "MainThread")] * 3 + \
        [("submit", "prefetch_prompts")] + [("generate", "MainThread")] * 2
    assert [(c[0], c[1]) for c in calls] == order
    for i in (2, 6):
        ahead, made = calls[i][2], calls[i + 1][2]
        assert list(map(id, ahead.pop("prompts"))) == list(map(id, made.pop("prompts"))) and ahead == made
    assert calls[3][2]["logprobs"] == [0, 0] and calls[3][2]["n"] == 2  # (positions 2, 3: not a K-th)
    first = [c[2] for c in calls if c[0] == "generate"]
    calls.clear()
    grpo.train(cli(grpo.Config, grpo.DEMO, args=args + ["--output-dir", str(tmp_path / "b"),
                                                        "--prefetch-requests", "off"]))
    assert [c[0] for c in calls] == ["generate"] * 7
    assert [c[2]["seeds"] for c in calls] == [c["seeds"] for c in first]
    assert "--prefetch-requests does nothing" not in capsys.readouterr().out
    calls.clear()
    grpo.train(cli(grpo.Config, grpo.DEMO, args=args + ["--output-dir", str(tmp_path / "d")]))  # auto: as with on
    assert [(c[0], c[1]) for c in calls] == order
    monkeypatch.delattr(rollout.HFRollout, "submit")  # an engine without an intake: `on` says it does nothing
    for flag, says in (("on", True), ("auto", False)):
        grpo.train(cli(grpo.Config, grpo.DEMO, args=args + ["--output-dir", str(tmp_path / f"c{flag}"),
                                                            "--max-steps", "1", "--prefetch-requests", flag]))
        assert ("[rollout] --prefetch-requests does nothing here" in capsys.readouterr().out) == says


def test_the_realistic_workload_queues_the_call_it_makes(monkeypatch):
    """bench.py's realistic workload tells grpo's prefetch (--prefetch-requests) the generate call its collect then
    makes for the drawn prompts: the same forced lengths, seeds and log-prob choices."""
    cfg = grpo.Config(n=4, max_response_length=64, seed=3)
    drawn = [(pos, {"raw_prompt_ids": [pos]}) for pos in range(8, 12)]
    ctx, made = SimpleNamespace(cfg=cfg), []
    monkeypatch.setattr(grpo, "take_prompts", lambda ctx, count: drawn)
    monkeypatch.setattr(grpo, "generate_and_score", lambda ctx, d, n, t, **kw: made.append(
        grpo.rollout_call(ctx.cfg, d, n, t, **kw)))
    bench.realistic_collect(ctx, 0, {})
    assert bench.realistic_collect.requests is bench.realistic_requests and len(set(map(str, made[0]["lengths"]))) > 1
    assert made == [bench.realistic_requests(ctx, drawn)]
