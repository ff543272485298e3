"""One measurement of an op timed in several windows of a job, as validate
times a step's ops once next to each half of a round's training: the
samples joined in the order they were taken (raw, nothing dropped), every
statistic recomputed from them, the notes of the windows kept."""
import dataclasses

import numpy as np

from commbench import stats
from commbench.results import Measurement, ResultFile


def join(parts: list, ci_of: str) -> Measurement:
    """The windows' measurements of one case (in the order taken) as one.
    A window that could not time it (skipped) leaves the others' samples and
    a note; all skipped: the first window's skip."""
    ok = [p for p in parts if p.status == "ok"]
    if not ok:
        return parts[0]
    notes = []
    for p in ok:
        own = stats.warnings_for(p.stats, p.iters, p.target_ci, ci_of)
        notes += [w for w in p.warnings if w not in own and w not in notes]
    notes += [f"window {k + 1} of {len(parts)} timed nothing: {p.skip_reason}"
              for k, p in enumerate(parts) if p.status != "ok"]
    samples = [t for p in ok for t in p.samples_s]
    summary = stats.summarize(samples)
    ranks = None
    if all(p.rank_samples_s for p in ok) and len({len(p.rank_samples_s) for p in ok}) == 1:
        ranks = [[t for p in ok for t in p.rank_samples_s[r]] for r in range(len(ok[0].rank_samples_s))]
    slowest, host = ok[0].slowest_rank, ok[0].slowest_host
    if ranks:
        slowest = int(np.argmax([np.mean(s) if s else -1.0 for s in ranks]))
        host = next((p.slowest_host for p in ok if p.slowest_rank == slowest), None)
    first = ok[0]
    m = dataclasses.replace(
        first, samples_s=samples, stats=summary, num_wrong=sum(p.num_wrong for p in ok),
        rank_samples_s=ranks, rank_time_p50_s=[float(np.median(s)) if s else 0.0 for s in ranks] if ranks else [],
        slowest_rank=slowest, slowest_host=host,
        warnings=stats.warnings_for(summary, len(samples), first.target_ci, ci_of) + notes)
    if first.algbw_gbps is not None:
        from commbench.compute.runner import op_time_s
        t = op_time_s(m)
        m.algbw_gbps = m.case.nbytes / t / 1e9 if t > 0 else None
    return m


def join_files(base: ResultFile, windows: list, path: str, ci_of: str) -> ResultFile:
    """base's measurements, then each case the windows timed joined across
    them (base's header, with the number of windows in its settings)."""
    by_case = {}
    for rf in windows:
        for m in rf.measurements:
            by_case.setdefault(m.case.key(), []).append(m)
    header = dict(base.header, settings=dict(base.header["settings"], step_op_windows=len(windows)))
    joined = [join(parts, ci_of) for parts in by_case.values()]
    return ResultFile(header=header, measurements=list(base.measurements) + joined, path=path)
