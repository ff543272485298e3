"""The data-parallel framework's own cost: which ops a plan times (bare and
wrapped, with the counts a step runs them), how the predictor adds wrapped -
bare to the stage (hand-computed), that unmeasured framework ops change
nothing, and real timings of the wrappers on two gloo ranks."""
import pytest

from commbench import models, predict
from commbench.compute import ops as compute_ops
from commbench.parallel import Parallelism
from commbench.workload import ComputeOp
from conftest import compute_measurements
from test_predict import TableTimes, adam, dp_op, layer_ops, workload

TINY = models.get("tiny-gpt")


def _by_wrapper(ops, impl):
    return {dict(o.params)["wrapper"]: o.count for o in ops if o.impl == impl}


@pytest.mark.parametrize("zero,micro,optimizer", [
    (0, {"ddp": 1, "ddp_no_sync": 3, "none": 4}, {}),
    (1, {"ddp": 1, "ddp_no_sync": 3, "none": 4}, {"zero1": 1, "none": 1}),
    (2, {"fsdp": 4, "none": 4}, {"fsdp": 1, "none": 1}),
    (3, {"fsdp_reshard": 4, "none": 4}, {"fsdp": 1, "none": 1}),
])
def test_framework_ops_per_zero_stage(zero, micro, optimizer):
    # dp 2, global batch 8, micro-batch 1: 4 micro-batches per step
    ops = compute_ops.framework_ops(TINY, Parallelism(world=2, zero=zero, global_batch=8))
    assert _by_wrapper(ops, "dp_microbatch") == micro
    assert _by_wrapper(ops, "dp_optimizer") == optimizer
    assert all(o.scope == "framework" and o.stage == 0 for o in ops)
    assert ops and all(o in compute_ops.compute_ops(TINY, Parallelism(world=2, zero=zero, global_batch=8))
                       for o in ops)


def test_framework_ops_one_micro_batch_and_per_stage():
    # one micro-batch: DDP always synchronises, no no_sync op
    assert _by_wrapper(compute_ops.framework_ops(TINY, Parallelism(world=2)), "dp_microbatch") == \
        {"ddp": 1, "none": 1}
    # no data parallelism, no wrapper
    assert compute_ops.framework_ops(TINY, Parallelism(world=2, gpus_per_node=2, tp=2)) == []
    # a pipeline: each stage its own module (first holds the embedding, last the head)
    ops = compute_ops.framework_ops(TINY, Parallelism(world=4, pp=2, global_batch=8))
    for stage, first, last in ((0, True, False), (1, False, True)):
        p = dict(next(o for o in ops if o.stage == stage).params)
        assert (p["first"], p["last"], p["layers"]) == (first, last, TINY.num_layers // 2)


def framework_op(name, impl, wrapper, count, phase="fwd+bwd", stage=0):
    return ComputeOp(name, "other", count=count, phase=phase, impl=impl, stage=stage, scope="framework",
                     params=(("wrapper", wrapper),))


class MeasuredTable(TableTimes):
    def measured(self, op):
        return op.name in self.table_compute


def test_overhead_added_to_micro_batches_and_optimizer():
    # m = 2: forward 10, backward 20 per micro-batch; DDP's synchronised
    # micro-batch 40, the no_sync one 33, bare 30 each: (40 + 33) - 2 x 30 = 13
    # per step, 6.5 per micro-batch, split 1:2 over forward and backward;
    # ZeroRedundancyOptimizer 4 against bare Adam 1.5: 2.5 more on the optimizer
    par = Parallelism(world=2, gpus_per_node=2, zero=1, global_batch=4)
    fw = [framework_op("sync", "dp_microbatch", "ddp", 1), framework_op("nosync", "dp_microbatch", "ddp_no_sync", 1),
          framework_op("bare", "dp_microbatch", "none", 2),
          framework_op("zopt", "dp_optimizer", "zero1", 1, "step"), framework_op("aopt", "dp_optimizer", "none", 1,
                                                                                 "step")]
    table = {"layer fwd": 10.0, "layer bwd": 20.0, "adam": 1.0, "sync": 40.0, "nosync": 33.0, "bare": 30.0,
             "zopt": 4.0, "aopt": 1.5}
    w = workload(par, layer_ops(2) + [adam()] + fw, [dp_op("b1", 100)])
    sb = predict.predict(w, par, MeasuredTable(table, {"b1": 5.0}))
    # the bucket (5) is issued in the last micro-batch's backward, after all of it: exposed
    assert sb.breakdown["compute_s"] == pytest.approx(2 * (30 + 6.5))
    assert sb.breakdown["optimizer_s"] == pytest.approx(1.0 + 2.5)
    assert sb.step_time_s == pytest.approx(2 * 36.5 + 5 + 3.5)
    assert any("framework" in n for n in sb.notes)
    # the same framework ops unmeasured (a SystemSpec, or no compute results for
    # them) leave the prediction as without them
    bare = predict.predict(workload(par, layer_ops(2) + [adam()], [dp_op("b1", 100)]), par,
                           TableTimes(table, {"b1": 5.0}))
    unmeasured = {k: v for k, v in table.items() if k in ("layer fwd", "layer bwd", "adam")}
    sb2 = predict.predict(w, par, MeasuredTable(unmeasured, {"b1": 5.0}))
    assert sb2.step_time_s == pytest.approx(bare.step_time_s) == pytest.approx(2 * 30 + 5 + 1)


def test_band_takes_the_difference_at_opposite_bounds():
    # wrapped 40 (38-42), bare 30 (25-35): overhead 10 at mid, 38 - 35 = 3 at
    # low, 42 - 25 = 17 at high; m = 1, forward 10 and backward 20 (exact)
    par = Parallelism(world=2, gpus_per_node=2, zero=3)
    fw = [framework_op("wrapped", "dp_microbatch", "fsdp_reshard", 1), framework_op("bare", "dp_microbatch", "none", 1)]
    w = workload(par, layer_ops(1) + [adam()] + fw, [])
    sb = predict.predict(w, par, MeasuredTable({"layer fwd": 10.0, "layer bwd": 20.0, "adam": 1.0,
                                                "wrapped": (38.0, 40.0, 42.0), "bare": (25.0, 30.0, 35.0)}, {}))
    assert (sb.step_time_low_s, sb.step_time_s, sb.step_time_high_s) == pytest.approx((34.0, 41.0, 48.0))


def test_wrapped_faster_than_bare_counts_as_no_overhead():
    par = Parallelism(world=2, gpus_per_node=2, zero=3)
    fw = [framework_op("wrapped", "dp_microbatch", "fsdp_reshard", 1), framework_op("bare", "dp_microbatch", "none", 1)]
    w = workload(par, layer_ops(1) + [adam()] + fw, [])
    sb = predict.predict(w, par, MeasuredTable({"layer fwd": 10.0, "layer bwd": 20.0, "adam": 1.0, "wrapped": 29.0,
                                                "bare": 30.0}, {}))
    assert sb.step_time_s == pytest.approx(31.0)


@pytest.mark.parametrize("flags,wrappers", [
    (["--zero", "1", "--global-batch", "4"], {("dp_microbatch", "ddp"), ("dp_microbatch", "ddp_no_sync"),
                                              ("dp_microbatch", "none"), ("dp_optimizer", "zero1"),
                                              ("dp_optimizer", "none")}),
    (["--zero", "3", "--global-batch", "4"], {("dp_microbatch", "fsdp_reshard"), ("dp_microbatch", "none"),
                                              ("dp_optimizer", "fsdp"), ("dp_optimizer", "none")}),
])
def test_wrappers_timed_on_two_gloo_ranks(tmp_path, flags, wrappers):
    timed = {(m.case.op, m.case.params["wrapper"]): m
             for m in compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "2", *flags, iters=5)
             if m.case.op in ("dp_microbatch", "dp_optimizer")}
    assert set(timed) == wrappers
    assert all(m.status == "ok" and len(m.samples_s) == 5 and len(m.rank_time_p50_s) == 2 for m in timed.values())
    if "--zero" in flags and flags[flags.index("--zero") + 1] == "3":
        # FSDP2's hooks, flat-buffer copies and DTensor dispatch cost more than
        # the bare stage's forward and backward (2-3x for tiny-gpt on this CPU)
        assert timed[("dp_microbatch", "fsdp_reshard")].stats["time_p50_s"] > \
            timed[("dp_microbatch", "none")].stats["time_p50_s"]
        # two ranks: the FSDP micro-batch ran over a fake group of dp = 2, not alone
        assert timed[("dp_microbatch", "fsdp_reshard")].case.params["dp"] == 2
        assert not any("fake group" in w for m in timed.values() for w in m.warnings)


def test_fsdp_micro_batch_alone_where_the_job_cannot_form_the_dp_group(tmp_path):
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "1", "--world", "2", "--zero", "2",
                              "--global-batch", "4")
    (fsdp,) = [m for m in ms if m.case.op == "dp_microbatch" and m.case.params["wrapper"] == "fsdp"]
    assert fsdp.status == "ok" and any("not a fake group of dp = 2" in w for w in fsdp.warnings)


def test_fsdp_micro_batch_of_the_other_resharding_stands_in():
    """ZeRO-2 priced from a ZeRO-3 job's measurements: its FSDP micro-batch
    (no reshard) was not timed, the resharding one was and stands in, so the
    two stages are priced alike (noted); with neither, no framework cost."""
    par = Parallelism(world=2, gpus_per_node=2, zero=2, global_batch=2)
    fw = [framework_op("mb", "dp_microbatch", "fsdp", 2), framework_op("bare", "dp_microbatch", "none", 2),
          framework_op("opt", "dp_optimizer", "fsdp", 1, "step"),
          framework_op("aopt", "dp_optimizer", "none", 1, "step")]
    stand_in = compute_ops.framework_stand_in(fw[0])
    assert dict(stand_in.params)["wrapper"] == "fsdp_reshard" and compute_ops.framework_stand_in(fw[1]) is None

    class ByWrapper(TableTimes):
        """Framework ops looked up by name and wrapper; the resharding one only measured."""
        def _key(self, op):
            return f"{op.name}/{dict(op.params).get('wrapper')}" if op.scope == "framework" else op.name

        def measured(self, op):
            return self._key(op) in self.table_compute

        def compute(self, op, bound):
            return self._at(self.table_compute[self._key(op)], bound)
    table = {"layer fwd": 10.0, "layer bwd": 20.0, "adam": 1.0, "mb/fsdp_reshard": 36.0, "bare/none": 30.0,
             "opt/fsdp": 2.0, "aopt/none": 1.5}
    w = workload(par, layer_ops(2) + [adam()] + fw, [])
    sb = predict.predict(w, par, ByWrapper(table, {}))
    # (36 - 30) per micro-batch on top of its 30 of compute; the optimizer 1 + (2 - 1.5)
    assert sb.breakdown["compute_s"] == pytest.approx(2 * 36)
    assert sb.breakdown["optimizer_s"] == pytest.approx(1.5)
    assert any("stands in for fsdp" in n for n in sb.notes)
    del table["mb/fsdp_reshard"]
    sb = predict.predict(w, par, ByWrapper(table, {}))
    assert sb.breakdown["compute_s"] == pytest.approx(2 * 30) and sb.breakdown["optimizer_s"] == pytest.approx(1.0)
