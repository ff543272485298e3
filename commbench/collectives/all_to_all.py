import numpy as np

from commbench.collectives.base import Collective, Prepared, values


class AllToAll(Collective):
    name = "all_to_all"

    def counts(self, nbytes, n, itemsize):
        per_peer = max(1, nbytes // (itemsize * n))
        return per_peer * n, per_peer * n   # S = all bytes a rank sends

    def busbw_factor(self, n):
        # the block a rank keeps for itself (1/n) crosses no link
        return (n - 1) / n

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        sbuf = backend.empty(send, dtype)
        rbuf = sbuf if in_place else backend.empty(recv, dtype)
        block, me = send // g.size, g.rank

        def expected(a, b):
            j = np.arange(a, b)     # block j // block of my output is block `me` of that rank's input
            return ((7 * (j // block) + 3 * (me * block + j % block)) % 11 + 1).astype(np.float64)
        return Prepared(op=backend.all_to_all(g, sbuf, rbuf, in_place),
                        input=sbuf, input_values=values(g.rank, np.arange(send), g.size, None),
                        output=rbuf, expected=expected)
