"""`commbench compute` on the CPU end to end: real torch kernels timed on one and
on two ranks at once, written to a ResultFile, printed as --json."""
import json

import pytest

from commbench import results
from commbench.compute.runner import op_time_s
from conftest import commbench

QUICK = ["-n", "3", "-w", "1", "--target-ci", "0", "--device", "cpu"]


def test_compute_one_rank_json_and_results(tmp_path):
    out = tmp_path / "c.jsonl"
    p = commbench("compute", "--model", "tiny-llama", "--micro-batch", "2", "--dtype", "fp32", *QUICK,
                  "--out", out, "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    rf = results.load(str(out))
    cases = [m for m in rf.measurements]
    assert cases and all(m.case.kind == "compute" and m.status == "ok" for m in cases)
    # one measurement per distinct kernel and shape
    keys = [m.case.key() for m in cases]
    assert len(keys) == len(set(keys))
    assert all(m.iters == 3 and m.case.concurrent_groups == 1 and len(m.rank_time_p50_s) == 1 for m in cases)
    by_kernel = {}
    for m in cases:
        by_kernel.setdefault((m.case.op, m.case.params["m"], m.case.params["n"], m.case.params["k"]), m)
    ops = doc["ops"]
    names = {o["name"] for o in ops}
    assert {"qkv fwd", "qkv dgrad", "qkv wgrad", "attention fwd", "attention bwd", "swiglu bwd", "rope fwd",
            "embedding bwd", "logits wgrad", "cross entropy fwd", "adam step"} <= names
    for o in ops:
        assert set(o) >= {"name", "kind", "m", "n", "k", "flops", "bytes", "count", "time_p50_s"}
        m = by_kernel[(o["impl"], o["m"], o["n"], o["k"])]
        # the op's time is its kernel's stored p50 (from the raw samples)
        assert o["time_p50_s"] == pytest.approx(sorted(m.samples_s)[1]) and o["time_p50_s"] > 0
        assert o["time_p50_s"] == pytest.approx(op_time_s(m))
    # tiny-llama: GEMM FLOPs 2 m n k, stored in the Case as well
    gemm = next(o for o in ops if o["name"] == "mlp up fwd")
    assert gemm["flops"] == 2 * gemm["m"] * gemm["n"] * gemm["k"] == 2 * 128 * 176 * 64
    assert rf.header["settings"]["plan"]["model"]["name"] == "tiny-llama"


def test_compute_two_ranks_at_once_and_no_overwrite(tmp_path):
    out = tmp_path / "c2.jsonl"
    p = commbench("compute", "--model", "tiny-gpt", "--nprocs", "2", "--dtype", "fp32", *QUICK, "-q",
                  "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    for m in rf.measurements:
        assert m.case.concurrent_groups == 2 and len(m.rank_time_p50_s) == 2
        # each stored sample is the max over the ranks of that iteration, so its
        # median is at least every rank's own median
        assert m.stats["time_p50_s"] >= max(m.rank_time_p50_s)
    before = out.read_bytes()
    p = commbench("compute", "--model", "tiny-gpt", "--dtype", "fp32", *QUICK, "-q", "--out", out, cwd=tmp_path)
    assert p.returncode == 2 and "exists" in p.stderr and "Traceback" not in p.stderr
    assert out.read_bytes() == before


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny-gpt", "--tp", "3"], "tp"),
    (["--model", "tiny-gpt", "-n", "0"], "-n"),
    (["--model", "tiny-gpt", "--device", "tpu"], "device"),
])
def test_compute_bad_input(tmp_path, args, needle):
    p = commbench("compute", *args, "--out", tmp_path / "x.jsonl", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists()


class _OneRank:
    """The two control calls measure() makes, for one rank."""
    torch_device = "cpu"

    def control_allgather(self, x):
        return [x]


def test_compute_refuses_an_op_larger_than_memory_before_allocating():
    import torch
    from commbench.compute import runner
    from commbench.compute.ops import _gemm
    free = runner.free_bytes("cpu", 1)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert 0 < free <= avail * 1.05 and runner.free_bytes("cpu", 4) == pytest.approx(free / 4, rel=0.05)
    side = int((free / 2) ** 0.5) + 1              # three side x side bf16 matrices: 3x the free memory
    op = _gemm("huge fwd", side, side, side, 1, "fwd", "bf16", 2, "gemm_nt")
    assert runner.needed_bytes(op, "cpu") == 2 * 2 * 3 * side * side
    case = runner.case_of(op, "cpu", "torch", 1)
    m = runner.measure(_OneRank(), None, case, op, None, ["h"], torch, "cpu")
    assert m.status == "skipped" and "needs about" in m.skip_reason and "GB free for this rank" in m.skip_reason
