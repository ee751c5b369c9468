"""Ulysses sequence parallelism (ulysses.py) under torchrun on gloo, 2 and 4 ranks: on the same packed row, K = 2
and K = 4 give the per-token log-probs, entropies, loss and every parameter's gradient of K = 1 (fp32, 1e-5), for
a Qwen2.5-VL and a Qwen3-VL (deepstack) row with images and a Qwen3 text row, each prompt once in the row and not.
As a script: one rank."""
import os
import sys

import pytest

from common import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3"])
def test_ulysses_equals_one_rank_per_row(arch, ranks, tmp_path, launch):
    p = launch.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", ranks, "--master-port",
                    free_port(), os.path.abspath(__file__), arch, tmp_path], tmp_path / "log", timeout=300,
                   PYTHONPATH=ROOT)
    for K in (2, 4) if ranks == 4 else (2,):
        assert f"ULYSSES_OK {arch} K={K} world={ranks}" in p.out, p.out[-3000:]


def test_grpo_with_ulysses_size_2_takes_the_steps_of_size_1(tmp_path, launch):
    """The trainer end to end on two ranks: --ulysses-size 2 (both ranks' samples trained together, each row split
    over the two) takes the steps of --ulysses-size 1: the same samples, loss, KL, entropy and gradient norms, over
    two mini-batches and two epochs (each rank's share cut into mini-batches as that rank alone cuts it)."""
    import json
    import tiny_model
    from test_multirank import REWARD
    (tmp_path / "r.py").write_text(REWARD)
    tiny_model.make_color_dataset(str(tmp_path / "train.parquet"), 32, seed=0)
    args = ["--format-prompt", tiny_model.DEMO_FORMAT_PROMPT, "--val-freq", "0", "--rollout-batch-size", "4",
            "--rollout-n", "4", "--global-batch-size", "2", "--ppo-epochs", "2", "--max-response-length", "6",
            "--max-steps", "2", "--save-freq", "-1", "--log-samples", "1", "--padding-free", "on", "--train-files",
            tmp_path / "train.parquet", "--reward-function", f"{tmp_path / 'r.py'}:varied"]
    for K in (1, 2):
        launch.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port",
                    free_port(), "grpo.py", "--output-dir", tmp_path / f"k{K}", "--ulysses-size", K] + args,
                   tmp_path / f"k{K}.log")
    one, two = ([json.loads(x) for x in open(tmp_path / d / "metrics.jsonl")] for d in ("k1", "k2"))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
        for k in ("actor/pg_loss", "actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm"):
            assert abs(a[k]) > 1e-3 and a[k] == pytest.approx(b[k], rel=1e-5), k


def _text_samples(path):
    import data
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    ps = [data.encode_prompt({"problem": q, "answer": "1", "images": []}, tok)
          for q in ("Name a colour.", "What is the largest digit of 90417? Think step by step.")]
    return [dict(prompt=ps[i % 2], response_ids=[(7 * i + j) % 300 + 3 for j in range(3 + 11 * i % 29)])
            for i in range(6)], tok.pad_token_id


def _step(path, samples, pad, K, share, world):
    """One micro-batch through the policy and grpo's loss as update_policy takes it: log-probs, entropies, loss
    (the whole group's), every parameter's full gradient."""
    import torch
    import torch.distributed as dist
    import fsdp_actor as actor
    import grpo
    import rundir
    import ulysses
    group = ulysses.make_group(K)
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, padding_free="on",
                              vision_varlen="on" if "qwen2_5_vl" in path else "off", share_prompts=share,
                              ulysses_group=group)
    batch, resp_len = actor.collate(samples, pad, torch.device("cpu"), model)
    lp, ent = model(**batch)  # [n], [n]
    logp, mask = actor.pad_responses(lp, resp_len)
    ent_p, _ = actor.pad_responses(ent, resp_len)
    cfg = grpo.Config(kl_coef=0.0, entropy_coeff=0.1)
    # update_policy's normalisers: summed over ranks, each of a Ulysses group's K ranks holding the same samples
    tokens = float(actor.all_reduce_cpu(float(resp_len.sum()))) / K
    norm = dict(num_tokens=tokens, num_seqs=len(samples) * world / K, max_len=64)
    loss, _ = grpo.micro_batch_loss(cfg, logp, ent_p, mask, samples, norm, rundir.MetricSums(), first_pass=True)
    (loss * world).backward()  # as update_policy: FSDP averages over all ranks, the normalisers are global
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    dist.barrier()
    return lp.detach(), ent.detach(), float(loss.detach()) * world / K, grads


def main(arch, tmp):
    import torch
    import torch.distributed as dist
    import fsdp_actor as actor
    import tiny_model
    rank, world, _ = actor.init_distributed()
    path = tiny_model.build_tiny_model(os.path.join(tmp, arch), arch=arch, rank=rank)
    if arch == "qwen3":
        samples, pad = _text_samples(path)
    else:
        from test_varlen import _samples  # one image, two images, none; 2 samples each
        samples, pad = _samples(path)
    g = torch.Generator().manual_seed(3)
    for s in samples:
        s["adv"] = float(torch.randn((), generator=g))
    n_row = sum(len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    for K in (2, 4) if world == 4 else (2,):
        for share in (False, True):
            torch.manual_seed(0)
            ref = _step(path, samples, pad, 1, share, world)
            got = _step(path, samples, pad, K, share, world)
            for name, a, b in zip(("log-probs", "entropies"), got[:2], ref[:2]):
                assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, (a - b).abs().max())
            assert abs(got[2] - ref[2]) <= 1e-5 * abs(ref[2]) and ref[2] != 0, (got[2], ref[2])
            assert got[3].keys() == ref[3].keys() and sum(bool(b.abs().max() > 0) for b in ref[3].values()) > 10
            for n, b in ref[3].items():  # (Qwen3-VL's last deepstack merger: 0 in both, the tiny LLM has 2 layers)
                assert (got[3][n] - b).abs().max() <= 1e-5 * b.abs().max(), (n, share)
        if rank == 0:
            print(f"ULYSSES_OK {arch} K={K} world={world} ({n_row} tokens in the row)", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])


def test_what_ulysses_cannot_split_is_one_line(tmp_path, launch):
    """Known before loading (presets.known_config): Qwen3.5's Gated DeltaNet layers, and heads K does not divide,
    stop grpo.py with one line naming the option; Qwen2.5-VL-7B's 28 heads split over 4 ranks."""
    import easyr1_config
    import grpo
    import presets
    import ulysses
    from common import UserError
    with pytest.raises(UserError, match=r"--ulysses-size 3: must divide the number of ranks \(4\)"):
        easyr1_config.check(grpo.Config(ulysses_size=3), 4)
    with pytest.raises(UserError, match=r"--ulysses-size 2: not built for qwen3_5 \(Gated DeltaNet"):
        ulysses.check_model(presets.known_config("Qwen/Qwen3.5-9B"), 2)
    with pytest.raises(UserError, match=r"--ulysses-size 8: must divide the model's 28 attention heads"):
        ulysses.check_model(presets.known_config("Qwen/Qwen2.5-VL-7B-Instruct"), 8)
    ulysses.check_model(presets.known_config("Qwen/Qwen2.5-VL-7B-Instruct"), 4)
    ulysses.check_model(presets.known_config("Qwen/Qwen3-4B"), 8)
    p = launch.run([sys.executable, "grpo.py", "--model-path", "Qwen/Qwen3.5-9B", "--ulysses-size", "2",
                    "--output-dir", tmp_path], tmp_path / "log", expect=2, timeout=120, WORLD_SIZE="2")
    assert p.out.count("error: ") == 1 and "--ulysses-size 2: not built for qwen3_5" in p.out, p.out[-2000:]
