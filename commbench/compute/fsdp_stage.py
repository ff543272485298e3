"""ZeRO-2/3 timed in place: one micro-batch's forward and backward of a stage
(modules.LocalStage at the rank's tensor-parallel shard) under FSDP2
`fully_shard`, as training.py wraps it, over the plan's real data-parallel
group: the compute, FSDP's own work and its all-gathers and reduce-scatters
together, as a step runs them. Where the host blocks on FSDP's collectives (a
CPU device) a micro-batch is their sum, each collective paying the ranks'
skew at its call; on a GPU, their overlap as FSDP's streams achieve it. The
predictor takes it in place of the stage's compute, the framework's
micro-batch cost and its FSDP collectives (predict.dp_in_place).

The groups are the plan's dp groups, which need the job to be the plan's
world; otherwise the op is skipped with the reason."""
import torch


def group_plans(ops) -> list:
    """The (world, tp, pp, dp) meshes whose dp groups the ops need."""
    return sorted({tuple(dict(op.params)[k] for k in ("world", "tp", "pp", "dp")) for op in ops if op.impl in PREPARE})


def make_groups(ops, world: int):
    """Create, on every rank at once (collective), the dp groups of each plan
    mesh the ops need that this job (of world ranks) is."""
    from commbench import process_groups
    from commbench.compute import plan_groups
    from commbench.parallel import Parallelism
    for mesh in group_plans(ops):
        w, tp, pp, dp = mesh
        if w == world:
            par = Parallelism(world=w, gpus_per_node=w, tp=tp, pp=pp, dp=dp, global_batch=dp)
            process_groups.cached(("fsdp_dp", mesh), lambda par=par: plan_groups(par.groups["dp"]))


def prepare_microbatch(op, device, dtype):
    """One micro-batch's forward and backward of the stage under FSDP2 over this
    rank's dp group of the plan."""
    import torch.distributed as dist

    from commbench import process_groups
    from commbench.compute import framework, modules
    p = dict(op.params)
    mesh = tuple(p[k] for k in ("world", "tp", "pp", "dp"))
    group = process_groups.lookup(("fsdp_dp", mesh))
    if group is None:
        raise RuntimeError(f"needs the plan's {p['world']} ranks to form its dp groups of {p['dp']}, "
                           f"the job has {dist.get_world_size()}")
    module, inputs = modules.build(op, device, dtype)
    module = framework.fsdp_wrap(module.to(framework.param_dtype(p, dtype)), p, device, group)
    out = module(*inputs)
    return framework.microbatch_call(module, inputs, None if out.dim() == 0 else torch.randn_like(out))


PREPARE = {"fsdp_microbatch": prepare_microbatch}
