from commbench.collectives.base import Collective, Prepared


class Barrier(Collective):
    """Latency only: no payload, so no bandwidth."""
    name = "barrier"
    has_in_place = False

    def counts(self, nbytes, n, itemsize):
        return 0, 0

    def algbw_gbps(self, nbytes, time_s):
        return None

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        return Prepared(op=backend.barrier(g))
