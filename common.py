"""common.py -- the floor, which imports no file of this project: the user-error type and its one-line report, the
image pixel bounds the options and the data share, small CPU collectives, and the garbage collector's pause and
freeze (measured 2026-12-02: benchmarks/HISTORY.md)."""
import contextlib
import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

# EasyR1 defaults (data.min_pixels / data.max_pixels).
MIN_PIXELS, MAX_PIXELS = 262144, 4194304
# LoRA's default exclusion: every family's vision and audio towers and projector (EasyR1's .*visual.*: Qwen's only)
LORA_EXCLUDE = r".*(visual|vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector).*"


class UserError(ValueError):
    """A mistake in what the user gave (an option, a file, a data row, a reward file): grpo.py and dapo.py print it as
    one `error:` line (rank 0, unless rank_local) and exit with code 2, no traceback."""

    def __init__(self, message, rank_local=False):
        super().__init__(message)
        self.rank_local = rank_local


def first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def one_line_errors():
    """Around a command line's work: a UserError ends the process with `error: <message>` and exit code 2, no
    traceback; every rank raises the same one and rank 0 speaks (a rank_local one: the rank that raised it)."""
    try:
        yield
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0 or e.rank_local:
            for bar in list(tqdm._instances):
                bar.close()  # end the progress bar's line first
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(2)  # exiting first would let torchrun stop rank 0 before it prints
        if dist.is_initialized() and not e.rank_local:  # (the others may be inside a collective: just go)
            dist.destroy_process_group()
        sys.exit(2)


# ----------------------------------------------------------------------------------------------- CPU collectives
def free_port() -> str:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


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


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while the block runs (vLLM's engine loop: Python on one core, the GPU
    waiting); reference counting frees all but cycles, which the collector takes once back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def heap_freezer():
    """Yields freeze(): collect once, then gc.freeze() every live object (as vLLM does), called by grpo.train after
    the first step: every vLLM sleep's full collection then walks only what later steps made. On leaving, unfreeze."""
    try:
        yield lambda: (gc.collect(), gc.freeze())
    finally:
        gc.unfreeze()
