"""Compute at a plan's shapes: the ComputeOps of a step (ops.py) and the timed
kernels that run them (gemm, attention, elementwise, optimizer, whole modules; imported only
when timing, as they import torch)."""


def kernels() -> dict:
    """impl name -> prepare(op, device, torch dtype) -> a callable running one call."""
    from commbench.compute import attention, elementwise, framework, gemm, modules, optimizer, tp_stage
    return {**gemm.PREPARE, **attention.PREPARE, **elementwise.PREPARE, **optimizer.PREPARE, **modules.PREPARE,
            **framework.PREPARE, **tp_stage.PREPARE}
