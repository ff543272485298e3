"""FSDP full shard (zero = 3): comm_ops against hand-computed plans, and THE
PROOF: torch's FSDP2 fully_shard on tiny models over gloo, its recorded
all-gathers and reduce-scatters matched exactly (kind, phase, count, numel)
against commbench's CommOps for the same model and plan."""
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from commbench import models, torch_model
from commbench.parallel import DTYPE_BYTES, Parallelism
from commbench.strategies import fsdp
from commbench.training import stage_module
from traffic import record

# --- comm_ops by hand ---------------------------------------------------------------


def _by(ops):
    return {(o.stage, o.label.split(" ", 1)[0] if o.label[0].isdigit() else "root", o.collective, o.phase): o
            for o in ops}


def test_gpt3_13b_on_512_gpus():
    """gpt3-13b, dp 512 over 128 nodes of 4, 2 micro-batches, bf16."""
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, zero=3, global_batch=1024)
    assert par.dp == 512 and par.num_microbatches == 2
    ops = fsdp.comm_ops(m, par)
    assert len(ops) == 5 and {o.axis for o in ops} == {"dp"}
    assert all(o.group_size == 512 and o.num_nodes == 128 and o.stage == 0 for o in ops)
    h, f = 5120, 20480
    # a block: 12 h^2 + 13 h elements; every dim 0 (5120, 20480) divides by 512: no padding
    block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    assert block == 12 * h * h + 13 * h == 314_639_360
    # the root: embed 50257 x 5120 padded to 512 x ceil(50257/512) = 50688 rows, pos 2048 x 5120, final LN 2 x 5120
    root = 50688 * h + 2048 * h + 2 * h
    assert root == 270_018_560 and root - (50257 * h + 2048 * h + 2 * h) == 431 * h
    b = _by(ops)
    for unit, numel, k in (("root", root, 1), ("40", block, 40)):
        ag, rs = b[(0, unit, "all_gather", "fwd")], b[(0, unit, "reduce_scatter", "bwd")]
        assert (ag.nbytes, ag.count, ag.overlap, ag.dtype) == (numel * 2, 2 * k, "fwd", "bf16")
        assert (rs.nbytes, rs.count, rs.overlap, rs.phase) == (numel * 2, 2 * k, "bwd", "bwd")
    # blocks re-gather in backward (reshard_after_forward=True); the root (None -> False) does not
    ag = b[(0, "40", "all_gather", "bwd")]
    assert (ag.nbytes, ag.count, ag.overlap) == (block * 2, 80, "bwd")
    assert (0, "root", "all_gather", "bwd") not in b
    # about 3 Psi per micro-batch (DESIGN.md): 3 x 2 bytes x all elements, padded
    total = sum(o.nbytes * o.count for o in ops)
    assert total == 2 * 2 * (3 * 40 * block + 2 * root)


def test_gpt3_13b_no_reshard_and_no_sync():
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, zero=3, global_batch=2048)      # 4 micro-batches
    ops = fsdp.comm_ops(m, par, reshard_after_forward=False, sync_every_microbatch=False)
    b = _by(ops)
    assert not any(o.phase == "bwd" and o.collective == "all_gather" for o in ops)
    assert b[(0, "40", "all_gather", "fwd")].count == 160          # 4 micro-batches x 40 blocks
    assert b[(0, "40", "reduce_scatter", "bwd")].count == 40       # once per step (no-sync accumulation)
    assert b[(0, "root", "reduce_scatter", "bwd")].count == 1
    # the root re-gathers in backward only when given reshard_after_forward=True itself
    b = _by(fsdp.comm_ops(m, par, root_reshard_after_forward=True))
    assert b[(0, "root", "all_gather", "bwd")].count == 4


def test_mixed_precision_dtypes_and_tp():
    """bf16 parameters, fp32 reduction; tp 4 inside a node: FSDP pads each
    parameter's local (TP) shard; the dp group of 128 spans 128 nodes."""
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, tp=4, zero=3, dtype="bf16", grad_dtype="fp32")
    b = _by(fsdp.comm_ops(m, par))
    h, f, n = 5120, 20480, 128
    # local block: norms 4h, q/k/v (h/4 x h) + biases 3h/4, o (h x h/4) + bias h, up (f/4 x h) + f/4, down (h x f/4) + h
    block = 4 * h + 3 * (h // 4 * h + h // 4) + h * h // 4 + h + f // 4 * h + f // 4 + h * f // 4 + h
    assert block % n == 0 and all(d % n == 0 for d in (h, h // 4, f // 4))
    # root: vocab-parallel embedding 12565 rows (ceil(50257/4), DTensor's largest shard) padded
    # to 128 x 99 = 12672; positions 2048 x h; final LN 2h
    root = 12672 * h + 2048 * h + 2 * h
    ag, rs = b[(0, "40", "all_gather", "fwd")], b[(0, "40", "reduce_scatter", "bwd")]
    assert (ag.nbytes, ag.dtype, ag.group_size, ag.num_nodes) == (block * 2, "bf16", 128, 128)
    assert (rs.nbytes, rs.dtype) == (block * 4, "fp32")
    assert b[(0, "root", "all_gather", "fwd")].nbytes == root * 2


def test_padding_small_group():
    """tiny-llama over 3 ranks: every dim 0 (64, 32, 176, 512) is padded up to a multiple of 3."""
    m = models.get("tiny-llama")
    b = _by(fsdp.comm_ops(m, Parallelism(world=3, zero=3, dtype="fp32")))
    p = lambda d: -(-d // 3) * 3                     # noqa: E731
    block = 2 * p(64) + p(64) * 64 * 2 + p(32) * 64 * 2 + p(176) * 64 * 2 + p(64) * 176
    assert block == 47076 and m.layer_params() == 46208
    root = p(512) * 64 + p(64) + p(512) * 64
    assert b[(0, "4", "all_gather", "fwd")].nbytes == block * 4
    assert b[(0, "root", "reduce_scatter", "bwd")].nbytes == root * 4 == 65730 * 4


def test_pipeline_1f1b_and_gpipe():
    """pp 2 x dp 2, 4 micro-batches, under torch.distributed.pipelining: one
    reduce-scatter per unit per step; 1F1B stage 0 (w = 2 warm-up forwards)
    gathers a block twice in forward and 4 - 2 + 1 = 3 times in backward,
    stage 1 (w = 1) once and 4 times; GPipe m and 1."""
    m = models.get("tiny-gpt")
    for sched, expect in (("1f1b", {0: (2, 3), 1: (1, 4)}), ("gpipe", {0: (4, 1), 1: (4, 1)})):
        par = Parallelism(world=4, pp=2, zero=3, global_batch=8, schedule=sched)
        assert par.num_microbatches == 4
        b = _by(fsdp.comm_ops(m, par))
        for stage, (fwd, bwd) in expect.items():
            assert b[(stage, "2", "all_gather", "fwd")].count == 2 * fwd
            assert b[(stage, "2", "all_gather", "bwd")].count == 2 * bwd
            assert b[(stage, "2", "reduce_scatter", "bwd")].count == 2
            assert b[(stage, "2", "reduce_scatter", "bwd")].overlap == "none"
            assert b[(stage, "root", "all_gather", "fwd")].count == 1
            assert (stage, "root", "all_gather", "bwd") not in b
    labels = [o.label for o in fsdp.comm_ops(m, Parallelism(world=4, pp=2, zero=3))]
    assert "root (embed, pos) all-gather fwd" in labels and "root (norm, head) all-gather fwd" in labels
    b = _by(fsdp.comm_ops(m, Parallelism(world=4, pp=2, zero=3, global_batch=8), reshard_after_forward=False))
    assert b[(0, "2", "all_gather", "fwd")].count == 2 and (0, "2", "all_gather", "bwd") not in b
    with pytest.raises(ValueError, match="interleaved pipeline schedule is not modelled"):
        fsdp.comm_ops(m, Parallelism(world=4, pp=2, zero=3, global_batch=8, interleave=2))


def test_single_rank_issues_nothing():
    assert fsdp.comm_ops(models.get("tiny-gpt"), Parallelism(world=1, zero=3)) == []


# --- THE PROOF: real FSDP2 over gloo ------------------------------------------------
#
# Each rank builds the models, applies fsdp.apply_fully_shard (every block, then the
# root), runs one warm-up step (FSDP's lazy init), then the recorded step. Marker
# broadcasts (FSDP itself never broadcasts) split the record: size 1 before every
# forward, 2 before every backward, 4 before the optimizer step, 3 at the end of a
# run; the c10d ops between two markers belong to that phase. CPU, fp32: FSDP2 runs
# on gloo as is (a "cpu" DeviceMesh; gloo carries the reduce-scatter as an all-reduce
# of the whole input, which the parse checks).

F, B, OPT, END = 1, 2, 4, 3

# (label, reshard_after_forward, root_reshard_after_forward, micro-batches, sync every micro-batch)
CONFIGS = [
    ("reshard", True, None, 1, True),
    ("no-reshard", False, None, 1, True),
    ("root-reshard", True, True, 1, True),
    ("accumulate", True, None, 2, True),
    ("accumulate-no-sync", True, None, 2, False),
]


def _mark(kind, group=None, src=0):
    dist.broadcast(torch.zeros(kind), src=src, group=group)


def _fsdp_run(rank, world, jobs):
    """jobs: [(model name, CONFIGS entry)], one FSDP model each, run one after the other."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    runs = []
    for name, (_, raf, root_raf, mbs, sync) in jobs:
        spec = models.get(name)
        model = torch_model.build(spec)
        fsdp.apply_fully_shard(model, mesh, reshard_after_forward=raf, root_reshard_after_forward=root_raf)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)

        def step(spec=spec, model=model, opt=opt, gen=gen, mbs=mbs, sync=sync, mark=lambda k: None):
            for i in range(mbs):
                if not sync:
                    model.set_requires_gradient_sync(i == mbs - 1)
                x = torch.randint(0, spec.vocab, (2, spec.seq), generator=gen)
                mark(F)
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
                mark(B)
                loss.backward()
            mark(OPT)
            opt.step()
            opt.zero_grad()
            mark(END)
        step()                                     # warm-up (lazy init)
        runs.append(step)

    def recorded():
        for step in runs:
            step(mark=_mark)
    return recorded


def _numel(shape):
    return int(torch.Size(shape).numel())


def _runs(events, group_size):
    """One rank's record as a list of runs, each a list of (marker kind, ops) segments,
    ops = [(collective, S in elements)]: all_gather S = the gathered output
    (input_shapes[0], group_size x the shard input_shapes[1]), reduce_scatter S = the
    whole input (input_shapes[1]). On gloo each is carried by one backend op right
    after it: gloo:all_gather of the per-rank shard, or (reduce_scatter) gloo:all_reduce
    of the whole input. The pipeline's send/recv are skipped; any other collective
    fails the test."""
    runs, segs, i = [], [], 0
    while i < len(events):
        name, shapes = events[i]
        nxt = events[i + 1] if i + 1 < len(events) else ("", [])
        if name == "gloo:broadcast":               # the marker (c10d::broadcast_ shapes its list as [])
            kind = _numel(shapes[0])
            if kind == END:
                runs.append(segs)
                segs = []
            else:
                segs.append((kind, []))
        elif name == "c10d::_allgather_base_":
            assert nxt[0] == "gloo:all_gather" and _numel(nxt[1][0]) == _numel(shapes[1])
            assert _numel(shapes[0]) == group_size * _numel(shapes[1])
            segs[-1][1].append(("all_gather", _numel(shapes[0])))
            i += 1
        elif name == "c10d::_reduce_scatter_base_":
            assert nxt[0] == "gloo:all_reduce" and _numel(nxt[1][0]) == _numel(shapes[1])
            segs[-1][1].append(("reduce_scatter", _numel(shapes[1])))
            i += 1
        elif name not in ("c10d::broadcast_", "c10d::send", "c10d::recv_", "gloo:send", "gloo:recv"):
            raise AssertionError(f"unexpected collective {name} {shapes}")
        i += 1
    assert not segs, "events after the last END marker"
    return runs


def _recorded_counts(segs):
    """Counter of (collective, phase, S) of one run; the optimizer step issues nothing."""
    out = Counter()
    for kind, ops in segs:
        assert kind in (F, B) or not ops, f"collectives in the optimizer step: {ops}"
        out.update((c, "fwd" if kind == F else "bwd", n) for c, n in ops)
    return out


def _expected_counts(ops):
    out = Counter()
    for o in ops:
        out[(o.collective, o.phase, o.nbytes // DTYPE_BYTES[o.dtype])] += o.count
    return out


def _table(got, want):
    keys = sorted(set(got) | set(want))
    return "\n".join(f"  {c:14s} {p} S={n:6d} elements: recorded {got[(c, p, n)]:3d}, comm_ops {want[(c, p, n)]:3d}"
                     for c, p, n in keys)


def _prove(world, jobs):
    per_rank = record(_fsdp_run, world, jobs)
    for r, events in enumerate(per_rank):
        runs = _runs(events, world)
        assert len(runs) == len(jobs)
        for (name, (label, raf, root_raf, mbs, sync)), segs in zip(jobs, runs):
            par = Parallelism(world=world, zero=3, dtype="fp32", micro_batch=2, global_batch=2 * world * mbs)
            assert par.num_microbatches == mbs
            ops = fsdp.comm_ops(models.get(name), par, reshard_after_forward=raf,
                                root_reshard_after_forward=root_raf, sync_every_microbatch=sync)
            assert all(o.group_size == world and o.axis == "dp" and o.stage == 0 for o in ops)
            got, want = _recorded_counts(segs), _expected_counts(ops)
            assert got == want, f"{name} world {world} {label} rank {r}:\n{_table(got, want)}"
            assert [k for k, _ in segs] == [F, B] * mbs + [OPT]
            if not sync:                       # no-sync: reduce-scatters only in the last backward
                assert not any(c == "reduce_scatter" for _, s in segs[:-2] for c, _ in s)
            if r == 0 and world == 2 and name == "tiny-gpt" and label == "reshard":
                print(f"\n{name} world {world} {label}:\n{_table(got, want)}")


def test_proof_fully_shard_two_ranks():
    """Over 2 gloo ranks: tiny-gpt in every CONFIGS entry, tiny-llama resharding
    after forward or not."""
    _prove(2, [("tiny-gpt", c) for c in CONFIGS] + [("tiny-llama", c) for c in CONFIGS[:2]])


def test_proof_fully_shard_four_ranks():
    """tiny-gpt and tiny-llama over 4 gloo ranks, blocks resharding after forward
    or not (4 ranks on 2 cores: the other configurations run over 2 ranks only)."""
    _prove(4, [(name, c) for name in ("tiny-gpt", "tiny-llama") for c in CONFIGS[:2]])


def test_proof_padding_three_ranks():
    """Over 3 ranks every dim 0 of tiny-llama (64, 32, 176, 512) is padded: the
    recorded all-gather outputs and reduce-scatter inputs are the padded sizes
    (block 47076 elements, not 46208; root 65730, not 65600)."""
    _prove(3, [("tiny-llama", c) for c in CONFIGS[:2]])


# --- THE PROOF with pipeline parallelism: FSDP inside torch.distributed.pipelining ----

def _pp_run(rank, world, name, pp, mbs, jobs):
    """pp x dp ranks in Megatron order (dp fastest): every stage module fully_shard'ed
    over its dp group, driven by torch's Schedule1F1B / ScheduleGPipe; markers on the
    dp group before every forward_one_chunk / backward_one_chunk of the stage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    spec = models.get(name)
    dp = world // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    s = rank // dp
    dpg = mesh["dp"].get_group()
    mark = lambda k: _mark(k, dpg, dist.get_global_rank(dpg, 0))   # noqa: E731
    tokens = torch.randint(0, spec.vocab, (mbs, spec.seq), generator=torch.Generator().manual_seed(1))
    runs = []
    for sched, raf in jobs:
        mod = stage_module(spec, s, pp)
        fsdp.apply_fully_shard(mod, mesh["dp"], reshard_after_forward=raf)
        stage = PipelineStage(mod, s, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        on = [False]
        for attr, kind in (("forward_one_chunk", F), ("backward_one_chunk", B)):
            def wrapped(*a, _f=getattr(stage, attr), _k=kind, _on=on, **kw):
                _on[0] and mark(_k)
                return _f(*a, **kw)
            setattr(stage, attr, wrapped)
        schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[sched](
            stage, mbs, loss_fn=lambda y, t: torch.nn.functional.cross_entropy(y.flatten(0, 1), t.flatten()))
        opt = torch.optim.SGD(mod.parameters(), lr=1e-3)

        def step(schedule=schedule, opt=opt, on=on, record=False):
            on[0] = record
            kw = {"target": tokens} if s == pp - 1 else {}
            schedule.step(*((tokens,) if s == 0 else ()), **kw)
            record and mark(OPT)
            opt.step()
            opt.zero_grad()
            record and mark(END)
        step()                                     # warm-up: shape inference, FSDP lazy init
        runs.append(step)

    def recorded():
        for step in runs:
            step(record=True)
    return recorded


def test_proof_pipeline_fsdp_matches_comm_ops():
    """tiny-gpt, pp 2 x dp 2, 4 micro-batches: 1F1B (blocks resharding after forward
    or not) and GPipe. Per stage the recorded all-gathers follow the compute order
    (1F1B stage 0: F F B F B F B B, stage 1: F B F B F B F B) and every unit
    reduce-scatters once, in perform_reduce_grad after the last backward."""
    name, world, pp, mbs = "tiny-gpt", 4, 2, 4
    jobs = [("1f1b", True), ("1f1b", False), ("gpipe", True)]
    per_rank = record(_pp_run, world, name, pp, mbs, jobs)
    orders = {"1f1b": {0: [F, F, B, F, B, F, B, B], 1: [F, B] * 4},
              "gpipe": {0: [F] * 4 + [B] * 4, 1: [F] * 4 + [B] * 4}}
    for r, events in enumerate(per_rank):
        stage = r // (world // pp)
        runs = _runs(events, world // pp)
        assert len(runs) == len(jobs)
        for (sched, raf), segs in zip(jobs, runs):
            par = Parallelism(world=world, pp=pp, zero=3, dtype="fp32", global_batch=mbs * world // pp,
                              schedule=sched)
            assert par.num_microbatches == mbs
            ops = [o for o in fsdp.comm_ops(models.get(name), par, reshard_after_forward=raf) if o.stage == stage]
            got, want = _recorded_counts(segs), _expected_counts(ops)
            assert got == want, f"{sched} reshard_after_forward={raf} stage {stage} rank {r}:\n{_table(got, want)}"
            assert [k for k, _ in segs] == orders[sched][stage] + [OPT]
            # the reduce-scatters all come at the end of the last backward
            assert all(c != "reduce_scatter" for _, s in segs[:-2] for c, _ in s)
            if r in (0, 2) and sched == "1f1b" and raf:
                print(f"\n1f1b stage {stage}:\n{_table(got, want)}")


def test_only_fsdp2_collectives_block_the_host():
    # FSDP2 (ZeRO-3, and torch ZeRO-2, which is FSDP2 without resharding) passes no
    # async_op: its collectives are blocking calls of the host; DDP's buckets
    # and ZeRO-1's broadcasts are async works
    from commbench import plan
    tiny = models.get("tiny-gpt")
    for zero, blocking in ((0, False), (1, False), (2, True), (3, True)):
        w = plan.build(tiny, Parallelism(world=2, gpus_per_node=2, zero=zero, global_batch=4))
        dp = [c for c in w.comm_ops if c.axis == "dp"]
        assert dp and all(c.host_blocking is blocking for c in dp), zero
