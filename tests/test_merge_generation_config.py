"""merge.py keeps the checkpoint's generation config as it is: Qwen3 lists two end tokens (<|im_end|> for a chat turn,
<|endoftext|>) and its sampling defaults; a merged folder that lost the list would generate past the end of a turn.
(EasyR1 fixed the same in its merger, commit b44b311.)"""
import json
import os

import pytest
import torch

import fsdp_actor as actor
import merge
import rollout
import rundir
import tiny_model

LORA = dict(lora_rank=4, lora_alpha=8, lora_target_modules="all-linear", lora_exclude_modules=".*visual.*")


@pytest.mark.parametrize("lora", [False, True])
def test_merged_folder_keeps_the_generation_config(tmp_path, lora):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "base"), arch="qwen3")
    ids = json.load(open(os.path.join(path, "generation_config.json")))["eos_token_id"]
    assert len(ids) == 2  # <|im_end|>, <|endoftext|>, as Qwen3's
    # Qwen3's file (written by an older transformers), with our tiny model's ids
    qwen3 = {"bos_token_id": ids[1], "do_sample": True, "eos_token_id": ids, "pad_token_id": ids[1],
             "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(qwen3, f, indent=2)
    lora_kw = dict(r=4, alpha=8, target_modules="all-linear", exclude_modules=".*visual.*") if lora else None
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32, lora=lora_kw)
    opt, sched = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    ckpt = str(tmp_path / "ckpt" / "step_1")
    os.makedirs(os.path.dirname(ckpt))
    rundir.save_checkpoint(ckpt, model, opt, sched, {"step": 1, "cursor": 0, "compute_dtype": "bfloat16",
                                                     "config": {"model_path": path, **(LORA if lora else {})}})
    out = merge.merge(ckpt, str(tmp_path / "hf"))
    assert open(os.path.join(out, "generation_config.json")).read() == \
        open(os.path.join(path, "generation_config.json")).read()
    assert rollout.special_token_ids(out)[0] == ids  # both engines stop at either end token
