"""Statistics of raw samples: percentiles, a distribution-free CI of the median,
and pyperf-style instability warnings. Everything here is derived, never stored
in place of the raw samples."""
import functools
import math

import numpy as np

CONFIDENCE = 0.95
UNSTABLE_CV = 0.10
FEW_SAMPLES = 10


# below 6 samples no pair of order statistics covers the median with 95 %
# (the full range of 5 covers it with 1 - 2/2^5 = 93.75 %)
MIN_CI_SAMPLES = 6


def median_ci(samples, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Confidence interval of the median from order statistics: the number of
    samples below the true median is Binomial(n, 1/2), so [x_(j), x_(k)] with j, k
    its two-sided quantiles covers the median with the given confidence, whatever
    the distribution (timing distributions are skewed, so no normal assumption)."""
    from scipy import stats as sps   # here, not at import: the CLI answers bad input fast
    x = np.sort(np.asarray(samples, dtype=np.float64))
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    if n < MIN_CI_SAMPLES:  # too few order statistics for a 95 % interval: the full range
        return float(x[0]), float(x[-1])
    # j = smallest count with P(B <= j) >= alpha/2, so P(B <= j-1) < alpha/2 and
    # [x_(j), x_(n-j+1)] (1-based) covers the median with probability >= confidence.
    j = int(sps.binom.ppf((1.0 - confidence) / 2, n, 0.5))
    lo, hi = j - 1, n - j
    return float(x[lo]), float(x[hi])


def mean_half_width(stdev: float, n: int) -> float:
    """Half-width of the mean's 95 % normal-theory CI: 1.96 stdev / sqrt(n)."""
    return 1.96 * stdev / math.sqrt(max(n, 1))


def precision(samples, of: str = "median") -> float:
    """Half-width of the CI of the median (of='median') relative to the median,
    or of the mean's 95 % normal-theory CI (of='mean', as central() gives it)
    relative to the mean; 0.01 = +-1 %."""
    if of == "mean":
        x = np.asarray(samples, dtype=np.float64)
        if len(x) < 2 or not x.mean() > 0:
            return math.inf
        return mean_half_width(float(x.std(ddof=1)), len(x)) / float(x.mean())
    lo, hi = median_ci(samples)
    med = float(np.median(samples)) if len(samples) else math.nan
    if not med or math.isnan(med):
        return math.inf
    return (hi - lo) / 2.0 / med


def summarize(samples) -> dict:
    """Derived figures of a list of per-iteration times in seconds."""
    x = np.asarray(samples, dtype=np.float64)
    if len(x) == 0:
        raise ValueError("no samples to summarize")
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    mean = float(x.mean())
    stdev = float(x.std(ddof=1)) if len(x) > 1 else 0.0
    lo, hi = median_ci(x)
    q1, q3 = np.percentile(x, [25, 75])
    iqr = q3 - q1
    outliers = int(np.sum((x < q1 - 3 * iqr) | (x > q3 + 3 * iqr))) if iqr > 0 else 0
    return {
        "time_min_s": float(x.min()),
        "time_p50_s": float(p50),
        "time_mean_s": mean,
        "time_p95_s": float(p95),
        "time_p99_s": float(p99),
        "time_max_s": float(x.max()),
        "time_stdev_s": stdev,
        "cv": stdev / mean if mean > 0 else 0.0,
        "ci_low_s": lo,
        "ci_high_s": hi,
        "precision": (hi - lo) / 2.0 / float(p50) if p50 > 0 else None,
        "num_outliers": outliers,
    }


def warnings_for(summary: dict, iters: int, target_ci: float, ci_of: str = "median") -> list[str]:
    """Instability warnings in the manner of pyperf; the precision one on the
    statistic the timing targeted (ci_of: median or mean)."""
    out = []
    if summary["cv"] > UNSTABLE_CV:
        out.append(f"unstable: CV {summary['cv']:.0%} > {UNSTABLE_CV:.0%}")
    if iters < FEW_SAMPLES:
        out.append(f"few samples: {iters} < {FEW_SAMPLES}")
    if summary["num_outliers"]:
        out.append(f"outliers: {summary['num_outliers']} beyond 3 IQR")
    if ci_of == "mean":
        mean = summary["time_mean_s"]
        prec = mean_half_width(summary["time_stdev_s"], iters) / mean if iters > 1 and mean > 0 else None
    else:
        prec = summary["precision"]
    if target_ci > 0 and (prec is None or prec > target_ci):
        out.append(f"precision of the {ci_of} +-{prec or math.inf:.1%} did not reach the target +-{target_ci:.1%}")
    return out


def central(summary: dict, iters: int, statistic: str) -> tuple[float, float, float]:
    """(value, low, high) of a measurement's time: its median with the CI of the
    median (statistic 'median'), or its mean with a 95 % normal-theory CI,
    mean +- 1.96 stdev / sqrt(n) (statistic 'mean'). The predictor sums times of
    many calls, and the expected time of a sum is the sum of the means, which for
    skewed timing distributions sits above the sum of the medians."""
    if statistic == "median":
        p50 = summary["time_p50_s"]
        lo, hi = summary.get("ci_low_s", p50), summary.get("ci_high_s", p50)
        return p50, min(lo, p50), max(hi, p50)
    if statistic != "mean":
        raise ValueError(f"statistic {statistic!r}: choose mean or median")
    mean = summary["time_mean_s"]
    half = mean_half_width(summary.get("time_stdev_s", 0.0), iters)
    return mean, max(0.0, mean - half), mean + half


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals]: how many standard deviations
    above the mean the last of n ranks arrives at a barrier (0 for one rank,
    1/sqrt(pi) = 0.564 for two, 1.029 for four, 3.04 for 512): the integral of
    x n phi(x) Phi(x)^(n-1)."""
    if n < 1:
        raise ValueError(f"expected_max_normal needs n >= 1, got {n}")
    if n == 1:
        return 0.0
    from scipy import integrate
    from scipy.stats import norm
    value, _ = integrate.quad(lambda x: x * n * norm.pdf(x) * norm.cdf(x) ** (n - 1), -12.0, 12.0, limit=200)
    return float(value)


def relative_spread(per_rank) -> float:
    """The standard deviation of one rank's sample relative to its peers': the
    residual of the two-way layout x[r, i] = mean + rank effect + call effect +
    e over R >= 2 ranks' samples (each truncated to the shortest, n >= 2; call
    i of every rank taken at about the same time), sqrt(sum(e^2) / ((R - 1)(n - 1))).
    A slowdown common to every rank at the same call, and a rank slower
    throughout, are not in it."""
    n = min(len(s) for s in per_rank)
    x = np.stack([np.asarray(s[:n], dtype=np.float64) for s in per_rank])
    e = x - x.mean(axis=1, keepdims=True) - x.mean(axis=0, keepdims=True) + x.mean()
    return math.sqrt(float((e ** 2).sum()) / ((len(per_rank) - 1) * (n - 1)))
