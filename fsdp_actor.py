"""fsdp_actor.py -- the policy side of RL: load the model, shard it with FSDP2, compute per-token log-probs,
take optimizer steps, stream full weights out to the rollout engine. The same with one process (CPU or GPU) and
under torchrun (gloo, NCCL). Rows: one per sample, right-padded (position t predicts token t+1), or one packed row
per micro-batch; log-probs come back flat per target token [n], pad_responses lays them out [B, R]."""
import functools
import math
import os
import types
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import memory
import presets
import ulysses
import varlen
import video
from common import UserError, _cpu_group, all_reduce_cpu, free_port  # noqa: F401 (all_reduce_cpu: actor.all_reduce_cpu)
from families import QWEN_VL, mm_token_types, own_config, soft_capped  # noqa: F401 (actor.mm_token_types)
from tiny_moe import expert_wrappers, merged_expert, router_aux_loss, routers
from varlen import ChunkLogProbs  # (LogProbModel.forward's argument `varlen` hides the module there)


# ----------------------------------------------------------------------------------------------- distributed
def init_distributed():
    """Works bare (`python grpo.py`) and under torchrun. Returns (rank, world_size, device)."""
    if "RANK" not in os.environ:  # single process: a 1-rank group keeps every code path identical
        # a port the kernel reports free, not one derived from the pid: CI met EADDRINUSE on a pid-derived port
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # gloo for CPU tensors even on GPU machines: vLLM and object collectives need a CPU group too
        dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", timeout=timedelta(minutes=60))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


# ----------------------------------------------------------------------------------------------- model
HYBRID = ("qwen3_5", "qwen3_5_moe")  # Qwen3.5: Gated DeltaNet layers between the attention ones (varlen.gdn_forward)


def load_hf_model(path, dtype=torch.float32, attn_implementation=None):
    """A VLM through AutoModelForImageTextToText, else a text LLM through AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # slow to import (~2 s)
    kw = dict(dtype=dtype, **({"attn_implementation": attn_implementation} if attn_implementation else {}))
    if presets.random_init(path):  # a folder without weights (bench.py's big presets): built from its config, seeded
        model = presets.random_model(path, **kw)
    else:
        try:  # (transformers' own config: families.own_config; no Hub kernels: 5.25 turns them on where they import,
            # again at each train()/eval(), which also drops varlen.use_gdn_forward's forward from Qwen3.5's GDN layers)
            model = AutoModelForImageTextToText.from_pretrained(path, config=own_config(path), use_kernels=False, **kw)
        except ValueError:  # "Unrecognized configuration class ... for AutoModelForImageTextToText": a text LLM
            model = AutoModelForCausalLM.from_pretrained(path, config=own_config(path), use_kernels=False, **kw)
    if dtype == torch.float64 and routers(model):  # MoE: transformers' default experts kernel (grouped_mm) takes
        model.set_experts_implementation("eager")  # no float64, the tests' reference precision; the loop does
    if model.config.model_type in ("qwen2_vl", "qwen2_5_vl"):  # positions after a video as vLLM has them
        model.model.get_rope_index = types.MethodType(video.qwen2_vl_rope_index, model.model)
    return model


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
        # the generic path (any other image-text family): the processor's inputs through the model's own forward
        self.generic = getattr(cfg, "vision_config", None) is not None and cfg.model_type not in QWEN_VL
        self.has_vision = not self.generic and getattr(cfg, "vision_config", None) is not None and hasattr(
            hf_model.model, "get_image_features")
        # who computes the rotary positions: collate() for Qwen2-VL/2.5-VL (3-D M-RoPE), text LLMs (1-D) and packed
        # Qwen3-VL rows, and Qwen3.5's, on the CPU; None = the model itself (other VLMs, and Qwen3-VL's padded rows)
        self.rope = ("mrope" if cfg.model_type in ("qwen2_vl", "qwen2_5_vl") + HYBRID else
                     "1d" if getattr(cfg, "vision_config", None) is None else None)
        self.packed = False  # build_actor: True when this model trains padding-free (one packed row per micro-batch)
        self.share_prompts = False  # build_actor: True when such a row holds each prompt once for all its samples
        # MoE (build_actor with router_aux_loss_coef > 0): each forward's router logits, per layer [tokens, experts],
        # and the load-balancing loss made of them (aux_loss); None = off, the default for RL
        self.router_logits, self.aux_loss = None, None
        self.chunk_kernels = varlen.LOGPROB_KERNELS  # build_actor: their compiled twins with --torch-compile
        self.softcap = getattr(cfg.get_text_config(), "final_logit_softcapping", None)  # Gemma: cap x tanh(z / cap)
        self.ulysses = None  # build_actor: this rank's sequence-parallel group (--ulysses-size > 1)

    def forward(self, input_ids, resp_idx, targets, mm_inputs, owner=None, position_ids=None, varlen=None,
                temperature=1.0, chunk_size=4096, entropy=True):
        """collate()'s rows: input_ids [B, T] (packed [1, N]), resp_idx [n] the positions that predict response
        tokens, targets [n], mm_inputs of the distinct prompts, owner, position_ids, varlen (the packed row's
        boundaries). -> log-probs [n] and, with `entropy`, entropies [n] (else None)."""
        if self.router_logits is not None:
            self.router_logits.clear()
        hidden = self.hidden_states(input_ids, mm_inputs, owner, position_ids, varlen)  # [B, T, H]; Ulysses [1, T/K, H]
        if self.router_logits and torch.is_grad_enabled():
            self.aux_loss = router_aux_loss(self.hf, self.router_logits, input_ids)
        n, all_idx = input_ids.shape[1], resp_idx
        if self.ulysses is not None:  # the targets of this rank's slice of the row; all ranks' gathered below
            a, b = ulysses.bounds(n, self.ulysses)
            mine = (resp_idx >= a) & (resp_idx < b)  # [n_targets]
            resp_idx, targets = resp_idx[mine] - a, targets[mine]
        h = hidden.flatten(0, 1).index_select(0, resp_idx)  # [n, H] (an index, not a boolean mask: no host sync)
        head = self.hf.get_output_embeddings()
        kernels = soft_capped(self.chunk_kernels, self.softcap) if self.softcap else self.chunk_kernels
        logps, ents = zip(*[ChunkLogProbs.apply(hc, tc, head.weight, temperature, self.forbidden, entropy, kernels)
                            for hc, tc in zip(h.split(chunk_size), targets.split(chunk_size))])  # a chunk at a time
        logp, ent = torch.cat(logps), torch.cat(ents) if entropy else None  # [n]; backward redoes each chunk's logits
        if self.ulysses is not None:
            logp, ent = (None if x is None else ulysses.gather(x, all_idx, n, self.ulysses) for x in (logp, ent))
        return logp, ent

    def hidden_states(self, input_ids, mm_inputs, owner, position_ids=None, varlen=None):
        # No attention mask: rows are right-padded and attention causal, so no real token sees a pad; a mask would
        # keep SDPA off its flash kernel. A packed row has no pads: `varlen` keeps each sample's attention inside it.
        kw = dict(attention_mask=None, use_cache=False, position_ids=position_ids, **(varlen or {}))
        if not mm_inputs and not self.has_vision:
            if self.generic and dist.get_world_size() > 1:  # the other ranks' vision blocks would wait for this one
                raise UserError(f"{self.hf.config.model_type}: a micro-batch without images on one of several ranks "
                                "(the generic path runs the vision tower only on images): train on one GPU")
            return self.hf.model(input_ids=input_ids, **kw).last_hidden_state
        if not mm_inputs:
            # Every rank runs the same sharded modules in the same order (each vision block all-gathers
            # collectively): a text-only micro-batch runs the tower on one blank image, adding 0 x its output.
            embeds = self.hf.model.get_input_embeddings()(input_ids)  # [B, T, H]
            embeds = embeds + self._idle_vision(embeds)
            if position_ids is None and self.rope == "mrope":  # plain text positions; left to itself, the model
                # would offset them by the rope_deltas an earlier image batch left behind (and fail on a new B)
                kw["position_ids"] = torch.arange(input_ids.shape[1], device=input_ids.device).expand(
                    3, *input_ids.shape)
            return self.hf.model(inputs_embeds=embeds, **kw).last_hidden_state
        owner, counts, vcounts = owner  # per row: its distinct prompt; per distinct prompt: its images, its videos
        if self.generic:  # the processor's tensors, one copy per row (collate), and its token types as it makes them
            return self.hf.model(input_ids=input_ids, **mm_inputs, **mm_token_types(self.hf, input_ids, mm_inputs),
                                 **kw).last_hidden_state
        grids = {k: mm_inputs[k] for k in ("image_grid_thw", "video_grid_thw") if k in mm_inputs}
        row_grids = {k: torch.cat([g.split(c)[i] for i in owner]) for (k, g), c in  # [items as the rows show them, 3]
                     zip(grids.items(), [counts if k == "image_grid_thw" else vcounts for k in grids])}
        if self.hf.config.model_type in ("qwen3_vl", "qwen3_vl_moe"):
            types = mm_token_types(self.hf, input_ids, mm_inputs).get("mm_token_type_ids")
            return self._deepstack_hidden(input_ids, mm_inputs, owner, counts, vcounts, row_grids, types, kw)
        if position_ids is None:  # the model derives the 3-D positions from the vision tokens and grids
            kw.update(input_ids=input_ids, **row_grids, **mm_token_types(self.hf, input_ids, mm_inputs))
        if self.rope == "mrope":
            # The n samples of a prompt share its images and videos: run the vision tower once per distinct one
            # (not n times) and scatter its features into every row that shows it. Gradients from all rows add up.
            feats, _ = self._vision_once(mm_inputs)
            embeds = self.hf.model.get_input_embeddings()(input_ids)  # [B, T, H]
            for tid, order in self._row_order(owner, counts, vcounts):
                rows = torch.cat([feats[j] for j in order]).to(embeds.dtype)  # [that kind's tokens in the rows, H]
                embeds = embeds.masked_scatter((input_ids == tid)[..., None], rows)
            return self.hf.model(inputs_embeds=embeds, **kw).last_hidden_state
        if "video_grid_thw" in mm_inputs:
            raise NotImplementedError(f"{type(self.hf).__name__}: videos are supported for Qwen2-VL, Qwen2.5-VL and "
                                      "Qwen3-VL")
        # other VLMs: the model's own path, with one copy of the pixels per row
        grid_of = mm_inputs["image_grid_thw"].split(counts)
        pixels = mm_inputs["pixel_values"].split([int(g.prod(-1).sum()) for g in grid_of])
        kw.setdefault("input_ids", input_ids)
        return self.hf.model(pixel_values=torch.cat([pixels[i] for i in owner]), **kw).last_hidden_state

    def _vision_once(self, mm_inputs):
        """The vision tower in ONE call over the micro-batch's distinct images, then videos (each item attends to
        itself alone): every rank runs the same vision blocks as often, whatever its micro-batch holds (text only:
        _idle_vision). Returns (per item [tokens, H], the output (Qwen3-VL's deepstack features))."""
        keys = [(p, g) for p, g in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
                if g in mm_inputs]
        grid = torch.cat([mm_inputs[g] for _, g in keys])  # [items, 3]
        pixels = torch.cat([mm_inputs[p] for p, _ in keys])  # [patches, C*t*p*p]
        out = self.hf.model.get_image_features(pixels, grid)
        pooled = getattr(out, "pooler_output", out)
        if isinstance(pooled, torch.Tensor):
            pooled = pooled.split((grid.prod(-1) // self.hf.model.visual.spatial_merge_size ** 2).tolist())
        return list(pooled), out

    def _row_order(self, owner, counts, vcounts):
        """[(pad token id, the indices of _vision_once's items in the order the rows show them)] for images, videos."""
        cfg, out, base = self.hf.config, [], 0
        for tid, c in ((cfg.image_token_id, counts), (cfg.video_token_id, vcounts)):
            if sum(c):
                starts = [base + sum(c[:i]) for i in range(len(c))]
                out.append((tid, [j for i in owner for j in range(starts[i], starts[i] + c[i])]))
            base += sum(c)
        return out

    def _deepstack_hidden(self, input_ids, mm_inputs, owner, counts, vcounts, row_grids, types, kw):
        """Qwen3-VL: the tower once per distinct item, as for Qwen2.5-VL; its deepstack features (a few blocks'
        outputs, added to the first LLM layers at the vision positions) scattered per row the same way and handed to
        the language model (the full model's forward would rerun the tower on every row's copy of the pixels)."""
        m = self.hf.model
        feats, out = self._vision_once(mm_inputs)
        sizes = [len(f) for f in feats]  # tokens per distinct item
        embeds = m.get_input_embeddings()(input_ids)  # [B, T, H]
        visual = torch.zeros_like(input_ids, dtype=torch.bool)  # [B, T] every image or video token
        deep_rows = [[] for _ in out.deepstack_features]
        deep = [d.split(sizes) if isinstance(d, torch.Tensor) else d  # transformers 5.17 returns deepstack unsplit
                for d in out.deepstack_features]
        kinds = self._row_order(owner, counts, vcounts)
        for tid, order in kinds:
            mask = input_ids == tid
            visual |= mask
            embeds = embeds.masked_scatter(mask[..., None], torch.cat([feats[j] for j in order]).to(embeds.dtype))
        for layer, d in enumerate(deep):  # deepstack rows in sequence order of all vision tokens, as the model's own
            per_kind = [torch.cat([d[j] for j in order]).to(embeds.dtype) for _, order in kinds]  # [N_kind, H] each
            if len(kinds) == 1:  # one kind (the usual case): already in order, and no host sync for the count
                deep_rows[layer] = per_kind[0]
                continue
            joint = embeds.new_zeros(int(visual.sum()), embeds.shape[-1])  # [N_visual, H] images and videos interleaved
            for (tid, _), x in zip(kinds, per_kind):
                joint[(input_ids == tid)[visual]] = x
            deep_rows[layer] = joint
        if kw["position_ids"] is None:  # (a packed row brings its own, and its boundaries: kw)
            kw["position_ids"], _ = m.get_rope_index(input_ids, mm_token_type_ids=types, **row_grids)  # [3, B, T]
        return m.language_model(inputs_embeds=embeds, visual_pos_masks=visual, deepstack_visual_embeds=deep_rows,
                                **kw).last_hidden_state

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


def recompute_first_layers(hf, share):
    """Only the first ceil(share x L) decoder layers recompute (vision blocks all do), the rest keep their
    activations; the first, not every k-th: backward frees the last layers' before recomputing. Returns the count."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # (transformers: slow to import, ~2 s)
    layers = [m for n, m in hf.named_modules()
              if isinstance(m, GradientCheckpointingLayer) and ".visual." not in f".{n}."]
    n = math.ceil(round(share * len(layers), 6))  # (0.7 x 10 is 7.000000000000001: 7 layers, not 8)
    for i, m in enumerate(layers):
        m.gradient_checkpointing = i < n
    return n


def build_actor(path, device, dtype, param_dtype, gradient_checkpointing=True, attn_implementation=None, trainable=True,
                freeze_vision_tower=False, lora=None, padding_free="auto", vision_varlen="auto", torch_compile="off",
                offload=False, router_aux_loss_coef=0.0, checkpoint_layers=1.0, share_prompts=True, ulysses_group=None):
    """Load and shard with FSDP2: every decoder layer and vision block its own unit (all-gathered just in time),
    the root the rest. `dtype`: the storage (fp32 master weights; bf16 for a frozen reference); `param_dtype`: the
    matmuls'. `lora`: memory.add_lora's keywords, or None. padding_free / vision_varlen / torch_compile: "auto" (a
    fast kernel on CUDA in bf16), "on" (also the CPU's reference path) or "off". offload: FSDP2's CPUOffloadPolicy
    (weights, gradients, optimizer state and step on the host, together); a frozen model waits on the host whole.
    router_aux_loss_coef > 0 (MoE): model.aux_loss each forward. share_prompts: each prompt once in a packed row.
    ulysses_group: this rank's sequence-parallel group (ulysses.py). MoE layers shard like dense ones (each layer's
    fused experts with it); routers: logits in the compute dtype, softmax and top-k in fp32, as transformers/vLLM."""
    from torch.distributed.device_mesh import init_device_mesh  # (FSDP2's modules: ~1 s to import)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard  # (likewise)
    hf = load_hf_model(path, dtype=dtype, attn_implementation=attn_implementation)
    hf.config.use_cache = False
    use_varlen = varlen.use_varlen_attention(hf, device, param_dtype, attn_implementation, padding_free, vision_varlen)
    if any(use_varlen.values()):
        varlen.set_varlen_attention(hf, **use_varlen)
    gdn = varlen.use_gdn_forward(hf, device)  # Qwen3.5: the linear-attention layers see the samples' boundaries
    if gradient_checkpointing and trainable:
        if hasattr(hf, "activation_checkpointing_enable"):  # transformers 5's name; the old one warns
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        recompute_first_layers(hf, checkpoint_layers)  # (1: every layer, as transformers has just set them)
    if not trainable:
        hf.requires_grad_(False)
    if freeze_vision_tower:  # EasyR1's option: train the language model on fixed image features
        for name, p in hf.named_parameters():
            if ".visual." in f".{name}":
                p.requires_grad_(False)
    if lora:
        memory.add_lora(hf, **lora)
        if dtype == torch.bfloat16:  # pure bf16: peft keeps the adapters in fp32 next to a bf16 base
            # parameters only: hf.to(dtype) would also round the rotary inv_freq buffers to bf16, which shifts
            # every position's angle (seen on an H200: engine/trainer log-probs 0.44 apart per token at 7B)
            for prm in hf.parameters():
                prm.data = prm.data.to(dtype)
    model = LogProbModel(hf)
    if model.generic and trainable and dist.get_rank() == 0:
        print(f"note: {hf.config.model_type} takes the generic path: padded rows, its processor's inputs through "
              "transformers' own forward, each image once per sample (Qwen-VL's pack and share them)", flush=True)
    if router_aux_loss_coef > 0 and trainable:
        if not routers(hf):
            raise UserError(f"--router-aux-loss-coef {router_aux_loss_coef}: {type(hf).__name__} has no MoE router")
        model.router_logits = []
        for r in routers(hf):  # output 0: the logits [tokens, experts] (its OutputRecorder's index)
            r.register_forward_hook(lambda m, args, out: model.router_logits.append(out[0])
                                    if torch.is_grad_enabled() else None)  # log-prob passes (no gradient) keep none
    model.packed = use_varlen["text"]  # collate() packs this model's micro-batches into one row
    model.rope = "mrope" if model.packed and model.rope is None else model.rope  # (Qwen3-VL: positions from collate)
    # a shared prompt's keys serve each response in attention; a recurrent layer would need its state forked instead
    model.share_prompts = model.packed and share_prompts and model.router_logits is None and gdn is None
    if ulysses_group is not None:  # each rank's slice of the row into the language model (the one below the root)
        K = dist.get_world_size(ulysses_group)
        ulysses.check_model(hf.config, K)
        if not model.packed or model.router_logits is not None:
            raise UserError(f"--ulysses-size {K}: needs padding-free rows (--padding-free on or auto where a fast "
                            "kernel runs) and no --router-aux-loss-coef")
        lm = getattr(hf.model, "language_model", hf.model)
        lm.register_forward_pre_hook(functools.partial(ulysses.shard_inputs, ulysses_group), with_kwargs=True)
        model.ulysses = ulysses_group
    # auto: on a GPU in bf16/fp16, for a model wide enough that fused kernels pay for the compilation (~100 s at
    # 3B); a tiny model's steps are launch-bound and would only wait for the compiler
    wide = getattr(getattr(hf.config, "text_config", hf.config), "hidden_size", 0) >= 1024
    if torch_compile == "on" or (torch_compile == "auto" and device.type == "cuda" and wide
                                 and param_dtype in (torch.bfloat16, torch.float16)):
        model.chunk_kernels = varlen.compile_elementwise(hf)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # FSDP2 offloads a trainable policy only: a frozen reference waits whole on the host till its pass (memory.resident)
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda")
              if offload and trainable else OffloadPolicy())
    blocks = set(getattr(hf, "_no_split_modules", None) or [])
    for m in hf.modules():
        if type(m).__name__ in blocks:
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    if device.type == "cuda" and not offload:
        model.to(device)
    elif device.type == "cuda" and trainable:  # weights on the host, buffers (rotary frequencies) on the GPU; an
        # offloaded reference stays on the host whole until its pass (memory.resident)
        for m in model.modules():
            m._buffers.update({name: b.to(device) for name, b in m._buffers.items() if b is not None})
    model.train(trainable)
    return model


# ----------------------------------------------------------------------------------------------- batches
def collate(samples, pad_id, device, model=None):
    """samples: dicts with prompt (a data.py record) and response_ids -> (the model's inputs, resp_len). Padded: a
    row per sample; packed (model.packed): one row, no pads, the boundaries for varlen attention; shared: each prompt
    once.    padded  p p p r r 0 0 / p p p r r r 0    packed  p p p r r p p p r r r    shared  p p p r r r r r
    With `model`, the rotary positions are computed here on the CPU (once per distinct prompt)."""
    packed = model is not None and model.packed
    shared = packed and model.share_prompts
    seqs = [s["prompt"]["prompt_ids"] + list(s["response_ids"]) for s in samples]
    # the distinct prompts of the batch (the n samples of a prompt share its images) and which one each row shows
    prompts = list({id(s["prompt"]): s["prompt"] for s in samples}.values())  # in order of first appearance
    index = {id(p): i for i, p in enumerate(prompts)}
    owner = [index[id(s["prompt"])] for s in samples]
    varlen_kw = None  # packed: the attention's boundaries (varlen.packed_layout)
    if packed:
        pieces, resp_idx, varlen_kw = varlen.packed_layout([len(p["prompt_ids"]) for p in prompts],
                                                           [len(s["response_ids"]) for s in samples], owner, shared)
        input_ids = torch.tensor([[t for i, a, b in pieces for t in seqs[i][a:b]]])  # [1, N]
        targets = torch.tensor([t for s in samples for t in s["response_ids"]], dtype=torch.long)  # [n]
    else:
        B, T = len(seqs), max(map(len, seqs)) + 1  # +1: a pad after the longest sample
        input_ids = torch.full((B, T), pad_id, dtype=torch.long)
        resp_mask = torch.zeros(B, T, dtype=torch.bool)  # the positions before response tokens
        for r, (x, s) in enumerate(zip(seqs, samples)):
            lp, lr = len(s["prompt"]["prompt_ids"]), len(s["response_ids"])
            input_ids[r, :len(x)] = torch.tensor(x)
            resp_mask[r, lp - 1:lp - 1 + lr] = True
        targets = input_ids.flatten()[1:][resp_mask.flatten()[:-1]]  # [n] the token each of those positions predicts
        resp_idx = resp_mask.flatten().nonzero().squeeze(1)  # [n]
    keys = {k for p in prompts for k in p["mm_inputs"]}  # Qwen-VL: pixel_values [P, D], image_grid_thw [I, 3]
    per_row = keys and not any(k.endswith("_grid_thw") for k in keys)  # another family's (generic): a copy per row
    shown = [prompts[o] for o in owner] if per_row else prompts
    mm = {k: to_device(torch.cat([p["mm_inputs"][k] for p in shown if k in p["mm_inputs"]]), device) for k in keys}
    counts = [len(p["mm_inputs"].get("image_grid_thw", ())) for p in prompts]  # images per distinct prompt
    vcounts = [len(p["mm_inputs"].get("video_grid_thw", ())) for p in prompts]  # videos per distinct prompt
    position_ids = None
    if model is not None and model.rope is not None:
        pos = _positions(model.hf, samples, prompts, owner, model.rope)  # per sample [3, L] (M-RoPE) or [L]
        if packed:
            position_ids = torch.cat([pos[i][..., a:b] for i, a, b in pieces], dim=-1)[..., None, :]  # [3,1,N] / [1,N]
        elif model.rope == "mrope":  # (a text LLM's padded rows keep the model's own 0..T-1)
            position_ids = torch.zeros(3, B, T, dtype=torch.long)  # [3, B, T]; pads' positions are never read
            for i, p in enumerate(pos):
                position_ids[:, i, :p.shape[-1]] = p
        position_ids = to_device(position_ids, device) if position_ids is not None else None
    varlen_kw = {k: to_device(v, device) if torch.is_tensor(v) else v for k, v in (varlen_kw or {}).items()} or None
    resp_len = torch.tensor([len(s["response_ids"]) for s in samples])
    return dict(input_ids=to_device(input_ids, device), resp_idx=to_device(resp_idx, device),
                targets=to_device(targets, device), mm_inputs=mm,
                owner=(list(range(len(prompts))) if shared else owner, counts, vcounts),  # whom each row shows
                position_ids=position_ids, varlen=varlen_kw), resp_len


def _positions(hf, samples, prompts, owner, rope):
    """Rotary positions of each sample (CPU). Text LLMs: 0..L-1. M-RoPE: get_rope_index on each distinct prompt,
    the response continuing its last position on all three axes (a prompt ending on an image token: the full call)."""
    if rope == "1d":
        return [torch.arange(len(s["prompt"]["prompt_ids"]) + len(s["response_ids"])) for s in samples]
    per_prompt = [_rope_index(hf, p["prompt_ids"], p["mm_inputs"]) for p in prompts]  # [3, Lp] each
    image_ids = {getattr(hf.config, "image_token_id", None), getattr(hf.config, "video_token_id", None)}
    out = []
    for s, o in zip(samples, owner):
        pp, lr = per_prompt[o], len(s["response_ids"])
        if s["prompt"]["prompt_ids"][-1] in image_ids or s["prompt"].get("tool_images"):  # (images in the response)
            out.append(_rope_index(hf, s["prompt"]["prompt_ids"] + list(s["response_ids"]), s["prompt"]["mm_inputs"]))
        else:
            out.append(torch.cat([pp, pp[:, -1:] + 1 + torch.arange(lr)], dim=1))
    return out


def _rope_index(hf, ids, mm):
    """[3, L] M-RoPE positions of one sequence from transformers' get_rope_index (CPU tensors in, CPU out)."""
    ids = torch.tensor([ids])  # [1, L]
    grids = {k: mm[k] for k in ("image_grid_thw", "video_grid_thw") if k in mm}
    if not grids:
        return torch.arange(ids.shape[1]).expand(3, -1)
    kw = dict(input_ids=ids, attention_mask=None, **grids)
    if "second_per_grid_ts" in mm:  # Qwen2.5-VL's video time axis: positions count tokens_per_second x seconds
        kw["second_per_grid_ts"] = mm["second_per_grid_ts"]
    kw.update(mm_token_types(hf, ids, mm))  # (the forward and get_rope_index take it alike: transformers >= 5)
    return hf.model.get_rope_index(**kw)[0][:, 0]


def to_device(t, device):
    """Host -> GPU copy that does not wait: a plain .to(cuda) synchronizes with the GPU's queue (the host then
    idles until the previous micro-batch's backward is done, and the GPU until the host launches the next)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def pad_responses(values, resp_len):
    """Flat per-token values [N] -> response-aligned [B, R] (zeros past each response), and the mask [B, R]."""
    R = int(resp_len.max())
    mask = torch.arange(R)[None, :] < resp_len[:, None]  # [B, R]
    idx = to_device(mask.flatten().nonzero().squeeze(1), values.device)  # an index, not a boolean mask: no sync
    out = values.new_zeros(mask.numel()).index_copy(0, idx, values).view(mask.shape)
    return out, to_device(mask, values.device)


def stack_padded(rows, R, device):
    """List of 1-D per-sample tensors (or lists) -> [B, R] zero-padded, built on the host and copied once."""
    out = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=out.dtype)
    return to_device(out, device)


def make_micro_batches(lengths, max_tokens, max_samples, groups=None, packed=False, prompt_lens=None):
    """Sample indices in micro-batches of at most `max_tokens` tokens (padded: samples x the longest; packed: the
    real lengths, with `prompt_lens` each prompt once) and `max_samples` samples, longest first; with `groups` (each
    sample's prompt) a prompt's samples stay together (its image through the vision tower once). Every rank runs
    as many micro-batches (each forward all-gathers collectively): the largest are split to the agreed count."""
    groups = groups if groups is not None else list(range(len(lengths)))
    top = {}
    for g, n in zip(groups, lengths):
        top[g] = max(top.get(g, 0), n)
    order = sorted(range(len(lengths)), key=lambda i: (-top[groups[i]], str(groups[i]), -lengths[i]))

    def size(mb):  # tokens the micro-batch costs (its first sample is its longest)
        if not packed or prompt_lens is None:
            return sum(lengths[i] for i in mb) if packed else len(mb) * lengths[mb[0]]
        prompts = {groups[i]: prompt_lens[i] for i in mb}  # each distinct prompt once, then every response
        return sum(prompts.values()) + sum(lengths[i] - prompt_lens[i] for i in mb)

    mbs, cur = [], []
    for i in order:
        if cur and (size(cur + [i]) > max_tokens or len(cur) >= max_samples):
            mbs.append(cur)
            cur = []
        cur.append(i)
    if cur:
        mbs.append(cur)
    n = torch.tensor([len(mbs)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=_cpu_group())
    while len(mbs) < int(n):  # split the largest micro-batch in two (a rank always has >= n samples)
        j = max(range(len(mbs)), key=lambda k: size(mbs[k]))
        g = mbs.pop(j)
        mbs[j:j] = [g[:len(g) // 2], g[len(g) // 2:]]
    return mbs


def plan_micro_batches(model, samples, max_tokens, max_samples):
    """make_micro_batches for `model`'s rows (padded, packed, or packed with shared prompts)."""
    lengths = [len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    first = {}  # each prompt by its first sample: the same order on every rank (Ulysses' ranks plan the same rows)
    groups = [first.setdefault(id(s["prompt"]), i) for i, s in enumerate(samples)]
    K = 1 if model.ulysses is None else dist.get_world_size(model.ulysses)  # a row of K ranks: K x the tokens
    return make_micro_batches(lengths, max_tokens * K, max_samples, groups, model.packed,
                              [len(s["prompt"]["prompt_ids"]) for s in samples] if model.share_prompts else None)


@torch.no_grad()
def compute_logprobs(model, samples, pad_id, device, temperature, max_tokens, max_samples, chunk_size=4096,
                     entropy=True):
    """Per-sample 1-D log-probs and entropies (None each without `entropy`) of the response tokens under `model`, no
    gradients (CPU tensors, copied back once at the end: a copy per micro-batch would stall the GPU queue each time)."""
    order, lps, ents, lens = [], [], [], []
    for idx in plan_micro_batches(model, samples, max_tokens, max_samples):
        batch, resp_len = collate([samples[i] for i in idx], pad_id, device, model)
        lp, ent = model(**batch, temperature=temperature, chunk_size=chunk_size, entropy=entropy)  # [n], [n] or None
        order += idx
        lps.append(lp.float())
        ents += [ent.float()] if entropy else []
        lens += resp_len.tolist()
    out_lp, out_ent = [None] * len(samples), [None] * len(samples)
    for i, a, b in zip(order, torch.cat(lps).cpu().split(lens), torch.cat(ents).cpu().split(lens) if entropy else
                       [None] * len(order)):
        out_lp[i], out_ent[i] = a, b
    return out_lp, out_ent


# ----------------------------------------------------------------------------------------------- optimizer
def build_optimizer(model, lr, weight_decay, betas, warmup_steps, device, bf16_rounding=None, seed=0, schedule=None):
    """AdamW over the trainable parameters (fp32 master weights), or, with `bf16_rounding`, memory.py's AdamW for
    pure-bf16 weights and state. schedule: optimizer step -> learning-rate factor (default: warm-up, then constant)."""
    params = [p for p in model.parameters() if p.requires_grad]
    on_gpu = memory.local(params[0]).device.type == "cuda"  # offloaded weights step on the host
    if bf16_rounding:
        opt = memory.BF16AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, rounding=bf16_rounding, seed=seed)
    else:
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=on_gpu or None)
    # linear warmup from lr/warmup to lr, then constant (EasyR1's default schedule)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule or (lambda s: min(1.0, (s + 1) / max(1, warmup_steps))))
    return opt, sched


def optimizer_step(model, opt, sched, max_grad_norm, offload_state=False):
    """Clip, step, and skip the step when the gradient norm is not finite (a NaN batch must not poison the weights).
    offload_state (--offload-optimizer): the state in for the step, out after it. -> the pre-clip norm (float)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if math.isfinite(norm):
        if offload_state:
            memory.move_optimizer_state(opt, memory.local(params[0]).device)
        opt.step()
        if offload_state:
            memory.move_optimizer_state(opt, torch.device("cpu"))
    opt.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped first step makes torch warn about the order; the step is counted
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
        sched.step()
    return norm


# ----------------------------------------------------------------------------------------------- weights out
def iter_full_params(model, dtype=None, lora_only=False):
    """Yield (hf_name, full tensor) one parameter at a time (peak: one tensor); every rank must iterate. LoRA: the
    merged W + scale * B @ A under the base name (MoE experts: tiny_moe.merged_expert); `lora_only`: those only."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    scales, experts = memory.lora_layers(model), expert_wrappers(model)
    sd = getattr(model, "hf", model).state_dict()
    for name, p in sd.items():
        if ".lora_A." in name or ".lora_B." in name or ".original_module." in name:  # (modules_to_save: the copy)
            continue
        layer = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if lora_only and not (layer in scales and name.endswith(".weight")) and ".modules_to_save." not in name \
                and name not in experts:
            continue
        name, t, (wn, w) = name.replace(".modules_to_save.default.", "."), full(p), experts.get(name, ("", None))
        if w is not None:
            t = merged_expert(w, t, full(sd[f"{wn}.lora_A.default.weight"]), full(sd[f"{wn}.lora_B.default.weight"]))
        elif layer in scales and name.endswith(".base_layer.weight"):  # [out, in] + scale * [out, r] @ [r, in]
            a, b = full(sd[f"{layer}.lora_A.default.weight"]), full(sd[f"{layer}.lora_B.default.weight"])
            t = t.float() + scales[layer] * (b.float() @ a.float())
        name = name.replace(".base_layer.", ".").replace(".base_layer.", ".")  # (twice: the nested expert wrappers)
        yield name, (t.to(dtype) if dtype is not None else t).detach()
