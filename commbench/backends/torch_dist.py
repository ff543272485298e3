"""torch.distributed: gloo on CPU, nccl on GPU, mpi where torch was built with it."""
import datetime
import functools
import os

import numpy as np

from commbench import launch as launch_mod
from commbench.backends.base import Backend, Group, Unsupported, check_gpu_per_rank

_TORCH_DTYPES = {
    "float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64",
    "int8": "int8", "uint8": "uint8", "int32": "int32", "int64": "int64",
}


class TorchBackend(Backend):
    in_place_only = ("all_reduce", "broadcast", "reduce")   # torch's API has no out-of-place form

    def __init__(self, launch, device, timeout_s, dist_backend: str | None = None):
        super().__init__(launch, device, timeout_s)
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA device is visible to torch")
            if (dist_backend or "nccl") == "nccl":
                check_gpu_per_rank(launch.local_world_size, torch.cuda.device_count(), "--device cuda")
            self.torch_device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.torch_device)
        else:
            self.torch_device = torch.device("cpu")
        pg = dist_backend or ("nccl" if device == "cuda" else "gloo")
        if pg == "mpi" and not dist.is_mpi_available():
            raise ValueError("--dist-backend mpi: this torch was built without MPI support")
        if pg == "nccl" and device != "cuda":
            raise ValueError("--dist-backend nccl needs --device cuda")
        self.name = f"torch-{pg}"
        self.pg_name = pg
        timeout = datetime.timedelta(seconds=timeout_s)
        if pg == "mpi":
            dist.init_process_group("mpi", timeout=timeout)
        else:
            addr, port = launch_mod.rendezvous(launch)
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
            kwargs = {"device_id": self.torch_device} if pg == "nccl" else {}
            dist.init_process_group(pg, init_method=f"tcp://{addr}:{port}", rank=launch.rank,
                                    world_size=launch.world_size, timeout=timeout, **kwargs)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # harness exchanges go over gloo on host tensors, whatever the measured backend
        self.control = dist.group.WORLD if pg == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        self._redops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                        "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}
        # torch 2.13 renames the tensor collectives *_single; older releases have the old names
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def new_groups(self, groups):
        groups = [tuple(g) for g in groups]
        mine = next((g for g in groups if self.rank in g), None)
        if mine is not None and len(groups) == 1 and len(mine) == self.world_size:
            handle = self.dist.group.WORLD
        else:
            handle, _ = self.dist.new_subgroups_by_enumeration([list(g) for g in groups],
                                                               timeout=datetime.timedelta(seconds=self.timeout_s))
        if mine is None:
            return None
        return Group(ranks=mine, rank=mine.index(self.rank), handle=handle)

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def check_supported(self, op, dtype, redop, in_place):
        if dtype not in _TORCH_DTYPES:
            raise Unsupported(f"torch.distributed has no {dtype} collectives")
        if redop == "avg" and self.pg_name != "nccl" and dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise Unsupported(f"{self.name} averages floating-point types only")
        if redop == "avg" and self.pg_name == "mpi":
            raise Unsupported("torch-mpi has no AVG reduction")
        if op == "all_to_all" and in_place:
            raise Unsupported("torch all_to_all_single has no in-place form")

    # --- buffers --------------------------------------------------------------
    def empty(self, count, dtype):
        return self.torch.zeros(count, dtype=getattr(self.torch, _TORCH_DTYPES[dtype]), device=self.torch_device)

    def upload(self, buf, values):
        buf.copy_(self.torch.from_numpy(np.ascontiguousarray(values)))

    def download(self, buf):
        return buf.detach().to("cpu", self.torch.float64).numpy()

    def view(self, buf, start, count):
        return buf.narrow(0, start, count)

    # --- primitives --------------------------------------------------------------
    def _global(self, g, group_rank):
        return g.ranks[group_rank]

    def all_reduce(self, g, send, recv, redop, in_place):
        return functools.partial(self.dist.all_reduce, recv, op=self._redops[redop], group=g.handle)

    def all_gather(self, g, send, recv, in_place):
        return functools.partial(self._all_gather, recv, send, group=g.handle)

    def reduce_scatter(self, g, send, recv, redop, in_place):
        return functools.partial(self._reduce_scatter, recv, send, op=self._redops[redop], group=g.handle)

    def broadcast(self, g, buf, root):
        return functools.partial(self.dist.broadcast, buf, src=self._global(g, root), group=g.handle)

    def broadcast_burst(self, g, buf, spans):
        """Every (start, stop, root) piece of buf broadcast async, then every work waited for."""
        dist, pieces = self.dist, [(self.view(buf, a, b - a), self._global(g, r)) for a, b, r in spans]

        def burst():
            for work in [dist.broadcast(v, src=src, group=g.handle, async_op=True) for v, src in pieces]:
                work.wait()
        return burst

    def reduce(self, g, send, recv, redop, root, in_place):
        return functools.partial(self.dist.reduce, recv, dst=self._global(g, root),
                                 op=self._redops[redop], group=g.handle)

    def all_to_all(self, g, send, recv, in_place):
        return functools.partial(self.dist.all_to_all_single, recv, send, group=g.handle)

    def send(self, g, buf, peer):
        return functools.partial(self.dist.send, buf, dst=self._global(g, peer), group=g.handle)

    def recv(self, g, buf, peer):
        return functools.partial(self.dist.recv, buf, src=self._global(g, peer), group=g.handle)

    def send_recv(self, g, send, recv, peer):
        dist, dst = self.dist, self._global(g, peer)
        ops = [dist.P2POp(dist.isend, send, dst, g.handle), dist.P2POp(dist.irecv, recv, dst, g.handle)]

        def exchange():
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return exchange

    def barrier(self, g):
        if self.pg_name == "nccl":
            # NCCL's barrier is an all-reduce of one element; time exactly that on the stream
            one = self.torch.zeros(1, device=self.torch_device)
            return functools.partial(self.dist.all_reduce, one, group=g.handle)
        return functools.partial(self.dist.barrier, group=g.handle)

    # --- timing -----------------------------------------------------------------
    def time_iterations(self, op, iters):
        from commbench import timing
        if self.device == "cuda":
            torch = self.torch
            return timing.event_timer(op, iters, lambda: torch.cuda.Event(enable_timing=True),
                                      lambda a, b: a.elapsed_time(b), torch.cuda.synchronize)
        return timing.host_timer(op, iters)

    def synchronize(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    # --- control channel -----------------------------------------------------------
    def control_reduce(self, values, op):
        t = self.torch.from_numpy(np.array(values, dtype=np.float64))
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM,
                             group=self.control)
        return t.numpy()

    def control_bcast(self, obj, root=0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=root, group=self.control)
        return box[0]

    def control_allgather(self, obj):
        out = [None] * self.world_size
        self.dist.all_gather_object(out, obj, group=self.control)
        return out
