"""kernels/ through the loader (commbench.kernels): directory lookup, the numpy
references of every kernel (CPU), `run --backend kernels` refusing a machine
without a GPU in one line; on a GPU, every kernel against its reference, copy
bandwidth against the device's peak, and `run --backend kernels` end to end."""
import re

import numpy as np
import pytest

from commbench import kernels
from conftest import FAST, ROOT, commbench


def _has_gpu():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# --- directory lookup ------------------------------------------------------------------
def test_default_dir_is_beside_the_package(monkeypatch):
    monkeypatch.delenv(kernels.ENV_DIR, raising=False)
    assert kernels.kernels_dir() == ROOT / "kernels"


def test_env_dir_and_missing_file(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.ENV_DIR, str(tmp_path))
    assert kernels.kernels_dir() == tmp_path
    with pytest.raises(ValueError, match=r"copy_triad\.cu is missing"):
        kernels.source("copy_kernel")


def test_missing_dir_is_a_clear_error(monkeypatch, tmp_path):
    gone = tmp_path / "nowhere"
    monkeypatch.setenv(kernels.ENV_DIR, str(gone))
    with pytest.raises(ValueError, match=re.escape(str(gone))):
        kernels.kernels_dir()


def test_unknown_kernel():
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        kernels.source("nope")


@pytest.mark.parametrize("name", sorted(kernels.FILES))
def test_every_kernel_is_in_its_file(name, monkeypatch):
    monkeypatch.delenv(kernels.ENV_DIR, raising=False)
    assert re.search(rf'extern\s+"C"\s+__global__\s+void\s+(__launch_bounds__\([^)]*\)\s*)?{name}\s*\(',
                     kernels.source(name))


# --- references --------------------------------------------------------------------------
def test_pattern_is_exact_in_half_and_deterministic():
    x = kernels.pattern(np, 4096, 3)
    assert x.dtype == np.float32 and x.min() >= 0 and x.max() < 1
    assert np.array_equal(x.astype(np.float16).astype(np.float32), x)
    assert np.array_equal(x, kernels.pattern(np, 4096, 3)) and not np.array_equal(x, kernels.pattern(np, 4096, 4))


def test_copy_and_triad_references():
    a, b = kernels.pattern(np, 1024, 1), kernels.pattern(np, 1024, 2)
    assert kernels.num_wrong_exact(kernels.copy_reference(a), a) == 0
    want = a.astype(np.float64) + 3.0 * b.astype(np.float64)
    got = kernels.triad_reference(a, b, 3.0)
    assert got.dtype == np.float32
    assert kernels.num_wrong_close(got, want, **kernels.TRIAD_TOL) == 0


def test_multi_reduce_references():
    srcs = [kernels.pattern(np, 999, s) for s in range(5)]
    exact = np.sum([s.astype(np.float64) for s in srcs], axis=0)
    assert kernels.num_wrong_close(kernels.multi_reduce_reference(srcs), exact, **kernels.REDUCE_TOL) == 0
    half = kernels.multi_reduce_half_reference([s.astype(np.float16) for s in srcs])
    assert half.dtype == np.float16
    assert kernels.num_wrong_close(half, exact, **kernels.REDUCE_HALF_TOL) == 0


def _spin_by_hand(t, iters):
    x = np.float32(t & 31)
    for _ in range(iters):
        x = np.float32(float(x) * 0.5 + 0.5)    # exact in double, one rounding to float32
    return x


@pytest.mark.parametrize("iters", [0, 1, 2, 7, 40, 200])
def test_sm_spin_reference_is_the_recurrence(iters):
    out = kernels.sm_spin_reference(2, iters, block=64)
    assert out.dtype == np.float32 and out.shape == (128,)
    want = np.array([_spin_by_hand(i % 64, iters) for i in range(128)], np.float32)
    assert kernels.num_wrong_exact(out, want) == 0


def test_sm_spin_reference_long_runs_reach_the_fixed_point():
    out = kernels.sm_spin_reference(3, 10 ** 12)       # exact without 10^12 steps
    assert out.shape == (3 * kernels.SPIN_BLOCK,)
    assert kernels.num_wrong_exact(out, kernels.sm_spin_reference(3, 200)) == 0
    assert np.all(out == np.float32(1.0))


def test_num_wrong_exact_compares_bits():
    a = np.array([0.0, 1.0, np.nan], np.float32)
    assert kernels.num_wrong_exact(a, a.copy()) == 0
    assert kernels.num_wrong_exact(np.array([-0.0, 1.0, np.nan], np.float32), a) == 1
    with pytest.raises(ValueError, match="cannot compare"):
        kernels.num_wrong_exact(a, a.astype(np.float64))


# --- no GPU here: clear errors -------------------------------------------------------------
@pytest.mark.skipif(_has_gpu(), reason="a GPU is visible")
def test_loader_without_gpu_is_a_value_error():
    with pytest.raises(ValueError, match="needs"):
        kernels.Kernels(0)


@pytest.mark.skipif(_has_gpu(), reason="a GPU is visible")
def test_run_kernels_without_gpu_exits_2_in_one_line(tmp_path):
    p = commbench("run", "--backend", "kernels", "-b", "1M", "-e", "4M", "--out", tmp_path / "k.jsonl", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--backend kernels" in lines[0] and "Traceback" not in p.stderr
    assert not (tmp_path / "k.jsonl").exists()


@pytest.mark.parametrize("extra", [["--device", "cpu"], ["--collective", "all_reduce"], ["-e", "1Q"]])
def test_run_kernels_rejects_bad_flags_in_one_line(extra, capsys):
    from commbench.cli import main
    assert main(["run", "--backend", "kernels", *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err


# --- GPU -------------------------------------------------------------------------------------
@pytest.fixture
def gpu():
    cupy = pytest.importorskip("cupy")
    return cupy, kernels.Kernels(0)


@pytest.mark.gpu
def test_copy_triad_p2p_against_references(gpu):
    cupy, ks = gpu
    n = 1 << 20
    a, b = kernels.pattern(cupy, n, 1), kernels.pattern(cupy, n, 2)
    c = cupy.zeros(n, dtype=cupy.float32)
    ks.copy(a, c)
    cupy.cuda.Device().synchronize()
    assert ks.check_copy(a, c) == 0
    c[7] += 1                                       # the check must see a wrong element
    assert ks.check_copy(a, c) == 1
    ks.triad(a, b, c, 3.0)
    cupy.cuda.Device().synchronize()
    assert ks.check_triad(a, b, c, 3.0) == 0
    c.fill(0)
    ks.p2p_copy(a, c)                               # on one device: a local copy through the same kernel
    cupy.cuda.Device().synchronize()
    assert ks.check_p2p(a, c) == 0
    if cupy.cuda.runtime.getDeviceCount() > 1 and cupy.cuda.runtime.deviceCanAccessPeer(1, 0):
        from commbench.kernel_bench import enable_peer_access
        assert enable_peer_access(cupy, 1, 0)
        with cupy.cuda.Device(1):
            dst = cupy.zeros(n, dtype=cupy.float32)
            kernels.Kernels(1).p2p_copy(a, dst)     # remote read of GPU 0 from GPU 1
            cupy.cuda.Device(1).synchronize()
        assert ks.check_p2p(a, dst) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_multi_reduce_against_reference(gpu, dtype):
    cupy, ks = gpu
    srcs = [kernels.pattern(cupy, 100003, s).astype(dtype) for s in range(4)]
    dst = cupy.zeros(100003, dtype=dtype)
    ptrs = ks.multi_reduce(srcs, dst)
    cupy.cuda.Device().synchronize()
    del ptrs
    assert ks.check_multi_reduce(srcs, dst) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("iters", [0, 3, 50, 100000])
def test_sm_spin_bit_exact(gpu, iters):
    cupy, ks = gpu
    out = cupy.full(4 * kernels.SPIN_BLOCK, -1, dtype=cupy.float32)
    ks.sm_spin(out, 4, iters)
    cupy.cuda.Device().synchronize()
    assert ks.check_sm_spin(out, 4, iters) == 0


def peak_hbm_gbps(index=0):
    """NVML memory clock x bus width x 2 (double data rate), else the data sheet."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
        bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        if mhz and bits:
            return mhz * 1e6 * bits / 8 * 2 / 1e9
    except Exception:
        pass
    import torch
    name = torch.cuda.get_device_name(index)
    for words, gbps in ((("A100", "40GB"), 1555), (("A100", "80GB"), 2039), (("H100",), 3350), (("H200",), 4800)):
        if all(w in name for w in words):
            return gbps
    pytest.skip(f"no NVML and no peak bandwidth on file for {name}")


@pytest.mark.gpu
def test_copy_bandwidth_is_plausible(gpu):
    cupy, ks = gpu
    n = 256 << 20                                  # 1 GiB per buffer: far beyond any L2
    a, c = cupy.ones(n, dtype=cupy.float32), cupy.zeros(n, dtype=cupy.float32)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    ks.copy(a, c)
    times = []
    for _ in range(5):
        start.record()
        ks.copy(a, c)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e-3)
    gbps = 2 * 4 * n / float(np.median(times)) / 1e9
    peak = peak_hbm_gbps(0)
    assert 0.10 * peak <= gbps <= peak, (gbps, peak)


@pytest.mark.gpu
def test_run_kernels_end_to_end(tmp_path):
    pytest.importorskip("cupy")
    from commbench import results
    out = tmp_path / "k.jsonl"
    p = commbench("run", "--backend", "kernels", "-b", "1M", "-e", "16M", "-f", "4", *FAST, "--out", out,
                  cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    ops = {m.case.op for m in rf.measurements}
    assert {"copy", "triad"} <= ops
    for m in rf.measurements:
        c = m.case
        assert (c.kind, c.backend, c.device, c.dtype, c.axis) == ("memory", "kernels", "cuda", "float32", "intra")
        if m.status != "ok":
            assert c.op.startswith("p2p") and "peer access" in m.skip_reason
            continue
        assert m.num_wrong == 0 and m.iters == 5
        per_elem = {"copy": 32, "triad": 48}.get(c.op, 16)
        assert c.nbytes % per_elem == 0 and c.group_size == (2 if c.op.startswith("p2p") else 1)
        factor = 2 if c.op == "p2p_bidir" else 1
        assert m.algbw_gbps == pytest.approx(factor * c.nbytes / float(np.percentile(m.samples_s, 50)) / 1e9)
