"""The files import downwards only. Read from the source of the root .py files and benchmarks/*.py (every import
statement: at the top, under `if __name__ == "__main__":`, or inside a function): the import graph has no cycle, each
file imports only files on its own floor or below (FLOORS, the drawing of README "Files"), and no function imports a
file of this project. An import inside a function hides a dependency from the top of the file and is how a cycle was
once held apart; one stays only for an optional or heavy third-party package (vLLM, peft, PyAV, wandb, ...). The
measurement tools (benchmarks/: bench, engine_bench, matrix and the scripts beside them) are a floor above all of the
root: they may import the trainer's files, and no root file imports them."""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = "benchmarks"  # the package of the measurement tools (python -m benchmarks.bench, from the root)
FILES = {f[:-3]: os.path.join(ROOT, f) for f in sorted(os.listdir(ROOT)) if f.endswith(".py")}
FILES.update({BENCH if f == "__init__.py" else f"{BENCH}.{f[:-3]}": os.path.join(ROOT, BENCH, f)
              for f in sorted(os.listdir(os.path.join(ROOT, BENCH))) if f.endswith(".py")})

# the floors, bottom first; a file imports files of its own floor or lower ones, never a higher one
FLOORS = [
    ["common", "tiny_families"],  # the floor: the user-error type, its one-line report, shared
    # constants, CPU collectives; the tiny non-Qwen checkpoints (tiny_model hands them its tokenizer)
    ["config", "tiny_model", "tiny_moe", "presets", "families", "flops", "varlen", "ulysses", "algos"],  # the options;
    # the demos (models, tasks, settings, the MoE's experts); the real-size random models; the families' differences;
    # FLOPs; kernels, sequence parallelism; the formulas
    ["video", "data", "easyr1_config"],  # the data (data.py reaches the demos through data_files); the command line
    ["memory", "fsdp_actor", "rollout", "rewards", "rundir", "tools"],  # the stages (tools: multi-turn rollouts)
    ["grpo"],  # the loop
    ["dapo", "merge"],  # entry points on top of it
    sorted(m for m in FILES if m == BENCH or m.startswith(BENCH + ".")),  # benchmarks/: the measurement tools
    # (bench, its engine-ablation engine_bench, matrix, the scripts), above the whole trainer
]
FLOOR = {m: i for i, names in enumerate(FLOORS) for m in names}
TOOLS = [f"{BENCH}.bench", f"{BENCH}.engine_bench", f"{BENCH}.matrix"]  # python -m benchmarks.X


def shown(m):
    """A module's file as the repository names it: grpo.py, benchmarks/bench.py."""
    return os.path.relpath(FILES[m], ROOT)


def module_names(node):
    """The project modules (keys of FILES) one import statement names: `import benchmarks.bench` and
    `from benchmarks import bench` name benchmarks.bench, `import grpo` names grpo, and a third-party package none."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names]
    else:
        return []
    out = []
    for name in names:
        parts = name.split(".")
        out += [next((".".join(parts[:i]) for i in (2, 1) if ".".join(parts[:i]) in FILES), None)]
    return [n for n in out if n]


def project_imports(path):
    """[(project module, line, inside a function)] of one file: import statements, and __import__ /
    importlib.import_module of a project module's name."""
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            names = module_names(child)
            if (isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant)
                    and getattr(child.func, "id", getattr(child.func, "attr", None)) in ("__import__", "import_module")):
                names = module_names(ast.Import(names=[ast.alias(name=str(child.args[0].value))]))
            out.extend((n, child.lineno, in_function) for n in names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    with open(path) as f:
        visit(ast.parse(f.read(), path), False)
    return out


def graph():
    return {m: sorted({n for n, _, _ in project_imports(p)} - {m}) for m, p in FILES.items()}


def find_cycle(g):
    """One cycle of the directed graph g (node -> its successors) as [a, b, ..., a], or None."""
    state, stack = {}, []  # state: 1 on the current path, 2 done

    def dfs(u):
        state[u] = 1
        stack.append(u)
        for v in g.get(u, []):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := dfs(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    return next((c for u in sorted(g) if u not in state and (c := dfs(u))), None)


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(map(shown, cycle))


def test_no_project_module_imported_inside_a_function():
    inside = [f"{shown(m)}:{line}: imports {n} inside a function" for m, p in FILES.items()
              for n, line, in_function in project_imports(p) if in_function]
    assert inside == [], "\n".join(inside + ["import it at the top of the file (README, Files: which floor may)"])


def test_every_file_imports_only_its_floor_or_below():
    g = graph()
    assert sorted(set(FILES) - set(FLOOR)) == [], "a new file: give it a floor in FLOORS (and in README, Files)"
    up = [f"{shown(m)} (floor {FLOOR[m]}) imports {shown(n)} (floor {FLOOR[n]})" for m in g for n in g[m]
          if FLOOR[n] > FLOOR[m]]
    assert up == [], "\n".join(up)
    assert g["common"] == [], "the floor imports no file of this project"
    # the demos' tasks are reached by the data layer through one door (data.data_files), and import no data file
    assert [m for m in FLOORS[2] if "tiny_model" in g[m]] == ["data"] and g["tiny_model"] == ["common", "tiny_families",
                                                                                              "tiny_moe"]
    assert g["tiny_moe"] == g["tiny_families"] == []  # the MoE's settings and layout, the other families' builds


def test_find_cycle_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def function_level_imports(path):
    """[(line number, top-level package, the statement's first line)] of the imports inside functions of one file."""
    with open(path) as f:
        src = f.read()
    lines, out = src.splitlines(), []
    for fn in ast.walk(ast.parse(src, path)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(node.lineno, a.name.split(".")[0], lines[node.lineno - 1]) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    out.append((node.lineno, node.module.split(".")[0], lines[node.lineno - 1]))
    return sorted(set(out))


def test_an_import_inside_a_function_is_an_optional_or_slow_package_with_its_reason():
    """Standard-library modules cost nothing to import at the top; a third-party one stays in a function only when it
    is optional (vLLM, peft, trackers, PyAV) or slow to import where most runs never need it, and its line says so.
    (The root's files and the tools run as modules; the one-off scripts beside them in benchmarks/ are not held to
    it.)"""
    checked = {m: p for m, p in FILES.items() if FLOOR[m] < FLOOR[BENCH] or m in TOOLS}
    bad = [f"{shown(m)}:{n}: {line.strip()}" for m, p in checked.items() for n, pkg, line in function_level_imports(p)
           if pkg in sys.stdlib_module_names or pkg in FILES or "#" not in line]
    assert bad == [], "\n".join(bad)
