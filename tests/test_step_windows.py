"""compute/windows.py: a step op timed in two windows of a validation round
joins into one measurement whose samples are both windows' in order, every
statistic recomputed from them (the predictor's slowest-rank mean included)."""
import statistics

import pytest

from commbench import predict, stats
from commbench.compute import windows
from commbench.results import Case, Measurement, ResultFile, make_header


def case(op="dp_microbatch"):
    return Case(kind="compute", op=op, backend="torch", device="cpu", dtype="float32", nbytes=4000, group_size=1,
                num_nodes=1, axis="compute", in_place=False, concurrent_groups=2, params={"m": 10})


def window(rank0, rank1, note="timed with DDP in place"):
    samples = [max(a, b) for a, b in zip(rank0, rank1)]
    summary = stats.summarize(samples)
    return Measurement(case=case(), samples_s=samples, warmup=3, target_ci=0.02, stats=summary,
                       algbw_gbps=4000 / summary["time_p50_s"] / 1e9, rank_samples_s=[rank0, rank1],
                       rank_time_p50_s=[statistics.median(rank0), statistics.median(rank1)],
                       slowest_rank=0, slowest_host="h",
                       warnings=stats.warnings_for(summary, len(samples), 0.02, "mean") + [note])


def test_two_windows_join_in_order_with_statistics_recomputed():
    a = window([0.010, 0.011, 0.012], [0.009, 0.010, 0.010])
    b = window([0.020, 0.021], [0.030, 0.032])
    m = windows.join([a, b], "mean")
    assert m.samples_s == [0.010, 0.011, 0.012, 0.030, 0.032]
    assert m.rank_samples_s == [[0.010, 0.011, 0.012, 0.020, 0.021], [0.009, 0.010, 0.010, 0.030, 0.032]]
    assert m.stats["time_mean_s"] == pytest.approx(0.095 / 5) and m.stats["time_p50_s"] == 0.012
    assert m.rank_time_p50_s == [0.012, 0.010]
    # rank 1's mean (0.0182) is above rank 0's (0.0148) once the windows are joined
    assert m.slowest_rank == 1 and m.algbw_gbps == pytest.approx(4000 / 0.012 / 1e9)
    # the predictor's time of it: the slowest rank's own mean over both windows
    assert predict.central_time(m, "mid") == pytest.approx(0.091 / 5)
    # the note of the windows kept once, the sample warnings those of the joined samples
    assert m.warnings.count("timed with DDP in place") == 1
    assert m.warnings[:-1] == stats.warnings_for(m.stats, 5, 0.02, "mean")
    assert "few samples: 5 < 10" in m.warnings


def test_a_window_that_timed_nothing_leaves_the_other_and_a_note():
    a = window([0.010, 0.011], [0.010, 0.012])
    skipped = Measurement(case=case(), status="skipped", skip_reason="1 transfer(s) of the tier whose receiver waited")
    m = windows.join([skipped, a], "mean")
    assert m.status == "ok" and m.samples_s == a.samples_s
    assert "window 1 of 2 timed nothing: 1 transfer(s) of the tier whose receiver waited" in m.warnings
    assert windows.join([skipped, skipped], "mean") is skipped


def test_join_files_keeps_the_kernels_and_joins_each_case():
    kernel = Measurement(case=case("gemm_nn"), samples_s=[1e-4], stats=stats.summarize([1e-4]))
    base = ResultFile(header=make_header(settings={"time_budget_s": 0.5}), measurements=[kernel], path=None)
    w1 = ResultFile(header=make_header(settings={}), measurements=[window([0.01, 0.01], [0.01, 0.01])])
    w2 = ResultFile(header=make_header(settings={}), measurements=[window([0.02, 0.02], [0.02, 0.02])])
    rf = windows.join_files(base, [w1, w2], "/x/compute.jsonl", "mean")
    assert rf.path == "/x/compute.jsonl" and rf.header["settings"] == {"time_budget_s": 0.5, "step_op_windows": 2}
    assert [m.case.op for m in rf.measurements] == ["gemm_nn", "dp_microbatch"]
    assert rf.measurements[1].samples_s == [0.01, 0.01, 0.02, 0.02]
    assert base.header["settings"] == {"time_budget_s": 0.5}     # not changed in place
