"""Pure functions a sweep is built from: message sizes and the size sweep,
dtype aliases, group layouts, and the statistics stored with every measurement
(percentiles, the order-statistic CI of the median, pyperf-style warnings)."""
import math

import numpy as np
import pytest
from scipy import stats as sps

from commbench import dtypes, groups, sizes, stats


# --------------------------------------------------------------------- sizes

@pytest.mark.parametrize("text, nbytes", [
    (8, 8),
    ("8", 8),
    ("0", 0),
    ("1K", 1024),
    ("32M", 32 << 20),
    ("1G", 1 << 30),
    ("1GiB", 1 << 30),
    ("4KB", 4096),
    ("4KiB", 4096),
    ("2T", 2 << 40),
    ("8B", 8),
    ("1k", 1024),
    ("32m", 32 << 20),
    ("1gib", 1 << 30),
    (" 16M ", 16 << 20),
])
def test_parse_size_accepts_nccl_tests_forms(text, nbytes):
    assert sizes.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["-1", "1.5M", "", "abc", "12Q", "M", "1 M B", "0x10", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError) as e:
        sizes.parse_size(text)
    assert repr(text) in str(e.value)          # the message names the bad value


def test_sweep_multiplicative_like_nccl_tests():
    s = sizes.sweep(8, 1 << 20, 2.0, None)
    assert len(s) == 18
    assert s[0] == 8 and s[-1] == 1048576
    assert s == [8 << i for i in range(18)]


def test_sweep_maxbytes_included_only_when_reached():
    assert sizes.sweep(8, 64, 2, None) == [8, 16, 32, 64]
    assert sizes.sweep(8, 100, 2, None) == [8, 16, 32, 64]      # 128 > 100: not included
    assert sizes.sweep(1024, 1024, 2, None) == [1024]
    assert sizes.sweep(8, 64, 1.5, None) == [8, 12, 18, 27, 40, 60]
    # a factor too small to grow a small integer size still advances
    assert sizes.sweep(1, 4, 1.1, None) == [1, 2, 3, 4]


def test_sweep_additive():
    assert sizes.sweep(0, 100, None, 25) == [0, 25, 50, 75, 100]
    assert sizes.sweep(1024, 4096, None, 1024) == [1024, 2048, 3072, 4096]
    assert sizes.sweep(10, 35, None, 10) == [10, 20, 30]        # 40 > 35


@pytest.mark.parametrize("args, words", [
    ((1 << 20, 1024, 2.0, None), ["1024", "1048576"]),           # inverted range
    ((8, 1024, 1.0, None), ["stepfactor", "1"]),
    ((8, 1024, 0.5, None), ["stepfactor", "0.5"]),
    ((0, 1024, 2.0, None), ["minbytes"]),                      # 0 * f never grows
    ((8, 1024, None, 0), ["stepbytes", "0"]),
    ((8, 1024, None, None), ["stepbytes"]),
    ((8, 1024, None, -8), ["stepbytes", "-8"]),
    ((-8, 1024, 2.0, None), ["non-negative"]),
])
def test_sweep_errors(args, words):
    with pytest.raises(ValueError) as e:
        sizes.sweep(*args)
    for w in words:
        assert w in str(e.value)


# -------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("text, names", [
    ("float", ["float32"]),
    ("half", ["float16"]),
    ("bf16", ["bfloat16"]),
    ("double", ["float64"]),
    ("int", ["int32"]),
    ("fp16,fp32,f64", ["float16", "float32", "float64"]),
    ("BF16", ["bfloat16"]),
    (" float32 , int8 ", ["float32", "int8"]),
    ("float,fp32,float32", ["float32"]),          # one name, no repeats
    ("uint64,float", ["uint64", "float32"]),      # order kept
])
def test_parse_dtypes_aliases(text, names):
    assert dtypes.parse_dtypes(text) == names


def test_parse_dtypes_all():
    got = dtypes.parse_dtypes("all")
    assert got == ["float32", "float16", "bfloat16", "float64", "int8", "uint8",
                   "int32", "uint32", "int64", "uint64"]
    assert dtypes.parse_dtypes(" ALL ") == got
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1,
                "int32": 4, "uint32": 4, "int64": 8, "uint64": 8}
    assert {name: dtypes.DTYPES[name].itemsize for name in got} == itemsize


@pytest.mark.parametrize("text", ["float33", "complex64", "", "float,nope"])
def test_parse_dtypes_rejects(text):
    with pytest.raises(ValueError, match="unknown dtype"):
        dtypes.parse_dtypes(text)


def test_parse_redops():
    assert dtypes.parse_redops("sum") == ["sum"]
    assert dtypes.parse_redops("MAX, min,max") == ["max", "min"]
    assert dtypes.parse_redops("all") == ["sum", "prod", "max", "min", "avg"]
    with pytest.raises(ValueError, match="'foo'"):
        dtypes.parse_redops("sum,foo")


# -------------------------------------------------------------------- groups

# 8 ranks on 2 hosts, 4 per host, ranks filled host by host
BLOCK = ["nodeA"] * 4 + ["nodeB"] * 4
# the same 8 ranks placed round-robin over the hosts
ROUND_ROBIN = ["nodeA", "nodeB"] * 4


@pytest.mark.parametrize("hosts, spec, axis, layout, num_nodes", [
    (BLOCK, "world", "world", ((0, 1, 2, 3, 4, 5, 6, 7),), 2),
    (BLOCK, "intra", "intra", ((0, 1, 2, 3), (4, 5, 6, 7)), 1),
    (BLOCK, "inter", "inter", ((0, 4), (1, 5), (2, 6), (3, 7)), 2),
    (BLOCK, "mod 2", "mod2", ((0, 2, 4, 6), (1, 3, 5, 7)), 2),
    (BLOCK, "div 2", "div2", ((0, 1), (2, 3), (4, 5), (6, 7)), 1),
    (BLOCK, "div 4", "div4", ((0, 1, 2, 3), (4, 5, 6, 7)), 1),
    (BLOCK, "mod 4", "mod4", ((0, 4), (1, 5), (2, 6), (3, 7)), 2),
    (BLOCK, "div 8", "div8", ((0, 1, 2, 3, 4, 5, 6, 7),), 2),
    (BLOCK, "mod 1", "mod1", ((0, 1, 2, 3, 4, 5, 6, 7),), 2),
    # intra/inter follow the hosts, not the rank numbers
    (ROUND_ROBIN, "intra", "intra", ((0, 2, 4, 6), (1, 3, 5, 7)), 1),
    (ROUND_ROBIN, "inter", "inter", ((0, 1), (2, 3), (4, 5), (6, 7)), 2),
    (ROUND_ROBIN, "div 2", "div2", ((0, 1), (2, 3), (4, 5), (6, 7)), 2),
    (ROUND_ROBIN, "mod 2", "mod2", ((0, 2, 4, 6), (1, 3, 5, 7)), 1),
])
def test_build_layouts(hosts, spec, axis, layout, num_nodes):
    lay = groups.build(spec, hosts)
    assert lay.axis == axis
    assert lay.groups == layout
    assert lay.num_nodes == num_nodes
    assert lay.group_size == len(layout[0])
    # every rank is in exactly one group, and group_of finds it
    assert sorted(r for g in lay.groups for r in g) == list(range(len(hosts)))
    for g in layout:
        for r in g:
            assert lay.group_of(r) == g
    assert lay.group_of(len(hosts)) is None


@pytest.mark.parametrize("hosts, spec", [
    (BLOCK, "mod 3"),                                  # 3, 3, 2
    (BLOCK, "div 3"),                                  # 3, 3, 2
    (["a"] * 5 + ["b"] * 3, "intra"),                  # 5 and 3 ranks per node
    (["a"] * 5 + ["b"] * 3, "inter"),                  # 2 and 1 members per local index
])
def test_build_unequal_groups_is_an_error(hosts, spec):
    with pytest.raises(ValueError) as e:
        groups.build(spec, hosts)
    msg = str(e.value)
    assert repr(spec) in msg and "unequal" in msg and "8 ranks" in msg


def test_parse_layouts():
    assert groups.parse_layouts("world,intra,MOD 2") == ["world", "intra", "mod 2"]
    assert groups.parse_layouts(" DIV   4 ,inter, div 4") == ["div 4", "inter"]
    for bad in ["MOD 0", "foo", "mod", "div -2", "mod 2.5", "world,,intra"]:
        with pytest.raises(ValueError, match="unknown group layout"):
            groups.parse_layouts(bad)


# --------------------------------------------------------------------- stats

def _reference_ci_indices(n, confidence=0.95):
    """Brute force: the narrowest symmetric pair of order statistics
    [x_(k), x_(n+1-k)] (1-based) whose coverage P(k <= B <= n-k), B ~ Bin(n, 1/2),
    is at least the confidence; returned 0-based."""
    best = 1
    for k in range(1, n // 2 + 1):
        cover = sps.binom.cdf(n - k, n, 0.5) - sps.binom.cdf(k - 1, n, 0.5)
        if cover >= confidence:
            best = k
    return best - 1, n - best


@pytest.mark.parametrize("n", [6, 7, 10, 11, 20, 50, 51, 100, 333, 1000])
def test_median_ci_picks_the_narrowest_valid_order_statistics(n):
    x = np.arange(n, dtype=float) * 1e-6
    rng = np.random.default_rng(n)
    lo, hi = stats.median_ci(rng.permutation(x))          # unsorted input
    rlo, rhi = _reference_ci_indices(n)
    assert (lo, hi) == (x[rlo], x[rhi])


def test_median_ci_small_and_empty():
    assert stats.median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    assert stats.median_ci([5.0]) == (5.0, 5.0)
    lo, hi = stats.median_ci([])
    assert math.isnan(lo) and math.isnan(hi)


@pytest.mark.parametrize("n", [10, 50])
def test_median_ci_coverage_on_skewed_timings(n):
    # timing distributions are skewed: exponential, true median ln 2
    rng = np.random.default_rng(12345 + n)
    trials = 2000
    data = rng.exponential(1.0, size=(trials, n))
    hits = 0
    for row in data:
        lo, hi = stats.median_ci(row)
        assert lo <= np.median(row) <= hi
        hits += lo <= math.log(2) <= hi
    coverage = hits / trials
    assert coverage >= 0.93
    # and it is not a trivially wide interval (exact coverage is ~0.98 at n=10, ~0.97 at n=50)
    assert coverage <= 0.995


def test_precision():
    x = np.arange(1, 101, dtype=float)
    lo, hi = stats.median_ci(x)
    assert stats.precision(x) == pytest.approx((hi - lo) / 2 / np.median(x))
    assert stats.precision([0.0] * 10) == math.inf
    assert stats.precision([]) == math.inf


def test_precision_of_the_mean():
    # the 95 % normal-theory half-width of the mean, relative to the mean (stats.central's CI)
    x = [1.0, 2.0, 3.0, 4.0, 10.0]
    half = 1.96 * np.std(x, ddof=1) / math.sqrt(5)
    assert stats.precision(x, "mean") == pytest.approx(half / 4.0)
    assert stats.central({"time_mean_s": 4.0, "time_stdev_s": float(np.std(x, ddof=1))}, 5, "mean") == \
        pytest.approx((4.0, 4.0 - half, 4.0 + half))
    # a heavy tail: the median is pinned long before the mean is
    rng = np.random.default_rng(3)
    spiky = list(np.where(rng.random(2000) < 0.05, 4e-3, 2.5e-4) + rng.normal(0, 1e-5, 2000))
    assert stats.precision(spiky) < 0.01 < 0.05 < stats.precision(spiky, "mean")     # about 8 %
    assert stats.precision([1.0], "mean") == math.inf and stats.precision([0.0, 0.0], "mean") == math.inf


def test_summarize_matches_numpy():
    rng = np.random.default_rng(7)
    x = rng.lognormal(mean=-11, sigma=0.3, size=257)
    s = stats.summarize(list(x))
    assert s["time_min_s"] == x.min()
    assert s["time_max_s"] == x.max()
    assert s["time_p50_s"] == pytest.approx(np.percentile(x, 50), rel=1e-12)
    assert s["time_p95_s"] == pytest.approx(np.percentile(x, 95), rel=1e-12)
    assert s["time_p99_s"] == pytest.approx(np.percentile(x, 99), rel=1e-12)
    assert s["time_mean_s"] == pytest.approx(x.mean(), rel=1e-12)
    assert s["time_stdev_s"] == pytest.approx(x.std(ddof=1), rel=1e-12)
    assert s["cv"] == pytest.approx(x.std(ddof=1) / x.mean(), rel=1e-12)
    assert (s["ci_low_s"], s["ci_high_s"]) == stats.median_ci(x)
    assert s["ci_low_s"] <= s["time_p50_s"] <= s["ci_high_s"]
    assert s["precision"] == pytest.approx((s["ci_high_s"] - s["ci_low_s"]) / 2 / s["time_p50_s"])


def test_summarize_known_array():
    x = [float(v) for v in range(1, 101)]                 # 1..100
    s = stats.summarize(x)
    assert s["time_p50_s"] == 50.5
    assert s["time_p95_s"] == pytest.approx(95.05)
    assert s["time_p99_s"] == pytest.approx(99.01)
    assert s["time_mean_s"] == 50.5
    assert s["num_outliers"] == 0
    # one value far beyond 3 IQR is counted, the rest are not
    s = stats.summarize(x + [10_000.0])
    assert s["num_outliers"] == 1
    # a single sample: no spread, no crash
    s = stats.summarize([2e-6])
    assert s["time_stdev_s"] == 0.0 and s["cv"] == 0.0 and s["time_p50_s"] == 2e-6
    with pytest.raises(ValueError):
        stats.summarize([])


def test_warnings_for():
    steady = stats.summarize([1.0, 1.01, 0.99, 1.0, 1.02, 0.98] * 5)
    assert steady["cv"] < 0.10
    assert stats.warnings_for(steady, iters=30, target_ci=0) == []

    noisy = dict(steady, cv=0.15)
    w = stats.warnings_for(noisy, iters=30, target_ci=0)
    assert len(w) == 1 and "unstable" in w[0] and "15%" in w[0]
    # exactly at the threshold is not flagged (CV over 10 %)
    assert stats.warnings_for(dict(steady, cv=0.10), iters=30, target_ci=0) == []

    w = stats.warnings_for(steady, iters=5, target_ci=0)
    assert len(w) == 1 and "few samples" in w[0] and "5" in w[0]
    assert stats.warnings_for(steady, iters=stats.FEW_SAMPLES, target_ci=0) == []

    w = stats.warnings_for(dict(steady, num_outliers=2), iters=30, target_ci=0)
    assert len(w) == 1 and "outliers: 2" in w[0]

    # precision: flagged only when the target is set and missed
    assert stats.warnings_for(dict(steady, precision=0.02), iters=30, target_ci=0.01)[0].startswith("precision")
    assert stats.warnings_for(dict(steady, precision=0.005), iters=30, target_ci=0.01) == []
    assert stats.warnings_for(dict(steady, precision=None), iters=30, target_ci=0.01)[0].startswith("precision")
    # on the mean where the timing targeted the mean: from its stdev, not the median's CI
    spread = dict(steady, precision=0.001, time_mean_s=1.0, time_stdev_s=0.1)    # +-3.6 % at n = 30
    w = stats.warnings_for(spread, iters=30, target_ci=0.02, ci_of="mean")
    assert len(w) == 1 and w[0].startswith("precision of the mean +-3.6%")
    assert stats.warnings_for(spread, iters=30, target_ci=0.04, ci_of="mean") == []
    assert stats.warnings_for(spread, iters=30, target_ci=0.02) == []

    both = stats.warnings_for(dict(steady, cv=0.5), iters=3, target_ci=0)
    assert any("unstable" in m for m in both) and any("few samples" in m for m in both)


class ScriptedBackend:
    """A one-rank backend whose calls take scripted times: 5 % of them 16 times
    the rest, as gloo's waits preempted by the scheduler look on a 2-core VM."""
    rank = 0

    def __init__(self):
        self.rng = np.random.default_rng(11)

    def time_iterations(self, op, iters):
        return list(np.where(self.rng.random(iters) < 0.05, 4e-3, 2.5e-4))

    def synchronize(self):
        pass

    def control_barrier(self):
        pass

    def control_reduce(self, values, op):
        return values

    def control_bcast(self, obj):
        return obj


@pytest.mark.parametrize("ci_of", ["median", "mean"])
def test_adaptive_stop_targets_the_statistic_asked_for(ci_of):
    from commbench.timing import TimingSettings, measure
    t = TimingSettings(warmup=0, iters=20, max_iters=5000, time_budget_s=60, target_ci=0.02, ci_of=ci_of)
    n = len(measure(ScriptedBackend(), None, t).samples_s)
    if ci_of == "median":
        assert n <= 40              # the median sits on the common time at once
    else:
        # the mean (5 % of calls at 16x: CV about 1.9) needs some 33,000 calls for +-2 %: the cap stops it
        assert n == 5000


class ClockedBackend(ScriptedBackend):
    """Calls of 1 ms, all alike (the CI is met at once), on a clock that each
    call advances (timing.time.monotonic patched to it)."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def time_iterations(self, op, iters):
        self.now += 1e-3 * iters
        return [1e-3] * iters


def test_calls_go_on_for_the_minimum_time_though_the_ci_is_met(monkeypatch):
    from commbench import timing
    from commbench.timing import TimingSettings, measure
    backend = ClockedBackend()
    monkeypatch.setattr(timing.time, "monotonic", lambda: backend.now)
    quick = TimingSettings(warmup=0, iters=10, max_iters=100000, time_budget_s=2.0, target_ci=0.02)
    assert len(measure(backend, None, quick).samples_s) == 10
    slow = TimingSettings(warmup=0, iters=10, max_iters=100000, time_budget_s=2.0, target_ci=0.02, min_time_s=0.5)
    n = len(measure(backend, None, slow).samples_s)
    assert 500 <= n < 1000          # at least 0.5 s of 1 ms calls, batches doubling at most
    capped = TimingSettings(warmup=0, iters=10, max_iters=100000, time_budget_s=0.2, target_ci=0.02, min_time_s=0.5)
    assert 200 <= len(measure(backend, None, capped).samples_s) < 400      # the budget still ends it
    with pytest.raises(ValueError, match="min_time_s"):
        TimingSettings(min_time_s=-1).check()


def test_timing_settings_reject_an_unknown_statistic():
    from commbench.timing import TimingSettings
    with pytest.raises(ValueError, match="ci_of 'p99'"):
        TimingSettings(ci_of="p99").check()
