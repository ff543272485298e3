"""Compute at a plan's shapes: the ComputeOps of a step (ops.py) and the timed
kernels that run them (gemm, attention, elementwise, optimizer, whole modules; imported only
when timing, as they import torch)."""


def kernels() -> dict:
    """impl name -> prepare(op, device, torch dtype) -> a callable running one call."""
    from commbench.compute import attention, elementwise, framework, fsdp_stage, gemm, modules, optimizer, tp_stage
    return {**gemm.PREPARE, **attention.PREPARE, **elementwise.PREPARE, **optimizer.PREPARE, **modules.PREPARE,
            **framework.PREPARE, **tp_stage.PREPARE, **fsdp_stage.PREPARE}


def plan_groups(groups: list):
    """This rank's process group of a partition of the job's ranks (collective:
    every rank calls it with the same groups), made as the training steps'
    DeviceMesh makes a mesh dimension's: the default group where one group
    holds every rank, else a new group each. The same ranks in a new gloo
    group are not the same group to time: a tiny-gpt TP micro-batch over a
    new group of both ranks took 32.6 ms against 28.5 over the default group
    (benchmarks/tp_group.py)."""
    import torch.distributed as dist
    if len(groups) == 1 and len(groups[0]) == dist.get_world_size():
        return dist.group.WORLD
    group, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return group


class Staged:
    """A call timed between untimed steps of its own, every time, as a training
    step runs it: a backward after a fresh forward (the graph it frees and the
    gradients it accumulates are part of its time), a forward followed by its
    backward (which frees the graph and leaves the caches as the next
    micro-batch's forward finds them). Called as a whole (warmup), it runs all."""

    def __init__(self, before, timed, after=None):
        self.before, self.timed, self.after = before, timed, after

    def __call__(self):
        if self.before:
            self.before()
        self.timed()
        if self.after:
            self.after()
