"""Pairwise point-to-point: in a group of g ranks, rank k pairs with k + g/2 (so
on the world of two nodes every pair crosses the network, and in intra-node
groups every pair stays inside a node); with g odd the last rank sits out."""
import numpy as np

from commbench.collectives.base import Collective, Prepared, values


def peer_of(rank: int, size: int) -> int | None:
    half = size // 2
    if rank < half:
        return rank + half
    if rank < 2 * half:
        return rank - half
    return None


class SendRecv(Collective):
    """Unidirectional: the lower rank of each pair sends, the upper one receives.
    busbw = algbw = S / t (OSU osu_bw's quantity, one message at a time)."""
    name = "send_recv"
    has_in_place = False
    min_group = 2

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        peer = peer_of(g.rank, g.size)
        buf = backend.empty(send, dtype)
        if peer is None:
            return Prepared(op=lambda: None)
        sent = values(min(g.rank, peer), np.arange(send), g.size, None)
        if g.rank < peer:
            return Prepared(op=backend.send(g, buf, peer), input=buf, input_values=sent)
        return Prepared(op=backend.recv(g, buf, peer), output=buf, expected=lambda a, b: sent[a:b])


class SendRecvBidir(Collective):
    """Bidirectional: both ranks of a pair send and receive S at once. Both
    directions are reported together, as OSU osu_bibw: algbw = busbw = 2 S / t."""
    name = "send_recv_bidir"
    has_in_place = False
    min_group = 2

    def algbw_gbps(self, nbytes, time_s):
        return 2 * nbytes / time_s / 1e9

    def prepare(self, backend, g, dtype, send, recv, redop, in_place, root=0):
        peer = peer_of(g.rank, g.size)
        sbuf, rbuf = backend.empty(send, dtype), backend.empty(recv, dtype)
        if peer is None:
            return Prepared(op=lambda: None)
        theirs = values(peer, np.arange(recv), g.size, None)
        return Prepared(op=backend.send_recv(g, sbuf, rbuf, peer), input=sbuf,
                        input_values=values(g.rank, np.arange(send), g.size, None),
                        output=rbuf, expected=lambda a, b: theirs[a:b])
