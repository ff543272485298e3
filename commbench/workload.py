"""Workload: what one optimizer step of a plan issues, per rank. CommOps come
from the strategies (strategies/), ComputeOps from compute/ (a later issue)."""
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CommOp:
    collective: str          # all_reduce | all_gather | reduce_scatter | broadcast | send_recv | all_to_all
    axis: str                # dp | tp | pp | ep ...
    group_size: int
    num_nodes: int           # nodes one group of this axis spans
    nbytes: int              # S of DESIGN.md's busbw table
    count: int               # times per optimizer step, per rank
    phase: str               # fwd | bwd | step
    overlap: str = "none"    # what it may hide behind: bwd | fwd | none
    # issued by a blocking call of the host that overlaps compute only through a
    # GPU's streams (FSDP2's all-gathers and reduce-scatters): on a CPU device,
    # where the host runs the compute, it holds the compute up; the others are
    # async works the backend progresses beside compute (DDP's buckets)
    host_blocking: bool = False
    dtype: str = "bf16"
    strategy: str = ""       # ddp | zero1 | zero2 | fsdp | tp | pp
    label: str = ""          # e.g. "bucket 3/7", "attn out fwd"
    stage: int = 0           # pipeline stage whose ranks issue it
    peer: int = -1           # send_recv: the other stage; -1 otherwise
    direction: str = ""      # send_recv: send | recv (seen from `stage`)
    root: int = -1           # broadcast: the group rank it comes from; -1 otherwise

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ComputeOp:
    """One compute kernel of a training step on one rank, at its TP-sharded shape.
    gemm: C[m,n] = A[m,k] B[k,n] (batch of them); attention: m query tokens, n key
    tokens, k head dim, batch = micro-batch x local heads; elementwise/optimizer:
    m elements. flops and nbytes (read + written) are per call; count is calls per
    optimizer step on one rank of the stage."""
    name: str                # e.g. "qkv fwd", "qkv dgrad", "attention bwd", "adam"
    kind: str                # gemm | attention | elementwise | optimizer | other
    m: int = 0
    n: int = 0
    k: int = 0
    flops: float = 0.0
    nbytes: int = 0
    count: int = 1
    phase: str = "fwd"       # fwd | bwd | step
    dtype: str = "bf16"
    batch: int = 1
    impl: str = ""           # the timed kernel (compute/): gemm_nt, sdpa_bwd, layernorm_fwd, ...
    stage: int = -1          # pipeline stage that runs it; -1 = every stage (transformer layers)
    scope: str = "layer"     # layer | embedding | head | optimizer
    params: tuple = ()       # further shape facts, (key, value) pairs: kv heads, causal, ...

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bytes"] = d["nbytes"]
        d["params"] = dict(self.params)
        return d


@dataclass
class Workload:
    model: dict
    parallelism: dict
    comm_ops: list = field(default_factory=list)
    compute_ops: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model": self.model, "parallelism": self.parallelism,
                "comm_ops": [c.to_dict() for c in self.comm_ops],
                "compute_ops": [c.to_dict() for c in self.compute_ops]}

    def volume_per_axis(self) -> dict:
        """Bytes a rank of each pipeline stage sends per step, per axis: S x count x
        the busbw factor (the fraction of S that crosses a link), split intra/inter
        node. Keys: (stage, axis, 'intra' | 'inter')."""
        from commbench.collectives import COLLECTIVES
        out = {}
        for c in self.comm_ops:
            if c.direction == "recv":       # the peer's send: counted once, on its side
                continue
            name = c.collective
            factor = COLLECTIVES[name].busbw_factor(c.group_size) if name in COLLECTIVES else 1.0
            where = "inter" if c.num_nodes > 1 else "intra"
            key = (c.stage, c.axis, where)
            out[key] = out.get(key, 0.0) + c.nbytes * c.count * factor
        return out
