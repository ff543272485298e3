"""DESIGN.md's busbw table, written out independently of commbench's code, so
the tests check commbench against the definitions rather than against itself."""
import numpy as np


def expected_bandwidths(op: str, nbytes: int, n: int, samples):
    t = float(np.median(samples))
    if op == "barrier":
        return None, None
    algbw = nbytes / t / 1e9
    if op == "send_recv_bidir":
        algbw = 2 * nbytes / t / 1e9         # both directions together (osu_bibw)
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0, "reduce": 1.0, "send_recv": 1.0, "send_recv_bidir": 1.0,
    }[op]
    return algbw, algbw * factor


def expected_nbytes(op: str, requested: int, n: int, itemsize: int) -> int:
    """S of the busbw table for a requested size, rounded down to whole elements
    per rank (at least one)."""
    if op == "barrier":
        return 0
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return max(1, requested // (itemsize * n)) * n * itemsize
    return max(1, requested // itemsize) * itemsize
