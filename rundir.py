"""rundir.py -- the output folder of a run (docs/options.md): checkpoints (sharded, atomic), resume or refuse (every
way of resuming refuses a changed config: two runs never mix), logs cut back to the resumed step, the best checkpoint,
a step's metrics, metrics.jsonl, samples.jsonl, val_samples.jsonl, trackers, the console line, reward.png."""
import importlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from typing import Annotated

import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

import flops
import fsdp_actor as actor
import memory
from common import UserError

# options that may change when a run is resumed: when to stop, validate, save and log, and engine / memory knobs that
# do not change what is computed. Anything else (data, model, algorithm, batch sizes, seed, ...) must stay the same.
RESUMABLE_CHANGES = {
    "max_steps", "total_epochs", "val_freq", "val_before_train", "save_freq", "save_limit", "output_dir", "resume",
    "config", "log_samples", "logger", "project_name", "experiment_name",
    "micro_batch_size_per_device", "max_token_len_per_device", "logprob_chunk_size", "gradient_checkpointing",
    "logprob_max_token_len_per_device", "checkpoint_layers", "share_prompts", "ulysses_size",  # how the work is cut
    "attn_implementation", "gpu_memory_utilization", "kv_cache_memory_gb", "max_num_batched_tokens", "enforce_eager",
    "sleep_level", "tensor_parallel_size", "torch_compile", "offload_params", "offload_optimizer", "prefetch_requests"}


def _read_json(path):
    return json.load(open(path)) if os.path.isfile(path) else None


def write_atomic(path, text):
    """A reader (or a crash) never sees a half-written file: write a temporary file, then rename it."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def config_diff(saved, cfg):
    """The options of `cfg` that differ from a saved config outside RESUMABLE_CHANGES, and the run's length where the lr
    schedule spans it (cosine, warm-up ratio), as "key: old -> new"; keys the saved config lacks are not compared."""
    now = json.loads(json.dumps(asdict(cfg)))  # tuples -> lists, as in the saved JSON
    span = {"max_steps", "total_epochs"} if now["lr_scheduler_type"] != "constant" or now["lr_warmup_ratio"] else set()
    return [f"{k}: {saved[k]!r} -> {v!r}" + " (the lr schedule spans the run)" * (k in span) for k, v in now.items()
            if k in saved and (k not in RESUMABLE_CHANGES or k in span) and saved[k] != v]


def find_resume(cfg):
    """The checkpoint to continue from and its trainer state, or (None, None) for a fresh start. Refuses (ValueError)
    what would mix two runs: a changed config, --resume never over a run, a PATH that is not a checkpoint."""
    ckpts = os.path.join(cfg.output_dir, "checkpoints")
    logs = [f for f in ("config.json", "metrics.jsonl") if os.path.isfile(os.path.join(cfg.output_dir, f))]
    if cfg.resume == "never":
        held = latest_checkpoint(ckpts) or (logs and os.path.join(cfg.output_dir, logs[0]))
        if held:
            raise UserError(f"--resume never: {cfg.output_dir} already holds a run ({held}); choose a new --output-dir "
                            "(or delete that folder), or continue it with --resume auto")
        return None, None
    ckpt = latest_checkpoint(ckpts) if cfg.resume == "auto" else cfg.resume.rstrip("/")
    state = _read_json(os.path.join(ckpt, "trainer_state.json")) if ckpt else None
    if ckpt and state is None:
        raise UserError(
            f"--resume {ckpt}: not a checkpoint (no trainer_state.json); give auto, never or checkpoints/step_N")
    config_json = os.path.join(cfg.output_dir, "config.json")
    for src, saved in ((ckpt, state and state.get("config")), (config_json, _read_json(config_json))):
        if saved and (diff := config_diff(saved, cfg)):
            raise UserError(f"{src} belongs to a run with another config ({'; '.join(diff)}): resume it with the same "
                            "options, or start a new run in another --output-dir")
    return ckpt, state


def truncate_jsonl(path, step):
    """Keep the rows of steps <= `step` (none at step 0): the later steps run again. Returns the rows dropped."""
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
    for name in ("metrics.jsonl", "samples.jsonl", "val_samples.jsonl"):
        if dropped := truncate_jsonl(os.path.join(cfg.output_dir, name), start_step):
            say(f"[resume] {name}: dropped {dropped} row(s) after step {start_step} (those steps run again)")
    root = os.path.join(cfg.output_dir, "checkpoints")
    for s in _saved_steps(root):
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
    for s in _saved_steps(root):
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
    save_checkpoint(os.path.join(cfg.output_dir, "checkpoints", f"step_{step}"), ctx.model, ctx.opt, ctx.sched,
                      {"step": step, "cursor": ctx.cursor, "config": asdict(cfg), "val/mean": val,
                       "kl_coef": ctx.kl_coef, "compute_dtype": str(ctx.compute_dtype).removeprefix("torch.")},
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
def _optional(name, module=None):
    """A tracker's package, imported only when asked for; not installed: one line saying how to get it."""
    try:
        return importlib.import_module(module or name)
    except ImportError:
        raise UserError(f"--logger {name} needs the {name} package: pip install {name}") from None


def _run_name(cfg):
    return cfg.experiment_name or os.path.basename(os.path.abspath(cfg.output_dir))


def open_trackers(cfg, start_step):
    """One log(metrics, step) function per tracker asked for beyond console and jsonl, and a close() for all."""
    logs, closes = [], []
    if "tensorboard" in cfg.logger:
        tb = _optional("tensorboard", "torch.utils.tensorboard")
        # purge_step hides what an earlier attempt logged after the resumed step (all of it when starting over)
        w = tb.SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"), purge_step=start_step and start_step + 1)
        logs.append(lambda m, step: [w.add_scalar(k, v, step) for k, v in m.items() if isinstance(v, (int, float))])
        closes.append(w.close)
    if "wandb" in cfg.logger:
        wandb = _optional("wandb")
        # without credentials (or a network) the run is written offline: `wandb sync` uploads it later
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb.login(prompt=False, verify=False) else "offline")
        run = wandb.init(project=cfg.project_name, name=_run_name(cfg), dir=cfg.output_dir, config=asdict(cfg),
                         mode=mode)
        logs.append(lambda m, step: run.log(m, step=step))
        closes.append(run.finish)
    for name, start in (("swanlab", _swanlab), ("mlflow", _mlflow)):
        if name in cfg.logger:
            log, close = start(cfg)
            logs.append(log)
            closes.append(close)
    # the phases' wall-clock starts (time/...) stay in metrics.jsonl: bench.py phases reads them; no one plots them
    return (lambda m, step: [f({k: v for k, v in m.items() if not k.startswith("time/")}, step) for f in logs],
            lambda: [f() for f in closes])


def _numbers(m):  # what SwanLab and MLflow plot (wandb takes the rest as well)
    return {k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}


def _swanlab(cfg):
    swanlab = _optional("swanlab")
    # without an API key (SWANLAB_API_KEY, or `swanlab login`) the run is written offline into the output folder, as
    # wandb's: `swanlab sync <folder>` uploads it later; SWANLAB_MODE (cloud, local, offline, disabled) decides when set
    settings = getattr(swanlab, "Settings", None)  # swanlab >= 0.7 reads the login file there; older: the variable
    key = os.environ.get("SWANLAB_API_KEY") or (settings and settings().api_key)
    # logdir / experiment_name: the names every swanlab version takes (EasyR1's call), newer ones also log_dir / name
    swanlab.init(project=cfg.project_name, experiment_name=_run_name(cfg), logdir=os.path.join(cfg.output_dir,
                 "swanlab"), config=asdict(cfg), mode=os.environ.get("SWANLAB_MODE") or ("cloud" if key else "offline"))
    return lambda m, step: swanlab.log(_numbers(m), step=step), swanlab.finish


def _mlflow(cfg):
    _optional("mlflow")
    from mlflow.entities import Metric, Param  # optional tracker (installed: checked above)
    from mlflow.tracking import MlflowClient  # (likewise)
    # MLFLOW_TRACKING_URI names a server when set; else one SQLite file in the output folder (MLflow 3 refuses its
    # ./mlruns store): `mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`
    uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + os.path.abspath(os.path.join(cfg.output_dir,
                                                                                              "mlflow.db"))
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(cfg.project_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        cfg.project_name, artifact_location=os.path.abspath(os.path.join(cfg.output_dir, "mlflow_artifacts")))
    run_id = client.create_run(exp_id, run_name=_run_name(cfg)).info.run_id
    client.log_batch(run_id, params=[Param(k, str(v)[:500]) for k, v in asdict(cfg).items()])  # MLflow 2's limit

    def log(m, step):
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in _numbers(m).items()])
    return log, lambda: client.set_terminated(run_id)


def plot_rewards(cfg):
    """reward.png in the output folder (atomic); False when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    plot([os.path.join(cfg.output_dir, "metrics.jsonl")], os.path.join(cfg.output_dir, "reward.png"),
         labels=[os.path.basename(os.path.abspath(cfg.output_dir))],
         title="reward (train: sampled; val: validation set)", chance=None if cfg.train_files else 0.25)
    return True


def plot(files: Annotated[list[str], tyro.conf.Positional], out: str = "reward.png", labels: tuple[str, ...] = (),
         title: str = "", chance: float | None = None) -> str:
    """Reward curves (train, and validation where logged) of metrics.jsonl files into the picture `out` (atomic)."""
    import matplotlib  # optional: only the plot needs it
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # (after use("Agg"))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, path in enumerate(files):
        rows = [json.loads(x) for x in open(path) if x.strip()]
        label = labels[i] if i < len(labels) else path
        train = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
        val = [(r["step"], r["val/mean"]) for r in rows if "val/mean" in r]
        line, = ax.plot(*(zip(*train) if train else ([], [])), lw=1, alpha=0.8, label=f"{label} train")
        if val:
            ax.plot(*zip(*val), "o-", color=line.get_color(), ms=3, label=f"{label} val")
    if chance is not None:
        ax.axhline(chance, color="grey", ls=":", lw=1, label="chance")
    ax.set(xlabel="step", ylabel="mean reward")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    tmp = out + ".tmp.png"  # written whole, then renamed: a viewer never reads half a file
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path, model, opt, sched, extra, keep=0, protect=None):
    """Sharded model + optimizer via torch.distributed.checkpoint (each rank its shard: several nodes need a shared
    file system), written to `<path>.tmp` and renamed when whole; then the newest `keep` kept (0 = all), and `protect`."""
    import torch.distributed.checkpoint as dcp  # ~1 s to import: only where a checkpoint is written
    from torch.distributed.checkpoint.state_dict import get_state_dict  # (the same package)
    tmp = path + ".tmp"
    if dist.get_rank() == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier(group=actor._cpu_group())
    msd, osd = get_state_dict(model, opt, options=_state_dict_options(model))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        write_atomic(os.path.join(tmp, "trainer_state.json"), json.dumps({**extra, "scheduler": sched.state_dict()}))
        if os.path.exists(path):  # a re-run of the same step
            shutil.rmtree(path)
        os.replace(tmp, path)
        root = os.path.dirname(path)
        while keep and len(steps := [s for s in _saved_steps(root) if s != protect]) > keep:  # after the new one
            shutil.rmtree(os.path.join(root, f"step_{steps[0]}"))
    dist.barrier(group=actor._cpu_group())


def load_checkpoint(path, model, opt, sched):
    import torch.distributed.checkpoint as dcp  # ~1 s to import: only where a checkpoint is read
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # (the same package)
    options = _state_dict_options(model)
    msd, osd = get_state_dict(model, opt, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    with open(os.path.join(path, "trainer_state.json")) as f:  # (missing: its own FileNotFoundError)
        extra = json.load(f)
    sched.load_state_dict(extra.pop("scheduler"))
    return extra


def _state_dict_options(model):
    """A LoRA checkpoint holds the adapters and their optimizer state only (megabytes; the frozen base: model_path)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # ~1 s to import: only at a checkpoint
    lora = bool(memory.lora_layers(model))
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _saved_steps(save_dir):
    """Steps of the complete checkpoints in save_dir, oldest first (a `.tmp` folder is an unfinished save)."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(int(d[5:]) for d in os.listdir(save_dir) if d.startswith("step_") and d[5:].isdigit())


def latest_checkpoint(save_dir):
    steps = _saved_steps(save_dir)
    return os.path.join(save_dir, f"step_{steps[-1]}") if steps else None


# ----------------------------------------------------------------------------------------------- logging
def log0(ctx, *a):
    if ctx.rank == 0:
        print(*a, flush=True)


def print_batch_arithmetic(ctx):
    cfg, w = ctx.cfg, ctx.world
    updates = cfg.rollout_batch_size // cfg.global_batch_size * cfg.ppo_epochs
    log0(ctx, f"[batch] {w} rank(s); per step: {cfg.rollout_batch_size} prompts x n={cfg.n} = "
              f"{cfg.rollout_batch_size * cfg.n} samples ({cfg.rollout_batch_size * cfg.n // w} per rank); "
              f"{updates} optimizer step(s) per rollout step ({cfg.rollout_batch_size // cfg.global_batch_size} "
              f"mini-batches x {cfg.ppo_epochs} epoch(s)) of {cfg.global_batch_size} prompts = "
              f"{cfg.global_batch_size * cfg.n // w} samples per rank, in micro-batches of <= "
              f"{cfg.micro_batch_size_per_device} samples and <= {cfg.max_token_len_per_device} tokens"
              + (f" (log-prob passes: <= {cfg.logprob_max_token_len_per_device} tokens)"
                 if cfg.logprob_max_token_len_per_device else "") + "; "
              f"old log-probs {'recomputed' if updates > 1 else 'taken from the first forward (on-policy)'}; "
              f"reference model {'on, kl_coef=' + str(cfg.kl_coef) if cfg.kl_coef > 0 else 'off'}")


def step_metrics(ctx, samples, T, peaks, so_far):
    """A training step's metrics beside the update's: rewards, lengths, seconds per phase (T), tokens per second, MFU
    (flops.py, veRL's convention) and memory (memory.metrics; so_far: the step's metrics until now)."""
    cfg, out = ctx.cfg, sample_metrics(ctx, samples, "reward")
    n_tok = float(actor.all_reduce_cpu(sum(len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in samples)))
    out.update({f"timing/{k}": v for k, v in T.items()})
    out["throughput/tokens_per_s"] = n_tok / T["step"] / ctx.world  # per device, like EasyR1
    out["throughput/tokens_per_s_total"] = n_tok / T["step"]
    fwd = float(actor.all_reduce_cpu(flops.forward_flops(ctx.model.hf.config, samples)))  # one pass, all ranks
    peak = cfg.peak_tflops * 1e12 * ctx.world
    out["perf/mfu_update"] = 3 * cfg.ppo_epochs * fwd / (T["update"] * peak)  # forward + backward per epoch
    if "ref_logprob" in T:
        out["perf/mfu_ref"] = fwd / (T["ref_logprob"] * peak)
    out.update(memory.metrics(ctx.rollout, peaks, {**so_far, **out}))
    return out


def sample_metrics(ctx, samples, prefix):
    """Rewards and their parts, prompt and response lengths, truncation rate: means over all ranks."""
    keys = sorted(samples[0]["scores"])
    rows = [[s["scores"][k] for k in keys] + [len(s["response_ids"]), 0.0 if s["finished"] else 1.0,
                                               len(s["prompt"]["prompt_ids"]), 1.0] for s in samples]
    tot = actor.all_reduce_cpu(torch.tensor(rows, dtype=torch.float64).sum(0))
    mx = actor.all_reduce_cpu(max(len(s["response_ids"]) for s in samples), op=dist.ReduceOp.MAX)
    cnt = float(tot[-1])
    out = {f"{prefix}/{'mean' if k == 'overall' else k}": float(v) / cnt for k, v in zip(keys, tot[:len(keys)])}
    out["response_length/mean" if prefix == "reward" else f"{prefix}/response_length"] = float(tot[len(keys)]) / cnt
    if prefix == "reward":
        out["response_length/max"] = float(mx)
        out["response_length/clip_ratio"] = float(tot[len(keys) + 1]) / cnt
        out["prompt_length/mean"] = float(tot[len(keys) + 2]) / cnt  # image tokens included
    return out


# the console line's metrics and their short names (dapo.py adds its own)
CONSOLE = [("reward/mean", "reward"), ("reward/accuracy", "acc"), ("val/mean", "val"), ("val/accuracy", "vacc"),
           ("response_length/mean", "len"), ("actor/kl", "kl"), ("actor/entropy", "ent"), ("actor/grad_norm", "gnorm"),
           ("rollout/logprob_diff_mean", "lpdiff"), ("timing/gen", "t_gen"), ("timing/update", "t_upd"),
           ("timing/step", "t_step"), ("throughput/tokens_per_s", "tok/s/dev")]


class MetricSums:
    """Metric -> [sum, count] over micro-batches (means), or a running max, all-reduced over ranks once at the end.
    Values stay tensors on the device until then: a float() per micro-batch would make the host wait each time."""

    def __init__(self):
        self.sums, self.maxes = {}, {}

    def add(self, k, v, c=1.0):  # c = 0: a share of a global total (losses), summed and not averaged
        s = self.sums.setdefault(k, [0.0, 0.0])
        s[0], s[1] = s[0] + (v.detach().double() if torch.is_tensor(v) else v), s[1] + c

    def add_max(self, k, v):
        self.maxes[k] = torch.maximum(self.maxes[k], v.detach().double()) if k in self.maxes else v.detach().double()

    def reduce(self, dev, n_steps):
        """Means over all ranks; losses (count 0) summed over ranks and micro-batches, averaged over n_steps
        optimizer steps; grad_norm and lr (the same on every rank) averaged over the steps."""
        keys, mkeys = sorted(self.sums), sorted(self.maxes)
        local = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=dev) for k in keys for x in self.sums[k]]
                            + [self.maxes[k] for k in mkeys]).cpu()  # the one wait for the GPU
        red = actor.all_reduce_cpu(local[:2 * len(keys)].view(-1, 2))
        out = {}
        for k, (v, c) in zip(keys, red.tolist()):
            if k in ("actor/pg_loss", "actor/loss"):
                out[k] = v / n_steps
            elif k in ("actor/grad_norm", "actor/lr"):
                out[k] = v / c  # same on every rank
            else:
                out[k] = v / max(c, 1)
        if mkeys:
            out.update(zip(mkeys, actor.all_reduce_cpu(local[2 * len(keys):], op=dist.ReduceOp.MAX).tolist()))
        return out


def gather_val_rows(samples):
    """Every rank's validation answers on rank 0 (others get None): answer, response, reward, accuracy."""
    mine = [{"answer": s["prompt"]["answer"], "response": s["text"], "reward": s["reward"],
             "accuracy": float(s["scores"].get("accuracy", s["reward"]))} for s in samples]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return [r for part in everyone for r in part] if everyone else None


class RunLog:
    """Rank 0's record of a run: metrics.jsonl (one row per step), samples.jsonl (a few generations per step), the
    trackers, the progress bar with a console line per step, and reward.png. Other ranks keep none of it."""

    def __init__(self, cfg, rank, start_step):
        self.cfg, self.on = cfg, rank == 0
        if self.on:
            self.metrics_f = open(os.path.join(cfg.output_dir, "metrics.jsonl"), "a")
            self.samples_f = open(os.path.join(cfg.output_dir, "samples.jsonl"), "a")
            self.val_f = open(os.path.join(cfg.output_dir, "val_samples.jsonl"), "a")
            self.track, self.close_trackers = open_trackers(cfg, start_step)
            self.bar = tqdm(total=cfg.max_steps, initial=start_step, dynamic_ncols=True,
                            desc=os.path.basename(sys.argv[0]).removesuffix(".py") or "train")

    def say(self, *a):
        if self.on:
            self.bar.write(" ".join(map(str, a)))

    def write(self, metrics, samples=None, last=False, val_rows=None):
        """One row (a step's metrics, or the step-0 validation when samples is None); val_rows: the validation's
        answers (gather_val_rows), one line each in val_samples.jsonl."""
        if not self.on:
            return
        step, cfg = metrics["step"], self.cfg
        self.metrics_f.write(json.dumps(metrics) + "\n")
        self.metrics_f.flush()
        for r in val_rows or ():
            self.val_f.write(json.dumps({"step": step, **r}) + "\n")
        self.val_f.flush()
        self.track(metrics, step)
        if samples is None:
            return
        for s in samples[:cfg.log_samples]:
            self.samples_f.write(json.dumps({"step": step, "prompt": s["prompt"]["prompt_text"], "response": s["text"],
                                             "answer": s["prompt"]["answer"], "reward": s["reward"]}) + "\n")
        self.samples_f.flush()
        if "val/mean" in metrics or step % 10 == 0 or last:
            plot_rewards(cfg)  # ~0.3 s: reward.png follows the run
        self.bar.update(1)
        if "console" in cfg.logger:
            self.bar.write(f"step {metrics['step']:4d} | " + " ".join(f"{n}={metrics[k]:.3g}" for k, n in CONSOLE
                                                                      if k in metrics))

    def close(self):
        if self.on:
            self.bar.close()
            self.close_trackers()
            for f in (self.metrics_f, self.samples_f, self.val_f):
                f.close()


if __name__ == "__main__":  # python rundir.py a/metrics.jsonl b/metrics.jsonl --labels cpu gpu --out compare.png
    out = tyro.cli(plot, description="Reward curves of metrics.jsonl files (grpo.py keeps <output_dir>/reward.png "
                   "up to date itself); --chance draws a dotted line at the reward of guessing (the demo: 0.25).")
    print(f"wrote {out}")
