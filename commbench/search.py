"""Plan search: every valid Parallelism of a model on a cluster, the ones whose
memory fits (memory.py), ranked by a step-time estimate (the predictor).

The candidate grid: tp over the divisors of gpus-per-node that divide the world
(tensor parallelism stays inside a node), pp over the divisors of world / tp,
dp = world / (tp pp), then micro-batch size, ZeRO stage, sequence parallelism,
interleaving (the schedule is 1F1B, interleaved 1F1B when v > 1; GPipe is not a
candidate: same bubble as 1F1B, more activation memory) and recompute. Values that do not apply are not candidates (they
would repeat another plan): sp without tp, interleave > 1 without pp, a ZeRO
stage > 0 with dp = 1 (sharding over one rank is zero 0). Every other candidate
is built as a Parallelism and checked with check_model; a ValueError from either
makes it invalid (counted, with its message as the reason). One rule is the
search's own: ZeRO-2/3 with pp > 1 is excluded, since DeepSpeed's PipelineEngine
asserts ZeRO stage < 2 and Megatron's distributed optimizer is ZeRO-1 (torch
pipelining with FSDP defers every reduce-scatter and reshard to the end of the
step, so it saves no gradient memory either: memory.py).

The work is linear in the number of candidates: one Parallelism, one check_model
and one memory estimate each (parameter counts are cached per (tp, pp, stage)).
Ranking keeps the best `top` with a heap."""
import heapq
import math
from collections import Counter
from dataclasses import dataclass, field

from commbench.memory import MemoryEstimate, fits, memory_per_gpu
from commbench.models import ModelSpec
from commbench.parallel import RECOMPUTE, Parallelism

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16)
DEFAULT_INTERLEAVE = (1, 2, 3, 4, 6, 8)
EXCLUDED_ZERO_PP = ("zero {z} with pp > 1: ZeRO-2/3 does not combine with pipeline parallelism "
                    "(DeepSpeed's pipeline engine refuses it; Megatron's distributed optimizer is ZeRO-1)")


def describe(par: Parallelism) -> str:
    """One line naming a plan's choices."""
    s = (f"tp={par.tp} pp={par.pp} dp={par.dp} zero={par.zero} sp={int(par.sp)} mb={par.micro_batch} "
         f"m={par.num_microbatches}")
    if par.interleave > 1:
        s += f" v={par.interleave}"
    return s + f" recompute={par.recompute}"


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_choices(name: str, values, allowed=None, positive_int=False) -> tuple:
    values = tuple(values)
    if not values:
        raise ValueError(f"{name}: give at least one value")
    for v in values:
        if positive_int and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}: {v!r} is not a positive integer")
        if allowed is not None and v not in allowed:
            raise ValueError(f"{name}: {v!r} is not one of {', '.join(map(str, allowed))}")
    return values


def enumerate_plans(model: ModelSpec, world: int, gpus_per_node: int, global_batch: int, seq: int = 0,
                    dtype: str = "bf16", micro_batches=DEFAULT_MICRO_BATCHES, zero=(0, 1, 2, 3),
                    sp=(False, True), interleave=DEFAULT_INTERLEAVE, recompute=RECOMPUTE,
                    rejected: Counter | None = None):
    """Yield every valid Parallelism of `model` on `world` GPUs (see the module doc).
    `rejected`, when given, counts the invalid candidates by reason."""
    micro_batches = _check_choices("micro-batches", micro_batches, positive_int=True)
    zero = _check_choices("zero", zero, allowed=(0, 1, 2, 3))
    sp = _check_choices("sp", sp, allowed=(False, True))
    interleave = _check_choices("interleave", interleave, positive_int=True)
    recompute = _check_choices("recompute", recompute, allowed=RECOMPUTE)
    # world, gpus-per-node, the whole-nodes rule, seq and dtype: once, not per candidate
    Parallelism(world=world, gpus_per_node=gpus_per_node, seq=seq, dtype=dtype)
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"global batch must be a positive integer, got {global_batch!r}")
    reject = rejected if rejected is not None else Counter()

    for tp in [d for d in _divisors(gpus_per_node) if world % d == 0]:
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            zs = [z for z in zero if not (z and dp == 1)]
            sps = [s for s in sp if not (s and tp == 1)]
            vs = [v for v in interleave if not (v > 1 and pp == 1)]
            for mb in micro_batches:
                try:
                    # the rules of this level (the global batch split) come first in Parallelism's
                    # checks, so when this probe fails every candidate below fails with its message
                    Parallelism(world=world, gpus_per_node=gpus_per_node, tp=tp, pp=pp, dp=dp,
                                micro_batch=mb, global_batch=global_batch, seq=seq, dtype=dtype)
                except ValueError as e:
                    reject[str(e)] += len(zs) * len(sps) * len(vs) * len(recompute)
                    continue
                for z in zs:
                    for s in sps:
                        for v in vs:
                            for rc in recompute:
                                try:
                                    par = Parallelism(world=world, gpus_per_node=gpus_per_node, tp=tp, pp=pp,
                                                      dp=dp, zero=z, sp=s, micro_batch=mb,
                                                      global_batch=global_batch, seq=seq, dtype=dtype,
                                                      interleave=v, recompute=rc)
                                    par.check_model(model)
                                except ValueError as e:
                                    reject[str(e)] += 1
                                    continue
                                if z >= 2 and pp > 1:         # valid as a Parallelism, not as a run
                                    reject[EXCLUDED_ZERO_PP.format(z=z)] += 1
                                    continue
                                yield par


@dataclass(frozen=True)
class RankedPlan:
    parallelism: Parallelism
    step_time_s: float
    samples_per_s: float        # global batch / step time
    tokens_per_s: float         # samples/s x sequence length
    memory: MemoryEstimate


@dataclass(frozen=True)
class Dropped:
    """A valid plan whose memory does not fit."""
    parallelism: Parallelism
    memory: MemoryEstimate
    usable_bytes: float

    @property
    def reason(self) -> str:
        m = self.memory
        return (f"needs {m.total / 1e9:.1f} GB on stage {m.stage} (weights {m.weights / 1e9:.1f}, gradients "
                f"{m.gradients / 1e9:.1f}, optimizer {m.optimizer_state / 1e9:.1f}, activations "
                f"{m.activations / 1e9:.1f}) > {self.usable_bytes / 1e9:.1f} GB usable")


@dataclass
class SearchResult:
    plans: list                                  # RankedPlan, best (lowest step time) first, at most `top`
    num_enumerated: int                          # candidates built: valid + invalid
    num_invalid: int
    num_too_big: int
    num_ranked: int                              # fitted and estimated (plans holds the best of them)
    num_unestimated: int = 0                     # estimate_fn raised ValueError / NotImplementedError
    invalid_reasons: dict = field(default_factory=dict)       # reason -> count
    unestimated_reasons: dict = field(default_factory=dict)   # reason -> count
    too_big: list = field(default_factory=list)               # Dropped, in enumeration order
    usable_bytes: float = 0.0


def search(model: ModelSpec, world: int, gpus_per_node: int, global_batch: int, gpu_memory_bytes: float,
           estimate_fn, top: int = 10, reserve_fraction: float = 0.1, optimizer: str = "adam",
           **enumerate_kwargs) -> SearchResult:
    """The `top` plans that fit in gpu_memory_bytes (less reserve_fraction), ranked
    by estimate_fn(model, par) -> predicted step time in seconds (lower is better).
    A plan estimate_fn cannot handle (ValueError, NotImplementedError) is counted as
    unestimated with its reason; a non-finite or non-positive time is an error."""
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
    if not callable(estimate_fn):
        raise ValueError(f"estimate_fn must be callable, got {estimate_fn!r}")
    fits(MemoryEstimate(0, 0, 0, 0, 0, 0), gpu_memory_bytes, reserve_fraction)   # validates both, once
    usable = gpu_memory_bytes * (1 - reserve_fraction)
    invalid, unestimated = Counter(), Counter()
    too_big, scored = [], []
    valid = 0
    for par in enumerate_plans(model, world, gpus_per_node, global_batch, rejected=invalid, **enumerate_kwargs):
        valid += 1
        mem = memory_per_gpu(model, par, optimizer)
        if not fits(mem, gpu_memory_bytes, reserve_fraction):
            too_big.append(Dropped(par, mem, usable))
            continue
        try:
            t = estimate_fn(model, par)
        except (ValueError, NotImplementedError) as e:
            unestimated[f"{type(e).__name__}: {e}"] += 1
            continue
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"estimate_fn returned {t!r} for plan {describe(par)}: "
                             "expected a positive, finite step time in seconds")
        scored.append((float(t), len(scored), par, mem))
    plans = []
    for t, _, par, mem in heapq.nsmallest(top, scored):      # ties keep enumeration order
        samples = par.global_batch / t
        plans.append(RankedPlan(par, t, samples, samples * par.seq_for(model), mem))
    n_invalid = sum(invalid.values())
    return SearchResult(plans=plans, num_enumerated=valid + n_invalid, num_invalid=n_invalid,
                        num_too_big=len(too_big), num_ranked=len(scored), num_unestimated=sum(unestimated.values()),
                        invalid_reasons=dict(invalid), unestimated_reasons=dict(unestimated), too_big=too_big,
                        usable_bytes=usable)


__all__ = ["enumerate_plans", "search", "SearchResult", "RankedPlan", "Dropped", "describe"]
