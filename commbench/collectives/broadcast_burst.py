"""Many broadcasts issued together and waited for together, as torch's
ZeroRedundancyOptimizer publishes its updated parameters (`_sync_params`: one
async broadcast per parameter from its owner, then a wait on every handle).
Timing them one by one and adding up misses what issuing them together does:
on gloo the queued works cost more than the same broadcasts in series
(benchmarks/zero1_broadcasts.py), on a GPU stream their launches overlap.

Not a sweep collective (it has no single size): `run --plan` measures one per
burst of the plan (sweep.plan_cases). The broadcasts are contiguous pieces of
one flat buffer, each from its own root; S = the total bytes, busbw = algbw
as for broadcast."""
import bisect

import numpy as np

from commbench.collectives.base import Collective, Prepared, values


class BroadcastBurst(Collective):
    name = "broadcast_burst"
    has_in_place = False
    single_buffer = True

    def __init__(self, pieces):
        """pieces: ((root group rank, nbytes), ...) in issue order."""
        self.pieces = tuple((int(r), int(b)) for r, b in pieces)

    def counts(self, nbytes: int, n: int, itemsize: int) -> tuple[int, int]:
        c = sum(max(1, b // itemsize) for _, b in self.pieces)
        return c, c

    def case_params(self) -> dict:
        return {"broadcasts": len(self.pieces), "roots": sorted({r for r, _ in self.pieces})}

    def spans(self, itemsize: int) -> list:
        """(start, stop, root) element ranges of the flat buffer, in issue order."""
        out, at = [], 0
        for root, nbytes in self.pieces:
            c = max(1, nbytes // itemsize)
            out.append((at, at + c, root))
            at += c
        return out

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        from commbench.dtypes import DTYPES
        spans = self.spans(DTYPES[dtype].itemsize)
        starts = [a for a, _, _ in spans]
        buf = backend.empty(recv, dtype)
        mine = np.zeros(recv)
        for a, b, r in spans:
            if r == g.rank:
                mine[a:b] = values(r, np.arange(a, b), g.size, None)

        def expected(lo, hi):
            """Every piece holds its root's values once the burst is done."""
            out = np.empty(hi - lo)
            for a, b, r in spans[max(0, bisect.bisect_right(starts, lo) - 1):]:
                if a >= hi:
                    break
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    out[a - lo:b - lo] = values(r, np.arange(a, b), g.size, None)
            return out
        return Prepared(op=backend.broadcast_burst(g, buf, spans), input=buf, input_values=mine,
                        output=buf, expected=expected)


def zero1_bursts(comm_ops) -> dict:
    """{stage: BroadcastBurst} of a plan's once-per-step data-parallel broadcasts
    (ZeRO-1's parameter publication), for the stages that issue more than one."""
    by_stage = {}
    for c in comm_ops:
        if c.axis == "dp" and c.phase == "step" and c.collective == "broadcast" and c.root >= 0:
            by_stage.setdefault(c.stage, []).extend([(c.root, c.nbytes)] * c.count)
    return {s: BroadcastBurst(p) for s, p in by_stage.items() if len(p) > 1}
