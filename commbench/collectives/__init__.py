"""Collective registry: one file per collective, one line here."""
from commbench.collectives.all_gather import AllGather
from commbench.collectives.all_reduce import AllReduce
from commbench.collectives.all_to_all import AllToAll
from commbench.collectives.barrier import Barrier
from commbench.collectives.broadcast import Broadcast
from commbench.collectives.reduce import Reduce
from commbench.collectives.reduce_scatter import ReduceScatter
from commbench.collectives.send_recv import SendRecv, SendRecvBidir

COLLECTIVES = {c.name: c for c in [
    AllReduce(), AllGather(), ReduceScatter(), Broadcast(), Reduce(), AllToAll(),
    SendRecv(), SendRecvBidir(), Barrier(),
]}


def parse(text: str) -> list:
    """'all_reduce,all_gather' or 'all' -> collectives; nccl-tests' and common
    spellings (allreduce, alltoall, sendrecv, bcast) are accepted."""
    if text.strip().lower() == "all":
        return list(COLLECTIVES.values())
    squashed = {name.replace("_", ""): c for name, c in COLLECTIVES.items()}
    squashed.update(bcast=COLLECTIVES["broadcast"], p2p=COLLECTIVES["send_recv"])
    out = []
    for word in text.split(","):
        key = word.strip().lower().replace("_", "").replace("-", "")
        if key not in squashed:
            raise ValueError(f"unknown collective {word.strip()!r}: choose from {', '.join(COLLECTIVES)} or all")
        if squashed[key] not in out:
            out.append(squashed[key])
    return out
