"""benchmarks/BENCHMARKS.md is a reference a reader can check: each table there is printed by the command above it
from files kept in benchmarks/ (benchmarks/record.py lists them), every file a table names exists, every run file kept
in benchmarks/cpu and benchmarks/h200 is named by a table, BENCHMARKS.md stays short, and the project's words are its
own (dates and commits, not the working words of whoever measured)."""
import os
import re
import subprocess

import pytest

import test_docs
from benchmarks import record

ROOT = record.ROOT
DOC = os.path.join(ROOT, "benchmarks", "BENCHMARKS.md")


def sections(text):
    """{heading: its text up to the next '## ' heading} of a markdown file's second-level sections."""
    parts = ("\n" + text).split("\n## ")[1:]
    return {p.split("\n", 1)[0]: p.split("\n", 1)[1] if "\n" in p else "" for p in parts}


def test_every_file_a_table_names_is_kept():
    assert record.missing() == [], "benchmarks/record.py names files that are not there"


def test_every_kept_run_file_is_named_by_a_table():
    assert record.strays() == [], ("run files no table reads: name them in a benchmarks/record.py table, "
                                   "or remove them (git keeps them)")


def test_a_missing_and_a_stray_file_are_caught(tmp_path):
    os.makedirs(tmp_path / "benchmarks" / "h200")
    for name in ("matrix_a.json", "run_metrics.jsonl", "stray.log", "probe.py"):
        (tmp_path / "benchmarks" / "h200" / name).write_text("{}")
    tables = [record.Table("t", "s", "benchmarks.matrix table", ["benchmarks/h200/matrix_*.json",
                                                                  "benchmarks/h200/run_metrics.jsonl",
                                                                  "benchmarks/h200/gone.json"])]
    assert record.missing(tables, str(tmp_path)) == ["benchmarks/h200/gone.json"]
    assert record.strays(tables, str(tmp_path)) == ["benchmarks/h200/stray.log"]


def test_each_table_is_what_its_command_prints_under_its_section():
    got = sections(open(DOC).read())
    for t in record.TABLES:
        assert t.section in got, f"BENCHMARKS.md has no section '## {t.section}'"
        text = got[t.section]
        assert f"`{record.command(t)}`" in text, f"{t.name}: the command is not shown in its section"
        assert record.output(t) in text, f"{t.name}: paste `python -m benchmarks.record {t.name}`'s table"


def test_benchmarks_is_a_short_reference():
    lines = open(DOC).read().splitlines()
    assert len(lines) <= 615, f"BENCHMARKS.md has {len(lines)} lines: history goes to benchmarks/HISTORY.md"
    for doc in (DOC, os.path.join(ROOT, "benchmarks", "HISTORY.md")):
        assert test_docs.broken_links(doc) == []
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ROOT, "benchmarks"))
               if "__pycache__" not in d for f in fs)
    assert size < 6e6, f"benchmarks/ holds {size / 1e6:.1f} MB"


WORKING_WORDS = "se" + "ssion [0-9]|le" + "ase"  # a measuring day's number, the device's loan (spelt apart: this
# file is tracked too); literal and case-insensitive, so the words that hold the loan word are out as well


def test_the_project_words_are_its_own():
    """No working words in a tracked file (*.jsonl aside), nor a day's number in a file's name (dates instead)."""
    try:
        out = subprocess.run(["git", "grep", "-niE", WORKING_WORDS, "--", ":!*.jsonl"], cwd=ROOT,
                             capture_output=True, text=True)
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert out.stdout == ""
    assert [n for n in names.splitlines() if re.search(r"se" + r"ssion|le" + r"ase|_s[0-9]+", n, re.I)] == []


def test_the_command_shown_prints_the_table(capsys):
    """`python -m benchmarks.record CMD FILES.. KEY=VALUE..` as BENCHMARKS.md shows it prints that table (files and
    options apart: `answers ... answer=blue`)."""
    for t in [t for t in record.TABLES if t.command.startswith("benchmarks.record ")]:
        cmd = t.command.split()[1]
        assert record.main([cmd, *record.files(t), *t.args]) == 0
        assert capsys.readouterr().out == record.output(t) + "\n", t.name
