"""Parallelism: a training plan (dp x tp x pp, ZeRO stage, micro-batching, ...)
that validates itself, and its rank mesh in Megatron order (tp fastest, then dp,
then pp): every rank's tp/dp/pp groups and whether each group spans nodes."""
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from commbench.models import ModelSpec

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
SCHEDULES = ("1f1b", "interleaved", "gpipe")
RECOMPUTE = ("none", "selective", "full")
# a pipeline is simulated micro-batch by micro-batch: far beyond real accumulation counts (thousands)
MAX_MICROBATCHES = 100_000
ZERO_FLAVOURS = ("torch", "deepspeed")
MAX_WORLD = 1 << 17             # 131072 GPUs: beyond any machine built, and plans stay quick to enumerate


@dataclass(frozen=True)
class Parallelism:
    world: int
    gpus_per_node: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 0                     # 0 = derived: world / (tp * pp)
    zero: int = 0                   # 0 DDP, 1/2 ZeRO, 3 FSDP full shard
    sp: bool = False                # Megatron sequence parallelism (needs tp > 1)
    micro_batch: int = 1
    global_batch: int = 0           # 0 = micro_batch * dp (no accumulation)
    seq: int = 0                    # 0 = the model's
    dtype: str = "bf16"             # parameters and activations
    grad_dtype: str = ""            # "" = dtype: the dtype gradients are reduced in
    bucket_mb: float = 25.0         # DDP bucket_cap_mb
    schedule: str = "1f1b"
    interleave: int = 1             # virtual stages per pp rank (interleaved 1F1B)
    recompute: str = "none"
    zero_flavour: str = "torch"     # ZeRO-1/2 as torch implements it, or as DeepSpeed does
    allow_tp_across_nodes: bool = False

    def __post_init__(self):
        ints = ("world", "gpus_per_node", "tp", "pp", "micro_batch", "interleave")
        for f in ints:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f.replace('_', '-')} must be a positive integer, got {v!r}")
        for f in ("dp", "global_batch", "seq", "zero"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{f.replace('_', '-')} must be a non-negative integer, got {v!r}")
        for f in ("sp", "allow_tp_across_nodes"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f.replace('_', '-')} must be true or false, got {getattr(self, f)!r}")
        b = self.bucket_mb
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b) or b <= 0:
            raise ValueError(f"bucket-mb must be a positive finite number of MB, got {b!r}")
        if self.world > MAX_WORLD:
            raise ValueError(f"world size {self.world}: commbench models jobs of up to {MAX_WORLD} GPUs")
        if self.world % (self.tp * self.pp):
            raise ValueError(f"tp*pp = {self.tp * self.pp} does not divide world size {self.world}")
        if self.dp == 0:
            object.__setattr__(self, "dp", self.world // (self.tp * self.pp))
        if self.tp * self.pp * self.dp != self.world:
            raise ValueError(f"tp*pp*dp = {self.tp * self.pp * self.dp} but world size is {self.world}")
        if self.world % self.gpus_per_node and self.world > self.gpus_per_node:
            raise ValueError(f"world size {self.world} is not a whole number of nodes of {self.gpus_per_node} GPUs")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (--sp) needs tp > 1")
        if self.global_batch == 0:
            object.__setattr__(self, "global_batch", self.micro_batch * self.dp)
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"global batch {self.global_batch} is not a multiple of micro-batch x dp = "
                             f"{self.micro_batch} x {self.dp}")
        if self.num_microbatches > MAX_MICROBATCHES:
            raise ValueError(f"{self.num_microbatches} micro-batches per step (global batch {self.global_batch} / "
                             f"(micro-batch {self.micro_batch} x dp {self.dp})) is beyond what this tool "
                             f"simulates (at most {MAX_MICROBATCHES}): raise the micro-batch")
        for f in ("dtype", "grad_dtype"):
            v = getattr(self, f)
            if f == "grad_dtype" and v == "":
                object.__setattr__(self, "grad_dtype", self.dtype)
            elif v not in DTYPE_BYTES:
                raise ValueError(f"{f.replace('_', '-')} {v!r}: choose from {', '.join(DTYPE_BYTES)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {self.schedule!r}: choose from {', '.join(SCHEDULES)}")
        if self.interleave > 1 and self.schedule == "gpipe":
            raise ValueError(f"interleave {self.interleave} needs the interleaved 1F1B schedule, not gpipe")
        if self.interleave > 1 and self.schedule != "interleaved":
            object.__setattr__(self, "schedule", "interleaved")
        if self.schedule == "interleaved" and self.pp == 1:
            raise ValueError("the interleaved schedule (--interleave > 1) needs pipeline parallelism (pp > 1)")
        if self.schedule == "interleaved" and self.pp > 1 and self.num_microbatches % self.pp:
            raise ValueError(f"interleaved 1F1B needs the micro-batch count ({self.num_microbatches}) "
                             f"to be a multiple of pp ({self.pp})")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}: choose from {', '.join(RECOMPUTE)}")
        if self.zero_flavour not in ZERO_FLAVOURS:
            raise ValueError(f"zero flavour {self.zero_flavour!r}: choose from {', '.join(ZERO_FLAVOURS)}")
        if self.zero_flavour == "deepspeed" and self.zero == 3:
            raise ValueError("zero flavour deepspeed models ZeRO-1/2; ZeRO-3 is modelled as FSDP2 (zero flavour torch)")
        if self.zero_flavour == "deepspeed" and self.zero == 2 and self.pp > 1:
            raise ValueError("DeepSpeed's pipeline engine refuses ZeRO-2 (stage < 2 with pipeline parallelism)")
        if self.tp > self.gpus_per_node and not self.allow_tp_across_nodes:
            raise ValueError(f"tp {self.tp} spans nodes of {self.gpus_per_node} GPUs: tensor parallelism "
                             "is meant to stay inside a node (--allow-tp-across-nodes models it anyway)")
        if self.tp <= self.gpus_per_node and self.gpus_per_node % self.tp and not self.allow_tp_across_nodes:
            raise ValueError(f"tp {self.tp} does not divide gpus-per-node {self.gpus_per_node}: "
                             "some tp groups would span two nodes (--allow-tp-across-nodes models it anyway)")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each pipeline (gradient accumulation)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world // self.gpus_per_node))

    def check_model(self, model: ModelSpec):
        """The rules that involve the model's shape."""
        if model.heads % self.tp:
            raise ValueError(f"heads {model.heads} of {model.name} are not divisible by tp {self.tp}")
        if model.kv_heads % self.tp:
            # Megatron-core splits the query groups: divide(num_query_groups, tp)
            raise ValueError(f"kv heads {model.kv_heads} of {model.name} are not divisible by tp {self.tp}")
        if model.num_layers % (self.pp * self.interleave):
            raise ValueError(f"layers {model.num_layers} of {model.name} are not divisible by "
                             f"pp x interleave = {self.pp} x {self.interleave}")
        if model.ffn_hidden % self.tp:
            raise ValueError(f"ffn hidden {model.ffn_hidden} of {model.name} is not divisible by tp {self.tp}")
        if model.arch == "gpt" and self.seq_for(model) > model.seq:
            raise ValueError(f"seq {self.seq_for(model)} is longer than the {model.seq} learned positions of "
                             f"{model.name}")
        if self.sp and self.seq_for(model) % self.tp:
            raise ValueError(f"sequence parallelism: seq {self.seq_for(model)} is not divisible by tp {self.tp}")

    def seq_for(self, model: ModelSpec) -> int:
        return self.seq or model.seq

    # --- the rank mesh -----------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) index of a rank: rank = pp_i * dp * tp + dp_i * tp + tp_i."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp_i: int, dp_i: int, tp_i: int) -> int:
        return pp_i * self.dp * self.tp + dp_i * self.tp + tp_i

    @cached_property
    def groups(self) -> dict:
        """axis -> list of groups (tuples of global ranks); each rank in one group per axis."""
        tp = [tuple(self.rank_of(p, d, t) for t in range(self.tp)) for p in range(self.pp) for d in range(self.dp)]
        dp = [tuple(self.rank_of(p, d, t) for d in range(self.dp)) for p in range(self.pp) for t in range(self.tp)]
        pp = [tuple(self.rank_of(p, d, t) for p in range(self.pp)) for d in range(self.dp) for t in range(self.tp)]
        return {"tp": tp, "dp": dp, "pp": pp}

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def nodes_spanned(self, group) -> int:
        return len({self.node_of(r) for r in group})

    def axis_nodes(self, axis: str) -> int:
        """Nodes spanned by one group of an axis (the most any group spans)."""
        return _axis_nodes(self.world, self.gpus_per_node, self.tp, self.pp, self.dp, axis)

    def group_of(self, axis: str, rank: int) -> tuple:
        return next(g for g in self.groups[axis] if rank in g)


@lru_cache(maxsize=1024)
def _axis_nodes(world: int, gpus_per_node: int, tp: int, pp: int, dp: int, axis: str) -> int:
    """Parallelism.axis_nodes, which only the mesh's shape decides: kept per shape,
    as the strategies ask once per CommOp and a plan search builds many plans of
    one mesh."""
    mesh = Parallelism(world=world, gpus_per_node=gpus_per_node, tp=tp, pp=pp, dp=dp, allow_tp_across_nodes=True)
    return max(mesh.nodes_spanned(g) for g in mesh.groups[axis])
