"""Full recompute timed inside the whole-stage ops, as training runs it: the
ops a plan with `--recompute full` gets (the stage modules and the FSDP
micro-batch carry it, their FLOPs the layers' forwards again), the module
they build (each layer's forward runs again in the backward), and how the
predictor takes such a stage (hand-computed): its recomputed forwards are
inside it, not on top."""
from dataclasses import replace

import pytest
import torch

from commbench import models, predict
from commbench.compute import modules
from commbench.compute import ops as compute_ops
from commbench.parallel import Parallelism
from commbench.workload import ComputeOp
from test_framework_overhead import MeasuredTable
from test_predict import adam, layer_ops, workload

TINY = models.get("tiny-gpt")


def _by_name(ops):
    return {o.name: o for o in ops}


@pytest.mark.parametrize("zero", [0, 3])
def test_stage_ops_carry_full_recompute_and_its_flops(zero):
    plain = Parallelism(world=2, gpus_per_node=2, zero=zero, global_batch=8)
    full = replace(plain, recompute="full")
    p_ops, f_ops = _by_name(compute_ops.compute_ops(TINY, plain)), _by_name(compute_ops.compute_ops(TINY, full))
    layer_fwd = p_ops["layer fwd (module)"].flops      # one layer's forward, its kernels' FLOPs
    for name in ("stage 0 fwd (module)", "stage 0 bwd (module)"):
        assert dict(f_ops[name].params)["recompute"] == "full"
        assert "recompute" not in dict(p_ops[name].params)
    assert f_ops["stage 0 fwd (module)"].flops == pytest.approx(p_ops["stage 0 fwd (module)"].flops)
    assert f_ops["stage 0 bwd (module)"].flops == pytest.approx(p_ops["stage 0 bwd (module)"].flops
                                                                + TINY.num_layers * layer_fwd)
    if zero == 3:
        (fp,) = [o for o in p_ops.values() if o.scope == "dp_in_place"]
        (ff,) = [o for o in f_ops.values() if o.scope == "dp_in_place"]
        assert dict(ff.params)["recompute"] == "full" and "recompute" not in dict(fp.params)
        assert ff.flops == pytest.approx(fp.flops + TINY.num_layers * layer_fwd)


def test_selective_recompute_leaves_the_stage_as_without():
    plain = Parallelism(world=2, gpus_per_node=2, global_batch=8)
    sel = _by_name(compute_ops.compute_ops(TINY, replace(plain, recompute="selective")))
    base = _by_name(compute_ops.compute_ops(TINY, plain))
    assert sel["stage 0 bwd (module)"] == base["stage 0 bwd (module)"]
    assert any(o.scope == "recompute_module" for o in sel.values())


def _calls_per_layer(op):
    """How often the first layer's attention runs in one forward and backward
    of the module the op times."""
    module, inputs = modules.build(op, "cpu", torch.float32)
    calls = []
    module.layers[0].attn.register_forward_hook(lambda *_: calls.append(1))
    out = module(*inputs)
    out.backward()
    return len(calls)


def test_the_stage_module_runs_each_layer_again_in_its_backward():
    plain = Parallelism(world=1, gpus_per_node=1, global_batch=1)
    for recompute, calls in (("none", 1), ("full", 2)):
        ops = _by_name(compute_ops.compute_ops(TINY, replace(plain, recompute=recompute)))
        assert _calls_per_layer(ops["stage 0 bwd (module)"]) == calls


def _stage(name, phase, recompute):
    params = (("recompute", "full"),) if recompute else ()
    return ComputeOp(name, "other", count=2, phase=phase, stage=0, scope="stage_module", params=params)


REDO = ComputeOp("layer fwd (module, recompute)", "other", count=2, phase="bwd", stage=-1, scope="recompute_module")


def test_a_stage_timed_with_its_recompute_takes_none_on_top():
    # m = 2; stage 4 forward, 10 backward per micro-batch; the recomputed
    # forwards timed as modules: 3 per micro-batch; Adam 1
    par = Parallelism(world=1, gpus_per_node=1, global_batch=2, recompute="full")
    table = {"stage fwd": 4.0, "stage bwd": 10.0, "layer fwd (module, recompute)": 3.0, "adam": 1.0,
             "layer fwd": 2.0, "layer bwd": 4.0}
    inside = workload(par, layer_ops(2) + [_stage("stage fwd", "fwd", True), _stage("stage bwd", "bwd", True),
                                          REDO, adam()], [])
    assert predict.predict(inside, par, MeasuredTable(table, {})).step_time_s == pytest.approx(2 * 14 + 1)
    # a stage timed without it (selective recompute): the recomputed part comes on top
    outside = workload(par, layer_ops(2) + [_stage("stage fwd", "fwd", False), _stage("stage bwd", "bwd", False),
                                           REDO, adam()], [])
    assert predict.predict(outside, par, MeasuredTable(table, {})).step_time_s == pytest.approx(2 * 17 + 1)


def test_tp_timed_without_recompute_over_a_stage_timed_with_it():
    """A TP micro-batch timed only without recompute (16 per micro-batch) over
    a stage timed with it (4 + 10, of which 3 recomputed): TP = 16 - (14 - 3)
    = 5, and the micro-batch 14 + 5 = 16 + 3."""
    par = Parallelism(world=2, gpus_per_node=2, tp=2, global_batch=2, recompute="full")
    place = ComputeOp("in place", "other", count=2, phase="fwd+bwd", impl="tp_microbatch", stage=0,
                      scope="tp_stage", params=(("recompute", "full"), ("tp", 2)))

    class NoneOnly(MeasuredTable):
        def measured(self, op):
            return super().measured(op) and not (op.scope == "tp_stage" and dict(op.params)["recompute"] == "full")
    table = {"stage fwd": 4.0, "stage bwd": 10.0, "layer fwd (module, recompute)": 3.0, "adam": 1.0,
             "in place": 16.0}
    w = workload(par, [_stage("stage fwd", "fwd", True), _stage("stage bwd", "bwd", True), REDO, adam(), place], [])
    sb = predict.predict(w, par, NoneOnly(table, {}))
    assert sb.breakdown["compute_s"] == pytest.approx(2 * 14)
    assert sb.breakdown["tp_exposed_s"] == pytest.approx(2 * 5)
    assert sb.step_time_s == pytest.approx(2 * 19 + 1)
