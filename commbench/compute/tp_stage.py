"""Tensor parallelism timed in place: one micro-batch's forward and backward of
a pipeline stage as the plan's TP implementation runs it (Megatron-style TP of
megatron_tp.py, or DTensor's tp_plan), over the rank's real tensor-parallel
group: tp consecutive ranks of the job, as Megatron lays them out.

The time holds the stage's compute, its TP collectives on the critical path as
they run between the kernels that feed them (the ranks' skew at every one, the
collectives' latency when they follow compute rather than each other), and
the implementation's own work (autograd functions around each collective;
DTensor's dispatch and redistribution). The predictor takes it for the
stage's compute plus TP communication where it was measured
(predict.stage_times); the kernel and module timings and the collectives timed
back to back are what it falls back on elsewhere (a tp that the job's ranks
cannot form, a SystemSpec).

The op needs tp ranks (a job whose world size is not a multiple of tp skips it,
with the reason in the results) and host memory for the whole model, which it
builds in fp32 to cut the rank's shard from (compute.runner.host_build_bytes)."""
import json

import torch


def tp_group(tp: int):
    """This rank's group of tp consecutive ranks, made as training makes its TP
    group (compute.plan_groups). Every rank of the job creates every such group
    together (collective): call it on all ranks before timing."""
    import torch.distributed as dist

    from commbench import process_groups
    from commbench.compute import plan_groups
    world = dist.get_world_size()
    return process_groups.cached(("tp", tp), lambda: plan_groups([range(r, r + tp) for r in range(0, world, tp)]))


def group_sizes(ops, world: int) -> list:
    """The tp sizes whose groups the ops need and this job can form."""
    sizes = {dict(op.params)["tp"] for op in ops if op.impl in PREPARE}
    return sorted(tp for tp in sizes if world % tp == 0)


def _plan(p):
    from commbench.models import ModelSpec
    from commbench.parallel import Parallelism
    spec = ModelSpec(**json.loads(p["model"]))
    par = Parallelism(world=p["tp"] * p["pp"], gpus_per_node=p["tp"], tp=p["tp"], pp=p["pp"], sp=p["sp"],
                      micro_batch=p["micro_batch"], seq=p["seq"], dtype=p["dtype"], recompute=p["recompute"])
    return spec, par


def prepare_microbatch(op, device, dtype):
    """One micro-batch's forward and backward of the stage over this rank's tp group."""
    import torch.distributed as dist

    from commbench import training
    p = dict(op.params)
    world = dist.get_world_size()
    if world % p["tp"]:
        raise RuntimeError(f"needs a multiple of tp = {p['tp']} ranks to form tensor-parallel groups, "
                           f"the job has {world}")
    spec, par = _plan(p)
    group, dev, stage = tp_group(p["tp"]), torch.device(device), op.stage
    g = torch.Generator().manual_seed(0)
    b, s, h = par.micro_batch, par.seq_for(spec), spec.hidden
    tokens = torch.randint(0, spec.vocab, (b, s), generator=g).to(dev)
    target = torch.randint(0, spec.vocab, (b, s), generator=g).to(dev)
    if p["flavour"] == "megatron":
        module = training.megatron_tp_module(spec, par, group, dev, dtype, seed=0)

        def call():
            module(tokens, target).backward()
        return _after_an_update(module, call)
    from torch.distributed.device_mesh import DeviceMesh
    module = training.stage_module(spec, stage, par.pp, seed=0).to(device=dev, dtype=dtype)
    training.apply_tp(module, spec, par, DeviceMesh.from_group(group, dev.type))
    if par.recompute == "full":
        training.apply_recompute(module)
    first, last = stage == 0, stage == par.pp - 1
    # a later stage's input: the activation the stage before sends (sequence-sharded under SP)
    x = tokens if first else torch.randn(b, s // par.tp if par.sp else s, h, generator=g).to(dev, dtype)
    if not first:
        x.requires_grad_(True)
    if last:
        def call():
            with training.loss_context(par):
                training.lm_loss(module(x), target).backward()
        return _after_an_update(module, call)
    grad = torch.randn_like(module(x))

    def call():
        module(x).backward(grad)
    return _after_an_update(module, call)


def _after_an_update(module, call):
    """The micro-batch call, on weights that one optimizer step has updated, as
    in the training steps that validate times after its warmup: on a CPU, a
    freshly initialized torch_model computes on denormal numbers and runs up to
    2.5 times slower until its first update."""
    from commbench.training import LR
    call()
    torch.optim.Adam(module.parameters(), lr=LR).step()
    module.zero_grad(set_to_none=True)
    return call


PREPARE = {"tp_microbatch": prepare_microbatch}
