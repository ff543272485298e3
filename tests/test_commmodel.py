"""CommModel on synthetic results that follow a known alpha-beta law exactly:
measured sizes come back as measured, sizes in between as log-log
interpolation, other groups and node counts from the fitted law, flagged."""
import math

import pytest

from commbench import stats, system
from commbench.commmodel import CommModel
from commbench.results import Case, Measurement, ResultFile

# the law the synthetic measurements follow: per tier, seconds per ring step and
# bytes/s per GPU share (inter-node: a group with r ranks per node gets r shares)
ALPHA = {"intra": 5e-6, "inter": 20e-6}
BW = {"intra": 100e9, "inter": 10e9}
SIZES = [1 << k for k in range(10, 27, 2)]     # 1 KiB .. 64 MiB, x4 apart


def law(collective, nbytes, n, nodes):
    """Written out per collective, independently of commbench.alphabeta."""
    tier = "intra" if nodes == 1 else "inter"
    r = 1 if nodes == 1 else math.ceil(n / nodes)
    if collective == "all_reduce":
        steps, moved = 2 * (n - 1), nbytes * 2 * (n - 1) / n
    elif collective in ("all_gather", "reduce_scatter"):
        steps, moved = n - 1, nbytes * (n - 1) / n
    elif collective == "send_recv":
        steps, moved = 1, nbytes
    else:
        raise AssertionError(collective)
    return steps * ALPHA[tier] + moved / (r * BW[tier])


def measurement(op, nbytes, n, nodes, t, dtype="bfloat16", groups=1, backend="torch-nccl", axis="world"):
    # 11 samples spread +-5 % around t: their median is t exactly
    samples = [t * (1 + 0.01 * k) for k in range(-5, 6)]
    case = Case(kind="collective", op=op, backend=backend, device="cuda", dtype=dtype, nbytes=nbytes,
                group_size=n, num_nodes=nodes, axis=axis, in_place=False, concurrent_groups=groups)
    return Measurement(case=case, samples_s=samples, stats=stats.summarize(samples))


def results(shapes, collectives=("all_reduce",), sizes=SIZES, **kw):
    ms = [measurement(c, s, n, nodes, law(c, s, n, nodes), **kw)
          for c in collectives for n, nodes in shapes for s in sizes]
    return ResultFile(header={"type": "header", "schema_version": 1}, measurements=ms)


BOTH_TIERS = [(2, 1), (4, 1), (8, 2), (16, 4)]


@pytest.fixture(scope="module")
def model():
    return CommModel.from_results([results(BOTH_TIERS)])


def test_exact_match_is_the_measured_p50(model):
    rf = results([(4, 1)])
    m = next(m for m in rf.measurements if m.case.nbytes == 1 << 20)
    e = model.estimate("all_reduce", 1 << 20, 4, 1)
    assert e.source == "measured"
    assert e.time_s == m.stats["time_p50_s"]
    assert (e.low_s, e.high_s) == (m.stats["ci_low_s"], m.stats["ci_high_s"])
    assert e.low_s < e.time_s < e.high_s


def test_between_sizes_is_loglog_interpolation(model):
    s0, s1, s = 1 << 20, 1 << 22, 3 << 20
    t0, t1 = law("all_reduce", s0, 4, 1), law("all_reduce", s1, 4, 1)
    # log t = log t0 + (log s - log s0) / (log s1 - log s0) * (log t1 - log t0)
    w = math.log(3) / math.log(4)                 # log(3 * 2^20 / 2^20) / log(2^22 / 2^20)
    want = math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    e = model.estimate("all_reduce", s, 4, 1)
    assert e.source == "interpolated"
    assert e.time_s == pytest.approx(want, rel=1e-12)
    assert e.low_s < e.time_s < e.high_s


@pytest.mark.parametrize("n, nodes, nbytes", [
    (8, 1, 1 << 24),        # a larger group on one node
    (64, 16, 1 << 24),      # more nodes (4 ranks per node, as measured)
    (16, 16, 1 << 24),      # one rank per node: a quarter of the NIC shares
    (4, 1, 1 << 30),        # a measured shape, beyond its largest size
    (16, 4, 1 << 8),        # ... below its smallest
])
def test_unmeasured_shapes_follow_the_fitted_law(model, n, nodes, nbytes):
    e = model.estimate("all_reduce", nbytes, n, nodes)
    assert e.source == "extrapolated"
    assert e.time_s == pytest.approx(law("all_reduce", nbytes, n, nodes), rel=1e-6)
    assert e.low_s <= e.time_s <= e.high_s
    assert "fit" in e.note


def test_unmeasured_collective_uses_all_reduce_fit(model):
    e = model.estimate("all_gather", 1 << 24, 32, 8)
    assert e.source == "extrapolated"
    assert "all_reduce" in e.note
    assert e.time_s == pytest.approx(law("all_gather", 1 << 24, 32, 8), rel=1e-6)


def test_missing_tier_is_an_error_naming_what_to_measure():
    intra_only = CommModel.from_results(results([(2, 1), (4, 1)]))
    with pytest.raises(ValueError, match=r"no inter-node measurements.*measure all_reduce"):
        intra_only.estimate("all_reduce", 1 << 20, 8, 2)
    inter_only = CommModel.from_results(results([(8, 2)]))
    with pytest.raises(ValueError, match=r"no intra-node measurements"):
        inter_only.estimate("all_reduce", 1 << 20, 4, 1)


def test_one_size_cannot_fix_a_fit():
    one = CommModel.from_results(results([(4, 1)], sizes=[1 << 20]))
    with pytest.raises(ValueError, match="cannot fix an alpha-beta fit"):
        one.estimate("all_reduce", 1 << 22, 4, 1)


def test_other_dtype_at_the_same_size_is_used_and_said():
    m = CommModel.from_results(results([(4, 1)]))
    e = m.estimate("all_reduce", 1 << 20, 4, 1, dtype="fp32")
    assert e.source == "measured"
    assert "no float32 measurement" in e.note and "used bfloat16's" in e.note
    assert e.time_s == law("all_reduce", 1 << 20, 4, 1)


def test_concurrent_groups_are_preferred_when_asked():
    iso = measurement("all_reduce", 1 << 20, 4, 2, 1.0e-3, groups=1)
    conc = measurement("all_reduce", 1 << 20, 4, 2, 2.0e-3, groups=4, axis="dp")
    m = CommModel.from_results(ResultFile(header={}, measurements=[iso, conc]))
    assert m.estimate("all_reduce", 1 << 20, 4, 2, concurrent=True).time_s == 2.0e-3
    assert m.estimate("all_reduce", 1 << 20, 4, 2, concurrent=False).time_s == 1.0e-3


def test_send_recv_is_a_pair():
    m = CommModel.from_results(results([(2, 1), (2, 2)], collectives=("send_recv",)))
    assert m.estimate("send_recv", 1 << 20, 2, 2).time_s == law("send_recv", 1 << 20, 2, 2)
    e = m.estimate("send_recv", 1 << 27, 2, 2)
    assert e.source == "extrapolated"
    assert e.time_s == pytest.approx(law("send_recv", 1 << 27, 2, 2), rel=1e-6)


def test_backends_are_not_mixed():
    a, b = results([(4, 1)]), results([(4, 1)], backend="torch-gloo")
    with pytest.raises(ValueError, match="mix backends"):
        CommModel.from_results([a, b])
    assert CommModel.from_results([a, b], backend="torch-gloo").backend == "torch-gloo"
    with pytest.raises(ValueError, match="no float16 measurements"):
        CommModel.from_results([a], dtype="fp16")


def test_skipped_wrong_and_compute_measurements_are_left_out():
    rf = results([(4, 1)], sizes=[1 << 20])
    rf.measurements[0].num_wrong = 3
    with pytest.raises(ValueError, match="no usable collective measurements"):
        CommModel.from_results(rf)


def test_bad_questions():
    m = CommModel.from_results(results([(4, 1)]))
    with pytest.raises(ValueError, match="no time model for collective"):
        m.estimate("barrier", 0, 4, 1)
    with pytest.raises(ValueError, match="cannot span"):
        m.estimate("all_reduce", 1024, 2, 4)
    with pytest.raises(ValueError, match="group of 1"):
        m.estimate("all_reduce", 1024, 1, 1)


def test_from_system_wraps_the_spec():
    spec = system.load("polaris")
    e = CommModel.from_system(spec).estimate("reduce_scatter", 1 << 26, 16, 4)
    assert e.source == "spec"
    assert e.time_s == e.low_s == e.high_s == spec.collective_time_s("reduce_scatter", 1 << 26, 16, 4)


def test_noisy_points_fit_within_tolerance_and_widen_the_band():
    # the same law with a deterministic +-3 % wobble on every measured time
    ms = []
    for i, (n, nodes, s) in enumerate((n, nodes, s) for n, nodes in BOTH_TIERS for s in SIZES):
        ms.append(measurement("all_reduce", s, n, nodes, law("all_reduce", s, n, nodes) * (1 + 0.03 * (-1) ** i)))
    m = CommModel.from_results(ResultFile(header={}, measurements=ms))
    e = m.estimate("all_reduce", 1 << 26, 128, 32)
    assert e.source == "extrapolated"
    assert e.time_s == pytest.approx(law("all_reduce", 1 << 26, 128, 32), rel=0.05)
    assert e.low_s < e.time_s < e.high_s
    assert (e.high_s - e.time_s) / e.time_s > 0.04     # CI half-width 4 % plus the residual
