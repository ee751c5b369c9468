"""The zoom demo's reply, read from a checkpoint (docs/demos.md): p(colour word | the zoomed picture) on validation
prompts, and the same with the zoom's pixels swapped between prompts (which picture the reply reads).

    python merge.py outputs/demo/checkpoints/step_110 /tmp/hf && python benchmarks/cpu/zoom_probe.py /tmp/hf 40

Each prompt's turn 2 is built by tools.rollout itself (a scripted engine: the call, then the end of turn), so the
context is token for token what the trainer sees; a colour's probability sums every token that reads as it."""
import os
import sys

import torch
from transformers import AutoModelForImageTextToText

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import data  # noqa: E402
import tiny_model  # noqa: E402
import tools  # noqa: E402
from types import SimpleNamespace as NS  # noqa: E402

PIX = dict(min_pixels=56 * 56, max_pixels=112 * 112)


class TwoTurns:  # turn 1: the call; turn 2: the end of turn; keeps what each call was given
    def __init__(self, call, end):
        self.turns, self.eos_ids, self.seen = [[call, end], [end]], [end], []

    def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, lengths=None, logprobs=None):
        self.seen.append([(list(p["prompt_ids"]), p["mm_inputs"]) for p in prompts])
        ids = self.turns[len(self.seen) - 1][:max_tokens]
        return [[{"response_ids": ids, "finished": True, "logprobs": [0.0] * len(ids)}] for _ in prompts]


def main(path, count=40):
    proc, cols = data.load_processor(path, **PIX), list(tiny_model.COLORS)
    tok, fns = proc.tokenizer, tools.load_tools("zoom")
    _, val = tiny_model.demo_zoom_data(n_train=2000, n_val=200)
    ds = data.PromptDataset(val, proc, format_prompt=tiny_model.ZOOM_FORMAT_PROMPT, tools=tools.schemas(fns), **PIX)
    recs = [ds[i] for i in range(count)]
    eng = TwoTurns(tok.convert_tokens_to_ids(tools.ZOOM_CALL), tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = NS(max_response_length=40, max_turn_tokens=1, max_turns=2, tool_timeout=2.0, limit_images=3, **PIX)
    tools.rollout(NS(cfg=cfg, tokenizer=tok, processor=proc, rollout=eng, tools=fns, world=1, rank=0),
                  dict(prompts=recs, n=1, temperature=1.0, top_p=1.0, max_tokens=1, seeds=list(range(count)),
                       logprobs=[1] * count))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    words = {}
    for i in range(model.config.get_text_config().vocab_size):
        try:
            words.setdefault(tok.decode([i]).strip().lower(), []).append(i)
        except TypeError:  # (ids the tokenizer does not hold)
            pass
    n1 = int(eng.seen[1][0][1]["image_grid_thw"][0].prod())  # the question's picture's patches; the zoom's follow
    zooms = {}
    for r, (_, mm) in zip(recs, eng.seen[1]):
        zooms.setdefault(r["answer"], mm["pixel_values"][n1:])
    table = {}
    with torch.no_grad():
        for r, (ids, mm) in zip(recs, eng.seen[1]):
            for zc, z in zooms.items():
                p = model(input_ids=torch.tensor([ids]), pixel_values=torch.cat([mm["pixel_values"][:n1], z]),
                          image_grid_thw=mm["image_grid_thw"]).logits[0, -1].softmax(-1)
                row = torch.stack([p[words.get(c, [])].sum() for c in cols])
                table.setdefault((r["answer"], zc), []).append(row)
    print("p(colour | zoom) over", cols, "(each prompt with its own zoom)")
    for c in cols:
        print(f"  {c:6s}", " ".join(f"{x:.4f}" for x in torch.stack(table[c, c]).mean(0).tolist()))
    print("p(colour | question's picture, zoom swapped in)")
    for (a, zc), rows in sorted(table.items()):
        print(f"  {a:6s} {zc:6s}", " ".join(f"{x:.4f}" for x in torch.stack(rows).mean(0).tolist()))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
