import numpy as np

from commbench.collectives.base import Collective, Prepared, values


class Broadcast(Collective):
    name = "broadcast"
    has_root = True
    single_buffer = True
    # busbw = algbw: the root's buffer crosses each link once (pipelined ring)

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        buf = backend.empty(recv, dtype)
        root_values = values(root, np.arange(recv), g.size, None)
        return Prepared(op=backend.broadcast(g, buf, root), input=buf,
                        input_values=root_values if g.rank == root else np.zeros(recv),
                        output=buf, expected=lambda a, b: root_values[a:b])
