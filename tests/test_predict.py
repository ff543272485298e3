"""Composition on synthetic workloads and time tables with hand-computed answers:
pure DP, TP on the critical path, the 1F1B bubble, DP buckets hidden and
exposed, ZeRO-3 gathers gating compute; the band, FLOPs and throughput."""
from dataclasses import replace

import pytest

from commbench import predict
from commbench.parallel import Parallelism
from commbench.workload import CommOp, ComputeOp, Workload

MODEL = {"name": "synthetic", "seq": 100, "num_params": 0}


class TableTimes(predict.Times):
    """Times looked up by op name (compute) or label (comm), the same at every
    bound unless a band is given as (low, mid, high)."""

    def __init__(self, compute, comm, interference=None):
        super().__init__(comm_model=None, interference=interference)
        self.table_compute, self.table_comm = compute, comm

    @staticmethod
    def _at(v, bound):
        if isinstance(v, tuple):
            return {"low": v[0], "mid": v[1], "high": v[2]}[bound]
        return v

    def compute(self, op, bound):
        return self._at(self.table_compute[op.name], bound)

    def comm_op(self, c, bound):
        return self._at(self.table_comm[c.label], bound)

    def comm(self, collective, nbytes, group_size, num_nodes, dtype, bound):
        return self._at(self.table_comm[collective], bound)


def layer_ops(m, stages=-1, flops=1e9):
    return [ComputeOp("layer fwd", "gemm", flops=flops, count=m, phase="fwd", stage=stages),
            ComputeOp("layer bwd", "gemm", flops=2 * flops, count=m, phase="bwd", stage=stages)]


def adam(stage=0):
    return ComputeOp("adam", "optimizer", m=10, count=1, phase="step", stage=stage, scope="optimizer")


def workload(par, compute, comm):
    return Workload(model=MODEL, parallelism={"seq": 100}, compute_ops=compute, comm_ops=comm)


def dp_op(label, nbytes, coll="all_reduce", count=1, phase="bwd", stage=0, group=2):
    return CommOp(coll, "dp", group, 1, nbytes, count, phase, overlap=phase, label=label, stage=stage)


def test_pure_dp_one_bucket_fully_exposed():
    # m = 1: forward 10, backward 20, one bucket ready at the end of the backward: all 5 exposed
    par = Parallelism(world=2, gpus_per_node=2)
    w = workload(par, layer_ops(1) + [adam()], [dp_op("b1", 100)])
    sb = predict.predict(w, par, TableTimes({"layer fwd": 10.0, "layer bwd": 20.0, "adam": 1.0}, {"b1": 5.0}))
    assert sb.step_time_s == pytest.approx(10 + 20 + 5 + 1)
    b = sb.breakdown
    assert (b["compute_s"], b["dp_exposed_s"], b["optimizer_s"], b["hidden_comm_s"]) == (30, 5, 1, 0)
    assert b["tp_exposed_s"] == b["pp_exposed_s"] == b["bubble_s"] == 0
    assert sb.samples_per_s == pytest.approx(2 / 36) and sb.tokens_per_s == pytest.approx(200 / 36)


def test_dp_buckets_hidden_then_exposed():
    """Two buckets of 3:1 bytes are ready at 3/4 and 4/4 of a backward of 20
    (t = 25 and 30 after the forward of 10)."""
    par = Parallelism(world=2, gpus_per_node=2)
    comm = [dp_op("first", 300), dp_op("last", 100)]
    base = {"layer fwd": 10.0, "layer bwd": 20.0, "adam": 0.0}
    # short first bucket: runs 25..29, hidden; last runs 30..32: 2 exposed
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], comm), par, TableTimes(base, {"first": 4, "last": 2}))
    assert sb.step_time_s == pytest.approx(32)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(2) and sb.breakdown["hidden_comm_s"] == pytest.approx(4)
    # long first bucket: runs 25..45 (5 of it hidden), the last queues behind it: 45..47
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], comm), par,
                         TableTimes(base, {"first": 20, "last": 2}))
    assert sb.step_time_s == pytest.approx(47)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(17) and sb.breakdown["hidden_comm_s"] == pytest.approx(5)


def test_accumulation_buckets_only_in_last_microbatch():
    # m = 3 micro-batches under no_sync: the bucket overlaps only the last backward
    par = Parallelism(world=2, gpus_per_node=2, global_batch=6)
    w = workload(par, layer_ops(3) + [adam()], [dp_op("first", 300), dp_op("last", 100)])
    sb = predict.predict(w, par, TableTimes({"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.0}, {"first": 1.0,
                                                                                                 "last": 0.5}))
    # compute 9; last backward 7..9: first ready 8.5 -> 9.5, last 9.5 -> 10
    assert sb.step_time_s == pytest.approx(10)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(1.0)
    assert sb.breakdown["hidden_comm_s"] == pytest.approx(0.5)


def test_tp_collectives_on_the_critical_path():
    par = Parallelism(world=2, gpus_per_node=2, tp=2, global_batch=2, micro_batch=1)
    tp = [CommOp("all_reduce", "tp", 2, 1, 64, 2 * 2, "fwd", label="tp fwd"),
          CommOp("all_reduce", "tp", 2, 1, 64, 2 * 2, "bwd", label="tp bwd"),
          CommOp("all_reduce", "tp", 2, 1, 64, 1, "step", label="tp once")]
    w = workload(par, layer_ops(2) + [adam()], tp)
    sb = predict.predict(w, par, TableTimes({"layer fwd": 3.0, "layer bwd": 6.0, "adam": 1.0},
                                            {"tp fwd": 0.5, "tp bwd": 0.25, "tp once": 2.0}))
    # per micro-batch: 3 + 2 x 0.5 forward, 6 + 2 x 0.25 backward; 2 micro-batches; then 2 + 1
    assert sb.step_time_s == pytest.approx(2 * (4 + 6.5) + 2 + 1)
    assert sb.breakdown["tp_exposed_s"] == pytest.approx(2 * (1 + 0.5) + 2)
    assert sb.breakdown["compute_s"] == pytest.approx(18)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_1f1b_bubble(m):
    pp = 4
    par = Parallelism(world=pp, gpus_per_node=pp, pp=pp, global_batch=m)
    w = workload(par, layer_ops(m) + [adam(s) for s in range(pp)], [])
    f, b = 1.0, 2.0
    sb = predict.predict(w, par, TableTimes({"layer fwd": f, "layer bwd": b, "adam": 0.5}, {}))
    # (m + pp - 1)(f + b): the bubble is (pp - 1)(f + b)
    assert sb.step_time_s == pytest.approx((m + pp - 1) * (f + b) + 0.5)
    assert sb.breakdown["bubble_s"] == pytest.approx((pp - 1) * (f + b))
    assert sb.breakdown["pp_exposed_s"] == 0


def test_pp_p2p_is_pp_exposed_and_tied_embedding_allreduce():
    pp, m = 2, 1
    par = Parallelism(world=pp, gpus_per_node=pp, pp=pp, global_batch=m)
    comm = [CommOp("send_recv", "pp", 2, 1, 10, 1, "fwd", label="s", stage=0, peer=1, direction="send"),
            CommOp("all_reduce", "pp", 2, 1, 10, 1, "step", label="tied", stage=0),
            CommOp("all_reduce", "pp", 2, 1, 10, 1, "step", label="tied", stage=1)]
    w = workload(par, layer_ops(m) + [adam(0), adam(1)], comm)
    sb = predict.predict(w, par, TableTimes({"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.0},
                                            {"send_recv": 0.5, "tied": 0.25}))
    # F0 0..1, p2p, F1 1.5..2.5, B1 2.5..4.5, p2p, B0 5..7; then the tied all-reduce
    assert sb.step_time_s == pytest.approx(7.25)
    assert sb.breakdown["pp_exposed_s"] == pytest.approx(1.0 + 0.25)
    assert sb.breakdown["bubble_s"] == pytest.approx(3.0)


def test_zero3_first_gather_exposed_rest_prefetched():
    """4 units of forward 1 each; 4 gathers of 0.5 prefetched one unit ahead: the
    first (issued at 0, needed at 0) holds compute 0.5, the rest arrive in time."""
    par = Parallelism(world=2, gpus_per_node=2, zero=3)
    comm = [dp_op("gather", 100, coll="all_gather", count=4, phase="fwd")]
    w = workload(par, layer_ops(1) + [adam()], comm)
    sb = predict.predict(w, par, TableTimes({"layer fwd": 4.0, "layer bwd": 8.0, "adam": 0.0}, {"gather": 0.5}))
    assert sb.step_time_s == pytest.approx(12.5)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(0.5)
    assert sb.breakdown["hidden_comm_s"] == pytest.approx(1.5)
    # gathers slower than the units they feed: each waits; exposed = 4 x 1.5 - 3 x 1 = 3
    sb = predict.predict(w, par, TableTimes({"layer fwd": 4.0, "layer bwd": 8.0, "adam": 0.0}, {"gather": 1.5}))
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(3.0)


def test_zero3_forward_gathers_not_ahead_on_a_cpu_device():
    """A CPU runs each op as the host reaches it: FSDP2 issues a unit's forward
    gather at the unit's pre-forward, after the unit before has computed, so
    each of the 4 gathers of 0.5 holds its unit back in full (2.0 exposed);
    backward gathers stay prefetched one unit ahead (first one exposed)."""
    par = Parallelism(world=2, gpus_per_node=2, zero=3)
    fwd = [dp_op("gather", 100, coll="all_gather", count=4, phase="fwd")]
    table = {"layer fwd": 4.0, "layer bwd": 8.0, "adam": 0.0}
    cpu = TableTimes(table, {"gather": 0.5, "bgather": 0.5})
    cpu.host_runs_ahead = False
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], fwd), par, cpu)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(4 * 0.5)
    assert sb.step_time_s == pytest.approx(12 + 2.0)
    bwd = [dp_op("bgather", 100, coll="all_gather", count=4, phase="bwd")]
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], bwd), par, cpu)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(0.5)


def test_host_blocking_collectives_overlap_nothing_on_a_cpu_device():
    """FSDP2's gathers and reduce-scatters are blocking calls of the host,
    overlapped only through a GPU's streams: on a CPU device every one holds
    the compute up (4 x 0.5 + 4 x 0.5 = 4 exposed, nothing hidden); async
    works (DDP's buckets) still overlap there, and on a GPU both do."""
    from dataclasses import replace
    par = Parallelism(world=2, gpus_per_node=2, zero=3)
    fsdp = [replace(dp_op("bgather", 100, coll="all_gather", count=4), host_blocking=True),
            replace(dp_op("rs", 100, coll="reduce_scatter", count=4), host_blocking=True)]
    table = {"layer fwd": 4.0, "layer bwd": 8.0, "adam": 0.0}
    cpu = TableTimes(table, {"bgather": 0.5, "rs": 0.5})
    cpu.host_runs_ahead = False
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], fsdp), par, cpu)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(4.0)
    assert sb.breakdown["hidden_comm_s"] == pytest.approx(0.0)
    assert sb.step_time_s == pytest.approx(12 + 4.0)
    gpu = predict.predict(workload(par, layer_ops(1) + [adam()], fsdp), par, TableTimes(table, {"bgather": 0.5,
                                                                                               "rs": 0.5}))
    assert gpu.breakdown["dp_exposed_s"] < 2.0 and gpu.breakdown["hidden_comm_s"] > 2.0
    # the same collectives as async works: overlapped on the CPU as well
    asynchronous = [replace(c, host_blocking=False) for c in fsdp]
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], asynchronous), par, cpu)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(gpu.breakdown["dp_exposed_s"])


def test_interference_slows_overlapped_comm_and_compute():
    par = Parallelism(world=2, gpus_per_node=2)
    w = workload(par, layer_ops(1) + [adam()], [dp_op("first", 300), dp_op("last", 100)])
    base = {"layer fwd": 10.0, "layer bwd": 20.0, "adam": 0.0}
    sb = predict.predict(w, par, TableTimes(base, {"first": 4, "last": 2},
                                            interference={"comm": 1.5, "compute": 1.25}))
    # first starts at 25 under compute: 5 s at 1/1.5 speed do 3.33 s of its 4, the rest
    # runs alone (ends 30.67); for those 5 s compute runs at 1/1.25 speed, so it ends
    # 5 x (1 - 1/1.25) = 1 s later, at 31; the last (ready at 30 + 1) starts at 31
    # after compute: 2 more, exposed 1 + 2
    assert sb.breakdown["hidden_comm_s"] == pytest.approx(5 + 2 / 3 + 2 - 3.0)
    assert sb.step_time_s == pytest.approx(33.0)


def test_band_and_model_flops():
    par = Parallelism(world=2, gpus_per_node=2)
    w = workload(par, layer_ops(1, flops=3e12) + [adam()], [dp_op("b1", 100)])
    sb = predict.predict(w, par, TableTimes({"layer fwd": (9.0, 10.0, 12.0), "layer bwd": (18.0, 20.0, 24.0),
                                             "adam": 0.0}, {"b1": (4.0, 5.0, 7.0)}), peak_tflops=1.0)
    assert (sb.step_time_low_s, sb.step_time_s, sb.step_time_high_s) == pytest.approx((31, 35, 43))
    # 3e12 + 6e12 FLOPs per replica x 2 replicas over 35 s on 2 GPUs
    assert sb.tflops_per_gpu == pytest.approx(18e12 / 35 / 2 / 1e12)
    assert sb.mfu == pytest.approx(sb.tflops_per_gpu)


def test_parts_sum_to_step_time_on_a_real_plan():
    from commbench import models, plan, system
    from commbench.commmodel import CommModel
    spec = system.load("polaris")
    for kw in (dict(tp=4, pp=2, global_batch=64), dict(zero=3, global_batch=32), dict(pp=4, interleave=2,
                                                                                    global_batch=64)):
        par = Parallelism(world=32, gpus_per_node=4, **kw)
        w = plan.build(models.get("gpt3-1.3b"), par)
        sb = predict.predict(w, par, predict.Times(CommModel.from_system(spec), spec=spec))
        parts = sum(v for k, v in sb.breakdown.items() if k != "hidden_comm_s")
        assert parts == pytest.approx(sb.step_time_s, rel=1e-9), kw


def test_zero1_parameter_broadcasts_in_series_per_step():
    """ZeroRedundancyOptimizer's per-parameter broadcasts are not coalesced: each
    takes its own time, one after another, after the optimizer."""
    par = Parallelism(world=2, gpus_per_node=2, zero=1)
    comm = [dp_op("b1", 100), dp_op("p", 1000, coll="broadcast", count=3, phase="step"),
            dp_op("q", 500, coll="broadcast", count=2, phase="step")]
    t = TableTimes({"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.5}, {"b1": 0.25, "p": 0.03, "q": 0.02})
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], comm), par, t)
    assert sb.step_time_s == pytest.approx(3 + 0.25 + 0.5 + 3 * 0.03 + 2 * 0.02)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(0.25 + 3 * 0.03 + 2 * 0.02)


def test_zero1_broadcasts_measured_as_one_burst_replace_their_series():
    """Where the step's broadcasts were measured issued together (run --plan's
    broadcast_burst), that one time replaces their sum; other step-phase DP
    collectives still add up."""
    par = Parallelism(world=2, gpus_per_node=2, zero=1)
    comm = [dp_op("b1", 100), replace(dp_op("p", 1000, coll="broadcast", count=3, phase="step"), root=0),
            replace(dp_op("q", 500, coll="broadcast", count=2, phase="step"), root=1)]
    asked = []

    class BurstTimes(TableTimes):
        def burst(self, pieces, group_size, num_nodes, dtype, bound):
            asked.append((tuple(pieces), group_size, num_nodes))
            return self._at(self.table_comm["burst"], bound)
    compute = {"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.5}
    t = BurstTimes(compute, {"b1": 0.25, "p": 0.03, "q": 0.02, "burst": (0.1, 0.2, 0.4)})
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], comm), par, t)
    assert asked[0] == (((0, 1000),) * 3 + ((1, 500),) * 2, 2, 1)
    assert sb.step_time_s == pytest.approx(3 + 0.25 + 0.5 + 0.2)
    assert sb.breakdown["dp_exposed_s"] == pytest.approx(0.25 + 0.2)
    assert (sb.step_time_low_s, sb.step_time_high_s) == pytest.approx((3.85, 4.15))
    # not measured as a burst: the series, as before
    t = BurstTimes(compute, {"b1": 0.25, "p": 0.03, "q": 0.02, "burst": None})
    sb = predict.predict(workload(par, layer_ops(1) + [adam()], comm), par, t)
    assert sb.step_time_s == pytest.approx(3 + 0.25 + 0.5 + 3 * 0.03 + 2 * 0.02)


def test_spec_predictions_over_a_grid_of_plans():
    """Every valid plan of a grid (GPT and Llama with GQA; tp, pp, ZeRO, SP,
    interleave, recompute) predicts on a spec: positive parts summing to the step,
    the band around it, throughput consistent with the step."""
    import itertools

    from commbench import models, plan, system
    from commbench.commmodel import CommModel
    spec = system.load("dgx-h100")
    times = predict.Times(CommModel.from_system(spec), spec=spec)
    done = 0
    for name, tp, pp, zero, sp, v, rc in itertools.product(
            ("gpt3-1.3b", "llama3-8b"), (1, 8), (1, 4), (0, 1, 3), (False, True), (1, 2), ("none", "full")):
        try:
            par = Parallelism(world=64, gpus_per_node=8, tp=tp, pp=pp, zero=zero, sp=sp, interleave=v,
                              recompute=rc, global_batch=8 * 64 // (tp * pp))
            w = plan.build(models.get(name), par)
        except ValueError:
            continue
        sb = predict.predict(w, par, times)
        parts = sum(x for k, x in sb.breakdown.items() if k != "hidden_comm_s")
        assert parts == pytest.approx(sb.step_time_s, rel=1e-9)
        assert min(sb.breakdown.values()) >= 0
        assert sb.step_time_low_s <= sb.step_time_s <= sb.step_time_high_s
        assert sb.samples_per_s == pytest.approx(par.global_batch / sb.step_time_s)
        if pp > 1 and par.num_microbatches:
            assert sb.breakdown["bubble_s"] > 0
        done += 1
    assert done > 40


def test_gathers_listed_unit_by_unit_are_prefetched_like_folded_ones():
    # two units' forward gathers of 0.5 over a forward of 4 (units at 0-2 and 2-4): only the
    # first is exposed whether the plan folds them into one op of 2 calls or lists them
    par = Parallelism(world=2, gpus_per_node=2, zero=3)
    t = {"layer fwd": 4.0, "layer bwd": 8.0, "adam": 0.0}
    folded = [dp_op("g", 100, coll="all_gather", count=2, phase="fwd")]
    listed = [dp_op("g1", 100, coll="all_gather", phase="fwd"), dp_op("g2", 100, coll="all_gather", phase="fwd")]
    for ops in (folded, listed):
        sb = predict.predict(workload(par, layer_ops(1) + [adam()], ops), par,
                             TableTimes(t, {"g": 0.5, "g1": 0.5, "g2": 0.5}))
        assert sb.step_time_s == pytest.approx(12.5) and sb.breakdown["dp_exposed_s"] == pytest.approx(0.5)


def test_reductions_that_overlap_nothing_run_after_the_last_backward():
    # FSDP under pipelining defers its reduce-scatters to the end of the step (overlap
    # "none"): 4 calls of 1 after the last backward ends at 6 (m = 2: 1 + 2 per micro-batch)
    par = Parallelism(world=2, gpus_per_node=2, global_batch=4)
    rs = CommOp("reduce_scatter", "dp", 2, 1, 100, 4, "bwd", overlap="none", label="rs", stage=0)
    sb = predict.predict(workload(par, layer_ops(2) + [adam()], [rs]), par,
                         TableTimes({"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.0}, {"rs": 1.0}))
    assert sb.step_time_s == pytest.approx(10.0) and sb.breakdown["dp_exposed_s"] == pytest.approx(4.0)
    assert sb.breakdown["hidden_comm_s"] == pytest.approx(0.0)


@pytest.mark.parametrize("strategy,coll,held", [("ddp", "all_reduce", True), ("zero1", "all_reduce", True),
                                                ("zero2", "reduce_scatter", False)])
def test_ddp_buckets_hold_the_last_backward_under_pipelining(strategy, coll, held):
    """pp 2, dp 2, m 2, f 1, b 2, no p2p. Unheld 1F1B: r1 B1 5..7, r0 B1 7..9.
    Stage 1's buckets (3:1 bytes) are ready at 6.5 and 7: 'first' (0.5) runs
    6.5..7, hidden; 'last' (3) runs 7..10. Under torch pipelining DDP's finalize
    holds stage 1's last backward until 10, so stage 0's B1 runs 10..12 and its
    bucket (1.5) ends at 13.5: the step. Without the hold (a reduce-scatter,
    ZeRO-2 style) stage 0 ends at 9 + 1.5 = 10.5, stage 1 at 10: the step is 10.5."""
    par = Parallelism(world=4, gpus_per_node=4, pp=2, global_batch=4)
    comm = [replace(dp_op("s0", 100, coll), strategy=strategy),
            replace(dp_op("first", 300, coll, stage=1), strategy=strategy),
            replace(dp_op("last", 100, coll, stage=1), strategy=strategy)]
    w = workload(par, layer_ops(2) + [adam(0), adam(1)], comm)
    sb = predict.predict(w, par, TableTimes({"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.0},
                                            {"s0": 1.5, "first": 0.5, "last": 3.0}))
    s0, s1 = sb.stages
    assert s1["end_s"] == pytest.approx(10.0) and s1["hidden_comm_s"] == pytest.approx(0.5)
    if held:
        assert sb.step_time_s == pytest.approx(13.5) and sb.critical_stage == 0
        # stage 0: compute 6, fill/drain bubble 9 - 6 = 3, DP 1.5 of its own + 3 of stage 1's hold
        assert sb.breakdown["dp_exposed_s"] == pytest.approx(4.5)
    else:
        assert sb.step_time_s == pytest.approx(10.5)
        assert sb.breakdown["dp_exposed_s"] == pytest.approx(1.5)
    assert sb.breakdown["bubble_s"] == pytest.approx(3.0) and sb.breakdown["compute_s"] == pytest.approx(6.0)
    assert sum(v for k, v in sb.breakdown.items() if k != "hidden_comm_s") == pytest.approx(sb.step_time_s)


def test_ddp_hold_goes_to_the_chunk_whose_last_backward_readies_the_bucket():
    """Interleaved, pp 2 x v 2, m 2, dp 2: each stage's one DDP bucket is ready
    at the end of its rank's last backward in time, chunk r's (chunk r + pp
    finishes before it), and nothing covers it: it holds chunk r by its whole
    time (1 on stage 0, 2 on stage 1). The step is the schedule's with those
    holds, chunks of half a stage (f 0.5, b 1)."""
    from commbench import schedule
    par = Parallelism(world=4, gpus_per_node=4, pp=2, global_batch=4, schedule="interleaved", interleave=2)
    comm = [replace(dp_op("s0", 100), strategy="ddp"), replace(dp_op("s1", 100, stage=1), strategy="ddp")]
    times = TableTimes({"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.0}, {"s0": 1.0, "s1": 2.0})
    sb = predict.predict(workload(par, layer_ops(2) + [adam(0), adam(1)], comm), par, times)
    bare = predict.predict(workload(par, layer_ops(2) + [adam(0), adam(1)], []), par, times)
    kw = dict(schedule="interleaved", interleave=2)
    assert bare.step_time_s == pytest.approx(schedule.simulate_pipeline(2, 2, 0.5, 1.0, **kw).makespan_s)
    want = schedule.simulate_pipeline(2, 2, 0.5, 1.0, hold_s=[1.0, 2.0, 0.0, 0.0], **kw)
    assert sb.step_time_s == pytest.approx(want.makespan_s)
    assert [st["end_s"] for st in sb.stages] == pytest.approx(want.last_bwd_end_s)
    # holds on the other chunk of each rank (r + pp) end the stages elsewhere
    other = schedule.simulate_pipeline(2, 2, 0.5, 1.0, hold_s=[0.0, 0.0, 1.0, 2.0], **kw)
    assert other.last_bwd_end_s != pytest.approx(want.last_bwd_end_s)


def test_mean_breakdown_of_rounds():
    """validate --rounds: the mean of two predictions, by hand: every time
    averaged, the parts still summing to the step, throughputs at the mean
    step, the latest stage critical, the notes once each."""
    from commbench.predict import StepBreakdown, mean_breakdown

    def sb(step, compute, bubble, ends, notes):
        return StepBreakdown(step_time_s=step, samples_per_s=8 / step, tokens_per_s=8 * 64 / step,
                             tflops_per_gpu=1e-3 / step, mfu=2e-3 / step,
                             breakdown={"compute_s": compute, "bubble_s": bubble}, step_time_low_s=step - 1,
                             step_time_high_s=step + 2, critical_stage=max(range(2), key=lambda i: ends[i]),
                             stages=[{"stage": i, "end_s": e} for i, e in enumerate(ends)], notes=notes)
    a, b = sb(10.0, 7.0, 3.0, [10.0, 9.0], ["x"]), sb(14.0, 8.0, 6.0, [11.0, 14.0], ["x", "y"])
    m = mean_breakdown([a, b])
    assert m.step_time_s == 12.0 and m.breakdown == {"compute_s": 7.5, "bubble_s": 4.5}
    assert sum(m.breakdown.values()) == m.step_time_s
    assert (m.step_time_low_s, m.step_time_high_s) == (11.0, 14.0)
    assert m.samples_per_s == pytest.approx(8 / 12) and m.tokens_per_s == pytest.approx(8 * 64 / 12)
    assert m.tflops_per_gpu == pytest.approx(1e-3 / 12) and m.mfu == pytest.approx(2e-3 / 12)
    assert m.stages == [{"stage": 0, "end_s": 10.5}, {"stage": 1, "end_s": 11.5}] and m.critical_stage == 1
    assert m.notes == ["x", "y"]
    assert mean_breakdown([a]) is a


def test_median_breakdown_of_rounds():
    """validate --rounds: the middle round by predicted step (an odd count),
    the mean of the middle two (an even count); every round's notes kept."""
    from commbench.predict import StepBreakdown, mean_breakdown, median_breakdown

    def sb(step, notes=()):
        return StepBreakdown(step_time_s=step, samples_per_s=8 / step, tokens_per_s=8 * 64 / step,
                             tflops_per_gpu=1e-3 / step, mfu=None, breakdown={"compute_s": step},
                             step_time_low_s=step - 1, step_time_high_s=step + 1, critical_stage=0,
                             stages=[{"stage": 0, "end_s": step}], notes=list(notes))
    slow, a, b, c = sb(48.0, ["slow spell"]), sb(26.0), sb(24.0), sb(27.0, ["z"])
    m = median_breakdown([a, b, slow])
    assert m.step_time_s == 26.0 and m.breakdown == {"compute_s": 26.0} and m.notes == ["slow spell"]
    assert (m.step_time_low_s, m.step_time_high_s) == (25.0, 27.0) and m.samples_per_s == 8 / 26.0
    m = median_breakdown([slow, a, b, c])
    assert m.step_time_s == 26.5 and m.stages == mean_breakdown([a, c]).stages and m.notes == ["slow spell", "z"]
    assert median_breakdown([a, b]).step_time_s == 25.0
    assert median_breakdown([a]).step_time_s == 26.0
