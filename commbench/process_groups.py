"""The torch process groups a phase of a job makes, destroyed when the phase
ends. Each gloo group holds 3 threads and about 5 sockets on every member rank,
and an NCCL group holds a communicator and its buffers. Without this,
`validate --rounds 3` at pp 2 x dp 2 on 4 gloo ranks made 14 groups a round and
freed none: each rank grew from 49 threads and 83 fds after round 1 to 133
threads and 211-217 fds after round 3.

scope(): every group created inside it (by commbench, a DeviceMesh, DDP or
FSDP) is destroyed at its end, except the default group and the groups that
existed before it. cached(key, make): a group made once per scope and shared by
the scope's timed ops."""
import contextlib
import gc

_CACHE = {}         # key -> this rank's group, made inside the scope now open


def _alive() -> list:
    from torch.distributed import distributed_c10d
    return list(distributed_c10d._world.pg_map)


@contextlib.contextmanager
def scope():
    """Run a phase; then destroy the groups it made (a collective exit: every
    rank of the job enters and leaves the same scopes in the same order).
    Nothing is destroyed when the phase raises: the job is ending, and shutting
    down a group whose peer is gone can hang."""
    import torch.distributed as dist
    if not dist.is_initialized():
        yield
        return
    before, keys = set(_alive()), set(_CACHE)
    yield
    for key in set(_CACHE) - keys:
        del _CACHE[key]
    gc.collect()        # drop the models and optimizers that hold the groups
    made = [pg for pg in _alive() if pg not in before]
    if made:
        dist.barrier()  # every rank is done with them before any member closes its sockets
        for pg in reversed(made):
            dist.destroy_process_group(pg)
        forget_meshes()


def forget_meshes():
    """Clear DTensor's caches of sharding decisions. They are keyed by
    DeviceMesh, whose equality is its ranks and dimension names, not its
    groups: a later phase's mesh of the same shape would be handed a cached
    decision holding an earlier phase's mesh, whose destroyed groups its
    collectives then look up by name ('Could not resolve the process group
    registered under the name 7', validate of TP x PP on 4 ranks). Private
    torch functions, each cleared where this torch has it."""
    import sys
    if "torch.distributed.tensor" not in sys.modules:
        return
    import importlib
    for module, name in (("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
                         ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
                         ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear")):
        try:
            fn = importlib.import_module(module)
            for part in name.split("."):
                fn = getattr(fn, part)
        except (ImportError, AttributeError):
            continue
        fn()


def cached(key, make):
    """The group cached under key, made by make() on first use (make is
    collective when the group is new: every rank asks in the same order)."""
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


def lookup(key):
    """The group cached under key, or None."""
    return _CACHE.get(key)
