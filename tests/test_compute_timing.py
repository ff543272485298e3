"""How compute ops are timed as a training step runs them: a backward after a
fresh, untimed forward each call, a forward followed by its untimed backward
(compute.Staged through runner.PerCallTimer),
its parameter gradients accumulated like a micro-batch's; the Adam op after an
untimed overwrite of the last-level cache, as a step's optimizer follows its
backward; and one Adam for training and its op (training.adam_kwargs,
adam_groups)."""
import time

import torch

from commbench import models, training
from commbench.compute import Staged, modules
from commbench.compute.ops import compute_ops
from commbench.compute.runner import PerCallTimer
from commbench.parallel import Parallelism


class HostBackend:
    def time_iterations(self, op, iters):
        from commbench import timing
        return timing.host_timer(op, iters)


def test_staged_setup_and_teardown_are_not_timed():
    calls = []

    def step(name, seconds):
        def run():
            calls.append(name)
            time.sleep(seconds)
        return run
    timer = PerCallTimer(HostBackend(), torch, "cpu", flush=False)
    samples = timer.time_iterations(Staged(step("before", 0.02), step("timed", 0.002), step("after", 0.02)), 3)
    assert calls == ["before", "timed", "after"] * 3
    assert len(samples) == 3 and all(0.002 <= s < 0.015 for s in samples)
    calls.clear()
    samples = timer.time_iterations(Staged(None, step("timed", 0.002), after=step("after", 0.02)), 2)
    assert calls == ["timed", "after"] * 2 and all(0.002 <= s < 0.015 for s in samples)
    # an op that is not staged is the backend's, timed back to back
    assert len(timer.time_iterations(lambda: None, 5)) == 5 and timer.flush_bytes() == 0
    assert PerCallTimer(HostBackend(), torch, "cpu", flush=True).flush_bytes() == 2 * (64 << 20)


def _stage_op(impl):
    par = Parallelism(world=1, gpus_per_node=1, global_batch=1)
    return next(op for op in compute_ops(models.get("tiny-gpt"), par) if op.impl == impl)


def test_module_backward_accumulates_like_a_micro_batch():
    call = modules.prepare(_stage_op("stage_bwd"), "cpu", torch.float32)
    assert isinstance(call, Staged)
    call()      # forward + backward: every parameter holds one micro-batch's gradient
    params = _module_params(call)
    first = [p.grad.clone() for p in params]
    assert all(g.abs().sum() > 0 for g in first)
    call()      # the same input again: the gradients are now twice as large
    for g, p in zip(first, params):
        assert torch.allclose(p.grad, 2 * g, rtol=1e-4, atol=1e-6)


def _module_params(call):
    """The stage module's parameters, through the forward closure of the Staged call."""
    return list(_closure_module(call.before).parameters())


def test_module_forward_is_timed_before_its_backward():
    """A forward is one module call; its backward runs after it, untimed, so no
    two forwards run back to back and each leaves its gradients as a step does."""
    call = modules.prepare(_stage_op("stage_fwd"), "cpu", torch.float32)
    assert isinstance(call, Staged) and call.before is None
    params = list(_closure_module(call.timed).parameters())
    start = [p.grad.clone() for p in params]      # prepare's own forward and backward
    assert all(g.abs().sum() > 0 for g in start)
    call.timed()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, start))   # the timed part: the forward only
    call.after()
    for g, p in zip(start, params):
        assert torch.allclose(p.grad, 2 * g, rtol=1e-4, atol=1e-6)
    call()          # whole: forward and backward again
    assert all(torch.allclose(p.grad, 3 * g, rtol=1e-4, atol=1e-6) for g, p in zip(start, params))


def _closure_module(fn):
    (module,) = {c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, torch.nn.Module)}
    return module


def test_adam_op_is_timed_after_evicting_the_cache():
    from commbench.compute import optimizer
    call = optimizer.prepare(_stage_op("adam"), "cpu", torch.float32)
    assert isinstance(call, Staged) and call.after is None
    (flush,) = [c.cell_contents for c in call.before.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    assert flush.numel() * flush.element_size() == 2 * (64 << 20)      # twice the CPU's assumed last-level cache
    params = [p for g in call.timed.__self__.param_groups for p in g["params"]]
    assert sum(p.numel() for p in params) == _stage_op("adam").m
    start = [p.detach().clone() for p in params]
    call.before()
    assert flush.eq(1.0).all() and all(torch.equal(p, s) for p, s in zip(params, start))   # untimed: no update
    call.timed()
    assert all(not torch.equal(p, s) for p, s in zip(params, start))                       # the timed step updates


def test_training_and_the_adam_op_share_one_adam():
    assert training.adam_kwargs("cpu") == {"lr": training.LR, "foreach": True}
    assert training.adam_kwargs("cuda") == {"lr": training.LR, "fused": True}
    plain = [torch.nn.Parameter(torch.zeros(3))]
    assert training.adam_groups(plain) == [{"params": plain}]


def test_adam_groups_keep_dtensors_apart(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
        p = torch.nn.Parameter(torch.ones(4))
        groups = training.adam_groups([d, p])
        assert [g["params"] for g in groups] == [[p], [d]] and isinstance(groups[1]["params"][0], DTensor)
        opt = torch.optim.Adam(groups, **training.adam_kwargs("cpu"))
        for q in (d, p):
            q.grad = torch.ones_like(q)
        opt.step()      # one foreach call would refuse the mix
        assert torch.allclose(p.detach(), torch.full((4,), 1 - training.LR))
        assert torch.allclose(d.detach().full_tensor(), torch.full((4,), 1 - training.LR))
    finally:
        dist.destroy_process_group()
