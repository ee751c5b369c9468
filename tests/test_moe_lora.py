"""LoRA on the MoE's experts (--lora-target-experts, peft's target_parameters): the fused expert tensors get per-expert
adapters that shard with their decoder layer and train; the engine gets W + peft's own delta in the fused layout,
under the base names (what peft's merge_and_unload makes), and the HF engine then scores as the trainer does. Off,
the experts stay frozen (tests/test_moe.py's attention-only test)."""
import pytest
import torch

import fsdp_actor as actor
import memory
import tiny_model
from common import UserError
from test_qwen3 import mixed_samples

CPU = torch.device("cpu")
LORA = dict(r=4, alpha=8, target_modules="all-linear", exclude_modules=r".*visual.*", modules_to_save="",
            target_experts=True)
FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("q3moe") / "m"), arch="qwen3_vl_moe")
    return (path, *mixed_samples(path, 2, 8))


def trained_step(path, proc, samples, gradient_checkpointing=False):
    """The actor with expert adapters after one optimizer step (peft starts B at 0: the step makes it nonzero);
    also returns the expert adapters' gradients of that step."""
    torch.manual_seed(0)
    model = actor.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=gradient_checkpointing,
                              lora=LORA)
    opt, sched = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, CPU)
    batch, _ = actor.collate(samples, proc.tokenizer.pad_token_id, CPU, model)
    lp, _ = model(**batch)
    (-lp.mean()).backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()
             if ".mlp.experts." in n and ".lora_" in n}
    actor.optimizer_step(model, opt, sched, 1.0)
    return model, grads


def test_expert_adapters_shard_with_their_layer_and_train(moe):
    """Every decoder layer's experts carry per-expert adapters on both fused tensors (lora_A [E r, in], lora_B
    [out, E r]), held by the layer's FSDP unit as DTensors; the optimizer trains them (nonzero gradients, with
    gradient checkpointing's recompute too) next to the attention's, and nothing else."""
    from torch.distributed.fsdp import FSDPModule
    path, proc, samples = moe
    model, grads = trained_step(path, proc, samples, gradient_checkpointing=True)
    t = model.hf.config.text_config
    E, H, I, r = t.num_experts, t.hidden_size, t.moe_intermediate_size, LORA["r"]
    for i, layer in enumerate(model.hf.model.language_model.layers):
        assert isinstance(layer, FSDPModule)
        held = {id(p.sharded_param) for p in layer._get_fsdp_state()._fsdp_param_group.fsdp_params}
        mine = {n.removeprefix(f"hf.model.language_model.layers.{i}."): p for n, p in model.named_parameters()
                if n.startswith(f"hf.model.language_model.layers.{i}.mlp.experts.")}
        # nested ParamWrappers: the inner one on gate_up_proj, the outer on down_proj
        shapes = {n: tuple(p.shape) for n, p in mine.items()}
        assert shapes == {"mlp.experts.base_layer.base_layer.gate_up_proj": (E, 2 * I, H),
                          "mlp.experts.base_layer.base_layer.down_proj": (E, H, I),
                          "mlp.experts.base_layer.lora_A.default.weight": (E * r, H),
                          "mlp.experts.base_layer.lora_B.default.weight": (2 * I, E * r),
                          "mlp.experts.lora_A.default.weight": (E * r, I),
                          "mlp.experts.lora_B.default.weight": (H, E * r)}, shapes
        assert all(id(p) in held and type(p).__name__ == "DTensor" for p in mine.values())
        assert all(p.requires_grad == (".lora_" in n) for n, p in mine.items())
    # peft starts B at 0, so the first step's gradient reaches B only (A's is B^T x ...): a second one reaches both
    assert len(grads) == 4 * t.num_hidden_layers
    assert all((float(g.abs().max()) > 0) == (".lora_B." in n) for n, g in grads.items())
    batch, _ = actor.collate(samples, proc.tokenizer.pad_token_id, CPU, model)
    (-model(**batch)[0].mean()).backward()
    assert all(float(p.grad.full_tensor().abs().max()) > 0 for n, p in model.named_parameters() if n in grads)
    opt, _ = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, CPU)
    trained = [n for n, p in model.named_parameters() if any(p is q for g in opt.param_groups for q in g["params"])]
    assert all(".lora_" in n and (".self_attn." in n or ".mlp.experts." in n) for n in trained)


def test_engine_gets_what_peft_merge_and_unload_makes(moe):
    """After a step the engine's tensors are, name for name, those of peft's merge_and_unload of the trained
    adapter (a plain, unsharded copy): the fused experts W + peft's per-expert delta in the [E, 2I, H] / [E, H, I]
    layout, the attention W + scale B A, the rest the base. The later (LoRA-only) syncs send the experts too."""
    path, proc, samples = moe
    model, _ = trained_step(path, proc, samples)
    merged = dict(actor.iter_full_params(model))
    hf = actor.load_hf_model(path, dtype=torch.float32)
    base = {k: v.clone() for k, v in hf.state_dict().items()}
    peft_model = memory.add_lora(hf, **LORA)
    trained = {n.removeprefix("hf."): p.full_tensor() for n, p in model.named_parameters() if ".lora_" in n}
    assert set(trained) <= set(hf.state_dict())
    hf.load_state_dict(trained, strict=False)
    unsharded = dict(actor.iter_full_params(hf))  # merge.py's path: the adapters read into a plain copy
    want = peft_model.merge_and_unload().state_dict()
    assert all(torch.allclose(unsharded[k], w, atol=1e-6, rtol=0) for k, w in want.items())
    assert set(merged) == set(want) == set(base), (set(merged) ^ set(base), set(want) ^ set(base))
    for name, w in want.items():
        assert torch.allclose(merged[name], w, atol=1e-6, rtol=0), name
    for i in range(model.hf.config.text_config.num_hidden_layers):
        for f in FUSED:
            name = f"model.language_model.layers.{i}.{f}"
            assert merged[name].shape == base[name].shape and float((merged[name] - base[name]).abs().max()) > 1e-5
    later = dict(actor.iter_full_params(model, lora_only=True))
    assert {k for k in later if ".mlp.experts." in k} == {k for k in base if ".mlp.experts." in k}
    assert all(torch.equal(later[k], merged[k]) for k in later)


def test_hf_engine_after_the_sync_scores_as_the_trainer(moe):
    """The HF engine, started from the base weights and sent the LoRA layers after a step (experts included),
    samples tokens whose log-probs it reports as the trainer recomputes them; a sync that left the experts out would
    not (the base experts differ from the trained ones)."""
    import rollout
    path, proc, samples = moe
    model, _ = trained_step(path, proc, samples)
    eng = rollout.HFRollout(path, device="cpu", dtype=torch.float32)
    eng.sync_weights(actor.iter_full_params(model, torch.float32, lora_only=True))
    prompts = [samples[0]["prompt"], samples[1]["prompt"]]
    T = 0.25
    out = eng.generate(prompts, n=2, temperature=T, top_p=1.0, max_tokens=12, seeds=[1, 2])
    gen = [dict(prompt=p, response_ids=o["response_ids"]) for p, g in zip(prompts, out) for o in g]
    assert all(len(s["response_ids"]) > 0 for s in gen)
    lps, _ = actor.compute_logprobs(model.eval(), gen, proc.tokenizer.pad_token_id, CPU, T, max_tokens=10_000,
                                    max_samples=8)
    for a, b in zip(lps, [torch.tensor(o["logprobs"]) for g in out for o in g], strict=True):
        assert torch.allclose(a, b, atol=1e-4), (a, b)


def test_without_experts_the_option_is_an_error(moe):
    """A dense model has no expert tensors: the option stops with one line rather than silently adapting less."""
    hf = actor.load_hf_model(tiny_model.build_tiny_model())
    with pytest.raises(UserError, match="no MoE experts"):
        memory.add_lora(hf, **LORA)


def test_memory_model_counts_the_expert_adapters(moe):
    """The memory model's trained parameters grow, with the option, by r x (in + out) per expert per fused tensor:
    exactly the expert adapters peft makes on the tiny MoE."""
    from transformers import AutoConfig
    path, _, _ = moe
    dims = memory.dims_from_config(AutoConfig.from_pretrained(path))
    hf = actor.load_hf_model(path)
    memory.add_lora(hf, **LORA)
    made = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n and ".lora_" in n)
    kw = dict(lora_rank=LORA["r"], world=1, kl_coef=0.0)
    grown = (memory.memory_model(dims, lora_experts=True, **kw)["parts"]["grads"]
             - memory.memory_model(dims, **kw)["parts"]["grads"])
    assert made > 0 and grown == pytest.approx(made * memory.STATE_BYTES["amp"]["grads"] / 2**30)


def test_expert_adapters_need_a_lora_rank():
    """The option checks (before anything loads) refuse --lora-target-experts without --lora-rank: one line."""
    import easyr1_config
    from common import UserError
    from config import Config
    with pytest.raises(UserError, match="--lora-target-experts .* needs --lora-rank > 0"):
        easyr1_config.check(Config(lora_target_experts=True), 1)
    easyr1_config.check(Config(lora_target_experts=True, lora_rank=8), 1)
