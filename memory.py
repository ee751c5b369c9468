"""memory.py -- the memory modes: pure-bf16 training (--precision bf16), host offload of the optimizer state and of
the reference model, LoRA; where the GPU memory goes; the memory model (what a run needs of each GPU: bench.py's
table, the check before loading); out of memory told in one line.

Pure bf16 (README "Memory modes"): a bf16 weight moves only by more than half an ulp, and RL's ~1e-6 updates are
smaller: rounded to nearest (`nearest`) the model never trains. `stochastic` rounds up or down at random (seeded per
seed, step, parameter, rank: exact resume); `kahan` keeps the remainder in a bf16 buffer for the next update (the
default). The moments meet the same trap. Each rank steps its own shard (`local`): no communication."""
import contextlib
import hashlib
import math
import os
import resource
import traceback
from dataclasses import asdict

import torch
import torch.distributed as dist

import families
import presets
import tiny_moe
import varlen
from common import LORA_EXCLUDE, UserError, all_reduce_cpu
from config import bf16_compute

# bytes per parameter of the policy's state (weights, gradients, AdamW's two moments), per --precision
STATE_BYTES = {"amp": dict(weights=4, grads=4, optim=8), "bf16": dict(weights=2, grads=2, optim=4)}
KAHAN_BYTES = 2  # bytes more per parameter: pure bf16 with Kahan's compensation
CHUNK = 1 << 24  # elements per piece of the fp32 scratch: bounds the step's extra memory to ~6 x 64 MB


def local(t):
    """The rank's own shard of a DTensor (a view: writes go to the parameter), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def stochastic_round_(dst, src, generator):
    """dst (bf16) <- src (fp32) rounded stochastically: add random bits to src's low 16 bits (a bf16 value is an
    fp32 one with them 0), then clear them; the carry happens with the probability of src's way to the next bf16
    value, symmetric in sign. E[dst] = src."""
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
    """One AdamW step on flat bf16 tensors p, g, m, v (and comp, the Kahan buffer, or None), in place: the math of
    torch.optim.AdamW in fp32 scratch, a chunk at a time, the new w stored into bf16 by `rounding`."""
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
    """AdamW on bf16 parameters and state (adamw_bf16_update). An Optimizer so that the LR scheduler, clipping and
    torch.distributed.checkpoint work unchanged: its state is keyed and named like torch.optim.AdamW's."""

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
                    for k in ("exp_avg", "exp_avg_sq") + ("comp",) * (self.rounding == "kahan"):
                        st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
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
# vLLM's sleep-mode pool (a torch MemPool) stays allocated asleep: the trainer's peak is torch's less the pool's bytes
BALLAST = []  # benchmarks/bench.py --gpu-memory-cap-gb: memory taken away to emulate a smaller card (not the trainer's)

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
    pool = _engine_bytes(engine) + sum(t.numel() for t in BALLAST)
    peak = max(torch.cuda.max_memory_allocated() - pool, 0) / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def metrics(engine, peaks, step_metrics):
    """memory/* of one step. peaks: phase -> phase_peak_gb (gen, ref, update). The engine: its pool, what else it
    keeps (engine_built), and what it took on waking. On CPU: the host's peak RSS only."""
    out = {"memory/host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if not torch.cuda.is_available():
        return out
    phases = {k: v for k, v in peaks.items() if k != "start"}
    out.update({f"memory/trainer_peak_{k}_gb": v for k, v in phases.items()})
    out["memory/trainer_peak_gb"] = max(phases.values())
    out["memory/engine_pool_gb"] = engine.pool_bytes() / 2**30
    out["memory/engine_other_gb"] = getattr(engine, "other_bytes", 0) / 2**30
    out["memory/engine_awake_gb"] = (step_metrics["memory/free_engine_asleep_gb"]
                                     - step_metrics["memory/free_engine_awake_gb"])
    # torch's view, as logged before (the engine's pool included; a bench.py ballast left out)
    out["memory/gpu_peak_allocated_gb"] = max(phases.values()) + _engine_bytes(engine) / 2**30
    out["memory/gpu_reserved_gb"] = torch.cuda.memory_reserved() / 2**30
    return out


def host_bytes_to_come(cfg, model, engine):
    """Host memory (bytes, this rank) the offload modes take after setup (what is there already is out of
    MemAvailable): the optimizer's state, with --offload-params the gradients, a level-1 sleeping engine's weights."""
    n = sum(local(p).numel() for p in model.parameters() if p.requires_grad)
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
    """With --offload-params / --offload-optimizer, one line at setup (every rank: collective) when a node's host
    memory cannot hold what the offloaded state takes at the first step, not the kernel killing the ranks later."""
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


# ------------------------------------------------------------------------- the memory model (README "Memory modes")
GIB = 2**30


def dims_from_config(cfg):
    """Parameter counts and the dimensions activations scale with, of a VLM's or text LLM's config (meta device)."""
    t = cfg.get_text_config()
    params = presets.count_params(cfg)
    H, kv = t.hidden_size, t.num_key_value_heads / t.num_attention_heads
    E = getattr(t, "num_experts", 0) or 0
    # MoE: a layer (one FSDP unit) holds all E experts (3 x H x I') and the router (E x H); a token's MLP intermediates
    # are its k experts', k x I' wide. Gemma 4: double-wide MLPs in the KV-sharing layers; per-layer inputs (ple wide)
    # from a [vocab, L x ple] table in the root unit; an audio tower never run (`idle`: weights only)
    wide = 2 if getattr(t, "use_double_wide_mlp", False) and getattr(t, "num_kv_shared_layers", 0) else 1
    inter = t.num_experts_per_tok * t.moe_intermediate_size if E else t.intermediate_size * wide
    mlp = 3 * H * t.moe_intermediate_size * E + H * E if E else 3 * H * inter
    # q, o: H x heads x head_dim (the layers' mean where they differ: Gemma 4); k, v: H x kv of that; the MLP
    layer = 2 * H * t.num_attention_heads * sum(families.head_dims(t)) / t.num_hidden_layers * (1 + kv) + mlp
    ple = getattr(t, "hidden_size_per_layer_input", 0) or 0
    # Gated DeltaNet (Qwen3.5) on the plain-torch path: its chunked rule keeps fp32 intermediates of every chunk for the
    # backward, `gdn` = 4 Hv (9 (K + V) + K V / 64 + 360) bytes a token (fitted to its saved tensors; the 9B's 365 KiB)
    hv, dk, dv = (getattr(t, "linear_" + n, 0) or 0 for n in ("num_value_heads", "key_head_dim", "value_head_dim"))
    return dict(params=params, hidden=t.hidden_size, inter=inter, layers=t.num_hidden_layers, moe=bool(E), experts=E,
                expert_inter=t.moe_intermediate_size if E else 0, vocab=t.vocab_size, kv_frac=kv, layer_params=layer,
                root_params=t.vocab_size * t.hidden_size * (1 if cfg.tie_word_embeddings else 2)
                + getattr(t, "vocab_size_per_layer_input", 0) * t.num_hidden_layers * ple, ple=ple,
                idle=params - presets.count_params(type(cfg).from_dict({**cfg.to_dict(), "audio_config": None}))
                if getattr(cfg, "audio_config", None) else 0,
                softcap=bool(getattr(t, "final_logit_softcapping", None)), heads=t.num_attention_heads,
                kv_width=t.num_key_value_heads * sum(families.head_dims(t)) / t.num_hidden_layers,
                gdn=4 * hv * (9 * (dk + dv) + dk * dv / 64 + 360))


def memory_model(dims, precision="amp", lora_rank=0, kahan=True, world=1, offload_params=False,
                 offload_optimizer=False, kl_coef=1e-2, mb_tokens=16384, chunk=4096, engine_gb=0.0, lp_tokens=None,
                 recompute=1.0, lora_experts=False):
    """GiB per GPU by phase: the policy's state (STATE_BYTES; LoRA: a frozen base, the adapters' state) and the bf16
    reference (kl_coef > 0 without LoRA), sharded over `world`; the largest units all-gathered in bf16; a micro-batch
    of `mb_tokens` per rank (`lp_tokens` in the log-prob passes; `recompute`: the layers' share that recompute)."""
    P, H, L = dims["params"], dims["hidden"], dims["layers"]
    b = dict(STATE_BYTES[precision])
    if precision == "bf16" and kahan:
        b["optim"] += KAHAN_BYTES
    if lora_rank:  # all-linear adapters on the language model: r x (in + out) per projection
        # q, o: H + H; k, v: H + kv H; gate, up, down: H + I (MoE: attention only, its experts are not nn.Linear)
        adapters = lora_rank * L * (4 * H + 2 * H * (1 + dims["kv_frac"])
                                    + (0 if dims.get("moe") else 3 * (H + dims["inter"])))
        if lora_experts:  # --lora-target-experts: per expert, gate_up [2I', H]: H + 2I'; down [H, I']: I' + H
            adapters += lora_rank * L * dims["experts"] * (2 * H + 3 * dims["expert_inter"])
        train, base = adapters, P * b["weights"]
    else:
        train, base = P - dims.get("idle", 0), dims.get("idle", 0) * b["weights"]
    weights = base + train * b["weights"]
    grads, optim = train * b["grads"], train * b["optim"]
    ref = 2 * P if kl_coef > 0 and not lora_rank else 0
    on_gpu = lambda x, off: 0 if off else x / world  # noqa: E731
    gathered = 2 * (dims["root_params"] + 2 * dims["layer_params"])  # bf16 all-gathered units
    # The update: checkpointing keeps each layer's bf16 input, and on top either one layer recomputed with its
    # gradient or a chunk of fp32 logits with its softmax and gradient (never alive together: summing them overshot
    # the 3B's update by 47 %). Gemma 4: each layer's per-layer input too; soft-capped logits one more chunk (`head`)
    ckpt, head = mb_tokens * 2 * L * (H + 2 * dims.get("ple", 0)), 4 * chunk * dims["vocab"]
    # --checkpoint-layers: a layer that does not recompute keeps its activations (`layer` bytes a token: a GDN layer's
    # where larger, on the plain path) from forward to backward; all of them are alive when the backward starts
    plain = dims.get("gdn") and not (torch.cuda.is_available() and varlen.fla_kernels() and varlen.fla_trains(
        int(os.environ.get("LOCAL_RANK", "0"))))
    layer = max(2 * (4 * H + 3 * dims["inter"]), dims["gdn"] if plain else 0)
    kept = (L - math.ceil(round(recompute * L, 6))) * mb_tokens * layer
    act_update = ckpt + kept + max(mb_tokens * 2 * layer, (3 + dims.get("softcap", 0)) * head)
    # a no-grad forward keeps nothing from layer to layer: its peak is inside one MLP (gate, up and their product,
    # bf16) beside the residual stream's input and output, or at the head, a chunk of fp32 logits and their softmax
    act_fwd = max((lp_tokens or mb_tokens) * 2 * (3 * dims["inter"] + 2 * H), (2 + dims.get("softcap", 0)) * head)
    resident = on_gpu(weights, offload_params) + on_gpu(optim, offload_params or offload_optimizer)
    # --offload-optimizer: the state comes in for the optimizer step, after the backward freed its activations
    # (with --offload-params the step runs on the host)
    step_in = on_gpu(optim, offload_params) if offload_optimizer else 0
    parts = dict(weights=on_gpu(weights, offload_params) / GIB, grads=on_gpu(grads, offload_params) / GIB,
                 optim=on_gpu(optim, offload_params) / GIB, ref=on_gpu(ref, offload_params) / GIB,
                 gathered=gathered / GIB, act_update=act_update / GIB, engine=engine_gb)
    ref_gpu = ref / world  # with --offload-params it comes in for its pass
    gen = (resident + on_gpu(ref, offload_params)) / GIB
    update = (resident + on_gpu(grads, offload_params) + on_gpu(ref, offload_params)
              + max(gathered + act_update, step_in)) / GIB
    return dict(gen=gen, ref=(resident + ref_gpu + gathered + act_fwd) / GIB, update=update, engine=engine_gb,
                peak=max(gen + engine_gb, update), parts=parts)


ENGINE_LEAST_GIB = 4.5  # vLLM beside its weights at its least (2026-12-01's 7B: 15.7 GiB of weights, 20.7 awake)


def need_gib(m, dims, world):
    """What a memory_model() cell needs of each GPU with the engine at its least (tensor-parallel over the cell's
    GPUs, ENGINE_LEAST_GIB beside its bf16 weights) while generating, or in the update (the engine asleep)."""
    engine = 2 * dims["params"] / min(world, 8) / GIB + ENGINE_LEAST_GIB
    return max(m["gen"] + engine, m["update"])


TOKENS_PER_SAMPLE = 1470  # the geo3k-like workload: ~324 image + ~120 text prompt tokens + 1024 response tokens
PROMPT_TOKENS = TOKENS_PER_SAMPLE - 1024


def config_mode(c, world):
    """memory_model()'s keywords for a run's config (grpo.Config as a dict) on `world` ranks: its state, and
    micro-batches of as many bench samples (PROMPT_TOKENS + max_response_length) as its limits let a rank take."""
    tokens = PROMPT_TOKENS + c["max_response_length"]
    # --ulysses-size K: a group's K ranks train their samples together, rows of K x the token bound, 1/K on each rank
    K = c.get("ulysses_size", 1)
    per_rank = c["rollout_batch_size"] * c["n"] // world * K
    fit = max(1, min(per_rank, c["micro_batch_size_per_device"], K * c["max_token_len_per_device"] // tokens))
    lp = c.get("logprob_max_token_len_per_device")  # (.get: bench summaries written before these options)
    lp_fit = max(1, min(per_rank, K * lp // tokens)) if lp else fit  # (no sample cap: grpo.logprob_bounds)
    return dict(precision=c["precision"], lora_rank=c["lora_rank"], kahan=c["bf16_rounding"] == "kahan", world=world,
                lora_experts=c.get("lora_target_experts", False),
                offload_params=c["offload_params"], offload_optimizer=c["offload_optimizer"], kl_coef=c["kl_coef"],
                mb_tokens=fit * tokens / K, chunk=c["logprob_chunk_size"], lp_tokens=lp_fit * tokens / K,
                recompute=0.0 if not c.get("gradient_checkpointing", True)  # auto: at most every layer recomputes
                else 1.0 if c.get("checkpoint_layers") == "auto" else c.get("checkpoint_layers", 1.0))


def check_fits(c, dims, world, card_gib, what, slack=0.1):
    """One line (a UserError: how many such GPUs, which --ulysses-size, or which smaller micro-batches or modes hold
    it) when by the memory model the run needs more than `world` GPUs of `card_gib` by over `slack`."""
    cell = lambda cc, w: need_gib(memory_model(dims, **config_mode(cc, w)), dims, w)  # noqa: E731
    if (need := cell(c, world)) <= (card_gib - 1) * (1 + slack):
        return
    K = c.get("ulysses_size", 1)  # more GPUs, or (long responses: one sample a micro-batch) a larger --ulysses-size
    fits = next(((w, k) for w in (world, 2, 4, 8, 16, 32, 64) for k in (1, 2, 4, 8) if w >= world and w % k == 0
                 and (w, k) > (world, K) and (k == 1 or not dims["gdn"] and dims["heads"] % k == 0)
                 and cell({**c, "ulysses_size": k}, w) <= card_gib - 1), None)
    mode = " ".join([f"--precision {c['precision']}"] + [f"--lora-rank {c['lora_rank']}"] * bool(c["lora_rank"])
                    + ["--offload-params"] * c["offload_params"] + ["--offload-optimizer"] * c["offload_optimizer"])
    tok = next((t for t in (c["max_token_len_per_device"] >> k for k in range(1, 7)) if t >= PROMPT_TOKENS
                + c["max_response_length"] and cell({**c, "max_token_len_per_device": t}, world) <= card_gib - 1), 0)
    less = [f"--max-token-len-per-device {tok}"] * bool(tok) + [flag for flag, on in (
        ("--lora-rank 64", c["lora_rank"]), ("--precision bf16", c["precision"] == "bf16"),
        ("--offload-params", c["offload_params"])) if not on]
    w, k = fits or (0, 1)
    where = "not even 64 such GPUs hold it" if fits is None else (f"it takes {w} such GPUs (" + (
        f"torchrun --nproc_per_node {w})" if w <= 8 else "several nodes)") if w > world else "these GPUs hold it") + (
        f" with --ulysses-size {k}" if k > 1 else "")
    raise UserError(f"{what} with {mode} needs about {need:.0f} GiB per GPU on {world} GPU{'s' * (world > 1)} (the "
                    f"memory model, README \"Memory modes\"), more than a {card_gib:.0f} GiB GPU holds: {where}"
                    + (f"; or less per GPU: {', '.join(less)}" if less else ""))


def engine_max_seqs(c, dims, card_gib, long=8192):
    """vLLM's max_num_seqs for answers of `long` tokens and more: as many whole sequences as its KV cache holds
    (bf16 keys and values of every layer; --kv-cache-memory-gb, else its share of the card less its weights and ~2
    GiB), so that none is preempted halfway; None at vLLM's default (256) or more, or unknown (CPU, GDN models)."""
    if dims is None or card_gib is None or dims["gdn"] or c["max_response_length"] < long:
        return None
    tp = c["tensor_parallel_size"]
    pool = c["kv_cache_memory_gb"] or card_gib * c["gpu_memory_utilization"] - 2 * dims["params"] / tp / GIB - 2
    per_seq = 2 * 2 * dims["layers"] * dims["kv_width"] * (c["max_prompt_length"] + c["max_response_length"])
    seqs = max(1, int(pool * GIB * tp // per_seq))
    return seqs if seqs < 256 else None


def known_dims(model_path, config=None):
    """dims_from_config of the model a run starts from when known before loading (presets.known_config, or `config`
    read already); None for any other (no check: a guess could stop a run that fits)."""
    cfg = config or presets.known_config(model_path)
    try:
        return None if cfg is None else dims_from_config(cfg)
    except (AttributeError, ValueError, TypeError):  # a model whose config lacks what the memory model reads
        return None


def rows_padded(cfg, model_config):
    """Whether the policy will train on padded rows, decided before loading as varlen.use_varlen_attention decides
    after (on the CPU the fast kernel is taken as present and auto as bf16: nothing trains at this share there)."""
    fast = cfg.attn_implementation is None and bf16_compute(cfg, cuda=True) and (  # (LOCAL_RANK: not set yet)
        not torch.cuda.is_available() or varlen._fast_varlen_kernel(int(os.environ.get("LOCAL_RANK", "0"))) is not None)
    return not varlen.varlen_choice(model_config, cfg.padding_free, "off", fast)["text"]


def this_gpu_gib():
    """This rank's GPU's memory in GiB (less bench.py's ballast, which stands for a smaller card); None on the CPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
    return (props.total_memory - sum(t.numel() for t in BALLAST)) / GIB


def auto_checkpoint_layers(c, dims, world, card_gib, error=0.15):
    """--checkpoint-layers auto: the smallest share of the decoder layers that recompute (k of L) with which the
    memory model's update (the engine asleep), grown by its error bound, fits `card_gib` less ~1 GiB; else 1."""
    L = dims["layers"]
    for k in range(L + 1):
        m = memory_model(dims, **config_mode({**c, "checkpoint_layers": k / L}, world))
        if m["update"] * (1 + error) <= card_gib - 1:
            return k / L
    return 1.0


def resolve_checkpoint_layers(cfg, world, card_gib=None):
    """(share, note: a line for the log) of --checkpoint-layers: a number as given; `auto` by auto_checkpoint_layers
    on this rank's GPU, or 1 without a known model or card, and for padded rows (the packed share ran out of memory)."""
    if cfg.checkpoint_layers != "auto":
        return float(cfg.checkpoint_layers), ""
    model_config = presets.known_config(cfg.model_path) if cfg.gradient_checkpointing else None
    dims = known_dims(cfg.model_path, model_config) if model_config is not None else None
    card_gib = card_gib or this_gpu_gib()
    padded = dims is not None and card_gib is not None and rows_padded(cfg, model_config)
    if dims is None or card_gib is None or padded:
        why = "gradient checkpointing is off" if not cfg.gradient_checkpointing else (
            "no GPU" if card_gib is None else "the memory model does not know this model" if dims is None else
            "padded rows: the memory model knows packed ones")
        return 1.0, f"--checkpoint-layers auto: every layer recomputes ({why})"
    share = auto_checkpoint_layers(asdict(cfg), dims, world, card_gib)
    update = memory_model(dims, **config_mode({**asdict(cfg), "checkpoint_layers": share}, world))["update"]
    return share, (f"--checkpoint-layers auto: {round(share * dims['layers'])} of {dims['layers']} decoder layers "
                   f"recompute ({share:.3f}); the update needs {update:.1f} GiB of {card_gib:.1f} by the memory model")


def check_before_loading(cfg, world, card_gib=None):
    """grpo.setup's check before anything loads (check_fits; on the CPU, or for a model known_dims does not know,
    none): one line naming the GPUs it takes, not out of memory after minutes of loading."""
    card_gib = card_gib or this_gpu_gib()
    dims = known_dims(cfg.model_path)
    if dims is not None and card_gib is not None:
        check_fits(asdict(cfg), dims, world, card_gib, f"--model-path {cfg.model_path}")


# Where in a step memory ran out (the first stage with one of its functions in the traceback), and what moves it there
_OOM_STAGES = [
    (("update_policy",), "the policy update", "fewer tokens per micro-batch (--max-token-len-per-device {mb}), more "
     "recomputed layers ({ck}) or a smaller --logprob-chunk-size; less state: --precision bf16, "
     "--lora-rank, --offload-optimizer, --offload-params"),
    (("compute_logprobs",), "the log-prob passes", "fewer tokens per micro-batch (--logprob-max-token-len-per-device "
     "{lp}) or a smaller --logprob-chunk-size; a host-side reference: --offload-params"),
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
            ballast = sum(t.numel() for t in BALLAST)
            engine = _engine_bytes(ctx.rollout)  # (allocated in torch's view even while its pages are freed)
            trainer = max(torch.cuda.memory_allocated() - engine - ballast, 0)
            awake = "asleep" if getattr(ctx.rollout, "asleep", None) else f"{gib(engine)}"
            shares = (f" (GiB: trainer {gib(trainer)}, engine {awake}, free {gib(torch.cuda.mem_get_info()[0])} of "
                      f"{gib(card - ballast)})")
        tip = advice.format(mb=cfg.max_token_len_per_device, util=cfg.gpu_memory_utilization,
                            lp=cfg.logprob_max_token_len_per_device or cfg.max_token_len_per_device,
                            ck=f"--checkpoint-layers {cfg.checkpoint_layers}" if cfg.gradient_checkpointing
                            else "--gradient-checkpointing")
        raise UserError(f"rank {ctx.rank} ran out of GPU memory in step {step + 1}, during {stage}{shares}. "
                        f"What lowers it there: {tip}.", rank_local=True) from None


# ----------------------------------------------------------------------------------------------- LoRA
def add_lora(hf, r, alpha, target_modules="all-linear", exclude_modules=LORA_EXCLUDE, modules_to_save="",
             target_experts=False):
    """LoRA through peft, in place: all but the adapters frozen (the vision tower too unless targeted: vLLM takes no
    LoRA on it); the trainer calls the HF model, the PeftModel is for merge.py. `target_experts`: the MoE's 3-D ones."""
    from peft import LoraConfig, get_peft_model  # peft: slow to import (~3 s)
    targets = target_modules if target_modules == "all-linear" else [t for t in target_modules.split(",") if t]
    experts = tiny_moe.expert_parameters(hf) if target_experts else None
    if target_experts and not experts:  # an error, not a silent no-op: the flag asks for adapters it cannot have
        raise UserError(f"--lora-target-experts: {type(hf).__name__} has no MoE experts (fused 3-D expert tensors)")
    peft_model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                                               target_parameters=experts, exclude_modules=exclude_modules or None,
                                               modules_to_save=[m for m in modules_to_save.split(",") if m] or None))
    if not any(p.requires_grad for p in hf.parameters()):
        raise UserError(f"--lora-target-modules {target_modules!r} matched no layer")
    return peft_model


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
    # the flag peft's own enable_adapters(False) sets, without its requires_grad switch: FSDP2 fixes a unit's gradient
    # dtypes at its first forward, often the reference pass (seen on GPU: bf16 gradients met fp32 master weights)
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m in layers:
            m._disable_adapters = False
