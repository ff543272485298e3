"""Compute at a plan's shapes: the ComputeOps of a step (ops.py) and the timed
kernels that run them (gemm, attention, elementwise, optimizer)."""
from commbench.compute import attention, elementwise, gemm, optimizer

KERNELS = {**gemm.PREPARE, **attention.PREPARE, **elementwise.PREPARE, **optimizer.PREPARE}
