"""The generic path for image-text families other than Qwen-VL (families.py), on the tiny Gemma 4 and InternVL
(tiny_families.py): their real module layout; pictures of two colours reach the LLM apart at init; the trainer's
per-token log-probs and gradients equal a plain `model(**processor(...))` forward (fp32); the HF engine generates
with the processor's inputs; honest refusals (a model neither path trains: one line, exit 2, before loading); the
data check knows each family's image token; the folders written for Gemma 4 hold every tensor vLLM loads."""
import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image

import data
import families
import fsdp_actor as actor
import memory
import rollout
import tiny_model
from config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIXELS = dict(min_pixels=56 * 56, max_pixels=112 * 112)


@pytest.fixture(scope="module", params=["gemma4", "internvl"])
def tiny(request, tmp_path_factory):
    arch = request.param
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("fam") / arch), arch=arch)
    hf = actor.load_hf_model(path)  # a 30x head: logits of +-30 and more, where Gemma's soft cap bites
    hf.get_output_embeddings().weight.data *= 30
    hf.save_pretrained(path)
    proc = data.load_processor(path, **PIXELS)
    rows = data.load_rows(tiny_model.demo_data()[1])
    prompts = [data.encode_prompt(rows[i], proc, format_prompt=tiny_model.DEMO_FORMAT_PROMPT, **PIXELS)
               for i in range(3)]
    # several samples per prompt, responses of 1..5 tokens (padded rows of different lengths in one micro-batch)
    g = torch.Generator().manual_seed(0)
    samples = [{"prompt": prompts[i % 3], "response_ids": torch.randint(0, 400, (1 + i % 5,), generator=g).tolist()}
               for i in range(7)]
    return arch, path, proc, samples


def test_tiny_models_have_the_families_layout(tiny):
    arch, path, proc, _ = tiny
    hf = actor.load_hf_model(path)
    names = {n for n, _ in hf.named_parameters()}
    if arch == "gemma4":
        t = hf.config.text_config
        assert t.layer_types == ["sliding_attention", "full_attention"] * 2 and t.num_kv_shared_layers == 2
        assert [t.per_layer_config[i].head_dim for i in range(4)] == [32, 64, 32, 64]  # per-layer head sizes
        assert t.final_logit_softcapping == 30.0 and t.hidden_size_per_layer_input == 16
        assert hf.model.language_model.layers[1].self_attn.q_proj.weight.shape == (4 * 64, 128)
        assert "model.language_model.embed_tokens_per_layer.weight" in names and "model.embed_vision." \
            "embedding_projection.weight" in names
        assert type(proc).__name__ == "Gemma4Processor" and proc.image_token == "<|image|>"
        over = families.vllm_overrides(hf.config)["text_config"]
        assert over["global_head_dim"] == 64
        for k, v in over.items():  # vLLM applies them by setattr on the text config, then reads both head sizes
            setattr(t, k, v)
        assert max(getattr(t, "head_dim", 0), getattr(t, "global_head_dim", 0)) == 64
    else:
        assert hf.config.text_config.model_type == "qwen2" and hf.config.downsample_ratio == 0.5
        assert "model.multi_modal_projector.linear_1.weight" in names
        assert "model.vision_tower.encoder.layer.0.lambda_1" in names  # InternViT's layer scale
        assert type(proc).__name__ == "InternVLProcessor" and proc.image_token == "<IMG_CONTEXT>"
        assert families.vllm_overrides(hf.config) == {}
    assert actor.LogProbModel(hf).generic and not actor.LogProbModel(hf).has_vision


def test_a_red_and_a_blue_picture_reach_the_llm_apart(tiny):
    """At init the LLM's inputs at the image tokens differ between colours (Gemma 4's vision position table, left at
    transformers' placeholder of ones, made every picture alike: 0.2 apart, and the colour demo never learned), and
    every head at the answer spreads its attention over the prompt (Gemma 4's q/k norms left at ones: heads on one
    token, entropy down to 0.0005 of 4.5 here, and the demo stayed at 0.725, green answered blue)."""
    arch, path, proc, _ = tiny
    hf = actor.load_hf_model(path)
    hf.set_attn_implementation("eager")  # (the attention weights)
    embeds = []
    for rgb in tiny_model.COLORS["red"], tiny_model.COLORS["blue"]:
        picture = tiny_model.png_item(Image.new("RGB", (96, 96), rgb))
        row = dict(problem=tiny_model.COLOR_QUESTION, answer="red", images=[picture])
        p = data.encode_prompt(row, proc, **PIXELS)
        ids = torch.tensor([p["prompt_ids"]])
        with torch.no_grad():
            out = hf(input_ids=ids, **p["mm_inputs"], **families.mm_token_types(hf, ids, p["mm_inputs"]),
                     output_hidden_states=True, output_attentions=True)
        embeds.append(out.hidden_states[0][0, ids[0] == hf.config.image_token_id])
        at_answer = torch.stack([a[0, :, -1] for a in out.attentions])  # [layers, heads, keys]
        entropy = -(at_answer * at_answer.clamp_min(1e-12).log()).sum(-1)
        assert entropy.min() > 0.5 * torch.tensor(ids.shape[1]).log(), entropy
    apart = float((embeds[0] - embeds[1]).norm() / embeds[0].norm())
    assert apart > 0.5, apart  # (measured: Gemma 4 1.68, InternVL 1.58; 0.21 with the table of ones)


def test_gemma4s_image_tokens_reach_the_per_layer_inputs_as_vllm_sends_them(tiny):
    """vLLM's Gemma 4 gives its per-layer inputs token 0 at every image token (gemma4_mm.py), transformers the
    config's <pad>: the tiny tokenizer puts <pad> at 0, as the hub's does, so the two forwards are one (2026-12-04's
    GPU row, with <pad> at 502, read 5.07e-3 a token engine against trainer: benchmarks/HISTORY.md)."""
    arch, path, proc, samples = tiny
    if arch != "gemma4":
        pytest.skip("Gemma 4's per-layer inputs")
    hf, p = actor.load_hf_model(path), samples[0]["prompt"]
    ids, mm = torch.tensor([p["prompt_ids"]]), p["mm_inputs"]
    assert (ids == hf.config.image_token_id).sum() > 0
    logits = []
    for pad in hf.config.text_config.pad_token_id, 0:  # transformers' own, then the token vLLM sends
        hf.config.text_config.pad_token_id = pad
        with torch.no_grad():
            logits.append(hf(input_ids=ids, **mm, **families.mm_token_types(hf, ids, mm)).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def _reference(path, proc, samples):
    """Each sample alone through the plain HF model: the processor's own outputs for the prompt (token types too),
    the response appended as text tokens; per-token log-probs (float64 log-softmax) and the weighted sum's grads."""
    hf = actor.load_hf_model(path).train(False)
    forbidden = actor.LogProbModel(hf).forbidden
    w = torch.Generator().manual_seed(1)
    out = []
    for s in samples:
        p = s["prompt"]
        enc = proc(text=[proc.tokenizer.decode(p["raw_prompt_ids"])], images=p["images"], return_tensors="pt",
                   add_special_tokens=False)
        assert enc["input_ids"][0].tolist() == p["prompt_ids"]  # (what the trainer reads: the processor's tokens)
        r = torch.tensor([s["response_ids"]])
        kw = {k: v for k, v in enc.items() if k != "attention_mask"}
        kw["input_ids"] = torch.cat([enc["input_ids"], r], 1)
        if "mm_token_type_ids" in kw:
            kw["mm_token_type_ids"] = torch.cat([kw["mm_token_type_ids"], torch.zeros_like(r)], 1)
        logits = hf(**kw).logits[0].double()
        logits[:, forbidden] = float("-inf")
        Lp = len(p["prompt_ids"])
        lp = torch.log_softmax(logits, -1)[Lp - 1:-1].gather(-1, r[0][:, None]).squeeze(-1)
        (lp * torch.rand(lp.shape, generator=w)).sum().backward()  # (fp32 draws, as the trainer's)
        out.append(lp.detach())
    return out, {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}


def test_logprobs_and_grads_equal_a_plain_forward(tiny):
    arch, path, proc, samples = tiny
    actor.init_distributed()
    torch.manual_seed(0)
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=True)
    assert model.generic and not model.packed
    w = torch.Generator().manual_seed(1)
    batch, resp_len = actor.collate(samples, proc.tokenizer.pad_token_id, torch.device("cpu"), model)
    assert batch["input_ids"].shape[0] == len(samples)  # padded rows, one per sample
    lp, _ = model(**batch)
    lps = lp.detach().split(resp_len.tolist())
    torch.cat([x * torch.rand(x.shape, generator=w, dtype=x.dtype) for x in lp.split(resp_len.tolist())]).sum() \
        .backward()
    grads = {n.removeprefix("hf."): p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    ref, ref_grads = _reference(path, proc, samples)
    for a, b in zip(lps, ref, strict=True):
        assert torch.allclose(a.double(), b, atol=1e-5), (a.double() - b).abs().max()
    assert grads.keys() == ref_grads.keys() and any("vision" in n for n in grads)
    for n, g in grads.items():
        assert (g - ref_grads[n]).norm() <= 1e-4 * ref_grads[n].norm() + 1e-8, (n, (g - ref_grads[n]).norm())


def test_lora_by_default_adapts_the_language_model_and_leaves_every_tower_and_projector_alone(tiny):
    """The default --lora-exclude-modules (common.LORA_EXCLUDE) keeps adapters out of Gemma 4's vision tower and
    embed_vision and InternVL's vision_tower and multi_modal_projector, as EasyR1's `.*visual.*` does for Qwen's
    `visual` (vLLM serves the towers without adapters); the language model's projections get them."""
    arch, path, _, _ = tiny
    hf = actor.load_hf_model(path)
    memory.add_lora(hf, 4, 8)
    adapted = {n.split(".lora_")[0] for n, _ in hf.named_parameters() if ".lora_" in n}
    assert any("language_model" in n for n in adapted)
    assert not [n for n in adapted if any(t in n for t in ("vision", "audio", "multi_modal_projector"))], adapted


def test_the_hf_engine_generates_with_the_processor_inputs(tiny):
    """The engine's sampled tokens' log-probs are the trainer's (the same forbidden tokens, soft cap, inputs)."""
    arch, path, proc, samples = tiny
    actor.init_distributed()
    prompts = [samples[0]["prompt"], samples[1]["prompt"]]
    out = rollout.HFRollout(path, "cpu").generate(prompts, 3, 1.0, 1.0, 4, [1, 2])
    got = [dict(prompt=p, response_ids=r["response_ids"]) for p, group in zip(prompts, out) for r in group]
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False)
    lps, _ = actor.compute_logprobs(model, got, proc.tokenizer.pad_token_id, torch.device("cpu"), 1.0, 10_000, 8)
    engine = [torch.tensor(r["logprobs"]) for group in out for r in group]
    for a, b in zip(lps, engine, strict=True):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_the_data_check_knows_each_familys_image_token(tiny):
    arch, path, proc, _ = tiny
    row = {"problem": f"What is {proc.image_token} here?", "answer": "red", "images": []}
    with pytest.raises(data.BadRow, match="the model's own image token"):
        data.encode_prompt(row, proc)
    assert memory.known_dims(path)["layers"] == (4 if arch == "gemma4" else 2)  # no traceback on per-layer heads
    memory.check_before_loading(Config(model_path=path), 1, card_gib=80)


def test_a_family_neither_path_trains_gets_one_line_before_loading(tmp_path):
    """An audio model (Whisper: no image-text or text-generation class for it): one line naming the families that
    work, exit 2, before anything loads (no weights in the folder: loading would fail otherwise)."""
    from transformers import WhisperConfig
    WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1).save_pretrained(tmp_path)
    p = subprocess.run([sys.executable, "grpo.py", "--model-path", str(tmp_path), "--output-dir",
                        str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [x for x in (p.stdout + p.stderr).splitlines() if "error" in x.lower() or "Traceback" in x]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --model-path"), p.stdout + p.stderr
    assert "whisper" in lines[0] and "Gemma 4, InternVL" in lines[0] and "Loading" not in p.stderr


def test_the_folders_written_for_gemma4_hold_a_k_norm_in_every_layer_as_vllm_loads_them(tmp_path):
    """vLLM 0.26's Gemma 4 builds a k norm in every layer and refuses a folder without one (the H200, 2026-12-03);
    transformers has none in the KV-shared layers. The tiny model's folder, merge.py's, and a sharded save completed
    by tiny_families.complete_for_vllm carry one of each layer's head size in the files vLLM reads (the index's, or
    every .safetensors file), and transformers still loads each folder."""
    from safetensors import safe_open
    import merge
    import rundir
    import tiny_families

    def vllm_reads(folder):
        index = os.path.join(folder, "model.safetensors.index.json")
        files = (set(json.load(open(index))["weight_map"].values()) if os.path.exists(index)
                 else [f for f in os.listdir(folder) if f.endswith(".safetensors")])
        return {k: safe_open(os.path.join(folder, f), "pt").get_slice(k).get_shape() for f in files
                for k in safe_open(os.path.join(folder, f), "pt").keys()}

    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "tiny"), arch="gemma4")
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
    opt, sched = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    ckpt = str(tmp_path / "ckpt" / "step_1")
    os.makedirs(os.path.dirname(ckpt))
    rundir.save_checkpoint(ckpt, model, opt, sched, {"step": 1, "cursor": 0, "config": {"model_path": path}})
    hf = actor.load_hf_model(path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    tiny_families.complete_for_vllm(str(tmp_path / "sharded"))
    heads = [hf.config.text_config.per_layer_config[i].head_dim for i in range(4)]  # [32, 64, 32, 64]
    for folder in (path, merge.merge(ckpt, str(tmp_path / "hf"), dtype="float32"), str(tmp_path / "sharded")):
        keys = vllm_reads(folder)
        assert [keys.get(f"model.language_model.layers.{i}.self_attn.k_norm.weight") for i in range(4)] == \
            [[d] for d in heads], folder
        actor.load_hf_model(folder)


def test_gemma4_e2b_in_small_trains_and_leaves_its_audio_tower_alone(tmp_path, monkeypatch):
    """presets.py's gemma4_e2b with its dimensions scaled down (the same layer pattern over 15 layers, the last 4
    sharing keys/values, per-layer inputs, the vision and audio towers), written by bench.build_random_model with its
    weights as the GPU recipe writes the real one: the k norms vLLM reads sit at each shared layer's head size
    (transformers writes per_layer_config's keys as "09", "14"), and a trainer step moves the LLM and the vision tower
    while the audio tower, which the trainer never runs, gets no gradient and no AdamW state (the memory model's
    `idle`)."""
    from safetensors import safe_open
    import presets
    from benchmarks import bench
    e2b = presets.PRESETS["gemma4_e2b"]
    monkeypatch.setitem(presets.PRESETS, "gemma4_small", dict(e2b, text={
        **e2b["text"], "vocab_size": 1024, "vocab_size_per_layer_input": 1024, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 15, "layer_types": e2b["text"]["layer_types"][:15],
        "num_attention_heads": 2, "head_dim": 16, "global_head_dim": 32, "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": 4}, vision={**e2b["vision"], "hidden_size": 32, "intermediate_size": 64,
                                            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                            "head_dim": 16, "global_head_dim": 16, "position_embedding_size": 1024},
        audio={**e2b["audio"], "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
               "subsampling_conv_channels": [8, 4], "output_proj_dims": 64}))
    path = bench.build_random_model(str(tmp_path / "small"), "gemma4_small")
    assert "09" in json.load(open(os.path.join(path, "config.json")))["text_config"]["per_layer_config"]  # (not 9)
    with safe_open(os.path.join(path, "model-kv-shared-norms.safetensors"), "pt") as f:
        assert [f.get_slice(f"model.language_model.layers.{i}.self_attn.k_norm.weight").get_shape() for i in
                range(11, 15)] == [[16], [16], [16], [32]]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:  # q/k norms at head_dim ** -0.25, not ones
        q = f.get_tensor("model.language_model.layers.0.self_attn.q_norm.weight").float()
    assert torch.allclose(q, torch.full_like(q, 16 ** -0.25), rtol=1e-2)
    actor.init_distributed()
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
    proc = data.load_processor(path, **PIXELS)
    rows = data.load_rows(bench.make_geo_dataset(str(tmp_path / "geo.parquet"), 2, proc.tokenizer, size=112,
                                                 text_tokens=10))
    samples = [{"prompt": data.encode_prompt(r, proc, **PIXELS), "response_ids": [5, 6, 7]} for r in rows]
    lp, _ = model(**actor.collate(samples, proc.tokenizer.pad_token_id, torch.device("cpu"), model)[0])
    lp.sum().backward()
    params = dict(model.named_parameters())
    got = {n for n, p in params.items() if p.grad is not None}
    opt, sched = actor.build_optimizer(model, 1e-3, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    actor.optimizer_step(model, opt, sched, 1.0)
    audio = [n for n in params if ".audio_tower." in n or ".embed_audio." in n]
    assert audio and not got & set(audio) and not any(params[n] in opt.state for n in audio)
    for part in (".vision_tower.", ".embed_tokens_per_layer.", ".layers.14.mlp."):  # (14: shared, double-wide)
        assert all(n in got and params[n] in opt.state for n in params if part in n), part
    assert memory.known_dims(path)["idle"] == sum(params[n].numel() for n in audio)


def test_the_gpu_engine_tests_weights_move_gemma4s_greedy_answers():
    """tests/test_families_gpu.py asserts that a sync of perturbed weights (all, or the vision tower's) changes vLLM's
    greedy answers. With its 10x LM head Gemma 4's soft-capped logits saturated: every prompt answered one token
    whatever the weights, and the H200 run failed for the test's sake (2026-12-03). The same check with the HF engine,
    at the GPU test's own sharpening (sharpen_for), here on the CPU."""
    from test_qwen3_gpu import vl_prompts
    from test_vllm_gpu import greedy, perturb, sharpen_for
    path = tiny_model.build_tiny_model(arch="gemma4")
    recs = vl_prompts(path)
    eng = rollout.make_rollout("hf", path, device="cpu", dtype=torch.float32)
    sd = sharpen_for(rollout.load_hf_model(path, torch.float32))
    eng.sync_weights(sd.items())
    base = greedy(eng, recs)
    assert len({tuple(b) for b in base}) > 1, base  # the prompts answer apart
    for keep in (lambda k: True, lambda k: "vision_tower" in k):
        eng.sync_weights(perturb(sd, keep).items())
        assert greedy(eng, recs) != base
        eng.sync_weights(sd.items())
