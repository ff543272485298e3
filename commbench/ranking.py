"""`commbench search`: every valid plan of a model on a cluster
(search.enumerate_plans), the ones whose memory fits (memory.py), ranked by the
step time the real predictor gives (predict.predict with the same Times as
`commbench predict`: plan.build(model, par), times.bind(workload.compute_ops)).

Within one search the Times are wrapped in CachedTimes: a collective's time is
asked once per (collective, S, group size, nodes, dtype, bound) instead of once
per CommOp and plan (DDP's equal buckets, the same TP all-reduce in every plan
of one tp and micro-batch), and the pipeline simulations are kept by their
inputs (predict.simulate: plans that differ only in ZeRO-0 or ZeRO-1 run the
same pipeline). Both return what was computed before for the same inputs, so
each plan's prediction is the one `commbench predict` gives for it."""
import dataclasses
import math
from dataclasses import dataclass, field

from commbench import plan as plan_mod
from commbench import predict, search

# the parts of a StepBreakdown that are time not spent computing, for "largest exposed"
EXPOSED_PARTS = (("tp_exposed_s", "TP"), ("pp_exposed_s", "PP"), ("dp_exposed_s", "DP/ZeRO"),
                 ("bubble_s", "bubble"))


class CachedTimes:
    """A predict.Times whose collective times are kept per shape and bound."""

    def __init__(self, inner):
        self.inner = inner
        self._comm = {}

    # what predict reads besides the times
    @property
    def spec(self):
        return self.inner.spec

    @property
    def interference(self):
        return self.inner.interference

    @property
    def notes(self):
        return self.inner.notes

    @property
    def host_runs_ahead(self):
        return self.inner.host_runs_ahead

    @property
    def ranks_share_cores(self):
        return self.inner.ranks_share_cores

    def has_band(self) -> bool:
        return self.inner.has_band()

    def measured(self, op) -> bool:
        return self.inner.measured(op)

    def bind(self, ops):
        if hasattr(self.inner, "bind"):
            self.inner.bind(ops)
        return self

    def compute(self, op, bound: str) -> float:
        return self.inner.compute(op, bound)

    def slowest_rank(self, op, bound: str) -> float:
        return self.inner.slowest_rank(op, bound)

    def spread(self, op) -> float:
        return self.inner.spread(op)

    def burst(self, pieces, group_size: int, num_nodes: int, dtype: str, bound: str):
        return self.inner.burst(pieces, group_size, num_nodes, dtype, bound)

    def comm(self, collective, nbytes, group_size, num_nodes, dtype, bound: str) -> float:
        key = (collective, nbytes, group_size, num_nodes, dtype, bound)
        t = self._comm.get(key)
        if t is None:
            t = self._comm[key] = self.inner.comm(collective, nbytes, group_size, num_nodes, dtype, bound)
        return t

    def comm_op(self, c, bound: str) -> float:
        return self.comm(c.collective, c.nbytes, c.group_size, c.num_nodes, c.dtype, bound)


def peak_tflops(spec, dtype: str, override: float | None = None) -> float | None:
    """Peak dense TFLOPS per GPU for MFU: the override, else the spec's for the dtype, else None."""
    if override is not None:
        if not (override > 0 and math.isfinite(override)):
            raise ValueError(f"--peak-tflops must be a positive finite number, got {override}")
        return override
    if spec is None:
        return None
    from commbench.system import peak_key
    return spec.peak_tflops.get(peak_key(dtype))


def largest_exposed(breakdown: dict) -> tuple:
    """(name, seconds) of the largest part of the step that is not compute or optimizer."""
    key, name = max(EXPOSED_PARTS, key=lambda kn: breakdown[kn[0]])
    return name, breakdown[key]


@dataclass
class Ranked:
    """A plan of the search with its prediction."""
    plan: search.RankedPlan
    prediction: predict.StepBreakdown


@dataclass
class SearchReport:
    model: str
    world: int
    gpus_per_node: int
    global_batch: int
    seq: int
    dtype: str
    gpu_memory_bytes: float
    result: search.SearchResult
    ranked: list                 # Ranked, best first
    peak_tflops: float | None
    notes: list = field(default_factory=list)

    def counts(self) -> dict:
        r = self.result
        return {"enumerated": r.num_enumerated, "invalid": r.num_invalid,
                "valid": r.num_enumerated - r.num_invalid, "too_big": r.num_too_big,
                "unestimated": r.num_unestimated, "ranked": r.num_ranked, "returned": len(self.ranked)}

    def smallest_too_big(self):
        """The dropped plan that needs the least memory (how far the GPU is from fitting any)."""
        return min(self.result.too_big, key=lambda d: d.memory.total, default=None)

    def to_dict(self) -> dict:
        plans = []
        for r in self.ranked:
            sb, par = r.prediction, r.plan.parallelism
            name, secs = largest_exposed(sb.breakdown)
            plans.append({
                "description": search.describe(par),
                "parallelism": dict(dataclasses.asdict(par), num_microbatches=par.num_microbatches),
                "step_time_s": sb.step_time_s, "step_time_low_s": sb.step_time_low_s,
                "step_time_high_s": sb.step_time_high_s, "samples_per_s": sb.samples_per_s,
                "tokens_per_s": sb.tokens_per_s, "tflops_per_gpu": sb.tflops_per_gpu, "mfu": sb.mfu,
                "memory_bytes": r.plan.memory.to_dict(), "breakdown": sb.breakdown,
                "largest_exposed": {"part": name, "time_s": secs}, "critical_stage": sb.critical_stage})
        small = self.smallest_too_big()
        return {
            "model": self.model, "world": self.world, "gpus_per_node": self.gpus_per_node,
            "global_batch": self.global_batch, "seq": self.seq, "dtype": self.dtype,
            "gpu_memory_bytes": self.gpu_memory_bytes, "usable_bytes": self.result.usable_bytes,
            "peak_tflops": self.peak_tflops, "plans": plans, "counts": self.counts(),
            "invalid_reasons": self.result.invalid_reasons,
            "unestimated_reasons": self.result.unestimated_reasons,
            "smallest_too_big": None if small is None else {
                "description": search.describe(small.parallelism), "memory_bytes": small.memory.to_dict(),
                "reason": small.reason},
            "notes": self.notes}


def run(model, world: int, gpus_per_node: int, global_batch: int, times, gpu_memory_bytes: float,
        seq: int = 0, dtype: str = "bf16", top: int = 10, peak: float | None = None,
        reserve_fraction: float = 0.1, **enumerate_kwargs) -> SearchReport:
    """Rank every plan that fits by its predicted step time; keep the best `top`."""
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"--top must be a positive integer, got {top!r}")
    cached = CachedTimes(times)
    predictions, pipelines = {}, {}

    def estimate(model_, par):
        workload = plan_mod.build(model_, par)
        sb = predict.predict(workload, par, cached.bind(workload.compute_ops), peak, pipeline_cache=pipelines)
        predictions[par] = sb
        return sb.step_time_s

    result = search.search(model, world, gpus_per_node, global_batch, gpu_memory_bytes, estimate, top=top,
                           reserve_fraction=reserve_fraction, seq=seq, dtype=dtype, **enumerate_kwargs)
    ranked = [Ranked(p, predictions[p.parallelism]) for p in result.plans]
    return SearchReport(model=model.name, world=world, gpus_per_node=gpus_per_node, global_batch=global_batch,
                        seq=seq or model.seq, dtype=dtype, gpu_memory_bytes=gpu_memory_bytes, result=result,
                        ranked=ranked, peak_tflops=peak, notes=sorted(times.notes.values()))


__all__ = ["CachedTimes", "SearchReport", "Ranked", "run", "peak_tflops", "largest_exposed"]
