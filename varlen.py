"""varlen.py -- the trainer's fast kernels (fsdp_actor.py): variable-length attention for the vision tower's windows
(one call per layer) and for packed rows of the language model; the per-chunk log-probs with their own backward
(ChunkLogProbs); norms, MLPs, rotary and log-prob functions compiled into fused kernels. Every fast path falls back
by itself: a CUDA kernel (torch's varlen_attn, else flash-attn 2) only if it matches the plain reference here
(probed once), else the reference (one SDPA call, a block-diagonal mask)."""
import functools
import inspect
import sys
import types
import warnings

import torch
import torch.nn.functional as F

import ulysses


# Both paths hand transformers' attention one call over many sequences (cu_seqlens [S + 1], int32):
#  - the vision tower: Qwen2-VL / Qwen2.5-VL pass cu_seqlens only to an attention whose name contains "flash"
#    (Qwen2_5_VLVisionAttention.forward, transformers 5.17-5.25): the vision config gets ours under such a name;
#  - packed rows: the text config gets ours under a plain name; the boundaries travel as the cu_seq_lens_q/k,
#    max_length_q/k keywords of every attention call, and a name unknown to the mask interface builds no [T, T] mask.
# The vision name is set on its config (from 5.25 set_attn_implementation loads a "flash" name as a Hub kernel).
VARLEN_TEXT, VARLEN_VISION = "vlm_rl_varlen", "vlm_rl_flash_varlen"


def varlen_attention(q, k, v, cu_seqlens, max_len, causal, scale=None, cu_k=None, max_k=None):
    """q [N, H, D], k/v [N, Hkv, D] (Hkv divides H), sequences back to back -> [N, H, D]: a fast kernel on CUDA in
    bf16/fp16 where one works, else the reference. cu_k, max_k: keys of their own boundaries, each sequence's queries
    causally aligned at the end of its keys (a shared prompt's keys before a response's own)."""
    cu_k, max_k = (cu_seqlens, max_len) if cu_k is None else (cu_k, max_k)
    kernel = _fast_varlen_kernel(q.device.index) if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    if kernel is not None:
        return kernel(q, k, v, cu_seqlens, cu_k, max_len, max_k, causal, scale)
    return reference_varlen_attention(q, k, v, cu_seqlens, causal, scale, cu_k)


def reference_varlen_attention(q, k, v, cu_seqlens, causal, scale=None, cu_k=None):
    """Plain PyTorch, the same math: one SDPA call with a block-diagonal (causal: aligned at each sequence's end)
    mask (O(N^2) memory: the CPU path, the tests' reference); past 8192 tokens one call per sequence."""
    cu_k = cu_seqlens if cu_k is None else cu_k
    gqa = k.shape[1] != q.shape[1]
    if q.shape[0] > 8192:
        out = []
        for a, b, c, d in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            mask = torch.ones(b - a, d - c, dtype=torch.bool, device=q.device).tril(d - c - (b - a)) if causal else None
            out.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                      v[c:d].transpose(0, 1), attn_mask=mask, scale=scale,
                                                      enable_gqa=gqa).transpose(0, 1))
        return torch.cat(out)

    def segments(cu):  # [n] each token's sequence, and its place in it
        lens = (cu[1:] - cu[:-1]).to(q.device)
        seg = torch.repeat_interleave(torch.arange(len(lens), device=q.device), lens)
        return seg, torch.arange(len(seg), device=q.device) - cu.to(q.device)[seg], lens

    sq, pq, lq = segments(cu_seqlens)
    sk, pk, lk = segments(cu_k)
    mask = sq[:, None] == sk[None, :]  # [Nq, Nk]
    if causal:  # query j of a sequence sees its first j + 1 + (keys - queries) keys
        mask &= pk[None, :] <= (pq + (lk - lq)[sq])[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=scale, enable_gqa=gqa)  # [H, N, D]
    return out.transpose(0, 1)


def _torch_varlen_kernel():
    """torch.nn.attention.varlen.varlen_attn (torch >= 2.10). Its keywords moved between versions: 2.10 took
    is_causal, 2.11 takes window_size=(-1, 0) for causal and has no GQA flag, 2.13 adds enable_gqa."""
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10 only (the caller skips a kernel that fails)
    params = inspect.signature(varlen_attn).parameters

    def kernel(q, k, v, cu, cu_k, max_len, max_k, causal, scale):
        kw = {"scale": scale}
        if causal:
            kw.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:  # query head h reads kv head h // (H / Hkv), as transformers' repeat_kv lays them out
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu, cu_k, max_len, max_k, **kw)
    return kernel


def _flash_attn_kernel():
    from flash_attn import flash_attn_varlen_func  # flash-attn 2 (GQA built in)

    def kernel(q, k, v, cu, cu_k, max_len, max_k, causal, scale):
        return flash_attn_varlen_func(q, k, v, cu, cu_k, max_len, max_k, softmax_scale=scale, causal=causal)
    return kernel


@functools.cache
def _fast_varlen_kernel(device_index):
    """The first kernel that imports *and* matches the reference (forward and backward, causal and not, GQA, an odd
    head size) on this device; None if none does. A kernel that fails here is skipped with a warning, never used."""
    device = torch.device("cuda", device_index)
    for make in (_torch_varlen_kernel, _flash_attn_kernel):
        try:
            kernel = make()
        except (ImportError, AttributeError):
            continue
        try:
            _check_kernel(kernel, device)
            return kernel
        except Exception as e:  # noqa: BLE001 -- any failure means: do not use this kernel
            warnings.warn(f"varlen attention kernel {make.__name__} unusable here ({str(e)[:300]}); skipping it")
    return None


def _check_kernel(kernel, device):
    """Three sequences (5, 11, 31 queries): output and input gradients within bf16 rounding of the fp32 reference,
    causal and not, GQA, an odd head size, and keys of their own lengths (a shared prompt: causal from the end)."""
    g = torch.Generator(device=device).manual_seed(0)
    cu = torch.tensor([0, 5, 16, 47], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5, 23, 63], dtype=torch.int32, device=device)  # 0, 7 and 9 keys before the queries
    for causal, hkv, dim, ck in ((True, 2, 128, cu), (False, 4, 80, cu), (True, 2, 128, cu_k)):
        x = [torch.randn(int(c[-1]), h, dim, device=device, generator=g) for h, c in ((4, cu), (hkv, ck), (hkv, ck))]
        fast = [t.to(torch.bfloat16).requires_grad_() for t in x]
        ref = [t.clone().requires_grad_() for t in x]
        out = kernel(*fast, cu, ck, 31, int((ck[1:] - ck[:-1]).max()), causal, dim ** -0.5)
        want = reference_varlen_attention(*ref, cu, causal, dim ** -0.5, ck)
        w = torch.randn(want.shape, device=device, generator=g)
        (out.float() * w).sum().backward()
        (want * w).sum().backward()
        got, exp = [out] + [t.grad for t in fast], [want] + [t.grad for t in ref]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, exp):
            err = float((a.float() - b).detach().norm() / b.detach().norm())
            if not err < 2e-2:
                keys = "own key boundaries" if ck is cu_k else "the queries' boundaries"
                raise RuntimeError(f"{name} differs from the reference by {err:.3g} (relative; causal={causal}; "
                                   f"{keys})")


def use_varlen_attention(hf, device, param_dtype, attn_implementation, padding_free="auto", vision_varlen="auto"):
    """Resolve the two options to {"text": bool, "vision": bool} for this model and device."""
    fast = (device.type == "cuda" and param_dtype in (torch.bfloat16, torch.float16) and attn_implementation is None
            and _fast_varlen_kernel(device.index if device.index is not None else torch.cuda.current_device())
            is not None)
    return varlen_choice(hf.config, padding_free, vision_varlen, fast)


def varlen_choice(config, padding_free, vision_varlen, fast):
    """use_varlen_attention's choice for a model's config; fast: a fast kernel runs here, in the compute dtype, with
    no --attn-implementation (before loading, memory.py asks this with fast taken from the options)."""
    for name, v in (("padding_free", padding_free), ("vision_varlen", vision_varlen)):
        if v not in ("auto", "on", "off"):
            raise ValueError(f"{name}={v!r}: choose auto, on or off")
    mt = config.model_type
    has_vision = getattr(config, "vision_config", None) is not None
    qwen3 = mt in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # (Qwen3.5: GDN boundaries, gdn_forward)
    # Qwen3-VL-MoE packs only when asked ("on"): its packed rows were never run on a GPU (the dense Qwen3-VL's were:
    # tests/test_varlen_gpu.py and the 8B bench, benchmarks/BENCHMARKS.md, 2026-12-02)
    unproven = mt == "qwen3_vl_moe"
    can = {"text": mt in ("qwen2_vl", "qwen2_5_vl") or qwen3 or not has_vision,
           "vision": mt in ("qwen2_vl", "qwen2_5_vl")}
    who = {"text": "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and text LLMs are", "vision": "Qwen2-VL and Qwen2.5-VL are"}
    out = {}
    for key, v, flag in (("text", padding_free, "--padding-free"), ("vision", vision_varlen, "--vision-varlen")):
        if v == "on" and not can[key] and (key == "text" or has_vision):  # no vision tower: nothing to switch
            raise ValueError(f"{flag} on: not supported for model_type {mt!r} ({who[key]}); use {flag} off or auto")
        out[key] = can[key] and (v == "on" or (v == "auto" and fast and not (unproven and key == "text")))
    return out


def set_varlen_attention(hf, text=False, vision=False):
    """Select our varlen function for the language model (packed rows) and/or the vision tower (one call per layer)."""
    from transformers import AttentionInterface  # slow to import (~2 s): only once a model is loaded
    AttentionInterface.register(VARLEN_TEXT, _hf_varlen_attention)
    AttentionInterface.register(VARLEN_VISION, _hf_varlen_attention)
    subs = getattr(hf.config, "sub_configs", None) or {}
    if "text_config" not in subs:  # a text LLM: one config
        return hf.set_attn_implementation(VARLEN_TEXT)
    if text:
        hf.set_attn_implementation({"text_config": VARLEN_TEXT})
    if vision:  # (last: from 5.25, set_attn_implementation re-checks every sub-model's name: it would fail on this)
        hf.config.vision_config._attn_implementation = VARLEN_VISION  # the vision model shares this config object


def _hf_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: query [1, H, N, D], key/value [1, Hkv, N, D] -> ([1, N, H, D],
    None). Without cu_seqlens (an ordinary padded call) it is transformers' own SDPA function."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # transformers: slow to import
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention expects one packed row, got a batch of {query.shape[0]}")
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [N, H, D]
    sp = kwargs.get("ulysses")  # sequence parallel: my tokens, every head -> every token, my heads (and back below)
    if sp is not None:
        q, k, v = ulysses.to_heads(q, k, v, sp)
    kv = kwargs.get("kv_index")  # a shared-prompt row (fsdp_actor.collate): each response's keys are its prompt's
    if kv is not None:           # and its own, gathered into a sequence of their own
        k, v = k.index_select(0, kv), v.index_select(0, kv)  # [Nk, Hkv, D]
        out = varlen_attention(q, k, v, cu.to(torch.int32), int(max_len), causal, scaling,
                               kwargs["cu_seq_lens_k"].to(torch.int32), int(kwargs["max_length_k"]))
    elif kwargs.get("max_length_k", max_len) != max_len:  # keys of their own boundaries, but no index to gather them
        raise RuntimeError("a shared-prompt row reached the attention without its kv_index (did this transformers "
                           "version drop the keyword?); train with --no-share-prompts")
    else:
        out = varlen_attention(q, k, v, cu.to(torch.int32), int(max_len), causal, scaling)
    return (out if sp is None else ulysses.to_tokens(out, sp))[None], None


def packed_layout(plens, rlens, owner, share=True):
    """The samples of a micro-batch in one packed row; with `share`, each distinct prompt once, then its samples'
    responses (exact: a response attends to its prompt's keys, gathered by kv_index, and its own, causally):
        unshared  p p p r r p p p r r r        shared  p p p r r r r r      (one prompt, two samples)
    plens: each distinct prompt's length; rlens, owner: each sample's response length and prompt. Returns (pieces:
    (sample, start, end) slices of the samples' sequences, back to back; resp_idx [n]: the row positions that
    predict each sample's response tokens; the attention's keywords: cu_seq_lens_q/k, max_length_q/k, kv_index)."""
    by_prompt = {}  # the row's groups: a prompt and its samples (unshared: each sample alone, its own prompt copy)
    for i, g in enumerate(owner):
        by_prompt.setdefault(g if share else -1 - i, []).append(i)
    pieces, q_lens, k_lens, kv, resp, at = [], [], [], [], [[] for _ in owner], 0
    for g, members in by_prompt.items():  # (a dict keeps the prompts in order of first appearance)
        p0, lp = at, plens[owner[members[0]]]
        if share:  # the prompt, a sequence of its own
            pieces.append((members[0], 0, lp))
            q_lens.append(lp)
            k_lens.append(lp)
            kv.append(torch.arange(p0, p0 + lp))
            at += lp
        for i in members:
            lr = rlens[i]
            if share and lr == 0:
                continue
            first = at if share else at + lp  # where the response starts in the row
            resp[i] = ([p0 + lp - 1] if lr else []) + list(range(first, first + lr - 1))
            pieces.append((i, lp, lp + lr) if share else (i, 0, lp + lr))
            q_lens.append(first + lr - at)
            k_lens.append(lp + lr)
            kv += [torch.arange(p0, p0 + lp), torch.arange(at, at + lr)] if share else []
            at += q_lens[-1]
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(torch.int32)  # noqa: E731
    attn = dict(cu_seq_lens_q=cu(q_lens), cu_seq_lens_k=cu(k_lens), max_length_q=max(q_lens),
                max_length_k=max(k_lens), **({"kv_index": torch.cat(kv)} if share else {}))
    return pieces, torch.tensor([j for r in resp for j in r], dtype=torch.long), attn


# ----------------------------------------------------------------------------------------------- Gated DeltaNet
# Qwen3.5's linear-attention layers carry state along the row (a 4-tap causal conv; the delta rule's state [heads, K,
# V]); transformers' torch path ignores cu_seqlens, so on a packed row sample 2 would start from sample 1's state
# (vLLM runs samples apart). gdn_forward is the layer's math with the boundaries: fla-core's kernels on CUDA, plain
# torch elsewhere (the conv's taps masked at each start; the recurrence on the samples as a right-padded batch).
def gdn_layers(hf):
    return [m for m in hf.modules() if type(m).__name__.endswith("GatedDeltaNet")]


@functools.cache
def fla_kernels():
    """(causal_conv1d, chunk_gated_delta_rule) of fla-core, or None where it does not import (CPU-only machines)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # optional (fla-core): the GPU kernels
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # (likewise)
    except Exception:  # noqa: BLE001 -- ImportError, or Triton failing to find a GPU
        return None
    return causal_conv1d, chunk_gated_delta_rule


@functools.cache
def fla_trains(device_index):
    """Whether fla-core's delta-rule backward runs here: fla-core 0.6 refuses it on Hopper under Triton 3.4-3.7.0,
    which computes it wrong (its issue #640; the H200 image has Triton 3.6). Probed once on a small input."""
    x = [torch.randn(1, 64, 2, 32, device=f"cuda:{device_index}", requires_grad=True) for _ in range(3)]
    g = torch.full((1, 64, 2), -0.1, device=x[0].device, requires_grad=True)
    try:
        out, _ = fla_kernels()[1](*x, g=g, beta=torch.sigmoid(g), use_qk_l2norm_in_kernel=True)
        out.sum().backward()
        return True
    except RuntimeError as e:
        warnings.warn(f"fla-core's delta-rule backward is unusable here ({str(e)[:200]}); the Gated DeltaNet layers "
                      "train on the plain-torch path (correct, slower), their no-grad passes on fla-core")
        return False


def use_gdn_forward(hf, device):
    """Give every Gated DeltaNet layer of hf the boundary-aware forward. Returns "fla", "fla forward" (fla-core
    without its backward: training forwards take the plain path) or "torch"; None: no GDN layer."""
    layers = gdn_layers(hf)
    if not layers:
        return None
    for m in layers:
        m.forward = types.MethodType(gdn_forward, m)
    if device.type == "cuda" and not fla_kernels():
        warnings.warn("fla-core does not import: the Gated DeltaNet layers run on the plain-torch path (correct, "
                      "slower; pip install fla-core)")
    if device.type != "cuda" or not fla_kernels():
        return "torch"
    return "fla" if fla_trains(device.index or 0) else "fla forward"  # (fla_trains warns when it is refused)


def gdn_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """hidden_states [B, T, H] -> [B, T, H]; a packed row (B = 1) has its boundaries in cu_seq_lens_q [S + 1]."""
    if cache is not None or cache_params is not None:  # generation with a cache: transformers' own path
        return type(self).forward(self, hidden_states, cache, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.dim() == 2:  # (as transformers: pads' inputs zeroed)
        hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
    B, T, _ = hidden_states.shape
    cu = kwargs.get("cu_seq_lens_q")  # [S + 1] or None
    fast = hidden_states.is_cuda and fla_kernels() is not None
    w = self.conv1d.weight.squeeze(1)  # [D, W]
    qkv = self.in_proj_qkv(hidden_states)  # [B, T, D] with D = 2 x key_dim + value_dim
    if fast:
        qkv, _ = fla_kernels()[0](qkv, w, self.conv1d.bias, activation="silu",
                                  cu_seqlens=None if cu is None else cu.long())
    else:
        qkv = F.silu(causal_conv_reference(qkv, w, self.conv1d.bias, cu))
    q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = (x.reshape(B, T, -1, self.head_k_dim) for x in (q, k))  # [B, T, Hk, K]
    v = v.reshape(B, T, -1, self.head_v_dim)  # [B, T, Hv, V]
    beta = self.in_proj_b(hidden_states).sigmoid()  # [B, T, Hv]
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)  # [B, T, Hv]
    rep = self.num_v_heads // self.num_k_heads  # each key head serves `rep` value heads
    q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))
    if fast and (not torch.is_grad_enabled() or fla_trains(hidden_states.device.index)):
        out, _ = fla_kernels()[1](q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=None if cu is None else cu.long())
    else:
        # inspect.unwrap: transformers' name dispatches to fla-core's kernel wherever fla-core imports
        torch_rule = inspect.unwrap(sys.modules[type(self).__module__].torch_chunk_gated_delta_rule)
        out = delta_rule_reference(torch_rule, q, k, v, g, beta, cu)
    z = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)
    out = self.norm(out.reshape(-1, self.head_v_dim), z).reshape(B, T, -1)  # the gated RMSNorm
    return self.out_proj(out)


def _starts(cu, T, device):
    """[T] each position's place in its sample (cu None: the row is one sample)."""
    pos = torch.arange(T, device=device)
    if cu is None:
        return pos
    cu = cu.to(device=device, dtype=torch.long)
    return pos - torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])


def causal_conv_reference(x, w, bias, cu=None):
    """Depthwise causal conv x [B, T, D], w [D, W] -> [B, T, D]: out[t] = sum_j w[:, W-1-j] x[t-j], taps reaching
    back past the start of t's sample left out (what zero left-padding each sample alone gives)."""
    T, W = x.shape[1], w.shape[1]
    place = _starts(cu, T, x.device)  # [T]
    xp = F.pad(x, (0, 0, W - 1, 0))  # [B, T + W - 1, D]
    out = sum(xp[:, W - 1 - j:W - 1 - j + T] * w[:, W - 1 - j] * (place >= j)[:, None].to(x.dtype) for j in range(W))
    return out if bias is None else out + bias


def delta_rule_reference(chunk_rule, q, k, v, g, beta, cu=None):
    """transformers' pure-torch chunked delta rule, run on each sample of a packed row apart (q, k [1, N, H, K], v
    [1, N, H, V], g, beta [1, N, H]), the samples as one right-padded batch; cu None: the rows as they are."""
    def call(*xs):
        return chunk_rule(*xs[:3], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True)[0]
    if cu is None:
        return call(q, k, v, g, beta)
    lens = (cu[1:] - cu[:-1]).tolist()
    batch = [torch.nn.utils.rnn.pad_sequence(x[0].split(lens), batch_first=True) for x in (q, k, v, g, beta)]
    out = call(*batch)  # [S, Lmax, H, V]
    return torch.cat([o[:n] for o, n in zip(out, lens)])[None]  # [1, N, H, V]


# ----------------------------------------------------------------------------------------------- chunk log-probs
# A chunk's fp32 [n, V] logits are 2.5 GB at 4096 tokens and a 152k vocabulary; checkpointing would rerun the chunk,
# and autograd's logsumexp/gather backward add more [n, V] tensors. ChunkLogProbs keeps logz [n] and turns one
# recomputed matmul into the logits' gradient in one pass: the plain formula's ops, dtypes and order.
def _logits(mm, temperature, forbidden):
    """The head's output mm [n, V] (in the matmul's dtype) -> logits [n, V] in fp32 at least (log_softmax in bf16
    loses ~2 digits), the forbidden token ids at -inf."""
    logits = (mm / temperature).to(torch.promote_types(mm.dtype, torch.float32))
    return _set_columns(logits, forbidden, float("-inf")) if forbidden else logits


# Eager writes only the few columns it changes; under torch.compile a mask of column ids fuses into the kernel (an
# index_put or scatter would make inductor store the fp32 [n, V] input first).
def _set_columns(x, ids, value):
    """x [n, V] (a fresh tensor: eager writes into it) with the columns `ids` set to value."""
    if torch.compiler.is_compiling():
        cols = torch.arange(x.shape[-1], device=x.device)  # [V]
        return x.masked_fill(functools.reduce(torch.logical_or, [cols == i for i in ids]), value)
    x[:, ids] = value
    return x


def _add_at_targets(x, targets, g):
    """x [n, V] (fresh) plus g [n] at each row's target column: x + g * onehot(targets)."""
    if torch.compiler.is_compiling():
        cols = torch.arange(x.shape[-1], device=x.device)  # [V]
        return x + torch.where(cols == targets[:, None], g[:, None], 0.0)
    return x.scatter_add_(1, targets[:, None], g[:, None])


def logprob_stats(mm, targets, temperature, forbidden, entropy):
    """-> log-probs of the targets [n], logz [n] (all that backward keeps) and, if `entropy`, entropies [n], else
    None (a metric, not a loss term: the log-prob passes that discard it skip a softmax over [n, V])."""
    logits = _logits(mm, temperature, forbidden)  # [n, V]
    logz = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz  # [n]
    if not entropy:
        return logp, logz, None
    p = torch.softmax(logits, dim=-1)
    return logp, logz, logz - (p * logits.masked_fill(p == 0, 0)).sum(-1)  # 0 * -inf would be NaN


def logits_grad(mm, logz, targets, g, temperature, forbidden, ent=None, g_ent=None):
    """The gradient of sum(g * logp + g_ent * entropy) wrt mm [n, V], in mm's dtype: (g onehot(target) - g p - g_ent
    p (log p + entropy)) / temperature, 0 at the forbidden ids; autograd's order (fp32 sum, cast, divide)."""
    logp = _logits(mm, temperature, forbidden).sub_(logz[:, None])  # [n, V]
    if g_ent is None:
        grad = logp.exp_().mul_(-g[:, None])  # [n, V] -g p
    else:  # the entropy bonus (--entropy-coeff): d entropy / d logit_j = -p_j (log p_j + entropy)
        grad = logp.exp().mul_(logp.nan_to_num_(neginf=0.0).add_(ent[:, None]).mul_(g_ent[:, None]).add_(g[:, None]))
        grad = grad.neg_()  # [n, V] -g p - g_ent p (log p + entropy)
    grad = _add_at_targets(grad, targets, g)
    if forbidden:  # (-g x 0 is -0.0; and a forbidden target gets none, as autograd's index_put has it)
        grad = _set_columns(grad, forbidden, 0.0)
    return grad.to(mm.dtype).div_(temperature)


LOGPROB_KERNELS = (logprob_stats, logits_grad)  # compile_elementwise returns their compiled twins


class ChunkLogProbs(torch.autograd.Function):
    """apply(h [n, H], targets [n], weight [V, H], temperature, forbidden, entropy, kernels) -> (log-probs [n],
    entropies [n] or None); matmuls in h's dtype, as F.linear. The weight's gradient is an ordinary input gradient
    (FSDP2 reduce-scatters it; tied embeddings add it to the embedding's)."""

    @staticmethod
    def forward(ctx, h, targets, weight, temperature, forbidden, entropy, kernels):
        logp, logz, ent = kernels[0](F.linear(h, weight), targets, temperature, forbidden, entropy)  # [n] each
        ctx.save_for_backward(h, weight, targets, logz, ent)  # not the [n, V] logits: backward recomputes them
        ctx.args = temperature, forbidden, kernels
        ctx.set_materialize_grads(False)  # an entropy that no loss uses has no gradient: no [n, V] pass for it
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, g_ent):
        h, weight, targets, logz, ent = ctx.saved_tensors
        temperature, forbidden, kernels = ctx.args
        grad = kernels[1](F.linear(h, weight), logz, targets, g, temperature, forbidden, ent, g_ent)  # [n, V]
        gh = grad.mm(weight) if ctx.needs_input_grad[0] else None  # [n, H]  (autograd's mm backward: the same
        gw = grad.t().mm(h) if ctx.needs_input_grad[2] else None  # [V, H]   operand order, the same bits)
        return gh, None, gw, None, None, None, None


# ----------------------------------------------------------------------------------------------- fused elementwise
# ~35% of the 3B update's GPU time went to memory-bound elementwise kernels (RMSNorm 6, the gated MLP 2, rotary ~8,
# each re-reading its tensor); torch.compile fuses each module or function into one or two kernels in place (the
# same parameters; the decoder layers stay FSDP units, outside the compiled regions).
def compile_elementwise(hf):
    """Compile hf's norms, gated MLPs and its modeling module's rotary functions in place, and return the compiled
    twins of LOGPROB_KERNELS (the per-chunk log-probs' forward and backward, also elementwise over [n, vocab])."""
    for m in hf.modules():
        if type(m).__name__.endswith(("RMSNorm", "MLP")):
            m.compile(dynamic=True)  # token counts change every micro-batch: one graph with a symbolic length
    mod = sys.modules[type(hf).__module__]
    # Not the vision tower's rotary function: its cos/sin are fp32, cast to bf16 by FSDP2 in forward but not in the
    # checkpoint's recompute, which then refuses the compiled graph's saved tensors (seen on the H200).
    for fn in ("apply_rotary_pos_emb", "apply_multimodal_rotary_pos_emb"):
        f = getattr(mod, fn, None)
        if f is not None and not hasattr(f, "_torchdynamo_orig_callable"):  # a module-level function, read at
            setattr(mod, fn, torch.compile(f, dynamic=True))               # call time by attention: swap it once
    return tuple(torch.compile(k, dynamic=True) for k in LOGPROB_KERNELS)
