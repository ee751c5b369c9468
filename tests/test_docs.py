"""The documents hold to the code they describe: every `file.py:function` that docs/walkthrough.md names exists, every
relative link of README.md and docs/*.md reaches a file (and its #anchor a heading there), README stays one sitting
(400 lines at most), and README's drawing of the import floors is tests/test_imports.py's FLOORS."""
import ast
import glob
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
NAMED = re.compile(r"`((?:[\w]+/)*\w+\.py):([A-Za-z_][\w.]*)`")  # `grpo.py:train_step`, `rollout.py:VLLMRollout.sync_weights`
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def defined_names(path):
    """The top-level functions and classes of a file, and Class.method for each class's functions."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.ClassDef):
            out |= {f"{node.name}.{m.name}" for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def missing_names(text):
    """The `file.py:name` references of a document whose file or name does not exist, as 'file.py:name (why)'."""
    out, cache = [], {}
    for file, name in sorted(set(NAMED.findall(text))):
        path = os.path.join(ROOT, file)
        if not os.path.isfile(path):
            out.append(f"{file}:{name} (no such file)")
            continue
        if name not in cache.setdefault(file, defined_names(path)):
            out.append(f"{file}:{name} (no such function, class or method)")
    return out


def test_walkthrough_names_only_functions_that_exist():
    text = open(os.path.join(ROOT, "docs", "walkthrough.md")).read()
    assert len(set(NAMED.findall(text))) >= 40  # the walk names the step's functions, not a handful
    assert missing_names(text) == []


def test_a_renamed_function_is_caught():
    """The check above is not vacuous: a name that is not in the file, a method of the wrong class and a file that is
    not there are each reported."""
    bad = "`grpo.py:train_stepp` `rollout.py:HFRollout.sync_weights` `rollout.py:HFRollout.submit` `nope.py:f`"
    assert missing_names(bad) == ["grpo.py:train_stepp (no such function, class or method)",
                                  "nope.py:f (no such file)",
                                  "rollout.py:HFRollout.submit (no such function, class or method)"]


def slug(heading):
    """GitHub's anchor of a heading: lowercase, punctuation other than '-' and '_' dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    """The #anchors of a markdown file's headings (outside fenced code), GitHub's -1, -2 on repeats."""
    out, seen, fenced = set(), {}, False
    for line in open(path):
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(re.sub(r"`", "", m.group(1)))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(path):
    """The relative links of one markdown file (code spans and indented code left out) that reach no file, or no
    heading of it: 'file: link (why)'."""
    out, here = [], os.path.dirname(path)
    for line in open(path):
        if line.startswith("    "):  # an indented code block: not rendered as links
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not this repository's
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(here, file)) if file else path
            where = f"{os.path.relpath(path, ROOT)}: {target}"
            if not os.path.exists(dest):
                out.append(f"{where} (no such file)")
            elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
                out.append(f"{where} (no such heading)")
    return out


def test_every_relative_link_resolves():
    assert [b for d in DOCS for b in broken_links(d)] == []


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Speed: the bar (H200)\n\n## Speed: the bar (H200)\n\n[ok](#speed-the-bar-h200) "
                                   "[ok](#speed-the-bar-h200-1) [ok](a.md#speed-the-bar-h200) `[skip](x.md)`\n"
                                   "[gone](b.md) [no](#speed) [no](a.md#nope) [web](https://example.org/x.md)\n")
    got = [b.split(": ", 1)[1] for b in broken_links(str(tmp_path / "a.md"))]
    assert got == ["b.md (no such file)", "#speed (no such heading)", "a.md#nope (no such heading)"]


def test_readme_is_one_sitting():
    with open(os.path.join(ROOT, "README.md")) as f:
        n = len(f.read().splitlines())
    assert n <= 400, f"README.md has {n} lines: move the detail to docs/ or benchmarks/BENCHMARKS.md"


def load_floors():
    spec = importlib.util.spec_from_file_location("_test_imports", os.path.join(ROOT, "tests", "test_imports.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FLOORS, mod.TOOLS


def drawn_floors(readme):
    """README "Files": the indented block after "Imports go one way", one floor a line, top first -> [module names]
    per floor, bottom first (benchmarks/bench.py -> benchmarks.bench)."""
    lines = readme.splitlines()
    i = next(k for k, x in enumerate(lines) if x.startswith("Imports go one way"))
    while not lines[i].startswith("    "):
        i += 1
    floors = []
    while i < len(lines) and lines[i].startswith("    "):
        names = [f.replace("/", ".") for f in re.findall(r"((?:\w+/)?\w+)\.py", lines[i])]
        if names:
            floors.append(names)
        i += 1
    return floors[::-1]


def test_readme_draws_the_floors_of_test_imports():
    floors, tools = load_floors()
    drawn = drawn_floors(open(os.path.join(ROOT, "README.md")).read())
    want = [sorted(f) for f in floors[:-1]] + [sorted(tools)]  # benchmarks/: its three tools stand for the floor
    assert [sorted(f) for f in drawn] == want, "README, Files: redraw the floors as tests/test_imports.py's FLOORS"
