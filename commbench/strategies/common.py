"""What every strategy needs: the parameters a rank holds after tensor and
pipeline parallelism, in torch_model's registration order (DDP buckets and FSDP
units follow that order), and CommOp construction for a plan's axis."""
from dataclasses import dataclass
from functools import lru_cache

from commbench.models import ModelSpec
from commbench.parallel import DTYPE_BYTES, Parallelism
from commbench.workload import CommOp


@dataclass(frozen=True)
class Param:
    name: str          # as in torch_model.Transformer.named_parameters()
    numel: int         # elements on this rank (after tp sharding)
    tp_sharded: bool   # False: replicated across the tp group (norms, rowwise biases, positions)


def stage_layers(model: ModelSpec, par: Parallelism, stage: int) -> range:
    """Layers of pipeline stage `stage`: a contiguous, equal split. (With
    interleaving a rank holds v chunks of L/(p v) layers; the count is the same.)"""
    per = model.num_layers // par.pp
    return range(stage * per, (stage + 1) * per)


def stage_kind(par: Parallelism, stage: int) -> tuple:
    """(first, last): what sets a stage's parameters apart. The stages between
    the first and the last hold equal layer counts of alike-sized parameters,
    so what is computed from their sizes (an Adam shard, DDP buckets, ZeRO-1's
    broadcasts) is computed once per kind."""
    return stage == 0, stage == par.pp - 1


def layer_params(model: ModelSpec, tp: int, i: int) -> list:
    return list(_layer_params(model, tp, i))


@lru_cache(maxsize=16384)
def _layer_params(model: ModelSpec, tp: int, i: int) -> tuple:
    """Kept per (model, tp, layer): a plan search lists the same layers for many plans."""
    h, f, kv = model.hidden, model.ffn_hidden, model.kv_dim
    b = model.has_bias
    out = []

    def add(name, numel, sharded):
        out.append(Param(f"layers.{i}.{name}", numel // tp if sharded else numel, sharded))
    add("norm1.weight", h, False)
    if b:
        add("norm1.bias", h, False)
    for proj, dim in (("q", h), ("k", kv), ("v", kv)):           # colwise: weight and bias split
        add(f"attn.{proj}.weight", dim * h, True)
        if b:
            add(f"attn.{proj}.bias", dim, True)
    add("attn.o.weight", h * h, True)                               # rowwise: bias replicated
    if b:
        add("attn.o.bias", h, False)
    add("norm2.weight", h, False)
    if b:
        add("norm2.bias", h, False)
    if model.gated_mlp:
        add("mlp.gate.weight", f * h, True)
    add("mlp.up.weight", f * h, True)
    if b:
        add("mlp.up.bias", f, True)
    add("mlp.down.weight", h * f, True)
    if b:
        add("mlp.down.bias", h, False)
    return tuple(out)


def rank_params(model: ModelSpec, par: Parallelism, stage: int = 0) -> list:
    """Parameters held by a rank of pipeline stage `stage`, in registration order.
    The first stage holds the (vocab-parallel) embedding and, for GPT, the learned
    positions; the last the final norm and the output layer (vocab-parallel; with
    tied embeddings and pp = 1 it is the embedding itself). A vocabulary that tp
    does not divide is split unevenly: the largest shard, ceil(V / tp) rows."""
    tp, h = par.tp, model.hidden
    vocab_rows = -(-model.vocab // tp)
    first, last = stage == 0, stage == par.pp - 1
    out = []
    if first:
        out.append(Param("embed.weight", vocab_rows * h, True))
        if model.arch == "gpt":
            out.append(Param("pos.weight", model.seq * h, False))
    for i in stage_layers(model, par, stage):
        out += _layer_params(model, tp, i)
    if last:
        out.append(Param("norm.weight", h, False))
        if model.has_bias:
            out.append(Param("norm.bias", h, False))
        if not model.tied_embeddings or not first:
            out.append(Param("head.weight", vocab_rows * h, True))
    return out


def shard_numel(model: ModelSpec, par: Parallelism, stage: int = 0) -> int:
    return sum(p.numel for p in rank_params(model, par, stage))


def grad_bytes(par: Parallelism) -> int:
    return DTYPE_BYTES[par.grad_dtype]


def param_bytes(par: Parallelism) -> int:
    return DTYPE_BYTES[par.dtype]


def op(par: Parallelism, collective: str, axis: str, nbytes: int, count: int, phase: str,
       strategy: str, overlap: str = "none", label: str = "", dtype: str | None = None,
       stage: int = 0, host_blocking: bool = False, root: int = -1) -> CommOp:
    """A CommOp on one of the plan's axes, with its group size and node span."""
    size = {"dp": par.dp, "tp": par.tp, "pp": par.pp}[axis]
    return CommOp(collective=collective, axis=axis, group_size=size, num_nodes=par.axis_nodes(axis),
                  nbytes=int(nbytes), count=int(count), phase=phase, overlap=overlap,
                  dtype=dtype or par.grad_dtype, strategy=strategy, label=label, stage=stage,
                  host_blocking=host_blocking, root=root)
