"""The data-parallel framework's own cost, timed on one rank: a pipeline stage
(modules.LocalStage at the rank's tensor-parallel shard) trained one
micro-batch at a time (forward, loss.backward() accumulating into the
gradients, as training.py runs it) bare and wrapped in the plan's
data-parallel framework (DDP, with and without no_sync; FSDP2 fully_shard
per block and root, resharding after forward or not), and the optimizer step
bare (Adam) and as the plan runs it (ZeroRedundancyOptimizer; Adam over
FSDP2's DTensor shards).

Each wrapper runs over a process group of its own rank alone, and an FSDP
micro-batch over a fake group of the plan's dp ranks (torch's "fake" backend,
where the job's world is a multiple of dp; else alone): on one rank FSDP2
skips its all-gather's copy-in and copy-out and the flat buffers (tiny-gpt,
ZeRO-3, one micro-batch on this 2-core VM: 8.2 ms over a one-rank gloo group,
10.5 ms over a fake group of 2). Either way its collectives move nothing
between ranks: what the wrapped time adds to the
bare one is the framework's work on the rank (hooks, gradient buckets and
their copies, the flat all-gather and reduce-scatter buffers and their copies
in and out, DTensor dispatch, mixed-precision casts, per-parameter optimizer
loops), which the kernel and module timings leave out and the collectives'
own measurements do not hold. The predictor adds wrapped - bare to the
stage's compute (predict.stage_times)."""
import torch

from commbench import process_groups
from commbench.compute import modules

# impl -> wrappers it is timed with; "none" is the bare baseline
MICROBATCH_WRAPPERS = ("none", "ddp", "ddp_no_sync", "fsdp", "fsdp_reshard")
OPTIMIZER_WRAPPERS = ("none", "zero1", "fsdp")


def solo_group():
    """This rank's one-rank process group (created by prepare_groups)."""
    return process_groups.lookup(("framework", 1))


def fake_group(size: int):
    """This rank's fake process group of size ranks (torch's "fake" backend: its
    collectives move and compute nothing), or None where prepare_groups could
    not make one (the job's world is not a multiple of size)."""
    return process_groups.lookup(("framework", size))


def prepare_groups(ops, world: int):
    """Create, on every rank of the job at once and in the same order (group
    creation is collective), the groups the framework ops of ops are wrapped
    over: each rank alone, and for the FSDP micro-batches a fake group of the
    plan's dp ranks, so that FSDP2 runs its dp > 1 path (on a one-rank group it
    skips the all-gather's copy-in and copy-out and the flat buffers) without
    moving anything. Once per process_groups.scope; nothing without framework ops."""
    import importlib

    import torch.distributed as dist
    ops = [op for op in ops if op.impl in PREPARE]
    if not ops:
        return
    process_groups.cached(("framework", 1), lambda: dist.new_subgroups(group_size=1)[0])
    sizes = sorted({dict(op.params)["dp"] for op in ops if dict(op.params)["wrapper"].startswith("fsdp")})
    for n in sizes:
        if n > 1 and world % n == 0:
            importlib.import_module("torch.testing._internal.distributed.fake_pg")   # registers "fake"
            process_groups.cached(("framework", n), lambda n=n: dist.new_subgroups(group_size=n, backend="fake")[0])


def group_note(op) -> str | None:
    """Why an FSDP micro-batch ran over this rank alone rather than a fake dp
    group, or None."""
    p = dict(op.params)
    if op.impl == "dp_microbatch" and p["wrapper"].startswith("fsdp") and p["dp"] > 1 and not fake_group(p["dp"]):
        return (f"FSDP over this rank alone, not a fake group of dp = {p['dp']} (the job's ranks are not a "
                "multiple of it): FSDP2's all-gather copy-in and copy-out at dp > 1 are left out")
    return None


def _wrap(module, p, device, micro_batch: bool = False):
    """module under the op's wrapper, over this rank alone; an FSDP micro-batch
    (micro_batch) over a fake group of the plan's dp ranks where there is one."""
    wrapper = p["wrapper"]
    if wrapper == "none":
        return module
    group = solo_group()
    if wrapper in ("ddp", "ddp_no_sync"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from commbench.strategies import ddp
        return DDP(module, process_group=group, **ddp.bucket_kwargs(p["bucket_mb"]))
    if wrapper in ("fsdp", "fsdp_reshard"):
        return fsdp_wrap(module, p, device, (fake_group(p["dp"]) if micro_batch else None) or group)
    raise ValueError(f"unknown data-parallel wrapper {wrapper!r}")


def fsdp_wrap(module, p, device, group):
    """module under FSDP2 as training.py shards it (fully_shard per block and
    root, the op's mixed precision; resharding after forward for wrapper
    fsdp_reshard) over group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from commbench.strategies import fsdp
    from commbench.training import TORCH_DTYPES
    mesh = DeviceMesh.from_group(group, torch.device(device).type)
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[p["dtype"]], reduce_dtype=TORCH_DTYPES[p["grad_dtype"]])
    fsdp.apply_fully_shard(module, mesh, reshard_after_forward=p["wrapper"] == "fsdp_reshard", mp_policy=mp)
    return module


def param_dtype(p, dtype):
    """Parameters as training.py stores them: the wider of the compute and
    gradient dtypes (bare: the compute dtype)."""
    from commbench.training import TORCH_DTYPES
    g = TORCH_DTYPES[p["grad_dtype"]]
    return g if g.itemsize > dtype.itemsize else dtype


def microbatch_call(module, inputs, grad_out):
    def call():
        out = module(*inputs)
        if out.dim() == 0:
            out.backward()
        else:
            out.backward(grad_out)
    return call


def prepare_microbatch(op, device, dtype):
    """One micro-batch's forward and backward of the stage, bare or wrapped."""
    p = dict(op.params)
    module, inputs = modules.build(op, device, dtype)
    if p["wrapper"] != "none":
        module = _wrap(module.to(param_dtype(p, dtype)), p, device, micro_batch=True)
    out = module(*inputs)
    grad_out = None if out.dim() == 0 else torch.randn_like(out)
    call = microbatch_call(module, inputs, grad_out)
    if p["wrapper"] == "ddp_no_sync":
        inner = call

        def call():
            with module.no_sync():
                inner()
    return call


def prepare_optimizer(op, device, dtype):
    """The optimizer step over the stage's parameters (gradients filled by one
    micro-batch first): Adam bare, ZeroRedundancyOptimizer on a DDP stage, or
    Adam over an FSDP2 stage's sharded parameters."""
    from commbench.training import adam_groups, adam_kwargs
    p = dict(op.params)
    wrapper = p["wrapper"]
    module, inputs = modules.build(op, device, param_dtype(p, dtype))
    module = _wrap(module, dict(p, wrapper={"zero1": "ddp", "none": "none"}.get(wrapper, "fsdp")), device)
    out = module(*inputs)
    out.backward(None if out.dim() == 0 else torch.randn_like(out))
    params = adam_groups(q for q in module.parameters() if q.requires_grad)
    if wrapper == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, process_group=solo_group(),
                                      **adam_kwargs(device))
    else:
        opt = torch.optim.Adam(params, **adam_kwargs(device))
    return opt.step


PREPARE = {"dp_microbatch": prepare_microbatch, "dp_optimizer": prepare_optimizer}
