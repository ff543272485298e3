"""A pipeline's stages timed inside the pipeline: which plans get the ops,
how the predictor takes them for the stages' forward and backward
(hand-computed 1F1B), and real timings of torch pipelining on two gloo ranks
(and on four, under DDP), skipped where the job is not the plan's world."""
import json

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
    return compute_ops.pipeline_stage_ops(TINY, Parallelism(**kw))


def test_ops_for_each_virtual_stage_of_a_pure_pipeline():
    par = Parallelism(world=2, gpus_per_node=2, pp=2, global_batch=4, interleave=2, schedule="interleaved")
    every = _ops(**vars(par))
    ops = [o for o in every if o.scope == "pp_stage"]
    assert [(dict(o.params)["chunk"], o.stage, o.impl) for o in ops] == [
        (k, k % 2, f"pipeline_{ph}") for k in range(4) for ph in ("fwd", "bwd")]
    assert all(o.count == 4 for o in ops)
    # and each pp rank's optimizer step, once a step: the Adam of its stage
    opt = [o for o in every if o.scope == "pp_optimizer"]
    adams = compute_ops.optimizer_ops(TINY, par)
    p2p = [o for o in every if o.scope == "pp_p2p"]
    assert len(every) == len(ops) + len(opt) + len(p2p) == 8 + 2 + 1
    # the transfers: one tier (both ranks on one node), the boundary's message
    assert [(dict(o.params)["tier"], o.impl, o.nbytes) for o in p2p] == [
        ("intra", "pipeline_p2p", TINY.seq * TINY.hidden * 2)]
    # stages on nodes of one GPU each: every boundary crosses nodes
    assert [dict(o.params)["tier"] for o in _ops(world=2, gpus_per_node=1, pp=2, global_batch=4)
            if o.scope == "pp_p2p"] == ["inter"]
    assert [(dict(o.params)["rank_stage"], o.stage, o.impl, o.phase, o.count, o.m) for o in opt] == [
        (s, s, "pipeline_optimizer", "step", 1, adams[s].m) for s in (0, 1)]
    # chunk 0 holds the embedding, the last chunk the head: more FLOPs than a middle chunk
    fwd = [o.flops for o in ops if o.phase == "fwd"]
    assert fwd[1] == fwd[2] < fwd[0] and fwd[1] < fwd[3]
    assert set(every) <= set(compute_ops.compute_ops(TINY, par))
    # no pipeline, ZeRO-2/3 or DeepSpeed's ZeRO-1 beside it, recompute: none
    for kw in (dict(world=2), dict(world=4, pp=2, zero=2), dict(world=4, pp=2, zero=3),
               dict(world=4, pp=2, zero=1, zero_flavour="deepspeed"),
               dict(world=2, pp=2, recompute="full"), dict(world=4, gpus_per_node=4, pp=2, tp=2, recompute="full")):
        assert _ops(global_batch=8, **kw) == [], kw


def test_ops_for_a_pipeline_under_zero1():
    """pp+dp with torch's ZeRO-1 (DDP with ZeroRedundancyOptimizer): the chunks,
    the plan naming its ZeRO stage so the pipeline that times them steps as
    training does; no optimizer op (its step holds the broadcasts, placed on
    their own). ZeRO-1 on one dp rank is plain Adam: the optimizer op too."""
    par = Parallelism(world=4, pp=2, zero=1, global_batch=8)
    ops = _ops(**vars(par))
    assert sorted((o.scope, o.stage) for o in ops) == [("pp_p2p", 0)] + [("pp_stage", s) for s in (0, 0, 1, 1)]
    assert json.loads(dict(ops[0].params)["plan"])["zero"] == 1
    ddp = json.loads(dict(_ops(world=4, pp=2, global_batch=8)[0].params)["plan"])
    assert "zero" not in ddp
    one = _ops(world=2, pp=2, zero=1, global_batch=4)
    assert "zero" not in json.loads(dict(one[0].params)["plan"])
    assert sum(o.scope == "pp_optimizer" for o in one) == 2


def test_ops_for_a_pipeline_with_tensor_parallelism():
    """TP x PP: the same chunks and optimizer steps, the plan naming its tp and
    sp (the pipeline that times them applies the plan's TP); a pure pipeline's
    plan does not name them (its results files keep their keys)."""
    par = Parallelism(world=4, gpus_per_node=4, pp=2, tp=2, sp=True, global_batch=4)
    ops = _ops(**vars(par))
    assert sorted((o.scope, o.stage) for o in ops) == sorted(
        [("pp_stage", s) for s in (0, 1) for _ in ("fwd", "bwd")] + [("pp_optimizer", 0), ("pp_optimizer", 1)] +
        [("pp_p2p", 0)])
    plan = json.loads(dict(ops[0].params)["plan"])
    assert (plan["tp"], plan["sp"], plan["world"]) == (2, True, 4)
    pure = json.loads(dict(_ops(world=2, pp=2, global_batch=4)[0].params)["plan"])
    assert "tp" not in pure and "sp" not in pure


def test_ops_for_a_pipeline_under_ddp():
    """pp+dp with DDP: the same chunks and optimizer steps, the plan naming its
    DDP (the dp ranks and their buckets); one micro-batch a step (every
    backward the one that reduces): none."""
    par = Parallelism(world=4, pp=2, global_batch=8, bucket_mb=10.0)
    ops = _ops(**vars(par))
    assert sorted((o.scope, o.impl) for o in ops) == sorted(
        [("pp_stage", f"pipeline_{ph}") for _ in (0, 1) for ph in ("fwd", "bwd")] +
        [("pp_optimizer", "pipeline_optimizer")] * 2 + [("pp_p2p", "pipeline_p2p")])
    plan = json.loads(dict(ops[0].params)["plan"])
    assert (plan["world"], plan["pp"], plan["bucket_mb"], plan["grad_dtype"]) == (4, 2, 10.0, par.grad_dtype)
    assert all(o.count == par.num_microbatches == 4 for o in ops if o.scope == "pp_stage")
    assert _ops(world=4, pp=2, global_batch=2) == []


def chunk(name, k, phase, m):
    return ComputeOp(name, "other", count=m, phase=phase, impl=f"pipeline_{phase}", stage=k, scope="pp_stage",
                     params=(("chunk", k),))


def test_timed_chunks_replace_the_stages_forward_and_backward():
    """pp = 2, m = 4: layers timed in a loop 1 / 2 per micro-batch on each stage;
    inside the pipeline stage 0 took 1.5 / 2.5 and stage 1 1.2 / 3. 1F1B on two
    stages: the step is m x (the slower stage's f + b) + the other's f + b, the
    slower being stage 1 (4.2 against 4.0): 4 x 4.2 + 4.0 = 20.8, + Adam 0.5."""
    m = 4
    par = Parallelism(world=2, gpus_per_node=2, pp=2, global_batch=m)
    pipe = [chunk("s0 f", 0, "fwd", m), chunk("s0 b", 0, "bwd", m), chunk("s1 f", 1, "fwd", m),
            chunk("s1 b", 1, "bwd", m)]
    table = {"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.5, "s0 f": 1.5, "s0 b": 2.5, "s1 f": 1.2, "s1 b": 3.0}
    w = workload(par, layer_ops(m) + [adam(0), adam(1)] + pipe, [])
    sb = predict.predict(w, par, MeasuredTable(table, {}))
    assert sb.step_time_s == pytest.approx(m * 4.2 + 4.0 + 0.5)
    assert any("timed inside the plan's pipeline (1500.000 ms fwd, 2500.000 ms bwd)" in n for n in sb.notes)
    # stage 1's chunks not all measured: its loop timings (1 / 2), stage 0's chunks
    # (1.5 / 2.5). By hand, stage 0: F0 0-1.5, F1 -3, B0 4.5-7 (stage 1's B0 ends at
    # 4.5), F2 -8.5, B1 -11, F3 -12.5, B2 -15, B3 15.5-18 (stage 1's B3 13.5-15.5)
    del table["s1 b"]
    sb = predict.predict(w, par, MeasuredTable(table, {}))
    assert sb.step_time_s == pytest.approx(18.0 + 0.5)
    # none measured: the loop timings alone, (m + 1) x 3
    for k in ("s0 f", "s0 b", "s1 f"):
        del table[k]
    sb = predict.predict(w, par, MeasuredTable(table, {}))
    assert sb.step_time_s == pytest.approx((m + 1) * 3.0 + 0.5)


def test_chunks_timed_under_ddp_carry_its_micro_batch_work():
    """pp = 2 under DDP (dp = 2), m = 2: layers timed in a loop 1 / 2 per
    micro-batch; DDP's own work on each stage timed on one rank: (6 + 5) - 2 x
    3 = 5 a step, 2.5 a micro-batch. Loop timings: that work added, each
    stage 5.5 a micro-batch, 1F1B (m + 1) x 5.5 + Adam 0.5 = 17. Chunks timed
    inside the pipeline under DDP (1.5 / 2.5) hold that work already:
    (m + 1) x 4 + 0.5 = 12.5, nothing added."""
    m = 2
    par = Parallelism(world=4, gpus_per_node=4, pp=2, global_batch=4)
    assert par.dp == 2 and par.num_microbatches == m
    fw = [op for s in (0, 1) for op in (framework_op(f"sync{s}", "dp_microbatch", "ddp", 1, stage=s),
                                         framework_op(f"nosync{s}", "dp_microbatch", "ddp_no_sync", 1, stage=s),
                                         framework_op(f"bare{s}", "dp_microbatch", "none", m, stage=s))]
    pipe = [chunk(f"s{k} {ph}", k, ph, m) for k in (0, 1) for ph in ("fwd", "bwd")]
    table = {"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.5, **{f"{w}{s}": v for s in (0, 1) for w, v in
                                                                  (("sync", 6.0), ("nosync", 5.0), ("bare", 3.0))}}
    w = workload(par, layer_ops(m) + [adam(0), adam(1)] + fw + pipe, [])
    loop = predict.predict(w, par, MeasuredTable(table, {}))
    assert loop.step_time_s == pytest.approx((m + 1) * 5.5 + 0.5)
    table.update({"s0 fwd": 1.5, "s0 bwd": 2.5, "s1 fwd": 1.5, "s1 bwd": 2.5})
    sb = predict.predict(w, par, MeasuredTable(table, {}))
    assert sb.step_time_s == pytest.approx((m + 1) * 4.0 + 0.5)
    assert any("adds 0.000 ms to its micro-batches" in n for n in sb.notes)


def test_chunks_timed_with_tensor_parallelism_hold_its_collectives():
    """pp = 2 x tp = 2, m = 4: layers timed in a loop 1 / 2 per micro-batch on
    each stage, TP's all-reduces back to back 0.25 a forward and a backward
    each (two a pass: 0.5 / 0.5 per micro-batch), a micro-batch with its TP in
    place 10. Inside the pipeline each stage's chunks took 1.5 / 2.5: they hold
    the compute and the TP collectives, so TP is 0.5 / 0.5 a micro-batch, the
    collectives' back-to-back timings and the TP micro-batch out. 1F1B on two
    balanced stages: (m + 1) x 4 + Adam 0.5."""
    m = 4
    par = Parallelism(world=4, gpus_per_node=4, pp=2, tp=2, global_batch=m)
    tp_comm = [CommOp("all_reduce", "tp", 2, 1, 64, 2 * m, ph, label=f"tp {ph}", stage=s)
               for s in (0, 1) for ph in ("fwd", "bwd")]
    in_place = [ComputeOp(f"tp mb {s}", "other", count=m, phase="fwd+bwd", impl="tp_microbatch", stage=s,
                          scope="tp_stage", params=(("tp", 2),)) for s in (0, 1)]
    pipe = [chunk(f"s{k} {ph}", k, ph, m) for k in (0, 1) for ph in ("fwd", "bwd")]
    table = {"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.5, "tp mb 0": 10.0, "tp mb 1": 10.0,
             **{f"s{k} {ph}": t for k in (0, 1) for ph, t in (("fwd", 1.5), ("bwd", 2.5))}}
    comm = {"tp fwd": 0.25, "tp bwd": 0.25}
    w = workload(par, layer_ops(m) + [adam(0), adam(1)] + in_place + pipe, tp_comm)
    sb = predict.predict(w, par, MeasuredTable(table, comm))
    assert sb.step_time_s == pytest.approx((m + 1) * 4.0 + 0.5)
    assert sb.breakdown["tp_exposed_s"] == pytest.approx(m * 1.0)
    assert sb.breakdown["compute_s"] == pytest.approx(m * 3.0)
    assert any("(1500.000 ms fwd, 2500.000 ms bwd, its TP collectives in them)" in n for n in sb.notes)
    assert not any("tensor parallelism timed in place" in n for n in sb.notes)
    # chunks faster than the loop's compute (noise): compute capped at them, no TP time
    table.update({"s0 fwd": 0.8, "s1 fwd": 0.8})
    sb = predict.predict(w, par, MeasuredTable(table, comm))
    assert sb.step_time_s == pytest.approx((m + 1) * 3.3 + 0.5)
    assert sb.breakdown["tp_exposed_s"] == pytest.approx(m * 0.5)
    # the chunks not measured: the TP micro-batch timed in place, (m + 1) x 10
    for k in ("s0 fwd", "s0 bwd", "s1 fwd", "s1 bwd"):
        del table[k]
    sb = predict.predict(w, par, MeasuredTable(table, comm))
    assert sb.step_time_s == pytest.approx((m + 1) * 10.0 + 0.5)
    assert any("tensor parallelism timed in place (10000.000 ms)" in n for n in sb.notes)


def pipeline_adam(name, stage):
    return ComputeOp(name, "optimizer", m=10, count=1, phase="step", impl="pipeline_optimizer", stage=stage,
                     scope="pp_optimizer", params=(("rank_stage", stage),))


def test_optimizer_timed_in_the_pipeline_replaces_adam_in_a_loop():
    """Stage 0's Adam timed inside the pipeline (0.8) stands for its loop
    timing (0.5); stage 1's, not measured, keeps its own (0.5). 1F1B on two
    balanced stages (1 / 2 per micro-batch), m = 4: stage 0's last backward
    ends at (m + 1) x 3 = 15, stage 1's at 13 (11-13, before stage 0's
    13-15): 15 + 0.8 against 13 + 0.5."""
    m = 4
    par = Parallelism(world=2, gpus_per_node=2, pp=2, global_batch=m)
    table = {"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.5, "opt0": 0.8}
    w = workload(par, layer_ops(m) + [adam(0), adam(1), pipeline_adam("opt0", 0), pipeline_adam("opt1", 1)], [])
    sb = predict.predict(w, par, MeasuredTable(table, {}))
    assert sb.step_time_s == pytest.approx(15.8)
    assert [st["optimizer_s"] for st in sb.stages] == pytest.approx([0.8, 0.5])
    assert any("stage 0: its optimizer step timed inside the plan's pipeline (800.000 ms)" in n for n in sb.notes)
    # stage 1's slower in place (3.5): it ends last, 13 + 3.5
    table["opt1"] = 3.5
    sb = predict.predict(w, par, MeasuredTable(table, {}))
    assert sb.step_time_s == pytest.approx(16.5) and sb.critical_stage == 1
    # neither measured: the loop timings
    sb = predict.predict(w, par, MeasuredTable({k: table[k] for k in ("layer fwd", "layer bwd", "adam")}, {}))
    assert sb.step_time_s == pytest.approx(15.5)


def p2p_op(name, tier="intra"):
    return ComputeOp(name, "other", count=1, phase="step", impl="pipeline_p2p", stage=0, scope="pp_p2p",
                     params=(("tier", tier),))


def test_transfers_timed_in_the_pipeline_replace_the_sweeps_p2p():
    """pp = 2, m = 1, F 1 / B 2 a stage: the sweep's send_recv (0.5) puts the
    step at 1 + 0.5 + 3 + 0.5 + 2 = 7 (test_predict's hand-made 1F1B); the
    transfers timed inside the pipeline (0.1) replace it: 1 + 0.1 + 3 + 0.1 + 2
    = 6.2. Unmeasured, or of the other tier only, the sweep's stands."""
    par = Parallelism(world=2, gpus_per_node=2, pp=2, global_batch=1)
    comm = [CommOp("send_recv", "pp", 2, 1, 10, 1, "fwd", label="s", stage=0, peer=1, direction="send")]
    table = {"layer fwd": 1.0, "layer bwd": 2.0, "adam": 0.0, "p2p": 0.1}
    sweep = {"send_recv": 0.5}
    w = workload(par, layer_ops(1) + [adam(0), adam(1), p2p_op("p2p")], comm)
    sb = predict.predict(w, par, MeasuredTable(table, sweep))
    assert sb.step_time_s == pytest.approx(6.2)
    assert sb.breakdown["pp_exposed_s"] == pytest.approx(0.2)
    del table["p2p"]
    assert predict.predict(w, par, MeasuredTable(table, sweep)).step_time_s == pytest.approx(7.0)
    table["p2p"] = 0.1
    inter = workload(par, layer_ops(1) + [adam(0), adam(1), p2p_op("p2p", "inter")], comm)
    assert predict.predict(inter, par, MeasuredTable(table, sweep)).step_time_s == pytest.approx(7.0)


def test_transfer_times_meet_the_nth_send_with_the_nth_receive():
    """Records of two ranks on one clock (ms): rank 0 sends twice to 1 and
    receives once from it; a transfer's time runs from the later of its two
    posts' ends to the receive's wait's end, for the waits that blocked.
    Rank 1's first receive (posted 0-1, waited 1-4; the send posted 2-2.2)
    took 4 - 2.2 = 1.8; its second (posted 5-6, the send 3-3.1, waited
    6-6.5) 6.5 - 6 = 0.5; rank 0's receive (posted 7-7.5, the send 8-8.1,
    waited 7.5-9) 0.9; a wait that did not block is left out, as is a
    receive whose wait never came, and a transfer done before its send's
    post returned counts 0."""
    from commbench.compute import pipeline_stage
    ms = 1e-3
    rank0 = [["send", 1, 2 * ms, 2.2 * ms, 2.3 * ms, 2.4 * ms], ["send", 1, 3 * ms, 3.1 * ms, None, None],
             ["recv", 1, 7 * ms, 7.5 * ms, 7.5 * ms, 9 * ms]]
    rank1 = [["recv", 0, 0.0, 1 * ms, 1 * ms, 4 * ms], ["recv", 0, 5 * ms, 6 * ms, 6 * ms, 6.5 * ms],
             ["send", 0, 8 * ms, 8.1 * ms, 8.1 * ms, 8.2 * ms]]
    got = pipeline_stage.transfer_times([rank0, rank1])
    assert sorted(got) == ["intra"]
    assert sorted(got["intra"]) == pytest.approx([0.5 * ms, 0.9 * ms, 1.8 * ms])
    # tiers by pair; a wait under BLOCKED_S left out
    rank1[1][5] = 6 * ms + pipeline_stage.BLOCKED_S / 2
    got = pipeline_stage.transfer_times([rank0, rank1], lambda a, b: f"{a}->{b}")
    assert got == {"0->1": [pytest.approx(1.8 * ms)], "1->0": [pytest.approx(0.9 * ms)]}
    # rank 1's send post returning at 9.5, after rank 0's wait ended (9): 0
    rank1[2][3] = 9.5 * ms
    assert pipeline_stage.transfer_times([rank0, rank1])["intra"] == [pytest.approx(1.8 * ms), 0.0]


def test_timed_inside_torch_pipelining_on_two_gloo_ranks(tmp_path):
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "2", "--pp", "2", "--global-batch", "4",
                              iters=3)
    mine = {(m.case.params["chunk"], m.case.op): m for m in ms if m.case.op in ("pipeline_fwd", "pipeline_bwd")}
    assert set(mine) == {(k, f"pipeline_{ph}") for k in (0, 1) for ph in ("fwd", "bwd")}
    for (k, _), m in mine.items():
        assert m.status == "ok"
        # at least 3 whole steps of 4 micro-batches, each call timed on the rank holding the chunk alone
        assert len(m.samples_s) >= 12 and len(m.samples_s) % 4 == 0
        assert [len(s) > 0 for s in m.rank_samples_s] == [r == k for r in (0, 1)]
        assert m.samples_s == m.rank_samples_s[k] and m.slowest_rank == k
    # a backward does about twice a forward's work
    for k in (0, 1):
        assert mine[(k, "pipeline_bwd")].stats["time_p50_s"] > mine[(k, "pipeline_fwd")].stats["time_p50_s"]
    # each rank's optimizer step, once a step, as many steps as the chunks saw
    opt = {m.case.params["rank_stage"]: m for m in ms if m.case.op == "pipeline_optimizer"}
    assert set(opt) == {0, 1}
    for s, m in opt.items():
        assert m.status == "ok" and len(m.samples_s) == len(mine[(s, "pipeline_fwd")].samples_s) // 4
        assert [len(x) > 0 for x in m.rank_samples_s] == [r == s for r in (0, 1)]
        assert m.samples_s == m.rank_samples_s[s] and min(m.samples_s) > 0
    # the transfers between the two stages, as the pipeline met them: one tier (one machine)
    (p2p,) = [m for m in ms if m.case.op == "pipeline_p2p"]
    assert p2p.status == "ok" and p2p.case.params["tier"] == "intra"
    assert len(p2p.samples_s) >= 2 and min(p2p.samples_s) >= 0
    # at most 2 transfers a micro-batch (an activation, a gradient) for every step the chunks saw
    assert len(p2p.samples_s) <= 2 * len(mine[(0, "pipeline_fwd")].samples_s)


def test_skipped_where_the_job_is_not_the_plans_world(tmp_path):
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "1", "--world", "2", "--pp", "2",
                              "--global-batch", "4", iters=2)
    mine = [m for m in ms if m.case.op.startswith("pipeline_")]
    assert len(mine) == 4 + 2 + 1 and all(m.status == "skipped" for m in mine)
    assert "needs the plan's 2 ranks to run its pipeline, the job has 1" in mine[0].skip_reason


def test_timed_inside_pipelining_with_ddp_on_four_gloo_ranks(tmp_path):
    """pp 2 x dp 2 under DDP, 4 micro-batches a step: chunk k on ranks 2k and
    2k + 1 (the mesh is pp, dp); a forward sampled 4 times a step, a backward
    3 times (its last, DDP's reduction, left out); a call's sample is the
    slower replica's."""
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "4", "--pp", "2", "--global-batch", "8",
                              iters=3)
    mine = {(m.case.params["chunk"], m.case.op): m for m in ms if m.case.op in ("pipeline_fwd", "pipeline_bwd")}
    assert set(mine) == {(k, f"pipeline_{ph}") for k in (0, 1) for ph in ("fwd", "bwd")}
    for k in (0, 1):
        fwd, bwd = mine[(k, "pipeline_fwd")], mine[(k, "pipeline_bwd")]
        assert fwd.status == bwd.status == "ok"
        steps = len(fwd.samples_s) // 4
        assert steps >= 3 and len(fwd.samples_s) == 4 * steps and len(bwd.samples_s) == 3 * steps
        for m in (fwd, bwd):
            holders = [r for r, s in enumerate(m.rank_samples_s) if s]
            assert holders == [2 * k, 2 * k + 1]
            assert m.samples_s == pytest.approx([max(a, b) for a, b in zip(*(m.rank_samples_s[r] for r in holders))])
    opt = {m.case.params["rank_stage"]: m for m in ms if m.case.op == "pipeline_optimizer"}
    assert set(opt) == {0, 1}
    for s, m in opt.items():
        assert m.status == "ok" and len(m.samples_s) == len(mine[(s, "pipeline_fwd")].samples_s) // 4
        assert [r for r, x in enumerate(m.rank_samples_s) if x] == [2 * s, 2 * s + 1]


def test_the_steps_own_work_goes_to_its_chunks_and_optimizer(monkeypatch):
    """instrument starts the clock at the step's start and stops it at the
    schedule's return: the work before the first wait for a peer (clearing
    the gradients, splitting the batch) goes to the first chunk that runs
    after it, the work after the last wait (merging the outputs) to the
    chunks of that last segment, in proportion to their own durations; the
    waits and the tied all-reduce go to none; the optimizer's sample runs to
    the step's end (the loss's mean after it). A fake clock, advanced by
    hand (ms), and fake stage, schedule and optimizer objects."""
    from types import SimpleNamespace

    from commbench.compute import pipeline_stage
    now = [0.0]
    monkeypatch.setattr(pipeline_stage.time, "perf_counter", lambda: now[0])

    def work(ms):
        def call(*args, **kwargs):
            now[0] += ms
        return call

    stage = SimpleNamespace(stage_index=0, forward_one_chunk=work(3.0), backward_one_chunk=work(4.0))
    schedules = SimpleNamespace(_wait_batch_p2p=lambda works: work(5.0)(), _batch_p2p=lambda ops: [])
    opt = SimpleNamespace(step=work(1.5))

    def step_microbatches():
        schedules._wait_batch_p2p([])        # the first micro-batch's input
        stage.forward_one_chunk(0)
        work(0.5)()                        # posting its send
        schedules._wait_batch_p2p([])        # the gradient back
        stage.backward_one_chunk(0)

    def sched_step():
        work(1.0)()                        # split the batch
        step_microbatches()
        work(2.0)()                        # merge the outputs

    sched = SimpleNamespace(step=sched_step)
    barriers = []

    def step():
        work(0.5)()                        # zero_grad
        sched.step()
        work(6.0)()                        # the tied all-reduce
        opt.step()
        work(0.25)()                       # the losses' mean

    timed_step, clock, opt_s, log, undo = pipeline_stage.instrument(
        step, [stage], sched, opt, schedules, lambda: None, lambda: barriers.append(now[0]), with_reduce=False)
    timed_step()
    timed_step()
    assert len(barriers) == 2
    # before the first wait: 0.5 + 1.0; the forward and its send's post; after the last wait: 2.0
    assert clock.samples[(0, "fwd")] == pytest.approx([1.5 + 3.0 + 0.5] * 2)
    assert clock.samples[(0, "bwd")] == pytest.approx([4.0 + 2.0] * 2)
    assert opt_s == pytest.approx([1.5 + 0.25] * 2)
    undo()
    now[0] = 0.0
    schedules._wait_batch_p2p([])
    assert now[0] == 5.0 and clock.samples[(0, "fwd")] == pytest.approx([5.0] * 2)


def test_timed_inside_pipelining_with_tensor_parallelism_on_four_gloo_ranks(tmp_path):
    """tp 2 x pp 2 (DTensor TP in torch pipelining), 4 micro-batches a step:
    chunk k on ranks 2k and 2k + 1 (the mesh is pp, dp, tp), every call of a
    chunk sampled on both TP ranks, the slower's time its sample."""
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "4", "--tp", "2", "--pp", "2",
                              "--global-batch", "4", iters=3)
    mine = {(m.case.params["chunk"], m.case.op): m for m in ms if m.case.op in ("pipeline_fwd", "pipeline_bwd")}
    assert set(mine) == {(k, f"pipeline_{ph}") for k in (0, 1) for ph in ("fwd", "bwd")}
    for (k, _), m in mine.items():
        assert m.status == "ok", m.skip_reason
        assert len(m.samples_s) >= 12 and len(m.samples_s) % 4 == 0
        holders = [r for r, s in enumerate(m.rank_samples_s) if s]
        assert holders == [2 * k, 2 * k + 1]
        assert m.samples_s == pytest.approx([max(a, b) for a, b in zip(*(m.rank_samples_s[r] for r in holders))])
    for k in (0, 1):
        assert mine[(k, "pipeline_bwd")].stats["time_p50_s"] > mine[(k, "pipeline_fwd")].stats["time_p50_s"]


def test_timed_inside_pipelining_under_zero1_on_four_gloo_ranks(tmp_path):
    """pp 2 x dp 2 with ZeRO-1, 4 micro-batches a step: the chunks timed as
    under DDP (a backward's last of a step left out), no optimizer samples."""
    ms = compute_measurements(tmp_path, "--model", "tiny-gpt", "--nprocs", "4", "--pp", "2", "--zero", "1",
                              "--global-batch", "8", iters=3)
    mine = {(m.case.params["chunk"], m.case.op): m for m in ms if m.case.op in ("pipeline_fwd", "pipeline_bwd")}
    assert set(mine) == {(k, f"pipeline_{ph}") for k in (0, 1) for ph in ("fwd", "bwd")}
    for k in (0, 1):
        fwd, bwd = mine[(k, "pipeline_fwd")], mine[(k, "pipeline_bwd")]
        assert fwd.status == bwd.status == "ok", fwd.skip_reason or bwd.skip_reason
        steps = len(fwd.samples_s) // 4
        assert steps >= 3 and len(bwd.samples_s) == 3 * steps
        assert [r for r, x in enumerate(fwd.rank_samples_s) if x] == [2 * k, 2 * k + 1]
