"""VLLMRollout composes a Qwen-VL request's input from its pictures' (rollout.VLLMRollout._add); here against vLLM's own
processing of the whole request, with vLLM's real renderer (no engine, no GPU: its CPU platform where CUDA is absent),
for every Qwen-VL family. Needs vLLM installed (skipped otherwise; the CPU suite has a stand-in's test in
tests/test_rollout.py):

    pip install vllm && python -m pytest tests/test_vllm_compose.py
"""
import types
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import data
import rollout
import tiny_model
from families import QWEN_VL


@pytest.fixture(scope="module")
def vllm():
    vllm = pytest.importorskip("vllm")
    rollout._set_vllm_env()
    if not torch.cuda.is_available():
        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform
        vllm.platforms._current_platform = CpuPlatform()  # (no CUDA: vLLM would find no platform)
    return vllm


@pytest.mark.parametrize("arch", QWEN_VL)
def test_composed_inputs_are_vllms_own_and_the_trainers(vllm, arch):
    """Prompts of two pictures each, of four sizes: each composed input has vLLM's ids and placeholder ranges for the
    whole request and the trainer's prompt_ids; no warning (a difference would switch composing off)."""
    from transformers import AutoConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor
    path = tiny_model.build_tiny_model(arch=arch)
    cfg = EngineArgs(model=path, load_format="dummy", enforce_eager=True, max_model_len=4096, mm_processor_cache_gb=0,
                     limit_mm_per_prompt={"image": 2}).create_engine_config()  # (VLLMRollout's, cache off)
    renderer, got = InputProcessor(cfg).renderer, []
    eng = object.__new__(rollout.VLLMRollout)
    eng.llm = types.SimpleNamespace(renderer=renderer, _render_and_add_requests=lambda prompts, params: got.extend(
        prompts) or [])
    eng.pad, eng.limit, eng.pieces, eng.model_type, eng.version, eng.keys = (
        AutoConfig.from_pretrained(path).image_token_id, 2, {}, arch, vllm.__version__, {})
    proc, rng, recs = data.load_processor(path), np.random.default_rng(0), []
    for i in range(4):
        pics = [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((56 + 28 * i, 84, 3),
                                                                                         (112, 56 + 28 * i, 3))]
        row = {"problem": "<image>What is it? Then <image> and this.", "answer": "x", "images": pics}
        recs.append(data.encode_prompt(row, proc, min_pixels=56 * 56, max_pixels=112 * 112))
    reqs = [eng._vllm_prompt(r) for r in recs]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*unlike VLLMRollout._compose")
        eng._add(reqs, None)
    assert eng.pad is not None and len(got) == len(reqs) and all(g.get("type") == "multimodal" for g in got)
    for g, want, rec in zip(got, renderer.render_cmpl(reqs), recs):
        assert [g[k] for k in rollout._COMPOSED] == [want[k] for k in rollout._COMPOSED]
        assert g["prompt_token_ids"] == rec["prompt_ids"]
        assert len(g["mm_kwargs"]["image"]) == 2 and len(set(g["mm_hashes"]["image"])) == 2
