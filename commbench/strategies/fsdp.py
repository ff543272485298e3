"""FSDP full shard (zero = 3) as torch's FSDP2 (`torch.distributed.fsdp.fully_shard`)
issues it, per optimizer step, per rank.

Unit structure (the usual recipe, torchtitan's and the FSDP2 tutorial's):

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh)          # root; reshard_after_forward left at None

so there is one sharded unit per transformer block and one root unit holding
what is left: embedding (+ learned positions for GPT), final norm and, when not
tied, the output layer. `fsdp_units` lists them; `apply_fully_shard` builds it.

What FSDP2 issues (torch 2.13, torch/distributed/fsdp/_fully_shard/):
- Every parameter is sharded on dim 0 over the dp group of n ranks with
  torch.chunk: each rank's shard is padded to ceil(d0 / n) rows
  (_fsdp_param.py _init_sharded_param: padded_sharded_size = chunks[0].size()).
  A tensor-parallel parameter (DTensor) is sharded on dim 0 of its *local* TP
  shard (_init_sharding_spec_tp returns param._local_tensor).
- All-gather: one flat collective per unit (foreach_all_gather copies every
  parameter's padded shard into one buffer, then one all_gather_into_tensor,
  c10d::_allgather_base_): per-rank input = sum over the unit's parameters of
  ceil(d0/n) * (numel / d0); output (S of the busbw table) = n times that.
- Reduce-scatter: one flat collective per unit (foreach_reduce: input numel =
  sum of _get_dim0_padded_size(grad) = ceil(d0/n)*n * (numel/d0), one
  reduce_scatter_tensor, c10d::_reduce_scatter_base_): S = that input, the same
  number of elements as the all-gather output.
- dtypes: the all-gather moves MixedPrecisionPolicy.param_dtype (par.dtype),
  the reduce-scatter reduce_dtype (par.grad_dtype); with the policy's defaults
  both are the parameters' dtype.
- Per micro-batch: each unit is all-gathered at its pre-forward; with
  reshard_after_forward=True it is freed after forward and all-gathered again
  at its pre-backward (backward prefetch issues it one unit early: same ops);
  with False it stays unsharded until after its backward. The root left at
  reshard_after_forward=None gets False (FSDPState._lazy_init sets
  post_forward_mesh_info = None for the root: it is needed first in backward),
  so the root is all-gathered once per micro-batch whatever the blocks do;
  passing True explicitly to the root (root_reshard_after_forward=True) makes
  it re-gather in backward like a block. Every unit reshards after backward
  (reshard_after_backward=True), so each micro-batch gathers afresh.
  Each unit reduce-scatters its gradients once per micro-batch, at its
  post-backward, unless `set_requires_gradient_sync(False)` is set for all
  micro-batches but the last (sync_every_microbatch=False): then gradients
  accumulate unsharded and each unit reduce-scatters once per step, while the
  all-gathers are unchanged.
- Both are blocking calls of the host (unshard and foreach_reduce pass no
  async_op; overlap comes from the all-gather and reduce-scatter CUDA streams
  they are issued on): on a GPU they overlap compute through those streams, on
  a CPU device each one holds the host, and so the compute, up until it is done
  (CommOp.host_blocking).
- The optimizer step on the sharded DTensor parameters is local: nothing.
- dp = 1: no collectives (FSDPParamGroup.unshard and foreach_reduce skip them).

Pipeline parallelism (pp > 1): FSDP inside torch.distributed.pipelining, one
fully_shard'ed module per stage (its blocks + a root for what the stage holds;
a middle stage's root has no parameters and issues nothing). The stage's
backward_maybe_with_nosync sets, for every micro-batch, is_last_backward(False),
reshard_after_backward(False) and requires_gradient_sync(False); after all
micro-batches perform_reduce_grad runs each unit's post_backward once: one
reduce-scatter per unit per step, after the backward (not overlapped). The
all-gathers then follow the stage's compute order, with a unit sharded (S) or
unsharded (U): F on S gathers (fwd), F ends in S if the unit reshards after
forward, else U; B on S gathers (bwd), B ends in U (no reshard after backward).
Torch's Schedule1F1B runs, on stage s of p with m micro-batches,
F^w (B F)^(m-w) B^w with w = min(m, p - s) (schedules.py: warmup_chunks);
ScheduleGPipe F^m B^m (w = m). For a unit that reshards after forward, F
gathers when it is the first action or follows an F: w gathers; B gathers when
it follows an F: m - w + 1 gathers. A unit that does not reshard after forward
gathers once per step. The interleaved schedule (PipelineScheduleMulti with
its UNSHARD/RESHARD lowering, at most 3 active stages) is not modelled.

Not modelled: HSDP (2-D mesh with a replicate all-reduce), CPU offload,
reshard_after_forward as an int (a smaller post-forward mesh), explicit
set_modules_to_forward/backward_prefetch (changes order, not ops), gradient
clipping's norm all-reduce (the optimizer's business, not FSDP's)."""
import math
from dataclasses import dataclass
from functools import lru_cache

from commbench.models import ModelSpec
from commbench.parallel import Parallelism
from commbench.strategies.common import grad_bytes, op, param_bytes, rank_params, stage_layers

STRATEGY = "fsdp"


@dataclass(frozen=True)
class Unit:
    label: str            # "block" or "root"
    layer: int            # block index; -1 for the root
    shapes: tuple         # local (after TP) shapes of its parameters, registration order
    names: tuple = ()     # their names

    def padded_numel(self, n: int) -> int:
        """Elements of the flat all-gather output / reduce-scatter input over n
        ranks: every parameter's dim 0 padded to a multiple of n (ceil(d0/n)
        rows per rank, torch.chunk's first chunk)."""
        return sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) for s in self.shapes)

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@lru_cache(maxsize=65536)
def local_shape(model: ModelSpec, tp: int, name: str) -> tuple:
    """Shape of parameter `name` on a rank after tensor parallelism (DTensor TP:
    q/k/v/gate/up and the output layer colwise = dim 0 split, o/down rowwise =
    dim 1 split with replicated bias, vocab-parallel embedding = dim 0 split).
    A dim 0 that tp does not divide (a vocabulary of 50257) is split unevenly
    by DTensor; this gives the largest local shard, ceil(d0 / tp) rows."""
    h, f, kv, V = model.hidden, model.ffn_hidden, model.kv_dim, model.vocab
    c = lambda d: -(-d // tp)          # noqa: E731  colwise local rows
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    table = {
        "embed.weight": (c(V), h), "pos.weight": (model.seq, h), "head.weight": (c(V), h),
        "norm.weight": (h,), "norm.bias": (h,),
        "norm1.weight": (h,), "norm1.bias": (h,), "norm2.weight": (h,), "norm2.bias": (h,),
        "attn.q.weight": (c(h), h), "attn.q.bias": (c(h),),
        "attn.k.weight": (c(kv), h), "attn.k.bias": (c(kv),),
        "attn.v.weight": (c(kv), h), "attn.v.bias": (c(kv),),
        "attn.o.weight": (h, h // tp), "attn.o.bias": (h,),
        "mlp.gate.weight": (c(f), h), "mlp.up.weight": (c(f), h), "mlp.up.bias": (c(f),),
        "mlp.down.weight": (h, f // tp), "mlp.down.bias": (h,),
    }
    return table[leaf]


def fsdp_units(model: ModelSpec, par: Parallelism, stage: int = 0) -> list:
    """The sharded units of a rank of `stage`, in forward order: the root (its
    pre-forward runs first), then one unit per block. The root holds the
    stage's parameters outside the blocks; it is left out when it has none."""
    params = rank_params(model, par, stage)
    for p in params:                                # the shapes match common.rank_params
        s = local_shape(model, par.tp, p.name)
        if math.prod(s) != p.numel:
            raise AssertionError(f"shape {s} of {p.name} does not hold {p.numel} elements")
    blocks = {i: [] for i in stage_layers(model, par, stage)}
    root = []
    for p in params:
        if p.name.startswith("layers."):
            blocks[int(p.name.split(".")[1])].append(p.name)
        else:
            root.append(p.name)

    def unit(label, layer, names):
        return Unit(label, layer, tuple(local_shape(model, par.tp, x) for x in names), tuple(names))
    units = [unit("root", -1, root)] if root else []
    return units + [unit("block", i, names) for i, names in blocks.items()]


def gathers_per_step(par: Parallelism, stage: int, reshards: bool, sync_every_microbatch: bool) -> tuple:
    """(all-gathers in forward, all-gathers in backward, reduce-scatters) of one
    unit per optimizer step; `reshards` = the unit reshards after forward."""
    m = par.num_microbatches
    if par.pp == 1:
        # every micro-batch: gather at pre-forward, again at pre-backward if the unit
        # was freed after forward; reshard after backward, so the next micro-batch gathers anew
        return m, (m if reshards else 0), (m if sync_every_microbatch else 1)
    if par.schedule == "interleaved" or par.interleave > 1:
        raise ValueError("FSDP with the interleaved pipeline schedule is not modelled "
                                  "(torch's PipelineScheduleMulti adds its own UNSHARD/RESHARD actions)")
    # torch.distributed.pipelining: no reshard after backward, no gradient sync until
    # perform_reduce_grad (one reduce-scatter per unit per step); 1F1B runs
    # F^w (B F)^(m-w) B^w, GPipe F^m B^m
    w = m if par.schedule == "gpipe" else min(m, par.pp - stage)
    if not reshards:
        return 1, 0, 1                 # gathered at the first F, kept until the end of the step
    return w, m - w + 1, 1             # F after F or first: w; B after F: (m - w) + 1


def comm_ops(model: ModelSpec, par: Parallelism, *, reshard_after_forward: bool = True,
             root_reshard_after_forward: bool | None = None,
             sync_every_microbatch: bool = True) -> list:
    """FSDP2 collectives per optimizer step for every pipeline stage.

    reshard_after_forward: passed to fully_shard of every block (True: ZeRO-3,
    parameters re-gathered in backward; False: gathered once per micro-batch).
    root_reshard_after_forward: the root's; None is FSDP2's default, which is
    False for the root. sync_every_microbatch=False: set_requires_gradient_sync
    (False) for all but the last micro-batch (pp = 1 only; pipelining always
    defers the reduce-scatter to the end of the step)."""
    par.check_model(model)
    if par.dp == 1:
        return []
    n, out = par.dp, []
    root_reshards = bool(root_reshard_after_forward)   # None -> False for the root
    for stage in range(par.pp):
        units = fsdp_units(model, par, stage)
        blocks = [u for u in units if u.label == "block"]
        groups = [(u.label, [u], root_reshards) for u in units if u.label == "root"]
        if blocks:
            # every block of a stage has the same shapes: one op per kind, count x blocks
            if len({u.shapes for u in blocks}) != 1:
                raise AssertionError("blocks of one stage differ in shape")
            groups.append(("block", blocks, reshard_after_forward))
        for label, us, reshards in groups:
            numel = us[0].padded_numel(n)
            fwd, bwd, rs = gathers_per_step(par, stage, reshards, sync_every_microbatch)
            k = len(us)
            what = (f"{k} blocks (layers {us[0].layer}-{us[-1].layer})" if label == "block"
                    else "root (" + ", ".join(x.rsplit(".", 1)[0] for x in us[0].names
                                              if x.endswith("weight")) + ")")
            # all_gather S = n x per-rank padded shard = padded numel, in the param dtype
            out.append(op(par, "all_gather", "dp", numel * param_bytes(par), fwd * k, "fwd", STRATEGY,
                          overlap="fwd", label=f"{what} all-gather fwd", dtype=par.dtype, stage=stage,
                          host_blocking=True))
            if bwd:
                out.append(op(par, "all_gather", "dp", numel * param_bytes(par), bwd * k, "bwd", STRATEGY,
                              overlap="bwd", label=f"{what} all-gather bwd", dtype=par.dtype, stage=stage,
                              host_blocking=True))
            # reduce_scatter S = the padded flat gradient input, in the reduce dtype;
            # with pipelining it runs after the whole backward, hidden behind nothing
            out.append(op(par, "reduce_scatter", "dp", numel * grad_bytes(par), rs * k, "bwd", STRATEGY,
                          overlap="bwd" if par.pp == 1 else "none", label=f"{what} reduce-scatter",
                          dtype=par.grad_dtype, stage=stage, host_blocking=True))
    return out


def apply_fully_shard(module, mesh, reshard_after_forward: bool = True,
                      root_reshard_after_forward: bool | None = None, mp_policy=None):
    """The unit structure comm_ops assumes, on a torch_model.Transformer (or a
    pipeline stage of one, or compute.modules.LocalStage): fully_shard every
    block, then the root."""
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    layers = module.layers
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **kw)
    return fully_shard(module, mesh=mesh, reshard_after_forward=root_reshard_after_forward, **kw)


__all__ = ["comm_ops", "fsdp_units", "apply_fully_shard", "local_shape", "Unit"]
