"""The results file: round trip, append-and-flush, truncated last line, refusal
of a foreign schema, the dataframe columns, and `show` printing a saved file."""
import json

import pytest

from commbench import results, stats
from commbench.results import Case, Measurement, ResultWriter, make_header
from conftest import FAST, ROOT, commbench, mpiexec


def measurement(op="all_reduce", nbytes=1024, samples=(1e-5, 2e-5, 3e-5)):
    case = Case(kind="collective", op=op, backend="mpi", device="cpu", dtype="float32", nbytes=nbytes,
                group_size=2, num_nodes=1, axis="world", in_place=False, params={"redop": "sum", "count": 256})
    s = stats.summarize(list(samples))
    return Measurement(case=case, samples_s=list(samples), warmup=1, stats=s,
                       algbw_gbps=nbytes / s["time_p50_s"] / 1e9, busbw_gbps=nbytes / s["time_p50_s"] / 1e9,
                       rank_time_p50_s=[1e-5, 2e-5], slowest_rank=1, slowest_host="h")


def test_round_trip_and_flush_per_line(tmp_path):
    path = tmp_path / "r.jsonl"
    w = ResultWriter(str(path), make_header(run_id="abc"))
    w.append(measurement(nbytes=8))
    # flushed at once: a reader sees the line before the writer closes
    assert len(path.read_text().splitlines()) == 2
    w.append(measurement(nbytes=16))
    w.close()
    rf = results.load(str(path))
    assert rf.header["run_id"] == "abc" and rf.header["schema_version"] == results.SCHEMA_VERSION
    assert [m.case.nbytes for m in rf.measurements] == [8, 16]
    assert rf.measurements[0] == measurement(nbytes=8)
    assert rf.measurements[0].case.key() == measurement(nbytes=8).case.key()


def test_writer_never_overwrites(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("precious\n")
    with pytest.raises(FileExistsError):
        ResultWriter(str(path), make_header(run_id="x"))
    assert path.read_text() == "precious\n"


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    w = ResultWriter(str(path), make_header(run_id="abc"))
    w.append(measurement(nbytes=8))
    w.append(measurement(nbytes=16))
    w.close()
    text = path.read_text()
    path.write_text(text[: len(text) - 40])      # a crash in the middle of the last write
    rf = results.load(str(path))
    assert [m.case.nbytes for m in rf.measurements] == [8]
    assert "truncated" in capsys.readouterr().err


def test_bad_middle_line_and_foreign_schema_are_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [json.dumps(make_header(run_id="a")), "{not json", json.dumps(measurement().to_dict())]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        results.load(str(path))
    path.write_text(json.dumps(dict(make_header(run_id="a"), schema_version=99)) + "\n")
    with pytest.raises(ValueError, match="schema version 99"):
        results.load(str(path))


def test_dataframe_has_the_design_columns(tmp_path):
    path = tmp_path / "r.jsonl"
    w = ResultWriter(str(path), make_header(run_id="abc"))
    w.append(measurement(samples=(1e-5, 3e-5, 2e-5, 4e-5)))
    w.close()
    df = results.load(str(path)).to_dataframe()
    row = df.iloc[0]
    for col in ("op", "backend", "device", "dtype", "nbytes", "group_size", "num_nodes", "axis", "in_place",
                "iters", "time_min_s", "time_p50_s", "time_mean_s", "time_p95_s", "time_max_s",
                "algbw_gbps", "busbw_gbps", "num_wrong"):
        assert col in df.columns
    assert row.iters == 4 and row.time_min_s == 1e-5 and row.time_max_s == 4e-5
    assert row.time_p50_s == pytest.approx(2.5e-5) and row.time_mean_s == pytest.approx(2.5e-5)


def test_show_prints_a_saved_prediction(tmp_path):
    """`predict --json` saved to a file: `show` prints its breakdown and scaling
    table as predict does, --json gives the document back, --csv (a results
    file's export) is refused with one line and exit 2."""
    args = ("predict", "--model", "tiny-gpt", "--world", "8", "--system", ROOT / "commbench/systems/h200.json",
            "--scale", "8,16")
    live = commbench(*args, cwd=tmp_path)
    saved = commbench(*args, "--json", cwd=tmp_path)
    assert live.returncode == saved.returncode == 0, live.stderr + saved.stderr
    path = tmp_path / "pred.json"
    path.write_text(saved.stdout)
    p = commbench("show", path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == live.stdout
    p = commbench("show", path, "--json")
    assert p.returncode == 0 and json.loads(p.stdout) == json.loads(saved.stdout)
    p = commbench("show", path, "--csv")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [f"commbench: error: {path} is a saved prediction, one JSON document: "
                                             "--csv exports a results file's measurements (use --json)"]


def test_show_prints_the_saved_run(tmp_path):
    out = tmp_path / "s.jsonl"
    p = commbench("run", "--backend", "mpi", "--collective", "all_reduce,broadcast", "-b", "1K", "-e", "4K",
                  "-f", "4", *FAST, "--out", out, launcher=mpiexec(2), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    p = commbench("show", out)
    assert p.returncode == 0, p.stderr
    assert "all_reduce" in p.stdout and "broadcast" in p.stdout
    for m in results.load(str(out)).measurements:
        assert f"{m.stats['time_p50_s'] * 1e6:.2f}" in p.stdout   # the stored p50, in microseconds
        assert f"{m.busbw_gbps:.3f}" in p.stdout
