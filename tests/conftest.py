"""The launcher for tests that start grpo.py, torchrun or run.sh as subprocesses (the `launch` fixture); the `gpu`
marker (tests that need CUDA, e.g. vLLM) is skipped on CPU boxes."""
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped when torch.cuda is unavailable)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def clean_env(**extra):
    """os.environ for a child: without the torch.distributed variables (a test that set up a 1-rank group in this
    process must not leak it into the children), one thread per process (the CPU is shared), unbuffered output.
    extra: more variables; a None value removes that variable."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def _stat(pid):
    """(state, ppid) of a process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _descendants(pid):
    """Every process below pid, read from /proc."""
    children = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        st = _stat(int(d))
        if st:
            children.setdefault(st[1], []).append(int(d))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _stop(p, grace=10.0):
    """Stop p and everything below it: SIGTERM to p's process group and to each descendant (torchrun starts its
    workers in sessions of their own, so the group alone misses them; on SIGTERM it also stops them itself), then
    SIGKILL whatever still runs after `grace` seconds."""
    if p.poll() is not None:
        return
    pids = [p.pid] + _descendants(p.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for kill, q in [(os.killpg, p.pid)] + [(os.kill, q) for q in pids]:
            try:
                kill(q, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + grace
        while time.time() < deadline:
            p.poll()  # reaps p, so it does not linger as a zombie
            if all((_stat(q) or ("Z",))[0] == "Z" for q in pids):
                return
            time.sleep(0.2)
    p.wait()


def _launcher():
    """launch.start(cmd, log, **env) -> Popen: cmd runs in ROOT in a session of its own, stdout and stderr to the
    file `log`, env = clean_env(**env). launch.wait(p or [p, ...], timeout, expect=0) waits for them all and fails
    the test (with the log's tail) on a timeout or an exit code other than `expect` (2: grpo.py's `error:` exit).
    launch.run(cmd, log, timeout, expect=0, **env) is both, and returns the process with its log's text as p.out.
    launch.script(file, arg, log, marker) runs a test file as a script (its own process, e.g. one vLLM engine each)
    and asserts that its output holds `marker`.
    Whatever is still running when the test ends (passed, failed or timed out) is stopped with all its
    descendants."""
    started = []

    def start(cmd, log, **env):
        f = open(log, "w")
        p = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=clean_env(**env), stdout=f,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        p.log = str(log)
        started.append((p, f))
        return p

    def tail(p, n=4000):
        with open(p.log, errors="replace") as f:
            return f.read()[-n:]

    def wait(ps, timeout, expect=0):
        ps = ps if isinstance(ps, (list, tuple)) else [ps]
        deadline = time.time() + timeout
        while True:  # poll them all: one failing ends the wait at once (its peers would block on it)
            for p in ps:
                rc = p.poll()
                assert rc in (None, expect), f"{p.args[:4]}... exited {rc}, not {expect}; its log ends:\n{tail(p)}"
            if all(p.poll() == expect for p in ps):
                return
            if time.time() > deadline:
                late = [p for p in ps if p.poll() is None]
                pytest.fail(f"{late[0].args[:4]}... still running after {timeout} s; its log ends:\n{tail(late[0])}")
            time.sleep(0.2)

    def run(cmd, log, timeout=600, expect=0, **env):
        p = start(cmd, log, **env)
        wait(p, timeout, expect)
        with open(p.log, errors="replace") as f:
            p.out = f.read()
        return p

    def script(file, arg, log, marker, timeout=600):
        # run as a script, its folder (tests/) comes first on sys.path; the repo's modules come from PYTHONPATH
        path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        p = run([sys.executable, os.path.abspath(file), arg], log, timeout, PYTHONPATH=path)
        print(p.out[-2000:])
        assert marker in p.out, p.out[-3000:]
        return p

    yield SimpleNamespace(start=start, wait=wait, run=run, tail=tail, script=script)
    for p, f in started:
        _stop(p)
        f.close()


@pytest.fixture
def launch():
    """The launcher: start, wait, run, tail (see _launcher)."""
    yield from _launcher()


@pytest.fixture(scope="module")
def launch_module():
    """launch for a module-scoped fixture: one run that several tests read."""
    yield from _launcher()
