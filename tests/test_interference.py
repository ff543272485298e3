"""`commbench compute --interference`: bad input in one line, slowdowns() on a
hand-made file, a real 2-rank gloo run end to end (CPU), and the GPU run."""
import statistics

import pytest

from commbench import interference, results
from commbench.interference import InterferenceConfig, Pair
from commbench.results import Case, Measurement, ResultFile
from conftest import commbench


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="multiple of 4"):
        InterferenceConfig(device="cpu", nbytes=6)
    with pytest.raises(ValueError, match="needs --device cuda"):
        InterferenceConfig(device="cpu", sms=(8,))
    with pytest.raises(ValueError, match="at least 1"):
        InterferenceConfig(device="cuda", sms=(0, 8))
    with pytest.raises(ValueError, match="comma-separated SM counts"):
        interference.parse_sms("8,lots")


@pytest.mark.parametrize("args", [["--sms", "8", "--device", "cpu"], ["--nbytes", "3"], ["--nbytes", "4X"]])
def test_cli_bad_input_is_one_line(args, capsys):
    from commbench.cli import main
    assert main(["compute", "--interference", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _m(op, concurrent, samples, work, partner=None, num_sms=None):
    case = Case(kind="interference", op=op, backend="torch-nccl", device="cuda", dtype="float32", nbytes=1024,
                group_size=2, num_nodes=1, axis="world", in_place=False,
                params={"concurrent": concurrent, "num_sms": num_sms, "partner": partner, "work": work})
    return Measurement(case=case, samples_s=samples)


def test_slowdowns_pair_alone_and_concurrent():
    ar, s8, s16 = "all_reduce 1024 B", "sm_spin 8 SMs", "sm_spin 16 SMs"
    rf = ResultFile(header={}, measurements=[
        _m("collective", False, [1.0, 2.0, 3.0], ar),
        _m("compute", False, [4.0, 4.0], s8, num_sms=8),
        _m("compute", True, [6.0, 6.0], s8, ar, 8),
        _m("collective", True, [3.0, 3.0, 3.0], ar, s8, 8),
        _m("collective", True, [5.0], ar, s16, 16),          # its compute alone is missing: no compute factor
        _m("compute", True, [9.0], s16, ar, 16),
    ])
    got = interference.slowdowns(rf)
    assert got == {Pair(8, s8, ar): {"compute": 1.5, "collective": 1.5},
                   Pair(16, s16, ar): {"collective": 2.5}}


def test_cpu_interference_end_to_end(tmp_path):
    out = tmp_path / "i.jsonl"
    p = commbench("compute", "--interference", "--device", "cpu", "--nprocs", "2", "--nbytes", "256K",
                  "--gemm-size", "128", "-n", "6", "-w", "1", "--target-ci", "0", "-q", "--out", out,
                  cwd=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    assert rf.header["settings"]["interference"] is True
    ms = rf.measurements
    assert sorted((m.case.op, m.case.params["concurrent"]) for m in ms) == [
        ("collective", False), ("collective", True), ("compute", False), ("compute", True)]
    by = {(m.case.op, m.case.params["concurrent"]): m for m in ms}
    for m in ms:
        c = m.case
        assert (c.kind, c.backend, c.device, c.dtype, c.nbytes, c.group_size, c.axis) == \
            ("interference", "torch-gloo", "cpu", "float32", 256 << 10, 2, "world")
        assert m.num_wrong == 0 and m.iters == 6 and all(t > 0 for t in m.samples_s)
        assert c.params["num_sms"] is None
    gemm, ar = by[("compute", False)].case.params["work"], by[("collective", False)].case.params["work"]
    assert "gemm 128x128x128" in gemm and "all_reduce 262144 B" in ar
    assert by[("compute", True)].case.params["partner"] == ar
    assert by[("collective", True)].case.params["partner"] == gemm
    # the factors, recomputed here from the stored raw samples
    want = {op: statistics.median(by[(op, True)].samples_s) / statistics.median(by[(op, False)].samples_s)
            for op in ("compute", "collective")}
    got = interference.slowdowns(str(out))
    assert list(got) == [Pair(None, gemm, ar)]
    assert got[Pair(None, gemm, ar)] == pytest.approx(want, rel=1e-12)
    assert interference.slowdowns(rf) == got


@pytest.mark.gpu
def test_gpu_interference_end_to_end(tmp_path):
    pytest.importorskip("cupy")
    out = tmp_path / "g.jsonl"
    p = commbench("compute", "--interference", "--device", "cuda", "--sms", "2,8", "--nbytes", "4M",
                  "-n", "5", "-w", "1", "--target-ci", "0", "--time-budget", "0.2", "-q", "--out", out,
                  cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    assert all(m.num_wrong == 0 for m in rf.measurements)
    got = interference.slowdowns(rf)
    assert sorted(k.num_sms for k in got) == [2, 8]
    for v in got.values():
        assert set(v) == {"compute", "collective"} and all(f > 0 for f in v.values())
