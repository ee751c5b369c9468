"""SwanLab and MLflow beside TensorBoard and W&B (test_resume.py reads those two back): each imported only when
asked, offline / file-backed without a server, and a run of the tiny demo read back from what they wrote."""
import glob
import json
import struct
import sys
import zlib
from dataclasses import replace

import pytest

import grpo as G
import rundir
from test_resume import SMALL


def leveldb_records(path, ident):
    """The records of a LevelDB-style log (the file format of W&B's and SwanLab's offline runs): a 7-byte file header,
    then 32 KiB blocks of records, each with a 7-byte header (crc32, length, FULL/FIRST/MIDDLE/LAST)."""
    data = open(path, "rb").read()
    assert data[:4] == ident, data[:8]
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"corrupt record at {pos}"
        buf, pos = buf + chunk, pos + 7 + n
        if kind in (1, 4):  # FULL or LAST: a whole record
            yield buf
            buf = b""


def swanlab_scalars(run_file, key):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    out = {}
    for raw in leveldb_records(run_file, b":SWL"):
        r = Record()
        r.ParseFromString(raw)
        if r.HasField("scalar") and r.scalar.key == key:
            out[r.scalar.step] = r.scalar.value.number
    return out


def mlflow_run(db):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"]
    (run,) = client.search_runs([exp.experiment_id])
    return client, exp, run


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, launch_module):
    """3 steps of the demo with validation every step, every tracker of this file that is installed on."""
    import importlib.util
    trackers = [t for t in ("swanlab", "mlflow") if importlib.util.find_spec(t)]
    if not trackers:
        pytest.skip("neither swanlab nor mlflow is installed (pip install swanlab mlflow)")
    out = tmp_path_factory.mktemp("trackers") / "run"
    # no key, mode or server from the caller's shell: offline / the output folder's file
    launch_module.run([sys.executable, "grpo.py", "--output-dir", out, *SMALL, "--max-steps", "3", "--val-freq", "1",
                       "--save-freq", "-1", "--logger", "console", *trackers, "--project-name", "proj",
                       "--experiment-name", "exp1"], out.parent / "log", SWANLAB_API_KEY=None, SWANLAB_MODE=None,
                      MLFLOW_TRACKING_URI=None, SWANLAB_ROOT=out.parent / "swanlab_home")
    return out, [json.loads(x) for x in open(out / "metrics.jsonl")]


def test_swanlab_offline_reads_back(tracked_run):
    pytest.importorskip("swanlab", reason="pip install swanlab to test --logger swanlab")
    out, rows = tracked_run
    (run_file,) = glob.glob(str(out / "swanlab" / "run-*" / "run-*.swanlab"))  # offline: no API key here
    assert swanlab_scalars(run_file, "reward/mean") == pytest.approx(
        {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r})
    assert swanlab_scalars(run_file, "val/mean") == pytest.approx({r["step"]: r["val/mean"] for r in rows})


def test_mlflow_file_store_reads_back(tracked_run):
    pytest.importorskip("mlflow", reason="pip install mlflow to test --logger mlflow")
    out, rows = tracked_run
    client, exp, run = mlflow_run(out / "mlflow.db")
    assert (exp.name, run.info.run_name, run.info.status, run.data.params["lr"]) == ("proj", "exp1", "FINISHED",
                                                                                    "0.001")
    for key in ("reward/mean", "val/mean"):
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx({r["step"]: r[key] for r in rows if key in r}), key


@pytest.mark.parametrize("name, module", [("swanlab", "swanlab"), ("mlflow", "mlflow")])
def test_a_missing_tracker_is_one_clear_error(name, module, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ValueError, match=f"--logger {name} needs the {name} package: pip install {name}"):
        rundir.open_trackers(replace(G.Config(), logger=["jsonl", name], output_dir=str(tmp_path)), 0)


def test_easyr1_logger_names_map_to_ours():
    import easyr1_config as E
    opts, _ = E.translate({"trainer": {"logger": ["console", "swanlab", "mlflow", "file"]}}, G.Config)
    assert opts["logger"] == ["console", "jsonl", "mlflow", "swanlab"]


def test_trackers_get_the_metrics_but_not_the_wall_clock_stamps(monkeypatch, tmp_path):
    """The phases' wall-clock starts (time/..., for bench.py phases) stay in metrics.jsonl; a tracker gets the rest."""
    got = []
    monkeypatch.setattr(rundir, "_swanlab", lambda cfg: (lambda m, step: got.append((dict(m), step)), lambda: None))
    log, close = rundir.open_trackers(replace(G.Config(), logger=["jsonl", "swanlab"], output_dir=str(tmp_path)), 0)
    log({"reward/mean": 0.5, "timing/gen": 2.0, "time/gen_start": 1.7e9, "step": 3}, 3)
    close()
    assert got == [({"reward/mean": 0.5, "timing/gen": 2.0, "step": 3}, 3)]
