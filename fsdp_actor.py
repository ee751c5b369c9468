"""fsdp_actor.py -- the policy side of RL: load the model, shard it with FSDP2, compute per-token log-probs,
take optimizer steps, stream full weights out to the rollout engine, save and load checkpoints.

Everything here works the same with one process (CPU or GPU), with `torchrun` on CPU (gloo) and on GPU (NCCL).
Sequences are laid out as one row per sample: prompt + response, right-padded:

    input_ids  [B, T]   p p p p r r r 0 0
    resp_mask  [B, T]   0 0 0 1 1 1 0 0 0   (position t predicts token t+1: marks the positions *before* response tokens)

Log-probs come back response-aligned and padded: [B, R] with R = the longest response of the micro-batch.
"""
import functools
import inspect
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


# ----------------------------------------------------------------------------------------------- distributed
def init_distributed():
    """Works bare (`python grpo.py`) and under torchrun. Returns (rank, world_size, device)."""
    if "RANK" not in os.environ:  # single process: a 1-rank group keeps every code path identical
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(29500 + os.getpid() % 2000))
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # gloo for CPU tensors even on GPU machines: vLLM and object collectives need a CPU group too
        dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", timeout=timedelta(minutes=60))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


# ----------------------------------------------------------------------------------------------- model
def load_hf_model(path, dtype=torch.float32, attn_implementation=None):
    """A VLM through AutoModelForImageTextToText, else a text LLM through AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    kw = dict(dtype=dtype, **({"attn_implementation": attn_implementation} if attn_implementation else {}))
    try:
        return AutoModelForImageTextToText.from_pretrained(path, **kw)
    except ValueError:  # "Unrecognized configuration class ... for AutoModelForImageTextToText": a text LLM
        return AutoModelForCausalLM.from_pretrained(path, **kw)


class LogProbModel(nn.Module):
    """FSDP root around the HF model. Its forward returns log-probs of the target tokens instead of logits, so the
    [tokens, vocab] fp32 logits exist only one chunk at a time (a 152k vocabulary would need 10 GB for 16k tokens).
    It must be a module: FSDP2 all-gathers the root's own parameters (embeddings, lm_head) in forward hooks."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model
        # The rollout engines never sample image/video pad tokens; masking them here too makes the trained policy
        # exactly the sampling distribution (it matters for tiny random models, where they hold ~1/V each).
        cfg = hf_model.config
        self.forbidden = [i for i in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None))
                          if isinstance(i, int) and i >= 0]
        self.has_vision = getattr(cfg, "vision_config", None) is not None and hasattr(hf_model.model,
                                                                                       "get_image_features")

    def forward(self, input_ids, resp_mask, mm_inputs, owner=None, temperature=1.0, chunk_size=4096):
        """mm_inputs: processor outputs of the *distinct* prompts of the batch; owner: (for each row the distinct
        prompt it shows, for each distinct prompt its number of images), as built by collate."""
        hidden = self.hidden_states(input_ids, mm_inputs, owner)  # [B, T, H]
        h = hidden[resp_mask]  # [N, H]   positions that predict a response token
        targets = input_ids[:, 1:][resp_mask[:, :-1]]  # [N]   (resp_mask is 0 at the last column)
        head = self.hf.get_output_embeddings()
        logps, ents = [], []
        for hc, tc in zip(h.split(chunk_size), targets.split(chunk_size)):
            if torch.is_grad_enabled():  # recompute the chunk's logits in backward instead of keeping them
                lp, ent = checkpoint(_chunk_logprobs, hc, tc, head.weight, temperature, self.forbidden,
                                     use_reentrant=False)
            else:
                lp, ent = _chunk_logprobs(hc, tc, head.weight, temperature, self.forbidden)
            logps.append(lp)
            ents.append(ent)
        return torch.cat(logps), torch.cat(ents)  # [N], [N]

    def hidden_states(self, input_ids, mm_inputs, owner):
        # No attention mask: rows are right-padded and attention is causal, so no real token ever sees a pad (the
        # pads' own outputs are never read). A padding mask would also keep SDPA off its flash kernel (and, with
        # grouped-query attention, on the slow O(T^2)-memory math path).
        kw = dict(input_ids=input_ids, attention_mask=None, use_cache=False)
        if not mm_inputs and not self.has_vision:
            return self.hf.model(**kw).last_hidden_state
        if not mm_inputs:
            # Every rank must run the same sharded modules in the same order (each vision block is an FSDP unit
            # whose weights are all-gathered collectively): a text-only micro-batch still runs the vision tower
            # first, on one blank image, and adds 0 x its output so that backward reaches its blocks too.
            embeds = self.hf.model.get_input_embeddings()(input_ids)  # [B, T, H]
            embeds = embeds + self._idle_vision(embeds)
            return self.hf.model(inputs_embeds=embeds, attention_mask=None, use_cache=False).last_hidden_state
        kw.update(mm_token_types(self.hf, input_ids, mm_inputs))
        owner, counts = owner  # per row: its distinct prompt; per distinct prompt: its number of images
        if "image_grid_thw" not in mm_inputs:
            raise NotImplementedError(f"{type(self.hf).__name__}: images are supported for Qwen-VL-style models "
                                      f"(processor outputs pixel_values + image_grid_thw); got {sorted(mm_inputs)}")
        grid = mm_inputs["image_grid_thw"]  # [I, 3], distinct prompts' images in order
        grid_of = grid.split(counts)  # one [images, 3] chunk per distinct prompt
        row_grid = torch.cat([grid_of[i] for i in owner])  # [I_rows, 3] the images as the rows show them
        if self.hf.config.model_type == "qwen3_vl":
            return self._deepstack_hidden(input_ids, mm_inputs, owner, counts, row_grid, kw["mm_token_type_ids"])
        if self.hf.config.model_type in ("qwen2_vl", "qwen2_5_vl"):
            # The n samples of a prompt share its image: run the vision tower once per distinct image (not n times)
            # and scatter its features into every row that shows it. Gradients from all rows add up in one place.
            feats = self.hf.model.get_image_features(mm_inputs["pixel_values"], grid)
            feats = list(getattr(feats, "pooler_output", feats))  # per image [tokens, H]
            starts = [sum(counts[:i]) for i in range(len(counts))]
            embeds = self.hf.model.get_input_embeddings()(input_ids)  # [B, T, H]
            rows = torch.cat([f for i in owner for f in feats[starts[i]:starts[i] + counts[i]]]).to(embeds.dtype)
            embeds = embeds.masked_scatter((input_ids == self.hf.config.image_token_id)[..., None], rows)
            return self.hf.model(inputs_embeds=embeds, image_grid_thw=row_grid, **kw).last_hidden_state
        # other VLMs: the model's own path, with one copy of the pixels per row
        pixels = mm_inputs["pixel_values"].split([int(g.prod(-1).sum()) for g in grid_of])
        return self.hf.model(pixel_values=torch.cat([pixels[i] for i in owner]), image_grid_thw=row_grid,
                             **kw).last_hidden_state

    def _deepstack_hidden(self, input_ids, mm_inputs, owner, counts, row_grid, types):
        """Qwen3-VL: the vision tower once per distinct image, as for Qwen2.5-VL. Its deepstack features (the outputs
        of a few vision blocks, each added to one of the first LLM layers' outputs at the image positions) are
        scattered per row the same way and handed to the language model, whose forward takes them as arguments; the
        full model's forward would instead rerun the tower on every row's copy of the pixels."""
        m = self.hf.model
        grid = mm_inputs["image_grid_thw"]  # [I, 3]
        out = m.get_image_features(mm_inputs["pixel_values"], grid)
        sizes = (grid.prod(-1) // m.visual.spatial_merge_size ** 2).tolist()  # tokens per distinct image
        starts = [sum(counts[:i]) for i in range(len(counts))]
        order = [j for i in owner for j in range(starts[i], starts[i] + counts[i])]  # the images as the rows show them

        def per_row(x):  # distinct images' tokens ([N, H], or split per image) -> the rows' image tokens [N_rows, H]
            x = x.split(sizes) if isinstance(x, torch.Tensor) else x  # transformers 5.17 returns deepstack unsplit
            return torch.cat([x[j] for j in order])

        embeds = m.get_input_embeddings()(input_ids)  # [B, T, H]
        mask = input_ids == self.hf.config.image_token_id  # [B, T]
        embeds = embeds.masked_scatter(mask[..., None], per_row(out.pooler_output).to(embeds.dtype))
        deep = [per_row(d).to(embeds.dtype) for d in out.deepstack_features]  # per deepstack layer [N_rows, H]
        pos, _ = m.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=row_grid)  # [3, B, T]
        return m.language_model(inputs_embeds=embeds, position_ids=pos, attention_mask=None, use_cache=False,
                                visual_pos_masks=mask, deepstack_visual_embeds=deep).last_hidden_state

    def _idle_vision(self, like):
        """0 x (the vision tower's output for one blank image of the smallest grid): a zero that is in the graph."""
        vc = self.hf.config.vision_config
        m = vc.spatial_merge_size
        dim = getattr(vc, "in_channels", 3) * vc.temporal_patch_size * vc.patch_size ** 2
        pixels = torch.zeros(m * m, dim, device=like.device, dtype=like.dtype)  # [patches, C*t*p*p]
        out = self.hf.model.get_image_features(pixels, torch.tensor([[1, m, m]], device=like.device))
        return sum(t.float().sum() for t in _tensors(out)).to(like.dtype) * 0.0


def _tensors(x):
    """The floating-point tensors inside a (nested) model output."""
    if isinstance(x, torch.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, dict):
        x = list(x.values())
    return [t for v in x for t in _tensors(v)] if isinstance(x, (list, tuple)) else []


def mm_token_types(hf, input_ids, mm_inputs):
    """transformers >= 5 builds Qwen-VL's 3-D (M-RoPE) positions only when told which tokens are image (1) and
    video (2) pads; without it the model silently falls back to 1-D positions and disagrees with vLLM."""
    cfg = hf.config
    if not mm_inputs or not _takes_mm_token_types(type(hf.model)):
        return {}
    types = torch.zeros_like(input_ids)
    for tid, v in ((getattr(cfg, "image_token_id", None), 1), (getattr(cfg, "video_token_id", None), 2)):
        if tid is not None:
            types[input_ids == tid] = v
    return {"mm_token_type_ids": types}


@functools.cache
def _takes_mm_token_types(model_cls):  # once per class: this runs on every forward
    return "mm_token_type_ids" in inspect.signature(model_cls.forward).parameters


def _chunk_logprobs(h, targets, weight, temperature, forbidden=()):
    logits = F.linear(h, weight).float() / temperature  # [n, V] fp32: log_softmax in bf16 loses ~2 digits
    if forbidden:
        logits[:, forbidden] = float("-inf")
    logz = torch.logsumexp(logits, dim=-1)  # [n]
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz  # [n]
    with torch.no_grad():  # entropy is a metric, not a loss term: no graph for it
        p = torch.softmax(logits, dim=-1)
        ent = logz - (p * logits.masked_fill(p == 0, 0)).sum(-1)  # 0 * -inf would be NaN
    return logp, ent


def build_actor(path, device, dtype, param_dtype, gradient_checkpointing=True, attn_implementation=None,
                trainable=True, freeze_vision_tower=False):
    """Load and shard with FSDP2: every decoder layer and vision block is its own unit (weights all-gathered just
    in time, freed after use), the root holds the rest. `dtype` is the storage (fp32 master weights for the
    policy, bf16 for a frozen reference); `param_dtype` is what the matmuls run in."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    hf = load_hf_model(path, dtype=dtype, attn_implementation=attn_implementation)
    hf.config.use_cache = False
    if gradient_checkpointing and trainable:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not trainable:
        hf.requires_grad_(False)
    if freeze_vision_tower:  # EasyR1's option: train the language model on fixed image features
        for name, p in hf.named_parameters():
            if ".visual." in f".{name}":
                p.requires_grad_(False)
    model = LogProbModel(hf)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = set(getattr(hf, "_no_split_modules", None) or [])
    for m in hf.modules():
        if type(m).__name__ in blocks:
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if device.type == "cuda":
        model.to(device)
    model.train(trainable)
    return model


# ----------------------------------------------------------------------------------------------- batches
def collate(samples, pad_id, device):
    """samples: dicts with prompt (a data.py prompt record) and response_ids. Returns the actor's inputs."""
    seqs = [s["prompt"]["prompt_ids"] + list(s["response_ids"]) for s in samples]
    T = max(len(x) for x in seqs) + 1  # +1: resp_mask needs a 0 in its last column
    B = len(seqs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    resp_mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (x, s) in enumerate(zip(seqs, samples)):
        lp, lr = len(s["prompt"]["prompt_ids"]), len(s["response_ids"])
        input_ids[i, :len(x)] = torch.tensor(x)
        resp_mask[i, lp - 1:lp - 1 + lr] = True
    # the distinct prompts of the batch (the n samples of a prompt share its images) and which one each row shows
    index, prompts, owner = {}, [], []
    for s in samples:
        if id(s["prompt"]) not in index:
            index[id(s["prompt"])] = len(prompts)
            prompts.append(s["prompt"])
        owner.append(index[id(s["prompt"])])
    mm = {}
    keys = {k for p in prompts for k in p["mm_inputs"]}  # Qwen-VL: pixel_values [P, D], image_grid_thw [I, 3]
    for key in keys:
        mm[key] = torch.cat([p["mm_inputs"][key] for p in prompts if key in p["mm_inputs"]]).to(device)
    counts = [len(p["mm_inputs"].get("image_grid_thw", ())) for p in prompts]  # images per distinct prompt
    resp_len = torch.tensor([len(s["response_ids"]) for s in samples])
    return dict(input_ids=input_ids.to(device), resp_mask=resp_mask.to(device), mm_inputs=mm,
                owner=(owner, counts)), resp_len


def pad_responses(values, resp_len):
    """Flat per-token values [N] -> response-aligned [B, R] (zeros past each response)."""
    R = int(resp_len.max())
    mask = torch.arange(R)[None, :] < resp_len[:, None]  # [B, R]
    out = values.new_zeros(mask.shape)
    out[mask.to(values.device)] = values
    return out, mask.to(values.device)


def stack_padded(rows, R, device):
    """List of 1-D per-sample tensors -> [B, R] zero-padded."""
    out = torch.zeros(len(rows), R, device=device)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r.to(device)
    return out


def make_micro_batches(lengths, max_tokens, max_samples, groups=None):
    """Group sample indices so that each micro-batch holds at most `max_tokens` padded tokens and `max_samples`
    samples. Sorting by length keeps padding small; with `groups` (the prompt of each sample) the samples of a
    prompt stay together, so its image goes through the vision tower once per micro-batch. Every rank must run the
    same number of micro-batches (each forward all-gathers weights collectively), so the count is agreed on and
    the longest micro-batches split to match."""
    groups = groups if groups is not None else list(range(len(lengths)))
    top = {}
    for g, n in zip(groups, lengths):
        top[g] = max(top.get(g, 0), n)
    order = sorted(range(len(lengths)), key=lambda i: (-top[groups[i]], str(groups[i]), -lengths[i]))
    groups, cur = [], []
    for i in order:
        if cur and ((len(cur) + 1) * lengths[cur[0]] > max_tokens or len(cur) >= max_samples):
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    n = torch.tensor([len(groups)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=_cpu_group())
    while len(groups) < int(n):  # split the largest group in two (a rank always has >= n samples)
        j = max(range(len(groups)), key=lambda k: len(groups[k]) * lengths[groups[k][0]])
        g = groups.pop(j)
        groups[j:j] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups


_CPU_GROUP = None


def _cpu_group():
    """A gloo group for small CPU collectives (counts, Python objects) next to NCCL."""
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return _CPU_GROUP


def all_reduce_cpu(x, op=dist.ReduceOp.SUM):
    """Sum (or max) a small CPU tensor over ranks."""
    x = torch.as_tensor(x, dtype=torch.float64).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=op, group=_cpu_group())
    return x


@torch.no_grad()
def compute_logprobs(model, samples, pad_id, device, temperature, max_tokens, max_samples, chunk_size=4096):
    """Per-sample 1-D log-probs (and entropies) of the response tokens under `model`, no gradients."""
    lengths = [len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    out_lp, out_ent = [None] * len(samples), [None] * len(samples)
    for idx in make_micro_batches(lengths, max_tokens, max_samples, [id(s["prompt"]) for s in samples]):
        batch, resp_len = collate([samples[i] for i in idx], pad_id, device)
        lp, ent = model(**batch, temperature=temperature, chunk_size=chunk_size)  # [N], [N]
        for i, a, b in zip(idx, lp.float().cpu().split(resp_len.tolist()), ent.float().cpu().split(resp_len.tolist())):
            out_lp[i], out_ent[i] = a, b
    return out_lp, out_ent


# ----------------------------------------------------------------------------------------------- optimizer
def build_optimizer(model, lr, weight_decay, betas, warmup_steps, device):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                            fused=device.type == "cuda" or None)
    # linear warmup from lr/warmup to lr, then constant (EasyR1's default schedule)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
    return opt, sched


def optimizer_step(model, opt, sched, max_grad_norm):
    """Clip, step, and skip the step when the gradient norm is not finite (a NaN/inf batch must not poison the
    weights). Returns the pre-clip grad norm (float)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = float(norm)
    if math.isfinite(norm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return norm


# ----------------------------------------------------------------------------------------------- weights out
def iter_full_params(model, dtype=None):
    """Yield (hf_name, full tensor) one parameter at a time: each DTensor is all-gathered, handed over, then
    dropped, so the peak extra memory is one tensor, never a full state-dict copy. Every rank must iterate."""
    for name, p in model.hf.state_dict().items():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        yield name, (t.to(dtype) if dtype is not None else t).detach()


# ----------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path, model, opt, sched, extra, keep=0):
    """Sharded model + optimizer via torch.distributed.checkpoint (every rank writes its shard: on several nodes
    the folder must be on a shared file system). Written to `<path>.tmp` and renamed when complete, so a crash
    mid-save never leaves a checkpoint that looks whole; then only the newest `keep` are kept (0 = all)."""
    import json
    import shutil
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    tmp = path + ".tmp"
    if dist.get_rank() == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier(group=_cpu_group())
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({**extra, "scheduler": sched.state_dict()}, f)
        if os.path.exists(path):  # a re-run of the same step
            shutil.rmtree(path)
        os.replace(tmp, path)
        root = os.path.dirname(path)
        while keep and len(steps := _saved_steps(root)) > keep:  # only after the new one is complete
            shutil.rmtree(os.path.join(root, f"step_{steps[0]}"))
    dist.barrier(group=_cpu_group())


def load_checkpoint(path, model, opt, sched):
    import json
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        extra = json.load(f)
    sched.load_state_dict(extra.pop("scheduler"))
    return extra


def _saved_steps(save_dir):
    """Steps of the complete checkpoints in save_dir, oldest first (a `.tmp` folder is an unfinished save)."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(int(d[5:]) for d in os.listdir(save_dir) if d.startswith("step_") and d[5:].isdigit())


def latest_checkpoint(save_dir):
    steps = _saved_steps(save_dir)
    return os.path.join(save_dir, f"step_{steps[-1]}") if steps else None
