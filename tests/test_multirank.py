"""The batch arithmetic and sharding at scale, as far as a CPU allows: the design card's
`torchrun --nproc_per_node 8 grpo.py` (eight gloo ranks, the HF engine) takes the same first step as one process,
and `run.sh multinode` (two torchrun agents meeting at a c10d rendezvous on 127.0.0.1) learns exactly what one
node with the same world size learns."""
import json
import os
import sys
import time

import pytest

import tiny_model
from common import free_port

# a reward that varies within every group from the first step (the demo's colour reward starts at ~0)
REWARD = """
def varied(items):
    return [{"overall": (sum(map(ord, it["response"])) % 7) / 6, "accuracy": 0.0} for it in items]
"""


def metrics(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture
def task(tmp_path):
    """Reward file and 32 rows of the demo's colour task (the demo's 2000 rows would be encoded by each of the eight
    ranks, most of this test's time)."""
    (tmp_path / "r.py").write_text(REWARD)
    tiny_model.make_color_dataset(str(tmp_path / "train.parquet"), 32, seed=0)
    return ["--train-files", tmp_path / "train.parquet", "--reward-function", f"{tmp_path / 'r.py'}:varied"]


def test_eight_ranks_take_the_same_first_step_as_one_process(tmp_path, task, launch):
    # 8 prompts x n 4: one prompt per rank. One mini-batch, two epochs over it: the second epoch's loss is off-policy
    # (recomputed old log-probs, ratios != 1, KL > 0), so pg_loss, loss and the second grad norm are not ~0 by
    # construction, and all of it rests on the first update being the same on 1 and 8 ranks.
    args = ["--format-prompt", tiny_model.DEMO_FORMAT_PROMPT, "--val-freq", "0", "--rollout-batch-size", "8",
            "--rollout-n", "4", "--global-batch-size", "8", "--ppo-epochs", "2", "--max-response-length", "4",
            "--max-steps", "2", "--save-freq", "-1", "--log-samples", "1"] + task
    t = time.time()
    launch.run([sys.executable, "grpo.py", "--output-dir", tmp_path / "one"] + args, tmp_path / "one.log")
    t_one = time.time() - t
    t = time.time()
    launch.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "8", "--master-port", free_port(),
                "grpo.py", "--output-dir", tmp_path / "eight"] + args, tmp_path / "eight.log", timeout=540)
    print(f"1 process {t_one:.0f} s, 8 ranks {time.time() - t:.0f} s")
    assert "[batch] 8 rank(s)" in (tmp_path / "eight.log").read_text()
    one, eight = metrics(tmp_path / "one"), metrics(tmp_path / "eight")
    assert [m["step"] for m in eight] == [1, 2]
    a, b = one[0], eight[0]
    assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-9)  # the same samples (seeded per prompt)
    assert 0 < a["reward/mean"] < 1
    assert a["response_length/mean"] == pytest.approx(b["response_length/mean"], abs=1e-9)
    for k in ("actor/pg_loss", "actor/loss", "actor/kl", "actor/clipfrac"):
        assert abs(a[k]) > 1e-3, k  # the second epoch moved off-policy: not ~0 by construction
        assert a[k] == pytest.approx(b[k], rel=1e-5), k
    assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4)
    assert a["actor/entropy"] == pytest.approx(b["actor/entropy"], rel=1e-5)
    # the second step (the weights after an update streamed into eight engines) comes out the same too
    for k in ("reward/mean", "actor/pg_loss", "actor/kl"):
        assert one[1][k] == pytest.approx(eight[1][k], rel=1e-5), k
    assert one[1]["actor/grad_norm"] == pytest.approx(eight[1]["actor/grad_norm"], rel=1e-4)


def test_run_sh_multinode_learns_what_one_node_learns(tmp_path, task, launch):
    # run.sh's own multinode line, as a user runs it on each node, made a CPU demo by options appended after the
    # recipe name; two nodes of one process each vs one node of two processes: the same world, the same run
    demo = ["--model-path", "", "--val-files", "", "--tensor-parallel-size", "1", "--max-response-length", "4",
            "--rollout-batch-size", "4", "--global-batch-size", "4", "--rollout-n", "4", "--lr", "1e-3",
            "--max-steps", "3", "--save-freq", "-1", "--log-samples", "1"] + task
    port = free_port()
    env = dict(NNODES=2, NPROC_PER_NODE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_ADDR="127.0.0.1",
               RDZV_ID=f"test{port}")
    t = time.time()
    nodes = [launch.start(["bash", "run.sh", "multinode"] + demo + ["--output-dir", tmp_path / "two_nodes"],
                          tmp_path / f"node{i}.log", **env) for i in range(2)]
    launch.wait(nodes, timeout=300)
    t_two = time.time() - t
    t = time.time()
    launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "grpo.py"]
               + demo + ["--output-dir", tmp_path / "one_node"], tmp_path / "one_node.log", timeout=300)
    print(f"2 nodes x 1 process {t_two:.0f} s, 1 node x 2 processes {time.time() - t:.0f} s")
    # one world of two ranks: rank 0 (which prints the batch line) lives on one of the two nodes
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    assert sum("[batch] 2 rank(s)" in x for x in logs) == 1
    # the appended options replaced every value of the recipe's that the one-node run does not have
    cfg_two, cfg_one = (json.load(open(tmp_path / d / "config.json")) for d in ("two_nodes", "one_node"))
    diff = {k for k in cfg_one if cfg_one[k] != cfg_two.get(k)} - {"output_dir"}
    assert not diff, {k: (cfg_two.get(k), cfg_one[k]) for k in diff}
    two, one = metrics(tmp_path / "two_nodes"), metrics(tmp_path / "one_node")
    assert [m["step"] for m in two] == [m["step"] for m in one] == [1, 2, 3]
    assert two[-1]["actor/kl"] > 0 and two[-1]["actor/grad_norm"] > 0  # the policy moved
    for a, b in zip(two, one):
        for k in b:
            # (MFU is per second; the engine/trainer log-prob gap is fp32 rounding noise, ~1e-7)
            if not k.startswith(("timing/", "time/", "throughput/", "memory/", "perf/mfu", "rollout/logprob_diff")):
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (a["step"], k)


def test_moe_two_ranks_take_the_same_steps_as_one_process(tmp_path, task, launch):
    """The tiny Qwen3-VL-MoE on 2 gloo ranks (each decoder layer's 4 experts sharded 2 and 2, all-gathered with their
    layer) takes the same two steps as one process: the same losses, KL and gradient norm (the second epoch
    off-policy, the second step after the updated weights went into the engines)."""
    args = ["--demo-model", "qwen3_vl_moe", "--format-prompt", tiny_model.DEMO_FORMAT_PROMPT, "--val-freq", "0",
            "--rollout-batch-size", "4", "--rollout-n", "4", "--global-batch-size", "4", "--ppo-epochs", "2",
            "--max-response-length", "4", "--max-steps", "2", "--save-freq", "-1"] + task
    launch.run([sys.executable, "grpo.py", "--output-dir", tmp_path / "one"] + args, tmp_path / "one.log")
    launch.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", free_port(),
                "grpo.py", "--output-dir", tmp_path / "two"] + args, tmp_path / "two.log", timeout=540)
    assert "[batch] 2 rank(s)" in (tmp_path / "two.log").read_text()
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["step"] for m in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-9)
        for k in ("actor/pg_loss", "actor/loss", "actor/kl"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), k
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4)
    assert abs(one[0]["actor/pg_loss"]) > 1e-3 and 0 < one[0]["reward/mean"] < 1


# the pid-derived port of before: a socket listening there (CI met one) stopped the run with EADDRINUSE
TAKEN = """
import os, socket
import fsdp_actor
s = socket.socket()
s.bind(("127.0.0.1", 29500 + os.getpid() % 2000))
s.listen()
print(fsdp_actor.init_distributed())
"""


def test_one_process_sets_up_its_group_on_a_free_port(tmp_path, launch):
    """`python grpo.py` (no torchrun) builds a 1-rank group on a port nothing listens on."""
    p = launch.run([sys.executable, "-c", TAKEN], tmp_path / "log", timeout=120)
    assert "(0, 1, device(type='cpu'))" in p.out, p.out[-2000:]
