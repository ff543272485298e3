"""DDP strategy (zero = 0): hand-computed buckets for a few plans, and the proof:
real torch DistributedDataParallel over gloo issues exactly the all-reduces
that strategies/ddp.py generates (same order, same sizes, one set per step).

The real runs record one step after two warm-up steps: DDP's first iteration
reduces every gradient in a single bucket, the second forward rebuilds the
buckets in gradient-ready order (and broadcasts the bucket indices once); the
third step is the steady state that comm_ops describes. Several configurations
share one recording per world size (spawning gloo ranks under the profiler is
the expensive part); a profiler range named `c10d::commbench_marker <i>`
around each configuration's step splits the events."""
import pytest
import torch

from commbench import models
from commbench.parallel import Parallelism
from commbench.strategies import ddp
from commbench.strategies.common import rank_params
from traffic import MARKER, marked, record

C10D_KIND = {"c10d::allreduce_": "all_reduce", "c10d::broadcast_": "broadcast",
             "c10d::_allgather_base_": "all_gather", "c10d::_reduce_scatter_base_": "reduce_scatter"}
GLOO_THREADS = 2        # ProcessGroupGloo's default worker threads (_Options()._threads)


def issued(events) -> dict:
    """Per marker index: (the c10d:: collectives called, in program order; the
    gloo: operations that carried them out, as (op, numel of the input))."""
    out, cur = {}, None
    for name, shapes in events:
        if name.startswith(MARKER):
            cur = int(name.split()[-1])
            out[cur] = ([], [])
        elif name in C10D_KIND:
            out[cur][0].append(C10D_KIND[name])
        elif name.startswith("gloo:"):
            numel = 1
            for d in shapes[0]:
                numel *= d
            out[cur][1].append((name[len("gloo:"):], numel))
        elif name.startswith("c10d::"):
            raise AssertionError(f"unexpected collective {name}")
    return out


def expected(ops, group_size, elem_bytes=4):
    """CommOps (count per step) -> (c10d calls, gloo operations) of one step. S is
    the busbw table's size; gloo's all_gather input is one rank's part (S / n) and
    gloo carries a reduce_scatter out as an all_reduce of the whole input (S)."""
    calls, gloo = [], []
    for o in ops:
        numel = o.nbytes // elem_bytes
        g = {"all_gather": ("all_gather", numel // group_size),
             "reduce_scatter": ("all_reduce", numel)}.get(o.collective, (o.collective, numel))
        calls += [o.collective] * o.count
        gloo += [g] * o.count
    return calls, gloo


def assert_same_ops(got, want):
    """The c10d calls must match exactly, in order. The gloo operations must be the
    same multiset and in the same order, except that an async op queued behind
    another may start first: ProcessGroupGloo runs its work queue on GLOO_THREADS
    worker threads and the profiler stamps a gloo op when a worker starts it, so
    ops in flight together may be recorded swapped, and a worker descheduled
    between taking an op and stamping it lets the other run several ops of the
    same burst first (ZeRO-1's broadcasts, issued async together: one recorded
    3 places late on a busy VM). Each gloo op is matched to the earliest equal
    expected op and must sit within its run of consecutive ops of the same
    collective, give or take GLOO_THREADS places."""
    (got_calls, got_gloo), (want_calls, want_gloo) = got, want
    assert got_calls == want_calls
    assert sorted(got_gloo) == sorted(want_gloo), "different collectives or sizes"
    run_start, run_end = list(range(len(want_gloo))), list(range(len(want_gloo)))
    for j in range(1, len(want_gloo)):
        if want_gloo[j][0] == want_gloo[j - 1][0]:
            run_start[j] = run_start[j - 1]
    for j in range(len(want_gloo) - 2, -1, -1):
        if want_gloo[j][0] == want_gloo[j + 1][0]:
            run_end[j] = run_end[j + 1]
    used = [False] * len(want_gloo)
    for i, g in enumerate(got_gloo):
        j = next(j for j, w in enumerate(want_gloo) if not used[j] and w == g)
        used[j] = True
        assert run_start[j] - GLOO_THREADS <= i <= run_end[j] + GLOO_THREADS, \
            f"op {i} {g} recorded {i - j:+d} places from where it was issued, outside its run of {g[0]}s"


# --- hand-computed -----------------------------------------------------------------------------
def test_tiny_gpt_buckets_by_hand():
    # limit 0.25 MiB = 65536 fp32 elements. Ready order: final norm (128), layer 3
    # (49984 = 4*64^2+4*64 attention, 2*64*256+256+64 MLP, 4*64 norms), then layer 2's
    # down.bias 64 and down.weight 16384: 128+49984+64+16384 = 66560 >= 65536 closes
    # bucket 1. Bucket 2: rest of layer 2 (33536) + layer 1 down (16448) + up (16640)
    # = 66624. Bucket 3: rest of layer 1 (16896) + layer 0 up to q (49856) = 66752.
    # Last: layer 0 norm1 128 + pos 4096 + embed 32768 (tied head) = 36992.
    m = models.get("tiny-gpt")
    par = Parallelism(world=2, dtype="fp32", bucket_mb=0.25)
    ops = ddp.comm_ops(m, par)
    assert [o.nbytes // 4 for o in ops] == [66560, 66624, 66752, 36992]
    assert sum(o.nbytes for o in ops) == 4 * m.num_params
    assert [o.label for o in ops] == ["bucket 1/4", "bucket 2/4", "bucket 3/4", "bucket 4/4"]
    for o in ops:
        assert (o.collective, o.axis, o.group_size, o.num_nodes, o.count, o.phase, o.overlap, o.strategy) == \
               ("all_reduce", "dp", 2, 2, 1, "bwd", "bwd", "ddp")


def test_first_bucket_rule():
    # bucket_mb 25 is torch's default (bucket_cap_mb=None): first bucket 1 MiB, later 25 MiB.
    # small-gpt fp32: final norm 256 + layer 7 (198272) + layer 6 down (128 + 65536) = 264192
    # elements = 1056768 B >= 1 MiB (one tensor less is 794624 B); the rest (1469696) fits in 25 MiB.
    m = models.get("small-gpt")
    assert [o.nbytes // 4 for o in ddp.comm_ops(m, Parallelism(world=2, dtype="fp32"))] == [264192, 1469696]
    assert ddp.ddp_kwargs(Parallelism(world=2)) == {"bucket_cap_mb": None}
    # an explicit size is the first bucket's limit too (torch >= 2.x _BucketCapacityConfig)
    assert ddp.bucket_limits(Parallelism(world=2, bucket_mb=10)) == (10 * 2**20, 10 * 2**20)
    assert ddp.ddp_kwargs(Parallelism(world=2, bucket_mb=10)) == {"bucket_cap_mb": 10}
    assert len(ddp.comm_ops(m, Parallelism(world=2, dtype="fp32", bucket_mb=10))) == 1


def test_ready_order_keeps_layernorm_weight_first():
    m = models.get("tiny-gpt")
    order = [p.name for p in ddp.grad_ready_order(rank_params(m, Parallelism(world=1)))]
    assert order[:4] == ["norm.weight", "norm.bias", "layers.3.mlp.down.bias", "layers.3.mlp.down.weight"]
    assert order[-4:] == ["layers.0.norm1.weight", "layers.0.norm1.bias", "pos.weight", "embed.weight"]


def test_gpt3_13b_dp512():
    # 512 GPUs, 4 per node, pure DP: the dp group spans 128 nodes. bf16, 25 MB default.
    # Bucket 1 (limit 1 MiB = 524288 elements): final norm 2*5120 + layer 39 down.bias 5120 +
    # down.weight 5120*20480 = 104872960 elements. Then each big weight closes a 25 MiB
    # (13107200-element) bucket with the small tensors before it: up 20480+104857600,
    # norm2+o 10240+5120+26214400, v/k/q 5120+26214400 each; the next layer's down bucket
    # carries this layer's norm1 (10240, as the final norm did). 6 buckets per layer;
    # the last: norm1 of layer 0 + positions 2048*5120 + embedding 50257*5120.
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4)
    ops = ddp.comm_ops(m, par)
    layer = [104872960, 104878080, 26229760, 26219520, 26219520, 26219520]
    assert [o.nbytes for o in ops] == [2 * e for e in layer * 40 + [10240 + 10485760 + 257315840]]
    assert sum(o.nbytes for o in ops) == 2 * m.num_params
    assert all((o.group_size, o.num_nodes, o.count) == (512, 128, 1) for o in ops)


def test_gpt3_13b_tp4_pp4_accumulation():
    # tp 4 x pp 4 x dp 32 on 512 GPUs of 4 per node: a dp group's ranks are 4 apart, one per
    # node (32 nodes). 8 micro-batches per step: no_sync keeps it to one set of all-reduces.
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, tp=4, pp=4, micro_batch=1, global_batch=256)
    assert par.num_microbatches == 8
    ops = ddp.comm_ops(m, par)
    assert all((o.group_size, o.num_nodes, o.count) == (32, 32, 1) for o in ops)
    # per layer shard: q,k,v,o weights 5120*1280, q/k/v bias 1280, o bias 5120 (rowwise,
    # replicated), norms 4*5120, up/down weights 20480/4*5120, up bias 5120, down bias 5120
    layer = 4 * 6553600 + 3 * 1280 + 5120 + 20480 + 2 * 26214400 + 5120 + 5120
    assert layer == 78682880
    per_stage = {s: sum(o.nbytes for o in ops if o.stage == s) // 2 for s in range(4)}
    # the vocabulary splits unevenly: a rank holds at most ceil(50257 / 4) = 12565 rows
    assert per_stage == {0: 12565 * 5120 + 2048 * 5120 + 10 * layer,     # vocab-parallel embed + pos
                         1: 10 * layer, 2: 10 * layer,
                         3: 10 * layer + 10240 + 12565 * 5120}           # norm + untied head shard
    # middle stage: down (5120+26214400) closes the 1 MiB first bucket, up the next; norm2+o+v
    # = 10240+5120+6553600+1280+6553600 reaches 25 MiB; then k+q = 2*(1280+6553600)
    s1 = [o.nbytes // 2 for o in ops if o.stage == 1]
    assert s1[:5] == [26219520, 26219520, 13123840, 13109760, 10240 + 26219520]


def test_single_replica_reduces_nothing():
    assert ddp.comm_ops(models.get("tiny-gpt"), Parallelism(world=1)) == []
    # tp 2 over 2 GPUs: dp = 1
    assert ddp.comm_ops(models.get("tiny-gpt"), Parallelism(world=2, gpus_per_node=2, tp=2)) == []


def test_tp_shard_is_reduced():
    m = models.get("tiny-gpt")
    par = Parallelism(world=4, gpus_per_node=4, tp=2, dtype="fp32")
    ops = ddp.comm_ops(m, par)
    assert sum(o.nbytes for o in ops) == 4 * sum(p.numel for p in rank_params(m, par))
    assert sum(o.nbytes for o in ops) < 4 * m.num_params
    assert all(o.group_size == 2 for o in ops)


# --- the proof: real DDP over gloo ------------------------------------------------------------
# (model, bucket_mb, micro-batches per step); bucket_mb 25 = torch's default (bucket_cap_mb=None)
CONFIGS = {
    2: [("small-gpt", 0.25, 1), ("small-gpt", 25, 1), ("tiny-gpt", 0.25, 3)],
    4: [("tiny-gpt", 0.25, 2), ("small-gpt", 25, 1), ("tiny-llama", 0.125, 1)],
}


def _plan(world, name, bucket_mb, m):
    return Parallelism(world=world, dtype="fp32", bucket_mb=bucket_mb, global_batch=world * m)


def ddp_steps(rank, world):
    """Module-level (spawned ranks import it): builds every configuration of this
    world size, runs two warm-up steps of each, returns the recorded step."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from commbench import torch_model
    steps = []
    for name, bucket_mb, m in CONFIGS[world]:
        spec = models.get(name)
        model = DDP(torch_model.build(spec), **ddp.ddp_kwargs(_plan(world, name, bucket_mb, m)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)

        def step(model=model, opt=opt, gen=gen, spec=spec, m=m):
            for i in range(m):
                tokens = torch.randint(0, spec.vocab, (1, 16), generator=gen)
                if i < m - 1:
                    with model.no_sync():                 # gradient accumulation: no reduction
                        model(tokens).float().pow(2).mean().backward()
                else:
                    model(tokens).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        step()
        step()
        steps.append(step)

    return marked(steps)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def recording(request):
    world = request.param
    return world, record(ddp_steps, world)


def test_real_ddp_matches(recording):
    world, events = recording
    for rank_events in events:                            # every rank issues the same sequence
        got = issued(rank_events)
        for i, (name, bucket_mb, m) in enumerate(CONFIGS[world]):
            want = expected(ddp.comm_ops(models.get(name), _plan(world, name, bucket_mb, m)), world)
            assert_same_ops(got[i], want)
    got = issued(events[0])
    if world == 2:
        # small-gpt at 0.25 MiB: 25 buckets of ~66k elements, the last (layer 0 tail,
        # positions, embedding) 147712; at torch's default a 1 MiB first bucket and one more
        assert len(got[0][1]) == 25 and sorted(got[0][1])[-1] == ("all_reduce", 147712)
        assert sorted(got[1][1]) == [("all_reduce", 264192), ("all_reduce", 1469696)]
        # 3 micro-batches, two under no_sync: still one all-reduce per bucket
        assert sorted(got[2][1]) == sorted(("all_reduce", n) for n in (66560, 66624, 66752, 36992))
