"""The data-parallel framework's own cost, timed on one rank: a pipeline stage
(modules.LocalStage at the rank's tensor-parallel shard) trained one
micro-batch at a time (forward, loss.backward() accumulating into the
gradients, as training.py runs it) bare and wrapped in the plan's
data-parallel framework (DDP, with and without no_sync; FSDP2 fully_shard
per block and root, resharding after forward or not), and the optimizer step
bare (Adam) and as the plan runs it (ZeroRedundancyOptimizer; Adam over
FSDP2's DTensor shards).

Each wrapper runs over a process group of its own rank alone, so its
collectives move nothing between ranks: what the wrapped time adds to the
bare one is the framework's work on the rank (hooks, gradient buckets and
their copies, the flat all-gather and reduce-scatter buffers and their copies
in and out, DTensor dispatch, mixed-precision casts, per-parameter optimizer
loops), which the kernel and module timings leave out and the collectives'
own measurements do not hold. The predictor adds wrapped - bare to the
stage's compute (predict.stage_times)."""
import torch

from commbench.compute import modules

# impl -> wrappers it is timed with; "none" is the bare baseline
MICROBATCH_WRAPPERS = ("none", "ddp", "ddp_no_sync", "fsdp", "fsdp_reshard")
OPTIMIZER_WRAPPERS = ("none", "zero1", "fsdp")
_SOLO = {}


def solo_group():
    """This rank's one-rank process group. Every rank of the job creates every
    one-rank group together (torch.distributed.new_subgroups is collective),
    once per process: call it on all ranks before timing any framework op."""
    import torch.distributed as dist
    if "group" not in _SOLO:
        _SOLO["group"], _ = dist.new_subgroups(group_size=1)
    return _SOLO["group"]


def needs_solo_group(ops) -> bool:
    return any(op.impl in PREPARE for op in ops)


def _wrap(module, p, device):
    wrapper = p["wrapper"]
    if wrapper == "none":
        return module
    group = solo_group()
    if wrapper in ("ddp", "ddp_no_sync"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from commbench.strategies import ddp
        return DDP(module, process_group=group, **ddp.bucket_kwargs(p["bucket_mb"]))
    if wrapper in ("fsdp", "fsdp_reshard"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from commbench.strategies import fsdp
        from commbench.training import TORCH_DTYPES
        mesh = DeviceMesh.from_group(group, torch.device(device).type)
        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[p["dtype"]], reduce_dtype=TORCH_DTYPES[p["grad_dtype"]])
        fsdp.apply_fully_shard(module, mesh, reshard_after_forward=wrapper == "fsdp_reshard", mp_policy=mp)
        return module
    raise ValueError(f"unknown data-parallel wrapper {wrapper!r}")


def _param_dtype(p, dtype):
    """Parameters as training.py stores them: the wider of the compute and
    gradient dtypes (bare: the compute dtype)."""
    from commbench.training import TORCH_DTYPES
    g = TORCH_DTYPES[p["grad_dtype"]]
    return g if g.itemsize > dtype.itemsize else dtype


def _microbatch_call(module, inputs, grad_out):
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
        module = _wrap(module.to(_param_dtype(p, dtype)), p, device)
    out = module(*inputs)
    grad_out = None if out.dim() == 0 else torch.randn_like(out)
    call = _microbatch_call(module, inputs, grad_out)
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
    module, inputs = modules.build(op, device, _param_dtype(p, dtype))
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
