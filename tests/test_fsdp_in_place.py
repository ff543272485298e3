"""ZeRO-2/3 timed in place: which plans get the op, how the predictor puts a
measured micro-batch under FSDP (compute, FSDP's work and its collectives) in
place of the stage's compute, framework cost and FSDP collectives
(hand-computed), and real timings over the plan's dp group on gloo ranks,
skipped where the job is not the plan's world."""
import pytest

from commbench import models, predict
from commbench.compute import ops as compute_ops
from commbench.parallel import Parallelism
from commbench.workload import CommOp, ComputeOp
from conftest import compute_measurements
from test_framework_overhead import MeasuredTable, framework_op
from test_predict import adam, layer_ops, workload

TINY = models.get("tiny-gpt")


def _ops(**kw):
    return [o for o in compute_ops.fsdp_stage_ops(TINY, Parallelism(**kw)) if o.scope == "dp_in_place"]


def test_ops_for_torch_zero2_and_zero3_alone():
    (op,) = _ops(world=2, zero=3, global_batch=8)
    p = dict(op.params)
    assert (op.impl, op.phase, op.count, op.stage) == ("fsdp_microbatch", "fwd+bwd", 4, 0)
    assert (p["wrapper"], p["world"], p["dp"], p["tp"], p["pp"]) == ("fsdp_reshard", 2, 2, 1, 1)
    assert dict(_ops(world=2, zero=2, global_batch=8)[0].params)["wrapper"] == "fsdp"
    assert op in compute_ops.compute_ops(TINY, Parallelism(world=2, zero=3, global_batch=8))
    # DDP and ZeRO-1, DeepSpeed, one rank, a pipeline, tensor parallelism: none
    for kw in (dict(world=2, zero=0), dict(world=2, zero=1), dict(world=2, zero=2, zero_flavour="deepspeed"),
               dict(world=1, zero=3), dict(world=4, pp=2, zero=1), dict(world=4, gpus_per_node=4, tp=2, zero=3)):
        assert _ops(global_batch=8, **kw) == [], kw


def in_place_op(count):
    return ComputeOp("in place", "other", count=count, phase="fwd+bwd", impl="fsdp_microbatch", stage=0,
                     scope="dp_in_place", params=(("wrapper", "fsdp_reshard"),))


def test_measured_micro_batch_replaces_compute_framework_and_fsdp_collectives():
    """m = 2: forward 10, backward 20; FSDP's blocking gathers (2 each way) and
    reduce-scatter (3) per micro-batch; the framework's micro-batch 4 more than
    bare and its optimizer 0.5 more than Adam (1). Timed in place a micro-batch
    takes 45: the step is 2 x 45 + the optimizer 1 + 0.5, nothing of FSDP's
    collectives on top; unmeasured, the collectives and framework as before."""
    par = Parallelism(world=2, gpus_per_node=2, zero=3, global_batch=4)
    comm = [CommOp("all_gather", "dp", 2, 1, 100, 2, "fwd", overlap="fwd", host_blocking=True, label="ag fwd"),
            CommOp("all_gather", "dp", 2, 1, 100, 2, "bwd", overlap="bwd", host_blocking=True, label="ag bwd"),
            CommOp("reduce_scatter", "dp", 2, 1, 100, 2, "bwd", overlap="bwd", host_blocking=True, label="rs")]
    fw = [framework_op("wrapped", "dp_microbatch", "fsdp_reshard", 2),
          framework_op("bare", "dp_microbatch", "none", 2),
          framework_op("fopt", "dp_optimizer", "fsdp", 1, "step"), framework_op("aopt", "dp_optimizer", "none", 1,
                                                                              "step")]
    table = {"layer fwd": 10.0, "layer bwd": 20.0, "adam": 1.0, "wrapped": 34.0, "bare": 30.0, "fopt": 1.5,
             "aopt": 1.0, "in place": 45.0}
    comm_t = {"ag fwd": 2.0, "ag bwd": 2.0, "rs": 3.0}
    w = workload(par, layer_ops(2) + [adam()] + fw + [in_place_op(2)], comm)
    times = MeasuredTable(table, comm_t)
    times.host_runs_ahead = False
    sb = predict.predict(w, par, times)
    assert sb.step_time_s == pytest.approx(2 * 45 + 1 + 0.5)
    assert sb.breakdown["compute_s"] == pytest.approx(90) and sb.breakdown["dp_exposed_s"] == 0
    assert any("under FSDP timed in place" in n for n in sb.notes)
    # not measured: compute + framework (4 a micro-batch) + every blocking collective in series
    del table["in place"]
    times = MeasuredTable(table, comm_t)
    times.host_runs_ahead = False
    sb = predict.predict(w, par, times)
    assert sb.step_time_s == pytest.approx(2 * (30 + 4 + 2 + 2 + 3) + 1 + 0.5)


def test_timed_over_the_plans_dp_group_on_two_gloo_ranks(tmp_path):
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "2", "--zero", "3", "--global-batch", "2",
                              iters=3)
    (m,) = [m for m in ms if m.case.op == "fsdp_microbatch"]
    assert m.status == "ok" and len(m.samples_s) == 3 and len(m.rank_samples_s) == 2
    # with its collectives over a real group it takes longer than the bare micro-batch
    (bare,) = [x for x in ms if x.case.op == "dp_microbatch" and x.case.params["wrapper"] == "none"]
    assert m.stats["time_p50_s"] > bare.stats["time_p50_s"]


def test_skipped_where_the_job_is_not_the_plans_world(tmp_path):
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "1", "--world", "2", "--zero", "2",
                              "--global-batch", "2", iters=2)
    (m,) = [m for m in ms if m.case.op == "fsdp_microbatch"]
    assert m.status == "skipped" and "needs the plan's 2 ranks to form its dp groups of 2" in m.skip_reason
