"""`commbench import nccl-tests`: every fixture in tests/fixtures/nccl-tests (text
logs of several nccl-tests versions and the JSON output), row counts, the
in-place/out-of-place split, busbw as the log has it, the footer, the mapping to
commbench's Case, and bad logs exiting 2 with one line."""
import json
import re
from pathlib import Path

import pytest

from commbench import import_nccl, results
from commbench.cli import main

FIX = Path(__file__).parent / "fixtures" / "nccl-tests"


@pytest.fixture
def cb(capsys):
    def call(*args):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out = capsys.readouterr()
        return rc, out.out, out.err
    return call


def log_rows(name):
    """The data rows of a text fixture, split on whitespace (the test's own reading)."""
    return [line.split() for line in (FIX / name).read_text().splitlines()
            if line.strip() and line.lstrip()[0].isdigit() and len(line.split()) > 8]


def imported(cb, tmp_path, name, *extra):
    out = tmp_path / (name + ".jsonl")
    rc, stdout, err = cb("import", "nccl-tests", FIX / name, "--out", out, *extra)
    assert rc == 0, err
    assert "imported" in stdout
    return results.load(str(out))


def split(rf):
    oop = [m for m in rf.measurements if not m.case.in_place]
    ip = [m for m in rf.measurements if m.case.in_place]
    return oop, ip


def test_all_reduce_v2_13_two_nodes(cb, tmp_path):
    rf = imported(cb, tmp_path, "all_reduce_perf-v2.13-2nodes.txt")
    rows = log_rows("all_reduce_perf-v2.13-2nodes.txt")
    oop, ip = split(rf)
    assert len(rows) == 9 and len(oop) == len(ip) == 9
    for row, o, i in zip(rows, oop, ip):     # size count type redop | time algbw busbw #wrong x 2
        c = o.case
        assert (c.op, c.backend, c.device, c.dtype, c.kind) == ("all_reduce", "nccl-tests", "cuda", "float32",
                                                                "collective")
        assert c.nbytes == int(row[0]) and c.params["count"] == int(row[1]) and c.params["redop"] == "sum"
        assert "root" not in c.params and (c.group_size, c.num_nodes, c.axis) == (8, 2, "world")
        assert o.samples_s == [pytest.approx(float(row[4]) * 1e-6)] and i.samples_s == [pytest.approx(float(row[8]) * 1e-6)]
        assert (o.algbw_gbps, o.busbw_gbps, i.busbw_gbps) == (float(row[5]), float(row[6]), float(row[10]))
        assert o.num_wrong == 0 and import_nccl.ONE_SAMPLE in o.warnings
    h = rf.header
    assert h["cluster"]["hosts"] == ["gpu-a01", "gpu-a02"] and h["cluster"]["gpus"][0]["name"] == "NVIDIA A100-SXM4-80GB"
    nt = h["settings"]["nccl_tests"]
    assert nt["settings"] == {"step_factor": 4, "nThread": 1, "nGpus": 1, "minBytes": 8, "maxBytes": 1048576,
                              "warmup_iters": 5, "iters": 20, "agg_iters": 1, "validation": 1, "graph": 0}
    assert nt["footers"] == [{"op": "all_reduce", "avg_busbw_gbps": 3.36056, "out_of_bounds": 0, "ok": True,
                              "table_line": 19}]
    assert h["settings"]["imported_from"]["path"].endswith("all_reduce_perf-v2.13-2nodes.txt")


def test_all_gather_v2_0_old_columns(cb, tmp_path):
    rf = imported(cb, tmp_path, "all_gather_perf-v2.0.log")
    rows = log_rows("all_gather_perf-v2.0.log")
    oop, ip = split(rf)
    assert len(rows) == 11 and len(oop) == len(ip) == 11
    for row, o, i in zip(rows, oop, ip):     # size count type | time algbw busbw error x 2
        assert o.case.op == "all_gather" and o.case.nbytes == int(row[0])   # S: the gathered output
        assert "redop" not in o.case.params and o.case.group_size == 8 and o.case.num_nodes == 1
        assert (o.busbw_gbps, i.busbw_gbps) == (float(row[5]), float(row[9]))
        assert o.num_wrong == 0
    footer = re.search(r"Avg bus bandwidth\s*:\s*(\S+)", (FIX / "all_gather_perf-v2.0.log").read_text())
    assert rf.header["settings"]["nccl_tests"]["footers"][0]["avg_busbw_gbps"] == float(footer.group(1))
    assert rf.header["cluster"]["gpus"][0]["name"] == "Tesla V100-SXM2-32GB"


def test_broadcast_per_iteration_columns_timestamps_and_na(cb, tmp_path):
    rf = imported(cb, tmp_path, "broadcast_v2.17_per_iter.txt")
    rows = log_rows("broadcast_v2.17_per_iter.txt")
    oop, ip = split(rf)
    assert len(rows) == 7 and len(oop) == len(ip) == 7
    for row, o, i in zip(rows, oop, ip):
        c = o.case
        assert (c.op, c.dtype, c.params["root"], c.group_size) == ("broadcast", "bfloat16", 0, 4)
        assert "redop" not in c.params                      # nccl-tests prints 'none'
        assert (o.busbw_gbps, i.busbw_gbps) == (float(row[7]), float(row[15]))
        assert o.num_wrong == 0                             # N/A: not checked (-c 0), and said so
        assert any("not checked" in w for w in o.warnings)
        assert o.stats["nccl_tests_per_iter"]["max_us"] == float(row[10])
    h = rf.header
    assert h["versions"] == {"nccl-tests": "2.17.6", "nccl": "2.27.3"}
    assert h["settings"]["nccl_tests"]["version_line"].startswith("# nccl-tests version 2.17.6")
    assert h["settings"]["nccl_tests"]["settings"]["unalign"] == 0


def test_json_output_with_per_iteration_samples(cb, tmp_path):
    rf = imported(cb, tmp_path, "reduce_scatter_json_v2.json")
    doc = json.loads((FIX / "reduce_scatter_json_v2.json").read_text())
    oop, ip = split(rf)
    assert len(oop) == len(ip) == len(doc["results"]) == 4
    for rec, o, i in zip(doc["results"], oop, ip):
        assert o.case.op == "reduce_scatter" and o.case.nbytes == rec["size"] and o.case.num_nodes == 2
        assert o.samples_s == pytest.approx([t * 1e-6 for t in rec["out_of_place_per_iter"]["times_us"]])
        assert i.samples_s == pytest.approx([t * 1e-6 for t in rec["in_place_per_iter"]["times_us"]])
        assert (o.busbw_gbps, i.busbw_gbps) == (rec["out_of_place"]["bus_bw"], rec["in_place"]["bus_bw"])
        assert o.warnings == [] and o.iters == 20
    h = rf.header
    assert h["command_line"][0] == "./build/reduce_scatter_perf" and h["versions"]["nccl"] == "2.27.3"
    assert h["env"] == {"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "ib0"}   # allow-listed
    assert h["settings"]["nccl_tests"]["footers"][0]["avg_busbw_gbps"] == doc["average_bus_bandwidth"]["bandwidth"]
    # raw samples make the imported file a baseline that check can test
    rc, out, _ = cb("check", "--baseline", tmp_path / "reduce_scatter_json_v2.json.jsonl",
                    tmp_path / "reduce_scatter_json_v2.json.jsonl")
    assert rc == 0 and "same 8" in out


def test_several_tests_in_one_log_and_op_override(tmp_path):
    text = (FIX / "broadcast_v2.17_per_iter.txt").read_text()
    both = tmp_path / "two.txt"
    both.write_text(text + text.replace("broadcast_perf", "scatter_perf"))
    rf = import_nccl.convert(str(both))
    assert {m.case.op for m in rf.measurements} == {"broadcast", "scatter"} and len(rf.measurements) == 28
    # --op must agree with the log: the collective it names, and a reduction op on its rows or not
    with pytest.raises(ValueError, match="line 16: --op all_gather, but the log says it tested broadcast"):
        import_nccl.convert(str(both), op="all_gather")
    reduce_named = tmp_path / "reduce.txt"
    reduce_named.write_text(text.replace("broadcast_perf", "reduce_perf"))
    with pytest.raises(ValueError, match="its rows have no reduction op: not a reduce log"):
        import_nccl.convert(str(reduce_named))
    nameless = tmp_path / "log.txt"
    nameless.write_text((FIX / "all_gather_perf-v2.0.log").read_text())
    with pytest.raises(ValueError, match="give --op"):
        import_nccl.convert(str(nameless))
    assert {m.case.op for m in import_nccl.convert(str(nameless), op="all_gather").measurements} == {"all_gather"}
    with pytest.raises(ValueError, match=r"its rows have no reduction op: not a all_reduce log \(--op\)"):
        import_nccl.convert(str(nameless), op="all_reduce")
    summed = tmp_path / "log2.txt"
    summed.write_text((FIX / "all_reduce_perf-v2.13-2nodes.txt").read_text())
    with pytest.raises(ValueError, match=r"its rows have a reduction op \(sum\): not a all_gather log"):
        import_nccl.convert(str(summed), op="all_gather")


def test_bad_logs_exit_2_with_one_line(cb, tmp_path):
    text = (FIX / "all_reduce_perf-v2.13-2nodes.txt").read_text()
    lines = text.splitlines()
    cut = tmp_path / "all_reduce_perf-cut.txt"
    cut.write_text("\n".join(lines[:25]) + "\n" + lines[25][:40])      # killed in the middle of a row
    nofooter = tmp_path / "all_reduce_perf-nofooter.txt"
    nofooter.write_text("\n".join(lines[:26]) + "\n")
    badnum = tmp_path / "all_reduce_perf-badnum.txt"
    badnum.write_text(text.replace("30.50    0.00", "30.5x    0.00", 1))
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("Segmentation fault (core dumped)\nsomething else\n")
    trunc_json = tmp_path / "rs.json"
    trunc_json.write_text((FIX / "reduce_scatter_json_v2.json").read_text()[:500])
    binary = tmp_path / "bin.log"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 10)
    expect = {cut: "line 26", nofooter: "truncated", badnum: "line 21", garbage: "no nccl-tests result table",
              trunc_json: "line 1", binary: "not text", tmp_path / "missing.txt": "cannot read"}
    for path, words in expect.items():
        rc, out, err = cb("import", "nccl-tests", path, "--out", tmp_path / "x.jsonl")
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (path, err)
        assert words in err, (path, err)
    assert not (tmp_path / "x.jsonl").exists()


def test_import_never_overwrites_without_force(cb, tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text("precious\n")
    rc, _, err = cb("import", "nccl-tests", FIX / "all_gather_perf-v2.0.log", "--out", out)
    assert rc == 2 and "--force" in err and out.read_text() == "precious\n"
    rc, _, _ = cb("import", "nccl-tests", FIX / "all_gather_perf-v2.0.log", "--out", out, "--force")
    assert rc == 0 and len(results.load(str(out)).measurements) == 22
