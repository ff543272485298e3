import numpy as np

from commbench.collectives.base import Collective, Prepared, reduction_table, values


class Reduce(Collective):
    name = "reduce"
    has_redop = True
    has_root = True
    # busbw = algbw: every rank's buffer reaches the root once (pipelined ring)

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        sbuf = backend.empty(send, dtype)
        rbuf = sbuf if in_place else backend.empty(recv, dtype)
        table = reduction_table(g.size, redop)
        return Prepared(op=backend.reduce(g, sbuf, rbuf, redop, root, in_place),
                        input=sbuf, input_values=values(g.rank, np.arange(send), g.size, redop),
                        output=rbuf if g.rank == root else None,
                        expected=lambda a, b: table[np.arange(a, b) % 11])
