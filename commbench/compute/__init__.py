"""Compute at a plan's shapes: the ComputeOps of a step (ops.py) and the timed
kernels that run them (gemm, attention, elementwise, optimizer, whole modules; imported only
when timing, as they import torch)."""


def kernels() -> dict:
    """impl name -> prepare(op, device, torch dtype) -> a callable running one call."""
    from commbench.compute import attention, elementwise, framework, gemm, modules, optimizer, tp_stage
    return {**gemm.PREPARE, **attention.PREPARE, **elementwise.PREPARE, **optimizer.PREPARE, **modules.PREPARE,
            **framework.PREPARE, **tp_stage.PREPARE}


class Staged:
    """A call timed after an untimed set-up of its own, every time: a backward
    pass after a fresh forward (the graph it frees and the gradients it
    accumulates are part of its time, as in a training step). Called as a
    whole (warmup), it runs both."""

    def __init__(self, before, timed):
        self.before, self.timed = before, timed

    def __call__(self):
        self.before()
        self.timed()
