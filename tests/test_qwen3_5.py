"""Qwen3.5 (hybrid: 3 of 4 layers Gated DeltaNet): the tiny models' layout, and packed rows that keep each sample's
conv and recurrent state to itself (varlen.gdn_forward), against each sample run alone."""
import pytest
import torch
import torch.nn.functional as F

import fsdp_actor as actor
import tiny_model
import varlen as V
from test_actor import reference_logprobs
from test_varlen import _grads, _samples


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def tiny(request, tmp_path_factory):
    return tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("q35") / request.param), arch=request.param)


def test_tiny_model_has_the_checkpoints_layout(tiny):
    """GDN layers in the checkpoints' pattern with every weight the engine must receive, under the hub's names."""
    hf = actor.load_hf_model(tiny)
    assert hf.config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    names = {n for n, _ in hf.named_parameters()}
    for w in ("A_log", "dt_bias", "conv1d.weight", "norm.weight", "in_proj_qkv.weight", "in_proj_z.weight",
              "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight"):
        assert f"model.language_model.layers.0.linear_attn.{w}" in names, w
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in names
    assert not any("deepstack" in n for n in names) and len(V.gdn_layers(hf)) == 3


def test_conv_reference_is_a_causal_depthwise_conv_restarted_at_each_sample():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 11, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    plain = F.conv1d(x.transpose(1, 2), w[:, None], b, padding=3, groups=6)[..., :11].transpose(1, 2)
    assert torch.allclose(V.causal_conv_reference(x, w, b), plain, atol=1e-6)
    cu = torch.tensor([0, 2, 7, 11], dtype=torch.int32)
    alone = [F.conv1d(x[:, a:e].transpose(1, 2), w[:, None], b, padding=3, groups=6)[..., :e - a].transpose(1, 2)
             for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    assert torch.allclose(V.causal_conv_reference(x, w, b, cu), torch.cat(alone, 1), atol=1e-6)


def test_packed_rows_equal_each_sample_alone(tiny):
    """One packed micro-batch (images, two images, text; responses of 1..9 tokens) against the padded rows and the
    plain HF forward of each sample alone: per-token log-probs and every gradient, fp32 on the CPU."""
    actor.init_distributed()
    samples, pad = _samples(tiny)
    lp_pad, g_pad = _grads(tiny, samples, pad, False, torch.float32)
    lp_pack, g_pack = _grads(tiny, samples, pad, True, torch.float32)
    ref = reference_logprobs(tiny, samples, pad)
    for a, b, c in zip(lp_pack, lp_pad, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        assert torch.allclose(a.double(), c, atol=1e-5), (a.double() - c).abs().max()
    assert g_pad.keys() == g_pack.keys() and any(".linear_attn.A_log" in n for n in g_pad)
    for n in g_pad:  # relative to the tensor's norm: 1e-5, but 1e-3 for the decay gate's parameters, whose gradients
        # sum exp(cumsum) terms over every token in the delta rule's fp32 (seen: 2e-5 dense, 3e-4 MoE; 7e-6 the rest)
        tol = 1e-3 if n.endswith(("A_log", "dt_bias", "in_proj_a.weight")) else 1e-5
        assert (g_pack[n] - g_pad[n]).norm() <= tol * g_pad[n].norm() + 1e-12, (n, (g_pack[n] - g_pad[n]).norm())


def test_a_packed_row_never_shares_a_prompt_across_a_recurrence(tiny):
    """A shared-prompt row would hand one response's state to the next: Qwen3.5 packs each sample whole."""
    model = actor.build_actor(tiny, torch.device("cpu"), torch.float32, torch.float32, padding_free="on",
                              share_prompts=True)
    assert model.packed and not model.share_prompts and model.rope == "mrope"


def test_the_engine_gets_the_experts_as_the_checkpoint_holds_them(tmp_path):
    """Qwen3.5-MoE: the trainer's fused expert tensors, split for vLLM's loader, are exactly the per-expert tensors
    of the checkpoint on disk (gate before up), with every other name untouched."""
    from safetensors.torch import load_file
    from tiny_moe import per_expert
    path = tiny_model.build_tiny_model(str(tmp_path / "m"), arch="qwen3_5_moe")
    disk = load_file(f"{path}/model.safetensors")
    sent = dict(per_expert(actor.load_hf_model(path).state_dict().items()))
    assert sent.keys() == disk.keys()
    for k in disk:
        assert torch.equal(sent[k], disk[k]), k


def test_flops_count_every_projection_once_and_attention_only_in_attention_layers():
    """The 9B shape's forward FLOPs: 2 per weight of every linear layer of the language model (embedding and head
    included, veRL's convention), the delta rule's 5 d_k d_v per value head in the 24 GDN layers, s^2 attention in
    the 8 others; the weights counted from the model itself (meta device), not from the formula's own terms."""
    import flops
    import presets
    cfg = presets.preset_config("qwen3_5_9b", tiny_model._token_ids(tiny_model.build_tokenizer()))
    t = cfg.text_config
    with torch.device("meta"):
        from transformers import Qwen3_5ForConditionalGeneration
        lm = Qwen3_5ForConditionalGeneration(cfg)
    linear = sum(m.weight.numel() for n, m in lm.named_modules()
                 if isinstance(m, torch.nn.Linear) and ".visual." not in f".{n}") + t.vocab_size * t.hidden_size
    s = [100, 300]
    core = 5 * 128 * 128 * 32 * 24 * sum(s)
    attn = 2 * 8 * t.num_attention_heads * t.head_dim * sum(x * x for x in s)
    assert flops.lm_forward_flops(cfg, s) == 2 * linear * sum(s) + core + attn


def test_the_plain_path_is_torchs_even_where_transformers_dispatches_to_a_kernel(tiny, monkeypatch):
    """Where fla-core imports, transformers' torch_chunk_gated_delta_rule is a wrapper that calls fla-core's kernel
    (whose backward is wrong on Hopper under Triton < 3.7.1): the plain path must reach the torch function under it."""
    import functools
    import sys
    hf = actor.load_hf_model(tiny)
    mod = sys.modules[type(V.gdn_layers(hf)[0]).__module__]
    torch_rule = mod.torch_chunk_gated_delta_rule

    @functools.wraps(torch_rule)
    def dispatched(*a, **kw):
        raise RuntimeError("a kernel, not the torch path")
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", dispatched)
    V.use_gdn_forward(hf, torch.device("cpu"))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    hf.model.language_model(input_ids=ids, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                            max_length_k=4)


def test_lora_adapts_the_gdn_projections_and_merges_to_a_folder_that_reproduces_the_actor(tmp_path):
    """--lora-rank on Qwen3.5 (all-linear): adapters on the GDN layers' five projections as on attention and MLP;
    the conv, A_log, dt_bias and the gated norm stay frozen. merge.py's dense folder gives the actor's log-probs."""
    import memory
    import merge
    from test_lora import lora_actor, lora_checkpoint
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "m"), arch="qwen3_5")
    samples, pad = _samples(path)
    model = lora_actor(path, seed=3)
    adapted = {n.rsplit(".", 1)[-1] for n in memory.lora_layers(model) if ".linear_attn." in n}
    assert adapted == {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}, adapted
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not any(k in n for n in trainable for k in ("conv1d", "A_log", "dt_bias", ".norm."))
    ckpt = lora_checkpoint(model, path, tmp_path)

    def logprobs(m):
        return actor.compute_logprobs(m, samples, pad, torch.device("cpu"), 1.0, max_tokens=10_000, max_samples=8)[0]
    want = logprobs(model)
    dense = merge.merge(ckpt, str(tmp_path / "dense"), dtype="float32")
    check = actor.build_actor(dense, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    for a, b in zip(want, logprobs(check.eval()), strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()  # merged logits equal the actor's (fp32)


def test_the_check_before_loading_knows_qwen3_5_by_its_hub_name(tmp_path, monkeypatch, capsys):
    """`--model-path Qwen/Qwen3.5-27B` with no download: its dimensions come from the preset of its hub name, and one
    80 GB GPU in AMP stops with one line that names how many such GPUs the memory model says it takes (its AMP
    row in BENCHMARKS.md "Memory cells": 90.1 GiB on each of 8, so 16)."""
    import types
    import grpo
    from test_errors import grpo_main

    def loading(*a, **k):
        raise RuntimeError("past the check")
    monkeypatch.setattr(grpo.actor, "init_distributed", loading)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setenv("WORLD_SIZE", "1")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        grpo_main(["--model-path", "Qwen/Qwen3.5-27B", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "about 489 GiB per GPU on 1 GPU" in err and "it takes 16 such GPUs" in err, err


def test_a_load_after_vllm_registered_its_own_config_class_gets_transformers_class(tiny, monkeypatch):
    """A vLLM engine registers its own Qwen3_5Config in transformers' AutoConfig, process-wide; an HF load after it
    (a test's reference, the parity check's HF engine) then built the vision tower from vLLM's config and failed on
    the H200 (no num_attention_heads). load_hf_model reads the folder with transformers' own class."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kind = PretrainedConfig.get_config_dict(tiny)[0]["model_type"]  # qwen3_5 or qwen3_5_moe: vLLM has both
    vllms = type("VllmsConfig", (PretrainedConfig,), {"model_type": kind})  # another class under the same name
    monkeypatch.setitem(CONFIG_MAPPING._extra_content, kind, vllms)
    model = actor.load_hf_model(tiny)
    assert type(model.config).__module__ == f"transformers.models.{kind}.configuration_{kind}"


def _plain_gdn_bytes_per_token(hidden, hk, hv, dk, dv, samples=2, length=128):
    """What one GDN layer on the plain-torch path keeps for its backward (saved tensors, its weights left out), bytes
    a token of a packed row, and the config it ran with."""
    import types

    import presets
    from transformers.models.qwen3_5 import modeling_qwen3_5
    base = presets.preset_config("qwen3_5_9b", tiny_model._token_ids(tiny_model.build_tokenizer()))
    cfg = type(base).from_dict({**base.to_dict(), "text_config": {
        **base.text_config.to_dict(), "hidden_size": hidden, "linear_num_key_heads": hk, "linear_num_value_heads": hv,
        "linear_key_head_dim": dk, "linear_value_head_dim": dv}})
    torch.manual_seed(0)
    layer = modeling_qwen3_5.Qwen3_5GatedDeltaNet(cfg.text_config, 0).to(torch.bfloat16)
    layer.forward = types.MethodType(V.gdn_forward, layer)
    n = samples * length
    x = torch.randn(1, n, hidden, dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        layer(x, cu_seq_lens_q=torch.arange(0, n + 1, length, dtype=torch.int32))
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    return (sum(saved.values()) - weights) / n, cfg


@pytest.mark.parametrize("dims", [(256, 4, 8, 32, 32), (256, 2, 8, 64, 128)])
def test_the_memory_model_counts_what_a_plain_path_gdn_layer_keeps_for_its_backward(dims):
    """The plain-torch chunked delta rule keeps fp32 intermediates of every chunk (~361 KiB a token in the 9B's layer,
    against the 208 KiB of any other layer): the memory model's per-token figure (dims["gdn"]) within 10 % of the
    saved tensors measured on two layer shapes."""
    import memory
    measured, cfg = _plain_gdn_bytes_per_token(*dims)
    assert abs(memory.dims_from_config(cfg)["gdn"] / measured - 1) < 0.10, (memory.dims_from_config(cfg)["gdn"],
                                                                             measured)


def test_the_9b_shape_that_ran_out_of_memory_is_refused_before_loading_and_fits_in_smaller_micro_batches(monkeypatch):
    """One H200, 2026-12-03 (benchmarks/HISTORY.md): the 9B shape in pure bf16 with 64k-token
    micro-batches peaked at 109.7 GiB in step 1's update and ran out of memory in step 2's (the optimizer's state came
    at step 1's end). The memory model on the plain GDN path: step 1's update within 15 % of the measured peak, and
    the run refused before loading on a 139.8 GiB card; with 16k-token micro-batches it fits."""
    import dataclasses
    import json
    import os

    import memory
    from benchmarks import bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the plain GDN path, as under the H200's Triton
    dims = bench.model_dims("qwen3_5_9b")
    runs = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "h200")
    step1 = json.loads(open(os.path.join(runs, "bench9b_qwen35_2026-12-03_oom_in_step2_metrics.jsonl")).readline())
    c = dict(dataclasses.asdict(bench.defaults("/tmp", "/tmp/m", "/tmp/d")), precision="bf16", rollout_batch_size=16,
             global_batch_size=16, checkpoint_layers=1.0)
    m = memory.memory_model(dims, **memory.config_mode(c, 1))
    model_step1 = m["update"] - m["parts"]["optim"]  # (the state did not exist yet at step 1's peak)
    assert abs(model_step1 / step1["memory/trainer_peak_update_gb"] - 1) < 0.15, (model_step1, step1)
    with pytest.raises(memory.UserError, match="GiB per GPU") as e:
        memory.check_fits(c, dims, 1, 139.8, "--preset qwen3_5_9b")
    tok = int(str(e.value).split("--max-token-len-per-device ")[1].split(",")[0])  # the one line names what fits
    memory.check_fits({**c, "max_token_len_per_device": tok}, dims, 1, 139.8, "--preset qwen3_5_9b")
    need = lambda t: memory.need_gib(memory.memory_model(dims, **memory.config_mode(  # noqa: E731
        {**c, "max_token_len_per_device": t}, 1)), dims, 1)
    assert tok == 16384 and need(tok) <= 138.8 < need(2 * tok)  # the largest halving under the card, no slack


def test_hybrid_engine_asks_for_a_steps_sequences_only(tiny, monkeypatch):
    """vLLM keeps one recurrent-state block per running sequence of a hybrid model, and its default of 1024 sequences
    outran the 578 blocks of the 35B-A3B's 6 GiB cache (CUDA graphs refused, 2026-12-04): VLLMRollout
    asks for one step's sequences on its replica (rollout_batch_size x n x TP / ranks); Qwen-VL keeps vLLM's default."""
    import dataclasses
    import sys
    import types
    import grpo
    import rollout
    got = []

    class LLM:
        def __init__(self, **kw):
            got.append(kw)
            self.llm_engine = types.SimpleNamespace(vllm_config=None)
    names = ("model", "max_num_seqs", "seed", "dtype", "gpu_memory_utilization", "additional_config", "logprobs_mode")
    engine_args = dataclasses.make_dataclass("EngineArgs", names)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.26.0", LLM=LLM))
    monkeypatch.setitem(sys.modules, "vllm.engine", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", types.SimpleNamespace(EngineArgs=engine_args))
    monkeypatch.setenv("WORLD_SIZE", "2")
    opts = rollout.engine_options(grpo.Config(rollout_batch_size=6, n=5))
    monkeypatch.delenv("WORLD_SIZE")  # (the engine itself would join a 2-rank world)
    with pytest.warns(UserWarning, match="does not know"):  # (the keywords this stand-in's EngineArgs lacks)
        rollout.make_rollout("vllm", tiny, **opts)
        rollout.make_rollout("vllm", tiny_model.build_tiny_model(), **opts)
    assert got[0]["max_num_seqs"] == 15 and "max_num_seqs" not in got[1]
    # a vLLM without logprobs_mode (< 0.10.1) would return the raw model's log-probs, not the sampler's: one line
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", types.SimpleNamespace(
        EngineArgs=dataclasses.make_dataclass("EngineArgs", names[:-1])))
    with pytest.raises(rollout.UserError, match="older than 0.10.1 .no logprobs_mode.: install vllm >= 0.10.1"):
        rollout.make_rollout("vllm", tiny, **opts)
