"""`commbench run --backend kernels`: device-memory bandwidth (copy, STREAM triad)
of each rank's GPU and peer-to-peer copy (remote read, remote write,
bidirectional) between every pair of GPUs of a node, with the kernels of
kernels/. Each case is checked against its reference, then timed with CUDA
events under the adaptive protocol of timing.py.

Without a launcher one process measures every visible GPU. Under a launcher
each rank measures its own GPU (local rank modulo the visible count) and local
rank 0 of each node the GPU pairs it sees; rank 0 gathers and writes."""
import contextlib
import datetime
import json
import sys
import uuid

import numpy as np

from commbench import env, kernels, results, stats, timing, watchdog
from commbench.results import Case, Measurement, ResultFile

TRIAD_SCALAR = 3.0
# bytes moved per launch per float4 element (16 B), as the .cu headers define them
BYTES_PER_ELEMENT = {"copy": 2 * 16, "triad": 3 * 16, "p2p_read": 16, "p2p_write": 16, "p2p_bidir": 16}


class StreamTimer:
    """What timing.measure needs of a backend, for ops timed with CUDA events on
    one stream. Events are recorded on streams[0], a stream of `device`; synchronize waits for all of
    them. Without `control` the decision is this process's alone; with a backend
    as control, its ranks decide together (as in the sweep)."""

    def __init__(self, cupy, device, streams, control=None):
        self.cupy, self.device, self.streams, self.control = cupy, device, list(streams), control
        self.rank = control.rank if control else 0

    def time_iterations(self, op, iters):
        cupy, s = self.cupy, self.streams[0]
        with cupy.cuda.Device(self.device):
            return timing.event_timer(op, iters, cupy.cuda.Event, cupy.cuda.get_elapsed_time,
                                      self.synchronize, record=lambda e: e.record(s))

    def synchronize(self):
        for s in self.streams:
            s.synchronize()

    def control_barrier(self):
        if self.control:
            self.control.control_barrier()

    def control_reduce(self, values, op):
        return self.control.control_reduce(values, op) if self.control else np.asarray(values, np.float64)

    def control_bcast(self, obj, root=0):
        return self.control.control_bcast(obj, root) if self.control else obj


def element_counts(sizes) -> list:
    """Buffer sizes in bytes -> distinct float4 counts (each buffer rounded down
    to a multiple of 16 B, at least one float4)."""
    return list(dict.fromkeys(max(1, s // 16) for s in sizes))


def measured(case, timed, settings, wrong, rank, host) -> Measurement:
    summary = stats.summarize(timed.samples_s)
    algbw = case.nbytes / summary["time_p50_s"] / 1e9
    if case.op == "p2p_bidir":      # both directions at once: as send_recv_bidir, 2 x nbytes
        algbw *= 2
    return Measurement(case=case, samples_s=timed.samples_s, warmup=settings.warmup,
                       target_ci=settings.target_ci, stats=summary, algbw_gbps=algbw, busbw_gbps=algbw,
                       num_wrong=wrong, wrong_ranks=[rank] if wrong else [],
                       rank_time_p50_s=[summary["time_p50_s"]], slowest_rank=rank, slowest_host=host,
                       warnings=stats.warnings_for(summary, len(timed.samples_s), settings.target_ci))


def _case(op, n, params):
    return Case(kind="memory", op=op, backend="kernels", device="cuda", dtype="float32",
                nbytes=n * BYTES_PER_ELEMENT[op], group_size=2 if op.startswith("p2p") else 1, num_nodes=1,
                axis="intra", in_place=False, params=params)


def memory_case(cupy, ks, op, n, settings, check, rank, host) -> Measurement:
    """copy or triad of n float4 on ks.device."""
    with cupy.cuda.Device(ks.device):
        stream = cupy.cuda.Stream(non_blocking=True)
        a = kernels.pattern(cupy, 4 * n, 1)
        b = kernels.pattern(cupy, 4 * n, 2)
        c = cupy.zeros(4 * n, dtype=cupy.float32)
        if op == "copy":
            def run():
                ks.copy(a, c, stream)
            verify = lambda: ks.check_copy(a, c)   # noqa: E731
        else:
            def run():
                ks.triad(a, b, c, TRIAD_SCALAR, stream)
            verify = lambda: ks.check_triad(a, b, c, TRIAD_SCALAR)   # noqa: E731
        wrong = 0
        for _ in range(check):
            c.fill(0)
            cupy.cuda.Device().synchronize()
            run()
            stream.synchronize()
            wrong += verify()
        timed = timing.measure(StreamTimer(cupy, ks.device, [stream]), run, settings)
    return measured(_case(op, n, {"gpu": ks.device}), timed, settings, wrong, rank, host)


def enable_peer_access(cupy, i, j) -> bool:
    """Whether device i can reach j's memory; enables it if it can."""
    rt = cupy.cuda.runtime
    if not rt.deviceCanAccessPeer(i, j):
        return False
    with cupy.cuda.Device(i):
        try:
            rt.deviceEnablePeerAccess(j)
        except rt.CUDARuntimeError as e:   # cudaErrorPeerAccessAlreadyEnabled is fine
            if "AlreadyEnabled" not in str(e) and "already" not in str(e).lower():
                raise
    return True


def p2p_case(cupy, ks, op, i, j, n, settings, check, rank, host) -> Measurement:
    """Copy of n float4 from GPU i to GPU j (bidir: i->j and j->i at once)."""
    case = _case(op, n, {"src": i, "dst": j})
    need = [(j, i)] if op == "p2p_read" else [(i, j)] if op == "p2p_write" else [(i, j), (j, i)]
    missing = [f"{x}->{y}" for x, y in need if not enable_peer_access(cupy, x, y)]
    if missing:
        return Measurement(case=case, status="skipped",
                           skip_reason=f"no peer access {', '.join(missing)} (cudaDeviceCanAccessPeer)")
    buf = {}
    for d, seed in ((i, 3), (j, 4)):
        with cupy.cuda.Device(d):
            buf[d] = (kernels.pattern(cupy, 4 * n, seed), cupy.zeros(4 * n, dtype=cupy.float32),
                      cupy.cuda.Stream(non_blocking=True))
    (src_i, dst_i, s_i), (src_j, dst_j, s_j) = buf[i], buf[j]
    if op == "p2p_read":        # runs on the destination, reads the peer
        streams, pairs = [s_j], [(src_i, dst_j)]

        def run():
            ks[j].p2p_copy(src_i, dst_j, s_j)
    elif op == "p2p_write":     # runs on the source, writes the peer
        streams, pairs = [s_i], [(src_i, dst_j)]

        def run():
            ks[i].p2p_copy(src_i, dst_j, s_i)
    else:
        # both devices write towards the other at once; s_j starts after s_i's
        # start fence and s_i's timing event waits for s_j's end, so the events on
        # s_i bracket both copies
        streams, pairs = [s_i, s_j], [(src_i, dst_j), (src_j, dst_i)]
        with cupy.cuda.Device(i):
            start = cupy.cuda.Event(disable_timing=True)
        with cupy.cuda.Device(j):
            end = cupy.cuda.Event(disable_timing=True)

        def run():
            start.record(s_i)
            with cupy.cuda.Device(j):
                s_j.wait_event(start)
            ks[i].p2p_copy(src_i, dst_j, s_i)
            ks[j].p2p_copy(src_j, dst_i, s_j)
            with cupy.cuda.Device(j):
                end.record(s_j)
            s_i.wait_event(end)
    wrong = 0
    for _ in range(check):
        for _, dst in pairs:
            dst.fill(0)
        for d in (i, j):
            cupy.cuda.Device(d).synchronize()
        run()
        for s in streams:
            s.synchronize()
        wrong += sum(ks[i].check_p2p(src, dst) for src, dst in pairs)
    timed = timing.measure(StreamTimer(cupy, j if op == "p2p_read" else i, streams), run, settings)
    return measured(case, timed, settings, wrong, rank, host)


def run(info, sizes, settings, check, out_path, overwrite, argv, timeout_s, on_measurement=None):
    """Every case on this rank. Returns (the ResultFile on rank 0, else None; the
    number of wrong elements over all cases, on rank 0)."""
    cupy = kernels.import_cupy("--backend kernels")
    count = cupy.cuda.runtime.getDeviceCount()
    ctl = None
    if info.world_size > 1:    # a control channel to gather the measurements
        ctl = watchdog.open_backend("torch", info, "cpu", watchdog.rendezvous_timeout_s(timeout_s, max(sizes)),
                                    dist_backend="gloo")
    try:
        mine = env.rank_info(info, "cuda")
        ranks = ctl.control_allgather(mine) if ctl else [mine]
        run_id = uuid.uuid4().hex[:12]
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        run_id, created = ctl.control_bcast((run_id, created)) if ctl else (run_id, created)
        settings_doc = {"sizes": sizes, "backend": "kernels", "device": "cuda", "check_iters": check,
                        "warmup": settings.warmup, "iters": settings.iters, "max_iters": settings.max_iters,
                        "time_budget_s": settings.time_budget_s, "target_ci": settings.target_ci,
                        "triad_scalar": TRIAD_SCALAR, "kernels_dir": str(kernels.kernels_dir())}
        header = env.header(info, ranks, argv, run_id, created, settings_doc)
        writer = results.open_on_rank0(info.rank, ctl.control_bcast if ctl else (lambda x: x), out_path, header,
                                       overwrite)
        host = mine["host"]
        gpus = [info.local_rank % count] if ctl else list(range(count))
        ks = {d: kernels.Kernels(d) for d in range(count)}
        result = ResultFile(header=header, measurements=[], path=out_path)
        wrong = 0

        def emit(m):
            nonlocal wrong
            got = [m] if ctl is None else [Measurement.from_dict(d) for d in
                                          ctl.control_allgather(None if m is None else m.to_dict()) if d]
            for x in got:
                wrong += x.num_wrong
                if writer:
                    writer.append(x)
                    result.measurements.append(x)
                    if on_measurement:
                        on_measurement(x)

        if ctl:
            with watchdog.Guard("kernels", ctl, [r["host"] for r in ranks], run_id, out_path, timeout_s) as guard:
                _all_cases(cupy, ks, info, gpus, count, sizes, settings, check, host, ctl, guard, emit)
        else:
            _all_cases(cupy, ks, info, gpus, count, sizes, settings, check, host, ctl, None, emit)
        if writer:
            writer.close()
        return (result if info.rank == 0 else None), wrong
    finally:
        if ctl:
            ctl.close()


def _step(guard, what: str, nbytes: int, settings):
    """A guarded step of a multi-rank run (one per case, the same number on
    every rank): its check, warmup and first iterations at 100 MB/s, plus the
    time budget; nothing to guard on a single rank."""
    if guard is None:
        return contextlib.nullcontext()
    calls = 2 + settings.warmup + settings.iters
    return guard.step(what, calls * watchdog.call_bound_s(nbytes) + settings.time_budget_s)


def _all_cases(cupy, ks, info, gpus, count, sizes, settings, check, host, ctl, guard, emit):
    counts = element_counts(sizes)
    for op in ("copy", "triad"):
        for n in counts:
            for g in gpus:     # every rank runs the same number of cases
                with _step(guard, f"kernels {op} of {16 * n} B on GPU {g}", 3 * 16 * n, settings):
                    emit(memory_case(cupy, ks[g], op, n, settings, check, info.rank, host))
    pairs = []
    if info.local_rank == 0:
        ordered = [(i, j) for i in range(count) for j in range(count) if i != j]
        pairs = ([("p2p_read", i, j) for i, j in ordered] + [("p2p_write", i, j) for i, j in ordered]
                 + [("p2p_bidir", i, j) for i, j in ordered if i < j])
    todo = [(op, i, j, n) for op, i, j in pairs for n in counts]
    steps = int(ctl.control_reduce(np.array([len(todo)], np.float64), "max")[0]) if ctl else len(todo)
    for k in range(steps):
        with _step(guard, f"kernels {todo[k][0]} GPU {todo[k][1]} -> {todo[k][2]} of {16 * todo[k][3]} B"
                   if k < len(todo) else "kernels: waiting for another host's peer-to-peer cases",
                   2 * 16 * (todo[k][3] if k < len(todo) else max(counts)), settings):
            emit(p2p_case(cupy, ks, *todo[k][:3], todo[k][3], settings, check, info.rank, host)
                 if k < len(todo) else None)


def print_table(measurements, file=None):
    from rich.console import Console
    from rich.table import Table
    t = Table(title="kernels: device memory and peer-to-peer copy (algbw = bytes moved / p50 time)",
              title_justify="left")
    for col in ("op", "gpu", "bytes moved", "time p50 (us)", "GB/s", "#wrong", "CV", "iters", "host", "notes"):
        t.add_column(col, justify="left" if col in ("op", "gpu", "host", "notes") else "right")
    for m in measurements:
        p = m.case.params
        where = str(p["gpu"]) if "gpu" in p else f"{p['src']}{'<->' if m.case.op == 'p2p_bidir' else '->'}{p['dst']}"
        if m.status != "ok":
            t.add_row(m.case.op, where, str(m.case.nbytes), "", "", "", "", "", "", f"skipped: {m.skip_reason}")
            continue
        t.add_row(m.case.op, where, str(m.case.nbytes), f"{m.stats['time_p50_s'] * 1e6:.2f}",
                  f"{m.algbw_gbps:.1f}", str(m.num_wrong), f"{m.stats['cv']:.1%}", str(m.iters),
                  m.slowest_host or "", "; ".join(m.warnings))
    Console(width=200, file=file).print(t)


def cli(a, argv) -> int:
    """`commbench run --backend kernels` with the run verb's parsed flags."""
    from commbench import launch as launch_mod
    from commbench import planflags
    from commbench.sizes import parse_size, sweep
    if a.device not in ("auto", "cuda"):
        raise ValueError(f"--backend kernels runs CUDA kernels: --device {a.device} is not cuda")
    if planflags.given(a):
        raise ValueError("--backend kernels measures memory and peer-to-peer copies: it takes no plan flags")
    if a.collective not in (None, "all") or a.dtype or a.dist_backend:
        raise ValueError("--backend kernels runs its own kernels in float32: "
                         "--collective, -d/--dtype and --dist-backend do not apply")
    stepbytes = parse_size(a.stepbytes) if a.stepbytes is not None else None
    stepfactor = a.stepfactor if a.stepfactor is not None else (None if stepbytes is not None else 2.0)
    sizes = sweep(parse_size(a.minbytes), parse_size(a.maxbytes), stepfactor, stepbytes)
    settings = timing.TimingSettings(warmup=a.warmup, iters=a.iters, max_iters=a.max_iters,
                                     time_budget_s=a.time_budget, target_ci=a.target_ci)
    settings.check()
    if a.check < 0:
        raise ValueError(f"-c/--check must be >= 0, got {a.check}")
    timing.check_timeout(a.timeout)
    info = launch_mod.detect()
    if info.launcher == "none" and a.nprocs not in (None, 1):
        raise ValueError("--backend kernels needs no --nprocs: one process measures every visible GPU "
                         "(under a launcher, each rank its own)")
    kernels.import_cupy("--backend kernels")       # no GPU: one line, exit 2
    from commbench.cli import _default_out
    live = None
    if info.rank == 0 and not (a.quiet or a.json or a.csv):
        live = lambda m: print(f"{m.case.op} {m.case.params} {m.case.nbytes} B: "   # noqa: E731
                               + (f"{m.algbw_gbps:.1f} GB/s" if m.status == "ok" else m.skip_reason),
                               file=sys.stderr)
    result, wrong = run(info, sizes, settings, a.check, a.out or _default_out(), a.force,
                        ["commbench", *argv], a.timeout, live)
    if result is None:
        return 0
    if a.json:
        print(json.dumps(result.to_json()))
    elif a.csv:
        result.to_dataframe().to_csv(sys.stdout, index=False)
    elif not a.quiet:
        print_table(result.measurements)
        print(f"results: {result.path}")
    if wrong:
        print(f"commbench: {wrong} wrong result element(s); see #wrong in {result.path}", file=sys.stderr)
    return 1 if wrong else 0
