"""Text models EasyR1 lists besides Qwen3: a Llama-3-style model (the tiny one is built in code: grouped-query
attention, rope_theta 500000 with the "llama3" scaling, tied embeddings as Llama 3.2) and Qwen2/Qwen2.5. Each one's
log-probs equal a plain HF forward, the tiny Llama is a demo (--demo-model llama), and both train 3 steps on the CPU
from EasyR1's own command line."""
import json
import os
import sys

import pytest
import torch

import data
import fsdp_actor as actor
import merge
import rollout
import rundir
import tiny_model
from test_qwen3 import reference_text_logprobs

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    actor.init_distributed()
    return tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("llama") / "m"), arch="llama")


def test_llama_folder_is_llama_3_shaped(llama):
    cfg = json.load(open(os.path.join(llama, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    rope = cfg["rope_parameters"]
    assert (rope["rope_type"], rope["rope_theta"], rope["factor"]) == ("llama3", 500000.0, 32.0)
    assert cfg["num_key_value_heads"] * 2 == cfg["num_attention_heads"]  # grouped-query attention
    assert cfg["tie_word_embeddings"] and not cfg["attention_bias"] and cfg["rms_norm_eps"] == 1e-5
    hf = actor.load_hf_model(llama)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.lm_head.weight is hf.model.embed_tokens.weight
    assert rollout.special_token_ids(llama)[0] == json.load(open(os.path.join(llama, "generation_config.json")))[
        "eos_token_id"]


def test_llama_logprobs_engine_and_merge(llama, tmp_path):
    """The trainer's log-probs equal the plain forward and what the HF engine reported sampling; a trained
    checkpoint merges into a folder with the trained (tied) weights."""
    tok = data.load_processor(llama)
    train, _ = tiny_model.demo_max_data(str(tmp_path / "max"), n_train=6, n_val=2)
    ds = data.PromptDataset(train, tok, format_prompt=tiny_model.NUMBER_FORMAT_PROMPT)
    prompts = [ds[0], ds[1], ds[2]]
    out = rollout.HFRollout(llama, device="cpu", dtype=torch.float32).generate(
        prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=5, seeds=[0, 1, 2])
    samples = [dict(prompt=p, response_ids=o["response_ids"]) for p, g in zip(prompts, out) for o in g]
    model = actor.build_actor(llama, CPU, torch.float32, torch.float32, gradient_checkpointing=False).eval()
    units = [type(m).__name__ for m in model.hf.modules() if type(m).__name__.startswith("FSDP")]
    assert units.count("FSDPLlamaDecoderLayer") == 2, units
    lps, _ = actor.compute_logprobs(model, samples, tok.pad_token_id, CPU, 1.0, max_tokens=10_000, max_samples=8)
    for a, b, o in zip(lps, reference_text_logprobs(llama, samples), [o for g in out for o in g], strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5), (a, b)
        assert torch.allclose(a, torch.tensor(o["logprobs"]), atol=1e-4)
    model = actor.build_actor(llama, CPU, torch.float32, torch.float32)
    opt, sched = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, CPU)
    for p in model.parameters():
        p.grad = torch.distributed.tensor.distribute_tensor(torch.ones(p.shape), p.device_mesh, p.placements)
    actor.optimizer_step(model, opt, sched, 1e9)
    trained = dict(actor.iter_full_params(model))
    ckpt = str(tmp_path / "ckpt" / "step_1")
    os.makedirs(os.path.dirname(ckpt))
    rundir.save_checkpoint(ckpt, model, opt, sched, {"step": 1, "cursor": 0, "config": {"model_path": llama}})
    merged = actor.load_hf_model(merge.merge(ckpt, str(tmp_path / "hf"), dtype="float32"))
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still tied
    assert all(torch.equal(v, trained[k]) for k, v in merged.named_parameters())
    assert not torch.equal(trained["model.embed_tokens.weight"], actor.load_hf_model(llama).model.embed_tokens.weight)


def test_tied_head_gradient_adds_to_the_embeddings(llama):
    """The head's gradient (ChunkLogProbs: an ordinary input gradient of the all-gathered weight) adds to the tied
    embedding's under FSDP2: every gradient equals autograd through the plain HF model's full logits (float64,
    temperature 0.7, chunks of 3 tokens)."""
    tok = data.load_processor(llama)
    g = torch.Generator().manual_seed(0)
    prompt = data.encode_prompt({"problem": "Name a number.", "answer": "7", "images": []}, tok)
    samples = [dict(prompt=prompt, response_ids=torch.randint(3, 200, (k,), generator=g).tolist()) for k in (4, 7)]
    up = [torch.randn(len(s["response_ids"]), generator=g, dtype=torch.float64) for s in samples]  # d loss / d logp
    model = actor.build_actor(llama, CPU, torch.float64, torch.float64)
    batch, _ = actor.collate(samples, tok.pad_token_id, CPU, model)
    lp, _ = model(**batch, temperature=0.7, chunk_size=3)
    (lp * torch.cat(up)).sum().backward()
    got = {n.removeprefix("hf."): p.grad.full_tensor() for n, p in model.named_parameters()}
    hf = actor.load_hf_model(llama, dtype=torch.float64)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    for s, u in zip(samples, up):
        ids = torch.tensor([s["prompt"]["prompt_ids"] + s["response_ids"]])
        Lp, Lr = len(s["prompt"]["prompt_ids"]), len(s["response_ids"])
        logp = torch.log_softmax(hf(input_ids=ids).logits[0, Lp - 1:Lp - 1 + Lr] / 0.7, -1)  # [Lr, V]
        (logp.gather(-1, torch.tensor(s["response_ids"])[:, None]).squeeze(-1) * u).sum().backward()
    want = {n: p.grad for n, p in hf.named_parameters()}
    assert got.keys() == want.keys() and "model.embed_tokens.weight" in want
    for n in want:  # (transformers' RMSNorm rounds to fp32 inside even in float64: ~5e-8 apart)
        assert (got[n] - want[n]).abs().max() <= 1e-6 * want[n].abs().max(), n


def test_demo_model_llama_is_the_text_demo(tmp_path):
    import grpo
    from easyr1_config import cli
    args = ["--demo-model", "llama", "--kl-coef", "0", "--rollout-engine", "hf", "--output-dir", str(tmp_path),
            "--resume", "never"]
    ctx = grpo.setup(cli(grpo.Config, grpo.DEMO, args=args, text_demo=grpo.TEXT_DEMO))
    assert type(ctx.model.hf).__name__.endswith("LlamaForCausalLM") and ctx.reward_fn.__name__ == "number_reward"
    assert not ctx.train[0]["mm_inputs"] and (ctx.cfg.n, ctx.cfg.max_response_length) == (32, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_trains_three_steps_from_easyr1s_command_line(arch, tmp_path, launch):
    """`python grpo.py config=<EasyR1's config.yaml> data.train_files=... worker.actor.model.model_path=<tiny>`,
    with the batch shrunk for two CPU cores and the reward and prompt of the digit task (EasyR1's math.py and
    math.jinja are files of its repository)."""
    path = tiny_model.build_tiny_model(str(tmp_path / arch), arch=arch)
    train, val = tiny_model.demo_max_data(str(tmp_path / "max"), n_train=64, n_val=8)
    out, fmt = tmp_path / "out", tmp_path / "number.jinja"
    fmt.write_text(tiny_model.NUMBER_FORMAT_PROMPT)
    words = [f"config={os.path.join(ROOT, 'tests', 'easyr1_config.yaml')}", f"data.train_files={train}",
             f"data.val_files={val}", f"worker.actor.model.model_path={path}", "worker.reward.reward_function=number",
             f"data.format_prompt={fmt}", "data.max_response_length=2",
             "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=4",
             "worker.actor.optim.lr=1e-3", "trainer.max_steps=3", "trainer.val_freq=3", "trainer.logger=[console]",
             "worker.actor.offload.offload_params=false", "worker.actor.offload.offload_optimizer=false",
             f"trainer.save_checkpoint_path={out}", "trainer.save_freq=-1", "worker.rollout.tensor_parallel_size=1"]
    p = launch.run([sys.executable, "grpo.py", *words, "--rollout-engine", "hf"], tmp_path / "log", timeout=600)
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "val/mean" in rows[-1]
    norms = [r["actor/grad_norm"] for r in rows[1:]]
    assert all(map(torch.isfinite, torch.tensor(norms))) and max(norms) > 0, norms  # (a group can be all wrong)
    assert f"model_path={path}" in p.out and "flags win" not in p.out
