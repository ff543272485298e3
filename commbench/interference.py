"""`commbench compute --interference`: how much a concurrent collective slows
compute, and compute the collective. Each of the two ops is timed alone and
with the other running throughout its timed window; the raw samples of all four
are stored and slowdowns() derives p50(concurrent) / p50(alone).

CPU: a float32 torch.mm in the main thread against a gloo all_reduce; the
partner runs in a Python thread (both release the GIL).
GPU: sm_spin_kernel on k SMs (one block of 1024 threads per SM) on its own
stream against an NCCL all_reduce; the partner is work queued on the GPU that
outlasts the measurement (a warning says where it did not)."""
import datetime
import math
import threading
import uuid
from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np

from commbench import env, results, stats, timing
from commbench.timing import TimingSettings
from commbench.results import Case, Measurement, ResultFile

SPIN_TIME_S = 1e-3          # GPU: one sm_spin launch lasts about this long alone
SM_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1)

Pair = namedtuple("Pair", "num_sms compute collective")


@dataclass(frozen=True)
class InterferenceConfig:
    device: str                       # cpu | cuda
    nbytes: int = 4 << 20             # all_reduce buffer
    sms: tuple | None = None          # cuda: SM counts of the compute (None: SM_FRACTIONS of the device)
    gemm_size: int = 512              # cpu: torch.mm of two gemm_size^2 float32 matrices
    timing: TimingSettings = field(default_factory=TimingSettings)
    timeout_s: float | None = None    # T of the watchdog's deadlines (None: 60 s), as compute's --timeout

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: choose cpu or cuda")
        if self.nbytes < 4 or self.nbytes % 4:
            raise ValueError(f"--nbytes {self.nbytes}: the all_reduce is float32, so a positive multiple of 4 bytes")
        if self.sms is not None:
            if self.device != "cuda":
                raise ValueError("--sms sets the SMs of the GPU compute kernel: it needs --device cuda")
            if not self.sms or any(k < 1 for k in self.sms):
                raise ValueError(f"--sms {','.join(map(str, self.sms))}: SM counts must be at least 1")
        if self.gemm_size < 1:
            raise ValueError(f"--gemm-size must be at least 1, got {self.gemm_size}")
        self.timing.check()
        timing.check_timeout(self.timeout_s)

    def window_s(self, partner_of_s: float) -> float:
        """An upper bound of one measurement's wall time, for an op taking
        partner_of_s alone: warmup and minimum iterations (allowing 4x slowdown),
        the adaptive budget, and slack."""
        t = self.timing
        return t.time_budget_s + 4 * (t.warmup + t.iters) * partner_of_s + 0.2


# --- CPU partners: Python threads ---------------------------------------------------------
class _Partner(threading.Thread):
    """Runs step() in a loop from entering the context until leaving it."""

    def __init__(self, step):
        super().__init__(daemon=True)
        self.step, self.stop, self.error = step, threading.Event(), None

    def run(self):
        try:
            while self.step(self.stop.is_set()):
                pass
        except BaseException as e:   # re-raised by the main thread
            self.error = e

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join()
        if self.error is not None and exc[0] is None:
            raise self.error


def gemm_partner(gemm):
    def step(stopping):
        gemm()
        return not stopping
    return _Partner(step)


def collective_partner(dist, buf, group):
    """all_reduce loop over a zero buffer whose element 0 carries each rank's stop
    flag: the sum is seen by all ranks after the same iteration, so every rank
    stops after the same number of all_reduces (none is left waiting)."""
    def step(stopping):
        buf[0] = 1.0 if stopping else 0.0
        dist.all_reduce(buf, group=group)
        return buf[0].item() == 0
    return _Partner(step)


# --- measurements -----------------------------------------------------------------------
def _record(backend, case, timed, settings, wrong, hosts, extra_warnings=()):
    from commbench.collectives import COLLECTIVES
    summary = stats.summarize(timed.samples_s)
    own_p50 = np.zeros(backend.world_size)
    own_p50[backend.rank] = float(np.median(timed.own_samples_s))
    rank_p50 = backend.control_reduce(own_p50, "sum").tolist()
    per_rank_wrong = np.zeros(backend.world_size)
    per_rank_wrong[backend.rank] = wrong
    per_rank_wrong = backend.control_reduce(per_rank_wrong, "sum")
    algbw = busbw = None
    if case.op == "collective":
        ar = COLLECTIVES["all_reduce"]
        algbw = ar.algbw_gbps(case.nbytes, summary["time_p50_s"])
        busbw = algbw * ar.busbw_factor(case.group_size)
    slowest = int(np.argmax(rank_p50))
    return Measurement(case=case, samples_s=timed.samples_s, warmup=settings.warmup, target_ci=settings.target_ci,
                       stats=summary, algbw_gbps=algbw, busbw_gbps=busbw, num_wrong=int(per_rank_wrong.sum()),
                       wrong_ranks=[int(r) for r in np.nonzero(per_rank_wrong)[0]], rank_time_p50_s=rank_p50,
                       slowest_rank=slowest, slowest_host=hosts[slowest],
                       warnings=stats.warnings_for(summary, len(timed.samples_s), settings.target_ci, settings.ci_of)
                       + list(extra_warnings))


def _check_all_reduce(backend, op, buf, count) -> int:
    """Every rank contributes rank + 1: the sum is n(n+1)/2 everywhere. The buffer
    is left zeroed (the partner's stop flag needs a zero buffer)."""
    n = backend.world_size
    backend.upload(buf, np.full(count, backend.rank + 1.0))
    backend.synchronize()
    op()
    backend.synchronize()
    wrong = int(np.count_nonzero(backend.download(buf) != n * (n + 1) / 2))
    backend.upload(buf, np.zeros(count))
    backend.synchronize()
    return wrong


def run(config: InterferenceConfig, info, argv, out_path, overwrite=False, on_measurement=None, backend=None):
    """On every rank. Returns the ResultFile on rank 0, else None. A torch backend
    passed in (shared with other work of the job) is used and left open. Each
    measurement runs under a watchdog.Guard (a hung or dead rank: EXIT_TIMEOUT
    and one line naming it)."""
    from commbench import watchdog
    own = backend is None
    if own:
        backend = watchdog.open_backend("torch", info, config.device, watchdog.rendezvous_timeout_s(config.timeout_s))
    try:
        ranks = backend.control_allgather(env.rank_info(info, config.device))
        hosts = [r["host"] for r in ranks]
        run_id, created = backend.control_bcast(
            (uuid.uuid4().hex[:12], datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")))
        t = config.timing
        settings = {"interference": True, "device": config.device, "nbytes": config.nbytes,
                    "sms": list(config.sms) if config.sms else None, "gemm_size": config.gemm_size,
                    "warmup": t.warmup, "iters": t.iters, "max_iters": t.max_iters,
                    "time_budget_s": t.time_budget_s, "target_ci": t.target_ci, "ci_of": t.ci_of, "timeout_s": config.timeout_s}
        header = env.header(info, ranks, argv, run_id, created, settings)
        from commbench import rankcheck
        rankcheck.check_same(backend, settings)      # ranks started with other flags or versions are refused
        writer = results.open_on_rank0(backend.rank, backend.control_bcast, out_path, header, overwrite)
        result = ResultFile(header=header, measurements=[], path=out_path)

        def emit(m):
            if writer:
                writer.append(m)
                result.measurements.append(m)
                if on_measurement:
                    on_measurement(m)
        from commbench import launch
        launch.setup_cpu_rank(info, config.device)     # the same threads as `commbench compute` times with
        try:
            with watchdog.Guard("interference", backend, hosts, run_id, out_path, config.timeout_s) as guard:
                _measure_all(config, backend, hosts, guard, emit)
        finally:
            if writer:
                writer.close()
        return result if backend.rank == 0 else None
    finally:
        if own:
            backend.close()


def _measure_all(config, backend, hosts, guard, emit):
    """The all_reduce alone, then per compute partner: compute alone, compute
    with the all_reduce, the all_reduce with compute; each a step of guard."""
    from commbench import watchdog
    t = config.timing
    dist = backend.dist
    world = list(range(backend.world_size))
    from commbench.backends.base import Group
    coll_work = f"all_reduce {config.nbytes} B float32 {backend.name} over {len(world)} ranks"
    coll_s = watchdog.call_bound_s(config.nbytes)
    comp_s = watchdog.call_bound_s(flops=2.0 * config.gemm_size ** 3) if config.device == "cpu" else 10 * SPIN_TIME_S
    with guard.step(f"interference: {coll_work} (checked, then alone)", 4 * coll_s):
        # the measured all_reduce gets a group of its own: on gloo the control
        # channel is WORLD, and a partner thread must not share a group with it
        g = Group(ranks=tuple(world), rank=backend.rank, handle=dist.new_group(world))
        count = config.nbytes // 4
        buf = backend.empty(count, "float32")
        coll = backend.all_reduce(g, buf, buf, "sum", True)
        coll_wrong = _check_all_reduce(backend, coll, buf, count)
        coll_alone = timing.measure(backend, coll, t, on_phase=guard.on_phase(coll_s))
    base = dict(kind="interference", backend=backend.name, device=config.device, dtype="float32",
                nbytes=config.nbytes, group_size=len(world), num_nodes=len(set(hosts)), axis="world",
                in_place=False)

    def case(op, work, concurrent, num_sms, partner):
        return Case(op=op, **base, params={"concurrent": concurrent, "num_sms": num_sms,
                                           "partner": partner if concurrent else None, "work": work})

    emit(_record(backend, case("collective", coll_work, False, None, None), coll_alone, t, coll_wrong, hosts))
    t_coll = backend.control_bcast(float(np.median(coll_alone.samples_s)))
    parts = _cpu(config, backend, dist, buf, g) if config.device == "cpu" else _gpu(config, backend, buf, g, t_coll)
    while True:
        with guard.step("interference: setting up the compute partner", 4 * comp_s + 4 * coll_s):
            part = next(parts, None)
        if part is None:
            dist.destroy_process_group(g.handle)     # its threads would run beside what the job times next
            return
        num_sms, work, compute, timer, wrong, warn, with_coll, with_compute = part
        with guard.step(f"interference: {work} alone", comp_s):
            alone = timing.measure(timer, compute, t, on_phase=guard.on_phase(comp_s))
        emit(_record(backend, case("compute", work, False, num_sms, None), alone, t, wrong, hosts, warn))
        t_comp = backend.control_bcast(float(np.median(alone.samples_s)))
        with guard.step(f"interference: {work} with {coll_work}", 4 * comp_s):
            with with_coll(config.window_s(t_comp)) as p:
                timed = timing.measure(timer, compute, t, on_phase=guard.on_phase(4 * comp_s))
        emit(_record(backend, case("compute", work, True, num_sms, coll_work), timed, t, wrong, hosts,
                     getattr(p, "warnings", ())))
        with guard.step(f"interference: {coll_work} with {work}", 4 * coll_s):
            with with_compute(config.window_s(t_coll)) as p:
                timed = timing.measure(backend, coll, t, on_phase=guard.on_phase(4 * coll_s))
        emit(_record(backend, case("collective", coll_work, True, num_sms, work), timed, t, coll_wrong, hosts,
                     getattr(p, "warnings", ())))


def _cpu(config, backend, dist, buf, g):
    import torch

    m = config.gemm_size
    gen = torch.Generator().manual_seed(1234)
    a, b = torch.rand(m, m, generator=gen), torch.rand(m, m, generator=gen)
    c = torch.empty(m, m)

    def gemm():
        torch.mm(a, b, out=c)
    gemm()
    # float32 GEMM against float64: k products of values in [0, 1) per element
    ref = a.double().numpy() @ b.double().numpy()
    wrong = int(np.count_nonzero(~np.isclose(c.numpy(), ref, rtol=1e-4, atol=1e-5 * m)))
    yield (None, f"gemm {m}x{m}x{m} float32 torch.mm", gemm, backend, wrong, (),
           lambda _w: collective_partner(dist, buf, g.handle), lambda _w: gemm_partner(gemm))


def _gpu(config, backend, buf, g, t_coll):
    from commbench.interference_gpu import gpu_parts
    yield from gpu_parts(config, backend, buf, g, t_coll, SM_FRACTIONS)


# --- the figure the predictor uses -------------------------------------------------------------
def slowdowns(result_file) -> dict:
    """{Pair(num_sms, compute, collective): {"compute": f, "collective": f}} with
    f = p50(concurrent) / p50(alone) from the raw samples: how many times longer
    the op takes with its partner running (1.0 = no interference). A factor is
    left out where its alone or concurrent measurement is missing."""
    if isinstance(result_file, str):
        result_file = results.load(result_file)
    ms = [m for m in result_file.measurements if m.case.kind == "interference" and m.status == "ok"]

    def ident(c):
        return (c.op, c.backend, c.device, c.dtype, c.nbytes, c.group_size, c.params.get("work"))
    alone = {ident(m.case): float(np.percentile(m.samples_s, 50)) for m in ms if not m.case.params["concurrent"]}
    out = {}
    for m in ms:
        p = m.case.params
        if not p["concurrent"] or ident(m.case) not in alone:
            continue
        if m.case.op == "compute":
            key = Pair(p["num_sms"], p["work"], p["partner"])
        else:
            key = Pair(p["num_sms"], p["partner"], p["work"])
        out.setdefault(key, {})[m.case.op] = float(np.percentile(m.samples_s, 50)) / alone[ident(m.case)]
    return out


# --- command line -----------------------------------------------------------------------------
def default_out() -> str:
    import os
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("results", f"interference-{stamp}-{os.getpid()}.jsonl")


def parse_sms(text):
    if text is None:
        return None
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"--sms {text!r}: expected comma-separated SM counts, e.g. 8,32,66") from None


def cli(a, argv) -> int:
    """`commbench compute --interference` with the compute verb's parsed flags."""
    import json
    import os
    import sys

    from commbench import launch as launch_mod
    from commbench.sizes import parse_size
    if a.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {a.device!r}: choose cpu, cuda or auto")
    settings = TimingSettings(warmup=a.warmup, iters=a.iters, max_iters=a.max_iters,
                                     time_budget_s=a.time_budget, target_ci=a.target_ci)
    probe = dict(nbytes=parse_size(a.nbytes), sms=parse_sms(a.sms), gemm_size=a.gemm_size, timing=settings,
                 timeout_s=a.timeout)
    InterferenceConfig(device="cuda" if a.sms else "cpu", **probe)      # bad flags fail before torch loads
    device = a.device
    if device != "cpu":
        import torch
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and a.sms:
            have = torch.cuda.get_device_properties(0).multi_processor_count
            if max(parse_sms(a.sms)) > have:
                raise ValueError(f"--sms {a.sms}: the GPU has {have} SMs")
    config = InterferenceConfig(device=device, **probe)
    info = launch_mod.detect()
    if info.launcher == "none":
        nprocs = a.nprocs
        if nprocs is None:
            import torch
            nprocs = torch.cuda.device_count() if device == "cuda" else 2
        if nprocs < 1:
            raise ValueError(f"--nprocs must be at least 1, got {nprocs}")
        out = a.out or default_out()
        if os.path.exists(out) and not a.force:
            raise ValueError(f"{out} exists: commbench never overwrites results (use --force or another --out)")
        child = list(argv) if a.out else [*argv, "--out", out]
        return launch_mod.spawn_local(nprocs, child, use_mpiexec=False)
    if a.nprocs is not None and a.nprocs != info.world_size:
        raise ValueError(f"--nprocs {a.nprocs} but the launcher started {info.world_size} ranks")
    from commbench import watchdog
    out = a.out or default_out()
    result = watchdog.interruptible(info.rank, out, lambda: run(config, info, ["commbench", *argv], out, a.force))
    if result is None:
        return 0
    wrong = sum(m.num_wrong for m in result.measurements)
    if a.json:
        print(json.dumps(dict(result.to_json(), slowdowns=[
            {"num_sms": k.num_sms, "compute": k.compute, "collective": k.collective, **v}
            for k, v in slowdowns(result).items()])))
    elif not a.quiet:
        for k, v in slowdowns(result).items():
            sms = f"{k.num_sms} SMs: " if k.num_sms else ""
            print(f"{sms}{k.compute} x {k.collective}: compute {v.get('compute', math.nan):.3f}x, "
                  f"collective {v.get('collective', math.nan):.3f}x slower together")
        print(f"results: {result.path}")
    if wrong:
        print(f"commbench: {wrong} wrong result element(s); see #wrong in {result.path}", file=sys.stderr)
    return 1 if wrong else 0
