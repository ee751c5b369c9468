"""Replay a demo run from one of its checkpoints, AdamW's first moment kept or zeroed: does the colour the run lost
after that checkpoint ride on the optimizer's memory of earlier steps (HISTORY.md, 2026-12-05)?

    cp -r outputs/gemma4 /tmp/r && rm -rf /tmp/r/checkpoints/step_1[45]0    # keep the checkpoint to replay from
    python benchmarks/cpu/momentum_replay.py --zero-momentum --demo-model gemma4 --output-dir /tmp/r \
        --resume /tmp/r/checkpoints/step_130

grpo.py's exact resume replays the steps after the checkpoint sample for sample (checked: without --zero-momentum
the replay's metrics equal the run's). Prints the pending update (AdamW's bias-corrected m / sqrt(v), RMS over every
weight, in units of the learning rate) as loaded."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import grpo  # noqa: E402
import rundir  # noqa: E402

ZERO = "--zero-momentum" in sys.argv
sys.argv = [a for a in sys.argv if a != "--zero-momentum"]
_load = rundir.load_checkpoint


def load_checkpoint(path, model, opt, sched):
    extra = _load(path, model, opt, sched)
    (beta1, beta2), sq, count = opt.param_groups[0]["betas"], 0.0, 0
    for st in opt.state.values():
        t = float(st["step"])
        m_hat, v_hat = st["exp_avg"] / (1 - beta1 ** t), st["exp_avg_sq"] / (1 - beta2 ** t)
        sq += float((m_hat / (v_hat.sqrt() + 1e-8)).square().sum())
        count += m_hat.numel()
        if ZERO:
            st["exp_avg"].zero_()
    print(f"[replay] {path}: pending update RMS {(sq / count) ** 0.5:.3f} x lr; first moment "
          f"{'zeroed' if ZERO else 'kept'}", flush=True)
    return extra


rundir.load_checkpoint = load_checkpoint
if __name__ == "__main__":
    grpo.main()
