"""Tensor parallelism timed in place: which plans get the op (per stage, per
implementation), how the predictor puts a measured micro-batch with its TP in
place of compute + TP collectives (hand-computed), the slowest rank's own
median as its estimate, and real timings on gloo ranks: Megatron-style and
DTensor, and a job too small to form the group."""
import statistics

import pytest

from commbench import models, predict
from commbench.compute import ops as compute_ops
from commbench.parallel import Parallelism
from commbench.results import Case, Measurement
from commbench.workload import CommOp, ComputeOp
from conftest import compute_measurements
from test_framework_overhead import MeasuredTable
from test_predict import adam, layer_ops, workload

TINY = models.get("tiny-gpt")


def _tp_ops(par, flavour):
    return [o for o in compute_ops.compute_ops(TINY, par, flavour) if o.scope == "tp_stage"]


def test_ops_per_stage_and_implementation():
    # Megatron-style TP runs without a pipeline: one op, counted per micro-batch
    par = Parallelism(world=2, gpus_per_node=2, tp=2, global_batch=4)
    (op,) = _tp_ops(par, "megatron")
    p = dict(op.params)
    assert (op.impl, op.phase, op.count, op.stage) == ("tp_microbatch", "fwd+bwd", 4, 0)
    assert (p["tp"], p["flavour"], p["first"], p["last"], p["heads"]) == (2, "megatron", True, True, TINY.heads // 2)
    # no tensor parallelism: none
    assert _tp_ops(Parallelism(world=2, global_batch=4), "megatron") == []
    # a pipeline: Megatron-style TP cannot run it, DTensor times each stage
    pp = Parallelism(world=4, gpus_per_node=4, tp=2, pp=2, global_batch=4)
    assert _tp_ops(pp, "megatron") == []
    assert [o.stage for o in _tp_ops(pp, "dtensor")] == [0, 1]
    # sequence parallelism: DTensor only
    sp = Parallelism(world=2, gpus_per_node=2, tp=2, sp=True, global_batch=4)
    assert _tp_ops(sp, "megatron") == [] and len(_tp_ops(sp, "dtensor")) == 1


def tp_place_op(name, count, stage=0):
    return ComputeOp(name, "other", count=count, phase="fwd+bwd", impl="tp_microbatch", stage=stage,
                     scope="tp_stage", params=(("tp", 2),))


TP_COMM = [CommOp("all_reduce", "tp", 2, 1, 64, 2 * 2, "fwd", label="tp fwd"),
           CommOp("all_reduce", "tp", 2, 1, 64, 2 * 2, "bwd", label="tp bwd"),
           CommOp("all_reduce", "tp", 2, 1, 64, 1, "step", label="tp once")]


def test_measured_micro_batch_replaces_compute_and_tp_collectives():
    # m = 2, forward 3 and backward 6 per micro-batch; the collectives timed
    # back to back: 1 forward and 0.5 backward per micro-batch (split 2:1);
    # a micro-batch timed with its TP in place: 13.5, so TP = 13.5 - 9 = 4.5
    # per micro-batch, split 3 forward, 1.5 backward; the once-per-step
    # all-reduce (2) and Adam (1) as before
    par = Parallelism(world=2, gpus_per_node=2, tp=2, global_batch=2)
    w = workload(par, layer_ops(2) + [adam(), tp_place_op("in place", 2)], TP_COMM)
    comm = {"tp fwd": 0.5, "tp bwd": 0.25, "tp once": 2.0}
    sb = predict.predict(w, par, MeasuredTable({"layer fwd": 3.0, "layer bwd": 6.0, "adam": 1.0, "in place": 13.5},
                                               comm))
    assert sb.step_time_s == pytest.approx(2 * 13.5 + 2 + 1)
    assert sb.breakdown["tp_exposed_s"] == pytest.approx(2 * 4.5 + 2)
    assert sb.breakdown["compute_s"] == pytest.approx(18)
    assert any("in place" in n for n in sb.notes)
    # unmeasured (a SystemSpec, or a job that could not form the group): the collectives as before
    sb2 = predict.predict(w, par, MeasuredTable({"layer fwd": 3.0, "layer bwd": 6.0, "adam": 1.0}, comm))
    assert sb2.step_time_s == pytest.approx(2 * (4 + 6.5) + 2 + 1)
    # timed faster than the compute alone (noise): no TP time, never less than the compute
    sb3 = predict.predict(w, par, MeasuredTable({"layer fwd": 3.0, "layer bwd": 6.0, "adam": 1.0, "in place": 8.0},
                                                comm))
    assert sb3.step_time_s == pytest.approx(2 * 9 + 2 + 1)


def test_measured_without_recompute_stands_in_for_a_plan_with_it():
    """Only the plan without recompute was timed in place: a plan with full
    recompute is that micro-batch plus its recomputed forward (3 per
    micro-batch) and that forward's TP collectives (0.5), never less than
    without recompute. m = 2, forward 3, backward 6 + 3 recomputed; collectives
    per micro-batch 1 forward, 0.5 backward, 0.5 recomputed; in place 13.5 (TP 4.5)."""
    par = Parallelism(world=2, gpus_per_node=2, tp=2, global_batch=2, recompute="full")
    place = ComputeOp("in place", "other", count=2, phase="fwd+bwd", impl="tp_microbatch", stage=0,
                      scope="tp_stage", params=(("recompute", "full"), ("tp", 2)))
    redo = ComputeOp("layer fwd (recompute)", "gemm", count=2, phase="bwd", stage=-1)
    comm = TP_COMM + [CommOp("all_reduce", "tp", 2, 1, 64, 2 * 2, "bwd", label="tp fwd (recompute)")]
    times = {"tp fwd": 0.5, "tp bwd": 0.25, "tp fwd (recompute)": 0.25, "tp once": 2.0}

    class NoneOnly(MeasuredTable):
        def measured(self, op):
            return super().measured(op) and dict(op.params).get("recompute") != "full"
    table = {"layer fwd": 3.0, "layer bwd": 6.0, "layer fwd (recompute)": 3.0, "adam": 1.0, "in place": 13.5}
    w = workload(par, layer_ops(2) + [redo, adam(), place], comm)
    sb = predict.predict(w, par, NoneOnly(table, times))
    # per micro-batch: compute 3 + 9, TP (13.5 - 9) + 0.5; once per step: TP 2, Adam 1
    assert sb.breakdown["compute_s"] == pytest.approx(2 * 12)
    assert sb.breakdown["tp_exposed_s"] == pytest.approx(2 * 5 + 2)
    assert sb.step_time_s == pytest.approx(2 * 17 + 2 + 1)
    assert any("without recompute" in n for n in sb.notes)
    # the plan's own measurement, where there is one, is used as it is
    sb = predict.predict(w, par, MeasuredTable(dict(table, **{"in place": 20.0}), times))
    assert sb.step_time_s == pytest.approx(2 * 20 + 2 + 1)


def test_pipeline_stages_each_take_their_own():
    # 1F1B over 2 stages, m = 2: stage micro-batches 3 + 6 compute; stage 0
    # timed in place 12 (TP 3), stage 1 15 (TP 6); no tp collectives given
    par = Parallelism(world=4, gpus_per_node=4, tp=2, pp=2, global_batch=2)
    ops = layer_ops(4) + [adam(0), adam(1), tp_place_op("s0", 2, 0), tp_place_op("s1", 2, 1)]
    table = {"layer fwd": 1.5, "layer bwd": 3.0, "adam": 0.0, "s0": 12.0, "s1": 15.0}
    stages = predict.stage_times(ops, [], par, MeasuredTable(table, {}), "mid")
    assert [s.fwd_s + s.bwd_s for s in stages] == pytest.approx([9.0, 9.0])
    assert [s.tp_fwd_s + s.tp_bwd_s for s in stages] == pytest.approx([3.0, 6.0])
    # with no collectives to split by, TP is split as the compute is: 1:2
    assert stages[1].tp_fwd_s == pytest.approx(2.0)


def _measurement(samples, rank_p50):
    case = Case(kind="compute", op="tp_microbatch", backend="torch", device="cpu", dtype="float32", nbytes=0,
                group_size=1, num_nodes=1, axis="compute", in_place=False, concurrent_groups=4, params={"m": 1})
    from commbench import stats
    return Measurement(case=case, samples_s=samples, stats=stats.summarize(samples), rank_time_p50_s=rank_p50)


def test_slowest_ranks_own_mean_is_the_estimate():
    # every rank's own samples stored: the step sums a rank's own calls and
    # waits for the slowest rank, so the estimate is the slowest rank's own mean
    # (2.0), not the mean of the per-call maxima (3.0) nor any rank's median
    op = tp_place_op("in place", 2)
    m = _measurement([3.0, 3.0, 3.0, 3.0], [1.0, 1.5])
    m.rank_samples_s = [[1.0, 1.0, 3.0, 1.0], [1.5, 3.0, 1.5, 2.0]]
    times = predict.Times(comm_model=None, matched={op: m})
    assert times.compute(op, "mid") == pytest.approx(2.0)
    half = 1.96 * statistics.stdev([1.5, 3.0, 1.5, 2.0]) / 2
    assert times.compute(op, "low") == pytest.approx(2.0 - half)
    assert times.compute(op, "high") == pytest.approx(2.0 + half)
    assert times.slowest_rank(op, "high") == pytest.approx(2.0 + half)


def test_slowest_rank_median_is_the_estimate():
    # 4 ranks in 2 TP groups timed side by side: the maximum over the ranks of
    # every call (the samples) adds the groups' noise; the step waits for the
    # slowest group's own time
    op = tp_place_op("in place", 4)
    m = _measurement([0.050, 0.060, 0.055, 0.065, 0.070], [0.044, 0.046, 0.048, 0.047])
    times = predict.Times(comm_model=None, matched={op: m})
    mid = times.compute(op, "mid")
    assert times.slowest_rank(op, "mid") == pytest.approx(0.048)
    assert times.slowest_rank(op, "high") == pytest.approx(0.048 * times.compute(op, "high") / mid)
    # without per-rank medians: the op's own time
    m.rank_time_p50_s = []
    assert times.slowest_rank(op, "mid") == pytest.approx(mid)


def test_megatron_timed_on_two_gloo_ranks(tmp_path):
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "2", "--gpus-per-node", "2", "--tp", "2",
                              "--global-batch", "2", iters=4)
    (m,) = [m for m in ms if m.case.op == "tp_microbatch"]
    assert m.status == "ok" and len(m.samples_s) == 4 and len(m.rank_time_p50_s) == 2
    assert m.case.params["flavour"] == "megatron"
    # the stage with its collectives takes longer than its forward and backward alone
    fb = {m.case.op: m.stats["time_p50_s"] for m in ms if m.case.op in ("stage_fwd", "stage_bwd")}
    assert m.stats["time_p50_s"] > fb["stage_fwd"] + fb["stage_bwd"]


def _dtensor_worker(rank, world, port, queue):
    import os
    import traceback

    import torch
    import torch.distributed as dist
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from commbench.compute import tp_stage
        par = Parallelism(world=4, gpus_per_node=4, tp=2, pp=2, global_batch=2, dtype="fp32", seq=32)
        sp = Parallelism(world=4, gpus_per_node=4, tp=2, sp=True, global_batch=2, dtype="fp32", seq=32)
        ops = _tp_ops(par, "dtensor") + _tp_ops(sp, "dtensor")
        from commbench.compute import plan_groups
        # the groups as training's DeviceMesh makes them: the default group where one
        # group holds every rank (training's pure TP), new groups of the plan's ranks else
        groups = {"tp2": dist.get_process_group_ranks(tp_stage.tp_group(2)),
                  "tp4_is_world": tp_stage.tp_group(4) is dist.group.WORLD,
                  "strided": dist.get_process_group_ranks(plan_groups([(0, 2), (1, 3)]))}
        done = []
        for op in ops:           # every rank runs every stage's op, as the compute runner does
            call = tp_stage.prepare_microbatch(op, "cpu", torch.float32)
            call()
            done.append(op.stage)
        dist.destroy_process_group()
        queue.put((rank, (done, groups), None))
    except Exception:
        queue.put((rank, None, traceback.format_exc()))


def test_dtensor_stages_run_on_four_gloo_ranks():
    # tp 2 x pp 2 (a later stage takes an activation, the last the loss over
    # vocabulary-sharded logits) and tp 2 with sequence parallelism
    from traffic import _context, _free_port
    ctx = _context()
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_dtensor_worker, args=(r, 4, port, queue)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        got = [queue.get(timeout=240) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [err for _, _, err in got if err]
    assert not errors, errors[0]
    for rank, (done, groups), _ in got:
        assert done == [0, 1, 0]
        assert groups == {"tp2": [rank // 2 * 2, rank // 2 * 2 + 1], "tp4_is_world": True,
                          "strided": [rank % 2, rank % 2 + 2]}


def test_skipped_where_the_job_cannot_form_the_group(tmp_path):
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "1", "--world", "4", "--gpus-per-node", "4",
                              "--tp", "4", "--global-batch", "2", iters=2)
    (m,) = [m for m in ms if m.case.op == "tp_microbatch"]
    assert m.status == "skipped" and "multiple of tp = 4" in m.skip_reason


def test_host_memory_of_the_whole_model_build():
    # the op cuts its shard from the whole model built in fp32 on the host: 4 B
    # per parameter, checked against the rank's share of the host before set-up
    from commbench.compute import runner
    par = Parallelism(world=2, gpus_per_node=2, tp=2, global_batch=2)
    (op,) = _tp_ops(par, "megatron")
    assert runner.host_build_bytes(op) == 4 * TINY.num_params
    big = models.get("gpt3-175b")
    (op175,) = [o for o in compute_ops.tp_stage_ops(big, Parallelism(world=8, gpus_per_node=8, tp=8), "dtensor")]
    assert runner.host_build_bytes(op175) == 4 * big.num_params > 600e9
    assert all(runner.host_build_bytes(o) == 0 for o in compute_ops.compute_ops(TINY, par) if o.scope != "tp_stage")
