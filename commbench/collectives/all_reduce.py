import numpy as np

from commbench.collectives.base import Collective, Prepared, reduction_table, values


class AllReduce(Collective):
    name = "all_reduce"
    has_redop = True

    def busbw_factor(self, n):
        # each rank must send and receive 2(n-1)/n of the buffer (reduce-scatter
        # then all-gather): the bus bandwidth that time implies (nccl-tests)
        return 2.0 * (n - 1) / n

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        sbuf = backend.empty(send, dtype)
        rbuf = sbuf if in_place else backend.empty(recv, dtype)
        table = reduction_table(g.size, redop)
        return Prepared(op=backend.all_reduce(g, sbuf, rbuf, redop, in_place),
                        input=sbuf, input_values=values(g.rank, np.arange(send), g.size, redop),
                        output=rbuf, expected=lambda a, b: table[np.arange(a, b) % 11])
