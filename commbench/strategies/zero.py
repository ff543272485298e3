"""ZeRO stages 1 and 2, per optimizer step and rank, in two flavours
(par.zero_flavour).

'torch' (what `commbench validate` runs):
- zero = 1: torch.distributed.optim.ZeroRedundancyOptimizer over a DDP model.
  Gradients: DDP's bucketed all-reduces, exactly as strategies/ddp.py (once per
  step; no_sync during accumulation). Step: each rank updates the parameters it
  owns, then every owner broadcasts them (`_sync_params`: for rank r in
  0..n-1, broadcast from r). Ownership (`_partition_parameters`): the
  parameters in registration order are sorted by numel, largest first (a
  stable sort: equal sizes keep registration order), and each goes to the rank
  with the smallest total numel so far (the lowest such rank on ties).
  parameters_as_bucket_view=False (the default): one broadcast per parameter,
  in the owner's assignment order, of numel x param bytes. With
  parameters_as_bucket_view=True: one broadcast per rank of its flattened
  partition (sum of its numel; an empty partition broadcasts a dummy
  torch.zeros(1) float32, 4 bytes). Every rank of the dp group takes part in
  every broadcast, so each is count 1 per rank; consecutive broadcasts of the
  same size from the same owner are merged into one CommOp with count k
  (order kept).
- zero = 2: FSDP2 `fully_shard(..., reshard_after_forward=False)` on every
  transformer layer and on the root (which then holds the embedding, positions,
  final norm and head), as recorded on gloo (tests/test_strategy_zero.py): per
  micro-batch, one all-gather per unit in forward (root first, then layers in
  order; parameters stay gathered through backward, so there is no backward
  all-gather) and one reduce-scatter per unit in backward (layers in reverse,
  then the root). Since reshard_after_backward stays True the parameters are
  re-gathered for every micro-batch, so both counts are m; inside
  torch.distributed.pipelining (no reshard after backward, gradient sync
  deferred to the end of the step) both are once per step, the reduce-scatter
  after the backward (strategies/fsdp.py). Each unit's
  collective is one flat buffer: every parameter sharded on dim 0 into n
  torch.chunk pieces padded to ceil(dim0 / n) rows, so S = sum over the unit's
  parameters of n * ceil(dim0 / n) * (numel / dim0) elements: all-gather in
  the parameter dtype, reduce-scatter in the gradient dtype. A unit with no
  parameters (the root of a middle pipeline stage) issues nothing. With tp > 1
  dim0 is that of the local TP shard (an approximation of FSDP2's strided
  sharding of DTensors).

'deepspeed' (DeepSpeed ZeRO-1/2, DeepSpeedZeroOptimizer; not runnable here, so
formula-based):
- gradients: reduce-scatter of Psi in buckets of reduce_bucket_size = 5e8
  elements (DeepSpeed's default): parameters in gradient ready order fill an
  IPG bucket, which is reduced before a parameter that would push it past
  5e8 elements is added (a model under 5e8 elements is one op). ZeRO-1 reduces
  once per step (at the gradient accumulation boundary); ZeRO-2 after every
  micro-batch (count = m). DeepSpeed carries a bucket's reduce-scatter out as
  one dist.reduce per destination rank's slice (reduce_scatter=True); the
  volume is that of one reduce-scatter of the bucket, which is what is emitted.
- parameters: one all-gather per step of the flat fp16/bf16 group. With
  torch >= 1.13 (dist.has_all_gather_into_tensor) DeepSpeed issues a single
  all_gather_into_tensor of the whole flat group and ignores
  allgather_bucket_size (5e8); one param group is assumed. The flat group is
  padded to a multiple of nccl_start_alignment_factor (2) x n elements, so
  S = ceil(Psi_elems / 2n) * 2n x param bytes."""
import heapq

from commbench.models import ModelSpec
from commbench.parallel import Parallelism
from commbench.strategies.common import grad_bytes, op, param_bytes, rank_params, shard_numel, stage_kind
from commbench.strategies.ddp import gradient_allreduces, grad_ready_order

DS_REDUCE_BUCKET_ELEMS = 500_000_000       # DeepSpeed reduce_bucket_size default
DS_ALLGATHER_BUCKET_ELEMS = 500_000_000    # DeepSpeed allgather_bucket_size default (unused, see above)
DS_ALIGNMENT = 2                           # DeepSpeed nccl_start_alignment_factor


# --- torch, zero = 1: ZeroRedundancyOptimizer ------------------------------------------------
def zero_partition(params: list, n: int) -> list:
    """ZeroRedundancyOptimizer._partition_parameters: params (registration order)
    -> per rank, the list of params it owns, in assignment order."""
    per_rank, least = [[] for _ in range(n)], [(0, r) for r in range(n)]    # a heap of (size, rank)
    for p in sorted(params, key=lambda q: q.numel, reverse=True):
        size, r = least[0]                     # _get_min_index: the first of the smallest
        per_rank[r].append(p)
        heapq.heapreplace(least, (size + p.numel, r))
    return per_rank


def zero_broadcasts(model: ModelSpec, par: Parallelism, stage: int = 0,
                    parameters_as_bucket_view: bool = False) -> list:
    """[(owner dp rank, nbytes)] of the broadcasts of one optimizer step, in issue order."""
    out = []
    for r, owned in enumerate(zero_partition(rank_params(model, par, stage), par.dp)):
        if parameters_as_bucket_view:
            numel = sum(p.numel for p in owned)
            out.append((r, numel * param_bytes(par) if numel else 4))   # empty: torch.zeros(1) fp32
        else:
            out += [(r, p.numel * param_bytes(par)) for p in owned]
    return out


def _torch_zero1(model, par, parameters_as_bucket_view):
    ops = gradient_allreduces(model, par, "zero1")
    if par.dp == 1:
        return ops
    of_kind = {}
    for stage in range(par.pp):
        kind = stage_kind(par, stage)
        if kind not in of_kind:
            runs = []                              # merge consecutive equal broadcasts of one owner
            for owner, nbytes in zero_broadcasts(model, par, stage, parameters_as_bucket_view):
                if runs and runs[-1][:2] == [owner, nbytes]:
                    runs[-1][2] += 1
                else:
                    runs.append([owner, nbytes, 1])
            of_kind[kind] = runs
        for owner, nbytes, k in of_kind[kind]:
            ops.append(op(par, "broadcast", "dp", nbytes, count=k, phase="step", strategy="zero1",
                          label=f"params from dp rank {owner}", dtype=par.dtype, stage=stage, root=owner))
    return ops


# --- torch, zero = 2: FSDP2 with reshard_after_forward=False -----------------------------------
def _torch_zero2(model, par):
    """Per unit (fsdp.fsdp_units: the root, then each block) an all-gather in
    forward and a reduce-scatter in backward, counted as fsdp counts a unit that
    does not reshard after forward (every micro-batch; under pipelining once per
    step, the reduce-scatter after the backward)."""
    from commbench.strategies import fsdp
    ops, n = [], par.dp
    if n == 1:
        return ops
    for stage in range(par.pp):
        units = fsdp.fsdp_units(model, par, stage)
        fwd, _, rs = fsdp.gathers_per_step(par, stage, False, True)
        name = {u: "root" if u.label == "root" else f"layers.{u.layer}" for u in units}
        for u in units:
            # all_gather S = total gathered output, n x padded shard, in the parameter dtype
            ops.append(op(par, "all_gather", "dp", u.padded_numel(n) * param_bytes(par), count=fwd,
                          phase="fwd", strategy="zero2", overlap="fwd", label=f"{name[u]} params",
                          dtype=par.dtype, stage=stage, host_blocking=True))
        blocks = [u for u in units if u.label != "root"]
        root = [u for u in units if u.label == "root"]
        for u in list(reversed(blocks)) + root:   # backward: last layer first, root last
            # reduce_scatter S = total input, n x padded shard, in the gradient dtype
            ops.append(op(par, "reduce_scatter", "dp", u.padded_numel(n) * grad_bytes(par), count=rs,
                          phase="bwd", strategy="zero2", overlap="bwd" if par.pp == 1 else "none",
                          label=f"{name[u]} grads", stage=stage, host_blocking=True))
    return ops


# --- DeepSpeed ZeRO-1/2 -------------------------------------------------------------------
def ds_reduce_buckets(model: ModelSpec, par: Parallelism, stage: int = 0) -> list:
    """Element counts of DeepSpeed's IPG gradient buckets, in reduction order."""
    out, cur = [], 0
    for p in grad_ready_order(rank_params(model, par, stage)):
        if cur and cur + p.numel > DS_REDUCE_BUCKET_ELEMS:
            out.append(cur)
            cur = 0
        cur += p.numel
    return out + ([cur] if cur else [])


def _deepspeed(model, par):
    ops, n = [], par.dp
    if n == 1:
        return ops
    strategy = f"zero{par.zero}"
    rs_count = par.num_microbatches if par.zero == 2 else 1     # ZeRO-2 reduces every micro-batch
    for stage in range(par.pp):
        bs = ds_reduce_buckets(model, par, stage)
        for i, elems in enumerate(bs):
            ops.append(op(par, "reduce_scatter", "dp", elems * grad_bytes(par), count=rs_count, phase="bwd",
                          strategy=strategy, overlap="bwd", label=f"bucket {i + 1}/{len(bs)}", stage=stage))
        align = DS_ALIGNMENT * n
        padded = -(-shard_numel(model, par, stage) // align) * align
        ops.append(op(par, "all_gather", "dp", padded * param_bytes(par), count=1, phase="step",
                      strategy=strategy, label="flat params", dtype=par.dtype, stage=stage))
    return ops


def comm_ops(model: ModelSpec, par: Parallelism, parameters_as_bucket_view: bool = False) -> list:
    """CommOps of ZeRO-1/2 (par.zero) in par.zero_flavour; parameters_as_bucket_view
    is ZeroRedundancyOptimizer's option (torch, zero = 1 only)."""
    if par.zero not in (1, 2):
        raise ValueError(f"strategies.zero handles zero stages 1 and 2, got {par.zero}")
    par.check_model(model)
    if par.zero_flavour == "deepspeed":
        return _deepspeed(model, par)
    if par.zero == 1:
        return _torch_zero1(model, par, parameters_as_bucket_view)
    return _torch_zero2(model, par)
