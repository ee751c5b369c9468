"""benchmarks/host_log.py OUT_CSV PATTERN [SECONDS] -- the host's side of a GPU run, once a second (beside
nvidia-smi's log, benchmarks/gpu_env.sh smi_start): how many cores were busy, the share stolen by the hypervisor
(a VM's neighbours), the cores' mean clock as /proc/cpuinfo gives it, and for the newest process whose command line
holds PATTERN its CPU use and its busiest thread's (name and share of one core), its page faults and the kernel's
compaction stalls (a large Python heap on a host that compacts memory for huge pages can stall its allocations). A
generation phase whose engine loop is short of the GPU (bench.py phases: utilisation well below 100 %) is either
Python at 100 % of one core, or a thread that lost its core or waited on memory: these columns say which. Standard
library only; Linux /proc."""
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
