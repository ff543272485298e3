"""Megatron-style tensor parallelism in plain torch (commbench/megatron_tp.py,
what `validate` runs for TP by default): it computes what the unsharded model
computes, and its recorded collectives are exactly strategies/tp.py's 'megatron'
flavour (fused QKV and gate/up: one input all-reduce each), per phase, in kind,
count and bytes."""
from collections import Counter

import torch
import torch.distributed as dist

from commbench import models, torch_model
from commbench.parallel import Parallelism
from commbench.strategies import tp
from traffic import MARKER, record

B, S = 2, 32


def megatron_step(rank, world, name):
    """One recorded micro-batch: forward, backward, optimizer step, each under a
    marker; returns the callable to record and checks the loss first."""
    from commbench import megatron_tp
    from torch.autograd.profiler import record_function
    spec = models.get(name)
    group = dist.new_group(list(range(world)))
    model = megatron_tp.Transformer(spec, rank, world, group, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, spec.vocab, (B, S), generator=gen)
    y = torch.randint(0, spec.vocab, (B, S), generator=gen)
    full = torch_model.build(spec, 0)
    want = torch.nn.functional.cross_entropy(full(x).reshape(-1, spec.vocab), y.reshape(-1))
    got = model(x, y)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (float(got), float(want))
    opt.zero_grad()

    def run():
        with record_function(f"{MARKER} fwd"):
            loss = model(x, y)
        with record_function(f"{MARKER} bwd"):
            loss.backward()
        with record_function(f"{MARKER} step"):
            opt.step()
    return run


def recorded_per_phase(events) -> Counter:
    """(phase, collective, bytes) -> count, from the gloo all-reduces (their
    tensor's shape) between markers; nothing else may be issued."""
    out, phase = Counter(), None
    for name, shapes in events:
        if name.startswith(MARKER):
            phase = name.split()[-1]
        elif name.startswith("gloo:"):
            assert name == "gloo:all_reduce", name
            numel = 1
            for d in shapes[0]:
                numel *= d
            out[(phase, "all_reduce", numel * 4)] += 1
        elif name.startswith("c10d::"):
            assert name == "c10d::allreduce_", name
    return out


def test_megatron_tp_matches_the_megatron_flavour():
    for name in ("tiny-gpt", "tiny-llama"):
        events = record(megatron_step, 2, name)
        par = Parallelism(world=2, gpus_per_node=2, tp=2, micro_batch=B, seq=S, dtype="fp32")
        want = Counter()
        for o in tp.comm_ops(models.get(name), par):
            want[(o.phase, o.collective, o.nbytes)] += o.count
        for rank_events in events:
            assert recorded_per_phase(rank_events) == want, name
