"""cupy.cuda.nccl: NCCL called directly (no torch in the path); the unique id of
each communicator is shared over MPI, which is also the control channel."""
import numpy as np

from commbench.backends.base import Backend, Group, Unsupported, check_gpu_per_rank
from commbench.backends.mpi import MPIBackend, decode, encode
from commbench.dtypes import DTYPES

# NCCL's ncclDataType_t and ncclRedOp_t values (nccl.h), keyed by the buffer's
# numpy dtype; NCCL has no uint16, so uint16 buffers are bfloat16 bit patterns
_NCCL_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
               "float16": 6, "float32": 7, "float64": 8, "uint16": 9}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


class CupyNcclBackend(Backend):
    name = "cupy-nccl"

    def __init__(self, launch, device, timeout_s):
        super().__init__(launch, device, timeout_s)
        if device != "cuda":
            raise ValueError("--backend cupy runs NCCL on GPUs: use --device cuda")
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError:
            raise ValueError("--backend cupy needs cupy with NCCL (pip install 'commbench[gpu]')") from None
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise ValueError("--backend cupy: no CUDA device")
        check_gpu_per_rank(launch.local_world_size, cupy.cuda.runtime.getDeviceCount(), "--backend cupy")
        self.cupy, self.nccl = cupy, nccl
        # MPI for ranks, unique-id exchange and the harness's control channel
        self.mpi = MPIBackend(launch, "cpu", timeout_s)
        self.rank, self.world_size = self.mpi.rank, self.mpi.world_size
        cupy.cuda.Device(launch.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def new_groups(self, groups):
        mpi_group = self.mpi.new_groups(groups)
        if mpi_group is None:
            return None
        comm = mpi_group.handle
        uid = comm.bcast(self.nccl.get_unique_id() if comm.rank == 0 else None, root=0)
        nc = self.nccl.NcclCommunicator(comm.size, uid, comm.rank)
        return Group(ranks=mpi_group.ranks, rank=comm.rank, handle=nc)

    def check_supported(self, op, dtype, redop, in_place):
        if dtype == "bfloat16" and self.nccl.get_version() < 21000:
            raise Unsupported("NCCL before 2.10 has no bfloat16")
        if redop == "avg" and self.nccl.get_version() < 21000:
            raise Unsupported("NCCL before 2.10 has no AVG")

    # --- buffers: bfloat16 held as uint16 bit patterns (cupy has no bfloat16) ------
    def empty(self, count, dtype):
        return self.cupy.zeros(count, dtype=np.uint16 if dtype == "bfloat16" else DTYPES[dtype].numpy)

    def upload(self, buf, values):
        buf[...] = self.cupy.asarray(encode(values, buf.dtype))

    def download(self, buf):
        self.stream.synchronize()
        return decode(buf.get())

    def view(self, buf, start, count):
        return buf[start:start + count]

    @staticmethod
    def _t(buf):
        return _NCCL_TYPES[buf.dtype.name]

    # --- primitives (counts are elements; NCCL in place = same pointer / offset views) ---
    def all_reduce(self, g, send, recv, redop, in_place):
        c, s, r, n, t, op, st = g.handle, send.data.ptr, recv.data.ptr, recv.size, self._t(recv), _NCCL_OPS[redop], self.stream.ptr
        return lambda: c.allReduce(s, r, n, t, op, st)

    def all_gather(self, g, send, recv, in_place):
        c, s, r, n, t, st = g.handle, send.data.ptr, recv.data.ptr, send.size, self._t(recv), self.stream.ptr
        return lambda: c.allGather(s, r, n, t, st)

    def reduce_scatter(self, g, send, recv, redop, in_place):
        c, s, r, n, t, op, st = g.handle, send.data.ptr, recv.data.ptr, recv.size, self._t(recv), _NCCL_OPS[redop], self.stream.ptr
        return lambda: c.reduceScatter(s, r, n, t, op, st)

    def broadcast(self, g, buf, root):
        c, b, n, t, st = g.handle, buf.data.ptr, buf.size, self._t(buf), self.stream.ptr
        return lambda: c.broadcast(b, b, n, t, root, st)

    def broadcast_burst(self, g, buf, spans):
        """Every (start, stop, root) piece of buf broadcast, enqueued one after
        another on the stream (as torch's async broadcasts on NCCL's stream); the
        timer's events wait for all."""
        c, t, st = g.handle, self._t(buf), self.stream.ptr
        pieces = [(buf[a:b].data.ptr, b - a, r) for a, b, r in spans]

        def burst():
            for p, n, r in pieces:
                c.broadcast(p, p, n, t, r, st)
        return burst

    def reduce(self, g, send, recv, redop, root, in_place):
        c, s, r, n, t, op, st = g.handle, send.data.ptr, recv.data.ptr, recv.size, self._t(recv), _NCCL_OPS[redop], self.stream.ptr
        return lambda: c.reduce(s, r, n, t, op, root, st)

    def all_to_all(self, g, send, recv, in_place):
        if in_place:
            raise Unsupported("NCCL all-to-all (grouped send/recv) has no in-place form")
        nccl, c, t, st, n = self.nccl, g.handle, self._t(recv), self.stream.ptr, g.size
        block = recv.size // n
        nbytes = recv.itemsize * block
        s0, r0 = send.data.ptr, recv.data.ptr

        def run():
            nccl.groupStart()
            for peer in range(n):
                c.send(s0 + peer * nbytes, block, t, peer, st)
                c.recv(r0 + peer * nbytes, block, t, peer, st)
            nccl.groupEnd()
        return run

    def send(self, g, buf, peer):
        c, b, n, t, st = g.handle, buf.data.ptr, buf.size, self._t(buf), self.stream.ptr
        return lambda: c.send(b, n, t, peer, st)

    def recv(self, g, buf, peer):
        c, b, n, t, st = g.handle, buf.data.ptr, buf.size, self._t(buf), self.stream.ptr
        return lambda: c.recv(b, n, t, peer, st)

    def send_recv(self, g, send, recv, peer):
        nccl, c, st = self.nccl, g.handle, self.stream.ptr
        s, r, n, t = send.data.ptr, recv.data.ptr, send.size, self._t(send)

        def run():
            nccl.groupStart()
            c.send(s, n, t, peer, st)
            c.recv(r, n, t, peer, st)
            nccl.groupEnd()
        return run

    def barrier(self, g):
        one = self.cupy.zeros(1, dtype=np.float32)
        c, p, st = g.handle, one.data.ptr, self.stream.ptr
        return lambda: c.allReduce(p, p, 1, _NCCL_TYPES["float32"], _NCCL_OPS["sum"], st)

    # --- timing: CUDA events on the communication stream -------------------------------
    def time_iterations(self, op, iters):
        from commbench import timing
        cupy, stream = self.cupy, self.stream
        return timing.event_timer(op, iters, lambda: cupy.cuda.Event(),
                                  cupy.cuda.get_elapsed_time, stream.synchronize,
                                  record=lambda e: e.record(stream))

    def synchronize(self):
        self.cupy.cuda.Device().synchronize()

    # --- control channel over MPI --------------------------------------------------------
    def control_reduce(self, values, op):
        return self.mpi.control_reduce(values, op)

    def control_bcast(self, obj, root=0):
        return self.mpi.control_bcast(obj, root)

    def control_allgather(self, obj):
        return self.mpi.control_allgather(obj)
