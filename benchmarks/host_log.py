"""benchmarks/host_log.py OUT_CSV PATTERN [SECONDS] -- the host's side of a GPU run, once a second (beside
nvidia-smi's log, benchmarks/gpu_env.sh smi_start): how many cores were busy, the share stolen by the hypervisor
(a VM's neighbours), the cores' mean clock as /proc/cpuinfo gives it, and for the newest process whose command line
holds PATTERN its CPU use and its busiest thread's (name and share of one core), its page faults and the kernel's
compaction stalls (a large Python heap on a host that compacts memory for huge pages can stall its allocations). A
generation phase whose engine loop is short of the GPU (`bench phases`: utilisation well below 100 %) is either
Python at 100 % of one core, or a thread that lost its core or waited on memory: these columns say which. Standard
library only; Linux /proc. phases() (`python -m benchmarks.bench phases`) lays a run's steps over the two logs."""
import collections
import csv
import datetime
import json
import lzma
import os
import sys
import time


def cpu_times():
    """(busy, steal, total) jiffies of all cores together (/proc/stat's first line)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal, sum(f[:8])


def find(pattern):
    """The newest process (highest pid) other than this one whose command line holds pattern, or None."""
    best = None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern in cmd and int(pid) != os.getpid() and "host_log.py" not in cmd:
            best = max(best or 0, int(pid))
    return best


def thread_ticks(pid):
    """{tid: (name, utime + stime jiffies)} of the process's threads."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            rest = stat[stat.rindex(")") + 2:].split()
            out[tid] = (name, int(rest[11]) + int(rest[12]))  # fields 14 and 15: utime, stime
    except OSError:
        pass
    return out


def faults(pid):
    """(minor, major) page faults of the process so far (/proc/PID/stat fields 10 and 12), (0, 0) if it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return 0, 0
    rest = stat[stat.rindex(")") + 2:].split()
    return int(rest[7]), int(rest[9])


def compact_stalls():
    for line in open("/proc/vmstat"):
        if line.startswith("compact_stall "):
            return int(line.split()[1])
    return 0


def mean_mhz():
    mhz = [float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")]
    return sum(mhz) / len(mhz) if mhz else float("nan")


def sample(prev, pattern, hz):
    """One row from the counters since `prev` (the state the last call returned) and the new state."""
    busy, steal, total = cpu_times()
    pid = find(pattern)
    ticks = thread_ticks(pid) if pid else {}
    flt, stalls = faults(pid) if pid else (0, 0), compact_stalls()
    row = None
    if prev is not None:
        (b0, s0, t0, pid0, ticks0, flt0, stalls0, when0), now = prev, time.time()
        dt_total = max(total - t0, 1)
        cores = os.cpu_count() or 1
        per = {tid: (name, (t - ticks0[tid][1]) / hz / (now - when0)) for tid, (name, t) in ticks.items()
               if pid == pid0 and tid in ticks0}
        top = max(per.values(), key=lambda x: x[1], default=("-", 0.0))
        row = [time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}",
               f"{cores * (busy - b0) / dt_total:.2f}", f"{100 * (steal - s0) / dt_total:.1f}", f"{mean_mhz():.0f}",
               f"{100 * sum(v for _, v in per.values()):.0f}", f"{100 * top[1]:.0f}", top[0],
               f"{(flt[0] - flt0[0]) / (now - when0) if pid == pid0 else 0:.0f}",
               f"{(flt[1] - flt0[1]) / (now - when0) if pid == pid0 else 0:.0f}", f"{stalls - stalls0}"]
    return (busy, steal, total, pid, ticks, flt, stalls, time.time()), row


ORDER = ["sync", "gen", "old_logprob", "ref_logprob", "update"]  # a step's phases in grpo.train_step's order


def _timed_rows(path):
    """(unix time, row) of a once-a-second CSV log (.xz too) whose first column is nvidia-smi's local timestamp."""
    with (lzma.open if path.endswith(".xz") else open)(path, "rt") as f:
        return [(datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp(), r)
                for r in list(csv.reader(f))[1:]]


def phases(metrics_path, csv_path, host_path=None):
    """Per step and phase, what the GPU did (nvidia-smi's once-a-second rows, benchmarks/gpu_env.sh smi_start): mean SM
    clock, power and utilisation (the share of the second a kernel ran), and the share of seconds held down by the
    software power cap (clock-event bit 0x4) or a thermal/hardware slowdown (0x8, 0x20, 0x40, 0x80). A phase's
    window is its wall-clock start (time/<phase>_start in metrics.jsonl) and its seconds. A run from before those
    stamps: its last step is taken to end between the last row with a kernel running and the next, and the phases
    are laid back in order (to within ~1 s; a gap between them, the advantages, goes before the update). With the
    host's log (benchmarks/host_log.py, <run>_host.csv): the busy cores, the share stolen by the hypervisor and the
    run's busiest thread (its share of one core: ~100 % is a loop bound by its own Python) and its page faults in
    each phase too."""
    rows = [json.loads(x) for x in open(metrics_path) if '"timing/step"' in x]
    smi = [(when, float(r[2].split()[0]), float(r[5].split()[0]), float(r[6].split()[0]), int(r[7], 16))
           for when, r in _timed_rows(csv_path)]  # (time, SM MHz, watts, utilisation %, clock-event bits)
    host = [(when, float(r[1]), float(r[2]), float(r[5]), r[6].strip(), float(r[7]) + float(r[8]))
            for when, r in (_timed_rows(host_path) if host_path else [])]  # (.., cores, stolen %, thread %, name, faults)
    stamped = all("time/sync_start" in r for r in rows)
    if not stamped:  # the run ended after the last row with a kernel running
        busy = max((i for i, x in enumerate(smi) if x[3] > 0), default=None)
        if busy is None:
            return f"{csv_path}: no row with a kernel running, and the run has no time/ stamps to place its phases"
        end = (smi[busy][0] + smi[busy + 1][0]) / 2 if busy + 1 < len(smi) else smi[busy][0]
    out = ["| step | phase | seconds | SM MHz | watts | utilisation | power-capped | thermal/hw slowdown |"
           + (" busy cores | stolen | busiest thread | page faults/s |" if host else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if host else "")]
    for i, r in enumerate(rows):
        if stamped:
            spans = [(k, r[f"time/{k}_start"], r[f"timing/{k}"]) for k in ORDER if f"time/{k}_start" in r]
        else:  # laid back from the end of the last step
            start = end - sum(q["timing/step"] for q in rows[i:])
            spans, t = [], start
            for k in ORDER:
                if f"timing/{k}" in r:
                    if k == "update":
                        t = start + r["timing/step"] - r["timing/update"]
                    spans.append((k, t, r[f"timing/{k}"]))
                    t += r[f"timing/{k}"]
        for k, t0, secs in spans:
            w = [x for x in smi if t0 <= x[0] < t0 + secs]
            if not w:
                continue
            mean = lambda j: sum(x[j] for x in w) / len(w)  # noqa: E731
            share = lambda bits: sum(1 for x in w if x[4] & bits) / len(w)  # noqa: E731
            line = (f"| {r.get('step', i + 1)} | {k} | {secs:.1f} | {mean(1):.0f} | {mean(2):.0f} | {mean(3):.0f} % | "
                    f"{share(0x4):.0%} | {share(0x8 | 0x20 | 0x40 | 0x80):.0%} |")
            h = [x for x in host if t0 <= x[0] < t0 + secs]
            if host:
                top = collections.Counter(x[4] for x in h).most_common(1)
                line += (f" {sum(x[1] for x in h) / len(h):.1f} | {sum(x[2] for x in h) / len(h):.1f} % | "
                         f"{sum(x[3] for x in h) / len(h):.0f} % ({top[0][0]}) | {sum(x[5] for x in h) / len(h):.0f} |"
                         if h else " - | - | - | - |")
            out.append(line)
    return "\n".join(out) + ("" if stamped else "\n\n(no time/ stamps in this run: phases laid back from its last "
                                                 "busy second, ~1 s)")


def main():
    out, pattern = sys.argv[1], sys.argv[2]
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    hz = os.sysconf("SC_CLK_TCK")
    with open(out, "w") as f:
        f.write("timestamp, cores_busy, steal_pct, cpu_mhz, proc_cpu_pct, top_thread_pct, top_thread, "
                "minor_faults_per_s, major_faults_per_s, compact_stalls\n")
        state, _ = sample(None, pattern, hz)
        while True:
            time.sleep(seconds)
            state, row = sample(state, pattern, hz)
            f.write(", ".join(row) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
