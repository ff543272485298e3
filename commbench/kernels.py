"""The custom CUDA kernels of kernels/*.cu, compiled with cupy.RawModule: the
directory lookup, one compiled module per (device, file), typed launch helpers,
and each kernel's reference check as its .cu header states it. The references
are plain numpy, so they run (and are tested) without a GPU; cupy is imported
only when a kernel is compiled."""
import os
from pathlib import Path

import numpy as np

ENV_DIR = "COMMBENCH_KERNELS_DIR"
COMPILE_OPTIONS = ("-std=c++17",)
SPIN_BLOCK = 1024          # sm_spin_kernel's block size (its __launch_bounds__)
BLOCK = 256                # threads per block of the streaming kernels
BLOCKS_PER_SM = 8          # 8 x 256 = 2048 threads: a full SM on sm_80 / sm_90

# kernel name -> file (one file may hold several kernels)
FILES = {"copy_kernel": "copy_triad.cu", "triad_kernel": "copy_triad.cu", "p2p_copy_kernel": "p2p_copy.cu",
         "multi_reduce_kernel": "multi_reduce.cu", "multi_reduce_half_kernel": "multi_reduce.cu",
         "sm_spin_kernel": "sm_spin.cu"}

# allclose tolerances. triad: the GPU may fuse a + s*b into one FMA (one rounding)
# where numpy rounds twice, a difference below 1 ulp. multi_reduce: same order of
# float32 additions as numpy; half rounds its float sum once to half (eps 2^-10).
TRIAD_TOL = dict(rtol=1e-6, atol=1e-6)
REDUCE_TOL = dict(rtol=1e-6, atol=1e-6)
REDUCE_HALF_TOL = dict(rtol=2e-3, atol=2e-3)


def kernels_dir() -> Path:
    """$COMMBENCH_KERNELS_DIR, else kernels/ beside the commbench package."""
    given = os.environ.get(ENV_DIR)
    path = Path(given) if given else Path(__file__).resolve().parent.parent / "kernels"
    if not path.is_dir():
        where = f"{ENV_DIR}={given}" if given else f"{path} (beside the commbench package)"
        raise ValueError(f"CUDA kernels directory not found: {where}; set {ENV_DIR} to the kernels/ "
                         "directory of a commbench checkout")
    return path


def source(kernel: str) -> str:
    """The CUDA source holding `kernel`."""
    if kernel not in FILES:
        raise ValueError(f"unknown kernel {kernel!r}: choose from {', '.join(FILES)}")
    path = kernels_dir() / FILES[kernel]
    if not path.is_file():
        raise ValueError(f"{path} is missing: {kernel} lives in {FILES[kernel]}")
    return path.read_text()


def import_cupy(what: str):
    """cupy, with a CUDA device visible; else a ValueError saying what `what` needs."""
    try:
        import cupy
    except ImportError:
        raise ValueError(f"{what} needs cupy and a CUDA GPU: cupy is not installed "
                         "(pip install 'commbench[gpu]')") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # no driver / no device: cupy raises CUDARuntimeError
        raise ValueError(f"{what} needs a CUDA GPU: none is visible ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None
    if count == 0:
        raise ValueError(f"{what} needs a CUDA GPU: none is visible")
    return cupy


# --- references (numpy, host) -------------------------------------------------------
def pattern(xp, count: int, seed: int = 0):
    """Deterministic float32 inputs in [0, 1), multiples of 1/1024 (exact in float32,
    fp16 too), on numpy or cupy alike."""
    i = xp.arange(count, dtype=xp.int64)
    return (((i * 2654435761 + seed * 40503) % 1024) / 1024.0).astype(xp.float32)


def copy_reference(src: np.ndarray) -> np.ndarray:
    return np.array(src, dtype=np.float32, copy=True)


p2p_reference = copy_reference


def triad_reference(a: np.ndarray, b: np.ndarray, s: float) -> np.ndarray:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a + np.float32(s) * b


def multi_reduce_reference(srcs) -> np.ndarray:
    """Element-wise sum in float32, in the kernel's order (k = 0, 1, ...)."""
    acc = np.zeros(np.asarray(srcs[0]).shape, np.float32)
    for s in srcs:
        acc += np.asarray(s).astype(np.float32)
    return acc


def multi_reduce_half_reference(srcs) -> np.ndarray:
    """float16 inputs summed in float32, rounded once to float16."""
    return multi_reduce_reference(srcs).astype(np.float16)


def sm_spin_reference(num_blocks: int, iters: int, block: int = SPIN_BLOCK) -> np.ndarray:
    """out[b*block + t] after `iters` steps of x = x*0.5 + 0.5 in float32 from
    x0 = t & 31. x*0.5 is exact, so the fused and unfused forms round alike. Once
    a step leaves every x unchanged it is a fixed point of a deterministic map, so
    the loop stops there: exact for any iters, in at most ~60 steps."""
    if num_blocks < 0 or iters < 0 or block < 1:
        raise ValueError(f"sm_spin_reference: num_blocks ({num_blocks}) and iters ({iters}) must be >= 0, "
                         f"block ({block}) >= 1")
    x = np.arange(32, dtype=np.float32)
    half = np.float32(0.5)
    for _ in range(iters):
        nxt = x * half + half
        if np.array_equal(nxt.view(np.uint32), x.view(np.uint32)):
            break
        x = nxt
    return np.tile(x[np.arange(block) & 31], num_blocks)


def num_wrong_exact(got, want) -> int:
    """Elements whose bits differ (copies and sm_spin must match bit for bit)."""
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(f"cannot compare {got.dtype}{got.shape} with {want.dtype}{want.shape}")
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[got.itemsize]
    return int(np.count_nonzero(got.view(bits) != want.view(bits)))


def num_wrong_close(got, want, rtol: float, atol: float) -> int:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise ValueError(f"cannot compare shape {got.shape} with {want.shape}")
    return int(np.count_nonzero(~np.isclose(got, want, rtol=rtol, atol=atol)))


# --- compiled modules and launches (cupy, GPU) -----------------------------------------
_MODULES = {}


def _float4_count(x, name: str) -> int:
    if getattr(x, "dtype", None) != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous float32 cupy array")
    if x.size == 0 or x.size % 4:
        raise ValueError(f"{name} holds {x.size} floats: float4 kernels need a positive multiple of 4")
    return x.size // 4


class Kernels:
    """The kernels on one device. Each launch helper checks its arguments, then
    launches on `stream` (default: cupy's current stream) and returns at once."""

    def __init__(self, device: int = 0):
        self.cupy = import_cupy("the CUDA kernels")
        self.device = device
        with self.cupy.cuda.Device(device) as d:
            self.num_sms = int(d.attributes["MultiProcessorCount"])

    def function(self, name: str):
        key = (self.device, name)
        if key not in _MODULES:
            cupy = self.cupy
            # cuda_fp16.h (multi_reduce.cu): cupy brings headers matching its NVRTC
            with cupy.cuda.Device(self.device):
                module = cupy.RawModule(code=source(name), options=COMPILE_OPTIONS)
                for kernel in [k for k, f in FILES.items() if f == FILES[name]]:
                    _MODULES[(self.device, kernel)] = module.get_function(kernel)
        return _MODULES[key]

    def _grid(self, n: int) -> int:
        return max(1, min(-(-n // BLOCK), self.num_sms * BLOCKS_PER_SM))

    def _launch(self, name, grid, block, args, stream):
        fn = self.function(name)
        with self.cupy.cuda.Device(self.device):
            if stream is None:
                fn((grid,), (block,), args)
            else:
                with stream:
                    fn((grid,), (block,), args)

    def copy(self, src, dst, stream=None):
        n = _float4_count(src, "src")
        if _float4_count(dst, "dst") != n:
            raise ValueError(f"copy: dst holds {dst.size} floats, src {src.size}")
        self._launch("copy_kernel", self._grid(n), BLOCK, (src, dst, np.uint64(n)), stream)

    def triad(self, a, b, c, s: float, stream=None):
        n = _float4_count(a, "a")
        if _float4_count(b, "b") != n or _float4_count(c, "c") != n:
            raise ValueError("triad: a, b and c must hold the same number of floats")
        self._launch("triad_kernel", self._grid(n), BLOCK, (a, b, c, np.float32(s), np.uint64(n)), stream)

    def p2p_copy(self, src, dst, stream=None):
        """Runs on this device; src (remote read) or dst (remote write) is a peer's."""
        n = _float4_count(src, "src")
        if _float4_count(dst, "dst") != n:
            raise ValueError(f"p2p_copy: dst holds {dst.size} floats, src {src.size}")
        self._launch("p2p_copy_kernel", self._grid(n), BLOCK, (src, dst, np.uint64(n)), stream)

    def multi_reduce(self, srcs, dst, stream=None):
        """dst = sum of srcs; float32 or float16 (the half kernel) by dst's dtype.
        Returns the device array of source pointers, which must outlive the launch."""
        cupy = self.cupy
        if dst.dtype not in (np.float32, np.float16) or not dst.flags.c_contiguous or dst.size == 0:
            raise ValueError("multi_reduce: dst must be a non-empty C-contiguous float32 or float16 cupy array")
        if not srcs or any(s.dtype != dst.dtype or s.size != dst.size or not s.flags.c_contiguous for s in srcs):
            raise ValueError(f"multi_reduce: every source must be C-contiguous {dst.dtype} of {dst.size} elements")
        with cupy.cuda.Device(self.device):
            ptrs = cupy.asarray(np.array([s.data.ptr for s in srcs], dtype=np.uint64))
        name = "multi_reduce_kernel" if dst.dtype == np.float32 else "multi_reduce_half_kernel"
        self._launch(name, self._grid(dst.size), BLOCK, (ptrs, np.int32(len(srcs)), dst, np.uint64(dst.size)),
                     stream)
        return ptrs

    def sm_spin(self, out, num_blocks: int, iters: int, stream=None):
        if not 1 <= num_blocks:
            raise ValueError(f"sm_spin: num_blocks must be >= 1, got {num_blocks}")
        if iters < 0:
            raise ValueError(f"sm_spin: iters must be >= 0, got {iters}")
        if out.dtype != np.float32 or out.size < num_blocks * SPIN_BLOCK or not out.flags.c_contiguous:
            raise ValueError(f"sm_spin: out must be C-contiguous float32 of at least {num_blocks * SPIN_BLOCK}")
        self._launch("sm_spin_kernel", num_blocks, SPIN_BLOCK, (out, np.int64(iters)), stream)

    # --- reference checks (after a launch; synchronize first) ----------------------------
    @staticmethod
    def check_copy(src, dst) -> int:
        return num_wrong_exact(dst.get(), copy_reference(src.get()))

    check_p2p = check_copy

    @staticmethod
    def check_triad(a, b, c, s: float) -> int:
        return num_wrong_close(c.get(), triad_reference(a.get(), b.get(), s), **TRIAD_TOL)

    @staticmethod
    def check_multi_reduce(srcs, dst) -> int:
        host = [s.get() for s in srcs]
        if dst.dtype == np.float16:
            return num_wrong_close(dst.get(), multi_reduce_half_reference(host), **REDUCE_HALF_TOL)
        return num_wrong_close(dst.get(), multi_reduce_reference(host), **REDUCE_TOL)

    @staticmethod
    def check_sm_spin(out, num_blocks: int, iters: int) -> int:
        got = out.get()[:num_blocks * SPIN_BLOCK]
        return num_wrong_exact(got, sm_spin_reference(num_blocks, iters))
