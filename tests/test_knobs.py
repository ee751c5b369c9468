"""The two speed knobs of the trainer, each against its plain fallback: a token bound of its own for the no-grad log-prob
passes (--logprob-max-token-len-per-device) gives the same log-probs in fewer micro-batches, and selective activation
checkpointing (--checkpoint-layers) gives the same loss and gradients with fewer layers recomputed; the memory model
counts both."""
import gc
import json
import math
import weakref
import shutil
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn as nn

import fsdp_actor as actor
import grpo
import memory
import tiny_model
from common import UserError
from easyr1_config import check, cli
from test_varlen import _samples
from benchmarks import bench

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ the log-prob passes' own token bound
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_4x_logprob_bound_gives_the_same_logprobs_in_fewer_micro_batches(packed, tmp_path, monkeypatch):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "m"))
    samples, pad = _samples(path)
    model = actor.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=False,
                              padding_free="on" if packed else "off", vision_varlen="on" if packed else "off",
                              share_prompts=False).eval()  # (each sample's own tokens: the counts below)
    assert model.packed == packed
    counts, real = [], actor.make_micro_batches

    def spy(*a, **k):
        out = real(*a, **k)
        counts.append(len(out))
        return out
    monkeypatch.setattr(actor, "make_micro_batches", spy)
    update = grpo.Config(max_token_len_per_device=60, micro_batch_size_per_device=2)  # the update's bounds
    got = {}
    for lp_bound in (0, 240):  # 0: today's (the update's bounds); 4 x the update's tokens, no sample cap
        bounds = grpo.logprob_bounds(replace(update, logprob_max_token_len_per_device=lp_bound))
        assert bounds == (dict(max_tokens=60, max_samples=2) if not lp_bound else
                          dict(max_tokens=240, max_samples=math.inf))
        got[lp_bound], _ = actor.compute_logprobs(model, samples, pad, CPU, 1.0, **bounds)
    assert counts == [6, 2], counts  # 6 samples of 31..61 tokens: one per micro-batch, then 2 (240 tokens each)
    for a, b in zip(got[0], got[240], strict=True):  # fp32: only the padding and grouping differ
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5), (a, b)


def test_the_log_prob_passes_of_a_step_get_their_own_bound(tmp_path, monkeypatch):
    """grpo.py's old and reference passes (one step of the demo, two mini-batches: both passes run) get the new
    bound, the update keeps its own; the policy recomputes the share of layers asked for, the reference none."""
    seen, real = [], actor.compute_logprobs
    monkeypatch.setattr(actor, "compute_logprobs", lambda *a, **k: (seen.append((k["max_tokens"], k["max_samples"])),
                                                                     real(*a, **k))[1])
    built, build = [], actor.build_actor
    monkeypatch.setattr(actor, "build_actor", lambda *a, **k: (built.append(k.get("checkpoint_layers", 1.0)),
                                                                build(*a, **k))[1])
    args = ["--rollout-engine", "hf", "--rollout-batch-size", "2", "--global-batch-size", "1", "--rollout-n", "2",
            "--max-steps", "1", "--val-freq", "0", "--save-freq", "-1", "--resume", "never", "--output-dir",
            str(tmp_path), "--max-token-len-per-device", "700", "--logprob-max-token-len-per-device", "2800",
            "--checkpoint-layers", "0.5"]
    cfg = cli(grpo.Config, grpo.DEMO, args=args)
    ctx = grpo.train(cfg)
    assert seen == [(2800, math.inf)] * 2  # the old policy's pass and the reference's
    assert built == [0.5, 1.0]  # the policy's share; the frozen reference never recomputes (no backward)
    flags = [m.gradient_checkpointing for n, m in ctx.model.hf.named_modules() if ".layers." in n and
             hasattr(m, "gradient_checkpointing") and n.count(".") == 3]  # model.language_model.layers.i
    assert flags == [True, False]
    (m,) = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert math.isfinite(m["actor/grad_norm"]) and m["timing/old_logprob"] > 0 and m["timing/ref_logprob"] > 0


def test_the_heap_is_frozen_after_the_first_step_and_unfrozen_at_the_end(tmp_path):
    """grpo.train moves what is alive after its first step out of the collector's walks (vLLM's sleep runs a full
    collection every step) and hands it back when the run ends; a step's cyclic garbage is still collected."""
    counts, collected = [], []

    def collect(ctx, step, metrics):
        counts.append(gc.get_freeze_count())
        cycle = [None]
        cycle[0] = cycle
        probe = weakref.ref(type("Probe", (), {})())  # (a class is cyclic: its __mro__ holds it)
        del cycle
        gc.collect()  # as vLLM's sleep: young cyclic garbage goes, frozen or not
        collected.append(probe() is None)
        return grpo.collect_rollouts(ctx, step, metrics)
    args = ["--rollout-engine", "hf", "--rollout-batch-size", "2", "--global-batch-size", "2", "--rollout-n", "2",
            "--max-steps", "3", "--val-freq", "0", "--save-freq", "-1", "--resume", "never", "--output-dir",
            str(tmp_path), "--max-response-length", "4"]
    assert gc.get_freeze_count() == 0
    grpo.train(cli(grpo.Config, grpo.DEMO, args=args), collect=collect)
    assert counts[0] == 0 and min(counts[1:]) > 1000, counts  # the model, the optimizer, ... (refcounting still frees)
    assert collected == [True] * 3 and gc.get_freeze_count() == 0


def test_the_options_are_checked():
    for bad in (dict(checkpoint_layers=1.5), dict(checkpoint_layers=-0.1), dict(logprob_max_token_len_per_device=-1)):
        with pytest.raises(UserError, match="--checkpoint-layers"):
            check(grpo.Config(model_path="", **bad), 1)


# ------------------------------------------------------------------------------ selective activation checkpointing
def _fake_model(n_text, n_vision):
    """A module tree shaped like a Qwen-VL: model.visual.blocks and model.language_model.layers of checkpointable
    layers, all turned on as transformers turns them on."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # (slow to import)
    layer = type("Layer", (GradientCheckpointingLayer,), {})
    model = nn.Module()
    model.visual, model.language_model = nn.Module(), nn.Module()
    model.visual.blocks = nn.ModuleList(layer() for _ in range(n_vision))
    model.language_model.layers = nn.ModuleList(layer() for _ in range(n_text))
    hf = nn.Module()
    hf.model = model
    for m in hf.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m.gradient_checkpointing = True
    return hf


@pytest.mark.parametrize("share, layers, want", [(1.0, 36, 36), (0.5, 36, 18), (0.75, 36, 27), (0.7, 10, 7),
                                                 (0.55, 10, 6), (0.01, 36, 1), (0.0, 36, 0)])
def test_the_first_ceil_share_x_layers_recompute_and_the_vision_blocks_all(share, layers, want):
    hf = _fake_model(layers, 3)
    assert actor.recompute_first_layers(hf, share) == want
    assert [m.gradient_checkpointing for m in hf.model.language_model.layers] == [True] * want + [False] * (layers - want)
    assert all(m.gradient_checkpointing for m in hf.model.visual.blocks)


def _deeper_tiny(tmp_path, layers=4):
    """The demo's tiny Qwen2.5-VL with `layers` decoder layers (random, seeded), its tokenizer and processor."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration  # (slow to import)
    src = tiny_model.build_tiny_model(str(tmp_path / "tiny"))
    out = str(tmp_path / f"tiny{layers}")
    shutil.copytree(src, out)
    cfg = AutoConfig.from_pretrained(src)
    t = cfg.text_config
    t.num_hidden_layers, t.layer_types = layers, t.layer_types[:1] * layers
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32).save_pretrained(out)
    return out


def _loss_and_grads(path, samples, pad, share):
    """One micro-batch's weighted log-prob sum and every parameter's gradient, with checkpointing on and `share` of
    the decoder layers recomputing; and the decoder layers whose checkpoint function ran."""
    model = actor.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=True,
                              checkpoint_layers=share)
    ran = []
    for i, layer in enumerate(model.hf.model.language_model.layers):
        real = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _i=i, _real=real, **k: (ran.append(_i), _real(*a, **k))[1]
    batch, _ = actor.collate(samples, pad, CPU, model)
    lp, _ = model(**batch)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1))
    loss = (lp * w).sum()
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, ran


def test_selective_checkpointing_gives_the_loss_and_gradients_of_full_checkpointing(tmp_path):
    actor.init_distributed()
    path = _deeper_tiny(tmp_path, layers=4)
    samples, pad = _samples(path)
    loss, grads, ran = _loss_and_grads(path, samples, pad, 1.0)
    assert ran == [0, 1, 2, 3]  # today: every decoder layer recomputes
    for share, first in ((0.5, [0, 1]), (0.25, [0]), (0.0, [])):
        l2, g2, ran = _loss_and_grads(path, samples, pad, share)
        assert ran == first, (share, ran)  # the first ceil(share x 4) layers go through the checkpoint, no other
        assert torch.allclose(l2, loss, rtol=0, atol=1e-6)
        assert g2.keys() == grads.keys() and len(grads) > 20
        for n in grads:
            assert torch.allclose(g2[n], grads[n], rtol=0, atol=1e-6), (share, n)


# ------------------------------------------------------------------------------ the memory model
def test_the_memory_model_counts_the_kept_layers_and_the_log_prob_micro_batch():
    dims = bench.model_dims("qwen2_5_vl_3b")  # 36 layers
    base = memory.memory_model(dims, mb_tokens=32768)
    half = memory.memory_model(dims, mb_tokens=32768, recompute=0.5)
    layer = 32768 * 2 * (4 * dims["hidden"] + 3 * dims["inter"]) / memory.GIB  # one layer's bf16 activations
    assert half["update"] - base["update"] == pytest.approx(18 * layer)
    assert (half["gen"], half["ref"]) == (base["gen"], base["ref"])
    big = memory.memory_model(dims, mb_tokens=32768, lp_tokens=4 * 32768)
    assert big["update"] == base["update"] and big["ref"] > base["ref"]
    assert memory.memory_model(dims, mb_tokens=32768, lp_tokens=32768) == base  # the default: the update's
    # a run's options reach it: the log-prob bound (no sample cap), the share, and no checkpointing = none recompute
    c = asdict(grpo.Config(rollout_batch_size=64, n=8, max_response_length=1024, max_token_len_per_device=16384))
    mode = memory.config_mode(c, 1)
    assert mode["lp_tokens"] == mode["mb_tokens"] and mode["recompute"] == 1.0
    tokens = memory.PROMPT_TOKENS + 1024
    mode = memory.config_mode({**c, "logprob_max_token_len_per_device": 4 * 16384, "checkpoint_layers": 0.25}, 1)
    assert mode["lp_tokens"] == 4 * 16384 // tokens * tokens and mode["recompute"] == 0.25
    assert memory.config_mode({**c, "gradient_checkpointing": False}, 1)["recompute"] == 0.0
    old = {k: v for k, v in c.items() if k not in ("logprob_max_token_len_per_device", "checkpoint_layers")}
    assert memory.config_mode(old, 1) == memory.config_mode(c, 1)  # a summary written before these options


def test_checkpoint_layers_auto_keeps_what_fits_the_card():
    """--checkpoint-layers auto (bench.py's default): the fewest recomputed layers whose update, by the memory model
    grown by its 15 % error bound, fits the card. The 3B bar on one H200 (140.4 GiB, 64k-token micro-batches):
    29 of 36 layers, the setting measured at 119.8 GiB (the model: 117.4; one layer fewer, 122.4, would pass
    140.4 with the bound: the 0.75 that ran out of memory on 2026-12-01 kept 9). Smaller cards recompute more,
    a card too small for any share falls back to every layer, and no card, no known model or no checkpointing
    means every layer; a number passes through."""
    dims = bench.model_dims("qwen2_5_vl_3b")
    bar = asdict(bench.defaults("/w", "/m", "/d"))
    assert bar["checkpoint_layers"] == "auto"
    assert memory.auto_checkpoint_layers(bar, dims, 1, 140.4) == 29 / 36
    shares = [memory.auto_checkpoint_layers(bar, dims, 1, card) for card in (140.4, 130, 110, 98)]
    assert shares == sorted(shares) and shares[-1] == 1.0 and shares[-2] < 1.0
    for share in shares[:-1]:
        m = memory.memory_model(dims, **memory.config_mode({**bar, "checkpoint_layers": share}, 1))
        assert m["update"] * 1.15 <= 139.4 and share * 36 == round(share * 36)
    assert memory.auto_checkpoint_layers(bar, dims, 2, 140.4) < 29 / 36  # FSDP over 2: half the state per GPU
    assert memory.config_mode(bar, 1)["recompute"] == 1.0  # the check before loading: auto at its most
    cfg = grpo.Config(model_path="Qwen/Qwen2.5-VL-3B-Instruct", checkpoint_layers="auto",
                      **{k: bar[k] for k in ("rollout_batch_size", "global_batch_size", "n", "max_token_len_per_device",
                                              "micro_batch_size_per_device", "max_response_length")})
    share, note = memory.resolve_checkpoint_layers(cfg, 1, card_gib=140.4)
    assert share == 29 / 36 and "29 of 36 decoder layers recompute" in note and "of 140.4" in note
    assert memory.resolve_checkpoint_layers(replace(cfg, model_path="/nowhere"), 1, card_gib=140.4)[0] == 1.0
    assert memory.resolve_checkpoint_layers(replace(cfg, gradient_checkpointing=False), 1, card_gib=140.4)[0] == 1.0
    assert memory.resolve_checkpoint_layers(replace(cfg, checkpoint_layers=0.5), 1, card_gib=140.4) == (0.5, "")
    # padded rows (the padded realistic run at 29 of 36 ran out of memory: benchmarks/HISTORY.md): every layer
    for padded in (dict(padding_free="off"), dict(attn_implementation="sdpa"), dict(dtype="fp32"),
                   dict(model_path="Qwen/Qwen3-VL-30B-A3B-Instruct")):  # (the MoE packs only when asked)
        share, note = memory.resolve_checkpoint_layers(replace(cfg, **padded), 1, card_gib=140.4)
        assert share == 1.0 and "every layer recomputes (padded rows" in note, padded
    assert memory.resolve_checkpoint_layers(replace(cfg, padding_free="on"), 1, card_gib=140.4)[0] == 29 / 36
    assert memory.resolve_checkpoint_layers(replace(cfg, dtype="fp32", precision="bf16"), 1, card_gib=140.4)[0] < 1
    if not torch.cuda.is_available():
        share, note = memory.resolve_checkpoint_layers(cfg, 1)
        assert share == 1.0 and "no GPU" in note
    check(replace(cfg, model_path=""), 1)  # auto passes the options' check


def test_checkpoint_layers_auto_reaches_the_actor_as_a_share(tmp_path, monkeypatch, capsys):
    """grpo.py --checkpoint-layers auto: setup resolves it before the policy is built (the actor gets a number,
    config.json records it) and says what it chose; on the CPU every layer recomputes."""
    built, build = [], actor.build_actor
    monkeypatch.setattr(actor, "build_actor", lambda *a, **k: (built.append(k.get("checkpoint_layers", 1.0)),
                                                                build(*a, **k))[1])
    cfg = cli(grpo.Config, grpo.DEMO, args=["--rollout-engine", "hf", "--checkpoint-layers", "auto", "--max-steps",
                                            "1", "--save-freq", "-1", "--resume", "never", "--output-dir",
                                            str(tmp_path)])
    assert cfg.checkpoint_layers == "auto"
    grpo.setup(cfg)
    assert built[0] == 1.0 and cfg.checkpoint_layers == 1.0
    assert "--checkpoint-layers auto: every layer recomputes (no GPU)" in capsys.readouterr().out
