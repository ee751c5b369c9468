"""merge.py -- turn a training checkpoint into a Hugging Face model folder you can load, serve or upload.

    python merge.py outputs/demo/checkpoints/step_150 outputs/demo/hf
    python merge.py outputs/run/checkpoints/step_60 outputs/run/hf --model-path Qwen/Qwen2.5-VL-7B-Instruct --dtype float32

With --adapter-only, the checkpoint of a LoRA run becomes a peft adapter folder (PeftModel.from_pretrained(base,
folder) loads it). Only the model's tensors are read from the sharded checkpoint (not the optimizer state); no process
group and no GPU are needed, whatever the number of ranks that saved it.

The default dtype is the policy's compute dtype (trainer_state.json: bfloat16 on GPUs, float32 on the CPU): the fp32
master weights cast as for every forward, the model that generated the rollouts; --dtype float32 keeps the masters."""
import json
import os
import shutil
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.distributed.checkpoint as dcp
import tyro

import fsdp_actor as actor
import memory
import tiny_families
import tiny_model
import tools

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class Args:
    checkpoint: Annotated[str, tyro.conf.Positional]  # e.g. outputs/demo/checkpoints/step_150
    output: Annotated[str, tyro.conf.Positional]  # the HF folder to write
    model_path: str | None = None  # the base model; default: the one recorded in the checkpoint
    dtype: Literal["bfloat16", "float16", "float32"] | None = None  # default: the compute dtype of the run
    adapter_only: bool = False  # a LoRA checkpoint as a peft adapter folder instead of a dense model


def trained_dtype(checkpoint):
    """The compute dtype recorded by grpo.py; float32 (the master weights, lossless) for older checkpoints."""
    state = json.load(open(os.path.join(checkpoint, "trainer_state.json")))
    return state.get("compute_dtype", "float32")


def base_model_path(checkpoint, model_path=None):
    if model_path:
        return model_path
    state = json.load(open(os.path.join(checkpoint, "trainer_state.json")))
    path = state.get("config", {}).get("model_path")
    if not path:  # the demo: the tiny model (of --demo-model; the zoom demo's has its call token) built in code
        path = tiny_model.build_tiny_model(arch=state["config"].get("demo_model", "qwen2_5_vl"), extra_tokens=[
            tools.ZOOM_CALL] if state["config"].get("demo_task") == "zoom" else ())
    return path


def merge(checkpoint, output, model_path=None, dtype=None, adapter_only=False):
    if not os.path.exists(os.path.join(checkpoint, ".metadata")):
        raise FileNotFoundError(f"{checkpoint}: not a checkpoint folder (no .metadata); pass checkpoints/step_N")
    path = base_model_path(checkpoint, model_path)
    hf = actor.load_hf_model(path, dtype=torch.float32)
    cfg = json.load(open(os.path.join(checkpoint, "trainer_state.json"))).get("config", {})
    lora = cfg.get("lora_rank", 0) > 0
    if lora:  # the checkpoint holds the adapters only: rebuild them on the base model, then read them in
        peft_model = memory.add_lora(hf, cfg["lora_rank"], cfg["lora_alpha"], cfg["lora_target_modules"],
                                cfg["lora_exclude_modules"], cfg.get("lora_modules_to_save", ""),
                                cfg.get("lora_target_experts", False))
    elif adapter_only:
        raise ValueError(f"{checkpoint}: --adapter-only needs a LoRA checkpoint (trained with --lora-rank > 0)")
    # the saved names are those of the FSDP root, fsdp_actor.LogProbModel: "hf." + the HF names
    state = {"model": {"hf." + k: v for k, v in hf.state_dict().items()
                       if not lora or ".lora_A." in k or ".lora_B." in k or ".modules_to_save." in k}}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)  # reads just these keys, from every rank's shard
    hf.load_state_dict({k[3:]: v for k, v in state["model"].items()}, strict=not lora)
    dtype = getattr(torch, dtype or trained_dtype(checkpoint))
    tmp = output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if adapter_only:  # a peft folder: PeftModel.from_pretrained(base, folder)
        peft_model.to(dtype).save_pretrained(tmp)
    else:
        if lora:  # dense: W + scale * B @ A under the base model's names
            merged = dict(actor.iter_full_params(hf))
            hf = actor.load_hf_model(path, dtype=torch.float32)
            hf.load_state_dict(merged)
        hf.to(dtype).save_pretrained(tmp)
        tiny_families.complete_for_vllm(tmp)  # (Gemma 4's k norms of KV-shared layers)
        copy_tokenizer_files(path, tmp)
    if os.path.exists(output):
        shutil.rmtree(output)
    os.replace(tmp, output)  # a crash never leaves a half-written model folder under the final name
    return output


def copy_tokenizer_files(path, out):
    """Tokenizer, processor, chat template and generation config, so the folder is complete; the generation config as
    the base folder has it (EasyR1's merger saved transformers' reading of it, and lost Qwen3's list of end tokens)."""
    if not os.path.isdir(path):  # a hub name: fetch the small files only
        from huggingface_hub import snapshot_download  # only for a hub name
        path = snapshot_download(path, allow_patterns=["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"])
    for name in os.listdir(path):
        src = os.path.join(path, name)
        if (os.path.isfile(src) and not name.endswith(WEIGHT_FILES) and not name.endswith(".index.json")
                and name not in ("config.json", "BUILD_COMPLETE.json")
                and (name == "generation_config.json" or not os.path.exists(os.path.join(out, name)))):
            shutil.copy2(src, os.path.join(out, name))


if __name__ == "__main__":
    a = tyro.cli(Args)
    print(f"wrote {merge(a.checkpoint, a.output, a.model_path, a.dtype, a.adapter_only)} in "
          f"{a.dtype or trained_dtype(a.checkpoint)}")
