import json
import os
import time

import pytest
import torch

import data
import presets
import tiny_model


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return tiny_model.build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


def test_build_writes_a_complete_hf_folder(tiny_path):
    files = set(os.listdir(tiny_path))
    for f in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "chat_template.jinja", "preprocessor_config.json",
              "video_preprocessor_config.json", tiny_model.MARKER]:
        assert f in files, f
    cfg = json.load(open(os.path.join(tiny_path, "config.json")))
    text = cfg["text_config"]
    assert text["vocab_size"] % 64 == 0
    assert text["hidden_size"] == 128 and text["num_hidden_layers"] == 2
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert sum(text["rope_parameters"]["mrope_section"]) * 2 == head_dim
    assert cfg["vision_config"]["out_hidden_size"] == text["hidden_size"]
    pre = json.load(open(os.path.join(tiny_path, "preprocessor_config.json")))
    assert pre["processor_class"] == "Qwen2_5_VLProcessor"
    assert pre["max_pixels"] == 112 * 112


def test_reload_and_generate(tiny_path):
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(tiny_path, dtype=torch.float32).eval()
    assert next(model.parameters()).dtype == torch.float32
    assert not model.config.tie_word_embeddings
    proc = data.load_processor(tiny_path)  # AutoProcessor, or the no-torchvision fallback
    img, _, _ = tiny_model.draw_color_image(__import__("random").Random(0))
    rec = data.encode_prompt({"problem": "<image>What is the color of the shape?",
                              "answer": "red", "images": [img]}, proc,
                             min_pixels=56 * 56, max_pixels=112 * 112)
    n_img = rec["prompt_ids"].count(proc.image_token_id)
    assert 4 <= n_img <= 16
    ids = torch.tensor([rec["prompt_ids"]])  # [1, T]
    # transformers 5 needs mm_token_type_ids to build the M-RoPE positions (1 = image token)
    mm_type = (ids == proc.image_token_id).long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             mm_token_type_ids=mm_type, **rec["mm_inputs"],
                             max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_color_words_are_single_tokens(tiny_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_path)
    for w in list(tiny_model.COLORS) + ["shape", "answer"]:
        assert len(tok.encode(w, add_special_tokens=False)) == 1, w
        assert len(tok.encode(" " + w, add_special_tokens=False)) == 1, w
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in tiny_model.SPECIAL_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [tok.convert_tokens_to_ids(t)]


def test_second_build_is_a_cache_hit(tiny_path):
    marker = os.path.join(tiny_path, tiny_model.MARKER)
    mtime = os.path.getmtime(marker)
    t0 = time.time()
    assert tiny_model.build_tiny_model(tiny_path) == tiny_path
    assert time.time() - t0 < 0.5
    assert os.path.getmtime(marker) == mtime


def test_half_written_folder_is_rebuilt(tmp_path):
    out = tmp_path / "half"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a crashed build: files but no marker
    path = tiny_model.build_tiny_model(str(out), arch="qwen2")
    assert os.path.isfile(os.path.join(path, tiny_model.MARKER))
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # temp dir cleaned up
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    tok = AutoTokenizer.from_pretrained(path)
    rec = data.encode_prompt({"problem": "What color is the sky?", "answer": "blue"}, tok)
    assert rec["prompt_ids"] == rec["raw_prompt_ids"] and rec["mm_inputs"] == {}


def test_qwen2_vl_arch(tmp_path):
    from transformers import AutoModelForImageTextToText
    path = tiny_model.build_tiny_model(str(tmp_path / "q2vl"), arch="qwen2_vl")
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert type(data.load_processor(path)).__name__ == "Qwen2VLProcessor"


def test_preset_config_parameter_counts():
    tok = tiny_model.build_tokenizer()
    ids = tiny_model._token_ids(tok)
    cfg3 = presets.preset_config("qwen2_5_vl_3b", ids)
    assert cfg3.text_config.vocab_size == 151936 and cfg3.text_config.tie_word_embeddings
    n3 = presets.count_params(cfg3)  # meta device: nothing allocated
    assert 3.6e9 < n3 < 3.9e9, n3  # Qwen2.5-VL-3B: ~3.75B incl. the 0.67B ViT
    n7 = presets.count_params(presets.preset_config("qwen2_5_vl_7b", ids))
    assert 8.1e9 < n7 < 8.5e9, n7  # Qwen2.5-VL-7B: ~8.29B
    with pytest.raises(ValueError, match="unknown preset"):
        presets.preset_config("qwen2_5_vl_13b", ids)  # no such model
