"""Video inputs end to end on the CPU: the data contract (videos column, <video> placeholders, frames or files), the
processor outputs the model needs (frames, second_per_grid_ts, Qwen3-VL's timestamps), the HF engine, the trainer's
log-probs against a plain HF forward (padded and padding-free), for the tiny Qwen2.5-VL, Qwen3-VL and Qwen2-VL."""
import io

import pytest
import torch
from PIL import Image

import data
import fsdp_actor as actor
import tiny_model

PX = dict(min_pixels=56 * 56, max_pixels=112 * 112)
COLOURS = ["red", "green", "blue", "white"]


def clip(first, last, n=4, size=(64, 60)):
    """n frames: the first half one colour, the rest another."""
    return [Image.new("RGB", size, tiny_model.COLORS[first if i < n // 2 else last]) for i in range(n)]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen2_vl"])
def arch(request, tmp_path_factory):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path_factory.mktemp(request.param) / "m"), arch=request.param)
    return request.param, path, data.load_processor(path, **PX)


def video_rows():
    img = Image.new("RGB", (70, 70), tiny_model.COLORS["green"])
    return [
        {"problem": "<video>Which colour does the video end with?", "answer": "blue", "videos": [clip("red", "blue")]},
        {"problem": "<image> then <video> and <video>: which?", "answer": "red", "images": [img],
         "videos": [clip("white", "red", n=6), clip("blue", "green", n=3)]},
        {"problem": "Name a colour.", "answer": "red"},
    ]


def video_prompts(proc):
    """video_rows() encoded, the second at 0.5 frames per second (its time positions differ from the default 2)."""
    return [data.encode_prompt(r, proc, video_fps=f, **PX) for r, f in zip(video_rows(), (2.0, 0.5, 2.0))]


def samples_of(prompts, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [dict(prompt=p, response_ids=torch.randint(3, 300, (1 + (3 * i + k) % 5,), generator=g).tolist())
            for i, p in enumerate(prompts) for k in range(n)]


# ------------------------------------------------------------------------------------------------ the data contract
def test_placeholders_must_match_the_videos(arch):
    _, _, proc = arch
    frames = clip("red", "blue")
    rows = [{"problem": "<video><video>Which?", "answer": "a", "videos": [frames]},  # 2 placeholders, 1 video
            {"problem": "<video>Which?", "answer": "a"},  # a placeholder, no video
            {"problem": "<video>Which?", "answer": "a", "videos": [frames]},  # fine
            {"problem": "Which colour?", "answer": "a", "videos": [frames]},  # fine: the video goes first
            {"problem": "<video>Which?", "answer": "a", "videos": [[]]},  # a video without frames
            {"problem": "<video>Which?", "answer": "a", "videos": [["no/such/frame.png"]]}]
    problems = data.check_rows(rows, proc, **PX)
    assert [(i, k) for i, k, _ in problems] == [(0, data.VIDEO_PLACEHOLDERS), (1, data.VIDEO_PLACEHOLDERS),
                                                (4, data.BAD_VIDEO), (5, data.BAD_VIDEO)]
    assert "2 '<video>' placeholder(s) but 1 videos" in problems[0][2]
    assert "image file not found" in problems[3][2] and "video 0" in problems[3][2]
    rec = data.encode_prompt(rows[3], proc, **PX)
    text = proc.tokenizer.decode(rec["raw_prompt_ids"])
    assert text.index("<|video_pad|>") < text.index("Which colour?")


def test_data_check_command_names_bad_video_rows(tmp_path, capsys):
    import datasets
    pngs = []
    for im in clip("red", "blue"):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        pngs.append({"bytes": buf.getvalue(), "path": None})
    rows = {"problem": ["<video>Which?", "<video> and <video>?", "Which?"], "answer": ["blue", "a", "b"],
            "videos": [[pngs], [pngs], [pngs, pngs]]}
    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "videos": datasets.List(datasets.List(datasets.Image()))})
    path = str(tmp_path / "v.parquet")
    datasets.Dataset.from_dict(rows, features=features).to_parquet(path)
    assert data.check_main(["--train-files", path, "--max-prompt-length", "4096"]) == 2
    out = capsys.readouterr().out
    assert "row 1: placeholders != videos: 2 '<video>' placeholder(s) but 1 videos" in out
    assert "row 0" not in out and "row 2" not in out and "1 bad" in out


# ------------------------------------------------------------------------------------------- frames, fps, the model
def test_frames_and_time_reach_the_model(arch):
    name, path, proc = arch
    row = {"problem": "<video>Which colour does the video end with?", "answer": "blue", "videos": [clip("red", "blue")]}
    fast, slow = (data.encode_prompt(row, proc, video_fps=f, **PX) for f in (2.0, 0.5))
    assert fast["video_fps"] == [2.0] and slow["video_fps"] == [0.5] and len(fast["videos"][0]) == 4
    # the frames themselves: the last merged patch of the first frame pair is red, of the second blue
    mean, std = torch.tensor(proc.image_processor.image_mean), torch.tensor(proc.image_processor.image_std)
    px = fast["mm_inputs"]["pixel_values_videos"]  # [T/2 * h * w, C * 2 * p * p]
    per_t = px.shape[0] // 2
    for t, colour in ((0, "red"), (1, "blue")):
        rgb = px[t * per_t].view(3, -1)[:, 0] * std + mean  # channel values of one pixel, back in [0, 1]
        assert torch.allclose(rgb * 255, torch.tensor(tiny_model.COLORS[colour], dtype=torch.float), atol=1.0)
    # Qwen2.5-VL bounds a frame (56x56, 14-pixel patches), Qwen3-VL the clip (4 frames x 32x32, 16-pixel patches)
    assert fast["mm_inputs"]["video_grid_thw"].tolist() == [[2, 2, 2] if name == "qwen3_vl" else [2, 4, 4]]
    hf = actor.load_hf_model(path).eval()
    pos = {f: actor._rope_index(hf, r["prompt_ids"], r["mm_inputs"]) for f, r in ((2.0, fast), (0.5, slow))}
    if name == "qwen2_5_vl":  # the time axis counts tokens_per_second (2) x the seconds of a frame pair
        assert fast["mm_inputs"]["second_per_grid_ts"].tolist() == [1.0]
        assert slow["mm_inputs"]["second_per_grid_ts"].tolist() == [4.0]
        assert fast["prompt_ids"] == slow["prompt_ids"]
        vid = torch.tensor(fast["prompt_ids"]) == hf.config.video_token_id
        t_fast, t_slow = pos[2.0][0][vid], pos[0.5][0][vid]
        assert (t_fast[per_t // 4:] - t_fast[0]).unique().tolist() == [2]  # second pair: 1 s x 2 later
        assert (t_slow[per_t // 4:] - t_slow[0]).unique().tolist() == [8]  # 4 s x 2 later
    elif name == "qwen2_vl":  # Qwen2-VL's time axis counts frame pairs, whatever their rate
        assert "second_per_grid_ts" not in fast["mm_inputs"]
        vid = torch.tensor(fast["prompt_ids"]) == hf.config.video_token_id
        assert torch.equal(pos[2.0][:, vid], pos[0.5][:, vid])
        assert (pos[2.0][0][vid][per_t // 4:] - pos[2.0][0][vid][0]).unique().tolist() == [1]
    else:  # Qwen3-VL: each frame pair's time is text before it; pairs 0.25 s and 1.25 s (fps 2), 1 s and 5 s
        tok = proc.tokenizer
        assert "<0.2 seconds>" in tok.decode(fast["prompt_ids"]) and "<1.2 seconds>" in tok.decode(fast["prompt_ids"])
        assert "<1.0 seconds>" in tok.decode(slow["prompt_ids"]) and "<5.0 seconds>" in tok.decode(slow["prompt_ids"])
    # more frames than --max-frames: evenly spread, and further apart in time
    long = dict(row, videos=[clip("red", "blue", n=10)])
    rec = data.encode_prompt(long, proc, video_fps=2.0, max_frames=4, **PX)
    assert rec["videos"][0].shape[0] == 4 and rec["video_fps"] == [2.0 * 4 / 10]
    assert len(rec["prompt_ids"]) == data.prompt_length(long, proc, video_fps=2.0, max_frames=4, **PX)


def write_video(path, frames, fps):
    import av
    with av.open(str(path), "w") as out:
        s = out.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        s.options = {"qscale": "1"}  # near lossless: the colours survive
        for im in frames:
            for pkt in s.encode(av.VideoFrame.from_image(im)):
                out.mux(pkt)
        for pkt in s.encode():
            out.mux(pkt)


def test_video_file_rows(arch, tmp_path, monkeypatch):
    pytest.importorskip("av")
    _, _, proc = arch
    write_video(tmp_path / "clip.mp4", clip("red", "blue", n=8, size=(64, 64)), fps=4)
    row = {"problem": "<video>Which colour does the video end with?", "answer": "blue", "videos": ["clip.mp4"]}
    rec = data.encode_prompt(row, proc, image_dir=str(tmp_path), video_fps=2.0, **PX)
    v = rec["videos"][0]  # 8 frames at 4 per second, sampled at 2 per second: 4 frames (0, 2, 5, 7)
    assert v.shape[0] == 4 and rec["video_fps"] == [2.0]
    first, last = v[0].reshape(-1, 3).mean(0), v[-1].reshape(-1, 3).mean(0)
    assert abs(first - torch.tensor(tiny_model.COLORS["red"]).numpy()).max() < 12
    assert abs(last - torch.tensor(tiny_model.COLORS["blue"]).numpy()).max() < 12
    assert len(rec["prompt_ids"]) == data.prompt_length(row, proc, image_dir=str(tmp_path), **PX)
    # without PyAV: the row is bad, and the message says what to install
    monkeypatch.setitem(__import__("sys").modules, "av", None)
    problems = data.check_rows([row], proc, image_dir=str(tmp_path), **PX)
    assert problems[0][1] == data.BAD_VIDEO and "pip install av" in problems[0][2]


# ------------------------------------------------------------------------------------------------ engine and trainer
def test_hf_engine_generates_from_video_and_agrees_with_the_trainer(arch):
    import rollout
    name, path, proc = arch
    prompts = video_prompts(proc)
    eng = rollout.HFRollout(path, device="cpu", dtype=torch.float32)
    out = eng.generate(prompts, n=3, temperature=1.0, top_p=1.0, max_tokens=6, seeds=[1, 2, 3])
    samples = [dict(prompt=p, response_ids=o["response_ids"], logprobs=o["logprobs"]) for p, g in zip(prompts, out)
               for o in g]
    assert all(len(s["response_ids"]) > 0 and len(s["logprobs"]) == len(s["response_ids"]) for s in samples)
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False).eval()
    lps, _ = actor.compute_logprobs(model, samples, proc.tokenizer.pad_token_id, torch.device("cpu"), 1.0,
                                    max_tokens=10_000, max_samples=4)
    for s, lp in zip(samples, lps):
        assert torch.allclose(lp.double(), torch.tensor(s["logprobs"], dtype=torch.float64), atol=1e-4)
    # the video matters: another clip changes the engine's distribution
    other = data.encode_prompt(dict(video_rows()[0], videos=[clip("white", "green")]), proc, **PX)
    a = eng.generate([prompts[0], other], n=1, temperature=1.0, top_p=1.0, max_tokens=1, seeds=[5, 5])
    assert a[0][0]["response_ids"] != a[1][0]["response_ids"] or a[0][0]["logprobs"] != a[1][0]["logprobs"]


def test_trainer_logprobs_match_a_plain_hf_forward(arch):
    from test_actor import reference_logprobs
    _, path, proc = arch
    samples = samples_of(video_prompts(proc))
    ref = reference_logprobs(path, samples, proc.tokenizer.pad_token_id)
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, gradient_checkpointing=False).eval()
    for max_tokens in (10_000, 60):  # everything in one micro-batch, and one prompt per micro-batch
        lps, _ = actor.compute_logprobs(model, samples, proc.tokenizer.pad_token_id, torch.device("cpu"), 1.0,
                                        max_tokens=max_tokens, max_samples=4)
        for a, b in zip(lps, ref):
            assert a.shape == b.shape and torch.allclose(a.double(), b, atol=2e-5), (a, b)


def test_padding_free_equals_padded_for_video_rows(arch):
    from test_varlen import _grads
    """Packed rows (Qwen3-VL: its timestamps and deepstack too), and packed rows that hold each prompt once."""
    name, path, proc = arch
    samples = samples_of(video_prompts(proc))
    assert len({id(s["prompt"]) for s in samples}) < len(samples)  # prompts with several samples: shared below
    lp_pad, g_pad = _grads(path, samples, proc.tokenizer.pad_token_id, False, torch.float64)
    lp_pack, g_pack = _grads(path, samples, proc.tokenizer.pad_token_id, True, torch.float64)
    lp_share, g_share = _grads(path, samples, proc.tokenizer.pad_token_id, True, torch.float64, share=True)
    for a, b, c in zip(lp_pad, lp_pack, lp_share, strict=True):
        assert torch.allclose(a, b, atol=1e-10) and torch.allclose(a, c, atol=1e-10)
    assert g_pad.keys() == g_pack.keys() == g_share.keys()
    for k in g_pad:
        assert torch.allclose(g_pad[k], g_pack[k], atol=1e-9), k
        assert (g_share[k] - g_pad[k]).abs().max() <= 1e-6 * g_pad[k].abs().max(), k  # (RMSNorm's fp32 rounding)


def test_vllm_requests_carry_the_frames_and_their_rate(arch):
    """What vLLM is handed (checked against vLLM itself in tests/test_video_gpu.py): one pad per video, the trainer's
    frames, their frame rate where each model's vLLM processor reads it."""
    import rollout
    name, _, proc = arch
    rec = video_prompts(proc)[1]  # an image, then clips of 6 and 3 (padded to 4) frames at 0.5 frames per second
    eng = object.__new__(rollout.VLLMRollout)
    eng.model_type = name
    req = rollout.VLLMRollout._vllm_prompt(eng, rec)
    assert req["prompt_token_ids"] == rec["raw_prompt_ids"]
    assert req["multi_modal_uuids"] == {"image": [eng._image_key(im) for im in rec["images"]]}  # (the videos: vLLM's)
    assert req["prompt_token_ids"].count(proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")) == 2
    assert req["multi_modal_data"]["image"] == rec["images"]
    videos, sizes = req["multi_modal_data"]["video"], (6, 4)
    if name == "qwen3_vl":
        assert [m for _, m in videos] == [{"total_num_frames": t, "fps": 0.5, "frames_indices": list(range(t)),
                                           "duration": t / 0.5, "do_sample_frames": False} for t in sizes]
        videos = [v for v, _ in videos]
    else:
        assert req["mm_processor_kwargs"] == {"video_metadata": [{"total_num_frames": t, "fps": 0.5} for t in sizes]}
    assert all(v is w and v.dtype.name == "uint8" for v, w in zip(videos, rec["videos"]))
    assert [len(v) for v in videos] == list(sizes)


@pytest.mark.parametrize("seconds, times", [(1.0, [3, 5]), (2 / 3, [3, 4, 5])])
def test_qwen2_5_vl_positions_after_a_video_follow_the_reference(seconds, times):
    """By hand: 3 text tokens, a video of t x 4 x 4 patches (2 x 2 tokens per grid step, tokens_per_second 2), 2 text
    tokens. The video's time positions are start + int(i * seconds * 2); the text after goes on from the largest
    position + 1, as the Qwen reference and vLLM 0.26 place it (on the H200 its positions for such a prompt were these,
    tests/test_video_gpu.py); transformers 5.x's own get_rope_index restarts it at start + 2, under the video."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    hf = actor.load_hf_model(tiny_model.build_tiny_model())
    cfg, t = hf.config, len(times)
    ids = [1, 2, 3] + [cfg.video_token_id] * (t * 4) + [4, 5]
    mm = {"video_grid_thw": torch.tensor([[t, 4, 4]]), "second_per_grid_ts": torch.tensor([seconds])}
    got = actor._rope_index(hf, ids, mm)  # what the trainer uses: load_hf_model put the reference rule in place
    after = times[-1] + 1  # (the spatial positions end at 4)
    video_t = [x for x in times for _ in range(4)]
    assert got.tolist() == [[0, 1, 2] + video_t + [after, after + 1],
                            [0, 1, 2] + [3, 3, 4, 4] * t + [after, after + 1],
                            [0, 1, 2] + [3, 4, 3, 4] * t + [after, after + 1]]
    kw = dict(input_ids=torch.tensor([ids]), **mm, **actor.mm_token_types(hf, torch.tensor([ids]), mm))
    theirs = Qwen2_5_VLModel.get_rope_index(hf.model, **kw)[0][:, 0]
    assert theirs[0, -2].item() == 5  # transformers' rule (the reason for ours): below the video's last time position


def test_reference_positions_equal_transformers_for_images(arch):
    """Without videos the two rules agree: the replacement changes only what follows a video."""
    name, path, proc = arch
    if name == "qwen3_vl":
        pytest.skip("Qwen3-VL keeps transformers' rule (its frames are separated by timestamps)")
    hf = actor.load_hf_model(path)
    row = {"problem": "<image>and<image>Which?", "answer": "red",
           "images": [Image.new("RGB", (70, 84), (1, 2, 3)), Image.new("RGB", (112, 56), (4, 5, 6))]}
    rec = data.encode_prompt(row, proc, **PX)
    ids = torch.tensor([rec["prompt_ids"]])
    kw = dict(input_ids=ids, image_grid_thw=rec["mm_inputs"]["image_grid_thw"],
              **actor.mm_token_types(hf, ids, rec["mm_inputs"]))
    ours = hf.model.get_rope_index(**kw)[0]
    theirs = type(hf.model).get_rope_index(hf.model, **kw)[0]
    assert hf.model.get_rope_index.__func__ is not type(hf.model).get_rope_index  # the replacement is in place
    assert torch.equal(ours, theirs)
