"""Measurements of the same cases taken in several rounds of one job (`validate
--rounds`), pooled into one ResultFile: each case's samples (and each rank's
own samples) concatenated in round order, its statistics derived again from
them. Every round weighs the same: a round contributes as many samples as the
round with the fewest has, taken evenly over its run. (Rounds time each case
for the same budget, so a round in a slower phase of the machine fits fewer
calls; the training steps, which the pooled prediction is compared with,
count every round alike.) A case measured ok in some rounds and skipped in
others keeps its ok rounds; a case skipped in every round stays skipped as the
first round said."""
import dataclasses

import numpy as np

from commbench import stats
from commbench.results import ResultFile


def pool(result_files: list) -> ResultFile:
    """One ResultFile of every case of the files (in order of first appearance),
    with the header of the first and "pooled_from": the files' paths."""
    if not result_files:
        raise ValueError("no results files to pool")
    if len(result_files) == 1:
        return result_files[0]
    by_key = {}
    for rf in result_files:
        for m in rf.measurements:
            by_key.setdefault(m.case.key(), []).append(m)
    header = dict(result_files[0].header, pooled_from=[rf.path for rf in result_files])
    return ResultFile(header=header, measurements=[_pooled(ms) for ms in by_key.values()], path=None)


def _pooled(ms: list):
    ok = [m for m in ms if m.status == "ok" and m.samples_s]
    if not ok:
        return ms[0]
    if len(ok) == 1:
        return ok[0]
    n = min(len(m.samples_s) for m in ok)
    samples = [x for m in ok for x in _evenly(m.samples_s, n)]
    summary = stats.summarize(samples)
    first = ok[0]
    ranks = None
    if all(m.rank_samples_s for m in ok) and len({len(m.rank_samples_s) for m in ok}) == 1:
        fewest = [min(len(m.rank_samples_s[r]) for m in ok) for r in range(len(first.rank_samples_s))]
        ranks = [[x for m in ok for x in _evenly(m.rank_samples_s[r], k)] for r, k in enumerate(fewest)]
    rank_p50 = [float(np.median(r)) for r in ranks] if ranks else first.rank_time_p50_s
    scale = first.stats["time_p50_s"] / summary["time_p50_s"] if summary["time_p50_s"] > 0 else None
    wrong = sum(m.num_wrong for m in ok)
    slowest = int(np.argmax(rank_p50)) if rank_p50 else first.slowest_rank
    host = next((m.slowest_host for m in ok if m.slowest_rank == slowest), first.slowest_host)
    return dataclasses.replace(
        first, samples_s=samples, stats=summary, rank_samples_s=ranks, rank_time_p50_s=rank_p50,
        algbw_gbps=None if first.algbw_gbps is None or scale is None else first.algbw_gbps * scale,
        busbw_gbps=None if first.busbw_gbps is None or scale is None else first.busbw_gbps * scale,
        num_wrong=wrong, wrong_ranks=sorted({r for m in ok for r in m.wrong_ranks}),
        slowest_rank=slowest, slowest_host=host,
        warnings=list(dict.fromkeys(w for m in ok for w in m.warnings)))


def _evenly(xs: list, n: int) -> list:
    """n of xs (n <= len(xs)) at evenly spaced positions, the first and the last included."""
    if n >= len(xs):
        return list(xs)
    return [xs[i] for i in np.linspace(0, len(xs) - 1, n).round().astype(int)]
