"""merge.py: a saved (sharded) checkpoint becomes an HF folder with exactly the trained weights."""
import json
import os

import torch

import data
import fsdp_actor as actor
import rundir
import merge
import tiny_model
import tools


def test_checkpoint_to_hf_folder(tmp_path):
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "tiny"))
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
    opt, sched = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():  # one real optimizer step, so the weights differ from the base model
        p.grad = torch.distributed.tensor.distribute_tensor(torch.randn(p.shape, generator=g), p.device_mesh,
                                                             p.placements)
    actor.optimizer_step(model, opt, sched, 1e9)
    trained = {k: v.clone() for k, v in actor.iter_full_params(model)}
    ckpt = str(tmp_path / "ckpt" / "step_1")
    os.makedirs(os.path.dirname(ckpt))
    rundir.save_checkpoint(ckpt, model, opt, sched, {"step": 1, "cursor": 0, "config": {"model_path": path}})
    out = merge.merge(ckpt, str(tmp_path / "hf"), dtype="float32")
    assert not os.path.exists(out + ".tmp")
    merged = actor.load_hf_model(out).state_dict()
    base = actor.load_hf_model(path).state_dict()
    assert merged.keys() == trained.keys()
    for k in trained:
        assert torch.equal(merged[k], trained[k]), k
    assert any(not torch.equal(base[k], trained[k]) for k in trained)
    # the folder is complete on its own: tokenizer, processor, chat template
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    assert json.load(open(os.path.join(out, "config.json")))["architectures"]


def test_docstring_usage_runs_as_written(tmp_path, launch):
    """Each `python merge.py ...` line of merge.py's docstring, with its paths pointed at a real checkpoint; the
    default dtype is the compute dtype the checkpoint records (bfloat16 here, as a GPU run records it)."""
    import shlex
    import sys
    actor.init_distributed()
    path = tiny_model.build_tiny_model(str(tmp_path / "tiny"))
    model = actor.build_actor(path, torch.device("cpu"), torch.float32, torch.float32)
    opt, sched = actor.build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), 0, torch.device("cpu"))
    ckpt = str(tmp_path / "ckpt" / "step_1")
    os.makedirs(os.path.dirname(ckpt))
    rundir.save_checkpoint(ckpt, model, opt, sched, {"step": 1, "cursor": 0, "config": {"model_path": path},
                                                "compute_dtype": "bfloat16"})
    trained = {k: v.clone() for k, v in actor.iter_full_params(model)}
    lines = [shlex.split(x.strip()) for x in merge.__doc__.splitlines() if x.strip().startswith("python merge.py")]
    assert len(lines) == 2
    for i, argv in enumerate(lines):
        out = str(tmp_path / f"hf{i}")
        argv = [sys.executable, argv[1], ckpt, out] + argv[4:]
        if "--model-path" in argv:  # a hub name in the docstring; no hub here: the same tiny base model
            argv[argv.index("--model-path") + 1] = path
        p = launch.run(argv, tmp_path / f"merge{i}.log")
        want = getattr(torch, argv[argv.index("--dtype") + 1]) if "--dtype" in argv else torch.bfloat16
        assert f"in {str(want).removeprefix('torch.')}" in p.out
        merged = actor.load_hf_model(out, dtype="auto").state_dict()  # as saved
        for k in trained:
            assert merged[k].dtype == want, k
            assert torch.equal(merged[k], trained[k].to(want)), k
    # a CPU run records float32: the default follows the record, not a fixed dtype
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    json.dump({**state, "compute_dtype": "float32"}, open(os.path.join(ckpt, "trainer_state.json"), "w"))
    out = merge.merge(ckpt, str(tmp_path / "hf_cpu"))
    assert all(v.dtype == torch.float32 for v in actor.load_hf_model(out, dtype="auto").state_dict().values())


def test_a_zoom_demo_checkpoint_merges_onto_the_model_with_the_call_token(tmp_path):
    # watched failing: without the demo task's extra token the base is the plain tiny model, whose tokenizer reads
    # the trained call's id as another word (the same vocabulary size: the weights load and nothing complains)
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": {"model_path": "", "demo_task": "zoom"}}))
    tok = data.load_processor(merge.base_model_path(str(ckpt))).tokenizer
    assert tok.convert_tokens_to_ids(tools.ZOOM_CALL) == tok.encode(tools.ZOOM_CALL, add_special_tokens=False)[0]
    assert len(tok.encode(tools.ZOOM_CALL, add_special_tokens=False)) == 1
