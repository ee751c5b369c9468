"""Why the Qwen3-VL colour demo stalls with vLLM (issue 24): train the demo with vLLM, then look at the validation
prompts from several sides, per colour. One GPU; results as JSON lines on stdout and in $OUT/diag.jsonl."""
import collections
import json
import os
import sys
import time

import torch

import easyr1_config
import fsdp_actor as actor
import grpo
import rollout

OUT = os.environ.get("OUT", "/tmp/diag_out")
os.makedirs(OUT, exist_ok=True)
STEPS = int(os.environ.get("DIAG_STEPS", "40"))
EXTRA = sys.argv[1:]
LOG = open(os.path.join(OUT, "diag.jsonl"), "w")


def emit(**kw):
    line = json.dumps(kw, default=str)
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def per_colour(samples):
    acc = collections.defaultdict(list)
    for s in samples:
        acc[s["prompt"]["answer"]].append(s["reward"])
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(acc.items())}


def answers(samples):
    c = collections.Counter((s["prompt"]["answer"], s["text"]) for s in samples)
    return {f"{a} -> {t!r}": k for (a, t), k in c.most_common(12)}


def run_val(ctx, recs, temperature=0.0, n=1, batch=64):
    out = []
    for i in range(0, len(recs), batch):
        drawn = [(-1 - j, r) for j, r in enumerate(recs[i:i + batch], start=i)]
        out += grpo.generate_and_score(ctx, drawn, n, temperature, 1.0)
    return out


def main():
    args = ["--demo-model", "qwen3_vl", "--rollout-engine", "vllm", "--enforce-eager", "--gpu-memory-utilization",
            "0.25", "--output-dir", "/tmp/diag_run", "--max-steps", str(STEPS), *EXTRA]
    cfg = easyr1_config.cli(grpo.Config, grpo.DEMO, args=args, text_demo=grpo.TEXT_DEMO, video_demo=grpo.VIDEO_DEMO)
    ctx = grpo.setup(cfg)
    val = [ctx.val[j] for j in range(len(ctx.val))]
    t0 = time.time()
    for step in range(STEPS):
        m, samples = grpo.train_step(ctx, step)
        rec = dict(step=step + 1, reward=round(m["reward/mean"], 3), train=per_colour(samples),
                   diff=m.get("rollout/logprob_diff_mean"), t=round(time.time() - t0, 1))
        if (step + 1) % 10 == 0:
            grpo.sync_engine(ctx)
            ctx.rollout.wake()
            vs = run_val(ctx, val)
            ctx.rollout.sleep()
            rec.update(val=per_colour(vs), val_mean=round(sum(s["reward"] for s in vs) / len(vs), 3))
        emit(**rec)
    grpo.sync_engine(ctx)
    eng = ctx.rollout
    eng.wake()
    # D1 greedy val, as validate() does; and the answers per colour
    vs = run_val(ctx, val)
    emit(d="D1 greedy val", val=per_colour(vs), answers=answers(vs))
    # D1b greedy val in batches of 8 (batching of the vision encoder)
    emit(d="D1b greedy val batch 8", val=per_colour(run_val(ctx, val, batch=8)))
    # D2 sampled val (T=1, n=8): is greedy the odd one out?
    emit(d="D2 sampled val T=1 n=8", val=per_colour(run_val(ctx, val, temperature=1.0, n=8)))
    # D5 greedy on 200 training rows
    tr = [ctx.train[j] for j in range(200)]
    ts = run_val(ctx, tr)
    emit(d="D5 greedy train rows", val=per_colour(ts), answers=answers(ts))
    # D3 after every cache reset vLLM has
    eng.llm.reset_mm_cache()
    eng._reset_caches()
    emit(d="D3 greedy val after reset_mm_cache", val=per_colour(run_val(ctx, val)))
    # D4 one pixel changed in every image (new hash: nothing cached can match)
    def perturbed(r):
        img = r["images"][0].copy()
        px = img.getpixel((0, 0))
        img.putpixel((0, 0), tuple(min(255, c + 1) for c in px))
        return {**r, "images": [img]}
    emit(d="D4 greedy val perturbed images", val=per_colour(run_val(ctx, [perturbed(r) for r in val])))
    # D9 prompt expansion: vLLM's prompt tokens against the trainer's prompt_ids
    from vllm import SamplingParams
    sp = SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=20, detokenize=False,
                        logit_bias={i: -100.0 for i in eng.forbidden_ids} or None)
    outs = eng.llm.generate([eng._vllm_prompt(r) for r in val], [sp] * len(val), use_tqdm=False)
    same = [list(o.prompt_token_ids) == list(r["prompt_ids"]) for o, r in zip(outs, val)]
    bad = [(len(o.prompt_token_ids), len(r["prompt_ids"]), r["answer"], r["images"][0].size)
           for o, r, s in zip(outs, val, same) if not s]
    emit(d="D9 prompt tokens equal", frac=sum(same) / len(same), examples=bad[:10])
    # D6 HF engine on the same weights, greedy val
    hf = rollout.HFRollout(ctx.model_path, device="cuda", dtype=ctx.compute_dtype)
    hf.sync_weights(actor.iter_full_params(ctx.model, ctx.compute_dtype))
    ctx.rollout = hf
    hs = run_val(ctx, val)
    emit(d="D6 HF engine greedy val", val=per_colour(hs), answers=answers(hs))
    ctx.rollout = eng
    # D7 first answer token: vLLM's top-20 processed log-probs against the HF model's log_softmax, per colour
    stats = collections.defaultdict(lambda: [0, 0, 0.0])  # colour -> [n, top1 equal, max |diff| over top-20]
    with torch.no_grad():
        for o, r in zip(outs, val):
            ids = torch.tensor([r["prompt_ids"]], device="cuda")
            mm = {k: (v.to("cuda", ctx.compute_dtype) if v.is_floating_point() else v.to("cuda"))
                  for k, v in r["mm_inputs"].items()}
            logits = hf.model(input_ids=ids, attention_mask=torch.ones_like(ids), **mm,
                              **actor.mm_token_types(hf.model, ids, mm)).logits[0, -1].float()
            logits[eng.forbidden_ids] = -float("inf")
            lp = torch.log_softmax(logits, -1)
            top = o.outputs[0].logprobs[0]
            st = stats[r["answer"]]
            st[0] += 1
            st[1] += int(lp.argmax().item() == o.outputs[0].token_ids[0])
            st[2] = max(st[2], max(abs(lp[t].item() - v.logprob) for t, v in top.items()))
    emit(d="D7 first token vLLM vs HF", per_colour={k: dict(n=v[0], top1_equal=v[1], max_diff=round(v[2], 4))
                                                     for k, v in sorted(stats.items())})
    # D8 the vision towers on the trainer's own pixel values
    try:
        inner = eng._inner_model()
        r = val[0]
        pv, thw = r["mm_inputs"]["pixel_values"].cuda(), r["mm_inputs"]["image_grid_thw"].cuda()
        v_out = inner.visual(pv, grid_thw=thw).float()
        h_out = hf.model.model.visual(pv.to(ctx.compute_dtype), grid_thw=thw)
        parts = [h_out.pooler_output] + list(h_out.deepstack_features) if hasattr(h_out, "pooler_output") else \
            [h_out[0]] + list(h_out[1])
        h_cat = torch.cat([p.float() for p in parts], dim=1)
        emit(d="D8 vision tower vLLM vs HF", shapes=[list(v_out.shape), list(h_cat.shape)],
             max_abs=(v_out - h_cat).abs().max().item() if v_out.shape == h_cat.shape else None,
             scale=h_cat.abs().mean().item())
    except Exception as e:  # a diagnostic: keep the others
        emit(d="D8 failed", error=repr(e))
    emit(d="done", t=round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
