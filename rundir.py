"""rundir.py -- the output folder of a run: resume or refuse, logs cut back to the resumed step, the best
checkpoint, experiment trackers, reward.png.

    output_dir/config.json          the config of the run (written when it starts fresh)
    output_dir/metrics.jsonl        one row per step (and a step-0 validation row); samples.jsonl: a few generations
    output_dir/checkpoints/step_N   model + optimizer + trainer_state.json; best.json names the best by val/mean
    output_dir/reward.png           train and validation reward against steps (when matplotlib is installed)

A folder holds one run. `--resume auto` continues it from its newest checkpoint, `--resume PATH` from a chosen one,
`--resume never` refuses a folder that already holds a run; every way refuses a changed config, so two runs never mix.
"""
import json
import os
import shutil
from dataclasses import asdict

import fsdp_actor as A
from data import UserError

# options that may change when a run is resumed: when to stop, validate, save and log, and engine / memory knobs that
# do not change what is computed. Anything else (data, model, algorithm, batch sizes, seed, ...) must stay the same.
RESUMABLE_CHANGES = {
    "max_steps", "total_epochs", "val_freq", "val_before_train", "save_freq", "save_limit", "output_dir", "resume",
    "config", "log_samples", "logger", "project_name", "experiment_name",
    "micro_batch_size_per_device", "max_token_len_per_device", "logprob_chunk_size", "gradient_checkpointing",
    "attn_implementation", "gpu_memory_utilization", "max_num_batched_tokens", "enforce_eager", "sleep_level",
    "tensor_parallel_size", "offload_params", "offload_optimizer"}


def _read_json(path):
    return json.load(open(path)) if os.path.isfile(path) else None


def write_atomic(path, text):
    """A reader (or a crash) never sees a half-written file: write a temporary file, then rename it."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def config_diff(saved, cfg):
    """The options of `cfg` that differ from a saved config, outside RESUMABLE_CHANGES ("key: old -> new").
    Keys the saved config does not know (added since it was written) are not compared."""
    now = json.loads(json.dumps(asdict(cfg)))  # tuples -> lists, as in the saved JSON
    return [f"{k}: {saved[k]!r} -> {v!r}" for k, v in now.items()
            if k in saved and k not in RESUMABLE_CHANGES and saved[k] != v]


def find_resume(cfg):
    """The checkpoint to continue from and its trainer state, or (None, None) for a fresh start. Refuses (ValueError)
    whatever would mix two runs: a changed config, --resume never over a folder that holds a run, a PATH that is
    not a checkpoint."""
    ckpts = os.path.join(cfg.output_dir, "checkpoints")
    logs = [f for f in ("config.json", "metrics.jsonl") if os.path.isfile(os.path.join(cfg.output_dir, f))]
    if cfg.resume == "never":
        held = A.latest_checkpoint(ckpts) or (logs and os.path.join(cfg.output_dir, logs[0]))
        if held:
            raise UserError(
                f"--resume never: {cfg.output_dir} already holds a run ({held}); choose a new --output-dir (or "
                "delete that folder), or continue it with --resume auto")
        return None, None
    ckpt = A.latest_checkpoint(ckpts) if cfg.resume == "auto" else cfg.resume.rstrip("/")
    state = _read_json(os.path.join(ckpt, "trainer_state.json")) if ckpt else None
    if ckpt and state is None:
        raise UserError(
            f"--resume {ckpt}: not a checkpoint (no trainer_state.json); give auto, never or checkpoints/step_N")
    config_json = os.path.join(cfg.output_dir, "config.json")
    for src, saved in ((ckpt, state and state.get("config")), (config_json, _read_json(config_json))):
        if saved and (diff := config_diff(saved, cfg)):
            raise UserError(
                f"{src} belongs to a run with another config ({'; '.join(diff)}): resume it with the same options, "
                "or start a new run in another --output-dir")
    return ckpt, state


def truncate_jsonl(path, step):
    """Keep the rows of steps <= `step` (none when starting over at step 0): the steps after the checkpoint will be
    run again. Returns the number of rows dropped."""
    if not os.path.isfile(path):
        return 0
    rows = open(path).read().splitlines()
    keep = [r for r in rows if r.strip() and step > 0 and json.loads(r).get("step", 0) <= step]
    if len(keep) != len(rows):
        write_atomic(path, "".join(r + "\n" for r in keep))
    return len(rows) - len(keep)


def prepare(cfg, start_step, ckpt, say=print):
    """Rank 0, before the first step: logs cut back to the start step, checkpoints newer than it set aside (a run
    resumed from an older checkpoint must never later resume from the abandoned branch), config.json for a new run."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    for name in ("metrics.jsonl", "samples.jsonl"):
        if dropped := truncate_jsonl(os.path.join(cfg.output_dir, name), start_step):
            say(f"[resume] {name}: dropped {dropped} row(s) after step {start_step} (those steps run again)")
    root = os.path.join(cfg.output_dir, "checkpoints")
    for s in A._saved_steps(root):
        if s > start_step:
            old = os.path.join(root, f"step_{s}")
            shutil.rmtree(old + ".abandoned", ignore_errors=True)
            os.replace(old, old + ".abandoned")
            say(f"[resume] {old} is newer than the resumed step: renamed {old}.abandoned")
    if ckpt is None:
        write_atomic(os.path.join(cfg.output_dir, "config.json"), json.dumps(asdict(cfg), indent=1))


# ------------------------------------------------------------------------------------------------ best checkpoint
def find_best(output_dir):
    """(step, val/mean) of the best saved checkpoint by validation reward (the earliest of equals), or None."""
    root, best = os.path.join(output_dir, "checkpoints"), None
    for s in A._saved_steps(root):
        v = (_read_json(os.path.join(root, f"step_{s}", "trainer_state.json")) or {}).get("val/mean")
        if v is not None and (best is None or v > best[1]):
            best = (s, v)
    return best


def save(ctx, step, metrics, say=print):
    """checkpoints/step_N (every rank takes part), with what merge.py and resume need to know; the best checkpoint
    by val/mean is kept beyond save_limit, named in checkpoints/best.json and in the log."""
    cfg, val, best = ctx.cfg, metrics.get("val/mean"), ctx.best
    if val is not None and (best is None or val > best[1]):
        ctx.best = (step, val)
    A.save_checkpoint(os.path.join(cfg.output_dir, "checkpoints", f"step_{step}"), ctx.model, ctx.opt, ctx.sched,
                      {"step": step, "cursor": ctx.cursor, "config": asdict(cfg), "val/mean": val,
                       "compute_dtype": str(ctx.compute_dtype).removeprefix("torch.")},
                      keep=cfg.save_limit, protect=ctx.best and ctx.best[0])
    if ctx.rank == 0 and ctx.best != best:
        write_best(cfg.output_dir, ctx.best)
        say(f"[best] checkpoints/step_{step}: val/mean={val:.4g} (checkpoints/best.json)")


def write_best(output_dir, best):
    path = os.path.join(output_dir, "checkpoints", "best.json")
    if best is None:
        if os.path.exists(path):
            os.remove(path)
        return
    write_atomic(path, json.dumps({"step": best[0], "checkpoint": f"checkpoints/step_{best[0]}", "val/mean": best[1]}))


# ------------------------------------------------------------------------------------------------ trackers
def open_trackers(cfg, start_step):
    """One log(metrics, step) function per tracker asked for beyond console and jsonl, and a close() for all.
    Each package is imported only when asked for."""
    logs, closes = [], []
    if "tensorboard" in cfg.logger:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "--logger tensorboard needs the tensorboard package: pip install tensorboard") from None
        # purge_step hides what an earlier attempt logged after the resumed step (all of it when starting over)
        w = SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"), purge_step=start_step + 1 if start_step else 0)
        logs.append(lambda m, step: [w.add_scalar(k, v, step) for k, v in m.items() if isinstance(v, (int, float))])
        closes.append(w.close)
    if "wandb" in cfg.logger:
        try:
            import wandb
        except ImportError:
            raise UserError("--logger wandb needs the wandb package: pip install wandb") from None
        # without credentials (or a network) the run is written offline: `wandb sync` uploads it later
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb.login(prompt=False, verify=False) else "offline")
        run = wandb.init(project=cfg.project_name, name=cfg.experiment_name or os.path.basename(
            os.path.abspath(cfg.output_dir)), dir=cfg.output_dir, config=asdict(cfg), mode=mode)
        logs.append(lambda m, step: run.log(m, step=step))
        closes.append(run.finish)
    return lambda m, step: [f(m, step) for f in logs], lambda: [f() for f in closes]


def plot_rewards(cfg):
    """reward.png in the output folder (atomic); False when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    import plot
    plot.plot([os.path.join(cfg.output_dir, "metrics.jsonl")], os.path.join(cfg.output_dir, "reward.png"),
              labels=[os.path.basename(os.path.abspath(cfg.output_dir))],
              title="reward (train: sampled; val: validation set)", chance=None if cfg.train_files else 0.25)
    return True
