"""CommModel: the time of one collective of a given size and group shape, from
measurements (results files) or from a SystemSpec; what the predictor asks for
every CommOp.

From measurements (DESIGN.md "Prediction"), in this order:
1. measured: a measurement of the same collective, group size and node span at
   exactly this size (the requested dtype's, else another dtype's at the same
   size, said in the note);
2. interpolated: a size between two measured sizes of that shape: straight line
   between the two neighbours in log(time) against log(size);
3. extrapolated: anything else, from the alpha-beta law of alphabeta.py fitted to
   measured points: the shape's own points when the size is only outside their
   range, else every point of the collective in that tier (intra: one node,
   inter: more than one), else all_reduce's fit of the tier with this
   collective's steps and busbw factor, else a fit to every collective of the
   tier. A tier without a usable point is a ValueError naming what to measure.

Uncertainty band (low_s, high_s): the stored 95 % CI of the median (stats
ci_low_s / ci_high_s; computed from the raw samples where a measurement lacks
them); interpolated in log-log like the time; for a fit, the median relative
CI half-widths of the fitted points widened by the fit's RMS relative residual.
Measurements of one shape and size taken several times (other axes, in place or
not, other reduction ops) are combined: the median of their p50s, the widest band.
"""
import math
import statistics
from dataclasses import dataclass

from commbench import alphabeta
from commbench.dtypes import ALIASES, DTYPES
from commbench.results import ResultFile

SOURCES = ("measured", "interpolated", "extrapolated", "spec")


@dataclass(frozen=True)
class Estimate:
    time_s: float
    low_s: float
    high_s: float
    source: str          # measured | interpolated | extrapolated | spec
    note: str = ""


@dataclass(frozen=True)
class _Point:
    collective: str
    nbytes: int
    group_size: int
    num_nodes: int
    dtype: str
    concurrent_groups: int
    time_s: float        # p50
    low_s: float         # CI of the median
    high_s: float


def _canonical_dtype(name: str) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose from {', '.join(DTYPES)}")
    return key


def _point(m, statistic: str = "median") -> _Point | None:
    """A measurement's p50 and CI of the median (or, statistic 'mean', its mean and
    the mean's CI: stats.central); None when it has neither stats nor samples, or
    no bytes."""
    if m.case.nbytes <= 0:        # no size to interpolate or fit on
        return None
    st = m.stats or {}
    if ("time_p50_s" not in st or "time_mean_s" not in st) and m.samples_s:
        from commbench.stats import summarize
        st = summarize(m.samples_s)
    if statistic != "median" and st.get("time_mean_s") is not None:
        from commbench.stats import central
        t, lo, hi = central(st, m.iters, statistic)
        if not math.isfinite(t) or t <= 0:
            return None
        c = m.case
        return _Point(c.op, c.nbytes, c.group_size, c.num_nodes, c.dtype, c.concurrent_groups, t, lo, hi)
    p50 = st.get("time_p50_s")
    if p50 is None or not math.isfinite(p50) or p50 <= 0:
        return None
    lo, hi = st.get("ci_low_s"), st.get("ci_high_s")
    if (lo is None or hi is None) and m.samples_s:
        from commbench.stats import median_ci
        lo, hi = median_ci(m.samples_s)
    lo = p50 if lo is None or not math.isfinite(lo) else min(lo, p50)
    hi = p50 if hi is None or not math.isfinite(hi) else max(hi, p50)
    c = m.case
    return _Point(c.op, c.nbytes, c.group_size, c.num_nodes, c.dtype, c.concurrent_groups, p50, lo, hi)


def _choose(values: set, asked, what: str) -> str:
    if asked is not None:
        if asked not in values:
            raise ValueError(f"no usable collective measurements with {what} {asked!r}: "
                             f"the results hold {', '.join(sorted(values))}")
        return asked
    if len(values) > 1:
        raise ValueError(f"the results mix {what}s {', '.join(sorted(values))}: predictions use one "
                         f"{what}'s measurements; choose one ({what}=...)")
    return next(iter(values))


def _loglog(x, x0, x1, y0, y1) -> float:
    """y at x on the straight line through (x0, y0) and (x1, y1) in log-log axes:
    log y = log y0 + (log x - log x0) / (log x1 - log x0) * (log y1 - log y0)."""
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


class CommModel:
    """Build with from_results or from_system; ask with estimate."""

    def __init__(self, points=(), spec=None, backend: str = "", device: str = "", bursts=None):
        self._spec = spec
        self.backend, self.device = backend, device
        self._by_key = {}
        for p in points:
            self._by_key.setdefault((p.collective, p.group_size, p.num_nodes), []).append(p)
        # (group size, nodes, dtype, total bytes, broadcasts) -> _Point of a measured broadcast burst
        self._bursts = dict(bursts or {})
        self._fits = {}

    # ------------------------------------------------------------ construction
    @classmethod
    def from_results(cls, result_files, backend: str | None = None, device: str | None = None,
                     dtype: str | None = None, statistic: str = "median") -> "CommModel":
        """From the status-ok collective measurements (with no wrong results) of one
        or more ResultFiles. backend and device must be one each: given, or the only
        one in the files. dtype, when given, keeps that dtype's measurements only.
        statistic: each measurement's median (default) or mean (stats.central)."""
        result_files = [result_files] if isinstance(result_files, ResultFile) else list(result_files)
        ms = [m for rf in result_files for m in rf.measurements
              if m.status == "ok" and m.case.kind == "collective" and m.case.op in alphabeta.MODELLED
              and not m.num_wrong]
        names = ", ".join(str(rf.path or "<in memory>") for rf in result_files) or "no results files"
        if not ms:
            raise ValueError(f"no usable collective measurements (status ok, no wrong results) in {names}: "
                             "measure with `commbench run` first")
        backend = _choose({m.case.backend for m in ms}, backend, "backend")
        ms = [m for m in ms if m.case.backend == backend]
        device = _choose({m.case.device for m in ms}, device, "device")
        ms = [m for m in ms if m.case.device == device]
        if dtype is not None:
            want = _canonical_dtype(dtype)
            have = {m.case.dtype for m in ms}
            ms = [m for m in ms if m.case.dtype == want]
            if not ms:
                raise ValueError(f"no {want} measurements of {backend} on {device}: the results hold "
                                 f"{', '.join(sorted(have))}")
        points = [p for p in (_point(m, statistic) for m in ms) if p is not None]
        if not points:
            raise ValueError(f"the collective measurements in {names} have no times (no stats, no samples)")
        bursts = {}
        for m in sorted((m for rf in result_files for m in rf.measurements
                         if m.status == "ok" and m.case.op == "broadcast_burst" and not m.num_wrong
                         and m.case.backend == backend and m.case.device == device),
                        key=lambda m: m.case.concurrent_groups):      # the most concurrent one wins
            p, c = _point(m, statistic), m.case
            if p is not None:
                bursts[(c.group_size, c.num_nodes, c.dtype, c.nbytes, c.params.get("broadcasts"))] = p
        return cls(points, backend=backend, device=device, bursts=bursts)

    @classmethod
    def from_system(cls, spec) -> "CommModel":
        """What-if: every estimate is spec.collective_time_s, source 'spec'."""
        return cls(spec=spec, backend="spec", device=spec.name)

    # ------------------------------------------------------------ the question
    def burst(self, nbytes: int, broadcasts: int, group_size: int, num_nodes: int, dtype: str) -> Estimate | None:
        """A burst of broadcasts (collectives.broadcast_burst) of nbytes in all,
        measured as one, or None where no measurement has that shape."""
        p = self._bursts.get((group_size, num_nodes, _canonical_dtype(dtype), nbytes, broadcasts))
        if p is None:
            return None
        return Estimate(p.time_s, p.low_s, p.high_s, "measured",
                        f"broadcast_burst of {broadcasts} n={group_size} nodes={num_nodes} {nbytes} B")

    def estimate(self, collective: str, nbytes: int, group_size: int, num_nodes: int,
                 dtype: str = "bf16", concurrent: bool = True) -> Estimate:
        """Time of one collective: S = nbytes (DESIGN.md busbw table; send_recv: the
        message, group of 2), group_size ranks spread over num_nodes nodes.
        concurrent: the op runs while every other group of its axis runs the same op
        (training); measurements with concurrent groups are preferred then, isolated
        ones otherwise."""
        coll = alphabeta.collective_name(collective)
        alphabeta.check_shape(group_size, num_nodes, nbytes)
        if group_size < 2:
            raise ValueError(f"a group of {group_size} rank does no {coll}: leave the op out")
        if self._spec is not None:
            t = self._spec.collective_time_s(coll, nbytes, group_size, num_nodes)
            return Estimate(t, t, t, "spec", f"SystemSpec {self._spec.name}: ring alpha-beta model, "
                                             f"{alphabeta.tier(num_nodes)}-node bandwidth; no measured spread")
        want = _canonical_dtype(dtype)
        shape = f"{coll} n={group_size} nodes={num_nodes}"
        key_points = self._by_key.get((coll, group_size, num_nodes), [])
        for series, dnote in self._series_options(key_points, want, concurrent):
            sizes = [s[0] for s in series]
            if nbytes in sizes:
                _, t, lo, hi, desc = series[sizes.index(nbytes)]
                return Estimate(t, lo, hi, "measured", f"{shape} {nbytes} B {desc}{dnote}")
            if sizes[0] < nbytes < sizes[-1]:
                i = next(i for i, s in enumerate(sizes) if s > nbytes)
                (s0, t0, l0, h0, _), (s1, t1, l1, h1, _) = series[i - 1], series[i]
                return Estimate(_loglog(nbytes, s0, s1, t0, t1), _loglog(nbytes, s0, s1, l0, l1),
                                _loglog(nbytes, s0, s1, h0, h1), "interpolated",
                                f"{shape}: log-log between {s0} B and {s1} B{dnote}")
        return self._extrapolate(coll, nbytes, group_size, num_nodes, want, concurrent, key_points)

    # ------------------------------------------------------------ internals
    def _series_options(self, points, want: str, concurrent: bool):
        """Series (sorted by size) of one shape to look the size up in: the requested
        dtype's, then another dtype's (same element size first, then most sizes)."""
        by_dtype = {}
        for p in points:
            by_dtype.setdefault(p.dtype, []).append(p)
        out = []
        if want in by_dtype:
            out.append((self._series(by_dtype.pop(want), concurrent), ""))
        if by_dtype:
            size = DTYPES[want].itemsize
            other = min(by_dtype, key=lambda d: (DTYPES[d].itemsize != size if d in DTYPES else True,
                                                 -len({p.nbytes for p in by_dtype[d]}), d))
            out.append((self._series(by_dtype[other], concurrent),
                        f"; no {want} measurement of this shape at this size, used {other}'s"))
        return out

    @staticmethod
    def _series(points, concurrent: bool):
        """[(nbytes, time, low, high, description)] sorted by size: per size, the
        measurements of the preferred concurrency (concurrent groups > 1 when
        concurrent, else isolated ones) where there are any, combined."""
        by_size = {}
        for p in points:
            by_size.setdefault(p.nbytes, []).append(p)
        out = []
        for nbytes in sorted(by_size):
            ps = by_size[nbytes]
            preferred = [p for p in ps if (p.concurrent_groups > 1) == concurrent]
            ps = preferred or ps
            groups = sorted({p.concurrent_groups for p in ps})
            desc = f"(concurrent groups {'/'.join(map(str, groups))}"
            desc += f", {len(ps)} measurements combined)" if len(ps) > 1 else ")"
            out.append((nbytes, statistics.median(p.time_s for p in ps), min(p.low_s for p in ps),
                        max(p.high_s for p in ps), desc))
        return out

    def _fit_points(self, keys, want: str, concurrent: bool):
        """alphabeta.fit rows and the relative band of the points of some shapes."""
        rows, rel_lo, rel_hi = [], [], []
        for coll, n, nodes in keys:
            options = self._series_options(self._by_key[(coll, n, nodes)], want, concurrent)
            for nbytes, t, lo, hi, _ in options[0][0]:
                rows.append((coll, nbytes, n, nodes, t))
                rel_lo.append((t - lo) / t)
                rel_hi.append((hi - t) / t)
        return rows, rel_lo, rel_hi

    def _fit(self, keys, want: str, concurrent: bool):
        cache = (tuple(sorted(keys)), want, concurrent)
        if cache not in self._fits:
            rows, rel_lo, rel_hi = self._fit_points(keys, want, concurrent)
            f = alphabeta.fit(rows) if rows else None
            self._fits[cache] = None if f is None else (f, statistics.median(rel_lo), statistics.median(rel_hi))
        return self._fits[cache]

    def _extrapolate(self, coll, nbytes, n, nodes, want, concurrent, key_points) -> Estimate:
        tier = alphabeta.tier(nodes)
        in_tier = [k for k in self._by_key if alphabeta.tier(k[2]) == tier]
        if not in_tier:
            where = "within one node" if tier == "intra" else "across two or more nodes"
            raise ValueError(f"no {tier}-node measurements of {self.backend} on {self.device}: cannot estimate "
                             f"{coll} of {n} ranks on {nodes} node(s); measure all_reduce (and {coll}) {where} "
                             "at several sizes (`commbench run --groups "
                             f"{'intra' if tier == 'intra' else 'inter'} -b 1K -e 256M`)")
        candidates = []
        if key_points:
            candidates.append(([(coll, n, nodes)], f"this shape's own points ({coll} n={n} nodes={nodes})"))
        own = [k for k in in_tier if k[0] == coll]
        if own:
            candidates.append((own, f"every {tier}-node {coll} point"))
        ar = [k for k in in_tier if k[0] == "all_reduce"]
        if ar and coll != "all_reduce":
            candidates.append((ar, f"{tier}-node all_reduce's points (no {coll} fit in this tier), "
                                   f"with {coll}'s steps and busbw factor"))
        candidates.append((in_tier, f"every {tier}-node point of {', '.join(sorted({k[0] for k in in_tier}))}"))
        for keys, what in candidates:
            got = self._fit(keys, want, concurrent)
            if got is None:
                continue
            f, rel_lo, rel_hi = got
            t = f.time_s(coll, nbytes, n, nodes)
            low = t * max(0.0, 1.0 - rel_lo - f.rel_rms)
            high = t * (1.0 + rel_hi + f.rel_rms)
            per = "per GPU" if tier == "intra" else "per GPU share (x ranks per node)"
            note = (f"{coll} n={n} nodes={nodes} {nbytes} B: alpha-beta fit to {what}: "
                    f"alpha {f.alpha_s * 1e6:.3g} us/step, bw {f.bw_Bps / 1e9:.4g} GB/s {per}, "
                    f"{f.num_points} points, RMS residual {f.rel_rms:.1%}")
            return Estimate(t, low, high, "extrapolated", note)
        raise ValueError(f"the {tier}-node measurements of {self.backend} on {self.device} cannot fix an "
                         f"alpha-beta fit for {coll} n={n} nodes={nodes} (they need two or more sizes with "
                         f"a bandwidth-bound one): measure {coll} or all_reduce {tier}-node at sizes from "
                         "a few KiB to a few hundred MiB")
