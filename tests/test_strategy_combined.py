"""Combined plans on 4 gloo ranks: the real torch composition of two strategies
issues exactly what commbench's plan composes from the single strategies.

TP+DP (tp 2 x dp 2, no SP, tiny-llama, fp32): a 2-D DeviceMesh (dp, tp) in
Megatron order (tp groups {0,1} {2,3}, dp groups {0,2} {1,3}); DTensor TP on the
tp sub-mesh exactly as tests/test_strategy_tp.py parallelizes, then
torch.distributed.tensor.parallel.ddp._pre_dp_module_transform and DDP over the
dp sub-mesh's group, once at torch's default bucket size (25 MB: one bucket
here) and once at bucket_mb 0.125 (4 buckets of the local shard), each model
in its own marker range of one recording. The recorded step (after two
warm-ups) must hold, per
phase, the dp CommOps of plan.comm_ops (strategies.ddp over the TP-local
shards) plus strategies.tp.comm_ops(flavour='dtensor'): the DDP bucket is told
apart from the TP all-reduces by its size (TP: activations b s h = 32 KiB and
b s cross-entropy vectors; DDP: gradient buckets of the local shard).

FINDING (TP+DP): DDP's buckets over DTensor-TP modules are NOT those of
strategies/ddp.py (reverse registration order) once there is more than one
bucket; the same parameters, total bytes and number of buckets, but other
boundaries. Why: _pre_dp_module_transform replaces each DTensor parameter by
its local tensor and re-wraps it with DTensor.from_local in a forward pre-hook
of the ROOT module, so all those from_local autograd nodes are created before
the first forward op and have the smallest sequence numbers of the graph. The
CPU autograd engine's ready queue runs the node with the highest sequence
number first, so every from_local backward (and with it the AccumulateGrad of
each TP-sharded local parameter, DDP's ready hook) waits until the whole
backward compute is done, and then they run in reverse registration order.
Plain parameters (the RMSNorm weights, which TP leaves as ordinary tensors)
become ready during backward as usual. Gradient ready order is therefore:
replicated parameters in reverse registration order, then TP-sharded ones in
reverse registration order (measured with post-accumulate-grad hooks); DDP
buckets that order by size (ddp.assign_buckets), and the test asserts exactly
those bucket sizes (`ready_order_tp_dp`; as a set, since gloo's two worker
threads may start two buckets in flight in either order), plus ddp.py's total
bytes and bucket count. A
consequence that commbench does not model: in this recipe the dp all-reduces of
the TP-sharded gradients are all launched after the backward compute (no
overlap with backward); the test checks that every bucket's all-reduce comes
after the last TP backward all-reduce.

PP+DP (pp 2 x dp 2, tiny-llama, fp32, m = 4 micro-batches of 1): rank =
pp_i * dp + dp_i; every stage module (split as tests/test_strategy_pp.py does)
is wrapped in DDP over its dp group and driven by Schedule1F1B over its pp
group; at the default bucket size and at bucket_mb 0.125 (3 + 4 buckets).
torch pipelining runs DDP's micro-batch backwards under no_sync except
the last one (PipelineStage.backward_maybe_with_nosync), so DDP reduces its
buckets once per step, as strategies/ddp.py assumes; the test asserts that.
"""
import json
import os
from collections import Counter

import pytest

from commbench import models, plan
from commbench.parallel import Parallelism
from commbench.strategies import ddp, pp, tp
from commbench.strategies.common import grad_bytes, rank_params
from commbench.training import lm_loss, stage_module, tp_plan
from traffic import gloo_ops, record

from test_strategy_pp import log_p2p_ops, p2p_table
from test_strategy_tp import MARKER, issued, per_phase

TPDP = dict(world=4, gpus_per_node=4, tp=2, dp=2, zero=0, micro_batch=2, global_batch=4, dtype="fp32")
PPDP = dict(world=4, gpus_per_node=4, pp=2, dp=2, zero=0, micro_batch=1, global_batch=8, dtype="fp32")


# --- TP + DP -------------------------------------------------------------------------------
BUCKETS = [25, 0.125]        # bucket_mb of TP+DP's configurations (marker index)


def tp_dp_step(rank, world):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import record_function

    from commbench import torch_model
    spec = models.get("tiny-llama")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    steps = []
    for ci, bucket_mb in enumerate(BUCKETS):
        par = Parallelism(**TPDP, bucket_mb=bucket_mb)
        model = torch_model.build(spec)
        parallelize_module(model, mesh["tp"], tp_plan(spec, sp=False))
        _pre_dp_module_transform(model)
        model = DDP(model, process_group=mesh["dp"].get_group(), **ddp.ddp_kwargs(par))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1 + rank // par.tp)    # same batch in a tp group, not across dp

        def step(ci=ci, model=model, opt=opt, gen=gen, B=par.micro_batch):
            tokens = torch.randint(0, spec.vocab, (B, spec.seq), generator=gen)
            targets = torch.randint(0, spec.vocab, (B, spec.seq), generator=gen)
            with record_function(f"{MARKER} {ci} fwd"), loss_parallel():
                loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            with record_function(f"{MARKER} {ci} bwd"), loss_parallel():
                loss.backward()
            with record_function(f"{MARKER} {ci} step"):
                opt.step()
                opt.zero_grad()
        step()              # DDP: one bucket of everything
        step()              # DDP rebuilds its buckets in ready order (index broadcast, once)
        steps.append(step)

    def recorded():
        for step in steps:
            step()
    return recorded


def bwd_allreduces(events, ci) -> list:
    """The gloo all_reduce sizes (numel) in config ci's bwd range, in order."""
    out, cur = [], None
    for name, shapes in events:
        if name.startswith(MARKER):
            cur = tuple(name.split()[1:])
        elif name == "gloo:all_reduce" and cur == (str(ci), "bwd"):
            n = 1
            for d in shapes[0]:
                n *= d
            out.append(n)
    return out


def ready_order_tp_dp(params: list) -> list:
    """Gradient ready order of DDP over DTensor TP (see the module docstring):
    replicated parameters first, then the TP-sharded ones, each in reverse
    registration order."""
    rev = list(reversed(params))
    return [p for p in rev if not p.tp_sharded] + [p for p in rev if p.tp_sharded]


def tp_dp_buckets(spec, par) -> list:
    """Bucket sizes in bytes, in launch order, of DDP over DTensor TP."""
    bs = ddp.assign_buckets(ready_order_tp_dp(rank_params(spec, par)), grad_bytes(par), ddp.bucket_limits(par))
    return [grad_bytes(par) * sum(p.numel for p in b) for b in bs]


def test_tp_dp_matches_plan():
    spec = models.get("tiny-llama")
    ranks = record(tp_dp_step, 4)
    for ci, bucket_mb in enumerate(BUCKETS):
        par = Parallelism(**TPDP, bucket_mb=bucket_mb)
        dp_ops = [o for o in plan.comm_ops(spec, par) if o.axis == "dp"]
        assert dp_ops == ddp.comm_ops(spec, par)
        tp_ops = tp.comm_ops(spec, par, flavour="dtensor")
        want_tp, want_dp = per_phase(tp_ops), per_phase(dp_ops)
        tp_sizes = {k[2] for k in want_tp}
        # the sizes tell the axes apart (nothing is both a bucket and a tp message)
        assert not tp_sizes & {k[2] for k in want_dp}
        real = tp_dp_buckets(spec, par)
        # what ddp.py predicts and what torch does agree in total bytes and bucket count
        assert sum(real) == sum(o.nbytes for o in dp_ops) and len(real) == len(dp_ops)
        for rank, events in enumerate(ranks):
            got = issued(events, par.tp)[ci]      # only all-reduces here: the group size is unused
            got_dp = Counter({k: v for k, v in got.items() if k[2] not in tp_sizes})
            got_tp = got - got_dp
            seq = [4 * n for n in bwd_allreduces(events, ci)]
            print(f"bucket_mb {bucket_mb} rank {rank}: dp torch {[n for n in seq if n not in tp_sizes]} / "
                  f"ddp.py {[o.nbytes for o in dp_ops]} / test formula {real}")
            print(f"bucket_mb {bucket_mb} rank {rank}: tp torch {sorted(got_tp.items())} / "
                  f"commbench {sorted(want_tp.items())}")
            assert got_tp == want_tp, (rank, got_tp, want_tp)
            # one all-reduce per bucket, in the bwd range, of the sizes the real ready order gives,
            # all after the last TP backward all-reduce. Their order among themselves is not
            # compared: gloo runs a group's async all-reduces on two worker threads, so the
            # profiler's start order of two buckets in flight can swap (a fresh-clone CI run saw
            # 139264 before 135424 on one rank of four), as in test_pp_dp_matches_plan
            assert set(got_dp) == {("bwd", "all_reduce", n) for n in real}
            assert sorted(seq[-len(real):]) == sorted(real) and not set(seq[:-len(real)]) - tp_sizes, seq
        if len(dp_ops) == 1:
            assert real == [o.nbytes for o in dp_ops]       # one bucket: ddp.py is exact


# --- PP + DP -------------------------------------------------------------------------------
def pp_dp_step(rank, world, bucket_mb, logdir):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel as DDP

    par = Parallelism(**PPDP, bucket_mb=bucket_mb)
    spec = models.get("tiny-llama")
    pp_i, dp_i = divmod(rank, par.dp)                          # Megatron: rank = pp_i * dp + dp_i
    # every rank creates every group, in the same order
    dp_groups = {g: dist.new_group(list(g)) for g in par.groups["dp"]}
    pp_groups = {g: dist.new_group(list(g)) for g in par.groups["pp"]}
    dp_group = next(v for g, v in dp_groups.items() if rank in g)
    pp_group = next(v for g, v in pp_groups.items() if rank in g)
    mod = DDP(stage_module(spec, pp_i, par.pp), process_group=dp_group, **ddp.ddp_kwargs(par))
    stage = PipelineStage(mod, pp_i, par.pp, torch.device("cpu"), group=pp_group)
    log = []
    log_p2p_ops(stage, log)
    m = par.num_microbatches
    sched = Schedule1F1B(stage, m, loss_fn=lm_loss)
    gen = torch.Generator().manual_seed(1 + dp_i)              # same batch along a pipeline
    tokens = torch.randint(0, spec.vocab, (par.micro_batch * m, spec.seq), generator=gen)
    target = torch.randint(0, spec.vocab, (par.micro_batch * m, spec.seq), generator=gen)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)

    def step():
        args = (tokens,) if pp_i == 0 else ()
        kw = {"target": target} if pp_i == par.pp - 1 else {}
        sched.step(*args, **kw)
        opt.step()
        opt.zero_grad()
    step()                  # pipelining shape inference; DDP's one-bucket first iteration
    step()                  # DDP rebuilds its buckets (index broadcast)

    def recorded():
        log.clear()
        step()
        with open(os.path.join(logdir, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)
    return recorded


@pytest.mark.parametrize("bucket_mb", BUCKETS)
def test_pp_dp_matches_plan(tmp_path, bucket_mb):
    par = Parallelism(**PPDP, bucket_mb=bucket_mb)
    spec = models.get("tiny-llama")
    ops = plan.comm_ops(spec, par)
    assert [o for o in ops if o.axis == "dp"] == ddp.comm_ops(spec, par)
    assert [o for o in ops if o.axis == "pp"] == pp.comm_ops(spec, par)
    table = p2p_table(pp.comm_ops(spec, par))
    ranks = record(pp_dp_step, par.world, bucket_mb, str(tmp_path))
    for rank, events in enumerate(ranks):
        pp_i = rank // par.dp
        backend = gloo_ops(events)
        log = [tuple(x) for x in json.load(open(tmp_path / f"rank{rank}.json"))]
        # (1) the logged P2POps are exactly the sends/recvs gloo ran, in order
        assert [(k, n) for _, k, _, n in log] == [(op, n) for op, n in backend if op in ("send", "recv")]
        # (2) p2p per (phase, direction, peer stage): count and bytes as strategies.pp says
        got = Counter((pp_i, ph, k, peer // par.dp) for ph, k, peer, _ in log)
        mine = {key: val for key, val in table.items() if key[0] == pp_i}
        assert set(got) == set(mine), (rank, got, mine)
        for key, (count, nbytes) in mine.items():
            sizes = {n * 4 for ph, k, peer, n in log if (pp_i, ph, k, peer // par.dp) == key}
            assert got[key] == count and sizes == {nbytes}, (rank, key, got[key], sizes, count, nbytes)
        assert all(peer % par.dp == rank % par.dp for _, _, peer, _ in log)    # same dp index
        # (3) dp: the stage's DDP buckets, once per step (not once per micro-batch: the
        # pipeline stage runs the first m-1 backwards under DDP's no_sync)
        want = [("all_reduce", o.nbytes // 4) for o in ddp.comm_ops(spec, par) if o.stage == pp_i
                for _ in range(o.count)]
        others = [(op, n) for op, n in backend if op not in ("send", "recv")]
        assert len(want) == len(ddp.buckets(spec, par, pp_i))
        print(f"bucket_mb {bucket_mb} rank {rank} (stage {pp_i}): p2p torch {sorted(got.items())} / commbench "
              f"{sorted(mine.items())}; dp torch {others} / commbench {want}")
        # the same buckets; their order is not compared: gloo runs a group's async all-reduces on
        # two worker threads, so the profiler's start order of two in flight can swap (seen once
        # in a fresh-clone CI run: 56448 before 34944 on one rank of four)
        assert sorted(others) == sorted(want), (rank, others, want)
