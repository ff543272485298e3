"""DDP (torch.nn.parallel.DistributedDataParallel, zero = 0): what its C++
Reducer issues per optimizer step, per rank.

Steady state (after the bucket rebuild at the start of the second iteration):
one all-reduce per gradient bucket, once per optimizer step. With gradient
accumulation the first m-1 micro-batches run under `no_sync()` and issue
nothing; the last one reduces every bucket once, so count = 1 whatever m.
The buckets cover this rank's parameters (after TP sharding and PP staging:
the DP all-reduce of a TP shard is of the shard), in the gradient dtype.

Bucketing, as torch 2.x does it (torch/nn/parallel/distributed.py and
reducer.cpp):
- First iteration: with find_unused_parameters=False the initial assignment
  uses a single size limit of sys.maxsize, i.e. one bucket of every parameter
  (the first step issues a single all-reduce of all gradients).
- At the first forward of the second iteration `Reducer::rebuild_buckets` runs
  `compute_bucket_assignment_by_size` over the parameters in the order their
  gradients became ready in the first backward, with the size limits
  [first_bucket_bytes_cap, bucket_bytes_cap], and broadcasts the result from
  rank 0 (two small int64 broadcasts, once per training run, not per step).
- compute_bucket_assignment_by_size: walk the tensors, add numel*element_size
  to the open bucket; as soon as the bucket's size is >= the current limit,
  close it and move to the next limit (the last limit then repeats). What is
  left open at the end is the last bucket. Ready-order buckets are not sorted.
- bucket_bytes_cap = int(bucket_cap_mb * 2**20) (MB means MiB). In torch 2.13
  the first limit is dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) only when
  bucket_cap_mb is left at its default (None -> 25 MiB); an explicit
  bucket_cap_mb makes the first limit equal to the cap. Parallelism cannot tell
  "left at default" from "25 given", so bucket_mb == 25 means torch's default
  (first bucket 1 MiB) here, and `ddp_kwargs(par)` builds DDP that way.
- Gradient ready order: the reverse of registration order, except that a
  LayerNorm's weight becomes ready before its bias (both come out of one
  native_layer_norm_backward); both have `hidden` elements, so this does not
  move any bucket boundary. A tied weight (GPT head = embedding) is one
  parameter, ready when its last use in backward (the embedding) is done.
- Reducer launches buckets strictly in index order as they become ready, so
  the all-reduces overlap the rest of the backward pass.

Not emitted: the parameter broadcast at construction (`_sync_module_states`,
once per run) and the buffer broadcast at every forward, which exists only for
modules with buffers and broadcast_buffers=True (torch_model has no buffers).
Also not modelled: DDP_SET_LAST_BUCKET_CAP=1 (reverses which bucket is small),
bucket_cap_mb_list, and comm hooks (e.g. fp16 compression)."""
from commbench.models import ModelSpec
from commbench.parallel import Parallelism
from commbench.strategies.common import grad_bytes, op, rank_params, stage_kind

MIB = 1024 * 1024                      # torch's _MB_TO_BYTES
DEFAULT_BUCKET_CAP_MB = 25             # torch's _DEFAULT_BUCKET_CAP_MB
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB   # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def ddp_kwargs(par: Parallelism) -> dict:
    """DistributedDataParallel keyword arguments that make torch bucket as
    comm_ops assumes: bucket_mb == 25 is torch's default (bucket_cap_mb=None)."""
    return bucket_kwargs(par.bucket_mb)


def bucket_kwargs(bucket_mb: float) -> dict:
    return {"bucket_cap_mb": None if bucket_mb == DEFAULT_BUCKET_CAP_MB else bucket_mb}


def bucket_limits(par: Parallelism) -> tuple[int, int]:
    """(first bucket limit, later bucket limit) in bytes."""
    cap = int(par.bucket_mb * MIB)
    first = DEFAULT_FIRST_BUCKET_BYTES if par.bucket_mb == DEFAULT_BUCKET_CAP_MB else cap
    return first, cap


def grad_ready_order(params: list) -> list:
    """The order in which a backward pass makes the gradients ready: reverse
    registration, with each LayerNorm's (bias, weight) pair swapped back to
    (weight, bias)."""
    rev = list(reversed(params))
    out, i = [], 0
    while i < len(rev):
        p = rev[i]
        nxt = rev[i + 1] if i + 1 < len(rev) else None
        if (nxt is not None and p.name.endswith(".bias") and "norm" in p.name.rsplit(".", 2)[-2]
                and nxt.name == p.name[:-len("bias")] + "weight"):
            out += [nxt, p]
            i += 2
        else:
            out.append(p)
            i += 1
    return out


def assign_buckets(params: list, elem_bytes: int, limits: tuple[int, int]) -> list:
    """compute_bucket_assignment_by_size for one dtype/device: params in the
    order given (ready order), a bucket closes once its size reaches its limit."""
    first, cap = limits
    buckets, cur, size, limit = [], [], 0, first
    for p in params:
        cur.append(p)
        size += p.numel * elem_bytes
        if size >= limit:
            buckets.append(cur)
            cur, size, limit = [], 0, cap
    if cur:
        buckets.append(cur)
    return buckets


def buckets(model: ModelSpec, par: Parallelism, stage: int = 0) -> list:
    """The rebuilt DDP buckets of a rank of `stage`: lists of Param, in launch order."""
    return assign_buckets(grad_ready_order(rank_params(model, par, stage)), grad_bytes(par), bucket_limits(par))


def gradient_allreduces(model: ModelSpec, par: Parallelism, strategy: str = "ddp") -> list:
    """One all-reduce per bucket per optimizer step, on the dp axis, for every stage."""
    out = []
    if par.dp == 1:
        return out                     # DDP over one rank reduces nothing
    sizes = {}
    for stage in range(par.pp):
        kind = stage_kind(par, stage)
        if kind not in sizes:
            sizes[kind] = [sum(p.numel for p in b) for b in buckets(model, par, stage)]
        bs = sizes[kind]
        for i, numel in enumerate(bs):
            # all_reduce S = the bucket buffer: sum of its gradients' numel x grad bytes
            out.append(op(par, "all_reduce", "dp", numel * grad_bytes(par), count=1, phase="bwd",
                          strategy=strategy, overlap="bwd", label=f"bucket {i + 1}/{len(bs)}", stage=stage))
    return out


def comm_ops(model: ModelSpec, par: Parallelism) -> list:
    par.check_model(model)
    return gradient_allreduces(model, par, "ddp")


