"""flops.py -- model FLOPs of a step's real tokens, for MFU (`perf/mfu_update`, `perf/mfu_ref`), by veRL's convention
(verl/utils/flops_counter.py, EasyR1's too): 2 FLOPs per weight per token (the embedding and LM head included), causal
attention 2 x s^2 x head_dim x heads per layer over each sample's length s; training 3 x forward (no recompute), a
log-prob pass 1 x. Qwen2(.5)-VL's vision tower counted as veRL counts Qwen3-VL's ViT, each distinct image once."""
import families


def lm_forward_flops(cfg, seqlens):
    """Forward FLOPs of the language model over samples of these lengths (prompt + response tokens)."""
    t = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    h, L, heads = t.hidden_size, t.num_hidden_layers, t.num_attention_heads
    kv = getattr(t, "num_key_value_heads", None) or heads
    hd = sum(families.head_dims(t)) / L  # (Gemma 4's differ by layer: their mean)
    gdn = sum(x == "linear_attention" for x in getattr(t, "layer_types", None) or [])
    if gdn:
        return _hybrid_forward_flops(t, gdn, seqlens)
    weights = L * (3 * h * t.intermediate_size + h * (2 * heads * hd + 2 * kv * hd)) + 2 * t.vocab_size * h
    return 2 * weights * sum(seqlens) + 2 * L * heads * hd * sum(s * s for s in seqlens)


def _hybrid_forward_flops(t, gdn, seqlens):
    """Qwen3.5: `gdn` Gated DeltaNet layers, the others gated attention (q_proj twice as wide: its output gate); MoE
    layers count the k routed experts, the shared one and the router. The delta rule's own work is veRL's recurrent
    count, 5 x d_k x d_v per value head per token (state read, outer-product update, output read)."""
    h, L, heads, kv, hd = t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    kd, hv = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads
    vd = hv * t.linear_value_head_dim
    E = getattr(t, "num_experts", 0) or 0
    mlp = (3 * h * (t.num_experts_per_tok * t.moe_intermediate_size + t.shared_expert_intermediate_size) + h * E
           if E else 3 * h * t.intermediate_size)
    weights = (gdn * (h * (2 * kd + 2 * vd + 2 * hv) + vd * h) + (L - gdn) * h * (3 * heads * hd + 2 * kv * hd)
               + L * mlp + 2 * t.vocab_size * h)
    core = 5 * t.linear_key_head_dim * t.linear_value_head_dim * hv * gdn
    return (2 * weights + core) * sum(seqlens) + 2 * (L - gdn) * heads * hd * sum(s * s for s in seqlens)


def vision_forward_flops(vc, grids):
    """Forward FLOPs of a Qwen2-VL / Qwen2.5-VL vision tower over images with these (t, h, w) patch grids."""
    m = vc.spatial_merge_size
    if hasattr(vc, "embed_dim"):  # Qwen2-VL: width embed_dim, GELU MLP of mlp_ratio, full attention everywhere
        d, mlp, full, window = vc.embed_dim, 2 * vc.embed_dim * int(vc.embed_dim * vc.mlp_ratio), vc.depth, None
    else:  # Qwen2.5-VL: gated (SwiGLU) MLP; windows of window_size pixels except in fullatt_block_indexes
        d, mlp, full = vc.hidden_size, 3 * vc.hidden_size * vc.intermediate_size, len(vc.fullatt_block_indexes)
        window = vc.window_size // m // vc.patch_size  # window side in merged units
    out_dim = getattr(vc, "out_hidden_size", None) or vc.hidden_size
    patch = getattr(vc, "in_channels", 3) * vc.temporal_patch_size * vc.patch_size ** 2 * d
    merger = ((d * m * m) ** 2 + d * m * m * out_dim) / (m * m)  # per patch token (it runs on 1 in m^2)
    per_token = patch + vc.depth * (mlp + 4 * d * d) + merger
    total = 0.0
    for t, gh, gw in grids:
        frame = gh * gw
        attn = full * t * frame ** 2
        if window is not None:  # windows of window x window merged units; the last row/column may be smaller
            side = lambda n: [min(window, n - i) for i in range(0, n, window)]  # noqa: E731
            tiles = sum(a * a for a in side(gh // m)) * sum(b * b for b in side(gw // m)) * m ** 4
            attn += (vc.depth - full) * t * tiles
        total += 2 * per_token * t * frame + 4 * d * attn
    return total


def forward_flops(cfg, samples):
    """Forward FLOPs of one pass of the actor over `samples` (dicts with prompt and response_ids)."""
    seqlens = [len(s["prompt"]["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    total = lm_forward_flops(cfg, seqlens)
    vc = getattr(cfg, "vision_config", None)
    if vc is not None and getattr(cfg, "model_type", "") in ("qwen2_vl", "qwen2_5_vl"):
        prompts = {id(s["prompt"]): s["prompt"] for s in samples}.values()
        grids = [g.tolist() for p in prompts for g in p["mm_inputs"].get("image_grid_thw", ())]
        total += vision_forward_flops(vc, grids)
    return total
