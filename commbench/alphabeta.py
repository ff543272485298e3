"""The latency-bandwidth (alpha-beta) law of a collective, shared by the
measured model (commmodel.py, which fits it) and the what-if model
(system.py, which takes it from a SystemSpec):

    t = steps(c, n) * alpha  +  S * busbw_factor(c, n) / bw_group

S is the size of DESIGN.md's busbw table, n the group size. busbw_factor is the
fraction of S each rank sends over its link (the collective file's own factor,
as nccl-tests define it), so S * factor / t is the bus bandwidth, and a
collective that reaches bus bandwidth bw takes S * factor / bw.

steps(c, n): how many latency terms a ring algorithm (NCCL's bandwidth
algorithm) pays one after the other. Chosen, not measured:
  all_reduce                  2(n-1)  reduce-scatter ring, then all-gather ring
  all_gather, reduce_scatter   n-1    one ring pass
  all_to_all                   n-1    pairwise exchange, n-1 rounds
  broadcast, reduce            n-1    pipelined chain: the first chunk reaches
                                      the far end after n-1 hops
  send_recv(_bidir)             1     one hop
NCCL switches to trees (about log2 n steps) for small messages, so this law is
pessimistic for small messages on large groups; it is exact for rings.

bw_group, intra-node (the group on one node): the per-GPU link bandwidth
(NVLink), whatever n is, since every GPU has its own links.
bw_group, inter-node: the NICs of a node are shared by every GPU on it. A ring
crosses each node boundary once per ring, and NCCL runs one ring per NIC, so a
group with r ranks on each node gets r NIC shares of bandwidth, where a share is
    inter bandwidth per GPU = NICs per node x NIC rate / GPUs per node;
r = ceil(n / nodes). This holds when all groups of an axis run at once (as in
training: g/r groups per node split the NICs) and for one group spanning whole
nodes (r = GPUs per node: all NICs); an isolated group with r < GPUs per node
on otherwise idle nodes may get more (NCCL's PXN), which only a measurement shows.
"""
import math
from dataclasses import dataclass

import numpy as np

from commbench.collectives import COLLECTIVES

# ring latency steps for a group of n (see the module docstring)
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "reduce": lambda n: n - 1,
    "send_recv": lambda n: 1,
    "send_recv_bidir": lambda n: 1,
}
MODELLED = tuple(_STEPS)


def collective_name(name: str) -> str:
    """The registry name of a collective that has a time model (ValueError otherwise)."""
    if name not in _STEPS:
        raise ValueError(f"no time model for collective {name!r}: choose from {', '.join(MODELLED)}")
    return name


def check_shape(group_size: int, num_nodes: int, nbytes: int):
    for what, v, least in (("group_size", group_size, 1), ("num_nodes", num_nodes, 1), ("nbytes", nbytes, 0)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < least:
            raise ValueError(f"{what} must be an integer >= {least}, got {v!r}")
    if num_nodes > group_size:
        raise ValueError(f"a group of {group_size} ranks cannot span {num_nodes} nodes")


def steps(collective: str, n: int) -> int:
    return _STEPS[collective_name(collective)](n)


def factor(collective: str, n: int) -> float:
    """The collective's busbw factor (collectives/<name>.py): bytes over a link per byte of S."""
    return COLLECTIVES[collective_name(collective)].busbw_factor(n)


def tier(num_nodes: int) -> str:
    return "intra" if num_nodes == 1 else "inter"


def ranks_per_node(group_size: int, num_nodes: int) -> int:
    """r of the module docstring: ranks of one group on each node (groups spread evenly)."""
    return math.ceil(group_size / num_nodes)


def link_bytes(collective: str, nbytes: int, group_size: int, num_nodes: int) -> float:
    """Bytes per unit of per-GPU bandwidth: S * factor, divided by the r NIC shares
    an inter-node group gets (intra-node: r = 1, each GPU has its own links)."""
    r = 1 if num_nodes == 1 else ranks_per_node(group_size, num_nodes)
    return nbytes * factor(collective, group_size) / r


@dataclass(frozen=True)
class Fit:
    """alpha (s per latency step) and bw (bytes/s per GPU share) of one tier,
    fitted to measured points; rel_rms is the fit's RMS relative residual."""
    alpha_s: float
    bw_Bps: float
    num_points: int
    rel_rms: float

    def time_s(self, collective: str, nbytes: int, group_size: int, num_nodes: int) -> float:
        return (steps(collective, group_size) * self.alpha_s
                + link_bytes(collective, nbytes, group_size, num_nodes) / self.bw_Bps)


def fit(points) -> Fit | None:
    """Least-squares alpha-beta fit to points (collective, nbytes, group_size,
    num_nodes, time_s). Each row is t_i = steps_i * alpha + link_bytes_i * (1/bw),
    divided by t_i so that the residuals are relative: the microsecond latencies of
    small messages count as much as the seconds of large ones, alpha then comes from
    the small messages and bw from the bandwidth-bound ones. Non-negative least
    squares (scipy.optimize.nnls): neither a negative latency nor a negative
    bandwidth is physical. None when the points cannot fix both unknowns (fewer than
    two independent rows) or show no bandwidth term (all latency-bound)."""
    from scipy.optimize import nnls   # here, not at import: the CLI answers bad input fast
    rows, t = [], []
    for coll, nbytes, n, nodes, time_s in points:
        if n < 2 or time_s <= 0:
            continue
        rows.append([steps(coll, n), link_bytes(coll, nbytes, n, nodes)])
        t.append(time_s)
    if len(rows) < 2:
        return None
    a, t = np.asarray(rows, dtype=np.float64), np.asarray(t, dtype=np.float64)
    scale = a.max(axis=0)                 # columns of order 1: seconds and bytes differ by 1e9
    if np.any(scale <= 0):
        return None
    aw = a / scale / t[:, None]
    if np.linalg.matrix_rank(aw) < 2:
        return None
    x, _ = nnls(aw, np.ones_like(t))
    alpha, inv_bw = x / scale
    if inv_bw <= 0:
        return None
    rel = (a @ np.array([alpha, inv_bw])) / t - 1.0
    return Fit(alpha_s=float(alpha), bw_Bps=float(1.0 / inv_bw), num_points=len(t),
               rel_rms=float(np.sqrt(np.mean(rel ** 2))))
