"""Record the collectives a real torch run issues: each rank runs `fn(rank,
world, *args)` under torch.profiler(record_shapes=True) over gloo, and the
c10d:: and gloo: events it issued come back in order, per rank. The profiler
sees the all-reduces that DDP's C++ reducer issues too, which never pass through
Python's torch.distributed functions."""
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        setup = fn(rank, world, *args)           # returns a callable: the part to record
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            setup()
        events = [(e.name, [list(s) for s in e.input_shapes]) for e in prof.events()
                  if e.name.startswith(("c10d::", "gloo:"))]
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, events, None))
    except Exception:
        queue.put((rank, None, traceback.format_exc()))


_CTX = None


def _context():
    """A forkserver that has imported torch, its profiler and the model builder
    once: each rank forks from it instead of paying those imports (seconds per
    rank, mostly the profiler's) again, and forks from a process that never ran
    a torch kernel (no OpenMP pool to inherit)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.profiler", "torch._dynamo",
                                     "commbench.torch_model", "traffic"])
    return _CTX


def record(fn, world: int, *args, timeout_s: float = 180.0) -> list:
    """Per rank, the list of (event name, input shapes) recorded while the callable
    that fn(rank, world, *args) returned ran. fn must be a module-level function."""
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out, errors = [None] * world, []
    try:
        for _ in range(world):
            rank, events, err = queue.get(timeout=timeout_s)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            out[rank] = events
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return out


MARKER = "c10d::commbench_marker"


def marked(steps):
    """One callable running each step under its own profiler range `MARKER i`
    (the c10d:: prefix passes record()'s filter): one recording, several cases."""
    from torch.autograd.profiler import record_function

    def run():
        for i, step in enumerate(steps):
            with record_function(f"{MARKER} {i}"):
                step()
    return run


def gloo_ops(events) -> list:
    """The backend-level operations, as (op, numel of the first input): e.g.
    ('all_reduce', 236928). On gloo a reduce_scatter shows as an all_reduce of
    the whole input nested in c10d::_reduce_scatter_base_."""
    out = []
    for name, shapes in events:
        if name.startswith("gloo:"):
            numel = 1
            for d in (shapes[0] if shapes and shapes[0] else []):
                numel *= d
            out.append((name[len("gloo:"):], numel if shapes and shapes[0] else 0))
    return out
