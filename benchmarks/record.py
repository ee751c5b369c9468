"""The record behind benchmarks/BENCHMARKS.md: each of its tables, the command that prints it and the files it reads.

From the repository root:
    python -m benchmarks.record                 # every table: its section, its command, then what the command prints
    python -m benchmarks.record speed           # one table, by name (names: TABLES below)
    python -m benchmarks.record parity FILES    # the tables no other tool prints: parity, curves,
                                                #   spikes, engine, two-turn, seconds, text, steps

BENCHMARKS.md quotes each command's output verbatim under its section, and tests/test_benchmarks_record.py holds it
so: every file a table names exists, every run file kept in benchmarks/cpu and benchmarks/h200 is named by a table,
and each table in BENCHMARKS.md is what its command prints now. A new measurement: keep its run files, add a Table
here (or a file to one), paste `python -m benchmarks.record NAME`'s output into its section.
"""
import collections
import glob
import json
import os
import re
import statistics
import sys

from benchmarks import bench, engine_bench, matrix, two_turn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: how `python -m benchmarks.record NAME` calls it; section: the BENCHMARKS.md heading it sits under (without
# "## "); command: the module and subcommand that print it; files: the run files it reads (paths from the repository
# root; a pattern stands for the files it matches, sorted, as the shell gives them); args: after the files.
Table = collections.namedtuple("Table", "name section command files args", defaults=((),))

MATRIX = "Learning matrix: every demo with vLLM (H100 and H200, 2026-12-01 to 2026-12-06)"
GEMMA4 = "Losing a colour: what decides it (H100 and CPU, 2026-12-05 to 2026-12-06)"
TWO_GPUS = "Two H200s: the colour demo at tensor parallel 1 and 2 (2 x H200, 2026-11-30)"
PARITY = "Parity: vLLM against the HF engine (H200, 2026-12-01 to 2026-12-04)"
SPEED = "Speed: the Qwen2.5-VL-3B step (H200, 2026-12-02)"
MEMORY = "Memory cells: measured against the memory model (H200, 2026-12-01 to 2026-12-05)"
LONG = "Long answers: the Qwen3-4B shape at 16k response tokens (H100, 2026-12-05)"
SHAPES = "Model shapes: Qwen3.5-9B, Qwen3.5-35B-A3B, Gemma-4-E2B (H200, 2026-12-03 to 2026-12-05)"
TOOLS_GPU = "The zoom demo with vLLM: the tools GPU test (H200 and H100, 2026-12-05 to 2026-12-06)"
TWO_TURN = "Two-turn rollout: a tool's picture between turns (H200 and H100, 2026-12-04 to 2026-12-06)"
CPU = "CPU demos: each built-in demo learns, at its own lr schedule (2-core CPU, 2026-12-05)"
TOOLS = "CPU: the zoom tool demo on five seeds (2-core CPU, 2026-12-05)"

H, C, H1 = "benchmarks/h200/", "benchmarks/cpu/", "benchmarks/h100/"
TABLES = [
    Table("matrix_one_run", MATRIX, "benchmarks.matrix table", [H1 + "matrix_2026-12-06.json"]),
    Table("matrix", MATRIX, "benchmarks.matrix table", [H + "matrix_*.json"], ("--last",)),
    Table("gemma4_causes", GEMMA4, "benchmarks.matrix table --ran", [H1 + "matrix_2026-12-05_gemma4_causes.json"]),
    Table("gemma4_balanced", GEMMA4, "benchmarks.matrix table --ran", [H1 + "matrix_2026-12-05_c.json"], (
        "--rows", "qwen25vl_colour,bf16,gemma4_colour,gemma4_colour/s2,gemma4_colour+kl001,gemma4_colour+kl001/s2,"
        "gemma4_colour+kl001/s3")),
    Table("gemma4_spikes", GEMMA4, "benchmarks.record spikes", [H1 + "matrix_2026-12-05_c_*_metrics.jsonl.xz",
                                                                 C + "demo_gemma4_balanced_metrics.jsonl.xz"]),
    Table("gemma4_cpu", GEMMA4, "benchmarks.record curves", [C + f + "_metrics.jsonl.xz" for f in (
        "demo_gemma4_balanced", "demo_gemma4_balanced_replay130_zero_momentum", "demo_gemma4_balanced_cosine",
        "demo_gemma4_balanced_cosine_seed2", "demo_gemma4_balanced_cosine_seed3", "demo_gemma4_balanced_cosine_kl0.01",
        "demo_balanced_300steps")]),
    Table("gemma4_blue", GEMMA4, "benchmarks.record answers",
          [H1 + "matrix_2026-12-06_gemma4_colour_seed2_val_samples.jsonl.xz"], ("answer=blue",)),
    Table("colour_cosine", GEMMA4, "benchmarks.record curves", [H1 + "matrix_2026-12-05_d_*_metrics.jsonl.xz"] + [
        C + f + "_metrics.jsonl.xz" for f in (
            "demo_qwen3_5_moe_cosine", "demo_qwen3_5_moe_cosine_seed2", "demo_qwen3_5_moe_cosine_seed3",
            "demo_qwen3_5_moe_constant_seed3", "demo_qwen3_5_moe_cosine_t1.2_seed2",
            "demo_qwen3_5_moe_cosine_t1.2_seed3")]),
    Table("two_gpus", TWO_GPUS, "benchmarks.record curves", [H + "demo_vllm_2gpu_tp1_110steps_metrics.jsonl",
                                                               H + "demo_vllm_2gpu_tp2_100steps_metrics.jsonl"]),
    Table("parity", PARITY, "benchmarks.record parity", [H + "parity_*.json"]),
    Table("speed", SPEED, "benchmarks.bench report", [H + "bench3b_2026-12-02_*_metrics.jsonl",
                                                       H + "bench8b_qwen3vl_bf16_packed_shared_metrics.jsonl"]),
    Table("engine3b", SPEED, "benchmarks.record engine", [H + "engine3b_2026-12-02_d.json"]),
    Table("pyspy", SPEED, "benchmarks.bench pyspy", [H + "engine3b_2026-12-02_a_pyspy_raw.txt.xz"], ("top=6",)),
    Table("memory", MEMORY, "benchmarks.bench table", [
        H + "m3b_amp_summary.json", H + "m3b_bf16_summary.json", H + "m3b_lora_summary.json",
        H + "m3b_offload_summary.json", H + "m3b_offopt_summary.json", H + "m7b_lora_amp_cap80_summary.json",
        H + "m7b_lora_bf16_cap40_kv1.5_summary.json", H + "m7b_lora_bf16_cap40_oom_step2_metrics.jsonl",
        H + "bench8b_qwen3vl_bf16_1gpu_16x8_summary.json", H + "moe30b_lora_bf16_summary.json",
        H + "bench9b_qwen35_2026-12-04_summary.json", H + "moe35b_qwen35_2026-12-05_summary.json",
        H + "gemma4_e2b_2026-12-04_summary.json"]),
    Table("shapes", SHAPES, "benchmarks.bench report", [H + "bench9b_qwen35_2026-12-03_oom_in_step2_metrics.jsonl",
                                                         H + "bench9b_qwen35_2026-12-04_metrics.jsonl",
                                                         H + "moe35b_qwen35_2026-12-05_metrics.jsonl",
                                                         H + "gemma4_e2b_2026-12-04_metrics.jsonl"]),
    Table("long16k", LONG, "benchmarks.record steps", [H1 + "long_qwen3_4b_16k_4x4_2026-12-05.log"]),
    Table("engine9b", SHAPES, "benchmarks.record engine", [H + "engine9b_qwen35_2026-12-04.json"]),
    Table("tools_gpu", TOOLS_GPU, "benchmarks.record curves", [H + "test_tools_gpu_2026-12-05_*steps_metrics.jsonl"]),
    Table("tools_gpu_h100", TOOLS_GPU, "benchmarks.record text", [H1 + "test_tools_gpu_2026-12-0*.log"]),
    Table("two_turn", TWO_TURN, "benchmarks.record two-turn", [d + "two_turn3b_*" + f for d in (H, H1) for f in (
        ".json", "_gpu.csv.xz", "_host.csv.xz")]),
    Table("cpu_demos", CPU, "benchmarks.record curves", [C + f + "_metrics.jsonl.xz" for f in (
        "demo_cosine", "demo_torchrun2_cosine", "demo_cosine_bf16", "demo_qwen2vl_cosine", "demo_qwen3vl_cosine",
        "demo_qwen3vl_moe_cosine", "demo_qwen3_5_cosine", "demo_qwen3_5_moe_cosine_t1.2", "demo_internvl_cosine",
        "demo_lora_cosine", "demo_lora_vision_adapters_cosine", "demo_rloo_cosine", "demo_video_cosine",
        "demo_qwen3vl_video_cosine", "demo_text_constant", "demo_text_cosine", "dapo_constant", "dapo_cosine")]),
    Table("tools", TOOLS, "benchmarks.record curves", [C + "demo_tools_balanced_*_metrics.jsonl.xz"]),
]


def files(t, root=ROOT):
    """The table's files, patterns expanded (a pattern that matches nothing stays, to be reported missing)."""
    out = []
    for p in t.files:
        hits = sorted(glob.glob(os.path.join(root, p))) if "*" in p else []
        out += [os.path.relpath(x, root) for x in hits] or [p]
    return out


def missing(tables=TABLES, root=ROOT):
    """The files the tables name that are not there."""
    return sorted({f for t in tables for f in files(t, root) if not os.path.isfile(os.path.join(root, f))})


def strays(tables=TABLES, root=ROOT, folders=("benchmarks/cpu", "benchmarks/h200", "benchmarks/h100")):
    """The files kept in the run folders that no table names (scripts, *.py, aside: zoom_probe.py is a tool)."""
    named = {f for t in tables for f in files(t, root)}
    kept = [os.path.relpath(os.path.join(d, f), root) for folder in folders
            for d, subs, fs in os.walk(os.path.join(root, folder)) if "__pycache__" not in d for f in fs]
    return sorted(f for f in kept if f not in named and not f.endswith(".py"))


def command(t):
    """The command as BENCHMARKS.md shows it (run from the repository root; the shell expands the patterns)."""
    return " ".join(["python -m", t.command, *t.files, *t.args])


def parity_table(paths):
    """One line per `python -m benchmarks.matrix parity --json` result: greedy answers equal, log-prob gap per token."""
    out = ["| run | prompts | greedy equal | log-prob gap mean | worst class (mean) | largest token | result |",
           "|---|---|---|---|---|---|---|"]
    for p in paths:
        d = json.load(open(p))
        top = max(c["max"] for c in d["classes"].values())
        out.append(f"| {os.path.basename(p).removesuffix('.json')} | {d['prompts']} | {d['greedy_equal']:.3f} | "
                   f"{d['mean']:.1e} | {d['worst_class']} ({d['worst_mean']:.1e}) | {top:.2f} | "
                   f"{'; '.join(d['failures']) or 'pass'} |")
    return "\n".join(out)


def curves_table(paths):
    """One line per metrics.jsonl[.xz]: greedy validation at each validation step (val/accuracy where the run logs
    it, the answer alone; else val/mean), runs of one value joined; where the run calls tools, the first training
    step whose tool-call rate reached 0.5 and 0.9, and its largest."""
    out = ["| run | steps | train reward, first 5 -> last 5 steps | greedy validation | tool-call rate: 0.5 from step, "
           "0.9 from step, max |", "|---|---|---|---|---|"]
    for p in paths:
        rows = [json.loads(x) for x in bench.read_lines(p)]
        train = [r for r in rows if "reward/mean" in r]
        key = "val/accuracy" if any("val/accuracy" in r for r in rows) else "val/mean"
        runs = []  # [value, first step, last step]
        for r in (r for r in rows if key in r):
            v = f"{r[key]:.3f}"
            if runs and runs[-1][0] == v:
                runs[-1][2] = r["step"]
            else:
                runs.append([v, r["step"], r["step"]])
        story = ", ".join(f"{v} at {a}" if a == b else f"{v} from {a} to {b}" for v, a, b in runs)
        rate = [(r["step"], r["tools/call_rate"]) for r in train if "tools/call_rate" in r]
        first = lambda bar: next((str(s) for s, x in rate if x >= bar), "never")  # noqa: E731
        calls = f"{first(0.5)}, {first(0.9)}, {max(x for _, x in rate):.3f}" if rate else "-"
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        rew = [r["reward/mean"] for r in train]
        out.append(f"| {os.path.basename(p).split('_metrics.jsonl')[0]} | {len(train)} | "
                   f"{mean(rew[:5]):.3f} -> {mean(rew[-5:]):.3f} | "
                   f"{story + f' ({key})' if story else '-'} | {calls} |")
    return "\n".join(out)


def spikes_table(paths):
    """One line per metrics.jsonl[.xz]: greedy validation from step 100 on, and each step past 60 whose gradient norm
    was 5x or more the median of the 20 steps before it (a rare mistake in a solved task: HISTORY.md, 2026-12-05)."""
    out = ["| run | greedy validation from step 100 | gradient-norm spikes after step 60: step (norm, x median of 20 "
           "before) |", "|---|---|---|"]
    for p in paths:
        rows = [json.loads(x) for x in bench.read_lines(p)]
        key = "val/accuracy" if any("val/accuracy" in r for r in rows) else "val/mean"
        val = ", ".join(f"{r['step']}: {r[key]:.3f}" for r in rows if key in r and r["step"] >= 100)
        g = [(r["step"], r["actor/grad_norm"]) for r in rows if "actor/grad_norm" in r]
        spikes = []
        for i, (step, x) in enumerate(g):
            med = statistics.median_high(y for _, y in g[max(0, i - 20):i]) if i else None
            if step > 60 and med and x >= 5 * med:
                spikes.append(f"{step} ({x:.1f}, {x / med:.0f}x)")
        out.append(f"| {os.path.basename(p).split('_metrics.jsonl')[0]} | {val} | {', '.join(spikes) or '-'} |")
    return "\n".join(out)


def answers_table(paths, answer):
    """Per validation step from 10 on (steps alike joined): the commonest greedy answer to the prompts whose answer is
    `answer`, and the share of them graded right (a matrix row's *_val_samples.jsonl[.xz])."""
    out = [f"| run | steps | commonest greedy answer to {answer} (its first 8 characters, of how many) | right |",
           "|---|---|---|---|"]
    for p in paths:
        by = collections.defaultdict(list)
        for r in (json.loads(x) for x in bench.read_lines(p)):
            if r["answer"] == answer and r["step"] >= 10:
                by[r["step"]].append(r)
        runs = []  # [(answer, right), first step, last step]
        for step, rs in sorted(by.items()):
            (top, k), = collections.Counter(r["response"][:8] for r in rs).most_common(1)
            row = (f"{json.dumps(top, ensure_ascii=False)} ({k} of {len(rs)})",
                   f"{sum(r['accuracy'] for r in rs) / len(rs):.2f}")
            if runs and runs[-1][0] == row:
                runs[-1][2] = step
            else:
                runs.append([row, step, step])
        name = os.path.basename(p).split("_val_samples")[0]
        out += [f"| {name} | {a if a == b else f'{a}-{b}'} | {row[0]} | {row[1]} |" for row, a, b in runs]
    return "\n".join(out)


def steps_lines(path):
    """A run's console log cut to what the trainer says of it: its [bench] and [batch] lines and its step lines
    (progress bars and the engine's log left out), as a code block."""
    text = open(path, errors="replace").read().replace("\r", "\n")
    keep = [m.group(0).rstrip() for line in text.splitlines()
            if (m := re.search(r"^\[(bench|batch)\] .*|\bstep +\d+ \|.*", line))]
    return "```\n" + "\n".join(dict.fromkeys(keep)) + "\n```"


def run_log(path, paths, kind="gpu"):
    """The GPU's or the host's log given beside a run's JSON (NAME_gpu.csv[.xz], NAME_host.csv[.xz] for NAME.json),
    or None."""
    return next((p for p in paths if p in (f"{path[:-5]}_{kind}.csv", f"{path[:-5]}_{kind}.csv.xz")), None)


def opts(t):
    """A Table's NAME=VALUE args (pyspy's top, answers' answer, text's tail) as a dict."""
    return dict(a.split("=", 1) for a in t.args if "=" in a)


def table_args(t):
    """matrix.table's options from a Table's command and args (`--ran`, `--rows A,B`, `--last`)."""
    a = list(t.args)
    return dict(ran_only="--ran" in t.command, rows=a[a.index("--rows") + 1].split(",") if "--rows" in a else None,
                earlier_too="--last" not in a)


def output(t):
    """What the table's command prints, computed here (the same functions its module's command line calls)."""
    paths = [os.path.join(ROOT, f) for f in files(t)]
    named = lambda text, p: f"{os.path.basename(p)}:\n\n{text}"  # noqa: E731
    run = {
        "benchmarks.matrix table": lambda: matrix.table([json.load(open(p)) for p in paths], **table_args(t)),
        "benchmarks.matrix table --ran": lambda: matrix.table([json.load(open(p)) for p in paths], **table_args(t)),
        "benchmarks.matrix log": lambda: json.dumps(matrix.from_log(paths[0])),
        "benchmarks.bench report": lambda: bench.report(paths),
        "benchmarks.bench table": lambda: bench.table(paths),
        "benchmarks.bench pyspy": lambda: engine_bench.pyspy_table(paths[0], "LLMEngine.step",
                                                                   int(opts(t)["top"])),
        "benchmarks.record parity": lambda: parity_table(paths),
        "benchmarks.record curves": lambda: curves_table(paths),
        "benchmarks.record spikes": lambda: spikes_table(paths),
        "benchmarks.record engine": lambda: "\n\n".join(named(engine_bench.table(json.load(open(p))), p)
                                                        for p in paths),
        "benchmarks.record two-turn": lambda: two_turn.runs_table([
            (os.path.basename(p), json.load(open(p)), run_log(p, paths), run_log(p, paths, "host"))
            for p in paths if p.endswith(".json")]),
        "benchmarks.record seconds": lambda: two_turn.seconds_table(json.load(open(paths[0])), paths[1],
                                                                    int(opts(t).get("round", 1)) - 1),
        "benchmarks.record text": lambda: "\n\n".join(named("\n".join(open(p).read().strip().split("\n")[
            :int(opts(t).get("head", 0)) or None][-int(opts(t).get("tail", 0)):]), p) for p in paths),  # (its first
        # `head` lines, of those the last `tail`)
        "benchmarks.record steps": lambda: "\n\n".join(named(steps_lines(p), p) for p in paths),
        "benchmarks.record answers": lambda: answers_table(paths, opts(t)["answer"]),
    }
    return run[t.command]()


COMMANDS = ("parity", "curves", "spikes", "engine", "two-turn", "seconds", "text", "steps",
            "answers")  # (the tables only this module prints)


def main(argv):
    by_name = {t.name: t for t in TABLES}
    if argv and argv[0] in COMMANDS:  # TABLES' benchmarks.record
        kv = [a for a in argv[1:] if "=" in a and not os.path.exists(a)]  # (answer=NAME, tail=N)
        print(output(Table("-", "-", "benchmarks.record " + argv[0], [a for a in argv[1:] if a not in kv], kv)))
        return 0
    unknown = [a for a in argv if a not in by_name]
    if unknown:
        print(f"unknown table {unknown[0]}: one of {', '.join(by_name)}, or {'/'.join(COMMANDS)} FILES",
              file=sys.stderr)
        return 2
    section = None
    for t in [by_name[a] for a in argv] or TABLES:
        if t.section != section:
            section = t.section
            print(f"## {section}\n")
        print(f"`{command(t)}`\n\n{output(t)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
