"""How far the trainer's per-token log-probs of the tiny Gemma 4 move under each way vLLM 0.26's Gemma 4 computes
otherwise than transformers (BENCHMARKS.md session 25), on the CPU with transformers alone:
  ple_row       the per-layer inputs at image tokens: transformers reads the config's <pad> row, vLLM row 0
                (gemma4_mm.py); with <pad> at 0 (the tiny tokenizer since session 25, the hub's) they are one row;
                measured here as <pad> against another id, the mismatch the tokenizer's old <pad> at 502 made
  softcap_bf16  the final soft cap in the logits' dtype (vLLM, and families.soft_capped since session 25) against fp32
  bf16          the whole model in bf16 against fp32: the floor any two bf16 implementations share
each at the model's initial logits and with the final norm scaled (SCALES: trained models' logits are larger).
    python -m benchmarks.gemma4_engine_gap [--tokens 200] [--scales 1,4,10]"""
import argparse
import copy

import torch
import torch.nn.functional as F

import data
import families
import fsdp_actor
import tiny_model


def logits(model, ids, mm, pad=None):
    tc = model.config.get_text_config()
    old, tc.pad_token_id = tc.pad_token_id, tc.pad_token_id if pad is None else pad
    try:
        mm = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in mm.items()}
        with torch.no_grad():
            h = model.model(input_ids=ids, **mm, **families.mm_token_types(model, ids, mm), use_cache=False)
            return F.linear(h.last_hidden_state, model.get_output_embeddings().weight)  # [1, T, V]
    finally:
        tc.pad_token_id = old


def logp(z, targets, cap, capped_in_fp32=True):  # [T, V], [T] -> [T]
    z = torch.tanh(z.float() / cap) * cap if capped_in_fp32 else (torch.tanh(z / cap) * cap).float()
    return z.log_softmax(-1).gather(-1, targets[:, None])[:, 0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--scales", default="1,4,10")
    args = ap.parse_args()
    path = tiny_model.build_tiny_model(arch="gemma4")
    proc = data.load_processor(path)
    rows = [data.load_rows(tiny_model.demo_data()[1])[i] for i in range(3)]
    prompts = [data.encode_prompt(r, proc, format_prompt=tiny_model.DEMO_FORMAT_PROMPT, min_pixels=56 * 56,
                                  max_pixels=112 * 112) for r in rows]
    hf = fsdp_actor.load_hf_model(path, torch.float32).eval()
    cfg, cap = hf.config, hf.config.get_text_config().final_logit_softcapping
    other = 7  # any id but <pad>: a trained row, as vLLM's row 0 was while <pad> sat at 502
    print(f"<pad> {cfg.get_text_config().pad_token_id}, soft cap {cap}, {args.tokens} sampled tokens x {len(prompts)}")
    print("| final-norm scale | ple_row (fp32) | softcap_bf16 | bf16 vs fp32 |\n|---|---|---|---|")
    norm = hf.model.language_model.norm.weight
    base = norm.detach().clone()
    for scale in [float(s) for s in args.scales.split(",")]:
        with torch.no_grad():
            norm.copy_(base * scale)
        hb = copy.deepcopy(hf).to(torch.bfloat16)
        g, gaps = torch.Generator().manual_seed(1), {"ple": [], "cap": [], "bf16": []}
        for p in prompts:
            ids = torch.tensor([p["prompt_ids"]])
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
            full = hf.generate(input_ids=ids, **p["mm_inputs"], **families.mm_token_types(hf, ids, p["mm_inputs"]),
                               do_sample=True, top_k=0, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                               suppress_tokens=[cfg.image_token_id, cfg.video_token_id])
            L, mm = ids.shape[1], p["mm_inputs"]
            t = full[0, L:]
            z32, z16 = logits(hf, full, mm)[0, L - 1:-1], logits(hb, full, mm)[0, L - 1:-1]
            ref = logp(z32, t, cap)
            gaps["ple"].append((logp(logits(hf, full, mm, pad=other)[0, L - 1:-1], t, cap) - ref).abs())
            gaps["cap"].append((logp(z16, t, cap, False) - logp(z16, t, cap)).abs())
            gaps["bf16"].append((logp(z16, t, cap) - ref).abs())
        m = {k: torch.cat(v).mean().item() for k, v in gaps.items()}
        print(f"| {scale:g} | {m['ple']:.2e} | {m['cap']:.2e} | {m['bf16']:.2e} |")


if __name__ == "__main__":
    main()
