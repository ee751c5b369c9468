"""bench.py's workload is the one the speed bar names: one 512x512 image and about 100 text tokens per prompt."""
import datetime
import glob
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict

import pytest

import data
import grpo
import memory
import tiny_model
from benchmarks import bench, host_log, record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (python -m benchmarks.bench runs from here)


def test_geo_prompts_have_one_512px_image_and_about_100_text_tokens(tmp_path):
    path = tiny_model.build_tiny_model(str(tmp_path / "tiny"))  # same tokenizer as the bench's random model
    proc = data.load_processor(path, min_pixels=3136, max_pixels=512 * 512)  # the bench's bounds
    parquet = bench.make_geo_dataset(str(tmp_path / "geo.parquet"), 3, proc.tokenizer)
    rows = data.load_rows(parquet)
    assert len(rows) == 3
    for row in rows:
        text = row["problem"].removeprefix("<image>")
        assert 100 <= len(proc.tokenizer(text)["input_ids"]) <= 110
        rec = data.encode_prompt(row, proc, min_pixels=3136, max_pixels=512 * 512)
        grid = rec["mm_inputs"]["image_grid_thw"]
        assert grid.tolist() == [[1, 36, 36]]  # 512 px -> 504 px (multiple of 28) -> 36 x 36 patches
        image_tokens = 36 * 36 // 4
        assert image_tokens + 100 <= len(rec["prompt_ids"]) <= image_tokens + 150  # + the chat template


def _trainer_only(launch, tmp_path, out, cfg_kw, run_kw, pre=""):
    """bench.run(trainer_only=True) on the tiny model and 4 geo prompts (2 prompts x 4 samples, 2 steps) in a child
    process, with cfg_kw / run_kw (Python keyword text) on top and `pre` (code) first; returns the rows of its
    metrics.jsonl."""
    path = tiny_model.build_tiny_model()
    proc = data.load_processor(path)
    parquet = bench.make_geo_dataset(str(tmp_path / "geo.parquet"), 4, proc.tokenizer, size=112, text_tokens=20)
    script = (
        "import dataclasses, torch.distributed as dist\nfrom benchmarks import bench\n" + pre +
        f"cfg = bench.defaults({str(tmp_path)!r}, {path!r}, {parquet!r})\n"
        "cfg = dataclasses.replace(cfg, rollout_batch_size=2, global_batch_size=2, n=4, min_pixels=56 * 56,\n"
        f"    max_pixels=112 * 112, max_steps=2, lr=1e-3, output_dir={str(out)!r}, {cfg_kw})\n"
        f"print('SUMMARY', bench.run(cfg, trainer_only=True, {run_kw}))\n"
        "dist.destroy_process_group()\n")
    launch.run([sys.executable, "-c", script], tmp_path / "bench.log")
    return [json.loads(x) for x in open(out / "metrics.jsonl")]


def test_trainer_only_profile_run(tmp_path, launch):
    """`bench.py --trainer-only --profile` on the tiny model: random full-length responses instead of an engine, the
    phases timed, the last step's kernel table written."""
    out = tmp_path / "run"
    # --sample-stacks 2: the generation phase (here the random responses, made slow) has its thread's stack counted
    # (and runs Python's collector over a heap of small lists: bench's gen_loop/gc times it)
    slow = ("import gc, time\nreal = bench.synthetic_collect\n"
            "def slow_collect(*a, **k):\n    time.sleep(0.2)\n    heap = [[i] for i in range(200_000)]\n"
            "    gc.collect()\n    return real(*a, **k)\n"
            "bench.synthetic_collect = slow_collect\n")
    rows = _trainer_only(launch, tmp_path, out, "max_response_length=8", "profile=True, sample_ms=2", pre=slow)
    assert [r["step"] for r in rows] == [1, 2]
    stacks = json.load(open(out / "gen_stacks.json"))
    assert [s["step"] for s in stacks] == [1, 2]
    for s in stacks:
        assert s["stacks"]["*"] >= 0.15 and any("slow_collect" in k for k in s["stacks"]), s
    for r in rows:
        assert r["response_length/mean"] == 8 and r["response_length/clip_ratio"] == 1.0
        assert r["timing/update"] > 0 and r["timing/ref_logprob"] > 0
        assert 0 < r["gen_loop/gc"] < r["timing/gen"]  # the collector's seconds during the generation phase
        # each phase's wall-clock start (bench.py phases): in the step's order, each after the last one's end
        starts = [(r[f"time/{k}_start"], r[f"timing/{k}"]) for k in ("sync", "gen", "ref_logprob", "update")]
        assert all(t0 + d <= t1 for (t0, d), (t1, _) in zip(starts, starts[1:])), starts
    assert rows[1]["actor/kl"] > 0  # the update of step 1 moved the policy away from the reference
    assert all(0 < r["perf/pad_fraction"] < 1 and r["perf/mfu_update"] > 0 and r["perf/mfu_ref"] > 0 for r in rows)
    table = (out / "profile.txt").read_text()
    assert "aten::" in table and "Self CPU" in table


def test_trainer_only_realistic_workload_padding_free(tmp_path, launch):
    """--workload realistic: forced response lengths from the seeded distribution; padding-free training (the plain
    varlen path on the CPU) leaves no pad token in the update's micro-batches."""
    rows = _trainer_only(launch, tmp_path, tmp_path / "run", "max_response_length=40, padding_free='on', "
                         "vision_varlen='on', max_token_len_per_device=120", "workload='realistic'")
    assert [r["step"] for r in rows] == [1, 2]
    want = [L for pos in range(4) for L in bench.response_lengths(1, pos, 4, 40)]  # the 4 prompts of 2 steps
    for r, lens in zip(rows, (want[:8], want[8:])):
        assert r["response_length/mean"] == sum(lens) / 8 and r["response_length/max"] == max(lens)
        assert r["response_length/clip_ratio"] == sum(L == 40 for L in lens) / 8
        assert r["perf/pad_fraction"] == 0 and r["perf/mfu_update"] > 0


def test_memory_model_bytes_per_parameter():
    """Without activations and gathered units, the model is bytes per parameter over the ranks: AMP 4 + 4 + 8,
    bf16 2 + 2 + 4 (+ 2 Kahan), the reference 2, LoRA's base its weights only; offload leaves the GPU empty."""
    dims = dict(params=1e9, hidden=0, inter=0, layers=0, vocab=0, kv_frac=0, layer_params=0, root_params=0)
    g = memory.GIB

    def upd(**kw):
        return memory.memory_model(dims, mb_tokens=0, chunk=0, **kw)["update"] * g / 1e9

    assert upd() == 16 + 2 and upd(kl_coef=0) == 16
    assert upd(world=4, kl_coef=0) == 4
    assert upd(precision="bf16", kahan=False, kl_coef=0) == 8 and upd(precision="bf16", kl_coef=0) == 10
    assert upd(offload_params=True) == 0
    assert memory.memory_model(dims, mb_tokens=0, chunk=0)["gen"] * g / 1e9 == 12 + 2  # no gradients then
    assert upd(lora_rank=8) == 4  # layers=0: no adapters, the fp32 base alone, no reference model


def test_table_marks_measured_cells_with_the_models_error(tmp_path):
    cfg = asdict(grpo.Config(rollout_batch_size=8, n=8, lora_rank=64))
    s = {"preset": "qwen2_5_vl_7b", "world": 1, "date": "2026-12-01", "command": "bench.py --lora-rank 64",
         "config": cfg, "memory/trainer_peak_update_gb": 40.0, "memory/engine_pool_gb": 20.0, "timing/step": 9.0}
    (tmp_path / "x_summary.json").write_text(json.dumps(s))
    (tmp_path / "x_metrics.jsonl").write_text("")
    out = bench.table([str(tmp_path / "x_metrics.jsonl")])
    row = [r for r in out.splitlines() if r.startswith("| x |")][0]
    want = bench.run_model(s)["update"]
    assert f"40.0, {want:.1f}, {100 * (want - 40) / 40:+.0f}%" in row and "2026-12-01" in row
    assert "| qwen2_5_vl_7b (8.29B) | AMP |" in out


def test_table_shows_a_run_that_did_not_finish(tmp_path):
    """No summary (the run died, e.g. out of memory at step 2): its last logged step's peaks, marked as such."""
    rows = [{"step": 1, "memory/trainer_peak_gen_gb": 17.94, "memory/trainer_peak_ref_gb": 21.6,
             "memory/trainer_peak_update_gb": 24.69, "memory/engine_pool_gb": 19.09, "timing/step": 140.1}]
    (tmp_path / "oom_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = [r for r in bench.table([str(tmp_path / "oom_metrics.jsonl")]).splitlines() if r.startswith("| oom |")][0]
    assert "did not finish" in row and "| 17.9 | 21.6 | 24.7 | 19.1 | step 1: 140.1 |" in row


@pytest.mark.parametrize("preset, billions", [("qwen2_5_vl_32b", 33.5), ("qwen2_5_vl_72b", 73.4)])
def test_computed_only_presets_have_the_checkpoints_sizes(preset, billions):
    """The table's computed-only rows: the presets' dimensions give the published checkpoints' parameter counts
    (Qwen2.5-VL-32B-Instruct 33.5B, -72B-Instruct 73.4B), so a wrong hidden size or layer count shows."""
    assert bench.model_dims(preset)["params"] / 1e9 == pytest.approx(billions, rel=0.005)


def test_memory_model_tracks_every_measured_run():
    """The README's claim: the model is within 15 % (or 1 GiB, for a phase that holds almost nothing, as the
    trainer while --offload-params generates) of each phase's trainer peak in every H200 run kept in
    benchmarks/h200 (the AMP, pure bf16, LoRA and offload runs of the 3B, 7B and 8B). A wrong bytes-per-parameter or
    activation term shows here (the old log-prob-pass bound was 54 % high on the 3B LoRA run; adding the logits
    chunk to a recomputed layer instead of taking the larger, 47 % high on the 3B offload run's update)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "h200")
    runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(here, "*_summary.json")))]
    runs = [s for s in runs if "memory/trainer_peak_ref_gb" in s]
    assert len(runs) >= 8
    assert any(s["config"]["offload_params"] for s in runs) and any(s["config"]["offload_optimizer"] for s in runs)
    for s in runs:
        model = bench.run_model(s)
        for phase in ("gen", "ref", "update"):
            got = s[f"memory/trainer_peak_{phase}_gb"]
            assert abs(model[phase] - got) < max(0.15 * got, 1.0), (s["command"], phase, got, model[phase])


def test_offloaded_optimizer_state_counts_in_the_step_only():
    """--offload-optimizer: the state is off the GPU while generating, and on it for the optimizer step, whose peak
    (weights + gradients + state + reference) stands even when the micro-batch's activations are small."""
    dims = bench.model_dims("qwen2_5_vl_3b")
    m = memory.memory_model(dims, offload_optimizer=True, mb_tokens=1024)
    p = m["parts"]
    assert m["gen"] == pytest.approx(p["weights"] + p["ref"])
    assert m["update"] >= p["weights"] + p["grads"] + p["optim"] + p["ref"] > p["optim"] > 20


@pytest.mark.parametrize("preset, kw, card", [
    ("qwen2_5_vl_7b", dict(lora_rank=64, precision="bf16"), 40),  # measured: fits an H200 capped to 40 GB
    ("qwen2_5_vl_7b", dict(lora_rank=64), 80),  # measured: fits 80 GB (40 GB was not tried in AMP)
    ("qwen3_vl_8b", dict(precision="bf16"), 140),  # measured: fits one H200
    ("qwen2_5_vl_3b", dict(), 140),  # measured on a whole H200 only
])
def test_smallest_card_holds_the_measured_cells(preset, kw, card):
    """The table's "(card)" for one GPU agrees with what ran: a measured cell is never put on a bigger card than the
    one it ran on, and the 8B in pure bf16, whose trainer alone took 133 GB in its update, not on a smaller one."""
    dims = bench.model_dims(preset)
    got = bench.smallest_card(memory.memory_model(dims, mb_tokens=11 * memory.TOKENS_PER_SAMPLE, **kw), dims, 1)
    assert got is not None and got <= card
    if preset == "qwen3_vl_8b":
        assert got == 140


def test_benchmarks_holds_every_computed_row_of_the_table():
    """BENCHMARKS.md "Memory cells" (README links it) holds `python -m benchmarks.bench table`'s computed rows (the
    30B-A3B's and Qwen3.5's among them): a change to the memory model or a preset shows here until that section's
    table is regenerated (tests/test_benchmarks_record.py: the whole table, measured rows too)."""
    rows = [r for r in bench.table([]).splitlines() if r.startswith(("| qwen", "| gemma4"))]
    doc = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "BENCHMARKS.md")).read()
    section = doc.split("\n## " + record.MEMORY + "\n", 1)[1].split("\n## ", 1)[0]
    assert any("qwen3_vl_30b_a3b" in r for r in rows) and any("gemma4_e2b" in r for r in rows)
    assert [r for r in rows if r not in section] == []


def test_qwen3_vl_30b_a3b_preset_and_its_easyr1_script():
    """Qwen3-VL-30B-A3B-Instruct: 31.07B parameters (the hub's 31.1B), each layer an FSDP unit of 128 experts
    (0.62B parameters gathered at once), a token's MLP 8 x 768 wide; LoRA adapts attention only. EasyR1's example
    (bf16 weights, bf16 AdamW, 8 GPUs) is the computed "bf16 (Kahan)" cell on 8 GPUs: it fits an 80 GB card."""
    dims = bench.model_dims("qwen3_vl_30b_a3b")
    assert dims["params"] / 1e9 == pytest.approx(31.07, rel=0.002) and dims["moe"]
    assert dims["layer_params"] == pytest.approx(2 * 2048 * 4096 + 2 * 2048 * 512 + 128 * (3 * 2048 * 768 + 2048))
    assert dims["inter"] == 8 * 768
    m = memory.memory_model(dims, precision="bf16", world=8, mb_tokens=11 * memory.TOKENS_PER_SAMPLE)
    assert bench.smallest_card(m, dims, 8) == 80
    dense_like = memory.memory_model({**dims, "moe": False}, lora_rank=64)  # MLP adapters would add to the state
    assert memory.memory_model(dims, lora_rank=64)["parts"]["optim"] < dense_like["parts"]["optim"]


def _recipe_config(tmp_path, precision=None, script="gpu_moe30b.sh"):
    """grpo.Config of a GPU recipe's (first) bench.py run (the flags as bash passes them, ${X:-default} as its
    default), and its preset."""
    import re
    import tyro
    import easyr1_config
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", script)
    text = open(here).read().replace("\\\n", " ")
    line = next(x.strip() for x in text.splitlines() if x.strip().startswith("run_bench "))
    words = [re.sub(r"\$\{\w+:-(\w+)\}", r"\1", w) for w in shlex.split(line.removesuffix(";;"))[4:]]
    i = words.index("--preset")
    preset = words[i + 1]
    del words[i:i + 2]
    if precision:
        words[words.index("--precision") + 1] = precision
    (tmp_path / "geo.parquet").touch()
    cfg = tyro.cli(grpo.Config, args=words, default=bench.defaults(str(tmp_path), "org/model",
                                                                  str(tmp_path / "geo.parquet")))
    easyr1_config.check(cfg, 1)
    return cfg, preset


def test_the_30b_recipe_fits_one_h200_by_the_memory_model(tmp_path):
    """benchmarks/gpu_moe30b.sh: the 30B-A3B with LoRA on a pure-bf16 base, the engine dropping its weights in its
    sleep (level 2, no reference model), 8 prompts x 8 x 512 tokens. By the memory model (BENCHMARKS.md: the 30B-A3B's
    "LoRA r64, bf16" row) the trainer holds 58.2 GiB while generating, beside the engine's 57.9 GiB of weights, its
    6 GiB KV cache and ~3 of activations and graphs: ~125 of an H200's ~139; the update needs ~80 with the engine
    asleep; vLLM's start-up check (gpu_memory_utilization x the card free) passes beside the trainer's weights.
    In AMP (LoRA on fp32 master weights) the same run stops before loading, naming the two GPUs it takes."""
    from common import UserError
    cfg, preset = _recipe_config(tmp_path)
    assert preset == "qwen3_vl_30b_a3b" and (cfg.lora_rank, cfg.precision, cfg.sleep_level) == (64, "bf16", 2)
    dims = bench.model_dims(preset)
    m = memory.memory_model(dims, **memory.config_mode(asdict(cfg), 1))
    card = 139.0  # GiB an H200 leaves to a process (140.4 less the CUDA context)
    engine = 2 * dims["params"] / memory.GIB + cfg.kv_cache_memory_gb + memory.ENGINE_LEAST_GIB - 1.5
    assert m["gen"] == pytest.approx(58.2, abs=0.1) and m["gen"] + engine == pytest.approx(125.1, abs=0.5)
    assert m["gen"] + engine < card - 10 and m["ref"] < m["update"] < 85
    assert (140.4 - m["gen"] - 1) > cfg.gpu_memory_utilization * 140.4  # vLLM's free-memory check at its start
    memory.check_fits(asdict(cfg), dims, 1, 140.4, f"--preset {preset}")
    cfg, _ = _recipe_config(tmp_path, precision="amp")
    with pytest.raises(UserError, match="it takes 2 such GPUs"):
        memory.check_fits(asdict(cfg), dims, 1, 140.4, f"--preset {preset}")


def test_gemma4_e2b_preset_is_the_hub_checkpoints_shape():
    """presets.py's gemma4_e2b: google/gemma-4-E2B-it's config.json as transformers reads it (its layer pattern, head
    sizes, shared key/value layers, double-wide MLP there, per-layer inputs, soft cap, towers), 5.10B parameters: the
    model card's 5.1B "with embeddings"; without its two embedding tables (0.40B + 2.35B per-layer inputs) 2.35B,
    the card's 2.3B "effective". Its hub name needs no download, with the hub's token ids."""
    import torch
    import families
    import presets
    from transformers import Gemma4ForConditionalGeneration
    cfg = presets.known_config("google/gemma-4-E2B-it")
    t = cfg.text_config
    assert (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id, t.eos_token_id) == (258880, 255999, 258882, 1)
    assert [i for i, k in enumerate(t.layer_types) if k == "full_attention"] == list(range(4, 35, 5))
    assert families.head_dims(t) == [256, 256, 256, 256, 512] * 7 and t.num_key_value_heads == 1
    assert t.num_kv_shared_layers == 20 and t.final_logit_softcapping == 30.0 and cfg.tie_word_embeddings
    assert t.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.25
    with torch.device("meta"):
        m = Gemma4ForConditionalGeneration(cfg)
    lm = m.model.language_model
    assert [lm.layers[i].mlp.gate_proj.weight.shape[0] for i in (14, 15)] == [6144, 12288]  # shared: double-wide
    assert m.model.vision_tower.config.num_hidden_layers == 16 and m.model.audio_tower.config.num_hidden_layers == 12
    total = presets.count_params(cfg)
    tables = lm.embed_tokens.weight.numel() + lm.embed_tokens_per_layer.weight.numel()
    assert total == sum(p.numel() for p in m.parameters()) == pytest.approx(5.10e9, rel=0.002)
    assert lm.embed_tokens_per_layer.weight.shape == (262144, 35 * 256)
    assert (total - tables) / 1e9 == pytest.approx(2.35, abs=0.01)
    assert bench.model_dims("gemma4_e2b")["params"] == total and not bench.too_big_for_disk("gemma4_e2b")


def test_gemma4_e2b_bench_folder_loads_as_a_gemma4_checkpoint(tmp_path):
    """bench.build_random_model's gemma4_e2b folder (without weights here: 10 GB in bf16; the GPU recipe writes them):
    AutoConfig reads the preset's config with the folder's tokenizer ids, data.load_processor gives Gemma 4's
    processor, which puts 256 image tokens between <|image> and <image|> for the bench's 512 x 512 picture (resized to
    768 x 768: 48 x 48 patches, pooled 3 x 3), and the engines stop at <eos> and <turn|>."""
    import families
    import presets
    from PIL import Image
    from transformers import AutoConfig
    path = bench.build_random_model(str(tmp_path / "e2b"), "gemma4_e2b", weights=False)
    cfg = AutoConfig.from_pretrained(path)
    assert presets.random_init(path) == {"preset": "gemma4_e2b", "seed": 0}
    assert presets.count_params(cfg) == bench.model_dims("gemma4_e2b")["params"]
    proc = data.load_processor(path, min_pixels=3136, max_pixels=512 * 512)
    tok = proc.tokenizer
    assert type(proc).__name__ == "Gemma4Processor" and cfg.image_token_id == tok.convert_tokens_to_ids("<|image|>")
    parquet = bench.make_geo_dataset(str(tmp_path / "geo.parquet"), 1, tok)
    rec = data.encode_prompt(data.load_rows(parquet)[0], proc, min_pixels=3136, max_pixels=512 * 512)
    ids = rec["prompt_ids"]
    assert ids.count(cfg.image_token_id) == 256 and ids[ids.index(cfg.image_token_id) - 1] == cfg.boi_token_id
    assert rec["mm_inputs"]["pixel_values"].shape[-2:] == (2520, 768)  # (padded to 280 x 9 patches of 16 x 16 x 3)
    assert families.special_token_ids(path) == ([tok.convert_tokens_to_ids(t) for t in ("<eos>", "<turn|>")],
                                                [cfg.image_token_id, cfg.video_token_id])


def test_the_gemma4_recipe_fits_one_h200_by_the_memory_model(tmp_path):
    """benchmarks/gpu_gemma4.sh e2b: the E2B shape in pure bf16, 16 prompts x 8 x 1024 tokens. By the memory model
    the trainer holds 45.8 GiB while generating beside the engine's 0.3 of the card (42 GiB: ~10 of weights, a KV
    cache far above the ~3 GiB the 128 samples need), and needs 84.8 in the update with the engine asleep: one H200
    holds it with room for the model's 15 % error; the run passes bench.py's check before loading."""
    cfg, preset = _recipe_config(tmp_path, script="gpu_gemma4.sh")
    assert preset == "gemma4_e2b" and (cfg.precision, cfg.rollout_batch_size, cfg.n) == ("bf16", 16, 8)
    assert (cfg.max_response_length, cfg.max_steps, cfg.gpu_memory_utilization) == (1024, 2, 0.3)
    dims = bench.model_dims(preset)
    m = memory.memory_model(dims, **memory.config_mode(asdict(cfg), 1))
    assert m["gen"] == pytest.approx(45.8, abs=0.1) and m["update"] == pytest.approx(84.8, abs=0.1)
    card = 139.0  # GiB an H200 leaves to a process
    assert 1.15 * m["gen"] + cfg.gpu_memory_utilization * 140.4 < card and 1.15 * m["update"] < card
    memory.check_fits(asdict(cfg), dims, 1, 140.4, f"--preset {preset}")


def test_phases_reads_the_gpu_log_inside_each_phase(tmp_path):
    """bench.py phases: the nvidia-smi rows that fall inside each phase's window (its stamped start and seconds),
    and, for a run without stamps, the phases laid back from its last busy second."""
    t0 = 1_800_000_000.0
    step = {"step": 1, "timing/step": 6.0, "timing/sync": 1.0, "timing/gen": 2.0, "timing/update": 3.0,
            "time/sync_start": t0, "time/gen_start": t0 + 1, "time/update_start": t0 + 3}
    (tmp_path / "m.jsonl").write_text(json.dumps(step) + "\n")
    rows = ["timestamp, index, clocks.current.sm [MHz], clocks.current.memory [MHz], temperature.gpu, "
            "power.draw [W], utilization.gpu [%], clocks_event_reasons.active"]
    for i in range(12):  # one row every half second: 2 in sync, 4 in generation, 6 in the update
        t = t0 + 0.25 + i / 2
        gen, upd = t0 + 1 <= t < t0 + 3, t >= t0 + 3
        sm, watts, util, why = (1500, 690.0, 100, 0x4) if upd else (1980, 400.0, 50, 0) if gen else (1980, 100.0, 0, 1)
        stamp = datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        rows.append(f"{stamp}, 0, {sm} MHz, 3201 MHz, 40, {watts:.2f} W, {util} %, 0x{why:016x}")
    idle = datetime.datetime.fromtimestamp(t0 + 6.25).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    rows.append(f"{idle}, 0, 1980 MHz, 3201 MHz, 40, 80.00 W, 0 %, 0x{1:016x}")  # the run has ended
    (tmp_path / "gpu.csv").write_text("\n".join(rows) + "\n")
    out = host_log.phases(str(tmp_path / "m.jsonl"), str(tmp_path / "gpu.csv")).splitlines()
    assert out[2:] == ["| 1 | sync | 1.0 | 1980 | 100 | 0 % | 0% | 0% |",
                       "| 1 | gen | 2.0 | 1980 | 400 | 50 % | 0% | 0% |",
                       "| 1 | update | 3.0 | 1500 | 690 | 100 % | 100% | 0% |"], out
    # the same run without its stamps: it ended between the last busy row and the next (t0 + 6), the rest laid back
    (tmp_path / "m.jsonl").write_text(json.dumps({k: v for k, v in step.items() if not k.startswith("time/")}))
    out = host_log.phases(str(tmp_path / "m.jsonl"), str(tmp_path / "gpu.csv")).splitlines()
    assert out[2:5] == ["| 1 | sync | 1.0 | 1980 | 100 | 0 % | 0% | 0% |",
                        "| 1 | gen | 2.0 | 1980 | 400 | 50 % | 0% | 0% |",
                        "| 1 | update | 3.0 | 1500 | 690 | 100 % | 100% | 0% |"], out
    assert "laid back" in out[-1]
    # a wrong call: one line, exit code 2
    for args in ([str(tmp_path / "m.jsonl")], [str(tmp_path / "m.jsonl"), str(tmp_path / "nope.csv")]):
        r = subprocess.run([sys.executable, "-m", "benchmarks.bench", "phases", *args], cwd=ROOT, capture_output=True,
                           text=True)
        assert r.returncode == 2 and r.stderr.startswith("error: usage: python -m benchmarks.bench phases") and \
            len(r.stderr.strip().splitlines()) == 1 and ("nope.csv: no such file" in r.stderr) == (len(args) == 2), r
    # with the host's log: its rows inside each phase, averaged; the busiest thread named by the most rows
    host = ["timestamp, cores_busy, steal_pct, cpu_mhz, proc_cpu_pct, top_thread_pct, top_thread, "
            "minor_faults_per_s, major_faults_per_s, compact_stalls"]
    for i in range(12):
        t = t0 + 0.25 + i / 2
        stamp = datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        who, pct = ("python", 100) if t0 + 1 <= t < t0 + 3 else ("pt_autograd_0", 40)
        host.append(f"{stamp}, {3.0 if who == 'python' else 9.0:.2f}, {2.0 if i == 2 else 0.0:.1f}, 2600, {pct}, {pct}, "
                    f"{who}, {100 * i}, 1, 0")
    (tmp_path / "host.csv").write_text("\n".join(host) + "\n")
    (tmp_path / "m.jsonl").write_text(json.dumps(step) + "\n")
    out = host_log.phases(str(tmp_path / "m.jsonl"), str(tmp_path / "gpu.csv"), str(tmp_path / "host.csv")).splitlines()
    assert out[0].endswith("| busy cores | stolen | busiest thread | page faults/s |") and out[1].count("---") == 12
    # (rows 0-1 in sync, 2-5 in generation, 6-11 in the update; faults 100 i minor + 1 major a second)
    assert [line.split("|")[-5:-1] for line in out[2:]] == [[" 9.0 ", " 0.0 % ", " 40 % (pt_autograd_0) ", " 51 "],
                                                            [" 3.0 ", " 0.5 % ", " 100 % (python) ", " 351 "],
                                                            [" 9.0 ", " 0.0 % ", " 40 % (pt_autograd_0) ", " 851 "]], out


def test_host_log_finds_the_run_and_its_busiest_thread(tmp_path):
    """benchmarks/host_log.py: the process whose command line holds the pattern, its busiest thread's share of a
    core (a Python busy loop: most of one), its page faults (it maps fresh memory), the machine's busy cores; another
    pattern: no process, 0 %."""
    # a busy loop that maps fresh memory (page faults) as it goes
    loop = ("import mmap, time\nx = b'x' * 4_000_000\nend = time.time() + 3\nwhile time.time() < end:\n"
            "    m = mmap.mmap(-1, len(x))\n    m[:] = x\n    m.close()\n")
    busy = subprocess.Popen([sys.executable, "-c", loop, "--output-dir", str(tmp_path / "probe_run")])
    logs = [subprocess.Popen([sys.executable, os.path.join(os.path.dirname(bench.__file__), "host_log.py"),
                              str(tmp_path / f"{name}.csv"), pattern, "0.25"])
            for name, pattern in (("mine", f"--output-dir {tmp_path / 'probe_run'}"), ("none", "no such run"))]
    time.sleep(2.0)
    for p in logs:
        p.kill()
    busy.wait()
    rows = [line.split(", ") for line in (tmp_path / "mine.csv").read_text().splitlines()]
    assert rows[0] == ["timestamp", "cores_busy", "steal_pct", "cpu_mhz", "proc_cpu_pct", "top_thread_pct",
                       "top_thread", "minor_faults_per_s", "major_faults_per_s", "compact_stalls"] and len(rows) >= 5
    assert all(len(r) == 10 and int(r[9]) >= 0 for r in rows[1:]) and max(float(r[7]) for r in rows[2:]) > 1000, rows
    assert max(float(r[5]) for r in rows[1:]) >= 60 and all(r[6].startswith("python") for r in rows[2:]), rows
    assert all(float(r[1]) >= 0.5 for r in rows[2:]), rows  # (the busy loop's core at least)
    none = [line.split(", ") for line in (tmp_path / "none.csv").read_text().splitlines()[1:]]
    assert none and all(r[4:8] == ["0", "0", "-", "0"] for r in none), none


@pytest.mark.parametrize("R", [16384, 32768])
def test_the_long_answer_recipe_fits_one_h100_by_the_memory_model(R, tmp_path):
    """benchmarks/gpu_long.sh 16k / 32k: the Qwen3-4B shape, 16 prompts x 4 forced answers of R tokens, pure bf16, one
    sample a micro-batch. By the memory model, grown by its 15 % error, the trainer beside the engine's share and the
    update fit an H100 (79 GiB to a process); vLLM takes as many sequences as its KV cache holds whole."""
    import tyro
    recipe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "gpu_long.sh")
    flags = subprocess.run(["bash", "-c", f'eval "$(sed -n "/^shape()/,/^}}/p" {recipe})"; P=16; shape {R}'],
                           capture_output=True, text=True, check=True).stdout.split()
    i = flags.index("--preset")
    preset = flags[i + 1]
    del flags[i:i + 2]
    (tmp_path / "geo.parquet").touch()
    cfg = tyro.cli(grpo.Config, args=flags, default=bench.defaults(str(tmp_path), "org/model",
                                                                   str(tmp_path / "geo.parquet")))
    assert preset == "qwen3_4b" and (cfg.rollout_batch_size, cfg.n, cfg.max_response_length) == (16, 4, R)
    dims = bench.model_dims(preset)
    c = asdict(cfg)
    assert memory.config_mode(c, 1)["mb_tokens"] == memory.PROMPT_TOKENS + R  # one sample a micro-batch
    layers = memory.auto_checkpoint_layers(c, dims, 1, 79.0)
    m = memory.memory_model(dims, **memory.config_mode({**c, "checkpoint_layers": layers}, 1))
    assert 1.15 * m["gen"] + cfg.gpu_memory_utilization * 79.6 < 79.0 and 1.15 * m["update"] < 79.0
    memory.check_fits(c, dims, 1, 79.6, f"--preset {preset}")
    seqs = memory.engine_max_seqs(c, dims, 79.6)
    assert 1 <= seqs < cfg.rollout_batch_size * cfg.n
