"""The shared harness of every collective: deterministic inputs, the exact
expected outputs, and the check. A collective file says how big its buffers are,
how its busbw is defined, which backend primitive it calls and what each rank
must end up with.

Inputs: rank r's element i is v(r, i) = (7r + 3i) mod 11 + 1, small integers that
every dtype holds exactly. For prod, v(r, i) = 2 where i mod n = r, else 1, so the
product is exactly 2 however many ranks there are. Because v(., i) depends only on
r mod 11 and i mod 11, the reduction over n ranks of element i depends only on
i mod 11: an 11-entry table gives the expected value of any element, at any size,
without materializing n input arrays."""
from dataclasses import dataclass

import numpy as np

from commbench.dtypes import DTYPES, wrap_to

CHECK_CHUNK = 1 << 22   # elements compared at once: bounds the check's host memory


def values(rank: int, idx: np.ndarray, n: int, redop: str | None) -> np.ndarray:
    if redop == "prod":
        return np.where(idx % n == rank, 2.0, 1.0)
    return ((7 * rank + 3 * idx) % 11 + 1).astype(np.float64)


def reduction_table(n: int, redop: str) -> np.ndarray:
    """Expected reduction over ranks 0..n-1 of element i, for i mod 11 = 0..10."""
    if redop == "prod":
        return np.full(11, 2.0)
    ranks = np.arange(min(n, 11))[:, None]
    per_rank = (7 * ranks + 3 * np.arange(11)[None, :]) % 11 + 1
    if redop in ("sum", "avg"):
        full, part = divmod(n, 11)
        # every full cycle of 11 ranks contributes each residue once: 1 + ... + 11 = 66
        total = 66.0 * full + ((7 * np.arange(part)[:, None] + 3 * np.arange(11)[None, :]) % 11 + 1).sum(axis=0)
        return total / n if redop == "avg" else total
    if redop == "max":
        return per_rank.max(axis=0).astype(np.float64)
    if redop == "min":
        return per_rank.min(axis=0).astype(np.float64)
    raise ValueError(f"unknown reduction op {redop!r}")


@dataclass
class Prepared:
    """A case ready to run on this rank."""
    op: object                   # zero-argument callable: one collective
    input: object = None         # buffer holding this rank's input (may be part of output)
    input_values: object = None  # what reset() puts into input
    output: object = None        # buffer this rank checks, or None
    expected: object = None      # f(start, stop) -> expected float64 values of output[start:stop]

    def reset(self, backend, corrupt: bool = False):
        """Clear the output, then fill the input (which may lie inside the output).
        corrupt changes the first input element: the fault the check must catch."""
        if self.output is not None and self.output is not self.input:
            backend.upload(self.output, np.zeros(_length(self.output)))
        if self.input is not None:
            vals = self.input_values
            if corrupt:
                vals = vals.copy()
                vals[0] += 1
            backend.upload(self.input, vals)


def _length(buf) -> int:
    return buf.numel() if hasattr(buf, "numel") else buf.size


class Collective:
    name = ""
    has_redop = False
    has_root = False
    min_group = 1
    single_buffer = False    # one buffer is input and output on every backend: always in place
    has_in_place = True      # False: no in-place form (point-to-point, barrier): always out of place

    def counts(self, nbytes: int, n: int, itemsize: int) -> tuple[int, int]:
        """(send, recv) element counts for a requested size, rounded down to whole
        elements (and to a multiple of n where the buffer splits across ranks),
        at least one element per rank."""
        c = max(1, nbytes // itemsize)
        return c, c

    def size_bytes(self, send: int, recv: int, itemsize: int, n: int) -> int:
        """S of DESIGN.md's busbw table."""
        return recv * itemsize

    def algbw_gbps(self, nbytes: int, time_s: float) -> float | None:
        return nbytes / time_s / 1e9

    def busbw_factor(self, n: int) -> float:
        return 1.0

    def prepare(self, backend, g, dtype: str, send: int, recv: int, redop, in_place: bool, root: int = 0) -> Prepared:
        raise NotImplementedError


def num_wrong(backend, prepared: Prepared, dtype: str, n: int, redop) -> int:
    """Elements of this rank's output that differ from the exact expected values
    beyond the rounding that summing n values in this dtype can introduce."""
    if prepared.output is None:
        return 0
    dt = DTYPES[dtype]
    got_all = backend.download(prepared.output)
    wrong = 0
    for start in range(0, len(got_all), CHECK_CHUNK):
        stop = min(start + CHECK_CHUNK, len(got_all))
        want = wrap_to(prepared.expected(start, stop), dt)
        got = got_all[start:stop]
        # a sum of n terms rounded at each step is within n ulps of the exact sum
        tol = dt.eps * max(n, 1) * np.abs(want) if dt.is_float else 0.0
        wrong += int(np.count_nonzero(~(np.abs(got - want) <= tol)))
    return wrong
