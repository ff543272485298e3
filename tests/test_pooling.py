"""pooling.pool: the measurements of several rounds of one job joined case by
case (validate --rounds), checked against the concatenations done here."""
import numpy as np
import pytest

from commbench import pooling, stats
from commbench.results import Case, Measurement, ResultFile


def _case(op="all_reduce", nbytes=1024):
    return Case("collective", op, "torch-gloo", "cpu", "float32", nbytes, 2, 1, "tp", True)


def _m(samples, ranks=None, op="all_reduce", nbytes=1024, status="ok", warnings=()):
    if status != "ok":
        return Measurement(case=_case(op, nbytes), status=status, skip_reason="could not set up: no")
    s = stats.summarize(samples)
    return Measurement(case=_case(op, nbytes), samples_s=list(samples), stats=s, rank_samples_s=ranks,
                       rank_time_p50_s=[float(np.median(r)) for r in ranks] if ranks else [s["time_p50_s"]],
                       algbw_gbps=nbytes / s["time_p50_s"] / 1e9, busbw_gbps=nbytes / s["time_p50_s"] / 1e9,
                       slowest_rank=0, slowest_host="h", warnings=list(warnings))


def test_pool_concatenates_each_case_and_derives_its_statistics_again():
    a = ResultFile({"type": "header", "run_id": "a"}, [_m([1.0, 2.0, 3.0], [[1.0, 2.0, 3.0], [0.5, 1.0, 1.5]]),
                                                       _m([7.0, 8.0], nbytes=64, warnings=["unstable: CV 11%"])],
                   path="round-1/comm.jsonl")
    b = ResultFile({"type": "header", "run_id": "b"}, [_m([5.0, 9.0, 4.0], [[0.1, 0.2, 0.3], [5.0, 9.0, 4.0]]),
                                                       _m([6.0], op="broadcast")], path="round-2/comm.jsonl")
    p = pooling.pool([a, b])
    assert p.header["run_id"] == "a" and p.header["pooled_from"] == ["round-1/comm.jsonl", "round-2/comm.jsonl"]
    by = {(m.case.op, m.case.nbytes): m for m in p.measurements}
    assert list(by) == [("all_reduce", 1024), ("all_reduce", 64), ("broadcast", 1024)]
    ar = by[("all_reduce", 1024)]
    assert ar.samples_s == [1.0, 2.0, 3.0, 5.0, 9.0, 4.0]
    assert ar.stats["time_mean_s"] == pytest.approx(4.0) and ar.stats["time_p50_s"] == 3.5
    assert ar.rank_samples_s == [[1.0, 2.0, 3.0, 0.1, 0.2, 0.3], [0.5, 1.0, 1.5, 5.0, 9.0, 4.0]]
    assert ar.rank_time_p50_s == [0.65, 2.75] and ar.slowest_rank == 1
    assert ar.algbw_gbps == pytest.approx(1024 / 3.5 / 1e9)
    # a case of one round only is that round's measurement
    assert by[("all_reduce", 64)] is a.measurements[1] and by[("broadcast", 1024)] is b.measurements[1]


def test_pool_weighs_every_round_alike():
    """A round that fitted 5 calls into the budget and one that fitted 2: each
    gives 2, the faster one its first and last, so the pooled mean is the mean
    of the rounds' own means here, not the faster round's."""
    fast = _m([1.0, 1.0, 2.0, 1.0, 1.0], [[1.0, 1.0, 2.0, 1.0, 1.0], [0.5] * 5])
    slow = _m([3.0, 3.0], [[3.0, 3.0], [0.5, 0.5]])
    (m,) = pooling.pool([ResultFile({}, [fast], "r1"), ResultFile({}, [slow], "r2")]).measurements
    assert m.samples_s == [1.0, 1.0, 3.0, 3.0] and m.stats["time_mean_s"] == 2.0
    assert m.rank_samples_s == [[1.0, 1.0, 3.0, 3.0], [0.5] * 4]
    # the middle of five of an odd count: first, middle, last
    (m,) = pooling.pool([ResultFile({}, [fast], "r1"), ResultFile({}, [_m([3.0, 3.0, 3.0])], "r2")]).measurements
    assert m.samples_s == [1.0, 2.0, 1.0, 3.0, 3.0, 3.0]


def test_pool_keeps_the_ok_rounds_of_a_case_skipped_in_another():
    ok1, ok2 = _m([1.0, 3.0]), _m([2.0, 4.0])
    skipped = _m([], status="skipped")
    p = pooling.pool([ResultFile({}, [skipped], "r1"), ResultFile({}, [ok1], "r2"), ResultFile({}, [ok2], "r3")])
    (m,) = p.measurements
    assert m.status == "ok" and m.samples_s == [1.0, 3.0, 2.0, 4.0] and m.stats["time_mean_s"] == 2.5
    only_skipped = pooling.pool([ResultFile({}, [skipped], "r1"), ResultFile({}, [_m([], status="skipped")], "r2")])
    assert only_skipped.measurements == [skipped]


def test_pool_of_one_file_is_that_file_and_of_none_an_error():
    rf = ResultFile({}, [_m([1.0])], "x")
    assert pooling.pool([rf]) is rf
    with pytest.raises(ValueError):
        pooling.pool([])
