"""Memory modes: the pure-bf16 AdamW step (stochastic rounding and Kahan compensation against round-to-nearest,
which loses RL-sized updates), bf16 checkpoints and exact resume, the offload wiring, the memory keys."""

import os

import pytest
import torch

import fsdp_actor as actor
import memory
from test_train import DENSE_REWARD, run
from benchmarks import bench

LR = 1e-6  # EasyR1's RL learning rate: the size where bf16 round-to-nearest drops every update


def weights(n=200_000, seed=0):
    """Weights the size of a trained model's (std 0.02), in bf16, and a gradient for them."""
    g = torch.Generator().manual_seed(seed)
    w = (0.02 * torch.randn(n, generator=g)).bfloat16()  # [n]
    grad = torch.randn(n, generator=g)  # [n] fp32
    return w, grad


def fp32_adamw(w, grads, lr):
    """torch.optim.AdamW on an fp32 copy: the reference path. grads: one [n] tensor per step."""
    p = torch.nn.Parameter(w.float().clone())
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=1e-2)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def bf16_adamw(w, grads, lr, rounding):
    """memory.BF16AdamW on a bf16 copy. Returns the weights as fp32, with Kahan's compensation added (what the
    weight holds in total) and the weights alone."""
    p = torch.nn.Parameter(w.clone())
    opt = memory.BF16AdamW([p], lr=lr, weight_decay=1e-2, rounding=rounding, seed=3)
    for g in grads:
        p.grad = g.bfloat16()
        opt.step()
    comp = opt.state[p].get("comp")
    total = p.detach().float() + (comp.float() if comp is not None else 0)
    return total, p.detach().float()


def test_one_step_at_rl_lr_is_lost_to_nearest_and_kept_by_stochastic_and_kahan():
    """The trap, one AdamW step at lr 1e-6. `carried`: the share of the fp32 step's movement that reaches the
    weights (sum of the movement along the fp32 step / sum of the fp32 step's |movement|)."""
    w, g = weights()
    ref = fp32_adamw(w, [g], LR) - w.float()  # [n] the fp32 update, ~1e-6 per weight
    assert (ref != 0).float().mean() > 0.99  # fp32 moves (nearly) every weight

    def carried(new):
        return float(((new - w.float()) * ref.sign()).sum() / ref.abs().sum())

    near_total, near = bf16_adamw(w, [g], LR, "nearest")
    # the trap: only the ~2% of weights smaller than ~5e-4 (whose half-ulp is below 1e-6) move
    assert (near != w.float()).float().mean() < 0.05
    assert abs(carried(near)) < 0.05
    sr_total, sr = bf16_adamw(w, [g], LR, "stochastic")
    moved = float((sr != w.float()).float().mean())
    assert 0.02 < moved < 0.2  # a few weights move a whole ulp ...
    assert carried(sr) == pytest.approx(1.0, abs=0.1)  # ... and on average exactly the fp32 step
    kahan_total, kahan = bf16_adamw(w, [g], LR, "kahan")
    assert (kahan != w.float()).float().mean() < 0.05  # the weights move as little as nearest's,
    assert carried(kahan_total) == pytest.approx(1.0, abs=0.01)  # the compensation holds the step


def test_stochastic_rounding_is_unbiased():
    """E[round(x)] = x: many draws of one value between two bf16 neighbours average to it; nearest does not."""
    x = torch.full((1_000_000,), 0.02)  # between the bf16 values 0.0198975 and 0.0200195, 87% of an ulp up
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    memory.stochastic_round_(out, x.clone(), torch.Generator().manual_seed(0))
    ulp = 2.0 ** -13  # bf16's spacing in [2^-6, 2^-5)
    lo = float(x[:1].view(torch.int32).bitwise_and(-65536).view(torch.float32))  # the neighbour towards 0
    assert set(out.float().unique().tolist()) == {lo, lo + ulp}  # only the two neighbours
    # the draws are lo + Bernoulli(p = 0.87) x ulp: the mean's standard error is ulp * sqrt(p (1-p) / n) ~ 4e-8
    assert float(out.float().mean()) == pytest.approx(0.02, abs=2e-7)
    assert abs(float(x[0].bfloat16()) - 0.02) > 1e-5  # round to nearest: off by 0.13 ulp, every time
    neg = torch.empty_like(out)
    memory.stochastic_round_(neg, -x, torch.Generator().manual_seed(1))  # the sign bit: symmetric
    assert float(neg.float().mean()) == pytest.approx(-0.02, abs=2e-7)


def test_many_steps_track_the_fp32_path():
    """300 AdamW steps at lr 1e-5 with gradients of a steady direction plus noise: stochastic rounding and Kahan
    end near the fp32 weights (distance small next to how far fp32 moved); nearest has hardly moved."""
    w, d = weights(50_000)
    gen = torch.Generator().manual_seed(1)
    grads = [d + 0.5 * torch.randn(d.shape, generator=gen) for _ in range(300)]
    ref = fp32_adamw(w, grads, 1e-5)
    path = float((ref - w.float()).norm())

    def dist(x):
        return float((x - ref).norm()) / path

    assert dist(bf16_adamw(w, grads, 1e-5, "nearest")[1]) > 0.8
    assert dist(bf16_adamw(w, grads, 1e-5, "stochastic")[1]) < 0.35
    assert dist(bf16_adamw(w, grads, 1e-5, "kahan")[0]) < 0.05  # weights + compensation
    assert dist(bf16_adamw(w, grads, 1e-5, "kahan")[1]) < 0.35  # the weights alone: within an ulp of it


def test_noise_is_a_function_of_step_and_parameter():
    """Resume is exact without saving RNG state: the same (seed, step, parameter) gives the same draws."""
    a = memory._generator(1, 5, 2, torch.device("cpu"))
    b = memory._generator(1, 5, 2, torch.device("cpu"))
    c = memory._generator(1, 6, 2, torch.device("cpu"))
    x, y, z = (torch.randint(0, 1 << 16, (8,), generator=g) for g in (a, b, c))
    assert torch.equal(x, y) and not torch.equal(x, z)


def test_bf16_run_trains_checkpoints_and_resumes(tmp_path, launch):
    """--precision bf16 end to end on CPU: bf16 weights and optimizer state in the checkpoint, and a run resumed
    from step 2 takes nearly the same third step as one run of 3 steps."""
    import torch.distributed.checkpoint as dcp
    (tmp_path / "r.py").write_text(DENSE_REWARD)
    kw = ["--precision", "bf16", "--global-batch-size", "2", "--save-freq", "1", "--lr", "1e-4",
          "--reward-function", f"{tmp_path / 'r.py'}:dense", "--lr-scheduler-type", "constant"]  # made longer below
    straight = run(launch, ["--max-steps", "3"] + kw, tmp_path / "a")
    run(launch, ["--max-steps", "2"] + kw, tmp_path / "b")
    resumed = run(launch, ["--max-steps", "3"] + kw, tmp_path / "b")
    assert straight[-1]["actor/grad_norm"] > 0 and straight[-1]["actor/kl"] > 0  # the policy moved
    # the same samples and nearly the same losses: not bit-exact, because PyTorch's bf16 backward on CPU is not
    # deterministic run to run (two fresh runs differ alike from their second step, same weights, same inputs);
    # the optimizer itself resumes exactly (test_bf16_optimizer_resumes_exactly)
    assert resumed[-1]["reward/mean"] == straight[-1]["reward/mean"]
    assert resumed[-1]["actor/kl"] == pytest.approx(straight[-1]["actor/kl"], rel=0.05)
    meta = dcp.FileSystemReader(str(tmp_path / "a" / "checkpoints" / "step_3")).read_metadata()
    dtypes = {k: v.properties.dtype for k, v in meta.state_dict_metadata.items() if hasattr(v, "properties")}
    assert dtypes and all(d == torch.bfloat16 for k, d in dtypes.items() if k.startswith("model.")), dtypes
    assert any(k.endswith("exp_avg_sq") for k in dtypes) and all(
        d == torch.bfloat16 for k, d in dtypes.items() if k.endswith(("exp_avg", "exp_avg_sq"))), dtypes


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_bf16_optimizer_resumes_exactly(tmp_path, rounding):
    """Six steps straight, or three, a save through torch.distributed.checkpoint (as the trainer saves), a fresh
    model and optimizer loaded from it, three more: the same bf16 weights, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    actor.init_distributed()
    w, d = weights(4096)
    grads = [d + torch.randn(d.shape, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def fresh():
        m = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            m.weight.copy_(w.view(64, 64))
        fully_shard(m)
        return m, memory.BF16AdamW(m.parameters(), lr=1e-5, rounding=rounding, seed=7)

    def steps(m, opt, gs):
        for g in gs:
            m.weight.grad = torch.distributed.tensor.distribute_tensor(g.view(64, 64).bfloat16(),
                                                                       m.weight.device_mesh, m.weight.placements)
            opt.step()

    m, opt = fresh()
    steps(m, opt, grads)
    want = m.weight.full_tensor().clone()
    m, opt = fresh()
    steps(m, opt, grads[:3])
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"))
    m, opt = fresh()
    msd, osd = get_state_dict(m, opt)  # (this initialises the state with a zero-lr step, as the trainer's load)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"))
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps(m, opt, grads[3:])
    got = m.weight.full_tensor()
    assert not torch.equal(got, w.view(64, 64))
    assert torch.equal(got, want)


def test_bf16_refuses_fp32_compute():
    import easyr1_config
    import grpo
    from data import UserError
    with pytest.raises(UserError, match="--precision bf16 computes in bf16"):
        easyr1_config.check(grpo.Config(precision="bf16", dtype="fp32"), 1)


def test_offload_wiring(tmp_path):
    """--offload-params hands FSDP2 its CPUOffloadPolicy on every unit; --offload-optimizer moves AdamW's state out
    and back around the step (on CPU both are the host: here the wiring and the numbers are checked, not the
    bytes saved, which benchmarks/gpu_memory.sh measures)."""
    import tiny_model
    from torch.distributed.fsdp import CPUOffloadPolicy
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "m"))
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False,
                              offload=True)
    states = [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    assert len(states) > 2
    groups = [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]
    assert groups and all(fp.offload_to_cpu for g in groups for fp in g.fsdp_params)
    assert all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)
    # the optimizer state round trip keeps values and object identity of the keys
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.distributed.tensor.distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements)
    opt, sched = actor.build_optimizer(model, 1e-3, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    actor.optimizer_step(model, opt, sched, 1.0, offload_state=True)
    assert all(not torch.equal(before[n], p.full_tensor()) for n, p in model.named_parameters())
    assert len(opt.state) == len(before)
    # where the state goes: every tensor but the (host-kept) step counter; "meta" stands in for a second device
    memory.move_optimizer_state(opt, torch.device("meta"))
    devs = {k: v.device.type for st in opt.state.values() for k, v in st.items()}
    assert devs == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}


def test_memory_metrics_without_cuda():
    """On CPU the per-phase peaks are None and only the host's RSS is logged; the GPU keys come from a GPU run."""
    assert memory.phase_peak_gb() is None
    out = memory.metrics(None, {"start": None, "gen": None}, {})
    assert list(out) == ["memory/host_peak_rss_gb"] and out["memory/host_peak_rss_gb"] > 0


def test_offload_runs_train_the_same(tmp_path, launch):
    """On the CPU the host is the device: --offload-params (FSDP2's CPUOffloadPolicy on every unit) and
    --offload-optimizer (the state's round trip around each step) must train as without (to float rounding: the
    offloaded path sums in another order: 1.5e-8 apart seen on a pg_loss of 1e-3)."""
    (tmp_path / "r.py").write_text(DENSE_REWARD)
    kw = ["--max-steps", "2", "--global-batch-size", "2", "--reward-function", f"{tmp_path / 'r.py'}:dense"]
    base = run(launch, kw, tmp_path / "base")
    assert base[-1]["actor/kl"] > 0
    for flag in ("--offload-params", "--offload-optimizer"):
        got = run(launch, kw + [flag], tmp_path / flag.strip("-"))
        for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl"):
            assert [r[k] for r in got] == pytest.approx([r[k] for r in base], rel=1e-4, abs=1e-6), (flag, k)


def test_offload_stops_at_setup_when_the_host_cannot_hold_the_state(tmp_path, monkeypatch):
    """--offload-params / --offload-optimizer: what the host still has to take after setup (AdamW's fp32 moments,
    8 bytes per trainable parameter; with --offload-params the fp32 gradients, 4 more; a level-1 sleeping vLLM's bf16
    copy of its weights, 2 per parameter over TP), and one error line naming the node when MemAvailable is short."""
    import types

    import grpo
    import tiny_model
    from data import UserError
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "m"))
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False,
                              offload=True)
    n = sum(p.numel() for p in model.parameters())
    hf_engine, vllm = object(), types.SimpleNamespace(sleep_level=1)
    cfg = grpo.Config(offload_params=True)
    assert memory.host_bytes_to_come(cfg, model, hf_engine) == 12 * n
    assert memory.host_bytes_to_come(cfg, model, vllm) == 14 * n
    assert memory.host_bytes_to_come(grpo.Config(offload_params=True, tensor_parallel_size=2), model, vllm) == 13 * n
    assert memory.host_bytes_to_come(grpo.Config(offload_optimizer=True), model, hf_engine) == 8 * n
    lora = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False,
                             offload=True, lora=dict(r=4, alpha=8, target_modules="all-linear",
                                                     exclude_modules=r".*visual.*", modules_to_save="lm_head"))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert 0 < adapters < n / 2  # (the adapters and lm_head's trainable copy; the engine's copy: the base, once)
    assert memory.host_bytes_to_come(cfg, lora, vllm) == 12 * adapters + 2 * n
    assert memory.available_host_bytes() > 0  # the real /proc/meminfo
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 14 * n - 1)
    with pytest.raises(UserError, match=r"--offload-params: the node of rank 0 needs .* GiB more host memory"
                                        r".* has .* GiB available: use more nodes"):
        memory.check_host_memory(cfg, model, vllm)
    memory.check_host_memory(cfg, model, hf_engine)  # 12 n fits
    memory.check_host_memory(grpo.Config(), model, vllm)  # no offload: nothing to check
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this node: twice the state
    with pytest.raises(UserError, match="--offload-params"):
        memory.check_host_memory(cfg, model, hf_engine)


def _host_check_on_two_ranks(rank, out):
    import torch.distributed as dist

    import grpo
    from data import UserError
    # a file store: no TCP store served by rank 0, whose exit could abort rank 1's client thread at teardown (CI saw
    # rank 1 die of SIGABRT, "terminate called without an active exception", after the test's work was done)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=2)
    model = torch.nn.Linear(100, 10)  # 1010 parameters: 8080 bytes of AdamW state to come
    memory.available_host_bytes = lambda: 10**9 if rank == 0 else 5000  # only rank 1's node is short
    try:
        memory.check_host_memory(grpo.Config(offload_optimizer=True), model, object())
        msg = "no error"
    except UserError as e:
        msg = str(e)
    open(os.path.join(out, f"{rank}.txt"), "w").write(msg)
    dist.barrier()
    # and no teardown (as test_algo's two ranks): with the file store CI saw the abort once more (2026-12-05); both
    # ranks have written their messages and passed the barrier
    os._exit(0)


def test_host_memory_check_stops_every_rank_when_one_node_is_short(tmp_path):
    """Every rank raises the same error (rank 0 prints it for all), and it names the short node's rank and numbers."""
    import torch.multiprocessing as mp
    mp.spawn(_host_check_on_two_ranks, args=(str(tmp_path),), nprocs=2)
    msgs = [(tmp_path / f"{r}.txt").read_text() for r in range(2)]
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("--offload-optimizer: the node of rank 1 needs 0.0 GiB") and "has 0.0 GiB" in msgs[0]


def test_the_memory_model_knows_a_model_from_its_config_json_or_its_hub_name(tmp_path, monkeypatch):
    """grpo.py's check before loading reads the model's dimensions from its config.json (memory.dims_from_config):
    they equal the preset's (bench.model_dims) for the tiny MoE's folder, for the 30B-A3B's config as the hub lays
    it out (num_experts), and for a config in the HF cache (no download); a preset's hub name needs no config; any
    other model is not checked (None)."""
    import huggingface_hub

    import presets
    import tiny_model
    import tiny_moe
    moe = tiny_model.build_tiny_model(arch="qwen3_vl_moe")
    assert memory.known_dims(moe) == bench.model_dims("tiny_qwen3_vl_moe")
    assert memory.known_dims(moe)["moe"] and not memory.known_dims(tiny_model.build_tiny_model())["moe"]
    ids = tiny_model._token_ids(tiny_model.build_tokenizer())
    big = tmp_path / "30b"
    presets.preset_config("qwen3_vl_30b_a3b", ids).save_pretrained(big)
    tiny_moe.hub_layout(str(big))
    assert '"num_experts": 128' in (big / "config.json").read_text()
    want = bench.model_dims("qwen3_vl_30b_a3b")
    assert memory.known_dims(str(big)) == want and want["moe"] and want["params"] > 31e9
    assert want["root_params"] == 2 * 151936 * 2048 and want["inter"] == 8 * 768  # untied lm_head; k experts wide
    # a hub name in the HF cache: models--org--name/snapshots/<commit>/config.json, refs/main naming the commit
    repo = tmp_path / "hub" / "models--someone--qwen3-vl-30b-copy"
    presets.preset_config("qwen3_vl_30b_a3b", ids).save_pretrained(repo / "snapshots" / "abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert memory.known_dims("someone/qwen3-vl-30b-copy") == want
    assert memory.known_dims("Qwen/Qwen3-VL-30B-A3B-Instruct") == want  # not cached: its preset
    assert memory.known_dims("Qwen/Qwen2.5-VL-7B-Instruct") == bench.model_dims("qwen2_5_vl_7b")
    text = memory.known_dims(tiny_model.build_tiny_model(arch="qwen3"))  # a text LLM: its causal LM's parameters
    assert text["params"] > 0 and not text["moe"]
    for unknown in ("someone/not-cached", "Qwen/Qwen3-VL-4B-Instruct", str(tmp_path), "", "./no/such/model"):
        assert memory.known_dims(unknown) is None, unknown


def test_the_memory_model_knows_gemma4_e2b_by_its_hub_name(tmp_path):
    """google/gemma-4-E2B-it, not downloaded: grpo.py's check before loading takes its preset's dimensions, with what
    a Qwen model lacks counted as FSDP2 holds it (each decoder layer and vision/audio block a unit, the root the
    rest): the per-layer-input table (2.35B) in the root unit, gathered whole with the embedding; the largest unit,
    a key/value-sharing layer with its double-wide MLP; the audio tower (0.31B with its projection) held but never
    run, so no gradient or optimizer state; each layer's per-layer input among the checkpointed activations; one more
    fp32 chunk of the soft-capped logits. The check passes on an H200 and names the 2 GPUs AMP takes on 80 GiB cards;
    grpo.py on the CPU gets through it (no traceback) to the one-line message that the download is missing."""
    import subprocess
    import sys
    from transformers import Gemma4ForConditionalGeneration
    import presets
    from common import UserError
    from config import Config
    from conftest import clean_env
    dims = memory.known_dims("google/gemma-4-E2B-it")
    assert dims == bench.model_dims("gemma4_e2b")
    with torch.device("meta"):
        m = Gemma4ForConditionalGeneration(presets.known_config("google/gemma-4-E2B-it"))
    units = [u for u in m.modules() if type(u).__name__ in m._no_split_modules]
    count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    assert dims["params"] == count(m) and dims["idle"] == count(m.model.audio_tower) + count(m.model.embed_audio)
    assert dims["root_params"] == pytest.approx(count(m) - sum(map(count, units)), rel=0.01)  # 2.75B
    assert dims["layer_params"] == pytest.approx(max(map(count, units)), rel=0.1)  # 70M: layer 19
    assert (dims["inter"], dims["ple"], dims["softcap"]) == (12288, 256, True)
    bf16 = memory.memory_model(dims, precision="bf16", kahan=False, kl_coef=0, mb_tokens=0, chunk=0)["parts"]
    assert bf16["weights"] * memory.GIB == 2 * dims["params"] and bf16["grads"] * memory.GIB == 2 * (
        dims["params"] - dims["idle"])
    base = dict(dims, ple=0, softcap=False)
    for kw, grows in ((dict(mb_tokens=4096, chunk=1), 4096 * 2 * 35 * 2 * 256),  # per-layer inputs, bf16
                      (dict(mb_tokens=0, chunk=4096), 4 * 4096 * 262144)):  # one more fp32 chunk of logits
        assert memory.memory_model(dims, **kw)["update"] - memory.memory_model(base, **kw)["update"] == \
            pytest.approx(grows / memory.GIB)
    memory.check_before_loading(Config(model_path="google/gemma-4-E2B-it"), 1, card_gib=140.4)
    with pytest.raises(UserError, match="--model-path google/gemma-4-E2B-it .* it takes 2 such GPUs"):
        memory.check_before_loading(Config(model_path="google/gemma-4-E2B-it"), 1, card_gib=80)  # AMP: 105 GiB
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "grpo.py", "--model-path", "google/gemma-4-E2B-it", "--output-dir",
                        str(tmp_path / "out")], cwd=root, capture_output=True, text=True, timeout=300,
                       env=clean_env(HF_HUB_OFFLINE="1"))
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out and out.splitlines()[-1].startswith(
        "error: --model-path google/gemma-4-E2B-it: could not load its tokenizer/processor"), out


def test_long_answers_ulysses_and_the_engines_sequences_by_the_memory_model():
    """Qwen3-4B (known by its hub name) with 16 x 4 answers of 256k tokens: one sample a micro-batch, so more GPUs do
    not help alone; the check before loading names the --ulysses-size that holds it, which divides each rank's
    share of the row by K; and vLLM takes as many sequences as its KV cache holds whole."""
    import dataclasses
    import grpo
    from common import UserError
    dims = memory.known_dims("Qwen/Qwen3-4B")
    c = dataclasses.asdict(grpo.Config(model_path="Qwen/Qwen3-4B", max_response_length=262144, rollout_batch_size=16,
                                       n=4, global_batch_size=16, max_token_len_per_device=16384))
    tokens = memory.PROMPT_TOKENS + 262144
    for K in (1, 2, 4):  # one sample a row, 1/K of it on each rank
        assert memory.config_mode({**c, "ulysses_size": K}, 8)["mb_tokens"] == tokens / K
    with pytest.raises(UserError, match=r"on 8 GPUs .* these GPUs hold it with --ulysses-size 2;"):
        memory.check_fits(c, dims, 8, 79.2, "--model-path Qwen/Qwen3-4B")
    with pytest.raises(UserError, match=r"on 1 GPU .* it takes 2 such GPUs \(torchrun --nproc_per_node 2\) with "
                                        r"--ulysses-size 2;"):
        memory.check_fits(c, dims, 1, 79.2, "--model-path Qwen/Qwen3-4B")
    memory.check_fits({**c, "ulysses_size": 2}, dims, 8, 79.2, "--model-path Qwen/Qwen3-4B")
    # the engine: bf16 keys and values, 36 layers x 8 heads x 128 x 2 bytes x 2 a token, whole sequences only
    per_seq = 2 * 2 * 36 * 8 * 128 * (1024 + 32768)
    c = {**c, "max_response_length": 32768, "max_prompt_length": 1024, "gpu_memory_utilization": 0.6}
    pool = 79.2 * 0.6 - 2 * dims["params"] / 2**30 - 2
    assert memory.engine_max_seqs(c, dims, 79.2) == int(pool * 2**30 // per_seq) < 64  # (64: the step's samples)
    assert memory.engine_max_seqs({**c, "kv_cache_memory_gb": 40.0}, dims, 79.2) == int(40 * 2**30 // per_seq)
    assert memory.engine_max_seqs({**c, "max_response_length": 4096}, dims, 79.2) is None  # short: vLLM's own
    assert memory.engine_max_seqs(c, dims, None) is None  # the CPU
