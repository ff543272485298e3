"""`commbench run`: every (layout, collective, dtype, redop, in-place, size) case
checked, timed and written as it completes. Runs on every rank; rank 0 writes."""
import datetime
import os
import signal
import uuid

import numpy as np

from commbench import env, groups, memcheck, rankcheck, stats, timing, watchdog
from commbench import resume as resume_mod
from commbench.backends.base import Unsupported
from commbench.collectives.base import Prepared, num_wrong
from commbench.dtypes import DTYPES
from commbench.results import Case, Measurement, ResultFile, ResultWriter


def corrupt_rank() -> int | None:
    """Fault injection for the correctness check's own tests: the rank named by
    COMMBENCH_INJECT_CORRUPTION sends a wrong input element in every check."""
    v = os.environ.get("COMMBENCH_INJECT_CORRUPTION")
    return int(v) if v and v.isdigit() else None


def cases(config, layout, group_size):
    """(collective, dtype, redop, in_place, nbytes, send, recv) in sweep order."""
    for coll in config.collective_list:
        for dtype in config.dtype_list if coll.name != "barrier" else config.dtype_list[:1]:
            itemsize = DTYPES[dtype].itemsize
            for redop in config.redop_list if coll.has_redop else [None]:
                for in_place in config.in_place_list:
                    seen = set()
                    for size in config.sizes if coll.name != "barrier" else [0]:
                        send, recv = coll.counts(size, group_size, itemsize)
                        nbytes = coll.size_bytes(send, recv, itemsize, group_size)
                        if nbytes in seen:    # several requested sizes round to one
                            continue
                        seen.add(nbytes)
                        yield coll, dtype, redop, in_place, nbytes, send, recv


def skip_reason(backend, coll, dtype, redop, in_place, group_size, root) -> str | None:
    if group_size < coll.min_group:
        return f"{coll.name} needs groups of at least {coll.min_group} ranks"
    if coll.has_root and root >= group_size:
        return f"root {root} is outside a group of {group_size} ranks"
    if redop == "avg" and not DTYPES[dtype].is_float:
        return "avg is defined here for floating-point types only"
    try:
        backend.check_supported(coll.name, dtype, redop, in_place)
    except Unsupported as e:
        return str(e)
    return None


PLAN_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}


def plan_cases(workload, par, hosts, isolated=False):
    """(layout, case) for every distinct collective of a plan's workload, on the
    plan's real groups: every group of an axis at once (as in training), or only
    the first one with isolated. Pipeline p2p runs between adjacent stages: pairs
    (stage 2j, 2j+1) of every pipeline at once; the tied embedding's all-reduce
    over the first and the last stage of every pipeline (pp.embedding_groups)."""
    from commbench.collectives import COLLECTIVES
    from commbench.strategies import pp
    layouts, out, seen = {}, [], set()
    for c in sorted(workload.comm_ops, key=lambda c: (c.axis, c.collective, c.nbytes)):
        dtype = PLAN_DTYPES[c.dtype]
        key = (c.axis, c.collective, c.nbytes, dtype)
        if key in seen:
            continue
        seen.add(key)
        pairs = c.collective.startswith("send_recv")
        embedding = pp.runs_on_embedding_groups(c)
        if (c.axis, pairs, embedding) not in layouts:
            gs = pp.embedding_groups(par) if embedding else par.groups[c.axis]
            if pairs:
                gs = [g[i:i + 2] for g in gs for i in range(0, len(g) - 1, 2)]
            gs = gs[:1] if isolated else gs
            node = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
            span = max(len({node[hosts[r]] for r in g}) for g in gs)
            layouts[(c.axis, pairs, embedding)] = groups.Layout(axis=c.axis, groups=tuple(tuple(g) for g in gs),
                                                                 num_nodes=span)
        layout = layouts[(c.axis, pairs, embedding)]
        coll = COLLECTIVES[c.collective]
        itemsize = DTYPES[dtype].itemsize
        send, recv = coll.counts(c.nbytes, layout.group_size, itemsize)
        nbytes = coll.size_bytes(send, recv, itemsize, layout.group_size)
        out.append((layout, (coll, dtype, "sum" if coll.has_redop else None, False, nbytes, send, recv)))
    return out + _burst_cases(workload, par, hosts, isolated)


def _burst_cases(workload, par, hosts, isolated):
    """ZeRO-1's parameter broadcasts of each stage as one burst (issued together,
    waited for together: collectives.broadcast_burst), on that stage's dp
    groups (every one at once, or the first with isolated); ranks of other
    stages idle."""
    from commbench.collectives.broadcast_burst import zero1_bursts
    node = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    dtype = PLAN_DTYPES[par.dtype]
    out = []
    for stage, coll in sorted(zero1_bursts(workload.comm_ops).items()):
        gs = [g for g in par.groups["dp"] if par.coords(g[0])[0] == stage]
        gs = gs[:1] if isolated else gs
        layout = groups.Layout(axis="dp", groups=tuple(tuple(g) for g in gs),
                               num_nodes=max(len({node[hosts[r]] for r in g}) for g in gs))
        itemsize = DTYPES[dtype].itemsize
        send, recv = coll.counts(0, layout.group_size, itemsize)
        out.append((layout, (coll, dtype, None, False, recv * itemsize, send, recv)))
    return out


def case_of(backend, config, layout, coll, dtype, redop, in_place, nbytes, send, recv) -> Case:
    """The Case (the key of a measurement) of one entry of the sweep on this backend."""
    case_in_place = coll.has_in_place and (in_place or coll.single_buffer or coll.name in backend.in_place_only)
    params = {"count": recv, "world_size": backend.world_size}
    if coll.has_redop:
        params["redop"] = redop
    if coll.has_root:
        params["root"] = config.root
    if hasattr(coll, "case_params"):
        params.update(coll.case_params())
    return Case(kind="collective", op=coll.name, backend=backend.name, device=config.device, dtype=dtype,
                nbytes=nbytes, group_size=layout.group_size, num_nodes=layout.num_nodes, axis=layout.axis,
                in_place=case_in_place, concurrent_groups=len(layout.groups), params=params)


def describe(case: Case, layout) -> str:
    """'all_reduce of 1048576 B (float32, sum) on group world [0-3]' for the timeout line."""
    redop = case.params.get("redop")
    gs = layout.groups
    where = (f"group {layout.axis} [{', '.join(map(str, gs[0]))}]" if len(gs) == 1 else
             f"groups {layout.axis} ({len(gs)} groups: {' '.join('[' + ','.join(map(str, g)) + ']' for g in gs)})")
    return f"{case.op} of {case.nbytes} B ({case.dtype}{', ' + redop if redop else ''}) on {where}"


def measure_case(backend, config, layout, g, hosts, coll, dtype, redop, in_place, nbytes, send, recv, arm=None):
    """One case on this rank; g is None where this rank is in no group (it idles,
    but still takes part in the harness's exchanges). arm(calls, budget_s), if
    given, re-arms the watchdog before each phase with the calls that follow."""
    arm = arm or (lambda calls, budget_s=0.0: None)
    case = case_of(backend, config, layout, coll, dtype, redop, in_place, nbytes, send, recv)
    case_in_place, n = case.in_place, layout.group_size
    reason = skip_reason(backend, coll, dtype, redop, case_in_place, n, config.root)
    if reason:
        return Measurement(case=case, status="skipped", skip_reason=reason)
    arm(config.check_iters + 1)
    if g is None:
        prepared = Prepared(op=lambda: None)
    else:
        prepared = coll.prepare(backend, g, dtype, send, recv, redop, case_in_place, root=config.root)
    wrong, bad = 0, corrupt_rank()
    for _ in range(config.check_iters):
        prepared.reset(backend, corrupt=bad == backend.rank)
        backend.synchronize()
        prepared.op()
        backend.synchronize()
        wrong += num_wrong(backend, prepared, dtype, n, redop)
    per_rank_wrong = backend.control_reduce(one_hot(backend, wrong), "sum")
    settings = config.timing_of(coll.name)
    timed = timing.measure(backend, prepared.op, settings, on_phase=arm)
    arm(1)
    own_p50 = float(np.median(timed.own_samples_s))
    rank_p50 = backend.control_reduce(one_hot(backend, own_p50), "sum").tolist()
    rank_samples = backend.control_allgather(timed.own_samples_s) if config.keep_rank_samples else None
    summary = stats.summarize(timed.samples_s)
    algbw = coll.algbw_gbps(nbytes, summary["time_p50_s"])
    slowest = int(np.argmax(rank_p50))
    return Measurement(
        case=case, samples_s=timed.samples_s, warmup=settings.warmup,
        target_ci=settings.target_ci, stats=summary, algbw_gbps=algbw,
        busbw_gbps=None if algbw is None else algbw * coll.busbw_factor(n),
        num_wrong=int(per_rank_wrong.sum()), wrong_ranks=[int(r) for r in np.nonzero(per_rank_wrong)[0]],
        rank_time_p50_s=rank_p50, rank_samples_s=rank_samples, slowest_rank=slowest,
        slowest_host=hosts[slowest], warnings=stats.warnings_for(summary, len(timed.samples_s),
                                                                   settings.target_ci, settings.ci_of))


def check_memory(config, hosts, ranks_on_host):
    """ValueError with the numbers if the largest case of the sweep would not fit."""
    todo = [c for spec in config.layout_list for layout in [groups.build(spec, hosts)]
            for c in cases(config, layout, layout.group_size)]
    short = memcheck.check([(c[0].name, c[1], c[5], c[6]) for c in todo], config.device, config.check_iters > 0,
                           ranks_on_host)
    if short:
        raise ValueError(short)


def one_hot(backend, value) -> np.ndarray:
    """A world-sized vector holding value at this rank: summed over ranks, it is
    every rank's value (an all-gather over the control channel's reduction)."""
    v = np.zeros(backend.world_size)
    v[backend.rank] = value
    return v


def run(config, launch, argv, out_path, overwrite=False, reporter=None, plan=None, isolated=False, backend=None,
        resume=False):
    """Run the sweep (or, with plan = (model, Parallelism), the plan's collectives)
    on this rank. Returns (the ResultFile on rank 0, else None; the number of wrong
    elements over all cases and ranks, on every rank). A backend passed in (shared
    with other work of the same job) is used and left open. resume: out_path is
    a results file of the same settings to continue (its Cases are not run again).

    Reliability (commbench/watchdog.py): every phase of every case has a deadline;
    a hung or vanished peer ends every rank with EXIT_TIMEOUT and one line; SIGINT
    and SIGTERM raise watchdog.Interrupted (the file keeps every finished line)."""
    own = backend is None
    if own:
        backend = watchdog.open_backend(config.backend, launch, config.device, config.rendezvous_timeout_s,
                                        **({"dist_backend": config.dist_backend} if config.backend == "torch" else {}))
    progress = None
    try:
        ranks = backend.control_allgather(env.rank_info(launch, config.device))
        hosts = [r["host"] for r in ranks]
        run_id, created = backend.control_bcast(
            (uuid.uuid4().hex[:12], datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")))
        progress = watchdog.Progress(run_id, backend.rank, backend.world_size, hosts, hosts[backend.rank])
        with watchdog.InterruptHandlers(progress):
            return _run_cases(config, launch, argv, out_path, overwrite, reporter, plan, isolated, backend, resume,
                              ranks, hosts, run_id, created, progress)
    finally:
        if progress is not None:
            progress.remove()
        if own:
            backend.close()


def _run_cases(config, launch, argv, out_path, overwrite, reporter, plan, isolated, backend, resume, ranks, hosts,
               run_id, created, progress):
    settings = config.settings()
    workload = None
    if plan is not None:
        from commbench import plan as plan_mod
        workload = plan_mod.build(*plan)
        settings = dict(settings, plan=workload.to_dict(), isolated=isolated)
    rankcheck.check_same(backend, {"settings": settings, "resume": bool(resume)})
    header = env.header(launch, ranks, argv, run_id, created, settings)
    if workload is not None:
        todo = plan_cases(workload, plan[1], hosts, isolated)
    else:
        layouts = [groups.build(spec, hosts) for spec in config.layout_list]
        rooted = [c.name for c in config.collective_list if c.has_root]
        largest = max(layout.group_size for layout in layouts)
        if rooted and config.root >= largest:
            raise rankcheck.RankMismatch(f"-r/--root {config.root} is outside every group (the largest has "
                                         f"{largest} ranks): {', '.join(rooted)} would all be skipped",
                                         quiet=backend.rank != 0)
        todo = [(layout, c) for layout in layouts for c in cases(config, layout, layout.group_size)]
    # the largest case must fit on every rank before anything is allocated
    short = memcheck.check([(c[0].name, c[1], c[5], c[6]) for _, c in todo], config.device,
                           config.check_iters > 0, launch.local_world_size)
    shorts = [(r, e) for r, e in enumerate(backend.control_allgather(short)) if e]
    if shorts:
        raise rankcheck.RankMismatch(f"rank {shorts[0][0]}: {shorts[0][1]}", quiet=backend.rank != 0)
    writer, err, previous = None, None, None
    if backend.rank == 0:
        try:
            if resume:
                previous = resume_mod.load_for_resume(out_path, settings)
            writer = ResultWriter(out_path, header, overwrite, append=bool(resume))
        except FileExistsError:
            err = f"{out_path} exists: commbench never overwrites results (use --force, --resume or another --out)"
        except ValueError as e:
            err = str(e)
        except OSError as e:
            err = f"cannot write {out_path}: {e.strerror}"
    err, done = backend.control_bcast((err, resume_mod.done_keys(previous) if previous else set()))
    if err:
        raise rankcheck.RankMismatch(err, quiet=backend.rank != 0)
    if previous is not None:
        header = previous.header
    result = ResultFile(header=header, measurements=list(previous.measurements) if previous else [], path=out_path)
    total_wrong = 0
    # the index of a case in the whole sweep is its position for the watchdog (the same on every rank)
    todo = [(i, layout, c, case_of(backend, config, layout, *c)) for i, (layout, c) in enumerate(todo)]
    # one measurement per Case: --in-place both asks twice for what runs in place only
    # (torch's all_reduce) or has no in-place form (send_recv)
    first = {}
    todo = [t for t in todo if first.setdefault(t[3].key(), t) is t and t[3].key() not in done]
    if reporter and backend.rank == 0:
        reporter.start(len(todo))
    stats.summarize([1e-6, 2e-6, 3e-6])      # its lazy scipy import takes seconds: not inside a deadline
    wd = watchdog.Watchdog(progress, out_path)
    try:
        made = {}
        for index, layout, c, case in todo:
            watchdog.hang_injection(backend.rank, index)
            what = describe(case, layout)
            phase = [0]

            def arm(calls, budget_s=0.0, index=index, what=what, nbytes=case.nbytes, phase=phase):
                phase[0] += 1
                wd.arm(index, phase[0], what, watchdog.phase_deadline_s(nbytes, calls, config.timeout_s, budget_s))
            try:
                arm(1)
                if layout.groups not in made:
                    made[layout.groups] = backend.new_groups(layout.groups)
                m = measure_case(backend, config, layout, made[layout.groups], hosts, *c, arm=arm)
            except (RuntimeError, OSError) as e:     # a collective failed: a peer gone, or our own error
                wd.peer_failed(what, e)
                raise
            total_wrong += m.num_wrong
            if backend.rank == 0:
                writer.append(m)
                result.measurements.append(m)
                if reporter:
                    reporter.add(m)
        wd.disarm()
    except watchdog.Interrupted as e:
        if backend.rank == 0:
            e.message = (f"commbench: interrupted by {signal.Signals(e.signum).name}: "
                         f"{len(result.measurements)} finished measurements are in {out_path}; continue with "
                         f"`commbench run --resume {out_path}` and the same flags")
        raise
    finally:
        wd.close()
        if writer:
            writer.close()
    if reporter and backend.rank == 0:
        reporter.finish()
    return (result if backend.rank == 0 else None), total_wrong
