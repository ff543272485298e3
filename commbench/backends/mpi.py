"""mpi4py: numpy buffers on the CPU; cupy device buffers when the MPI is CUDA-aware."""
import os
from functools import partial

import numpy as np

from commbench.backends.base import Backend, Group, Unsupported
from commbench.dtypes import DTYPES


def encode(values: np.ndarray, np_dtype) -> np.ndarray:
    """Host values in a buffer's numpy dtype. numpy has no bfloat16: bfloat16
    buffers are uint16 bit patterns, rounded to nearest even here."""
    if np.dtype(np_dtype) != np.uint16:
        return values.astype(np_dtype)
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def decode(host: np.ndarray) -> np.ndarray:
    """A host copy of a buffer as float64 values (uint16 = bfloat16 bits)."""
    if host.dtype == np.uint16:
        return (host.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return host.astype(np.float64)


def cuda_aware() -> bool:
    """Whether the loaded MPI takes device pointers: COMMBENCH_MPI_CUDA_AWARE
    decides if set; else Open MPI's MPIX_Query_cuda_support or MPICH's
    MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA = 0), looked up in the MPI
    library that mpi4py loaded."""
    forced = os.environ.get("COMMBENCH_MPI_CUDA_AWARE")
    if forced is not None:
        return forced == "1"
    import ctypes

    from mpi4py import MPI
    lib = ctypes.CDLL(MPI.__file__)   # dlsym on it searches libmpi, its dependency
    if hasattr(lib, "MPIX_Query_cuda_support"):
        return lib.MPIX_Query_cuda_support() == 1
    if hasattr(lib, "MPIX_GPU_query_support"):
        flag = ctypes.c_int(0)
        return lib.MPIX_GPU_query_support(0, ctypes.byref(flag)) == 0 and flag.value == 1
    return False


class MPIBackend(Backend):
    name = "mpi"

    def __init__(self, launch, device, timeout_s):
        super().__init__(launch, device, timeout_s)
        try:
            from mpi4py import MPI
        except ImportError:
            raise ValueError("--backend mpi needs mpi4py (pip install 'commbench[mpi]')") from None
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.rank, self.comm.size
        if launch.world_size not in (1, self.world_size):
            raise ValueError(f"the launcher says {launch.world_size} ranks but MPI has {self.world_size}: "
                             "start the MPI backends with mpiexec")
        self.xp = np
        if device == "cuda":
            if not cuda_aware():
                raise ValueError("--backend mpi --device cuda needs a CUDA-aware MPI (neither "
                                 "MPIX_Query_cuda_support nor MPIX_GPU_query_support says so); "
                                 "if yours is, set COMMBENCH_MPI_CUDA_AWARE=1")
            import cupy
            cupy.cuda.Device(launch.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
            self.xp = cupy
        self._redops = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
        self._bf16 = getattr(MPI, "BFLOAT16_T", MPI.DATATYPE_NULL)

    def new_groups(self, groups):
        groups = [tuple(g) for g in groups]
        color = next((i for i, g in enumerate(groups) if self.rank in g), None)
        if len(groups) == 1 and color == 0 and len(groups[0]) == self.world_size:
            comm = self.comm
        else:
            comm = self.comm.Split(self.MPI.UNDEFINED if color is None else color, self.rank)
        if color is None:
            return None
        return Group(ranks=groups[color], rank=comm.rank, handle=comm)

    def check_supported(self, op, dtype, redop, in_place):
        if redop == "avg":
            raise Unsupported("MPI has no AVG reduction")
        if dtype == "bfloat16" and self._bf16 == self.MPI.DATATYPE_NULL:
            raise Unsupported("this MPI has no bfloat16 datatype")
        if op == "reduce_scatter" and in_place:
            raise Unsupported("MPI in-place Reduce_scatter_block puts the result at the buffer start, "
                              "not at the rank's offset")

    # --- buffers ---------------------------------------------------------------
    def empty(self, count, dtype):
        if dtype == "bfloat16":
            return self.xp.zeros(count, dtype=np.uint16)
        return self.xp.zeros(count, dtype=DTYPES[dtype].numpy)

    def _spec(self, buf):
        return [buf, self._bf16] if buf.dtype == np.uint16 else buf

    def upload(self, buf, values):
        buf[...] = self.xp.asarray(encode(values, buf.dtype))

    def download(self, buf):
        return decode(buf.get() if self.xp is not np else buf)

    def view(self, buf, start, count):
        return buf[start:start + count]

    # --- primitives --------------------------------------------------------------
    def _sync_first(self, call):
        """With device buffers, kernels that wrote them must finish before MPI reads
        them. Host calls stay bare partials: no Python frame of ours in the timed loop."""
        if self.xp is np:
            return call
        sync = self.xp.cuda.get_current_stream().synchronize

        def run():
            sync()
            call()
        return run

    def all_reduce(self, g, send, recv, redop, in_place):
        c, op = g.handle, self._redops[redop]
        sendbuf = self.MPI.IN_PLACE if in_place else self._spec(send)
        r = self._spec(recv)
        return self._sync_first(partial(c.Allreduce, sendbuf, r, op))

    def all_gather(self, g, send, recv, in_place):
        c = g.handle
        sendbuf = self.MPI.IN_PLACE if in_place else self._spec(send)
        r = self._spec(recv)
        return self._sync_first(partial(c.Allgather, sendbuf, r))

    def reduce_scatter(self, g, send, recv, redop, in_place):
        c, op = g.handle, self._redops[redop]
        s, r = self._spec(send), self._spec(recv)
        return self._sync_first(partial(c.Reduce_scatter_block, s, r, op))

    def broadcast(self, g, buf, root):
        c, b = g.handle, self._spec(buf)
        return self._sync_first(partial(c.Bcast, b, root))

    def broadcast_burst(self, g, buf, spans):
        """Every (start, stop, root) piece of buf as an Ibcast, then one Waitall."""
        c, waitall = g.handle, self.MPI.Request.Waitall
        pieces = [(self._spec(self.view(buf, a, b - a)), r) for a, b, r in spans]

        def burst():
            waitall([c.Ibcast(v, r) for v, r in pieces])
        return self._sync_first(burst)

    def reduce(self, g, send, recv, redop, root, in_place):
        c, op = g.handle, self._redops[redop]
        s = self.MPI.IN_PLACE if in_place and g.rank == root else self._spec(send)
        r = self._spec(recv)
        return self._sync_first(partial(c.Reduce, s, r, op, root))

    def all_to_all(self, g, send, recv, in_place):
        c = g.handle
        s = self.MPI.IN_PLACE if in_place else self._spec(send)
        r = self._spec(recv)
        return self._sync_first(partial(c.Alltoall, s, r))

    def send(self, g, buf, peer):
        c, b = g.handle, self._spec(buf)
        return self._sync_first(partial(c.Send, b, peer))

    def recv(self, g, buf, peer):
        c, b = g.handle, self._spec(buf)
        return partial(c.Recv, b, peer)

    def send_recv(self, g, send, recv, peer):
        c, s, r = g.handle, self._spec(send), self._spec(recv)
        return self._sync_first(partial(c.Sendrecv, s, peer, recvbuf=r, source=peer))

    def barrier(self, g):
        return g.handle.Barrier

    # --- timing -------------------------------------------------------------------
    def time_iterations(self, op, iters):
        from commbench import timing
        return timing.host_timer(op, iters)

    def synchronize(self):
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    # --- control channel --------------------------------------------------------------
    def control_reduce(self, values, op):
        out = np.empty_like(np.asarray(values, dtype=np.float64))
        self.comm.Allreduce(np.asarray(values, dtype=np.float64), out,
                            self.MPI.MAX if op == "max" else self.MPI.SUM)
        return out

    def control_bcast(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def control_allgather(self, obj):
        return self.comm.allgather(obj)
