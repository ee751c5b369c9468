"""Qwen3.5 on the GPU (skipped elsewhere): fla-core's kernels on packed rows against each sample alone, and vLLM with
the tiny Qwen3.5 / Qwen3.5-MoE: a change in one Gated DeltaNet layer reaches the engine after a sync, and after a
level-2 sleep that discarded every weight.

    pytest -m gpu tests/test_qwen3_5_gpu.py -s
    PYTHONPATH=. python tests/test_qwen3_5_gpu.py qwen3_5     # the engine check by hand: qwen3_5 | qwen3_5_moe
"""
import sys

import pytest
import torch

import fsdp_actor as actor
import rollout
import tiny_model
import varlen as V
from test_grpo_gpu import engine_memory, run
from test_qwen3_gpu import PX, engine_checked, mean_logprob_diff, vl_prompts
from test_vllm_gpu import greedy

pytestmark = pytest.mark.gpu
GDN = "model.language_model.layers.1.linear_attn."  # one of the three linear-attention layers


def test_fla_kernels_on_a_packed_row_equal_each_sample_alone():
    """One GDN layer (the tiny model's, widened to real head sizes) on three samples packed in one bf16 row through
    fla-core's kernels, against each sample alone through the plain-torch path in fp32: outputs and gradients."""
    if not torch.cuda.is_available() or V.fla_kernels() is None:
        pytest.skip("needs CUDA and fla-core")
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    cfg = AutoConfig.from_pretrained(tiny_model.build_tiny_model(arch="qwen3_5")).text_config
    cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim = 512, 128, 128
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, 0).cuda()
    lens = [37, 200, 91]  # chunk boundaries (64) fall inside samples and between them
    x = torch.randn(1, sum(lens), cfg.hidden_size, device="cuda")
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    w = torch.randn_like(x)

    def run_layer(dtype, xs, ws, **kw):
        lay = Qwen3_5GatedDeltaNet(cfg, 0).cuda().to(dtype)
        lay.load_state_dict(layer.state_dict())
        V.use_gdn_forward(lay, torch.device("cuda"))
        with torch.no_grad():  # (no-grad: fla-core's forward, also where its backward is refused: V.fla_trains)
            plain = lay(xs.to(dtype), **kw)
        out = lay(xs.to(dtype), **kw)
        (out.float() * ws).sum().backward()
        return plain.float(), {n: p.grad.float() for n, p in lay.named_parameters()}

    print(f"[gdn] fla-core trains here: {V.fla_trains(torch.cuda.current_device())}")
    fast, g_fast = run_layer(torch.bfloat16, x, w, cu_seq_lens_q=cu)
    fla = V.fla_kernels
    V.fla_kernels = lambda: None  # the plain-torch path, sample by sample
    try:
        alone, g_ref = [], {}
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            out, g = run_layer(torch.float32, x[:, a:b], w[:, a:b])
            alone.append(out)
            g_ref = {n: g_ref.get(n, 0) + g[n] for n in g}
    finally:
        V.fla_kernels = fla
    ref = torch.cat(alone, 1)
    err = ((fast - ref).norm() / ref.norm()).item()
    print(f"[gdn] fla packed bf16 vs alone fp32: output rel err {err:.2e}")
    assert err < 2e-2
    for n in g_ref:
        e = ((g_fast[n] - g_ref[n]).norm() / g_ref[n].norm()).item()
        assert e < 5e-2, (n, e)


def test_packed_logprobs_equal_padded_on_the_gpu():
    """The tiny Qwen3.5 in bf16 on the GPU: packed rows (fla) give the padded rows' log-probs (bf16 tolerance)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_varlen import _samples
    actor.init_distributed()
    path = tiny_model.build_tiny_model(arch="qwen3_5")
    samples, pad = _samples(path)
    out = {}
    for packed in (False, True):
        model = actor.build_actor(path, torch.device("cuda"), torch.float32, torch.bfloat16,
                                  padding_free="on" if packed else "off", vision_varlen="off")
        assert model.packed == packed
        with torch.no_grad():
            out[packed], _ = actor.compute_logprobs(model, samples, pad, torch.device("cuda"), 1.0, max_tokens=10_000,
                                                    max_samples=64)
    d = max((a - b).abs().max().item() for a, b in zip(out[True], out[False]))
    print(f"[gdn] packed vs padded bf16 max |logp diff| {d:.2e}")
    assert d < 5e-2


def check(arch):
    rollout._set_vllm_env()
    path = tiny_model.build_tiny_model(arch=arch)
    recs = vl_prompts(path)
    eng, ref, sd, base = engine_checked(path, arch, recs, limit_mm_per_prompt={"image": 2, "video": 0},
                                        mm_processor_kwargs=PX)
    g = torch.Generator().manual_seed(123)  # every tensor of the layer, 1-D ones included (A_log, dt_bias, norm)
    new = {k: (v.float() + torch.randn(v.shape, generator=g).to(v.device)).to(v.dtype) for k, v in sd.items()
           if k.startswith(GDN)}
    assert {k.rsplit(".", 2)[-2] if k.endswith(".weight") else k.rsplit(".", 1)[-1] for k in new} >= {
        "A_log", "dt_bias", "conv1d", "norm", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
    for level in (1, 2):
        eng.sleep_level = level
        eng.sleep()
        eng.sync_weights({**sd, **new}.items() if level == 2 else new.items())  # level 2 lost them all
        changed = greedy(eng, recs)
        ref.load_state_dict({k: v.float() for k, v in new.items()}, strict=False)
        d = mean_logprob_diff(eng, ref, recs)
        print(f"[{arch}] one GDN layer changed, after sleep level {level}: greedy changed for "
              f"{sum(a != b for a, b in zip(changed, base))}/{len(base)}; vLLM vs HF mean |logp diff| {d:.4f}")
        assert d < 0.1 and changed != base
        eng.sync_weights(sd.items())
        ref.load_state_dict({k: v.float() for k, v in sd.items()})
        assert greedy(eng, recs) == base  # restored exactly
    print(f"QWEN3_5_GPU_OK {arch} vllm={eng.version}", flush=True)


def check_merged(out_dir):
    """merge.py's dense folder of a Qwen3.5 LoRA checkpoint (adapters on the GDN projections too) starts in vLLM as it
    is, and the engine computes what HF computes from the same folder."""
    import pathlib
    from test_lora import lora_actor, lora_checkpoint
    import merge
    rollout._set_vllm_env()
    actor.init_distributed()
    tmp = pathlib.Path(out_dir)
    model = lora_actor(tiny_model.build_tiny_model(arch="qwen3_5"), seed=3)
    folder = merge.merge(lora_checkpoint(model, tiny_model.build_tiny_model(arch="qwen3_5"), tmp), str(tmp / "dense"),
                         dtype="bfloat16")
    eng = rollout.VLLMRollout(folder, **engine_memory(0.25), max_model_len=1024, enforce_eager=True, dtype="bfloat16",
                              limit_mm_per_prompt={"image": 2, "video": 0}, mm_processor_kwargs=PX)
    ref = rollout.load_hf_model(folder, torch.bfloat16).float().cuda().eval()
    d = mean_logprob_diff(eng, ref, vl_prompts(folder))
    print(f"[merged] vLLM on merge.py's folder vs HF on it: mean |logp diff| {d:.4f}")
    assert d < 0.05
    print("QWEN3_5_GPU_OK merged", flush=True)


def test_vllm_loads_a_merged_qwen3_5_lora_folder(launch, tmp_path):
    pytest.importorskip("vllm")
    launch.script(__file__, f"merged:{tmp_path}", tmp_path / "merged.log", "QWEN3_5_GPU_OK merged")


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_vllm_engine_gets_one_gdn_layer_after_sync_and_sleep(launch, tmp_path, arch):
    pytest.importorskip("vllm")
    launch.script(__file__, arch, tmp_path / f"{arch}.log", f"QWEN3_5_GPU_OK {arch}")


@pytest.mark.parametrize("demo", ["qwen3_5", "qwen3_5_moe"])
def test_demo_engine_agrees_with_trainer_after_every_sync(tmp_path, demo, launch):
    rows = run(launch, tmp_path, "--demo-model", demo)
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    print(f"[{demo}] engine/trainer |logp diff| mean per step", diffs)
    assert len(diffs) == 4 and max(diffs) < 5e-3, diffs


if __name__ == "__main__":
    check_merged(sys.argv[1][7:]) if sys.argv[1].startswith("merged:") else check(sys.argv[1])
