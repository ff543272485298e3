"""Case-by-case comparison of two results files, shared by `compare` and `check`:
the join key, a two-sided Mann-Whitney U test on the raw samples with a Holm
correction across the joined cases, the practical threshold, and the verdict.

Join key (what must match for two measurements to be "the same Case" on two
systems): kind, op, dtype, nbytes (S), group_size, num_nodes, axis, in_place,
concurrent_groups and the parameters that change the operation (redop, root).
Not part of it: backend and device (a baseline imported from nccl-tests must
join a commbench torch-nccl run; a backend difference is reported as an
environment difference instead) and parameters that follow from the others
(count, world_size). Where one file holds the same loose key twice (e.g. a sweep
over two backends), backend and device join too, for every file of the pair.

Verdict (DESIGN.md convention 4: a significance test AND a threshold), with
ratio = p50(B) / p50(A) of the raw per-iteration samples:
  slower  Holm-adjusted p < alpha and ratio > factor
  faster  Holm-adjusted p < alpha and ratio < 1/factor
  same    otherwise
  untested  a side has fewer than 2 raw samples (e.g. an nccl-tests text log,
            which reports one averaged time): no test is possible.
Holm (step-down Bonferroni) controls the family-wise error rate over all
joined cases of the pair: with a sweep of 100 cases, an uncorrected 5 % test
would flag about 5 same-speed cases as different, and a regression gate that
fails CI on noise is worse than none. Holm is uniformly more powerful than
plain Bonferroni and needs no independence between cases."""
import math
from dataclasses import dataclass, field

import numpy as np

ALPHA = 0.05
MIN_SAMPLES = 2
JOIN_PARAMS = ("redop", "root", "broadcasts")    # broadcasts: a broadcast_burst's number of pieces
ROOTED = ("broadcast", "reduce")


def join_key(case, with_backend: bool = False) -> tuple:
    params = tuple((k, case.params[k]) for k in JOIN_PARAMS
                   if case.params.get(k) is not None and (k != "root" or case.op in ROOTED))
    key = (case.kind, case.op, case.dtype, case.nbytes, case.group_size, case.num_nodes, case.axis,
           bool(case.in_place), case.concurrent_groups, params)
    return key + ((case.backend, case.device) if with_backend else ())


def _usable(rf) -> list:
    return [m for m in rf.measurements if m.status == "ok" and m.samples_s]


def _has_duplicates(rf) -> bool:
    keys = [join_key(m.case) for m in _usable(rf)]
    return len(keys) != len(set(keys))


def index(rf, with_backend: bool, notes: list) -> dict:
    """{join key: Measurement}; a key measured twice keeps the first, with a note."""
    out = {}
    for m in _usable(rf):
        k = join_key(m.case, with_backend)
        if k in out:
            notes.append(f"{rf.path}: {describe(m.case)} appears twice; the first is used")
            continue
        out[k] = m
    return out


def describe(case) -> str:
    redop = case.params.get("redop")
    return (f"{case.op} {case.dtype} {case.nbytes} B n={case.group_size} nodes={case.num_nodes} {case.axis}"
            f"{' in-place' if case.in_place else ''}{' ' + redop if redop else ''}")


def p50(m) -> float:
    """The median of the raw samples (the stored statistics are derived from them)."""
    if m.samples_s:
        return float(np.median(m.samples_s))
    v = (m.stats or {}).get("time_p50_s")
    return float(v) if v is not None else float("nan")


def holm(pvalues: list) -> list:
    """Holm-Bonferroni adjusted p-values, in the input order (scipy has no Holm)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@dataclass
class CaseDiff:
    key: tuple
    a: object                  # Measurement in A
    b: object                  # Measurement in B
    p50_a_s: float
    p50_b_s: float
    ratio: float               # p50(B) / p50(A): > 1 means B is slower
    p_value: float | None      # two-sided Mann-Whitney U, None when untested
    p_adjusted: float | None   # Holm over the pair's tested cases
    verdict: str = "same"

    @property
    def case(self):
        return self.a.case

    def to_dict(self) -> dict:
        c = self.case
        return {"op": c.op, "dtype": c.dtype, "nbytes": c.nbytes, "group_size": c.group_size,
                "num_nodes": c.num_nodes, "axis": c.axis, "in_place": c.in_place,
                "redop": c.params.get("redop"), "backend_a": c.backend, "backend_b": self.b.case.backend,
                "p50_a_s": self.p50_a_s, "p50_b_s": self.p50_b_s,
                "busbw_a_gbps": self.a.busbw_gbps, "busbw_b_gbps": self.b.busbw_gbps,
                "iters_a": self.a.iters, "iters_b": self.b.iters, "ratio": self.ratio,
                "p_value": self.p_value, "p_adjusted": self.p_adjusted, "verdict": self.verdict}


@dataclass
class PairDiff:
    rows: list                         # CaseDiff, in A's order
    only_a: list = field(default_factory=list)   # Measurements without a partner
    only_b: list = field(default_factory=list)
    with_backend: bool = False
    notes: list = field(default_factory=list)


def compare_pair(rf_a, rf_b, factor: float = 1.05, alpha: float = ALPHA) -> PairDiff:
    from scipy import stats as sps
    if not (factor >= 1.0 and math.isfinite(factor)):
        raise ValueError(f"--factor must be a finite ratio of p50 times >= 1, got {factor}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    with_backend = _has_duplicates(rf_a) or _has_duplicates(rf_b)
    notes = []
    ia, ib = index(rf_a, with_backend, notes), index(rf_b, with_backend, notes)
    rows = []
    for k, ma in ia.items():
        mb = ib.get(k)
        if mb is None:
            continue
        pa, pb = p50(ma), p50(mb)
        ratio = pb / pa if pa > 0 else math.inf
        pv = None
        if len(ma.samples_s) >= MIN_SAMPLES and len(mb.samples_s) >= MIN_SAMPLES:
            pv = float(sps.mannwhitneyu(ma.samples_s, mb.samples_s, alternative="two-sided").pvalue)
            pv = 1.0 if math.isnan(pv) else pv     # all samples tied: no evidence of a difference
        rows.append(CaseDiff(k, ma, mb, pa, pb, ratio, pv, None))
    tested = [r for r in rows if r.p_value is not None]
    for r, adj in zip(tested, holm([r.p_value for r in tested])):
        r.p_adjusted = adj
    for r in rows:
        if r.p_adjusted is None:
            r.verdict = "untested"
        elif r.p_adjusted < alpha and r.ratio > factor:
            r.verdict = "slower"
        elif r.p_adjusted < alpha and r.ratio < 1.0 / factor:
            r.verdict = "faster"
        else:
            r.verdict = "same"
    untested = len(rows) - len(tested)
    if untested:
        notes.append(f"{untested} case(s) untested: a side has fewer than {MIN_SAMPLES} raw samples "
                     "(nccl-tests text logs report one averaged time)")
    return PairDiff(rows=rows, only_a=[m for k, m in ia.items() if k not in ib],
                    only_b=[m for k, m in ib.items() if k not in ia], with_backend=with_backend, notes=notes)


def geomean_by_op(rows: list) -> dict:
    """{op: (geometric mean of the ratios, number of cases)}."""
    from scipy.stats import gmean
    by = {}
    for r in rows:
        if math.isfinite(r.ratio) and r.ratio > 0:
            by.setdefault(r.case.op, []).append(r.ratio)
    return {op: (float(gmean(v)), len(v)) for op, v in by.items()}
