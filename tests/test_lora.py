"""LoRA (peft): the reference is the policy with its adapters off, only adapters train, the engine gets merged
weights under the base names, checkpoints hold the adapters and resume exactly, merge.py writes dense and adapter
folders."""
import json
import os

import pytest
import torch

import data
import fsdp_actor as actor
import memory
import rundir
import merge
import tiny_model
from test_actor import reference_logprobs
from test_train import DENSE_REWARD, run

LORA = dict(r=4, alpha=8, target_modules="all-linear", exclude_modules=r".*visual.*")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"))
    proc = data.load_processor(path)
    train, _ = tiny_model.demo_data(str(tmp_path_factory.mktemp("data")), n_train=4, n_val=2)
    ds = data.PromptDataset(train, proc, format_prompt=tiny_model.DEMO_FORMAT_PROMPT, min_pixels=56 * 56,
                            max_pixels=112 * 112)
    samples = [dict(prompt=ds[0], response_ids=[5, 6, 7]), dict(prompt=ds[0], response_ids=[8]),
               dict(prompt=ds[1], response_ids=[9, 9, 9, 9])]
    return path, proc, samples


def lora_actor(path, seed=0, **kw):
    torch.manual_seed(seed)
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False,
                              lora={**LORA, **kw})
    with torch.no_grad():  # peft starts B at 0 (adapter = identity): move it so the adapter changes the output
        for n, p in model.named_parameters():
            if ".lora_B." in n or ".modules_to_save." in n:
                p.copy_(torch.distributed.tensor.distribute_tensor(0.05 * torch.randn(p.shape), p.device_mesh,
                                                                   p.placements))
    return model.eval()


def lora_checkpoint(model, path, tmp_path):
    """A training checkpoint of a LoRA actor (step 1, the options merge.py reads); returns its folder."""
    opt, sched = actor.build_optimizer(model, 1e-3, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    ckpt = str(tmp_path / "ckpt" / "step_1")
    os.makedirs(os.path.dirname(ckpt))
    cfg = {"model_path": path, "lora_rank": LORA["r"], "lora_alpha": LORA["alpha"],
           "lora_target_modules": LORA["target_modules"], "lora_exclude_modules": LORA["exclude_modules"]}
    rundir.save_checkpoint(ckpt, model, opt, sched, {"step": 1, "cursor": 0, "config": cfg})
    return ckpt


def logprobs(model, samples, proc):
    return actor.compute_logprobs(model, samples, proc.tokenizer.pad_token_id, torch.device("cpu"), 1.0,
                                  max_tokens=10_000, max_samples=8)[0]


def test_reference_is_the_base_model_and_only_adapters_train(setup):
    path, proc, samples = setup
    model = lora_actor(path)
    base = reference_logprobs(path, samples, proc.tokenizer.pad_token_id)
    with memory.adapters_disabled(model):
        off = logprobs(model, samples, proc)
    on = logprobs(model, samples, proc)
    for a, b, c in zip(off, base, on, strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5)  # adapters off == the base model, no second copy
        assert not torch.allclose(c.double(), b, atol=1e-3)  # and on, they do change the policy
    opt, _ = actor.build_optimizer(model, 1e-3, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    names = [n for n, p in model.named_parameters() if id(p) in trained]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert not any(".visual." in n for n in names)  # the vision tower is excluded by default


@pytest.mark.parametrize("modules_to_save", ["", "lm_head"])
def test_merged_weights_reproduce_the_actor(setup, modules_to_save):
    path, proc, samples = setup
    model = lora_actor(path, seed=1, modules_to_save=modules_to_save)
    merged = dict(actor.iter_full_params(model))
    plain = actor.load_hf_model(path, dtype=torch.float32)
    assert merged.keys() == plain.state_dict().keys()  # the base model's names: what engines load
    plain.load_state_dict(merged)
    dense = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    with torch.no_grad():
        for n, p in dense.hf.named_parameters():
            p.copy_(torch.distributed.tensor.distribute_tensor(merged[n], p.device_mesh, p.placements))
    for a, b in zip(logprobs(model, samples, proc), logprobs(dense.eval(), samples, proc), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    changed = dict(actor.iter_full_params(model, lora_only=True))  # later syncs: the LoRA-wrapped layers only
    assert changed and set(changed) < set(merged)
    assert all(torch.equal(changed[k], merged[k]) for k in changed)
    assert all((k.endswith("proj.weight") or k == f"{modules_to_save}.weight") and ".visual." not in k
               for k in changed)
    assert ("lm_head.weight" in changed) == bool(modules_to_save)  # a module trained in full is re-sent too


def test_lora_checkpoint_merges_to_dense_and_adapter_folders(setup, tmp_path):
    path, proc, samples = setup
    model = lora_actor(path, seed=2)
    ckpt = lora_checkpoint(model, path, tmp_path)
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    full = sum(p.numel() for p in model.parameters()) * 4
    assert size < full / 4  # adapters (and their optimizer state) only, not the base weights
    want = logprobs(model, samples, proc)
    dense = merge.merge(ckpt, str(tmp_path / "dense"), dtype="float32")
    hf = actor.load_hf_model(dense)
    assert not any("lora" in k for k in hf.state_dict())
    torch.save(hf.state_dict(), tmp_path / "sd.pt")
    check = actor.build_actor(dense, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    for a, b in zip(want, logprobs(check.eval(), samples, proc), strict=True):
        assert torch.allclose(a, b, atol=1e-5)  # merged logits equal the actor's (fp32)
    folder = merge.merge(ckpt, str(tmp_path / "adapter"), dtype="float32", adapter_only=True)
    from peft import PeftModel
    peft_model = PeftModel.from_pretrained(actor.load_hf_model(path), folder)
    for n, t in peft_model.base_model.model.state_dict().items():
        if ".lora_" in n:
            want_t = dict(model.hf.state_dict())[n]
            assert torch.equal(t, want_t.full_tensor()), n
    assert json.load(open(os.path.join(folder, "adapter_config.json")))["r"] == LORA["r"]


def test_lora_runs_one_and_two_processes_alike_and_resumes_exactly(tmp_path, launch):
    (tmp_path / "r.py").write_text(DENSE_REWARD)
    # one mini-batch per step: its loss does not depend on how the batch is spread over ranks
    kw = ["--lora-rank", "4", "--global-batch-size", "4", "--save-freq", "1", "--reward-function",
          f"{tmp_path / 'r.py'}:dense", "--lr-scheduler-type", "constant"]  # a run made longer: a constant lr
    straight = run(launch, ["--max-steps", "3"] + kw, tmp_path / "a")
    two = run(launch, ["--max-steps", "1"] + kw, tmp_path / "two", nproc=2)
    for k in ("reward/mean", "actor/pg_loss", "actor/loss", "actor/grad_norm"):
        assert two[0][k] == pytest.approx(straight[0][k], rel=1e-4, abs=1e-6), k
    run(launch, ["--max-steps", "2"] + kw, tmp_path / "b")
    resumed = run(launch, ["--max-steps", "3"] + kw, tmp_path / "b")
    assert straight[-1]["actor/kl"] > 0 and straight[-1]["actor/grad_norm"] > 0  # the adapters moved
    for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl"):
        assert resumed[-1][k] == pytest.approx(straight[-1][k], rel=1e-5, abs=1e-7), k


def test_reference_pass_first_then_bf16_update(setup):
    """The reference pass (adapters off) is often the model's first forward, where FSDP2 fixes each unit's gradient
    dtypes from the parameters that require grad. Switching the adapters off must not switch their requires_grad
    (seen on an H200: the update's bf16 gradients then met the fp32 master weights and backward raised)."""
    path, proc, samples = setup
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.bfloat16, gradient_checkpointing=False,
                              lora={**LORA, "modules_to_save": "lm_head"})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    with memory.adapters_disabled(model):
        assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable
        actor.compute_logprobs(model, samples, proc.tokenizer.pad_token_id, torch.device("cpu"), 1.0, 10_000, 8)
    batch, _ = actor.collate(samples, proc.tokenizer.pad_token_id, torch.device("cpu"))
    lp, _ = model(**batch)
    lp.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.dtype == torch.float32 for g in grads.values())


def test_bf16_lora_is_the_bf16_model_with_zero_adapters(setup):
    """Pure bf16 with LoRA, as built (B = 0): the same log-probs as the bf16 model without adapters, to the bit.
    Casting the whole model to bf16 for the adapters' sake also rounded the rotary inv_freq buffers, which moves
    every position's angle: 0.44 nats per token apart from vLLM on the 7B."""
    path, proc, samples = setup
    long = [dict(prompt=samples[0]["prompt"], response_ids=[(7 * i) % 500 + 5 for i in range(400)])]

    def build(lora):
        torch.manual_seed(0)
        return actor.build_actor(path, torch.device("cpu"), torch.bfloat16, torch.bfloat16,
                                 gradient_checkpointing=False, lora=lora).eval()
    plain, with_lora = build(None), build(LORA)
    assert {n.replace("base_model.model.", ""): b.dtype for n, b in with_lora.named_buffers()} == \
        {n: b.dtype for n, b in plain.named_buffers()}
    assert any(".lora_A." in n and p.dtype == torch.bfloat16 for n, p in with_lora.named_parameters())
    for a, b in zip(logprobs(plain, long, proc), logprobs(with_lora, long, proc), strict=True):
        assert torch.equal(a, b)
