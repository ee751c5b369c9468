"""plot.py -- reward curves from metrics.jsonl files.

    python plot.py outputs/demo/metrics.jsonl --out demo_reward.png
    python plot.py a/metrics.jsonl b/metrics.jsonl --labels cpu gpu --out compare.png
"""
import json
from dataclasses import dataclass, field
from typing import Annotated

import tyro


@dataclass
class Args:
    files: Annotated[list[str], tyro.conf.Positional]
    out: str = "reward.png"
    labels: list[str] = field(default_factory=list)
    title: str = "reward (train: sampled, temperature 1; val: greedy, unseen images)"
    chance: float = 0.25  # where the dotted chance line goes (1 of 4 colours); 0 = no line
    chance_label: str = "chance (1 of 4 colours)"


def main(a: Args):
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, path in enumerate(a.files):
        rows = [json.loads(x) for x in open(path)]
        label = a.labels[i] if i < len(a.labels) else path
        train = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
        val = [(r["step"], r["val/mean"]) for r in rows if "val/mean" in r]
        line, = ax.plot(*zip(*train), lw=1, alpha=0.8, label=f"{label} train")
        if val:
            ax.plot(*zip(*val), "o-", color=line.get_color(), ms=3, label=f"{label} val")
    if a.chance:
        ax.axhline(a.chance, color="grey", ls=":", lw=1, label=a.chance_label)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(a.title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
