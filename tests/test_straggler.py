"""The wait at the data-parallel synchronisation for the last rank: E[max of R
standard normals] x the spread of a rank's compute between two synchronisations,
checked against a Monte Carlo estimate and hand-computed steps."""
import math
import statistics

import numpy as np
import pytest

from commbench import predict, stats
from commbench.parallel import Parallelism
from commbench.results import Case, Measurement
from test_predict import TableTimes, adam, dp_op, layer_ops, workload


class SpreadTimes(TableTimes):
    """TableTimes whose ops vary by a given standard deviation per call."""

    def __init__(self, compute, comm, spreads):
        super().__init__(compute, comm)
        self.spreads = spreads

    def spread(self, op):
        return self.spreads.get(op.name, 0.0)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_expected_max_normal_against_monte_carlo(n):
    draws = np.random.default_rng(7).standard_normal((200_000, n))
    assert stats.expected_max_normal(n) == pytest.approx(draws.max(axis=1).mean(), abs=0.01)


def test_expected_max_normal_exact_values():
    assert stats.expected_max_normal(1) == 0.0
    assert stats.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    with pytest.raises(ValueError):
        stats.expected_max_normal(0)


def _dp_plan(dp, spreads):
    # m = 2 micro-batches: forward 10, backward 20 each, Adam 1, one bucket of 5
    # ready at the end of the last backward (all exposed)
    par = Parallelism(world=dp, gpus_per_node=dp, global_batch=2 * dp)
    w = workload(par, layer_ops(2) + [adam()], [dp_op("b1", 100, group=dp)])
    times = SpreadTimes({"layer fwd": 10.0, "layer bwd": 20.0, "adam": 1.0}, {"b1": 5.0}, spreads)
    return par, w, times


def test_straggler_wait_added_at_the_dp_sync():
    par, w, times = _dp_plan(4, {"layer fwd": 0.3, "layer bwd": 0.4, "adam": 0.5})
    sb = predict.predict(w, par, times)
    # each call independent: 2 forwards, 2 backwards and one Adam step between syncs
    sigma = math.sqrt(2 * 0.3 ** 2 + 2 * 0.4 ** 2 + 0.5 ** 2)
    wait = 1.0294 * sigma
    assert sb.stages[0]["straggler_s"] == pytest.approx(wait, rel=1e-3)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(5.0 + wait, rel=1e-3)
    assert sb.step_time_s == pytest.approx(2 * (10 + 20) + 5 + 1 + wait, rel=1e-4)
    assert sum(sb.breakdown[k] for k in ("compute_s", "tp_exposed_s", "pp_exposed_s", "dp_exposed_s",
                                         "bubble_s", "optimizer_s")) == pytest.approx(sb.step_time_s)
    assert any("last of its 4 data-parallel ranks" in n for n in sb.notes)


def test_straggler_wait_grows_with_the_dp_group():
    spreads = {"layer fwd": 0.3, "layer bwd": 0.4, "adam": 0.5}
    waits = {}
    for dp in (2, 8, 512):
        par, w, times = _dp_plan(dp, spreads)
        waits[dp] = predict.predict(w, par, times).stages[0]["straggler_s"]
    sigma = math.sqrt(2 * 0.09 + 2 * 0.16 + 0.25)
    assert waits[2] == pytest.approx(sigma / math.sqrt(math.pi), rel=1e-4)
    assert waits[2] < waits[8] < waits[512] == pytest.approx(3.0439 * sigma, rel=1e-3)


def test_no_wait_without_spread_or_without_dp_collectives():
    par, w, times = _dp_plan(4, {})
    sb = predict.predict(w, par, times)
    assert sb.stages[0]["straggler_s"] == 0.0 and sb.step_time_s == pytest.approx(66.0)
    assert not any("data-parallel ranks" in n for n in sb.notes)
    # tensor parallelism alone: its collectives are synchronous per layer, and
    # a micro-batch timed with them in place carries their waits
    par = Parallelism(world=2, gpus_per_node=2, tp=2)
    w = workload(par, layer_ops(1) + [adam()], [])
    sb = predict.predict(w, par, SpreadTimes({"layer fwd": 10.0, "layer bwd": 20.0, "adam": 1.0}, {},
                                             {"layer fwd": 3.0, "layer bwd": 3.0}))
    assert sb.stages[0]["straggler_s"] == 0.0 and sb.step_time_s == pytest.approx(31.0)


def _compute_measurement(samples, rank_samples):
    case = Case(kind="compute", op="layer_fwd", backend="torch", device="cpu", dtype="float32", nbytes=0,
                group_size=1, num_nodes=1, axis="compute", in_place=False, concurrent_groups=2, params={"m": 1})
    return Measurement(case=case, samples_s=samples, stats=stats.summarize(samples), rank_samples_s=rank_samples)


def test_spread_is_the_ranks_relative_variation():
    # rank 1 is 1.0 slower throughout and call 2 is slow on both ranks alike:
    # neither makes a rank wait for the other; the rest varies by +-0.5 on each
    own = [[1.0, 2.5, 1.0, 3.0], [2.0, 3.5, 3.0, 3.0]]
    m = _compute_measurement([2.0, 3.5, 3.0, 3.0], own)
    grand = sum(map(sum, own)) / 8
    rows = [sum(r) / 4 for r in own]
    cols = [(own[0][i] + own[1][i]) / 2 for i in range(4)]
    resid = sum((own[r][i] - rows[r] - cols[i] + grand) ** 2 for r in range(2) for i in range(4))
    assert predict.spread_s(m) == pytest.approx(math.sqrt(resid / (1 * 3)))
    # a common slowdown and a constant offset alone give no spread
    same = _compute_measurement([2.0, 5.0], [[1.0, 4.0], [2.0, 5.0]])
    assert predict.spread_s(same) == pytest.approx(0.0, abs=1e-12)


def test_spread_of_one_rank_or_of_older_results():
    one = _compute_measurement([1.0, 2.0, 3.0], [[1.0, 2.0, 3.0], []])
    assert predict.spread_s(one) == pytest.approx(1.0)
    # older results without every rank's samples: the per-call maxima's spread
    old = _compute_measurement([2.0, 4.0, 6.0], None)
    assert predict.spread_s(old) == pytest.approx(statistics.stdev([2.0, 4.0, 6.0]))


def test_no_wait_where_the_measured_ranks_shared_the_cores():
    """A rank that waits on an oversubscribed CPU yields its core: the last
    catches up, and the step is the calls' means (no straggler term)."""
    par, w, times = _dp_plan(4, {"layer fwd": 0.3, "layer bwd": 0.4, "adam": 0.5})
    times.ranks_share_cores = True
    sb = predict.predict(w, par, times)
    assert sb.stages[0]["straggler_s"] == 0.0
    assert sb.step_time_s == pytest.approx(2 * (10 + 20) + 5 + 1)
    assert any("shared a machine's cores" in n for n in sb.notes)


@pytest.mark.parametrize("per_machine, threads, cores, shared", [
    ({"m": 4}, 1, 2, True),                  # 4 ranks on 2 cores
    ({"m": 2}, 1, 2, False),                 # one core each
    ({"m": 2}, 2, 2, True),                  # two threads each on 2 cores
    ({"a": 2, "b": 2}, 1, 2, False),         # two machines of 2 cores
    ({"a": 2, "b": 3}, 1, 2, True),
])
def test_cores_shared_counts_threads_per_machine(per_machine, threads, cores, shared):
    from commbench import env
    info = {"ranks_per_machine": per_machine, "threads_per_rank": threads, "cpu_count": cores}
    assert env.cores_shared(info) is shared


def test_emulated_nodes_are_one_machine():
    """Ranks on two host names of one kernel (commbench emulate's namespaces)
    count as one machine's: they share its cores."""
    from commbench import env
    ranks = [{"rank": r, "host": f"node{r // 2}", "machine": "boot-1", "threads": 1} for r in range(4)]
    info = env.cluster(ranks)
    assert info["ranks_per_host"] == {"node0": 2, "node1": 2}
    assert info["ranks_per_machine"] == {"boot-1": 4} and info["threads_per_rank"] == 1
    assert env.cores_shared(dict(info, cpu_count=2)) and not env.cores_shared(dict(info, cpu_count=4))
    # older results (no ranks_per_machine): per host
    assert not env.cores_shared({"ranks_per_host": {"node0": 2, "node1": 2}, "cpu_count": 2})


def test_measured_times_read_shared_cores_from_the_compute_file_header():
    from commbench.results import ResultFile
    m = _compute_measurement([1.0, 2.0], [[1.0, 2.0], [1.5, 2.5]])
    over = {"cluster": {"ranks_per_machine": {"x": 4}, "threads_per_rank": 1, "cpu_count": 2}}
    fits = {"cluster": {"ranks_per_machine": {"x": 2}, "threads_per_rank": 1, "cpu_count": 2}}
    assert predict.MeasuredTimes(None, [ResultFile(over, [m])], device="cpu").ranks_share_cores
    assert not predict.MeasuredTimes(None, [ResultFile(fits, [m])], device="cpu").ranks_share_cores
    assert not predict.MeasuredTimes(None, [], device="cpu").ranks_share_cores
