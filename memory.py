"""memory.py -- the memory modes: pure-bf16 training (--precision bf16), host offload of the optimizer state and of
the reference model (--offload-optimizer, --offload-params), and where the GPU memory goes (per-phase peaks of the
trainer, the engine's share).

Pure bf16: weights, gradients and AdamW state all in bf16 (8 bytes per parameter, 10 with Kahan's buffer, instead
of AMP's 16: fp32 weights 4 + fp32 gradients 4 + fp32 moments 8), with an optimizer step that does not lose small
updates.

The trap: bf16 keeps 8 significant bits, so a weight w moves only if its update exceeds half an ulp, about
|w| * 2^-9. At RL's lr ~1e-6 an AdamW update is ~lr (Adam normalises the gradient), while a typical weight of 0.02
has a half-ulp of 6e-5: rounded to nearest, every update vanishes and the model never trains. Two ways out, both
here (`rounding`):

  stochastic: compute the new weight in fp32, then round it *up or down at random*, up with probability equal to
      how far it lies towards the next bf16 value. Each single step still moves only a few percent of the
      weights, by one ulp, but the expected weight equals the fp32 weight, so over many steps the weights follow the fp32 path.
      Costs nothing extra in memory; the noise is seeded per (seed, step, parameter, rank), so a resumed run
      draws the same noise: resume is exact without saving RNG state.
  kahan: keep the part of each update the bf16 weight could not absorb in a bf16 compensation buffer and add it
      to the next update (Kahan summation): weight + compensation tracks the fp32 weight to within bf16's
      rounding of the compensation itself. Deterministic; costs 2 more bytes per parameter.
  nearest: plain round-to-nearest (the trap itself; for the comparisons in the tests and the README).

The moments m and v are bf16 too and meet the same trap (v * 0.999 rounds back to v: v never decays), so they are
rounded stochastically in the stochastic and kahan modes, to nearest in `nearest`. Which mode is the default
(kahan), and why, is in README.md ("Memory modes"), with the measurements.

FSDP2: parameters, gradients and state are DTensors sharded alike; the step works on each rank's local shard
(`local`), element by element, so no communication is needed.
"""
import contextlib
import hashlib
import os
import resource
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

import tiny_model
from common import UserError, all_reduce_cpu

# bytes per parameter of the policy's state (weights, gradients, AdamW's two moments), per --precision; pure bf16
# with Kahan's compensation keeps KAHAN_BYTES more
STATE_BYTES = {"amp": dict(weights=4, grads=4, optim=8), "bf16": dict(weights=2, grads=2, optim=4)}
KAHAN_BYTES = 2
CHUNK = 1 << 24  # elements per piece of the fp32 scratch: bounds the step's extra memory to ~6 x 64 MB


def local(t):
    """The rank's own shard of a DTensor (a view: writes go to the parameter), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def stochastic_round_(dst, src, generator):
    """dst (bf16) <- src (fp32) rounded stochastically. A bf16 value is an fp32 value whose low 16 bits are 0: add
    uniform random bits to those low 16 bits, then clear them. The carry into bit 16 happens with probability
    (low bits) / 2^16, i.e. the fraction of the way src lies towards the next bf16 value away from 0; the sign bit
    sits above, so negative values round symmetrically. E[dst] = src."""
    bits = src.view(torch.int32)  # same memory, the fp32 bit pattern
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    dst.copy_((bits + noise).bitwise_and_(-65536).view(torch.float32))  # exact: the low bits are zero


def _store(dst, src, rounding, generator):
    if rounding == "nearest":
        dst.copy_(src)
    else:
        stochastic_round_(dst, src, generator)


@torch.no_grad()
def adamw_bf16_update(p, g, m, v, comp, step, lr, beta1, beta2, eps, weight_decay, rounding, generator):
    """One AdamW step on flat bf16 tensors p, g, m, v (and comp, the Kahan buffer, or None), in place. The math is
    torch.optim.AdamW's, in fp32 scratch, one chunk at a time:
        m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
        w <- w (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    and the new w is stored into bf16 by `rounding`."""
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    for sl in [slice(i, i + CHUNK) for i in range(0, p.numel(), CHUNK)]:
        g32 = g[sl].float()  # [c]
        m32 = m[sl].float().mul_(beta1).add_(g32, alpha=1 - beta1)  # [c]
        v32 = v[sl].float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)  # [c]
        _store(m[sl], m32, rounding, generator)
        _store(v[sl], v32, rounding, generator)
        w32 = p[sl].float()  # [c]
        update = (m32 / bc1).div_((v32 / bc2).sqrt_().add_(eps)).mul_(-lr).sub_(w32, alpha=lr * weight_decay)
        if rounding == "kahan":
            update += comp[sl].float()  # what earlier steps could not apply
            new = w32 + update
            p[sl].copy_(new)  # round to nearest
            comp[sl].copy_(update - (p[sl].float() - w32))  # what this step's rounding lost
        else:
            _store(p[sl], w32.add_(update), rounding, generator)


def _generator(seed, step, index, device):
    """The noise of one parameter's shard at one step: a function of (seed, step, parameter, rank) alone."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    key = hashlib.blake2b(f"{seed}/{step}/{index}/{rank}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(key, "little") >> 1)


class BF16AdamW(torch.optim.Optimizer):
    """AdamW on bf16 parameters with bf16 state, stepping through adamw_bf16_update. A torch Optimizer (not a bare
    function) only so that the LR scheduler, clip_grad_norm_ and torch.distributed.checkpoint's optimizer state
    dicts work unchanged: the state (step, exp_avg, exp_avg_sq, and comp for Kahan) is keyed and named like
    torch.optim.AdamW's, and sharded like the parameters."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, rounding="stochastic", seed=0):
        if rounding not in ("stochastic", "kahan", "nearest"):
            raise ValueError(f"rounding={rounding!r}: choose stochastic, kahan or nearest")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.rounding, self.seed = rounding, seed

    @torch.no_grad()
    def step(self, closure=None):
        index = 0  # the parameter's position over all groups: part of its noise seed
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"BF16AdamW steps bf16 parameters; got {p.dtype}")
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if self.rounding == "kahan":
                        st["comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t = int(st["step"])
                flat = [local(x).view(-1) for x in (p, p.grad, st["exp_avg"], st["exp_avg_sq"])]  # [numel] each
                comp = local(st["comp"]).view(-1) if "comp" in st else None
                gen = None if self.rounding == "nearest" else _generator(self.seed, t, index, flat[0].device)
                adamw_bf16_update(*flat, comp, t, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                                  self.rounding, gen)


# ----------------------------------------------------------------------------------------------- offload
def move_optimizer_state(opt, device):
    """Every state tensor of `opt` to `device` (DTensors move their local shard). AdamW's `step` counter stays
    where the optimizer keeps it (the host; on the GPU for the fused kernel, which wants it there)."""
    fused = bool(opt.defaults.get("fused"))
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and (k != "step" or fused):
                st[k] = v.to(device, non_blocking=device.type == "cuda")


@contextlib.contextmanager
def resident(model, device, offload):
    """A model kept on the host (offload=True) comes to `device` for the block and goes back after it: the
    frozen reference model of --offload-params, which is needed once per step."""
    if offload and device.type == "cuda":
        model.to(device)
    try:
        yield model
    finally:
        if offload and device.type == "cuda":
            model.to("cpu")


# ----------------------------------------------------------------------------------------------- accounting
# torch counts every tensor of its caching allocator as allocated, and vLLM's sleep-mode pool (CuMemAllocator: the
# engine's weights and KV cache, allocated through a torch MemPool) is one of its pools; asleep, the pool's physical
# memory is released but its tensors still exist, so torch.cuda.max_memory_allocated() includes the engine's whole
# pool, awake or not. The trainer's own peak (weights, gradients, optimizer state, activations) is that minus the
# pool's bytes (the engine's pool_bytes(), constant after start-up).
_BALLAST = []  # bench.py --gpu-memory-cap-gb: memory taken away to emulate a smaller card (not the trainer's)


def occupy(gb):
    """Hold `gb` GiB of GPU memory until the process ends (a smaller card); the memory/* keys leave it out."""
    _BALLAST.append(torch.empty(int(gb * 2**30), dtype=torch.uint8, device="cuda"))


def sleep(engine):
    """Put the engine to sleep; returns the GPU memory free with it awake and asleep (memory/free_engine_*_gb)."""
    free = lambda: torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else 0.0  # noqa: E731
    awake = free()
    engine.sleep()
    return {"memory/free_engine_awake_gb": awake, "memory/free_engine_asleep_gb": free()}


def engine_built(engine, allocated_before):
    """Call right after the engine is built: what it allocated outside its pool (vLLM's CUDA graphs and buffers;
    the HF engine's weights) stays allocated in every phase, and is the engine's, not the trainer's."""
    if torch.cuda.is_available():
        engine.other_bytes = max(0, torch.cuda.memory_allocated() - allocated_before - engine.pool_bytes())


def _engine_bytes(engine):
    return engine.pool_bytes() + getattr(engine, "other_bytes", 0) if engine is not None else 0


def phase_peak_gb(engine=None):
    """The trainer's peak GPU memory (GiB) since the last call, then a new phase begins; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    pool = _engine_bytes(engine) + sum(t.numel() for t in _BALLAST)
    peak = max(torch.cuda.max_memory_allocated() - pool, 0) / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def metrics(engine, peaks, step_metrics):
    """memory/* of one step. peaks: phase -> phase_peak_gb (gen: sync and generation, where the engine's own
    activations outside its pool count too; ref: old and reference log-probs; update: the policy update). The
    engine: its pool (weights + KV cache, what it maps while awake) from vLLM's allocator, what else it keeps
    allocated (engine_built), and what it took from the driver on waking (free memory asleep - awake, from
    cudaMemGetInfo). On CPU: the host's peak RSS only."""
    out = {"memory/host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if not torch.cuda.is_available():
        return out
    pool = engine.pool_bytes() / 2**30
    phases = {k: v for k, v in peaks.items() if k != "start"}
    out.update({f"memory/trainer_peak_{k}_gb": v for k, v in phases.items()})
    out["memory/trainer_peak_gb"] = max(phases.values())
    out["memory/engine_pool_gb"] = pool
    out["memory/engine_other_gb"] = getattr(engine, "other_bytes", 0) / 2**30
    out["memory/engine_awake_gb"] = (step_metrics["memory/free_engine_asleep_gb"]
                                     - step_metrics["memory/free_engine_awake_gb"])
    # torch's view, as logged before (the engine's pool included; a bench.py ballast left out)
    out["memory/gpu_peak_allocated_gb"] = max(phases.values()) + _engine_bytes(engine) / 2**30
    out["memory/gpu_reserved_gb"] = torch.cuda.memory_reserved() / 2**30
    return out


def host_bytes_to_come(cfg, model, engine):
    """Host memory (bytes, this rank) that the offload modes still take after setup: the optimizer's state
    (allocated at the first step; AdamW's two moments, fp32, or bf16 and Kahan's buffer), with --offload-params
    also the gradients, and the sleeping engine's copy of its weights (level 1: bf16, its tensor-parallel share).
    What is on the host already (the offloaded weights, the reference) is out of MemAvailable by then."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = sum(local(p).numel() for p in trainable)
    b = STATE_BYTES[cfg.precision]
    state = n * (b["optim"] + KAHAN_BYTES * (cfg.precision == "bf16" and cfg.bf16_rounding == "kahan"))
    grads = n * b["grads"] if cfg.offload_params else 0
    full = sum(p.numel() for name, p in model.named_parameters()  # what the engine holds: no adapters, no copies
               if "lora_" not in name and ".original_module." not in name)
    copy = 2 * full // cfg.tensor_parallel_size if getattr(engine, "sleep_level", 0) == 1 else 0
    return state + grads + copy


def available_host_bytes():
    """MemAvailable of /proc/meminfo (bytes), None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_host_memory(cfg, model, engine):
    """With --offload-params / --offload-optimizer, stop at setup with one line when a node's host memory cannot
    hold what the offloaded state will take at the first step (a lower bound: torch rounds page-locked blocks up),
    instead of the kernel killing the ranks minutes later with no word. Collective (every rank raises the same
    error, naming a rank on the node that is short)."""
    if not (cfg.offload_params or cfg.offload_optimizer):
        return
    need = host_bytes_to_come(cfg, model, engine) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = available_host_bytes()
    table = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64)  # [ranks, (need, available)]
    table[dist.get_rank()] = torch.tensor([need, need if avail is None else avail])
    table = all_reduce_cpu(table)  # (the gloo group: every rank's row)
    short = table[:, 0] - table[:, 1]  # [ranks]
    if short.max() > 0:
        r = int(short.argmax())
        n, a = table[r].tolist()
        raise UserError(f"--offload-{'params' if cfg.offload_params else 'optimizer'}: the node of rank {r} needs "
                        f"{n / 2**30:.1f} GiB more host memory for the offloaded optimizer state"
                        f"{', the gradients' if cfg.offload_params else ''} and the sleeping engine's weights, and "
                        f"has {a / 2**30:.1f} GiB available: use more nodes, --precision bf16, --lora-rank, "
                        f"{'--offload-optimizer alone, ' if cfg.offload_params else ''}or --sleep-level 2")


# Where in a step the memory ran out (the first stage with one of its functions in the traceback), and what moves
# memory there. Generation has the engine's pool and activations beside the trainer's resident state; the passes
# and the update add the trainer's activations of one micro-batch to that state.
_OOM_STAGES = [
    (("update_policy",), "the policy update", "fewer tokens per micro-batch (--max-token-len-per-device {mb}) or a "
     "smaller --logprob-chunk-size; less state: --precision bf16, --lora-rank, --offload-optimizer, --offload-params"),
    (("compute_logprobs",), "the log-prob passes", "fewer tokens per micro-batch (--max-token-len-per-device {mb}) or "
     "a smaller --logprob-chunk-size; a host-side reference: --offload-params"),
    (("sync_engine", "wake"), "the engine's wake-up and weight sync", "a smaller engine (--gpu-memory-utilization "
     "{util}, or a fixed --kv-cache-memory-gb); less trainer state beside it: --offload-optimizer, --offload-params, "
     "--lora-rank"),
    (("collect_rollouts", "generate_and_score", "generate"), "generation", "a smaller engine (--gpu-memory-utilization "
     "{util}, or a fixed --kv-cache-memory-gb, leaving room for its activations); less trainer state beside it: "
     "--offload-optimizer, --offload-params, --precision bf16, --lora-rank"),
]


@contextlib.contextmanager
def oom_explained(ctx, step):
    """Around a training step: out of GPU memory becomes one line (exit 2; UserError) that says in which stage, how
    the card was shared at that moment, and which options move memory there, instead of a traceback per rank."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
            raise
        names = {f.name for f in traceback.extract_tb(e.__traceback__)}
        stage, advice = next(((label, tip) for fns, label, tip in _OOM_STAGES if names & set(fns)),
                             ("a training step", "see README.md, Memory modes"))
        cfg, shares = ctx.cfg, ""
        if torch.cuda.is_available():
            gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
            card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            ballast = sum(t.numel() for t in _BALLAST)
            engine = _engine_bytes(ctx.rollout)  # (allocated in torch's view even while its pages are released)
            trainer = max(torch.cuda.memory_allocated() - engine - ballast, 0)
            awake = "asleep" if getattr(ctx.rollout, "asleep", None) else f"{gib(engine)}"
            shares = (f" (GiB: trainer {gib(trainer)}, engine {awake}, free {gib(torch.cuda.mem_get_info()[0])} of "
                      f"{gib(card - ballast)})")
        tip = advice.format(mb=cfg.max_token_len_per_device, util=cfg.gpu_memory_utilization)
        raise UserError(f"rank {ctx.rank} ran out of GPU memory in step {step + 1}, during {stage}{shares}. "
                        f"What lowers it there: {tip}.", rank_local=True) from None


# ----------------------------------------------------------------------------------------------- comparison
def _flat_checkpoint(path):
    """(model tensors, optimizer state) of a checkpoint folder, read on one process (a temporary torch.save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # only `memory.py compare` reads one
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(path, os.path.join(d, "ck.pt"))
        ck = torch.load(os.path.join(d, "ck.pt"), weights_only=False)
    return ck["model"], ck["optim"]["state"]


def compare_runs(init, amp, others):
    """How far pure-bf16 runs moved compared with an AMP run of the same steps: init the HF state dict the runs
    started from (fp32), amp and others checkpoint folders. Each bf16 run is measured from its own start (init
    rounded to bf16): `carried` = <its movement, AMP's> / |AMP's|^2 (1: all of AMP's step arrived), `rel_err` =
    |its movement - AMP's| / |AMP's|, and with Kahan the same for weights + compensation (what the weights hold)."""
    ref, _ = _flat_checkpoint(amp)
    keys = sorted(ref)
    cat = lambda d, f=lambda t: t.float(): torch.cat([f(d[k]).flatten() for k in keys])  # noqa: E731
    w0 = {"hf." + k: v for k, v in init.items()}
    d_amp = cat(ref) - cat(w0)
    rows = [f"AMP moved |w - w0| = {float(d_amp.norm()):.5f}"]
    for path in others:
        model, state = _flat_checkpoint(path)
        d = cat(model) - cat(w0, lambda t: t.bfloat16().float())
        row = (f"{path}: carried {float(d @ d_amp / (d_amp @ d_amp)):.3f}, "
               f"rel_err {float((d - d_amp).norm() / d_amp.norm()):.3f}, weights moved {float((d != 0).float().mean()):.3f}")
        if all(k in state and "comp" in state[k] for k in keys):
            dc = d + torch.cat([state[k]["comp"].float().flatten() for k in keys])
            row += (f"; weights + compensation: carried {float(dc @ d_amp / (d_amp @ d_amp)):.3f}, "
                    f"rel_err {float((dc - d_amp).norm() / d_amp.norm()):.3f}")
        rows.append(row)
    return "\n".join(rows)


if __name__ == "__main__":  # python memory.py compare AMP_CKPT BF16_CKPT... (the demo's runs: the tiny model's init)
    from transformers import AutoModelForImageTextToText  # as fsdp_actor.load_hf_model (it imports this file)

    if sys.argv[1:2] != ["compare"] or len(sys.argv) < 4:
        sys.exit("usage: python memory.py compare AMP_CHECKPOINT BF16_CHECKPOINT... (runs of the demo model)")
    start = AutoModelForImageTextToText.from_pretrained(tiny_model.build_tiny_model(), dtype=torch.float32).state_dict()
    print(compare_runs(start, sys.argv[2], sys.argv[3:]))


# ----------------------------------------------------------------------------------------------- LoRA
def add_lora(hf, r, alpha, target_modules="all-linear", exclude_modules=r".*visual.*", modules_to_save=""):
    """LoRA through peft, in place: the wrapped Linear layers keep their weight as `<name>.base_layer.weight`
    next to `<name>.lora_A/B.default.weight`, and every parameter outside the adapters is frozen (the vision
    tower too, unless targeted: vLLM takes no LoRA on the vision encoder, so it is excluded by default). The
    PeftModel wrapper is dropped: the trainer keeps calling the HF model, whose layers now carry the adapters.
    `modules_to_save` (peft's): modules trained in full next to the adapters, e.g. lm_head."""
    from peft import LoraConfig, get_peft_model  # peft: slow to import (~3 s)
    targets = target_modules if target_modules == "all-linear" else [t for t in target_modules.split(",") if t]
    peft_model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                                               exclude_modules=exclude_modules or None,
                                               modules_to_save=[m for m in modules_to_save.split(",") if m] or None))
    if not any(p.requires_grad for p in hf.parameters()):
        raise UserError(f"--lora-target-modules {target_modules!r} matched no layer")
    return peft_model  # (merge.py saves adapter folders through it)


def lora_layers(model):
    """{module name: LoRA scale} of the LoRA-wrapped layers ({} without LoRA)."""
    from peft.tuners.lora import LoraLayer  # peft: slow to import (~3 s)
    hf = getattr(model, "hf", model)
    return {n: m.scaling["default"] for n, m in hf.named_modules() if isinstance(m, LoraLayer)}


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model, i.e. the reference policy of a LoRA run: no second copy of the weights."""
    from peft.tuners.lora import LoraLayer  # peft: slow to import (~3 s)
    from peft.utils.other import ModulesToSaveWrapper  # (likewise)
    layers = [m for m in getattr(model, "hf", model).modules() if isinstance(m, (LoraLayer, ModulesToSaveWrapper))]
    # the flag peft's own enable_adapters(False) sets, without its requires_grad switch: FSDP2 fixes each unit's
    # gradient dtypes at its first forward, and the reference pass is often the first (seen on GPU: a bf16
    # gradient then met fp32 master weights)
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m in layers:
            m._disable_adapters = False
