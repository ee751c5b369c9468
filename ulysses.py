"""ulysses.py -- Ulysses sequence parallelism (--ulysses-size K; DeepSpeed-Ulysses, arXiv 2309.14509): the K ranks
of a group train one packed row together, each holding a contiguous 1/K of its tokens (the vision tower runs on all
the row's images on each rank, which keeps the embeddings of its own positions). Around attention an all-to-all trades
a rank's tokens for every token of 1/K of the heads, and back. Every rank gathers the row's log-probs and computes
the same loss; FSDP shards over all ranks. Plain torch.distributed: NCCL on GPUs, gloo on the CPU."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import UserError

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # the VLMs split here (and text LLMs)


def make_group(K):
    """This rank's group: K consecutive ranks (new_group is collective: every rank creates every group). None: K 1."""
    world = dist.get_world_size()
    if K < 1 or world % K:
        raise UserError(f"--ulysses-size {K}: must divide the number of ranks ({world})")
    groups = [dist.new_group(list(range(start, start + K))) for start in range(0, world, K)] if K > 1 else None
    return groups and groups[dist.get_rank() // K]


def check_model(config, K):
    """One line for a model (its config; None: not known yet) that Ulysses cannot split here, before it runs."""
    if config is None or K == 1:
        return
    mt, text = config.model_type, config.get_text_config()
    heads, recurrent = text.num_attention_heads, "linear_attention" in (getattr(text, "layer_types", None) or [])
    if recurrent or getattr(config, "vision_config", None) is not None and mt not in MODEL_TYPES:
        raise UserError(f"--ulysses-size {K}: not built for {mt} (Gated DeltaNet layers carry their state along the "
                        "whole row; other VLMs' own paths are not split); use --ulysses-size 1 (Qwen2-VL, Qwen2.5-VL, "
                        "Qwen3-VL and text LLMs split)")
    if heads % K:
        raise UserError(f"--ulysses-size {K}: must divide the model's {heads} attention heads")


def bounds(n, group):
    """[a, b): this rank's slice of a row of n tokens padded to K equal slices."""
    per = -(-n // dist.get_world_size(group))
    r = dist.get_rank(group)
    return r * per, (r + 1) * per


def shard_inputs(group, module, args, kwargs):
    """The language model's forward pre-hook: the packed row's inputs [1, N, ...] and positions [..., N] -> this
    rank's slice of them; the pads that make N a multiple of K are a sequence of their own (never read)."""
    kw = dict(kwargs)
    key = "inputs_embeds" if kw.get("inputs_embeds") is not None else "input_ids"
    x, n = kw[key], kw[key].shape[1]
    a, b = bounds(n, group)
    pad = (b - a) * dist.get_world_size(group) - n
    kw[key] = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))[:, a:b]  # [1, n/K, ...]
    kw["position_ids"] = F.pad(kw["position_ids"], (0, pad))[..., a:b]  # [1, n/K] or [3, 1, n/K]
    if (vis := kw.get("visual_pos_masks")) is not None:  # Qwen3-VL's deepstack: my vision tokens' features
        first, kw["visual_pos_masks"] = int(vis[:, :a].sum()), F.pad(vis.long(), (0, pad)).bool()[:, a:b]  # [1, n/K]
        mine = int(kw["visual_pos_masks"].sum())
        kw["deepstack_visual_embeds"] = [d[first:first + mine] for d in kw["deepstack_visual_embeds"]]
    if pad:
        for s in ("q", "k"):  # queries' and keys' boundaries: the pads, a sequence of their own
            kw[f"cu_seq_lens_{s}"] = torch.cat([kw[f"cu_seq_lens_{s}"], kw[f"cu_seq_lens_{s}"][-1:] + pad])
            kw[f"max_length_{s}"] = max(kw[f"max_length_{s}"], pad)
        if "kv_index" in kw:  # a shared-prompt row: the pads' keys are themselves
            kw["kv_index"] = torch.cat([kw["kv_index"], torch.arange(n, n + pad, device=kw["kv_index"].device)])
    kw["ulysses"] = group
    return args, kw


def _all_to_all(x, group, to_heads):
    """to_heads: [n, H, D] (my tokens, every head) -> [K n, H/K, D] (every token, my heads); else the inverse."""
    K = dist.get_world_size(group)
    if to_heads:
        n, H, D = x.shape
        send = x.reshape(n, K, H // K, D).transpose(0, 1).contiguous()  # [K, n, H/K, D]: part j to rank j
    else:
        send = x.reshape(K, x.shape[0] // K, *x.shape[1:]).contiguous()  # [K, n, h, D]: rank j's tokens back to it
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: what rank j sent me
    return recv.flatten(0, 1) if to_heads else recv.transpose(0, 1).flatten(1, 2)  # [K n, h, D] / [n, K h, D]


class _AllToAll(torch.autograd.Function):  # its backward: the inverse exchange
    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.args = group, to_heads
        return _all_to_all(x, group, to_heads)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.args[0], not ctx.args[1]), None, None


def to_heads(q, k, v, group):
    """q [n, H, D], k, v [n, Hkv, D] of my tokens -> every token's, my 1/K of the heads. Key/value heads that K does
    not divide are repeated first, as transformers' repeat_kv lays them out (query head h reads h // (H / Hkv))."""
    K = dist.get_world_size(group)
    if k.shape[1] % K:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return [_AllToAll.apply(x, group, True) for x in (q, k, v)]


def to_tokens(out, group):  # the attention's output [N, H/K, D] -> my tokens' [n, H, D]
    return _AllToAll.apply(out, group, False)


class _Gather(torch.autograd.Function):
    """Per-token values of each rank's own targets -> all of them, in the row's target order. Every rank then
    computes the same loss, so the backward keeps only the gradient of this rank's own values."""

    @staticmethod
    def forward(ctx, x, owner, group):
        K, me = dist.get_world_size(group), dist.get_rank(group)
        counts = torch.bincount(owner, minlength=K).tolist()
        parts = [x.new_empty(max(counts)) for _ in range(K)]
        dist.all_gather(parts, F.pad(x, (0, max(counts) - len(x))), group=group)
        out = x.new_empty(len(owner))
        for r in range(K):
            out[owner == r] = parts[r][:counts[r]]
        ctx.mine = owner == me
        return out

    @staticmethod
    def backward(ctx, g):
        return g[ctx.mine], None, None


def gather(x, resp_idx, n, group):
    """x [m]: values at this rank's positions of resp_idx [n_targets] (row of n tokens) -> [n_targets] all ranks'."""
    a, b = bounds(n, group)
    return _Gather.apply(x, resp_idx // (b - a), group)


def gather_samples(samples, group):
    """The group's samples in rank order (each rank's list pickled whole: a prompt's samples still share its record)."""
    if group is None:
        return samples
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, samples, group=group)
    return [s for part in out for s in part]
