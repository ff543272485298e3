"""Real multi-process sweeps of every collective over gloo (local spawn and
torchrun) and MPI (mpiexec -n 2 and -n 4), each checked against DESIGN.md's
definitions recomputed here from the stored raw samples."""
import json
import math

import numpy as np
import pytest

from busbw import expected_bandwidths, expected_nbytes
from commbench import results
from conftest import BIN, FAST, MPIEXEC, clean_env, commbench, mpiexec, run_job

ALL = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
       "send_recv", "send_recv_bidir", "barrier"]
REQUESTED = [8, 512, 32768]   # -b 8 -e 32K -f 64


def check_file(path, n, backend, requested=REQUESTED, ops=ALL):
    rf = results.load(str(path))
    h = rf.header
    assert h["schema_version"] == 1 and h["cluster"]["num_ranks"] == n
    assert sum(h["cluster"]["ranks_per_host"].values()) == n
    assert h["versions"]["python"] and h["versions"]["torch"]
    assert h["command_line"][0] == "commbench" and "run" in h["command_line"]
    ok = [m for m in rf.measurements if m.status == "ok"]
    assert {m.case.op for m in ok} == set(ops)
    for m in ok:
        c = m.case
        assert c.backend == backend and c.group_size == n and c.axis == "world"
        assert m.num_wrong == 0, (c.op, c.nbytes)
        assert len(m.samples_s) == 5 and all(s > 0 for s in m.samples_s)
        assert len(m.rank_time_p50_s) == n
        assert m.slowest_rank == int(np.argmax(m.rank_time_p50_s))
        # the figures in the file follow from the raw samples
        assert m.stats["time_p50_s"] == pytest.approx(float(np.median(m.samples_s)), rel=1e-12)
        assert m.stats["time_min_s"] == min(m.samples_s) and m.stats["time_max_s"] == max(m.samples_s)
        assert m.stats["time_mean_s"] == pytest.approx(float(np.mean(m.samples_s)), rel=1e-12)
        algbw, busbw = expected_bandwidths(c.op, c.nbytes, n, m.samples_s)
        if algbw is None:
            assert m.algbw_gbps is None and m.busbw_gbps is None
        else:
            assert m.algbw_gbps == pytest.approx(algbw, rel=1e-9)
            assert m.busbw_gbps == pytest.approx(busbw, rel=1e-9)
    sizes = {op: sorted(m.case.nbytes for m in ok if m.case.op == op) for op in ops}
    for op in ops:
        want = sorted({expected_nbytes(op, r, n, 4) for r in requested}) if op != "barrier" else [0]
        assert sizes[op] == want, op
    return rf


def test_local_spawn_gloo_every_collective(tmp_path):
    out = tmp_path / "gloo.jsonl"
    p = commbench("run", "--nprocs", "2", "--collective", "all", "-b", "8", "-e", "32K", "-f", "64",
                  *FAST, "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = check_file(out, 2, "torch-gloo")
    assert rf.header["launcher"] == "local"
    # torch has no out-of-place all_reduce/broadcast/reduce: the Case says what ran
    inplace = {m.case.op for m in rf.measurements if m.case.in_place}
    assert inplace == {"all_reduce", "broadcast", "reduce"}


def test_torchrun_module_and_script_forms(tmp_path):
    # the module form sweeps every collective; the script form two of them
    for form, target, ops in [("module", ["-m", "commbench"], ALL),
                              ("script", [str(BIN / "commbench")], ["all_reduce", "all_gather"])]:
        out = tmp_path / f"{form}.jsonl"
        import subprocess
        p = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", "2", *target, "run",
                            "--collective", ",".join(ops), "-b", "8", "-e", "32K", "-f", "64",
                            *FAST, "--out", str(out)], capture_output=True, text=True, timeout=240,
                           env=clean_env(), cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        rf = check_file(out, 2, "torch-gloo", ops=ops)
        assert rf.header["launcher"] == "torchrun"


@pytest.mark.parametrize("n", [2, 4])
def test_mpiexec_mpi_backend_every_collective(tmp_path, n):
    out = tmp_path / f"mpi{n}.jsonl"
    p = commbench("run", "--backend", "mpi", "--collective", "all", "-b", "8", "-e", "32K", "-f", "64",
                  *FAST, "--out", out, launcher=mpiexec(n), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = check_file(out, n, "mpi")
    assert rf.header["launcher"] == "mpich"
    assert rf.header["versions"]["mpi_library"].startswith("MPICH")


def test_torch_backend_under_mpiexec_finds_rendezvous_itself(tmp_path):
    out = tmp_path / "t.jsonl"
    env = clean_env()
    p = commbench("run", "--collective", "all_reduce,send_recv", "-b", "1K", "-e", "1K", *FAST,
                  "--out", out, launcher=mpiexec(2), env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "MASTER_ADDR" not in env
    check_file(out, 2, "torch-gloo", requested=[1024], ops=["all_reduce", "send_recv"])


def test_mpi_spawned_by_nprocs_uses_mpiexec(tmp_path):
    out = tmp_path / "m.jsonl"
    p = commbench("run", "--backend", "mpi", "--nprocs", "2", "--collective", "broadcast",
                  "-b", "64", "-e", "64", *FAST, "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert results.load(str(out)).header["launcher"] == "mpich"


def test_dtypes_redops_and_in_place_are_exact(tmp_path):
    """Every reduction op, several dtypes, in- and out-of-place, on 4 MPI ranks
    and on 2 gloo ranks (avg and bfloat16 on gloo): no wrong element."""
    out = tmp_path / "m.jsonl"
    p = commbench("run", "--backend", "mpi", "--collective", "all_reduce,reduce_scatter,all_gather,reduce,all_to_all,broadcast",
                  "-d", "float32,float16,float64,int32,int8,uint8", "-o", "all", "--in-place", "both", "-r", "2",
                  "-b", "64", "-e", "4K", "-f", "64", *FAST, "-n", "2", "--out", out,
                  launcher=mpiexec(4), cwd=tmp_path)
    assert p.returncode == 0, p.stderr + p.stdout[-3000:]     # mpiexec reports a killed rank on stdout
    rf = results.load(str(out))
    ok = [m for m in rf.measurements if m.status == "ok"]
    assert all(m.num_wrong == 0 for m in ok)
    assert {m.case.params.get("redop") for m in ok if m.case.op == "all_reduce"} == {"sum", "prod", "max", "min"}
    assert {m.case.in_place for m in ok if m.case.op == "all_reduce"} == {True, False}
    assert {m.case.params["root"] for m in ok if m.case.op in ("reduce", "broadcast")} == {2}
    skipped = {m.skip_reason for m in rf.measurements if m.status == "skipped"}
    assert any("AVG" in r for r in skipped)          # MPI has no avg: recorded, not a crash
    out2 = tmp_path / "g.jsonl"
    p = commbench("run", "--nprocs", "2", "--collective", "all_reduce,reduce_scatter",
                  "-d", "bf16,float16,int64", "-o", "avg,prod,max", "-b", "64", "-e", "64", *FAST,
                  "--out", out2, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out2))
    ok = [m for m in rf.measurements if m.status == "ok"]
    assert {(m.case.dtype, m.case.params["redop"]) for m in ok if m.case.op == "all_reduce"} == \
        {("bfloat16", "avg"), ("bfloat16", "prod"), ("bfloat16", "max"), ("float16", "avg"), ("float16", "prod"),
         ("float16", "max"), ("int64", "prod"), ("int64", "max")}
    assert all(m.num_wrong == 0 for m in ok)


@pytest.mark.parametrize("launch", ["local", "mpiexec"])
def test_check_catches_a_corrupted_result(tmp_path, launch):
    """Rank 0 sends one wrong element: every collective whose output depends on
    rank 0's input reports it, and the exit status is 1."""
    out = tmp_path / "c.jsonl"
    ops = "all_reduce,all_gather,reduce_scatter,broadcast,reduce,all_to_all,send_recv,send_recv_bidir"
    args = ["run", "--collective", ops, "-b", "64", "-e", "64", *FAST, "--out", out]
    if launch == "local":
        p = commbench(*args, "--nprocs", "2", env=clean_env(COMMBENCH_INJECT_CORRUPTION="0"), cwd=tmp_path)
    else:
        p = commbench(*args, "--backend", "mpi", launcher=mpiexec(2),
                      env=clean_env(COMMBENCH_INJECT_CORRUPTION="0"), cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    assert "wrong" in p.stderr
    rf = results.load(str(out))
    wrong = {m.case.op: m.num_wrong for m in rf.measurements}
    assert all(wrong[op] >= 1 for op in ops.split(",")), wrong
    # all_reduce: every rank's element 0 (the reduction includes rank 0's bad value)
    assert wrong["all_reduce"] == 2 and wrong["reduce"] == 1 and wrong["send_recv"] == 1


def test_group_layouts_on_two_emulated_nodes(tmp_path):
    """4 ranks named as 2 nodes x 2: intra, inter, MOD and DIV groups, all groups
    of a layout at once, each Case naming its axis, group size and node span."""
    out = tmp_path / "g.jsonl"
    cmd = ["-m", "commbench", "run", "--backend", "mpi", "--collective", "all_reduce,send_recv",
           "--groups", "world,intra,inter,MOD 2,DIV 2", "-b", "1K", "-e", "1K", *FAST,
           "--keep-rank-samples", "--out", str(out)]
    import sys
    launcher = [MPIEXEC, "-n", "2", "-env", "COMMBENCH_HOSTNAME", "nodeA", sys.executable, *cmd,
                ":", "-n", "2", "-env", "COMMBENCH_HOSTNAME", "nodeB", sys.executable, *cmd]
    p = run_job(launcher, cwd=tmp_path)
    assert p.returncode == 0, p.stderr + p.stdout[-3000:]
    rf = results.load(str(out))
    assert rf.header["cluster"]["hosts"] == ["nodeA", "nodeB"]
    got = {(m.case.op, m.case.axis): (m.case.group_size, m.case.concurrent_groups, m.case.num_nodes)
           for m in rf.measurements}
    for op in ("all_reduce", "send_recv"):
        assert got[(op, "world")] == (4, 1, 2)
        assert got[(op, "intra")] == (2, 2, 1)
        assert got[(op, "inter")] == (2, 2, 2)
        assert got[(op, "mod2")] == (2, 2, 2)     # {0,2}, {1,3}: across the nodes
        assert got[(op, "div2")] == (2, 2, 1)     # {0,1}, {2,3}: within them
    for m in rf.measurements:
        assert m.num_wrong == 0
        # each iteration's time is the max over all ranks running at once
        per_rank = np.array(m.rank_samples_s)
        assert per_rank.shape == (4, len(m.samples_s))
        assert np.allclose(per_rank.max(axis=0), m.samples_s)
        assert m.slowest_host in ("nodeA", "nodeB")
        assert m.slowest_host == ["nodeA", "nodeA", "nodeB", "nodeB"][m.slowest_rank]


def test_adaptive_iterations_reach_target_or_say_so(tmp_path):
    out = tmp_path / "a.jsonl"
    p = commbench("run", "--backend", "mpi", "--collective", "all_reduce", "-b", "8", "-e", "64K", "-f", "8",
                  "-n", "10", "--target-ci", "0.05", "--time-budget", "0.5", "--max-iters", "4000", "-q",
                  "--out", out, launcher=mpiexec(2), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    for m in results.load(str(out)).measurements:
        s = m.stats
        assert 10 <= m.iters <= 4000
        assert s["precision"] == pytest.approx((s["ci_high_s"] - s["ci_low_s"]) / 2 / s["time_p50_s"])
        # either the target was reached, or the file says it was not
        reached = s["precision"] <= 0.05
        assert reached != any("did not reach the target" in w for w in m.warnings)


def test_adaptive_stop_needs_a_real_95_percent_interval(tmp_path):
    """Below 6 samples the median's interval is the range, which covers it with
    less than 95 % (2 samples: 50 %): a loose target met by 2 samples does not
    stop the doubling before 6."""
    out = tmp_path / "few.jsonl"
    p = commbench("run", "--backend", "mpi", "--collective", "all_reduce", "-b", "1K", "-e", "1K", "-n", "2",
                  "-w", "1", "--target-ci", "0.9", "-q", "--out", out, launcher=mpiexec(2), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (m,) = results.load(str(out)).measurements
    assert m.iters >= 6 and m.stats["precision"] <= 0.9


def test_json_and_csv_exports(tmp_path):
    p = commbench("run", "--backend", "mpi", "--collective", "all_reduce,barrier", "-b", "8", "-e", "64",
                  "-f", "8", *FAST, "--json", "--out", tmp_path / "j.jsonl", launcher=mpiexec(2), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["header"]["run_id"] and len(doc["measurements"]) == 3
    assert {m["case"]["op"] for m in doc["measurements"]} == {"all_reduce", "barrier"}
    p = commbench("show", tmp_path / "j.jsonl", "--csv")
    import io
    import pandas as pd
    df = pd.read_csv(io.StringIO(p.stdout))
    for col in ("op", "backend", "device", "dtype", "nbytes", "group_size", "num_nodes", "axis", "in_place",
                "iters", "time_min_s", "time_p50_s", "time_mean_s", "time_p95_s", "time_max_s",
                "algbw_gbps", "busbw_gbps", "num_wrong"):
        assert col in df.columns
    assert len(df) == 3 and math.isnan(df[df.op == "barrier"].busbw_gbps.iloc[0])


def test_in_place_both_measures_each_case_once(tmp_path):
    """--in-place both on gloo: all_reduce runs in place only (torch has no
    out-of-place form) and send_recv / barrier have no in-place form: one
    measurement each per size, all_gather both ways."""
    out = tmp_path / "ip.jsonl"
    p = commbench("run", "--nprocs", "2", "--collective", "all_reduce,all_gather,send_recv,barrier", "-b", "1K",
                  "-e", "2K", *FAST, "-n", "2", "--in-place", "both", "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    ms = results.load(str(out)).measurements
    keys = [m.case.key() for m in ms]
    assert len(keys) == len(set(keys))
    modes = {}
    for m in ms:
        modes.setdefault(m.case.op, []).append(m.case.in_place)
    assert modes == {"all_reduce": [True, True], "all_gather": [False, False, True, True],
                     "send_recv": [False, False], "barrier": [False]}
