"""process_groups.scope: the process groups a phase makes are destroyed at its
end, on every rank, a later phase's DeviceMesh of the same shape runs its
DTensor collectives over its own groups, and a validation's rounds do not pile
them up."""
import json
import os
import subprocess

import torch.distributed as dist
from torch.distributed import distributed_c10d

from conftest import BIN, ROOT, clean_env
from traffic import _context, _free_port


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _names():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


def _rank(rank, world, port, queue, checks="_scope_checks"):
    import traceback
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        globals()[checks](world)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def _scope_checks(world):
    import gc

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from commbench import process_groups
    # the process's first new group starts 3 threads that stay (torch 2.13,
    # gloo) whatever becomes of the group: made and destroyed once before counting
    with process_groups.scope():
        dist.all_reduce(torch.ones(2), group=dist.new_group(list(range(world))))
    gc.collect()
    before, threads = set(distributed_c10d._world.pg_map), _threads()
    with process_groups.scope():
        mine = dist.new_subgroups_by_enumeration([[r] for r in range(world)])[0]
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
        shared = process_groups.cached("k", lambda: dist.new_group(list(range(world))))
        assert process_groups.cached("k", lambda: 1 / 0) is shared      # made once
        t = torch.ones(4)
        dist.all_reduce(t, group=shared)
        dist.all_reduce(t, group=mesh["dp"].get_group())
        assert t.tolist() == [world * world] * 4
        assert len(distributed_c10d._world.pg_map) > len(before) and _threads() > threads
    del mine, mesh, shared
    gc.collect()
    assert set(distributed_c10d._world.pg_map) == before, "the scope's groups outlived it"
    assert process_groups.lookup("k") is None
    assert _threads() == threads, f"the scope's groups left threads behind: {threads} -> {_threads()} {_names()}"
    t = torch.ones(2)
    dist.all_reduce(t)                                   # the default group is untouched
    assert t.tolist() == [world] * 2
    # a phase that raises keeps its groups: the job ends, and a peer may be gone
    try:
        with process_groups.scope():
            dist.new_group(list(range(world)))
            raise KeyError("phase failed")
    except KeyError:
        pass
    assert len(distributed_c10d._world.pg_map) == len(before) + 1


def _mesh_checks(world):
    """The same DTensor reduction in two phases, each over a DeviceMesh of a new
    group of the same ranks: equal meshes to DTensor's caches, which the second
    phase must not be handed with the first phase's destroyed group."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from commbench import process_groups
    for phase in range(2):
        with process_groups.scope():
            mesh = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
            x = distribute_tensor(torch.arange(4.0 * world).reshape(2 * world, 2), mesh, [Shard(0)])
            total = x.sum().full_tensor()       # Partial -> Replicate: an all-reduce over the mesh's group
            assert total.item() == sum(range(4 * world)), (phase, total)
            del mesh, x, total


def _run(world, checks):
    ctx = _context()
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, queue, checks)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        errors = [queue.get(timeout=120) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [e for _, e in errors if e] == []


def test_a_later_phases_mesh_of_the_same_shape_uses_its_own_groups():
    _run(2, "_mesh_checks")


def test_scope_destroys_the_groups_it_made_and_only_those():
    _run(2, "_scope_checks")


def test_validation_rounds_do_not_pile_up_groups(tmp_path):
    """3 rounds of validate at pp 2 on 2 ranks: the live groups, threads and
    open files after round 3 are those after round 1, and only the default
    group outlives a round (before the fix: 14 more groups, 42 more threads
    and 67 more fds per round at pp 2 x dp 2 on 4 ranks)."""
    p = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", "2", str(ROOT / "tests" / "rounds_probe.py"),
                        str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=clean_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    for rank in (0, 1):
        rounds = [x for x in lines if x["rank"] == rank]
        assert len(rounds) == 3
        assert [r["groups"] for r in rounds] == [1, 1, 1]
        assert rounds[2]["threads"] == rounds[0]["threads"]
        assert abs(rounds[2]["fds"] - rounds[0]["fds"]) <= 2
