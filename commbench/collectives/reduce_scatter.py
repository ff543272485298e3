import numpy as np

from commbench.collectives.base import Collective, Prepared, reduction_table, values


class ReduceScatter(Collective):
    name = "reduce_scatter"
    has_redop = True

    def counts(self, nbytes, n, itemsize):
        per_rank = max(1, nbytes // (itemsize * n))
        return per_rank * n, per_rank

    def size_bytes(self, send, recv, itemsize, n):
        return send * itemsize   # S is the total input

    def busbw_factor(self, n):
        # each rank sends the (n-1)/n of its input that the others reduce
        return (n - 1) / n

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        sbuf = backend.empty(send, dtype)
        rbuf = backend.view(sbuf, g.rank * recv, recv) if in_place else backend.empty(recv, dtype)
        table = reduction_table(g.size, redop)
        offset = g.rank * recv
        return Prepared(op=backend.reduce_scatter(g, sbuf, rbuf, redop, in_place),
                        input=sbuf, input_values=values(g.rank, np.arange(send), g.size, redop),
                        output=rbuf, expected=lambda a, b: table[(offset + np.arange(a, b)) % 11])
