"""Workload + times -> StepBreakdown: the training step reconstructed from
measured (or SystemSpec-modelled) kernels and collectives (DESIGN.md,
"Prediction").

Composition, for each pipeline stage (every rank of a stage does the same):
1. Per micro-batch, the stage's forward and backward are its compute kernels
   (ComputeOps x calls per micro-batch) plus its tensor-parallel collectives,
   which sit on the critical path of every layer (Megatron issues them
   synchronously between the GEMMs).
2. The pipeline schedule (GPipe, 1F1B, interleaved 1F1B) is simulated with those
   per-chunk times and the measured p2p time of each stage boundary
   (schedule.simulate_pipeline; in GPipe and 1F1B a transfer ends one p2p
   time after the later of its send's and its receive's posts, and in 1F1B
   neighbouring stages exchange their activation and gradient and wait for
   both, as torch's Schedule1F1B and Megatron do); with pp = 1 it is m
   forwards and backwards in a row.
3. DP / ZeRO collectives are placed on that timeline on one communication
   stream (a communicator runs its collectives in issue order):
   - an op issued every micro-batch (count a multiple of m) goes into every
     micro-batch's forward or backward, else (DDP buckets under no_sync, once
     per step) into the last micro-batch's;
   - within a forward or backward, ops of one call each (DDP buckets, ZeRO-2 or
     FSDP units listed one by one) are spread by their cumulative bytes (a
     bucket is ready when the backward has produced that share of the
     gradients: backward time taken as proportional to parameters); an op folded
     over k equal units is spread evenly, one call per 1/k of the interval;
   - gradient reductions (all_reduce, reduce_scatter) become ready when their
     part of the backward ends and never hold compute back: what is left after
     the stage's last backward is exposed;
   - ops that overlap nothing (overlap "none": FSDP's reduce-scatters under
     pipelining, deferred to the end of the step) run, call after call, once
     the stage's last backward has ended;
   - under pipelining, DDP's bucket all-reduces (DDP, torch's ZeRO-1) hold the
     stage: torch.distributed.pipelining runs each chunk's last backward with
     DDP's reducer armed, and DDP's finalize, inside that backward, waits for
     the buckets, so the stage sends its gradient upstream only when its
     reduction is done. What compute does not cover of a chunk's buckets
     becomes a hold of its last backward (held_by_finalize, chunk_holds,
     schedule.simulate_pipeline's hold_s) and the pipeline is simulated again
     with the holds: a stage's exposed all-reduce delays every stage upstream,
     in series, and each stage's dp_exposed_s holds what the holds (its own and
     those downstream) add to its end. (Megatron and DeepSpeed wait for their
     DP reductions only after the pipeline flush, where the stages' run side
     by side; the predictor models torch's, which validate trains.)
   - parameter all-gathers (ZeRO-3 / FSDP, forward and backward; folded over k
     units or listed unit by unit) are prefetched
     one unit ahead (issued when the previous unit starts) and gate their own
     unit: compute waits for an all-gather that has not arrived, and that wait
     is exposed (FSDP's first all-gather of a forward is therefore always exposed);
     on a CPU device the forward's gathers are not ahead: FSDP2 issues a unit's
     gather at its pre-forward, which a GPU's host reaches while the previous
     unit's kernels still run, but a CPU only once they are done (backward
     gathers are prefetched explicitly, on both);
   - with interference factors (compute --interference), a collective that runs
     under compute takes comm_slowdown times longer, and the compute it
     overlaps runs compute_slowdown times slower meanwhile (it ends
     (1 - 1/compute_slowdown) x the overlap later).
   - the gradient synchronisation waits for the last of the dp group's R ranks:
     a rank's compute between two synchronisations varies by sigma (its calls'
     measured spreads, independent), and the last arrives E[max of R standard
     normals] sigma after the mean (straggler_wait; in dp_exposed_s), unless
     the measured ranks shared a machine's cores (more threads than cores, on
     a CPU): a rank that waits yields its core to the others, so the last one
     catches up and the step ends when their work is done, which the calls'
     means timed side by side already hold.
4. After the pipeline and the DP tail: once-per-step collectives (ZeRO-1
   parameter broadcasts / all-gathers, one after another as a stream or gloo's
   queue runs them; the tied-embedding all-reduce; the sequence-parallel
   norm-gradient all-reduce) and the optimizer step, in series.
The step time is the slowest stage's end.

Breakdown (of the critical stage; the parts sum to the step time):
  compute_s     its forward and backward kernels (recompute included)
  tp_exposed_s  its tensor-parallel collectives (all on the critical path)
  bubble_s      pipeline idle time with p2p taken as free (fill and drain)
  pp_exposed_s  what the p2p adds to the pipeline, plus the tied-embedding all-reduce
  dp_exposed_s  DP/ZeRO time compute did not cover, the wait for the last dp rank,
                plus once-per-step DP collectives
  optimizer_s   the optimizer step
  hidden_comm_s DP/ZeRO collective time hidden under compute (not part of the sum)
Measured times enter as means (a step is a sum of calls: its expected time is
the sum of the calls' means; the median of a skewed timing distribution would
undercount it). Uncertainty band: the whole composition again with every time
at the low and at the high end of its 95 % CI (of the mean), extremes moving
together, so the band is conservative.
Model FLOPs (TFLOPS per GPU, MFU) count every GEMM and attention op once,
without recompute: Megatron's 72 B s L h^2 (1 + s/6h + V/(12 L h)) for a GPT."""
import math
from dataclasses import asdict, dataclass, field, replace

from commbench import schedule

BOUNDS = ("mid", "low", "high")
GATHERS = ("all_gather",)


@dataclass
class StepBreakdown:
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float | None
    breakdown: dict
    step_time_low_s: float
    step_time_high_s: float
    critical_stage: int
    stages: list = field(default_factory=list)     # per stage: its end and its parts
    notes: list = field(default_factory=list)      # interpolated / extrapolated / spec inputs

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- inputs
# Measured times enter the composition as their means (stats.central): a step is
# a sum of calls, whose expected time is the sum of the calls' means.
STATISTIC = "mean"


def central_time(m, bound: str) -> float:
    """A compute measurement's time at a bound (mid, low, high), scaled to the op it
    stands for (runner.scale): the mean of its slowest rank's own samples where
    the measurement holds every rank's (a rank's step sums its own calls, and the
    step waits for the slowest rank: the per-call maximum over ranks would add
    every rank's noise, and on an oversubscribed CPU count the ranks' turns on
    the cores as time); else the mean of the per-call maxima."""
    import numpy as np

    from commbench.compute.runner import scale
    from commbench.stats import central
    own = [np.asarray(s, dtype=np.float64) for s in (m.rank_samples_s or []) if s]
    if own:
        slowest = max(own, key=np.mean)
        spread = {"time_mean_s": float(slowest.mean()),
                  "time_stdev_s": float(slowest.std(ddof=1)) if len(slowest) > 1 else 0.0}
        mid, lo, hi = central(spread, len(slowest), STATISTIC)
    else:
        mid, lo, hi = central(m.stats, m.iters, STATISTIC)
    return {"mid": mid, "low": lo, "high": hi}[bound] * scale(m)


def spread_s(m) -> float:
    """The standard deviation of one call of a compute measurement on one rank
    relative to its peers (scaled as central_time scales the call): what makes
    ranks arrive apart at a synchronisation. Where the measurement holds two or
    more ranks' own samples (timed side by side), stats.relative_spread: a
    slowdown common to every rank at the same call (the machine's speed
    drifting) makes no rank wait for another, and a rank that is slower
    throughout is the slowest rank's mean already (central_time). With one
    rank's samples, their standard deviation; without any, that of the
    per-call maxima."""
    import numpy as np

    from commbench.compute.runner import scale
    from commbench.stats import relative_spread
    own = [s for s in (m.rank_samples_s or []) if len(s) > 1]
    if len(own) >= 2:
        sd = relative_spread(own)
    elif own:
        sd = float(np.std(own[0], ddof=1))
    else:
        sd = float(m.stats.get("time_stdev_s") or 0.0)
    return sd * scale(m)


class Times:
    """Seconds of one call of a ComputeOp or a CommOp, at a bound (p50, low,
    high), from measured compute results (runner.match) or a SystemSpec, and a
    CommModel. Collects a note for every input that was not measured as is."""

    def __init__(self, comm_model, matched=None, spec=None, interference=None):
        self.comm_model, self.matched, self.spec = comm_model, matched or {}, spec
        self.interference = interference or {}
        self.notes = {}
        # whether the host issues work ahead of the device that runs it (a GPU's
        # stream): a CPU "device" runs each op as the host reaches it
        self.host_runs_ahead = True
        # whether the measured ranks shared a machine's cores (straggler_wait)
        self.ranks_share_cores = False

    def measured(self, op) -> bool:
        return op in self.matched

    def has_band(self) -> bool:
        """Whether the low and high bounds can differ from the central time (False
        only where every time comes from a SystemSpec, which has no spread)."""
        return True

    def compute(self, op, bound: str) -> float:
        m = self.matched.get(op)
        if m is not None:
            return central_time(m, bound)
        if self.spec is None:
            raise ValueError(f"no compute measurement of {op.name} ({op.impl} {op.m}x{op.n}x{op.k} {op.dtype}): "
                             "run commbench compute with the same plan flags, or give --system")
        self.notes.setdefault(("compute-spec",), f"compute times from SystemSpec {self.spec.name} (not measured)")
        return self.spec.compute_time_s(op)

    def spread(self, op) -> float:
        """spread_s of a measured op (computed once per op: every bound and
        composition asks again); 0 for a time from a SystemSpec (no spread known)."""
        m = self.matched.get(op)
        if m is None:
            return 0.0
        cache = self.__dict__.setdefault("_spreads", {})
        if op not in cache:
            cache[op] = spread_s(m)
        return cache[op]

    def slowest_rank(self, op, bound: str) -> float:
        """A measured op's time on its slowest rank. compute() is that where the
        results hold every rank's samples (central_time); in older results, the
        slowest rank's own median (scaled to the bound by the measurement's
        spread). For ops whose ranks are not in step call by call (TP groups
        timed side by side)."""
        m = self.matched.get(op)
        mid = self.compute(op, "mid")
        if m is None or m.rank_samples_s or not m.rank_time_p50_s or mid <= 0:
            return self.compute(op, bound)
        from commbench.compute.runner import scale
        return max(m.rank_time_p50_s) * scale(m) * self.compute(op, bound) / mid

    def comm(self, collective, nbytes, group_size, num_nodes, dtype, bound: str) -> float:
        if group_size < 2:
            return 0.0
        est = self.comm_model.estimate(collective, nbytes, group_size, num_nodes, dtype=dtype)
        if est.source != "measured":
            self.notes.setdefault((collective, group_size, num_nodes, est.source),
                                  f"{est.source}: {collective} n={group_size} nodes={num_nodes} ({est.note})")
        return {"mid": est.time_s, "low": est.low_s, "high": est.high_s}[bound]

    def comm_op(self, c, bound: str) -> float:
        return self.comm(c.collective, c.nbytes, c.group_size, c.num_nodes, c.dtype, bound)

    def burst(self, pieces: list, group_size: int, num_nodes: int, dtype: str, bound: str) -> float | None:
        """A burst of broadcasts ((root, nbytes), ...) issued together, where one
        like it was measured as a whole (collectives.broadcast_burst); else None."""
        if self.comm_model is None:
            return None
        est = self.comm_model.burst(sum(b for _, b in pieces), len(pieces), group_size, num_nodes, dtype)
        if est is None:
            return None
        return {"mid": est.time_s, "low": est.low_s, "high": est.high_s}[bound]


# ----------------------------------------------------------------------------- per stage
@dataclass
class StageTimes:
    fwd_s: float = 0.0           # compute of one micro-batch's forward on this stage
    bwd_s: float = 0.0
    layer_fwd_s: float = 0.0     # the part of fwd_s / bwd_s that is transformer layers
    layer_bwd_s: float = 0.0
    tp_fwd_s: float = 0.0        # TP collectives of one micro-batch's forward
    tp_bwd_s: float = 0.0
    tp_step_s: float = 0.0       # once-per-step TP collectives
    pp_step_s: float = 0.0       # once-per-step pp-axis collectives (tied embeddings)
    dp_step_s: float = 0.0       # once-per-step DP collectives (ZeRO-1 parameters)
    optimizer_s: float = 0.0
    recompute_s: float = 0.0     # the part of bwd_s that is recomputed forwards
    tp_recompute_s: float = 0.0  # the part of tp_bwd_s that is their TP collectives
    dp_in_place: bool = False    # fwd_s + bwd_s hold FSDP's work and collectives, timed in place
    mb_var_s2: float = 0.0       # variance of one micro-batch's forward + backward on one rank (spread_s)
    optimizer_var_s2: float = 0.0


# module-level scopes and the kernel-level scopes they stand in for
MODULE_SCOPES = {"layer_module": "layer", "head_module": "head"}
STAGE_COVERS = ("layer", "layer_module", "embedding", "head", "head_module")


def whole_stage(ops, times: Times, stage: int):
    """The stage's whole-module ops (forward and backward) where all were
    measured, else None."""
    whole = [op for op in ops if op.scope == "stage_module" and op.stage == stage]
    return whole if whole and all(times.measured(op) for op in whole) else None


def whole_recomputes(whole: list) -> bool:
    """Whether a whole stage was timed with the plan's full recompute in it
    (compute.ops.stage_module_shape): its recomputed forwards are then no
    extra cost on top."""
    from commbench.compute.ops import stage_recomputes
    return all(stage_recomputes(op) for op in whole)


def granularity(ops, times: Times, stage: int | None = None) -> list:
    """The ops that make up a stage's step (or, with stage None, every stage's),
    each piece of work once, at the coarsest granularity measured: the whole
    stage as one module where both its passes were measured; else per layer and
    head as modules where all of theirs were; else kernel by kernel (measured,
    or from a SystemSpec)."""
    # costs on top (framework_overhead) or in place of compute + TP (tp_in_place), not granularities
    ops = [op for op in ops if op.scope not in ("framework", "tp_stage", "dp_in_place", "pp_stage", "pp_optimizer",
                                               "pp_p2p")]
    if stage is not None:
        ops = [op for op in ops if op.stage in (-1, stage)]
        whole = whole_stage(ops, times, stage)
        if whole is not None:
            covers = STAGE_COVERS + (("recompute_module",) if whole_recomputes(whole) else ())
            return [op for op in ops if op.scope not in covers]
    ops = [op for op in ops if op.scope != "stage_module"]
    skip = set()
    for module_scope, kernel_scope in MODULE_SCOPES.items():
        mods = [op for op in ops if op.scope == module_scope]
        skip.add(kernel_scope if mods and all(times.measured(op) for op in mods) else module_scope)
    if "layer_module" in skip:
        # the recomputed forwards timed as modules go with the layer modules (or
        # the whole stage); the layer kernels carry their own
        skip.add("recompute_module")
    return [op for op in ops if op.scope not in skip]


def framework_overhead(ops, times: Times, stage: int, bound: str):
    """(seconds per step over the micro-batches, seconds per optimizer step) that
    the data-parallel framework adds on one of the stage's ranks: its wrapped
    timings less the bare ones (compute/framework.py), each at least 0; None
    where they were not all measured (a SystemSpec has no framework cost). An
    FSDP micro-batch measured only with the other resharding stands in (noted):
    ZeRO-2 and ZeRO-3 are priced alike from one plan's measurements."""
    from commbench.compute.ops import framework_stand_in
    mine = [op for op in ops if op.scope == "framework" and op.stage == stage]
    for i, op in enumerate(mine):
        other = framework_stand_in(op)
        if not times.measured(op) and other is not None and times.measured(other):
            mine[i] = other
            times.notes.setdefault(("framework stand-in", stage), f"stage {stage}: the FSDP micro-batch measured "
                                   f"with wrapper {dict(other.params)['wrapper']} stands in for "
                                   f"{dict(op.params)['wrapper']}")
    if not mine or not all(times.measured(op) for op in mine):
        return None

    # a difference at a bound: the wrapped time there less the bare one at the
    # opposite bound, so the band still holds every value in between
    opposite = {"low": "high", "mid": "mid", "high": "low"}[bound]

    def net(impl):
        wrapped = bare = 0.0
        for op in mine:
            if op.impl == impl:
                if dict(op.params)["wrapper"] == "none":
                    bare += times.compute(op, opposite) * op.count
                else:
                    wrapped += times.compute(op, bound) * op.count
        return max(0.0, wrapped - bare)
    return net("dp_microbatch"), net("dp_optimizer")


def dp_in_place(ops, times: Times, stage: int, bound: str):
    """Seconds of one micro-batch's forward and backward of the stage under
    FSDP2 over the plan's dp group, its collectives in place
    (compute/fsdp_stage.py); None where not measured."""
    mine = [op for op in ops if op.scope == "dp_in_place" and op.stage == stage]
    if not mine or not all(times.measured(op) for op in mine):
        return None
    return sum(times.slowest_rank(op, bound) for op in mine) / len(mine)


def _apply_dp_in_place(st: StageTimes, whole: float):
    """A micro-batch timed with FSDP in place is the stage's micro-batch: its
    compute, FSDP's own work and its collectives (which compose then leaves
    out), split over forward and backward as the compute splits."""
    compute = st.fwd_s + st.bwd_s
    f = whole / compute if compute > 0 else 1.0
    st.fwd_s, st.bwd_s, st.layer_fwd_s, st.layer_bwd_s = (
        st.fwd_s * f, st.bwd_s * f, st.layer_fwd_s * f, st.layer_bwd_s * f)
    st.dp_in_place = True


def pp_in_place(ops, times: Times, stage: int, bound: str):
    """(forward, backward) seconds of one micro-batch on the stage's rank, its
    virtual stages timed inside the plan's pipeline (compute/pipeline_stage.py);
    None where they were not all measured."""
    mine = [op for op in ops if op.scope == "pp_stage" and op.stage == stage]
    if not mine or not all(times.measured(op) for op in mine):
        return None
    return tuple(sum(times.compute(op, bound) for op in mine if op.phase == ph) for ph in ("fwd", "bwd"))


def pp_optimizer_in_place(ops, times: Times, stage: int, bound: str):
    """(seconds, variance) of the stage's optimizer step as its pipeline's
    step runs it (compute/pipeline_stage.py); None where not measured."""
    mine = [op for op in ops if op.scope == "pp_optimizer" and op.stage == stage]
    if not mine or not all(times.measured(op) for op in mine):
        return None
    return sum(times.compute(op, bound) * op.count for op in mine), sum(times.spread(op) ** 2 for op in mine)


def _apply_pp_in_place(st: StageTimes, fwd: float, bwd: float, holds_tp: bool = False):
    """The stage's forward and backward as the pipeline runs them, its layers'
    share (which interleaving splits) scaled alike. Under tensor parallelism
    (holds_tp) the chunks hold its collectives too: what they took beyond the
    stage's compute is its TP time (the collectives' own timings replaced),
    the compute at most the chunks' time."""
    if holds_tp:
        compute_fwd, compute_bwd = min(st.fwd_s, fwd), min(st.bwd_s, bwd)
        st.tp_fwd_s, st.tp_bwd_s = fwd - compute_fwd, bwd - compute_bwd
        fwd, bwd = compute_fwd, compute_bwd
    if st.fwd_s > 0:
        st.layer_fwd_s *= fwd / st.fwd_s
    if st.bwd_s > 0:
        st.layer_bwd_s *= bwd / st.bwd_s
    st.fwd_s, st.bwd_s = fwd, bwd


def tp_in_place(ops, times: Times, stage: int, bound: str):
    """(seconds, with recompute) of one micro-batch's forward and backward of the
    stage with its tensor parallelism, timed in place over the rank's TP group
    (compute/tp_stage.py): the plan's own, or where only that was measured, the
    same without recompute (with recompute False: its recomputed forwards are
    not in it); None where neither was measured."""
    from commbench.compute.ops import without_recompute
    mine = [op for op in ops if op.scope == "tp_stage" and op.stage == stage]
    for ops_, exact in ((mine, True), ([without_recompute(op) for op in mine], False)):
        if ops_ and all(times.measured(op) for op in ops_):
            plain = all(dict(op.params).get("recompute", "none") == "none" for op in mine)
            return sum(times.slowest_rank(op, bound) for op in ops_) / len(ops_), exact or plain
    return None


def _stage_compute(workload_ops, par, times: Times, bound: str) -> list:
    """Each stage's compute from its ops at the coarsest measured granularity."""
    m = par.num_microbatches
    out = [StageTimes() for _ in range(par.pp)]
    known = {}          # id(op) -> (time, spread): an op of every stage (stage -1) is timed once
    for s, st in enumerate(out):
        for op in granularity(workload_ops, times, s):
            if id(op) not in known:
                known[id(op)] = (times.compute(op, bound), times.spread(op))
            t, spread = known[id(op)]
            var = spread ** 2 * op.count      # the calls' variations taken as independent
            if op.phase == "step":
                st.optimizer_var_s2 += var
            else:
                st.mb_var_s2 += var / m
            # the part of the stage that interleaving splits into chunks: its layers
            # (a whole-stage module is split evenly)
            layered = op.scope in ("layer", "layer_module", "stage_module", "recompute_module")
            if op.name.endswith("(recompute)") or op.scope == "recompute_module":
                st.recompute_s += t * op.count / m
            if op.phase == "step":
                st.optimizer_s += t * op.count
            elif op.phase == "fwd":
                st.fwd_s += t * op.count / m
                st.layer_fwd_s += t * op.count / m if layered else 0.0
            else:
                st.bwd_s += t * op.count / m
                st.layer_bwd_s += t * op.count / m if layered else 0.0
        whole = whole_stage(workload_ops, times, s)
        if whole is not None and whole_recomputes(whole):
            # the recomputed forwards are inside the stage's backward: their
            # part of it (which a TP micro-batch timed without recompute
            # leaves out, _apply_tp_in_place) is the layer forwards' time
            for op in workload_ops:
                if op.scope == "recompute_module" and op.stage in (-1, s) and times.measured(op):
                    st.recompute_s += times.compute(op, bound) * op.count / m
    return out


def _stage_comm(stages: list, comm_ops, par, times: Times, bound: str):
    """The TP collectives of each stage's micro-batches and its once-per-step
    TP, pipeline and DP collectives, from the collectives' own timings."""
    m = par.num_microbatches
    for c in comm_ops:
        st = stages[c.stage]
        if c.axis == "tp":
            t = times.comm_op(c, bound)
            if c.phase == "step":
                st.tp_step_s += t * c.count
            elif c.phase == "fwd":
                st.tp_fwd_s += t * c.count / m
            else:
                st.tp_bwd_s += t * c.count / m
                if c.label.endswith("(recompute)"):
                    st.tp_recompute_s += t * c.count / m
        elif c.axis == "pp" and c.phase == "step":
            st.pp_step_s += times.comm_op(c, bound) * c.count
    # once-per-step DP collectives (ZeRO-1's parameter broadcasts or all-gather):
    # torch's ZeroRedundancyOptimizer issues one broadcast per parameter, async,
    # and waits for all. Where that burst was measured as a whole (run --plan:
    # collectives.broadcast_burst) it is its time; else the broadcasts' own times
    # in series: they are not coalesced, so each pays its latency in turn, as
    # NCCL runs the kernels of one stream and gloo its work queue
    # (benchmarks/zero1_broadcasts.py: tiny-gpt's 68 take 16-20 ms async on 2
    # gloo ranks, 11-15 ms one after another, one broadcast of their bytes 0.3 ms)
    from commbench.collectives.broadcast_burst import zero1_bursts
    burst_s = {}
    for s, coll in zero1_bursts(comm_ops).items():
        c = next(c for c in comm_ops if c.stage == s and c.axis == "dp" and c.collective == "broadcast")
        t = times.burst(coll.pieces, c.group_size, c.num_nodes, c.dtype, bound)
        if t is not None:
            burst_s[s] = t
            stages[s].dp_step_s += t
    for c in comm_ops:
        if c.axis == "dp" and c.phase == "step":
            if c.stage in burst_s and c.collective == "broadcast" and c.root >= 0:
                continue
            stages[c.stage].dp_step_s += times.comm_op(c, bound) * c.count


def _apply_tp_in_place(st: StageTimes, whole: float, with_recompute: bool = True):
    """A micro-batch timed with its TP in place replaces the stage's compute +
    TP collectives: its excess over the compute is the TP time (at least 0),
    split over forward and backward as the collectives' own timings split it.
    Timed without the plan's recompute (with_recompute False), the excess is
    taken over the compute less the recomputed forwards, whose own TP
    collectives then come on top."""
    extra, extra_tp = (0.0, 0.0) if with_recompute else (st.recompute_s, st.tp_recompute_s)
    compute = st.fwd_s + st.bwd_s - extra
    comm = st.tp_fwd_s + st.tp_bwd_s - extra_tp
    fwd_share = st.tp_fwd_s / comm if comm > 0 else (st.fwd_s / compute if compute > 0 else 0.5)
    tp = max(0.0, whole - compute)
    st.tp_fwd_s, st.tp_bwd_s = tp * fwd_share, tp * (1.0 - fwd_share) + extra_tp


def _apply_framework(st: StageTimes, over: tuple, m: int):
    """The data-parallel framework's own work, spread over the micro-batch's
    forward and backward in proportion to their compute (FSDP's hooks and
    copies sit at every unit), and its optimizer step."""
    per_mb = over[0] / m
    if st.fwd_s + st.bwd_s > 0:
        f = 1.0 + per_mb / (st.fwd_s + st.bwd_s)
        st.fwd_s, st.bwd_s, st.layer_fwd_s, st.layer_bwd_s = (
            st.fwd_s * f, st.bwd_s * f, st.layer_fwd_s * f, st.layer_bwd_s * f)
    st.optimizer_s += over[1]


def _in_place_var(workload_ops, times: Times, stage: int, scope: str) -> float:
    """Variance of one micro-batch timed in place (scope tp_stage, dp_in_place:
    each op a whole micro-batch, their mean taken; pp_stage: the stage's chunks,
    summed), from the ops measured (a TP micro-batch may be its stand-in without
    recompute)."""
    from commbench.compute.ops import without_recompute
    mine = [op for op in workload_ops if op.scope == scope and op.stage == stage]
    if scope == "tp_stage" and not all(times.measured(op) for op in mine):
        mine = [without_recompute(op) for op in mine]
    var = [times.spread(op) ** 2 for op in mine]
    return sum(var) if scope == "pp_stage" else sum(var) / max(1, len(var))


def stage_times(workload_ops, comm_ops, par, times: Times, bound: str) -> list:
    m = par.num_microbatches
    out = _stage_compute(workload_ops, par, times, bound)
    _stage_comm(out, comm_ops, par, times, bound)
    for s, st in enumerate(out):
        pipe = pp_in_place(workload_ops, times, s, bound)
        if pipe is not None:
            _apply_pp_in_place(st, *pipe, holds_tp=par.tp > 1)
            st.mb_var_s2 = _in_place_var(workload_ops, times, s, "pp_stage")
            times.notes.setdefault(("pp in place", s), f"stage {s}: its micro-batch timed inside the plan's "
                                   f"pipeline ({pipe[0] * 1e3:.3f} ms fwd, {pipe[1] * 1e3:.3f} ms bwd"
                                   f"{', its TP collectives in them' if par.tp > 1 else ''})")
        opt = pp_optimizer_in_place(workload_ops, times, s, bound)
        if opt is not None:
            st.optimizer_s, st.optimizer_var_s2 = opt
            times.notes.setdefault(("pp optimizer in place", s), f"stage {s}: its optimizer step timed inside the "
                                   f"plan's pipeline ({opt[0] * 1e3:.3f} ms)")
        # a TP micro-batch timed in place, where the pipeline's own chunks were not
        found = tp_in_place(workload_ops, times, s, bound) if pipe is None or par.tp == 1 else None
        if found is not None:
            whole, exact = found
            _apply_tp_in_place(st, whole, exact)
            st.mb_var_s2 = _in_place_var(workload_ops, times, s, "tp_stage")
            times.notes.setdefault(("tp in place", s), f"stage {s}: a micro-batch with its tensor parallelism timed "
                                   f"in place ({whole * 1e3:.3f} ms{'' if exact else ', without recompute'}): "
                                   f"TP time = that less the stage's compute"
                                   f"{'' if exact else ' without its recomputed forwards, plus their TP collectives'}")
        over = framework_overhead(workload_ops, times, s, bound)
        if pipe is not None and over is not None:
            over = (0.0, over[1])       # DDP's work on a micro-batch is in the chunks timed in place
        fsdp = dp_in_place(workload_ops, times, s, bound)
        if fsdp is not None:
            _apply_dp_in_place(st, fsdp)
            st.mb_var_s2 = _in_place_var(workload_ops, times, s, "dp_in_place")
            over = None if over is None else (0.0, over[1])       # its micro-batch cost is in the timing
            times.notes.setdefault(("fsdp in place", s), f"stage {s}: a micro-batch under FSDP timed in place "
                                   f"over the plan's dp group ({fsdp * 1e3:.3f} ms): its compute, FSDP's work and "
                                   "its all-gathers and reduce-scatters")
        if over is not None:
            _apply_framework(st, over, m)
            times.notes.setdefault(("framework", s), f"stage {s}: the data-parallel framework's own work, measured "
                                   f"on one rank, adds {over[0] * 1e3:.3f} ms to its micro-batches and "
                                   f"{over[1] * 1e3:.3f} ms to its optimizer step (in compute and optimizer)")
    return out


def chunk_times(stages: list, par, which: str) -> list:
    """Per-chunk forward or backward time (compute + TP) for the pipeline
    simulation. With v chunks per rank, chunk c = i pp + r holds 1/v of rank r's
    layers; the embedding rides on the first chunk, the head on the last."""
    v = par.interleave if par.pp > 1 else 1      # virtual stages only exist in a pipeline
    out = []
    for c in range(par.pp * v):
        st = stages[c % par.pp]
        total = (st.fwd_s + st.tp_fwd_s) if which == "fwd" else (st.bwd_s + st.tp_bwd_s)
        layers = st.layer_fwd_s if which == "fwd" else st.layer_bwd_s
        tp = st.tp_fwd_s if which == "fwd" else st.tp_bwd_s
        extra = total - layers - tp          # embedding / head: on the rank's first / last chunk only
        t = (layers + tp) / v
        first, last = c // par.pp == 0, c // par.pp == v - 1
        if (c % par.pp == 0 and first) or (c % par.pp == par.pp - 1 and last) or v == 1:
            t += extra
        out.append(t)
    return out


def p2p_times(comm_ops, par, times: Times, bound: str, compute_ops=()):
    """p2p time of each chunk boundary k (chunk k on rank k % pp -> chunk k+1):
    its tier's transfers timed inside the plan's pipeline (p2p_in_place) where
    measured, else one send_recv of the stage boundary's message between those
    two ranks' nodes."""
    from commbench.strategies import pp
    sends = [c for c in comm_ops if c.axis == "pp" and c.collective == "send_recv" and c.direction == "send"]
    if not sends:
        return 0.0
    nbytes, dtype = max(c.nbytes for c in sends), sends[0].dtype
    cache, in_place = {}, p2p_in_place(compute_ops, times, bound)

    def at(k):
        nodes = pp.boundary_nodes(par, k)
        if nodes not in cache:
            cache[nodes] = in_place.get(nodes) or times.comm("send_recv", nbytes, 2, nodes, dtype, bound)
        return cache[nodes]
    return at


def p2p_in_place(ops, times: Times, bound: str) -> dict:
    """nodes (1, 2) -> the p2p time of a chunk boundary of that tier as the
    plan's own pipeline met its transfers (scope pp_p2p, compute/pipeline_stage.py:
    from the later of a transfer's posts to the end of its receiver's wait),
    where measured; it replaces the sweep's send_recv, timed with every pair
    exchanging at once and nothing else running."""
    return {2 if dict(op.params)["tier"] == "inter" else 1: times.compute(op, bound)
            for op in ops if op.scope == "pp_p2p" and times.measured(op)}


# ----------------------------------------------------------------------------- DP placement
@dataclass
class Call:
    ready_s: float
    duration_s: float
    deadline_s: float | None      # compute waits for it here: a gating all-gather's unit starts; a
                                  # host-blocking call (CPU) is issued


def _spread(interval_list, frac: float) -> float:
    """The point at fraction frac of a list of (start, end) compute intervals
    taken end to end."""
    total = sum(b - a for a, b in interval_list)
    want = frac * total
    for a, b in interval_list:
        if want <= (b - a) + 1e-15:
            return a + want
        want -= b - a
    return interval_list[-1][1]


def dp_calls(dp_ops, par, timeline, times: Times, bound: str) -> list:
    """Every DP/ZeRO call of one stage's step with its ready time on the stage's
    timeline (schedule.Op list), in issue order."""
    m = par.num_microbatches
    # ops that overlap nothing (FSDP's reduce-scatters under pipelining, deferred to
    # the end of the step) run, each of their calls, after the stage's last backward
    after = [c for c in dp_ops if c.overlap == "none"]
    dp_ops = [c for c in dp_ops if c.overlap != "none"]
    plan = {}                         # phase -> (its ops per micro-batch, those of micro-batches < m - 1)
    for phase in ("fwd", "bwd"):
        ops = [c for c in dp_ops if c.phase == phase]
        if ops:
            per_mb = [(c, c.count // m, None) if c.count >= m and c.count % m == 0 else (c, c.count, m - 1)
                      for c in ops]
            plan[phase] = (per_mb, [x for x in per_mb if x[2] is None])
    # (phase, micro-batch) -> [(start, end)] in time order, for the micro-batches that get calls
    intervals = {}
    kinds = {"F": "fwd", "B": "bwd"}
    for op in timeline:
        phase = kinds[op.kind]
        if phase in plan and (plan[phase][1] or op.microbatch == m - 1):
            intervals.setdefault((phase, op.microbatch), []).append((op.start_s, op.end_s))
    calls = []
    for phase in ("fwd", "bwd"):
        if phase not in plan:
            continue
        per_mb, every_mb = plan[phase]
        singles = [(c, k) for c, k, _ in per_mb if k == 1]
        total_single = sum(c.nbytes for c, _ in singles) or 1
        for j in range(m):
            ivs = sorted(intervals.get((phase, j), []))
            if not ivs:
                continue
            done = 0.0
            unit_before = None          # where the previous gathered unit listed as an op of its own starts
            for c, k, only in (per_mb if j == m - 1 else every_mb):
                dur = times.comm_op(c, bound)
                gating = c.collective in GATHERS
                if k == 1:
                    before, done = done, done + c.nbytes / total_single
                    fr = [(before, done)]
                else:
                    fr = [(i / k, (i + 1) / k) for i in range(k)]
                # FSDP2 prefetches backward gathers explicitly, one unit ahead; in
                # forward it issues a unit's gather at the unit's pre-forward,
                # which on a GPU the host reaches while the unit before still
                # computes, on a CPU only when it is done
                ahead = phase == "bwd" or times.host_runs_ahead
                # a blocking call of the host (FSDP2's) on a device the host computes
                # on (a CPU) holds the compute up from where it is issued until done
                blocking = c.host_blocking and not times.host_runs_ahead
                for i, (f0, f1) in enumerate(fr):
                    if gating:      # prefetched when the unit before starts; its unit starts at f0
                        before_unit = fr[i - 1][0] if i > 0 else (unit_before if k == 1 else None)
                        prev = before_unit if ahead and before_unit is not None else f0
                        issued = _spread(ivs, prev)
                        calls.append(Call(issued, dur, issued if blocking else _spread(ivs, f0)))
                        if k == 1:
                            unit_before = f0
                    else:           # its gradients are complete at the end of its part
                        ready = _spread(ivs, f1)
                        calls.append(Call(ready, dur, ready if blocking else None))
    if after:
        last_bwd = max(op.end_s for op in timeline if op.kind == "B")
        calls += [Call(last_bwd, times.comm_op(c, bound), None) for c in after for _ in range(c.count)]
    calls.sort(key=lambda c: c.ready_s)
    return calls


def place_dp(calls, compute_end_s: float, comm_slowdown: float = 1.0, compute_slowdown: float = 1.0):
    """Run the calls on one stream against the stage's compute, which ends at
    compute_end_s unless gating all-gathers or interference hold it back.
    Interference (factors >= 1) acts on the part of a gradient reduction that
    runs while compute still runs: that part proceeds comm_slowdown times slower,
    and compute, at 1/compute_slowdown of its speed meanwhile, ends
    (1 - 1/compute_slowdown) x its length later. A gating
    all-gather is taken as running while compute waits for it, without
    interference. Returns (exposed_s, hidden_s, comm_total_s)."""
    free, shift, total = 0.0, 0.0, 0.0
    for c in calls:
        start = max(c.ready_s + shift, free)
        window = compute_end_s + shift - start          # compute still to run after start
        dur = c.duration_s
        if c.deadline_s is None and window > 0 and comm_slowdown > 1.0:
            if dur * comm_slowdown <= window:
                dur, overlap = dur * comm_slowdown, dur * comm_slowdown
            else:
                dur, overlap = window + (dur - window / comm_slowdown), window
        else:
            overlap = max(0.0, min(dur, window)) if c.deadline_s is None else 0.0
        end = start + dur
        total += dur
        if overlap > 0 and compute_slowdown > 1.0:
            # for `overlap` wall seconds compute ran at 1/compute_slowdown of its speed
            shift += (1.0 - 1.0 / compute_slowdown) * overlap
        if c.deadline_s is not None and end > c.deadline_s + shift:
            shift += end - (c.deadline_s + shift)          # compute waits for its parameters
        free = end
    tail = max(0.0, free - (compute_end_s + shift))
    exposed = shift + tail
    return exposed, max(0.0, total - exposed), total


# ----------------------------------------------------------------------------- composition
def model_flops(workload, par) -> float:
    """FLOPs of one optimizer step over the whole job: every GEMM and attention op
    once (no recompute), summed over stages, tp ranks and dp replicas."""
    total = 0.0
    vocab = workload.model.get("vocab")
    # a rank's logits GEMM covers ceil(V / tp) rows; the tp ranks together, V
    vocab_share = vocab / (par.tp * -(-vocab // par.tp)) if vocab else 1.0
    for op in workload.compute_ops:
        if op.kind in ("gemm", "attention") and op.scope in ("layer", "head") and not op.name.endswith("(recompute)"):
            share = vocab_share if op.name.startswith("logits ") else 1.0
            total += op.flops * op.count * (par.pp if op.stage < 0 else 1) * share
    return total * par.tp * par.dp


def simulate(par, fwd, bwd, p2p, full: bool, cache: dict | None = None, hold: tuple = ()) -> schedule.PipelineResult:
    """The pipeline of a plan with these chunk and p2p times (and per-chunk holds
    of the last backward, schedule.simulate_pipeline's hold_s); its timelines hold
    every op with full=True, else only the last micro-batch's (enough for DP
    collectives issued once per step). cache (kept across the predictions of one
    search) holds simulations by their inputs: identical inputs, identical results."""
    m = par.num_microbatches
    kw = dict(schedule=par.schedule if par.pp > 1 else "1f1b", interleave=par.interleave if par.pp > 1 else 1,
              record="all" if full else "last", hold_s=hold or 0.0)
    if callable(p2p):           # the same calls simulate_pipeline makes, once, as a key
        p2p = tuple(p2p(k) for k in range(par.pp * kw["interleave"] - 1))
    key = (par.pp, m, kw["schedule"], kw["interleave"], tuple(fwd), tuple(bwd), p2p, tuple(hold))
    hit = cache.get(key) if cache is not None else None
    if hit is not None and (hit.record == "all" or not full):
        return hit
    res = schedule.simulate_pipeline(par.pp, m, fwd, bwd, p2p, **kw)
    if cache is not None:
        cache[key] = res if not full else replace(
            res, timelines=[[op for op in tl if op.microbatch == m - 1] for tl in res.timelines], record="last")
    return res


def straggler_wait(st: StageTimes, m: int, dp_ops: list, times: Times, stage: int) -> float:
    """Seconds the stage's ranks wait at the step's data-parallel synchronisation
    for the last of them: each rank's compute between two such points (its m
    micro-batches and its optimizer step) varies by sigma (the measured calls'
    spreads, independent), and the last of R ranks arrives E[max of R standard
    normals] sigma after the mean (stats.expected_max_normal), which grows with
    the dp group as a job scales. 0 without DP collectives in the backward or
    forward (those timed in place carry their waits), without measured spread,
    or where the measured ranks shared a machine's cores (Times.ranks_share_cores:
    a rank that waits gives its core to the others, and the last catches up)."""
    from commbench.stats import expected_max_normal
    if not dp_ops:
        return 0.0
    if times.ranks_share_cores:
        times.notes.setdefault(("straggler", stage), f"stage {stage}: no wait for the last data-parallel rank: "
                               "the measured ranks shared a machine's cores, where a rank that waits yields "
                               "its core and the last catches up")
        return 0.0
    sigma = math.sqrt(m * st.mb_var_s2 + st.optimizer_var_s2)
    ranks = max(c.group_size for c in dp_ops)
    behind = expected_max_normal(ranks)
    wait = behind * sigma
    if wait > 0:
        times.notes.setdefault(("straggler", stage), f"stage {stage}: the last of its {ranks} data-parallel ranks "
                               f"reaches the gradient synchronisation {behind:.2f} x "
                               f"{sigma * 1e3:.3f} ms (the spread of a rank's step compute) after the mean: "
                               f"+{wait * 1e3:.3f} ms, in DP/ZeRO exposed")
    return wait


def held_by_finalize(c, par) -> bool:
    """Whether a DP collective holds its stage's last backward under pipelining:
    DDP's bucket all-reduces (DDP and torch's ZeRO-1 both run DDP), which
    torch.distributed.pipelining reduces inside each chunk's last backward, whose
    DDP finalize waits for them before the gradient goes upstream
    (schedule.simulate_pipeline's hold_s)."""
    return (par.pp > 1 and par.zero_flavour == "torch" and c.strategy in ("ddp", "zero1")
            and c.collective == "all_reduce" and c.phase == "bwd" and c.overlap == "bwd" and not c.host_blocking)


def chunk_holds(held_ops: dict, par, pipe, times: Times, bound: str) -> tuple:
    """(per chunk: how long its last backward holds its rank, per stage: the
    held collectives' time hidden under that backward). Each chunk's bucket
    all-reduces are those ready inside its last backward (dp_calls spreads a
    stage's buckets over its last micro-batch's backwards); the hold is what of
    them compute does not cover (place_dp). The stream is empty when a chunk's
    last backward starts (the chunk before on the rank waited for its own), so
    each chunk is placed on its own, and a hold upstream shifts a chunk's
    compute and its buckets alike: the holds of the unheld pipeline are final."""
    slow = times.interference
    holds, hidden = [0.0] * (par.pp * (par.interleave if par.pp > 1 else 1)), {}
    for r, ops in held_ops.items():
        ivs = sorted(pipe.last_bwd_s[r].items(), key=lambda kv: kv[1])
        by_chunk = {c: [] for c, _ in ivs}
        k = 0
        for call in dp_calls(ops, par, pipe.timelines[r], times, bound):      # in ready order
            while k < len(ivs) - 1 and call.ready_s > ivs[k][1][1] * (1 + 1e-12):
                k += 1
            by_chunk[ivs[k][0]].append(call)
        for c, (_, b) in ivs:
            exposed, hid, _ = place_dp(by_chunk[c], b, slow.get("comm", 1.0), slow.get("compute", 1.0))
            holds[c] = exposed
            hidden[r] = hidden.get(r, 0.0) + hid
    return holds, hidden


def compose(workload, par, times: Times, bound: str = "mid", pipeline_cache: dict | None = None) -> dict:
    """One composition at a bound: per-stage ends and the critical stage's parts."""
    stages = stage_times(workload.compute_ops, workload.comm_ops, par, times, bound)
    fwd, bwd = chunk_times(stages, par, "fwd"), chunk_times(stages, par, "bwd")
    p2p = p2p_times(workload.comm_ops, par, times, bound, workload.compute_ops)
    slow = times.interference
    m = par.num_microbatches
    dp_by_stage = {}                  # stage -> its DP/ZeRO ops of the forward and backward, in order
    held_ops = {}                     # stage -> those that hold its last backward (held_by_finalize)
    for c in workload.comm_ops:
        if c.axis == "dp" and c.phase in ("fwd", "bwd"):
            if c.host_blocking and stages[c.stage].dp_in_place:
                continue                  # FSDP's own collectives: in the micro-batch timed in place
            (held_ops if held_by_finalize(c, par) else dp_by_stage).setdefault(c.stage, []).append(c)
    # dp_calls needs every micro-batch's intervals only for ops issued every micro-batch
    full = m > 1 and any(c.count >= m and c.count % m == 0 for ops in dp_by_stage.values() for c in ops)
    pipe = simulate(par, fwd, bwd, p2p, full, pipeline_cache)
    free = simulate(par, fwd, bwd, 0.0, False, pipeline_cache) if p2p else pipe
    holds, held_hidden = chunk_holds(held_ops, par, pipe, times, bound) if held_ops else ((), {})
    held = simulate(par, fwd, bwd, p2p, full, pipeline_cache, tuple(holds)) if any(holds) else pipe
    parts = []
    for r in range(par.pp):
        st = stages[r]
        # a rank's last op is a backward: the end of its last backward is its end
        end = pipe.last_bwd_end_s[r]
        end_free = free.last_bwd_end_s[r]
        end_held = held.last_bwd_end_s[r]
        calls = dp_calls(dp_by_stage.get(r, []), par, held.timelines[r], times, bound)
        exposed, hidden, _ = place_dp(calls, end_held, slow.get("comm", 1.0), slow.get("compute", 1.0))
        # plus what the holds of this stage and of those downstream delay its end by
        exposed += end_held - end
        hidden += held_hidden.get(r, 0.0)
        straggler = straggler_wait(st, m, dp_by_stage.get(r, []) + held_ops.get(r, []), times, r)
        exposed += straggler
        compute = (st.fwd_s + st.bwd_s) * m
        tp = (st.tp_fwd_s + st.tp_bwd_s) * m
        busy = pipe.busy_s[r]
        parts.append({
            "stage": r,
            "end_s": end + exposed + st.tp_step_s + st.pp_step_s + st.dp_step_s + st.optimizer_s,
            "compute_s": compute,
            "tp_exposed_s": tp + st.tp_step_s,
            "bubble_s": max(0.0, end_free - busy),
            "pp_exposed_s": max(0.0, end - end_free) + st.pp_step_s,
            "dp_exposed_s": exposed + st.dp_step_s,
            "hidden_comm_s": hidden,
            "optimizer_s": st.optimizer_s,
            "straggler_s": straggler,
        })
    return {"stages": parts, "critical": max(range(par.pp), key=lambda r: parts[r]["end_s"])}


def predict(workload, par, times: Times, peak_tflops: float | None = None,
            pipeline_cache: dict | None = None) -> StepBreakdown:
    """pipeline_cache: a dict kept across the predictions of one search (simulate)."""
    if times.has_band():
        runs = {b: compose(workload, par, times, b, pipeline_cache) for b in BOUNDS}
    else:       # every bound gives the central times: one composition stands for all three
        central = compose(workload, par, times, BOUNDS[0], pipeline_cache)
        runs = {b: central for b in BOUNDS}
    main = runs["mid"]
    crit = main["stages"][main["critical"]]
    step = crit["end_s"]
    if not step > 0 or not math.isfinite(step):
        raise ValueError(f"predicted step time {step!r} s: the inputs give no time")
    seq = workload.parallelism.get("seq") or workload.model["seq"]
    tflops = model_flops(workload, par) / step / par.world / 1e12
    keys = ("compute_s", "tp_exposed_s", "pp_exposed_s", "dp_exposed_s", "hidden_comm_s", "bubble_s", "optimizer_s")
    lows = [runs["low"]["stages"][runs["low"]["critical"]]["end_s"], runs["high"]["stages"][runs["high"]["critical"]]["end_s"]]
    return StepBreakdown(
        step_time_s=step, samples_per_s=par.global_batch / step, tokens_per_s=par.global_batch * seq / step,
        tflops_per_gpu=tflops, mfu=tflops / peak_tflops if peak_tflops else None,
        breakdown={k: crit[k] for k in keys}, step_time_low_s=min(lows), step_time_high_s=max(lows),
        critical_stage=main["critical"], stages=main["stages"], notes=sorted(times.notes.values()))


def mean_breakdown(sbs: list) -> StepBreakdown:
    """The mean of several predictions of one plan (validate --rounds: each from
    one round's own measurements): the step, its band, the breakdown and every
    stage's times averaged (the parts still sum to the step), the throughputs
    at the mean step, the critical stage the one whose mean end is latest, and
    every note once."""
    if len(sbs) == 1:
        return sbs[0]
    n, first = len(sbs), sbs[0]
    step = sum(sb.step_time_s for sb in sbs) / n
    slower = first.step_time_s / step          # throughputs go as 1 / step

    def mean(dicts):
        return {k: sum(d[k] for d in dicts) / n if isinstance(v, float) else v for k, v in dicts[0].items()}
    stages = [mean([sb.stages[i] for sb in sbs]) for i in range(len(first.stages))]
    return StepBreakdown(
        step_time_s=step, samples_per_s=first.samples_per_s * slower, tokens_per_s=first.tokens_per_s * slower,
        tflops_per_gpu=first.tflops_per_gpu * slower, mfu=None if first.mfu is None else first.mfu * slower,
        breakdown=mean([sb.breakdown for sb in sbs]),
        step_time_low_s=sum(sb.step_time_low_s for sb in sbs) / n,
        step_time_high_s=sum(sb.step_time_high_s for sb in sbs) / n,
        critical_stage=max(range(len(stages)), key=lambda i: stages[i]["end_s"]) if stages else first.critical_stage,
        stages=stages, notes=sorted({note for sb in sbs for note in sb.notes}))


def median_breakdown(sbs: list) -> StepBreakdown:
    """The median of several predictions of one plan (validate --rounds): the
    prediction of the middle round by predicted step (the mean_breakdown of
    the middle two for an even count), with every round's notes. A round whose
    measurements caught the machine in a slow spell moves it no further than
    a slow phase of the training steps moves their median."""
    ranked = sorted(sbs, key=lambda sb: sb.step_time_s)
    half = len(ranked) // 2
    middle = ranked[half - 1:half + 1] if len(ranked) % 2 == 0 else [ranked[half]]
    m = mean_breakdown(middle)
    return replace(m, notes=sorted({note for sb in sbs for note in sb.notes}))


# ----------------------------------------------------------------------------- inputs from files
class MeasuredTimes(Times):
    """Times from results files: collectives from a CommModel of the comm files
    (falling back to a SystemSpec where the measurements cannot answer, with a
    note), kernels from the compute files. An Adam shard of another size than
    measured (dp changes it under ZeRO) is scaled from the measured rate per
    element: the step is memory-bound, linear in its elements."""

    def __init__(self, comm_model, compute_files=(), spec=None, interference=None, device=None):
        super().__init__(comm_model, spec=spec, interference=interference)
        self.compute_files, self.device = list(compute_files), device
        self.host_runs_ahead = device != "cpu"
        self.ranks_share_cores = any(_shared_cores(rf) for rf in self.compute_files)
        self._adam = [m for rf in self.compute_files for m in rf.measurements
                      if m.case.kind == "compute" and m.case.op == "adam" and m.status == "ok"]

    def has_band(self) -> bool:
        # spec-only (--system without results files): SystemSpec times have no spread
        return self.comm_model is not None or bool(self.compute_files)

    def bind(self, ops):
        from commbench.compute.ops import framework_stand_in, without_recompute
        from commbench.compute.runner import match
        # a TP-in-place micro-batch may stand in without recompute (tp_in_place)
        ops = list(ops) + [without_recompute(op) for op in ops if op.scope == "tp_stage"]
        ops += [o for o in (framework_stand_in(op) for op in ops) if o is not None]     # framework_overhead
        self.matched = match(ops, self.compute_files, self.device) if self.compute_files else {}
        return self

    def compute(self, op, bound):
        ref = self._adam_stand_in(op)
        if ref is not None:
            self.notes.setdefault(("adam",), f"adam step scaled from a measured shard of {ref.case.params['m']} "
                                             "elements (linear in elements)")
            return central_time(ref, bound) * op.m / ref.case.params["m"]
        return super().compute(op, bound)

    def spread(self, op):
        ref = self._adam_stand_in(op)
        if ref is not None:
            return spread_s(ref) * op.m / ref.case.params["m"]
        return super().spread(op)

    def _adam_stand_in(self, op):
        """The measured Adam shard that stands in for an unmeasured one, or None."""
        if op in self.matched or op.impl != "adam" or not self._adam:
            return None
        from commbench.compute.runner import TORCH_DTYPES
        same = [m for m in self._adam if m.case.dtype == TORCH_DTYPES[op.dtype]] or self._adam
        return max(same, key=lambda m: m.case.params["m"])

    def comm(self, collective, nbytes, group_size, num_nodes, dtype, bound):
        if self.comm_model is None:
            return self._spec_comm(collective, nbytes, group_size, num_nodes)
        try:
            return super().comm(collective, nbytes, group_size, num_nodes, dtype, bound)
        except ValueError as e:
            if self.spec is None:
                raise
            self.notes.setdefault((collective, group_size, num_nodes, "spec"),
                                  f"spec: {collective} n={group_size} nodes={num_nodes} from {self.spec.name} ({e})")
            return self._spec_comm(collective, nbytes, group_size, num_nodes)

    def _spec_comm(self, collective, nbytes, group_size, num_nodes):
        self.notes.setdefault(("comm-spec",), f"collective times from SystemSpec {self.spec.name} (not measured)")
        return self.spec.collective_time_s(collective, nbytes, group_size, num_nodes)


def _shared_cores(rf) -> bool:
    """Whether a compute results file was measured by CPU ranks that shared a
    machine's cores (env.cores_shared)."""
    from commbench import env
    cpu = any(m.case.kind == "compute" and m.case.device == "cpu" for m in rf.measurements)
    return cpu and env.cores_shared(rf.header.get("cluster") or {})


def interference_factors(path_or_file) -> dict:
    """{"compute": f, "comm": f} from a `compute --interference` results file (a
    path or a loaded ResultFile): the pair with the most SMs busy (a training
    kernel's occupancy), or the CPU pair."""
    from commbench import interference, results
    rf = results.load(path_or_file) if isinstance(path_or_file, str) else path_or_file
    pairs = interference.slowdowns(rf)
    if not pairs:
        raise ValueError(f"{rf.path}: no interference measurements (commbench compute --interference writes them)")
    key = max(pairs, key=lambda p: (p.num_sms or 0))
    f = pairs[key]
    return {"compute": max(1.0, f.get("compute", 1.0)), "comm": max(1.0, f.get("collective", 1.0))}


def load_times(comm_paths=(), compute_paths=(), system=None, interference_path=None, backend=None):
    """MeasuredTimes from the files of `predict --comm/--compute/--system/--interference`."""
    from commbench import results
    from commbench import system as system_mod
    from commbench.commmodel import CommModel
    spec = system_mod.load(system) if system else None
    if not comm_paths and spec is None:
        raise ValueError("predict needs collective times: --comm RESULTS... or --system SPEC")
    if not compute_paths and spec is None:
        raise ValueError("predict needs kernel times: --compute RESULTS... or --system SPEC")
    comm_files = [results.load(p) for p in comm_paths]
    compute_files = [results.load(p) for p in compute_paths]
    if compute_files and not any(m.case.kind == "compute" for rf in compute_files for m in rf.measurements):
        raise ValueError(f"{', '.join(compute_paths)}: no compute measurements (commbench compute writes them)")
    comm_model = CommModel.from_results(comm_files, backend=backend, statistic=STATISTIC) if comm_files else None
    slow = interference_factors(interference_path) if interference_path else None
    devices = {m.case.device for rf in compute_files for m in rf.measurements if m.case.kind == "compute"}
    return MeasuredTimes(comm_model, compute_files, spec=spec, interference=slow,
                         device=devices.pop() if len(devices) == 1 else None)
