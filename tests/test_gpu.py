"""GPU paths: NCCL through torch and through cupy, CUDA-event timing. Marked
gpu: skipped (with the reason) where torch sees no CUDA device."""
import pytest

from busbw import expected_bandwidths
from commbench import results
from conftest import FAST, commbench, mpiexec

pytestmark = pytest.mark.gpu


def _check(out, backend):
    rf = results.load(str(out))
    ok = [m for m in rf.measurements if m.status == "ok"]
    assert ok
    for m in ok:
        assert m.case.device == "cuda" and m.case.backend == backend
        assert m.num_wrong == 0, (m.case.op, m.case.nbytes)
        algbw, busbw = expected_bandwidths(m.case.op, m.case.nbytes, m.case.group_size, m.samples_s)
        if algbw is not None:
            assert m.busbw_gbps == pytest.approx(busbw, rel=1e-9)
    return rf


def test_torch_nccl_every_collective(tmp_path):
    import torch
    n = max(1, torch.cuda.device_count())
    out = tmp_path / "nccl.jsonl"
    p = commbench("run", "--nprocs", str(n), "--device", "cuda", "--collective", "all", "-d", "float32,bf16",
                  "-b", "8", "-e", "64M", "-f", "16", *FAST, "--out", out, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr
    rf = _check(out, "torch-nccl")
    assert rf.header["versions"].get("nccl")


def test_cupy_nccl_under_mpiexec(tmp_path):
    pytest.importorskip("cupy")
    import torch
    n = max(1, torch.cuda.device_count())
    out = tmp_path / "cupy.jsonl"
    p = commbench("run", "--backend", "cupy", "--device", "cuda", "--collective", "all", "-d", "float32,bf16",
                  "-b", "8", "-e", "64M", "-f", "16", *FAST, "--out", out, launcher=mpiexec(n), cwd=tmp_path,
                  timeout=600)
    assert p.returncode == 0, p.stderr
    _check(out, "cupy-nccl")


def test_corruption_is_caught_on_gpu(tmp_path):
    import torch
    n = max(1, torch.cuda.device_count())
    out = tmp_path / "c.jsonl"
    from conftest import clean_env
    p = commbench("run", "--nprocs", str(n), "--device", "cuda", "--collective", "all_reduce,all_gather",
                  "-b", "1K", "-e", "1K", *FAST, "--out", out, cwd=tmp_path,
                  env=clean_env(COMMBENCH_INJECT_CORRUPTION="0"))
    assert p.returncode == 1, p.stderr
    assert all(m.num_wrong >= 1 for m in results.load(str(out)).measurements)
