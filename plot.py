"""plot.py -- reward curves from metrics.jsonl files (grpo.py also keeps <output_dir>/reward.png up to date).

    python plot.py outputs/demo/metrics.jsonl --chance 0.25 --out demo_reward.png
    python plot.py a/metrics.jsonl b/metrics.jsonl --labels cpu gpu --out compare.png
"""
import json
import os
from dataclasses import dataclass, field
from typing import Annotated

import tyro


@dataclass
class Args:
    files: Annotated[list[str], tyro.conf.Positional]
    out: str = "reward.png"
    labels: list[str] = field(default_factory=list)
    title: str = "reward (train: sampled, temperature 1; val: greedy, unseen images)"
    chance: float | None = None  # a dotted line at the reward of guessing (the demo: 0.25, one of 4 colours)


def plot(files, out, labels=(), title="", chance=None):
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, path in enumerate(files):
        rows = [json.loads(x) for x in open(path) if x.strip()]
        label = labels[i] if i < len(labels) else path
        train = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
        val = [(r["step"], r["val/mean"]) for r in rows if "val/mean" in r]
        line, = ax.plot(*(zip(*train) if train else ([], [])), lw=1, alpha=0.8, label=f"{label} train")
        if val:
            ax.plot(*zip(*val), "o-", color=line.get_color(), ms=3, label=f"{label} val")
    if chance is not None:
        ax.axhline(chance, color="grey", ls=":", lw=1, label="chance")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    tmp = out + ".tmp.png"  # written whole, then renamed: a viewer never reads half a file
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    a = tyro.cli(Args)
    print(f"wrote {plot(a.files, a.out, a.labels, a.title, a.chance)}")
