"""A pipeline's stages timed inside the pipeline: the plan's real
torch.distributed.pipelining schedule (training.pipeline, as `validate` trains
it) runs whole optimizer steps over the job's ranks, and each rank's busy time
from the step's start to the schedule's return is split over the chunks it
ran (ChunkClock): a chunk's forward_one_chunk or backward_one_chunk as the
step runs it (the other micro-batches' activations alive, the peer stages
computing at the same time) plus the step's own work around it (clearing
the gradients, splitting the batch into micro-batches, posting its sends and
receives, the last stage's loss, merging the outputs). Waits for the peers'
activations and gradients are outside it: they are the bubble and the p2p
the predictor composes. On this project's 2-core CPU machine small-gpt's
stage 0 chunks took 4.12 / 6.91 ms (fwd / bwd p50, the chunk calls alone)
in the pipeline against 3.69 / 6.30 ms for the same stage timed in a loop
(commbench compute, the same hour); tiny-gpt's stages spent 0.7-1.5 ms a
step of 4 micro-batches outside the chunks and the waits, and the step's
work before the schedule's micro-batches, around them (torch's split and
merge) and after the optimizer took 0.39-0.50 / 0.70-0.87 ms a step on its
ranks 0 / 1 (pp 2, means of 60 steps, two runs of
benchmarks/pipeline_timeline.py; small-gpt's 0.57 / 1.58 ms, 40 steps).

Each rank's optimizer step is timed in place too, from the step's call to
the optimizer to the step's end (the optimizer and the step's work after it,
the last stage's mean loss): after the pipeline's backward and the tied
embeddings' all-reduce, the peer ranks stepping theirs. The tied all-reduce
is the one part of the step timed elsewhere (a collective of the comm
sweep). On this project's 2-core CPU machine tiny-gpt's stage halves took
1.15-1.29 ms from the call to the optimizer to its return (p50, the three
rounds of one validation) against 0.64-0.67 ms (each rank's p50) for the
same Adam timed in a loop on both ranks at once (a round of another).

Under DDP (pp+dp, ZeRO 0, or torch's ZeRO-1: DDP with
ZeroRedundancyOptimizer) a chunk's last backward of a step holds DDP's
gradient reduction (torch pipelining runs the others under no_sync): it
keeps its share of its segment, under a key of its own that is not
reported, so the chunk's backward samples are its m - 1 others a step. Every
dp replica of a stage times its chunks; a call's sample is the slowest
replica's.

The stage boundaries' transfers are timed in the same steps (op
pipeline_p2p, one per tier of the plan's boundaries, intra- and inter-node):
each rank records when it posted its sends and receives (torch pipelining's
_batch_p2p) and when its wait for them (_wait_batch_p2p) began and ended; the
n-th send from rank a to rank b meets the n-th receive at b from a, and each
transfer whose receiver blocked in its wait gives the time from the later of
the two posts' ends to the wait's end (at least 0): the p2p time of the
predictor's pipeline simulation (a transfer ends one p2p time after the
later of its posts), as the pipeline meets it. The waits that did not block
only bound it and are left out. The two ends are on two ranks' clocks, so
it needs every rank on one machine (env.machine_id, the kernel's boot id:
network namespaces share it); else it is skipped and the comm sweep's
send_recv stands in. On this project's 2-core CPU machine tiny-gpt's pp 4
on 4 ranks met its transfers 0.45-0.49 ms (mean, the three rounds of one validation)
after the later of their posts' ends in the pipeline, while the sweep's
send_recv of the same 16 KiB between pairs of its ranks took 2.4-3.2 ms
(mean; p50 0.13-4.0 ms, bimodal: 4 processes on 2 cores), which put the
step at +81 % (now -12.9 %).

The ops are those of compute.ops.pipeline_stage_ops (pp > 1, dp = 1 or DDP
with ZeRO 0 or 1, with or without DTensor TP, no recompute; no optimizer op
under ZeRO-1, whose step holds its broadcasts); they need the job to be the
plan's world, else they are skipped with the reason."""
import json
import math
import time

IMPLS = ("pipeline_fwd", "pipeline_bwd", "pipeline_optimizer", "pipeline_p2p")
OPTIMIZER = "optimizer"
BLOCKED_S = 50e-6         # a wait for a transfer shorter than this did not block: it only bounds the transfer
REDUCE = "bwd_reduce"     # under DDP, a chunk's last backward of a step: not reported


def plans(items) -> list:
    """The items (case, op) grouped by the plan they belong to, in order."""
    groups = {}
    for case, op in items:
        groups.setdefault(dict(op.params)["plan"], []).append((case, op))
    return list(groups.values())


def _plan(op):
    from commbench.models import ModelSpec
    from commbench.parallel import Parallelism
    p = dict(op.params)
    spec, plan = ModelSpec(**json.loads(p["model"])), json.loads(p["plan"])
    return spec, Parallelism(gpus_per_node=plan["world"], **plan)


def _setup_error(backend, op) -> str | None:
    from commbench import training
    spec, par = _plan(op)
    if par.world != backend.world_size:
        return f"needs the plan's {par.world} ranks to run its pipeline, the job has {backend.world_size}"
    try:
        training.check_plan(spec, par)
    except ValueError as e:
        return str(e)
    return None


class ChunkClock:
    """A rank's busy time in a step, split over its chunks. The host is busy
    between two waits for the peers (torch pipelining's _wait_batch_p2p), and
    from the step's start (begin) to the first and from the last to the
    schedule's return (end): a chunk's forward or backward and the step's own
    work around it (posting its sends and receives, the last stage's loss);
    each such segment is shared among the chunks that ran in it in proportion
    to their own durations (a segment without a chunk goes to the next one).
    On a GPU, each chunk and each wait is bounded by device synchronizations."""

    def __init__(self, sync):
        self.sync, self.samples = sync, {}
        self.start, self.carry, self.chunks = None, 0.0, []

    def begin(self):
        self.sync()
        self.start, self.chunks = time.perf_counter(), []

    def clear(self):
        self.samples, self.carry = {}, 0.0

    def end(self):
        """Close the segment running now (at a wait, or the end of the step)."""
        if self.start is None:
            return
        self.sync()
        total = time.perf_counter() - self.start + self.carry
        own = sum(d for _, d in self.chunks)
        if self.chunks:
            for key, d in self.chunks:
                share = d / own if own > 0 else 1.0 / len(self.chunks)
                self.samples.setdefault(key, []).append(total * share)
            self.carry = 0.0
        else:
            self.carry = total
        self.start, self.chunks = None, []

    def chunk(self, fn, key, last_key=None):
        """fn timed as one of the chunks key; a call with last_backward=True
        goes by last_key where given (DDP reduces the gradients in it)."""
        def call(*args, **kwargs):
            k = last_key if last_key is not None and kwargs.get("last_backward") else key
            return _timed(fn, self.sync, lambda d: self.chunks.append((k, d)))(*args, **kwargs)
        return call


class TransferLog:
    """This rank's posts of sends and receives in the timed steps, in posting
    order: [direction, peer (global rank), post start, post end, wait start,
    wait end] (wait times once waited; after sync() on a GPU)."""

    def __init__(self, sync):
        self.sync, self.records, self.posted = sync, [], {}

    def clear(self):
        self.records = []

    def post(self, fn):
        import torch.distributed as dist

        def call(p2p_ops, *args, **kwargs):
            t0 = time.perf_counter()
            works = fn(p2p_ops, *args, **kwargs)
            t1 = time.perf_counter()
            mine = [["send" if o.op in (dist.isend, dist.send) else "recv", o.peer, t0, t1, None, None]
                    for o in p2p_ops]
            self.records += mine
            self.posted[id(works)] = mine
            return works
        return call

    def wait(self, fn):
        def call(works, *args, **kwargs):
            t0 = time.perf_counter()
            out = fn(works, *args, **kwargs)
            self.sync()
            t1 = time.perf_counter()
            for rec in self.posted.pop(id(works), []):
                rec[4], rec[5] = t0, t1
            return out
        return call


def transfer_times(records: list, tier_of=lambda a, b: "intra") -> dict:
    """records[r]: rank r's TransferLog.records (one clock for all ranks).
    tier -> [seconds]: the n-th send from a to b met with the n-th receive at b
    from a, for each transfer whose receive's wait blocked (over BLOCKED_S),
    the time from the later of the two posts' ends to the wait's end, at
    least 0 (gloo may deliver while a send's post is still returning). The
    posts' ends, as the pipeline simulation has them: a chunk's time holds
    its rank's busy time up to its next wait, posts included
    (ChunkClock), and its transfers start from there; counting from a
    send's start instead would count a slow post twice (tiny-gpt's
    interleaved pipeline on 2 ranks came out +19.8 % so, its posts taking up
    to 2.5 ms)."""
    sends, recvs = {}, {}
    for r, recs in enumerate(records):
        for kind, peer, p0, p1, w0, w1 in recs:
            if kind == "send":
                sends.setdefault((r, peer), []).append(p1)
            elif w1 is not None:
                recvs.setdefault((peer, r), []).append((p1, w0, w1))
    out = {}
    for (a, b), got in sorted(recvs.items()):
        for (p1, w0, w1), s1 in zip(got, sends.get((a, b), [])):
            if w1 - w0 > BLOCKED_S:
                out.setdefault(tier_of(a, b), []).append(max(0.0, w1 - max(p1, s1)))
    return out


def key_of(op) -> str:
    """The name a rank's samples of op go by: "CHUNK/fwd", "CHUNK/bwd", or
    "STAGE/optimizer" for the pp rank's optimizer step."""
    p = dict(op.params)
    if op.impl == "pipeline_p2p":
        return f"{p['tier']}/p2p"
    if op.impl == "pipeline_optimizer":
        return f"{p['rank_stage']}/{OPTIMIZER}"
    return f"{p['chunk']}/{op.impl.rsplit('_', 1)[1]}"


def _timed(fn, sync, record):
    """fn, each call's duration (bounded by device synchronizations) told to record."""
    def call(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        record(time.perf_counter() - t0)
        return out
    return call


def _around(fn, before, after):
    """fn, with before() ahead of every call and after() behind it."""
    def call(*args, **kwargs):
        before()
        try:
            return fn(*args, **kwargs)
        finally:
            after()
    return call


def instrument(step, stages, sched, opt, schedules, sync, barrier, with_reduce: bool) -> tuple:
    """Wrap the plan's pipeline for timing: (one timed step, its ChunkClock,
    the optimizer's samples, undo). A timed step waits at barrier(), then the
    clock runs from the step's start to the schedule's return (sched.step),
    stopped at every wait for the peers (schedules._wait_batch_p2p, restored
    by undo); the optimizer's sample runs from its call (opt.step) to the
    step's end; the log records its transfers (TransferLog). with_reduce:
    DDP's last backward of a step keeps a key of its own (REDUCE)."""
    clock, opt_s, opt_start, log = ChunkClock(sync), [], [0.0], TransferLog(sync)

    def optimizer_started():
        sync()
        opt_start[0] = time.perf_counter()

    def timed_step():
        barrier()
        clock.begin()
        step()
        sync()
        opt_s.append(time.perf_counter() - opt_start[0])

    opt.step = _around(opt.step, optimizer_started, lambda: None)
    for st in stages:
        st.forward_one_chunk = clock.chunk(st.forward_one_chunk, (st.stage_index, "fwd"))
        st.backward_one_chunk = clock.chunk(st.backward_one_chunk, (st.stage_index, "bwd"),
                                           (st.stage_index, REDUCE) if with_reduce else None)
    sched.step = _around(sched.step, lambda: None, clock.end)
    wait, post = schedules._wait_batch_p2p, schedules._batch_p2p
    schedules._wait_batch_p2p = _around(log.wait(wait), clock.end, clock.begin)
    schedules._batch_p2p = log.post(post)

    def undo():
        schedules._wait_batch_p2p, schedules._batch_p2p = wait, post
    return timed_step, clock, opt_s, log, undo


def run_steps(backend, items, settings, device) -> dict:
    """Run the plan's pipeline for warmup + n steps on every rank; this rank's
    chunk times {(virtual stage, "fwd"|"bwd"): [seconds per call]} after the
    warmup (ChunkClock) and its optimizer steps' {(pp index, "optimizer"):
    [...]}, and its TransferLog's records of those steps. n: at least 3 steps
    and settings.iters calls of a chunk, then more while the time budget
    (settings.time_budget_s per op) lasts, at most settings.max_iters calls;
    rank 0 decides, so every rank runs as many."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.device_mesh import init_device_mesh

    from commbench import training
    spec, par = _plan(items[0][1])
    dev = torch.device(backend.torch_device if device == "cuda" else "cpu")
    mesh = init_device_mesh(dev.type, (par.pp, par.dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))
    step, stages, sched, opt = training.pipeline(spec, par, mesh, dev, seed=0)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    timed_step, clock, opt_s, log, undo = instrument(step, stages, sched, opt, schedules, sync, dist.barrier,
                                                     with_reduce=par.dp > 1)
    try:
        for _ in range(max(1, settings.warmup)):
            timed_step()
        clock.clear()
        opt_s.clear()
        log.clear()
        m = par.num_microbatches
        least = max(3, math.ceil(settings.iters / m))
        most = max(least, settings.max_iters // m)
        budget, t0, done = settings.time_budget_s * len(items), time.perf_counter(), 0
        while True:
            timed_step()
            done += 1
            more = done < least or (done < most and time.perf_counter() - t0 < budget)
            if not backend.control_bcast(more):
                break
    finally:
        undo()
    return {**clock.samples, (mesh["pp"].get_local_rank(), OPTIMIZER): opt_s}, log.records


def measure(backend, items, settings, device, hosts) -> list:
    """One compute Measurement per item (the ops of one plan), every rank
    taking part; samples_s of a chunk: per call, the maximum over the ranks
    that hold it; rank_samples_s: each rank's own (empty on the others)."""
    import numpy as np

    from commbench import stats
    from commbench.results import Measurement
    errors = [e for e in backend.control_allgather(_setup_error(backend, items[0][1])) if e]
    if errors:
        return [Measurement(case=case, status="skipped", skip_reason=f"could not set up: {errors[0]}")
                for case, _ in items]
    own, records = run_steps(backend, items, settings, device)
    every = backend.control_allgather({f"{k}/{phase}": v for (k, phase), v in own.items()})
    transfers = _transfers(backend, items, records, hosts)
    out = []
    for case, op in items:
        key = key_of(op)
        if op.impl == "pipeline_p2p":
            out.append(_p2p_measurement(case, transfers, dict(op.params)["tier"], settings))
            continue
        rank_samples = [r.get(key, []) for r in every]
        holders = [s for s in rank_samples if s]
        if not holders:
            out.append(Measurement(case=case, status="skipped", skip_reason="no rank ran it"))
            continue
        samples = [max(calls) for calls in zip(*holders)]
        summary = stats.summarize(samples)
        slowest = int(np.argmax([np.mean(s) if s else -1.0 for s in rank_samples]))
        m = Measurement(case=case, samples_s=samples, warmup=settings.warmup, target_ci=settings.target_ci,
                        stats=summary, rank_time_p50_s=[float(np.median(s)) if s else 0.0 for s in rank_samples],
                        rank_samples_s=rank_samples, slowest_rank=slowest, slowest_host=hosts[slowest],
                        warnings=stats.warnings_for(summary, len(samples), settings.target_ci, settings.ci_of))
        t = m.stats["time_p50_s"]
        m.algbw_gbps = case.nbytes / t / 1e9 if t > 0 else None
        m.warnings.append("timed inside the plan's pipeline schedule (warmup in whole steps)")
        out.append(m)
    return out


def _transfers(backend, items, records, hosts):
    """tier -> the transfers' times (transfer_times; a pair of ranks on two
    hosts is inter-node, as the job runs, emulated nodes included) where the
    plan has pipeline_p2p ops and every rank shares one clock; else a line
    saying why not (every rank takes part in the exchanges either way)."""
    from commbench.env import machine_id
    machines = backend.control_allgather(machine_id())
    every = backend.control_allgather(records if any(op.impl == "pipeline_p2p" for _, op in items) else [])
    if len(set(machines)) > 1:
        return ("its ranks run on more than one machine: a transfer's two ends are timed on different clocks "
                "(the sweep's send_recv stands in)")
    return transfer_times(every, lambda a, b: "intra" if hosts[a] == hosts[b] else "inter")


def _p2p_measurement(case, transfers, tier: str, settings):
    from commbench import stats
    from commbench.results import Measurement
    if isinstance(transfers, str):
        return Measurement(case=case, status="skipped", skip_reason=transfers)
    samples = transfers.get(tier, [])
    if len(samples) < 2:
        return Measurement(case=case, status="skipped",
                           skip_reason=f"{len(samples)} transfer(s) of the tier whose receiver waited")
    summary = stats.summarize(samples)
    m = Measurement(case=case, samples_s=samples, warmup=settings.warmup, target_ci=settings.target_ci,
                    stats=summary, warnings=stats.warnings_for(summary, len(samples), settings.target_ci,
                                                               settings.ci_of))
    m.warnings.append("transfers timed inside the plan's pipeline schedule, after the later of their posts")
    return m
