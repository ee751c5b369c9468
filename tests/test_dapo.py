"""dapo.py: the dynamic-sampling filter (by hand and as a property), the overlong shaping, the error when the batch
cannot be filled, and one short end-to-end run."""
import json
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo
from algos import select_groups
from dapo import DAPOConfig, collect_dynamic, shape_overlong


def fake(accs, n, length=3, finished=True):
    """Samples of len(accs)//n groups with the given accuracies (reward = accuracy)."""
    prompts = [{"prompt_text": f"q{g}"} for g in range(len(accs) // max(n, 1))]
    return [dict(prompt=prompts[i // n], response_ids=[1] * length, finished=finished, reward=float(a),
                 scores={"overall": float(a), "accuracy": float(a)}) for i, a in enumerate(accs)]


def test_select_groups_by_hand():
    s = fake([1, 1, 1, 0, 0, 0, 0, 1, 0, 0], n=2)  # groups: all-right, mixed, all-wrong, mixed, all-wrong
    kept, failed = select_groups(s, 2, "accuracy")
    assert kept == s[2:4] + s[6:8] and failed == 3
    kept, failed = select_groups(s, 2, "accuracy", limit=1)  # the batch is full after one group
    assert kept == s[2:4] and failed == 3
    assert select_groups(s, 2, "accuracy", limit=0)[0] == []
    # "overall" varies where accuracy does not: the key decides
    s2 = fake([1, 1], n=2)
    s2[0]["scores"]["overall"] = 0.5
    assert select_groups(s2, 2, "accuracy")[0] == [] and select_groups(s2, 2, "overall")[0] == s2


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5), groups=st.integers(0, 8), limit=st.integers(0, 10), data=st.data())
def test_select_groups_never_keeps_zero_variance_nor_too_many(n, groups, limit, data):
    accs = data.draw(st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=n * groups, max_size=n * groups))
    kept, failed = select_groups(fake(accs, n), n, "accuracy", limit=limit)
    assert len(kept) % n == 0 and len(kept) <= limit * n
    for g in range(0, len(kept), n):
        grp = kept[g:g + n]
        assert len({id(s["prompt"]) for s in grp}) == 1  # whole groups, in order
        assert len({s["scores"]["accuracy"] for s in grp}) > 1  # never a zero-variance group
    mixed = sum(len(set(accs[g:g + n])) > 1 for g in range(0, len(accs), n))
    assert failed == groups - mixed and len(kept) == min(mixed, limit) * n


def test_overlong_shaping_and_filtering():
    cfg = DAPOConfig(max_response_length=10, overlong_buffer_length=4, overlong_penalty_factor=0.5,
                     overlong_filtering=True)
    s = fake([1, 1, 0], n=3)
    s[1]["response_ids"] = [1] * 8  # 2 tokens into the buffer of 4: -0.5 * 2/4
    s[2]["response_ids"], s[2]["finished"] = [1] * 10, False  # cut off: the full -0.5, and masked out
    shape_overlong(s, cfg)
    assert [x["reward"] for x in s] == [1.0, 0.75, -0.5]
    assert [x["scores"]["overall"] for x in s] == [1.0, 0.75, -0.5]
    assert [x["scores"]["overlong_penalty"] for x in s] == [0.0, -0.25, -0.5]
    assert [x.get("loss_mask", 1) for x in s] == [1, 1, 0]
    assert s[2]["scores"]["accuracy"] == 0.0  # the filter still sees the raw accuracy
    off = shape_overlong(fake([1], 1, length=10, finished=False), DAPOConfig(max_response_length=10,
                                                                             overlong_buffer_length=0))
    assert off[0]["reward"] == 1.0 and "loss_mask" not in off[0]


def stub_ctx(monkeypatch, accs_per_try, **cfg_kw):
    """A ctx whose generate_and_score returns the given accuracies, try after try (one rank, no model)."""
    cfg = DAPOConfig(**{"rollout_batch_size": 2, "gen_batch_size": 2, "n": 2, "overlong_buffer_length": 0, **cfg_kw})
    tries = iter(accs_per_try)
    monkeypatch.setattr(grpo.data, "draw_prompts", lambda ds, cursor, count, *a: [(cursor + i, {})
                                                                                  for i in range(count)])
    monkeypatch.setattr(grpo, "generate_and_score", lambda ctx, drawn, n, t: fake(next(tries), n))
    return SimpleNamespace(cfg=cfg, rank=0, world=1, cursor=0, train=None, prefetch=None, prefetch_count=0,
                           prompt_seconds=0.0)


def test_collect_fills_the_batch_exactly(monkeypatch):
    ctx = stub_ctx(monkeypatch, [[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 1]])  # 1 mixed, then 0, then 2 (1 spare)
    m = {}
    out = collect_dynamic(ctx, 0, m)
    assert len(out) == 4 and [[s["scores"]["accuracy"] for s in g] for g in grpo.by_prompt(out, 2)] == [[0, 1], [1, 0]]
    assert all(len({id(s["prompt"]) for s in g}) == 1 for g in grpo.by_prompt(out, 2))  # whole groups
    assert ctx.cursor == 6  # three tries of 2 prompts
    assert m["dapo/tries"] == 3 and m["dapo/groups_generated"] == 6 and m["dapo/groups_filtered"] == 3
    assert m["dapo/groups_kept"] == 2 and m["dapo/groups_surplus"] == 1
    assert m["dapo/generated_accuracy"] == pytest.approx(5 / 12)


def test_collect_errors_after_max_try_make_batch(monkeypatch):
    ctx = stub_ctx(monkeypatch, [[1, 1, 1, 1]] * 3, max_try_make_batch=3)
    with pytest.raises(grpo.UserError, match="max_try_make_batch=3.*--max-try-make-batch.*all-correct or all-wrong"):
        collect_dynamic(ctx, 0, {})
    ctx = stub_ctx(monkeypatch, [[1, 1, 1, 1]], filter_key="nope")
    with pytest.raises(grpo.UserError, match="--filter-key nope: not a score"):
        collect_dynamic(ctx, 0, {})


@pytest.mark.parametrize("nproc", [1, 2])
def test_dapo_end_to_end_smoke(tmp_path, nproc, launch):
    # 2 tries per step at most would often fail on the untrained model: leave the tries unlimited here
    args = ["--max-steps", "2", "--rollout-batch-size", "2", "--rollout-n", "4", "--global-batch-size", "2",
            "--gen-batch-size", "4", "--max-try-make-batch", "0", "--val-freq", "0", "--overlong-filtering",
            "--output-dir", str(tmp_path)]
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                                   if nproc > 1 else [])
    launch.run(launcher + ["dapo.py"] + args, tmp_path / "dapo.log")
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("dapo/tries", "dapo/groups_generated", "dapo/groups_kept", "dapo/groups_filtered"):
            assert k in r, k
        assert r["dapo/groups_kept"] == 2 and r["dapo/groups_generated"] >= 2
        parts = r["dapo/groups_kept"] + r["dapo/groups_filtered"] + r["dapo/groups_surplus"]
        assert r["dapo/groups_generated"] == parts
        assert "actor/kl" not in r  # no reference model
    cfg = json.load(open(tmp_path / "config.json"))  # the run used dapo.py's defaults, not grpo.py's (0.3, 0.01)
    assert cfg["clip_ratio_high"] == 0.28 and cfg["kl_coef"] == 0.0
