"""What every backend provides: process-group set-up, buffers, the collective
primitives (each returns a zero-argument callable, bound once, so the timed loop
only calls it), a timer, and a control channel for the harness's own exchanges
(outside the timed region)."""
from dataclasses import dataclass

import numpy as np


class Unsupported(Exception):
    """The backend lacks this op / dtype / redop: the Case is recorded as skipped."""


@dataclass
class Group:
    ranks: tuple          # global ranks, sorted; group rank = index
    rank: int             # this process's rank in the group
    handle: object        # the backend's communicator / process group

    @property
    def size(self) -> int:
        return len(self.ranks)


def check_gpu_per_rank(ranks_on_host: int, gpus: int, what: str):
    """NCCL puts each rank of a communicator on a GPU of its own: a host with
    more ranks than visible GPUs fails in NCCL's set-up ("Duplicate GPU
    detected"), so say it first, in one line."""
    if ranks_on_host > gpus:
        raise ValueError(f"{what}: {ranks_on_host} ranks on this host and {gpus} GPU(s) visible; NCCL needs a "
                         f"GPU of its own for each rank (start at most {gpus} rank(s) per host, or check "
                         "CUDA_VISIBLE_DEVICES)")


class Backend:
    name = "base"           # stored in Case.backend
    in_place_only = ()      # collectives this backend can only run in place

    def __init__(self, launch, device: str, timeout_s: float):
        self.launch = launch
        self.device = device
        self.timeout_s = timeout_s

    # --- set-up -----------------------------------------------------------
    rank: int
    world_size: int

    def new_groups(self, groups) -> Group:
        """Create every group of a layout (a collective call over the world);
        return the one this rank belongs to, or None if it is in none (it idles)."""
        raise NotImplementedError

    def close(self):
        pass

    # --- capability ---------------------------------------------------------
    def check_supported(self, op: str, dtype: str, redop: str | None, in_place: bool):
        """Raise Unsupported with the reason if this backend cannot run the case."""

    # --- buffers ------------------------------------------------------------
    def empty(self, count: int, dtype: str):
        raise NotImplementedError

    def upload(self, buf, values: np.ndarray):
        """Copy host values (float64/int64 numpy) into buf, converting the dtype."""
        raise NotImplementedError

    def download(self, buf) -> np.ndarray:
        """buf as a float64 numpy array."""
        raise NotImplementedError

    def view(self, buf, start: int, count: int):
        raise NotImplementedError

    # --- primitives: each returns a callable running one op -------------------
    # In place, send is the part of recv that holds this rank's input (all_gather),
    # recv the part of send that receives this rank's output (reduce_scatter), or
    # send is recv (the others); a backend with an in-place form uses it.
    def all_reduce(self, g, send, recv, redop, in_place): raise Unsupported("all_reduce")
    def all_gather(self, g, send, recv, in_place): raise Unsupported("all_gather")
    def reduce_scatter(self, g, send, recv, redop, in_place): raise Unsupported("reduce_scatter")
    def broadcast(self, g, buf, root): raise Unsupported("broadcast")
    def broadcast_burst(self, g, buf, spans): raise Unsupported("broadcast_burst")
    def reduce(self, g, send, recv, redop, root, in_place): raise Unsupported("reduce")
    def all_to_all(self, g, send, recv, in_place): raise Unsupported("all_to_all")
    def send(self, g, buf, peer): raise Unsupported("send")
    def recv(self, g, buf, peer): raise Unsupported("recv")
    def send_recv(self, g, send, recv, peer): raise Unsupported("send_recv")
    def barrier(self, g): raise Unsupported("barrier")

    # --- timing -------------------------------------------------------------
    def time_iterations(self, op, iters: int) -> list:
        """Seconds of each of iters back-to-back calls of op."""
        raise NotImplementedError

    def synchronize(self):
        pass

    # --- control channel (world, host objects) --------------------------------
    def control_reduce(self, values: np.ndarray, op: str) -> np.ndarray:
        """Element-wise max or sum of a float64 array over all ranks, on all ranks."""
        raise NotImplementedError

    def control_bcast(self, obj, root: int = 0):
        raise NotImplementedError

    def control_allgather(self, obj) -> list:
        raise NotImplementedError

    def control_barrier(self):
        self.control_reduce(np.zeros(1), "sum")
