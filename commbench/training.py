"""Real training steps of a plan, timed: the torch implementation of each
strategy (DDP, ZeroRedundancyOptimizer, FSDP2 fully_shard, DTensor tensor
parallelism, torch.distributed.pipelining) on torch_model's transformer, as the
strategy proofs in tests/ build them. `validate` compares these times with the
prediction.

Every rank of an initialized default process group (world size = par.world)
calls train_steps. Ranks are laid out in Megatron order (tp fastest, then dp,
then pp): a DeviceMesh of shape (pp, dp, tp)."""
import functools
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commbench import torch_model
from commbench.models import ModelSpec
from commbench.parallel import Parallelism
from commbench.strategies import ddp, fsdp

LR = 1e-3
TORCH_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def adam_kwargs(device) -> dict:
    """Adam as commbench's training steps run it and its compute ops time it
    (compute/optimizer.py, compute/framework.py): fused on a GPU (as Megatron's
    and torchtitan's optimizers), torch's foreach implementation on a CPU (its
    default there is a per-parameter loop, slower than either)."""
    if torch.device(device).type == "cuda":
        return {"lr": LR, "fused": True}
    return {"lr": LR, "foreach": True}


@dataclass
class StepTimes:
    step_s: list            # per timed step: the slowest rank's duration (s)
    rank_step_s: list       # per timed step: this rank's duration (s)
    losses: list            # per timed step: mean loss over the ranks that computed one
    implementation: str     # what ran, e.g. "DDP(bucket 25 MB) over dp 2, no_sync accumulation; ..."
    warmup: int = 0


# --- builders shared with the strategy proofs ----------------------------------------------------
def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def stage_module(spec: ModelSpec, k: int, nvirt: int, seed: int = 0):
    """Virtual stage k of nvirt of a torch_model.Transformer: layers [k L/nvirt,
    (k+1) L/nvirt); the first keeps the embedding (+ positions), the last the final
    norm and its own output layer (a copy of a tied embedding: pipelining shares no
    weights across stages). Every rank builds the whole model from the same seed."""
    m = torch_model.build(spec, seed)
    per = spec.num_layers // nvirt
    for i in list(m.layers.keys()):
        if not k * per <= int(i) < (k + 1) * per:
            del m.layers[i]
    if k != 0:
        m.embed, m.pos = None, None
    if k != nvirt - 1:
        m.norm, m.head = None, None
    return m


def tp_plan(spec: ModelSpec, sp: bool) -> dict:
    """DTensor tensor-parallel plan of a whole torch_model.Transformer (torch's TP
    tutorial): colwise q/k/v (gate) up, rowwise o and down, vocab-parallel embedding
    and head (logits stay sharded for loss_parallel); with SP the norms are
    SequenceParallel and activations between blocks sequence-sharded."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    seq = {"input_layouts": Shard(1)} if sp else {}
    cols = ["attn.q", "attn.k", "attn.v"] + (["mlp.gate", "mlp.up"] if spec.gated_mlp else ["mlp.up"])
    plan = {}
    for i in range(spec.num_layers):
        for c in cols:
            plan[f"layers.{i}.{c}"] = ColwiseParallel(**seq)
        for r in ("attn.o", "mlp.down"):
            plan[f"layers.{i}.{r}"] = RowwiseParallel(**({"output_layouts": Shard(1)} if sp else {}))
        if sp:
            plan[f"layers.{i}.norm1"] = plan[f"layers.{i}.norm2"] = SequenceParallel()
    plan["head"] = ColwiseParallel(**seq, output_layouts=Shard(-1), use_local_output=False)
    if not sp:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    elif spec.arch == "gpt":    # add the positions to the full sequence, then split it
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())
        plan["layers.0"] = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                              use_local_output=True)
    else:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if sp:
        plan["norm"] = SequenceParallel()
    return plan


# --- what can run -------------------------------------------------------------------------------
def check_plan(model: ModelSpec, par: Parallelism):
    """ValueError naming why validate cannot run this plan as a real torch step."""
    par.check_model(model)
    if par.recompute == "selective":
        raise ValueError("recompute 'selective' is not supported by validate: Megatron recomputes core "
                         "attention only, and torch_model's attention offers no part to checkpoint alone")
    if par.zero_flavour != "torch":
        raise ValueError(f"zero flavour {par.zero_flavour!r} is not supported by validate: it runs torch's "
                         "implementations (DDP, ZeroRedundancyOptimizer, FSDP2), not DeepSpeed")
    if par.grad_dtype != par.dtype and not (par.zero >= 2 and par.dp > 1):
        raise ValueError(f"grad dtype {par.grad_dtype} != dtype {par.dtype} is not supported by validate "
                         "without FSDP (zero 2/3): DDP reduces gradients in the parameters' dtype")
    if par.pp > 1 and par.num_microbatches < par.pp:
        raise ValueError(f"{par.num_microbatches} micro-batches on {par.pp} stages are not supported by validate: "
                         "torch pipelining schedules need at least as many micro-batches as stages")
    virtual = par.pp * (par.interleave if par.schedule == "interleaved" else 1)
    if par.pp > 1 and par.dp > 1 and par.zero < 2 and par.num_microbatches <= virtual:
        stages = f"{virtual} virtual stages (pp {par.pp} x interleave {par.interleave})" if virtual > par.pp else \
            f"{par.pp} stages"
        raise ValueError(f"{par.num_microbatches} micro-batches on {stages} with DDP are not supported by "
                         "validate: DDP's bucket rebuild fails an internal assertion under torch pipelining "
                         "unless there are more micro-batches than virtual stages (rebuilt parameter indices "
                         "twice the parameters, seen with torch 2.13)")


def _check_args(par: Parallelism, steps: int, warmup: int, min_time_s: float = 0.0):
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not min_time_s >= 0:
        raise ValueError(f"min_time_s must be >= 0 seconds, got {min_time_s!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if not dist.is_initialized():
        raise ValueError("train_steps needs an initialized default process group")
    if dist.get_world_size() != par.world:
        raise ValueError(f"plan world {par.world} but the process group has {dist.get_world_size()} ranks")


# --- parallelizing a module -------------------------------------------------------------------
def _device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def apply_tp(module, spec: ModelSpec, par: Parallelism, tp_mesh):
    """DTensor tensor parallelism (tp_plan) of a model or pipeline stage over a
    one-dimensional tp DeviceMesh."""
    from torch.distributed.tensor.parallel import parallelize_module
    present = {k: v for k, v in tp_plan(spec, par.sp).items() if _has(module, k)}
    parallelize_module(module, tp_mesh, present)
    if _tied(module):
        module.head.weight = module.embed.weight      # both Shard(0) over the vocabulary: one DTensor


def _has(module, name: str) -> bool:
    try:
        return module.get_submodule(name) is not None
    except AttributeError:
        return False


def checkpoint_each(blocks):
    """Full recompute: each block's forward under torch.utils.checkpoint
    (non-reentrant), so that the backward runs it again."""
    from torch.utils.checkpoint import checkpoint
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def apply_recompute(module):
    checkpoint_each(module.layers.values())


def _apply_dp(module, par: Parallelism, mesh):
    """The data-parallel wrapper of the plan's ZeRO stage over the dp mesh."""
    if par.dp == 1:
        return module
    if par.zero >= 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[par.dtype], reduce_dtype=TORCH_DTYPES[par.grad_dtype])
        fsdp.apply_fully_shard(module, mesh["dp"], reshard_after_forward=par.zero == 3, mp_policy=mp)
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP
    if par.tp > 1:
        _tp_ddp_transform(module)
    return DDP(module, process_group=mesh["dp"].get_group(), **ddp.ddp_kwargs(par))


def _tp_ddp_transform(module):
    """torch's _pre_dp_module_transform (DTensor parameters held as local tensors
    outside forward), keeping a tied head on the embedding's weight: the transform
    sees a shared parameter once and would leave the head's reference a DTensor."""
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    _pre_dp_module_transform(module)
    if _tied(module):
        _retie(module)
        module.register_forward_pre_hook(lambda m, _: _retie(m))
        module.register_forward_hook(lambda m, _, __: _retie(m))


def _tied(module) -> bool:
    return module.spec.tied_embeddings and module.embed is not None and module.head is not None


def _retie(module):
    del module.head.weight
    module.head.weight = module.embed.weight


def _param_dtype(par: Parallelism) -> torch.dtype:
    """Stored parameters: the widest of dtype and grad dtype (FSDP mixed precision
    casts to dtype for compute and to grad dtype for the reduction)."""
    a, b = TORCH_DTYPES[par.dtype], TORCH_DTYPES[par.grad_dtype]
    return a if a.itemsize >= b.itemsize else b


def _parallelize(raw, spec: ModelSpec, par: Parallelism, mesh, dev):
    raw.to(device=dev, dtype=_param_dtype(par))
    if par.tp > 1:
        apply_tp(raw, spec, par, mesh["tp"])
    if par.recompute == "full":
        apply_recompute(raw)
    return _apply_dp(raw, par, mesh)


def adam_groups(params) -> list:
    """The parameters as Adam's groups: DTensors apart from plain tensors (the
    foreach and fused implementations cannot mix them in one call; a TP plan
    under DDP holds both)."""
    from torch.distributed.tensor import DTensor
    params = list(params)
    split = [[p for p in params if not isinstance(p, DTensor)], [p for p in params if isinstance(p, DTensor)]]
    return [{"params": group} for group in split if group]


def _optimizer(params, par: Parallelism, mesh):
    kwargs, groups = adam_kwargs(mesh.device_type), adam_groups(params)
    if par.zero == 1 and par.dp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.Adam,
                                       process_group=mesh["dp"].get_group(), **kwargs)
    return torch.optim.Adam(groups, **kwargs)


def _describe(par: Parallelism, dev: torch.device, tp_impl: str = "dtensor") -> str:
    parts = []
    if par.tp > 1 and tp_impl == "megatron":
        parts.append(f"Megatron-style TP x {par.tp} in plain torch (column/row-parallel, vocab-parallel "
                     "embedding and cross-entropy)")
    elif par.tp > 1:
        parts.append(f"DTensor TP x {par.tp} (colwise/rowwise{', SequenceParallel' if par.sp else ''}, "
                     "vocab-parallel embedding, loss_parallel)")
    if par.pp > 1:
        parts.append(f"pipelining {_schedule_class(par).__name__} over pp {par.pp}"
                     f"{f' x {par.interleave} chunks' if par.interleave > 1 else ''}, "
                     f"{par.num_microbatches} micro-batches")
    if par.dp > 1:
        bucket = f"DDP(bucket {par.bucket_mb:g} MB)"
        accumulation = "" if par.pp > 1 else ", no_sync accumulation"
        parts.append({0: f"{bucket} over dp {par.dp}{accumulation}",
                      1: f"{bucket} + ZeroRedundancyOptimizer(Adam) over dp {par.dp}{accumulation}",
                      2: f"FSDP2 fully_shard per block + root, reshard_after_forward=False over dp {par.dp}",
                      3: f"FSDP2 fully_shard per block + root, reshard_after_forward=True over dp {par.dp}",
                      }[par.zero])
    if par.pp == 1 and par.num_microbatches > 1:
        parts.append(f"{par.num_microbatches} micro-batches accumulated")
    if par.recompute == "full":
        parts.append("full recompute (torch.utils.checkpoint per block)")
    impl = "fused" if "fused" in adam_kwargs(dev) else "foreach"
    parts.append(f"Adam ({impl}) lr {LR:g}; {par.dtype}"
                 + (f", reduce in {par.grad_dtype}" if par.grad_dtype != par.dtype else "")
                 + f"; micro-batch {par.micro_batch}; {dev.type}")
    return "; ".join(parts if len(parts) > 1 else ["single replica"] + parts)


# --- data and loss ------------------------------------------------------------------------------
def _tokens(spec: ModelSpec, shape: tuple, seed: int, dev):
    """(inputs, targets): random tokens, the same on every rank given the seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, spec.vocab, shape, generator=gen)
    y = torch.randint(0, spec.vocab, shape, generator=gen)
    return x.to(dev), y.to(dev)


def _data_seed(seed: int, dp_i: int) -> int:
    """Replicas of a dp group see different data; tp ranks and pipeline stages of
    one replica the same."""
    return seed * 100_003 + dp_i + 1


def loss_context(par: Parallelism):
    if par.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()
    return nullcontext()


def _plain(t):
    """A loss as a plain tensor (under loss_parallel it is a replicated DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --- the step of each kind of plan --------------------------------------------------------------
def megatron_tp_module(spec: ModelSpec, par: Parallelism, tp_group, dev, dtype, seed: int):
    """This rank's shard of Megatron-style TP (megatron_tp.py) over tp_group, its
    layers checkpointed under full recompute; called as model(tokens, targets) -> loss."""
    from commbench import megatron_tp
    raw = megatron_tp.Transformer(spec, dist.get_rank(tp_group), par.tp, tp_group, seed)
    raw.to(device=dev, dtype=dtype)
    if par.recompute == "full":
        checkpoint_each(raw.layers)
    return raw


def _megatron_tp_model(spec: ModelSpec, par: Parallelism, mesh, dev, seed: int):
    """Megatron-style TP on the tp mesh, then the plan's DP wrapper."""
    raw = megatron_tp_module(spec, par, mesh["tp"].get_group(), dev, _param_dtype(par), seed)
    if par.dp > 1 and par.zero >= 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[par.dtype], reduce_dtype=TORCH_DTYPES[par.grad_dtype])
        from torch.distributed.fsdp import fully_shard
        for layer in raw.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=par.zero == 3, mp_policy=mp)
        fully_shard(raw, mesh=mesh["dp"], reshard_after_forward=par.zero == 3, mp_policy=mp)
        return raw
    if par.dp > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(raw, process_group=mesh["dp"].get_group(), **ddp.ddp_kwargs(par))
    return raw


def _flat_step(spec: ModelSpec, par: Parallelism, mesh, dev, seed: int, tp_impl: str = "dtensor"):
    """One optimizer step without pipelining: m micro-batches accumulated."""
    megatron = tp_impl == "megatron" and par.tp > 1
    if megatron:
        model = _megatron_tp_model(spec, par, mesh, dev, seed)
    else:
        model = _parallelize(torch_model.build(spec, seed), spec, par, mesh, dev)
    opt = _optimizer(list(model.parameters()), par, mesh)
    m = par.num_microbatches
    x, y = _tokens(spec, (m, par.micro_batch, par.seq_for(spec)), _data_seed(seed, mesh["dp"].get_local_rank()), dev)
    batches = list(zip(x, y))
    is_ddp = hasattr(model, "no_sync")

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i, (x, y) in enumerate(batches):
            no_sync = model.no_sync() if is_ddp and i < m - 1 else nullcontext()
            with no_sync, (nullcontext() if megatron else loss_context(par)):
                loss = (model(x, y) if megatron else lm_loss(model(x), y)) / m
                loss.backward()
            total = total + _plain(loss.detach())
        opt.step()
        return total
    return step


def _schedule_class(par: Parallelism):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    if par.schedule == "interleaved":
        return ScheduleInterleaved1F1B
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[par.schedule]


def _tied_groups(par: Parallelism):
    """{(dp_i, tp_i): group of the first and the last pipeline stage}
    (pp.embedding_groups, which the plan's all-reduce is measured on): created
    on every rank, in the same order."""
    from commbench.strategies import pp
    return {par.coords(g[0])[1:]: dist.new_group(list(g)) for g in pp.embedding_groups(par)}


def _tied_allreduce(spec: ModelSpec, par: Parallelism, chunks: list):
    """Megatron's _allreduce_word_embedding_grads: the first stage's embedding and
    the last stage's head copy of it sum their gradients (pipelining cannot)."""
    if not spec.tied_embeddings:
        return lambda: None
    groups = _tied_groups(par)
    pp_i, dp_i, tp_i = par.coords(dist.get_rank())
    if pp_i not in (0, par.pp - 1):
        return lambda: None
    weight = chunks[0].embed.weight if pp_i == 0 else chunks[-1].head.weight
    group = groups[(dp_i, tp_i)]

    @torch.no_grad()
    def reduce():
        g = weight.grad
        if hasattr(g, "redistribute"):
            # DTensor TP leaves a stage's embedding gradient Replicate, the head's Shard(0)
            g = weight.grad = g.redistribute(placements=weight.placements)
            g = g.to_local()
        dist.all_reduce(g, group=group)
    return reduce


def _pipeline_step(spec: ModelSpec, par: Parallelism, mesh, dev, seed: int):
    """One optimizer step of torch.distributed.pipelining: this rank's stage (or
    interleave chunks), each parallelized like a whole model."""
    return pipeline(spec, par, mesh, dev, seed)[0]


def pipeline(spec: ModelSpec, par: Parallelism, mesh, dev, seed: int) -> tuple:
    """(one optimizer step of the pipeline, this rank's PipelineStages, one per
    interleave chunk, virtual stage c * pp + the rank's pp index, the schedule,
    the rank's optimizer)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti
    pp_i, v, nvirt = mesh["pp"].get_local_rank(), par.interleave, par.pp * par.interleave
    chunks = [stage_module(spec, c * par.pp + pp_i, nvirt, seed) for c in range(v)]
    mods = [_parallelize(c, spec, par, mesh, dev) for c in chunks]
    stages = [PipelineStage(mod, c * par.pp + pp_i, nvirt, dev, group=mesh["pp"].get_group())
              for c, mod in enumerate(mods)]
    cls, m = _schedule_class(par), par.num_microbatches
    sched = cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0], m, loss_fn=lm_loss)
    tied = _tied_allreduce(spec, par, chunks)
    opt = _optimizer([p for mod in mods for p in mod.parameters()], par, mesh)
    x, y = _tokens(spec, (par.micro_batch * m, par.seq_for(spec)), _data_seed(seed, mesh["dp"].get_local_rank()),
                   dev)
    first, last = pp_i == 0, pp_i == par.pp - 1

    def step():
        opt.zero_grad(set_to_none=True)
        losses = []
        with loss_context(par):
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        tied()
        opt.step()
        return torch.stack([_plain(t.detach()) for t in losses]).mean() if losses else None
    return step, stages, sched, opt


# --- timing -------------------------------------------------------------------------------------
def _timed(step, warmup: int, steps: int, dev, on_step=None, min_time_s: float = 0.0) -> tuple:
    """This rank's duration and loss of each step, each started together:
    warmup steps, then steps timed ones and, with min_time_s > 0, more until
    the timed steps took min_time_s (the slowest rank's total): past steps,
    the all-reduce of that total starts each step in place of the barrier, so
    every rank stops at the same step. on_step(i, durations so far), if
    given, is told before step i (i counts the warmup)."""
    durations, losses = [], []
    while True:
        i = len(durations)
        if on_step:
            on_step(i, durations)
        if i < warmup + steps:
            dist.barrier()
        elif min_time_s <= 0 or _slowest_total(durations[warmup:], dev) >= min_time_s:
            return durations, losses
        t0 = time.perf_counter()
        loss = step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        durations.append(time.perf_counter() - t0)
        losses.append(loss)


def _slowest_total(durations: list, dev) -> float:
    """The largest sum of durations over the ranks (a collective)."""
    t = torch.tensor([sum(durations)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _over_ranks(durations: list, losses: list, dev) -> tuple:
    """(max duration over ranks, mean loss over the ranks that computed one) per step."""
    t = torch.tensor(durations, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ls = torch.zeros(len(losses), 2, dtype=torch.float64, device=dev)
    for i, loss in enumerate(losses):
        if loss is not None:
            ls[i, 0], ls[i, 1] = float(loss), 1.0
    dist.all_reduce(ls)
    return t.tolist(), [s / w if w else math.nan for s, w in ls.tolist()]


def train_steps(model: ModelSpec, par: Parallelism, steps: int, warmup: int = 2, device: str = "cpu",
                seed: int = 0, tp_impl: str = "dtensor", on_step=None, min_time_s: float = 0.0) -> StepTimes:
    """Run warmup + steps real optimizer steps of the plan on this rank (every rank
    of the default group calls it) and time them. ValueError for a plan that
    cannot run. on_step(i, durations so far), if given, is told before each step
    (i counts the warmup) and, with i None, before the final exchange.
    min_time_s > 0 times more than steps steps where they are short: until
    the timed steps took min_time_s (_timed)."""
    check_plan(model, par)
    _check_args(par, steps, warmup, min_time_s)
    from torch.distributed.device_mesh import init_device_mesh
    dev = _device(device)
    mesh = init_device_mesh(dev.type, (par.pp, par.dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))
    if tp_impl not in ("dtensor", "megatron"):
        raise ValueError(f"tp implementation {tp_impl!r}: choose dtensor or megatron")
    if tp_impl == "megatron" and par.tp > 1:
        from commbench.strategies import tp
        why = tp.implementation_limit(model, par, "megatron")
        if why:
            raise ValueError(f"tp implementation megatron does not support {why}: use dtensor")
    step = _pipeline_step(model, par, mesh, dev, seed) if par.pp > 1 else \
        _flat_step(model, par, mesh, dev, seed, tp_impl)
    durations, losses = _timed(step, warmup, steps, dev, on_step, min_time_s)
    if on_step:
        on_step(None, durations)
    step_s, mean_losses = _over_ranks(durations, losses, dev)
    return StepTimes(step_s=step_s[warmup:], rank_step_s=durations[warmup:], losses=mean_losses[warmup:],
                     implementation=_describe(par, dev, tp_impl), warmup=warmup)
