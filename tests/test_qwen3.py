"""Qwen3-VL (deepstack, interleaved M-RoPE, patch 16) and the text-only Qwen3: the trainer's log-probs equal a plain
HF forward, the HF engine generates, and the demos are selected by --demo-model."""
import os
import random

import pytest
import torch

import data
import fsdp_actor as actor
import rundir
import rollout
import presets
import tiny_model
from test_actor import reference_logprobs

CPU = torch.device("cpu")
PX = dict(min_pixels=56 * 56, max_pixels=112 * 112)


def mixed_samples(path, singles, n_samples):
    """(processor, samples) of a tiny VLM folder: `singles` one-image prompts, a two-image prompt sharing the last
    single's picture, a text-only prompt (in the order one..., two, text, last one), and random responses."""
    proc = data.load_processor(path)
    rng = random.Random(0)
    imgs = [tiny_model.draw_color_image(rng)[0] for _ in range(singles + 1)]
    one = [data.encode_prompt({"problem": "<image>What is the main color?", "answer": "red", "images": [im]}, proc,
                              **PX) for im in imgs[:singles]]
    two = data.encode_prompt({"problem": "<image> and <image>: same colour?", "answer": "no",
                              "images": imgs[singles - 1:]}, proc, **PX)
    text = data.encode_prompt({"problem": "Name a colour.", "answer": "red", "images": []}, proc, **PX)
    prompts = one[:-1] + [two, text, one[-1]]
    g = torch.Generator().manual_seed(0)
    return proc, [dict(prompt=prompts[i % len(prompts)], response_ids=torch.randint(
        3, 300, (1 + (i * 5) % 9,), generator=g).tolist()) for i in range(n_samples)]


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("q3vl") / "m"), arch="qwen3_vl")
    return (path, *mixed_samples(path, 3, 10))


def test_qwen3_vl_folder(qwen3_vl):
    """What vLLM and AutoProcessor read: Qwen3-VL's processor classes, 16-pixel patches, deepstack, interleaving."""
    import json
    path, proc, _ = qwen3_vl
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert cfg["vision_config"]["patch_size"] == 16 and len(cfg["vision_config"]["deepstack_visual_indexes"]) == 2
    rope = cfg["text_config"]["rope_parameters"]
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) * 2 == cfg["text_config"]["head_dim"]
    pre = json.load(open(os.path.join(path, "preprocessor_config.json")))
    video = json.load(open(os.path.join(path, "video_preprocessor_config.json")))
    assert pre["processor_class"] == "Qwen3VLProcessor" and pre["patch_size"] == 16 and pre["image_mean"] == [0.5] * 3
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor" and video["patch_size"] == 16
    assert type(proc).__name__ == "Qwen3VLProcessor"
    tok = proc.tokenizer
    assert tok.tokenize("12 + 30") == ["1", "2", "Ġ", "+", "Ġ", "3", "0"]  # one token per digit, like Qwen


def test_qwen3_vl_logprobs_match_plain_hf_forward(qwen3_vl, monkeypatch):
    """Images, a two-image row and a text-only row in one batch, 2 samples per prompt: equal to the model's own
    forward (float64 reference), with the vision tower run once over the distinct images."""
    path, proc, samples = qwen3_vl
    model = actor.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=False).eval()
    seen = []
    vis = model.hf.model.visual
    monkeypatch.setattr(vis, "forward", lambda pixel_values, grid_thw, **kw: (
        seen.append(len(grid_thw)), type(vis).forward(vis, pixel_values, grid_thw=grid_thw, **kw))[1])
    ref = reference_logprobs(path, samples, proc.tokenizer.pad_token_id)
    for max_tokens in (10_000, 60):  # one micro-batch (5 prompts, 5 distinct images), then several
        lps, _ = actor.compute_logprobs(model, samples, proc.tokenizer.pad_token_id, CPU, 1.0, max_tokens=max_tokens,
                                        max_samples=16)
        for a, b in zip(lps, ref, strict=True):
            assert a.shape == b.shape
            assert torch.allclose(a.double(), b, atol=2e-5), (a, b)
    assert seen[0] == 5  # the first (single) micro-batch: each distinct image once, not once per sample


def test_qwen3_vl_text_only_micro_batch(qwen3_vl):
    """A micro-batch without images still runs the vision tower (a blank image, times 0: every rank runs the same
    FSDP units) and gives the plain forward's log-probs; the deepstack mergers get a (zero) gradient too."""
    path, proc, samples = qwen3_vl
    text = [s for s in samples if not s["prompt"]["mm_inputs"]]
    model = actor.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=False)
    batch, resp_len = actor.collate(text, proc.tokenizer.pad_token_id, CPU)
    lp, _ = model(**batch)
    ref = reference_logprobs(path, text, proc.tokenizer.pad_token_id)
    for a, b in zip(lp.split(resp_len.tolist()), ref, strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5)
    lp.sum().backward()
    grads = {n: q.grad for n, q in model.named_parameters() if ".deepstack_merger_list." in n}
    assert grads and all(g is not None and float(g.full_tensor().abs().sum()) == 0 for g in grads.values())


def hf_engine_matches_trainer(path, proc, prompts, T=0.25):
    """The HF engine samples 3 answers per prompt at temperature T (peaked: a wrong position, feature or routing
    changes the numbers visibly); its log-probs must equal the trainer's full-forward recomputation. Returns it."""
    eng = rollout.HFRollout(path, device="cpu", dtype=torch.float32)
    out = eng.generate(prompts, n=3, temperature=T, top_p=1.0, max_tokens=12, seeds=[1, 2])
    model = actor.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=False).eval()
    gen = [dict(prompt=p, response_ids=o["response_ids"]) for p, g in zip(prompts, out) for o in g]
    assert all(len(s["response_ids"]) > 0 for s in gen)
    lps, _ = actor.compute_logprobs(model, gen, proc.tokenizer.pad_token_id, CPU, T, max_tokens=10_000, max_samples=8)
    for a, b in zip(lps, [torch.tensor(o["logprobs"]) for g in out for o in g], strict=True):
        assert torch.allclose(a, b, atol=1e-4), (a, b)
    return eng


def test_qwen3_vl_hf_engine_generates_what_the_trainer_scores(qwen3_vl):
    """The HF engine samples with a KV cache (its positions continue from the image's 3-D ones); the log-probs it
    reports must be the trainer's full-forward recomputation of the same tokens, single- and two-image prompts."""
    path, proc, samples = qwen3_vl
    prompts = [samples[0]["prompt"], samples[2]["prompt"]]  # one image; two images
    eng = hf_engine_matches_trainer(path, proc, prompts)
    g = eng.generate(prompts[1:], n=2, temperature=0, top_p=1.0, max_tokens=8, seeds=[0])[0]
    assert g[0] == g[1] and len(g[0]["response_ids"]) > 0


def reference_text_logprobs(path, samples):
    """Plain HF forward of a causal LM, one sample at a time, float64 log_softmax over the full logits."""
    hf = actor.load_hf_model(path, dtype=torch.float32).eval()
    out = []
    for s in samples:
        ids = torch.tensor([s["prompt"]["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=ids).logits[0].double(), -1)
        Lp, Lr = len(s["prompt"]["prompt_ids"]), len(s["response_ids"])
        out.append(lp[Lp - 1:Lp - 1 + Lr].gather(-1, torch.tensor(s["response_ids"])[:, None]).squeeze(-1))
    return out


def test_qwen3_text_model_end_to_end_pieces(tmp_path):
    """The text-only path: AutoModelForCausalLM, the tokenizer as processor, rows without an images column, FSDP
    units from _no_split_modules, log-probs equal to the plain forward, the HF engine, and merge.py."""
    import merge
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "q3"), arch="qwen3")
    tok = data.load_processor(path)
    assert not hasattr(tok, "image_processor")  # a tokenizer: no vision inputs anywhere
    train, _ = tiny_model.demo_max_data(str(tmp_path / "max"), n_train=6, n_val=2)
    assert data.load_rows(train).column_names == ["problem", "answer"]  # no images column
    ds = data.PromptDataset(train, tok, format_prompt=tiny_model.NUMBER_FORMAT_PROMPT)
    eng = rollout.HFRollout(path, device="cpu", dtype=torch.float32)
    prompts = [ds[0], ds[1], ds[2]]
    out = eng.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=5, seeds=[0, 1, 2])
    samples = [dict(prompt=p, response_ids=o["response_ids"]) for p, g in zip(prompts, out) for o in g]
    model = actor.build_actor(path, CPU, torch.float32, torch.float32, gradient_checkpointing=False).eval()
    assert type(model.hf).__name__.endswith("Qwen3ForCausalLM")
    units = [type(m).__name__ for m in model.hf.modules() if type(m).__name__.startswith("FSDP")]
    assert units.count("FSDPQwen3DecoderLayer") == 2, units  # each decoder layer its own FSDP unit
    lps, _ = actor.compute_logprobs(model, samples, tok.pad_token_id, CPU, 1.0, max_tokens=10_000, max_samples=8)
    for a, b, o in zip(lps, reference_text_logprobs(path, samples), [o for g in out for o in g], strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5), (a, b)
        assert torch.allclose(a, torch.tensor(o["logprobs"]), atol=1e-4)  # what the engine reported sampling
    # a trained checkpoint of the text demo merges into its own base model (the tiny Qwen3, not the default VLM)
    model = actor.build_actor(path, CPU, torch.float32, torch.float32)
    opt, sched = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, CPU)
    for p in model.parameters():  # one optimizer step (dcp saves an optimizer with state)
        p.grad = torch.distributed.tensor.distribute_tensor(torch.ones(p.shape), p.device_mesh, p.placements)
    actor.optimizer_step(model, opt, sched, 1e9)
    trained = dict(actor.iter_full_params(model))
    ckpt = str(tmp_path / "ckpt" / "step_1")
    os.makedirs(os.path.dirname(ckpt))
    rundir.save_checkpoint(ckpt, model, opt, sched, {"step": 1, "cursor": 0, "config": {"model_path": path}})
    merged = actor.load_hf_model(merge.merge(ckpt, str(tmp_path / "hf"), dtype="float32"))
    assert type(merged).__name__ == "Qwen3ForCausalLM"
    assert all(torch.equal(v, trained[k]) for k, v in merged.state_dict().items())
    assert os.path.basename(merge.base_model_path(ckpt)) == "q3"
    demo = {"step": 1, "cursor": 0, "config": {"model_path": "", "demo_model": "qwen3"}}
    rundir.save_checkpoint(ckpt, model, opt, sched, demo)
    assert merge.base_model_path(ckpt) == tiny_model.build_tiny_model(arch="qwen3")


def test_qwen3_vl_8b_preset_has_the_real_dimensions():
    """bench.py --preset qwen3_vl_8b: Qwen3-VL-8B-Instruct's config (8.77B parameters, 0.58B of them the ViT)."""
    ids = tiny_model._token_ids(tiny_model.build_tokenizer())
    cfg = presets.preset_config("qwen3_vl_8b", ids)
    assert cfg.model_type == "qwen3_vl" and cfg.vision_config.deepstack_visual_indexes == [8, 16, 24]
    assert cfg.text_config.rope_parameters["mrope_section"] == [24, 20, 20]
    n = presets.count_params(cfg)  # meta device: nothing allocated
    assert 8.7e9 < n < 8.85e9, n


@pytest.mark.parametrize("demo, model_cls, reward, images", [
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "color_reward", True),  # the default: today's demo
    ("qwen2_vl", "Qwen2VLForConditionalGeneration", "color_reward", True),
    ("qwen3_vl", "Qwen3VLForConditionalGeneration", "color_reward", True),
    ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "color_reward", True),
    ("qwen3", "Qwen3ForCausalLM", "number_reward", False)])
def test_demo_model_selects_model_task_and_reward(tmp_path, demo, model_cls, reward, images):
    import grpo
    from easyr1_config import cli
    args = ["--demo-model", demo, "--kl-coef", "0", "--rollout-engine", "hf", "--output-dir", str(tmp_path),
            "--resume", "never"]
    ctx = grpo.setup(cli(grpo.Config, grpo.DEMO, args=args, text_demo=grpo.TEXT_DEMO))  # as grpo.main makes it
    assert type(ctx.model.hf).__name__.endswith(model_cls) and type(ctx.rollout.model).__name__ == model_cls
    assert ctx.reward_fn.__name__ == reward
    assert bool(ctx.train[0]["mm_inputs"]) == images and bool(ctx.val[0]["mm_inputs"]) == images
    assert hasattr(ctx.processor, "image_processor") == images
    # the text demo's own settings where the options were left at their defaults; the colour demos keep theirs
    assert (ctx.cfg.n, ctx.cfg.max_response_length, ctx.cfg.lr, ctx.cfg.temperature) == (
        (16, 4, 1e-3, 1.0) if images else (32, 1, 5e-4, 1.5))
    if not images:
        assert cli(grpo.Config, grpo.DEMO, args=args + ["--rollout-n", "8"], text_demo=grpo.TEXT_DEMO).n == 8


def test_max_task_rows(tmp_path):
    """The text demo's rows: the answer is the largest of 3 to 5 digits (it occurs once), no answer dominates (a
    constant answer must not pay), no list position holds the answer more often than the others (copying one must
    not pay), the questions are too many to learn as a table, and no validation question occurs in training."""
    import collections
    import re
    train, val = tiny_model.demo_max_data(str(tmp_path), n_train=3000, n_val=300)
    rows = {p: list(data.load_rows(p)) for p in (train, val)}
    where, lengths = collections.Counter(), collections.Counter()
    for path, rs in rows.items():
        for row in rs:
            digits = [int(d) for d in re.fullmatch(r"What is the largest of (\d(?:, \d)+)\?", row["problem"])
                      .group(1).split(", ")]
            assert digits.count(max(digits)) == 1 and row["answer"] == str(max(digits))
            where[(len(digits), digits.index(max(digits)))] += 1
            lengths[len(digits)] += 1
    assert sorted(lengths) == [3, 4, 5]
    for (k, i), count in where.items():  # the largest digit's place is uniform over the list's k places
        assert abs(count / lengths[k] - 1 / k) < 0.06, (k, i, count / lengths[k])
    answers = collections.Counter(r["answer"] for r in rows[train])
    assert sorted(answers) == [str(d) for d in range(2, 10)]
    assert max(answers.values()) < 0.145 * len(rows[train])  # uniform over 2..9: 1/8 each
    train_q, val_q = {r["problem"] for r in rows[train]}, [r["problem"] for r in rows[val]]
    assert len(set(val_q)) == len(val_q)  # validation: different questions
    assert len(train_q) > 0.6 * len(rows[train])  # mostly different questions: no table to learn
    assert not train_q & set(val_q)  # validation is unseen
    assert all(map(tiny_model.is_val_question, val_q)) and not any(map(tiny_model.is_val_question, train_q))
    # checked whenever the files are used, cached ones too: a training file holding validation questions is refused
    tiny_model.make_max_dataset(train, 50, seed=1, split="val")  # validation's own questions
    with pytest.raises(data.UserError, match="validation questions occur in"):
        tiny_model.demo_max_data(str(tmp_path), n_train=3000, n_val=300)
