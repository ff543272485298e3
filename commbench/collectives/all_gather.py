import numpy as np

from commbench.collectives.base import Collective, Prepared, values


class AllGather(Collective):
    name = "all_gather"

    def counts(self, nbytes, n, itemsize):
        per_rank = max(1, nbytes // (itemsize * n))
        return per_rank, per_rank * n

    def busbw_factor(self, n):
        # S is the gathered output; each rank receives the (n-1)/n it lacks
        return (n - 1) / n

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        rbuf = backend.empty(recv, dtype)
        sbuf = backend.view(rbuf, g.rank * send, send) if in_place else backend.empty(send, dtype)

        def expected(a, b):
            j = np.arange(a, b)     # element j of the output is element j % send of rank j // send
            return ((7 * (j // send) + 3 * (j % send)) % 11 + 1).astype(np.float64)
        return Prepared(op=backend.all_gather(g, sbuf, rbuf, in_place),
                        input=sbuf, input_values=values(g.rank, np.arange(send), g.size, None),
                        output=rbuf, expected=expected)
