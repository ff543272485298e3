"""ZeRO-1/2 strategy: hand-computed values for both flavours, and the proof for
the torch flavour: a real ZeroRedundancyOptimizer(Adam) over DDP (zero = 1)
and FSDP2 fully_shard(reshard_after_forward=False) (zero = 2) over gloo issue
exactly the collectives strategies/zero.py generates.

ZeroRedundancyOptimizer on gloo: no quirk found. Its broadcasts are async
(async_op=True, all waited at the end of step), so several are queued at once
and ProcessGroupGloo's worker threads may start two of them in either order;
assert_same_ops (from the DDP test) allows exactly that and nothing else. The
parameters are plain CPU tensors, so there is no device staging; the
parameters_as_bucket_view buckets are real flat tensors broadcast whole.
The DeepSpeed flavour cannot run here (no DeepSpeed, no GPU): its tests check
the documented formulas by hand."""
import pytest
import torch

from commbench import models
from commbench.models import ModelSpec
from commbench.parallel import Parallelism
from commbench.strategies import fsdp, zero
from commbench.strategies.common import rank_params
from test_strategy_ddp import assert_same_ops, expected, issued
from traffic import marked, record


# --- torch, zero = 1 by hand ------------------------------------------------------------------
def test_partition_tiny_gpt_two_ranks():
    # sorted largest first: embedding 32768 -> rank 0; the eight 16384-element MLP weights
    # alternate by smallest total (ties -> lower rank): rank 1, 1, 0, 1, 0, 1, 0, 1
    m = models.get("tiny-gpt")
    parts = zero.zero_partition(rank_params(m, Parallelism(world=1)), 2)
    assert [p.numel for p in parts[0][:4]] == [32768, 16384, 16384, 16384]
    assert [p.numel for p in parts[1][:5]] == [16384] * 5
    assert sum(p.numel for p in parts[0]) + sum(p.numel for p in parts[1]) == m.num_params
    ops = zero.comm_ops(m, Parallelism(world=2, zero=1, dtype="fp32"))
    bc = [(o.label, o.nbytes // 4, o.count) for o in ops if o.collective == "broadcast"]
    assert bc[:3] == [("params from dp rank 0", 32768, 1), ("params from dp rank 0", 16384, 3),
                      ("params from dp rank 0", 4096, 9)]
    assert sum(c for _, _, c in bc) == len(rank_params(m, Parallelism(world=1))) == 68
    assert all(o.phase == "step" and o.overlap == "none" for o in ops if o.collective == "broadcast")
    # the gradients are DDP's buckets
    assert [o.nbytes // 4 for o in ops if o.collective == "all_reduce"] == [236928]


def test_bucket_view_one_broadcast_per_rank():
    m = models.get("tiny-gpt")
    ops = zero.comm_ops(m, Parallelism(world=4, zero=1, dtype="fp32"), parameters_as_bucket_view=True)
    bc = [o for o in ops if o.collective == "broadcast"]
    assert len(bc) == 4 and all(o.count == 1 for o in bc)
    assert sum(o.nbytes for o in bc) == 4 * m.num_params
    # more ranks than parameters: an empty partition broadcasts torch.zeros(1) (fp32)
    few = ModelSpec("one-layer", 1, 8, 2, 16, 4)
    bc = zero.zero_broadcasts(few, Parallelism(world=64, zero=1), parameters_as_bucket_view=True)
    assert len(bc) == 64 and bc[-1] == (63, 4)


def test_gpt3_13b_zero1_torch_dp512():
    # 644 parameters over 512 ranks, largest first: embedding -> rank 0, the 80 MLP weights
    # (104857600) -> ranks 1-80, the 160 attention weights -> 81-240, positions -> 241, the 40
    # up biases (20480) -> 242-281, then 362 tensors of 5120: one to each of 282-511 and the
    # remaining 132 to the then-smallest ranks 282-413 (a second one each)
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, zero=1)
    ops = zero.comm_ops(m, par)
    bc = [o for o in ops if o.collective == "broadcast"]
    assert sum(o.count for o in bc) == 644
    assert sum(o.nbytes * o.count for o in bc) == 2 * m.num_params
    assert (bc[0].label, bc[0].nbytes, bc[0].count) == ("params from dp rank 0", 2 * 257315840, 1)
    by_owner = {}
    for o in bc:
        by_owner.setdefault(int(o.label.split()[-1]), []).append((o.nbytes, o.count))
    assert by_owner[282] == [(10240, 2)] and by_owner[413] == [(10240, 2)] and by_owner[414] == [(10240, 1)]
    assert by_owner[241] == [(2 * 10485760, 1)]
    assert len(by_owner) == 512
    assert all((o.group_size, o.num_nodes, o.phase, o.dtype) == (512, 128, "step", "bf16") for o in bc)
    # gradients: DDP's 241 buckets
    ar = [o for o in ops if o.collective == "all_reduce"]
    assert len(ar) == 241 and sum(o.nbytes for o in ar) == 2 * m.num_params
    assert all(o.strategy == "zero1" for o in ops)


# --- torch, zero = 2 (FSDP2, reshard_after_forward=False) by hand ---------------------------
def test_gpt3_13b_zero2_torch_dp512():
    # units: root (embedding, positions, final norm) + 40 layers. Each parameter is padded on
    # dim 0 to a multiple of 512: the embedding's 50257 rows to 99 * 512 = 50688; every other
    # dim 0 (5120, 20480, 2048) divides evenly. m = 1024 / (1 x 512) = 2 micro-batches.
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, zero=2, global_batch=1024)
    ops = zero.comm_ops(m, par)
    ag = [o for o in ops if o.collective == "all_gather"]
    rs = [o for o in ops if o.collective == "reduce_scatter"]
    root = 50688 * 5120 + 2048 * 5120 + 2 * 5120
    assert [o.nbytes for o in ag] == [2 * root] + [2 * 314639360] * 40
    assert [o.nbytes for o in rs] == [2 * 314639360] * 40 + [2 * root]
    assert all((o.count, o.group_size, o.num_nodes) == (2, 512, 128) for o in ops)
    assert {o.phase for o in ag} == {"fwd"} and {o.phase for o in rs} == {"bwd"}


def test_fsdp_padding_small():
    # tiny-gpt over 3 ranks: embedding rows 512 -> 513, positions 64 -> 66, norms 64 -> 66
    m = models.get("tiny-gpt")
    units = {u.label if u.label == "root" else f"layers.{u.layer}": u
             for u in fsdp.fsdp_units(m, Parallelism(world=1))}
    assert units["root"].padded_numel(3) == 513 * 64 + 66 * 64 + 2 * 66
    # layer: q/k/v/o weights 64 -> 66 rows of 64, down 64 -> 66 rows of 256, up 256 -> 258 rows
    # of 64, up bias 256 -> 258, the five other biases and four norm vectors 64 -> 66
    layer = 4 * 66 * 64 + 66 * 256 + 258 * 64 + 258 + 5 * 66 + 4 * 66
    assert units["layers.0"].padded_numel(3) == layer


# --- DeepSpeed by hand ---------------------------------------------------------------------
def test_gpt3_13b_deepspeed():
    # ZeRO-2, dp 512, m = 2. IPG buckets of <= 5e8 elements in ready order: final norm
    # 10240 + layer 39 (314639360) + layer 38's down (5120 + 104857600) and up bias 20480 =
    # 419532800; its up weight would pass 5e8, so the bucket is reduced first.
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, zero=2, zero_flavour="deepspeed", global_batch=1024)
    ops = zero.comm_ops(m, par)
    rs = [o for o in ops if o.collective == "reduce_scatter"]
    ag = [o for o in ops if o.collective == "all_gather"]
    assert rs[0].nbytes == 2 * 419532800
    assert all(o.nbytes <= 2 * 500_000_000 and o.count == 2 and o.phase == "bwd" for o in rs)
    assert sum(o.nbytes for o in rs) == 2 * m.num_params
    # then a period of three layers in two buckets (498170880, 445747200 elements), 25 buckets
    # in all, the tail of layer 0 with the positions (351349760), and the embedding alone
    # (257315840: with the tail it would pass 5e8): 28 reduce-scatters
    assert [o.nbytes // 2 for o in rs[1:5]] == [498170880, 445747200] * 2
    assert [o.nbytes // 2 for o in rs[-2:]] == [351349760, 257315840]
    assert len(rs) == 28
    # one all-gather of the flat group, padded to 2 x 512 elements (12853386240 divides evenly)
    assert [(o.nbytes, o.count, o.phase) for o in ag] == [(2 * m.num_params, 1, "step")]
    assert all((o.group_size, o.num_nodes) == (512, 128) for o in ops)
    # ZeRO-1: the same buckets, reduced once per step
    ops1 = zero.comm_ops(m, Parallelism(world=512, gpus_per_node=4, zero=1, zero_flavour="deepspeed",
                                        global_batch=1024))
    assert [o.nbytes for o in ops1] == [o.nbytes for o in ops]
    assert all(o.count == 1 for o in ops1)


def test_deepspeed_small_and_padded():
    # under 5e8 elements: one reduce-scatter; all-gather padded to a multiple of 2 x 5 = 10
    m = models.get("tiny-gpt")
    ops = zero.comm_ops(m, Parallelism(world=5, zero=1, zero_flavour="deepspeed", dtype="fp32"))
    assert [(o.collective, o.nbytes // 4) for o in ops] == [("reduce_scatter", 236928), ("all_gather", 236930)]


def test_zero_errors_and_single_rank():
    with pytest.raises(ValueError, match="zero stages 1 and 2"):
        zero.comm_ops(models.get("tiny-gpt"), Parallelism(world=2, zero=3))
    for z in (1, 2):
        for fl in ("torch", "deepspeed"):
            assert zero.comm_ops(models.get("tiny-gpt"), Parallelism(world=1, zero=z, zero_flavour=fl)) == []


# --- the proof: real ZeroRedundancyOptimizer and FSDP2 over gloo ---------------------------------
# a llama-like model whose dims do not divide by 4, so FSDP2 pads: vocab 509 rows -> 512,
# ffn 98 -> 100 (gate, up), kv 24 rows divide evenly
ODD = ModelSpec("odd-llama", 2, 48, 4, 509, 32, kv_heads=2, ffn_hidden=98, arch="llama", tied_embeddings=False)
# (kind, model, bucket_mb or micro-batches, parameters_as_bucket_view)
CONFIGS = {
    2: [("zero1", "small-gpt", 0.25, False), ("zero1", "tiny-gpt", 25, True), ("zero2", "tiny-gpt", 2, False)],
    4: [("zero1", "tiny-gpt", 0.25, False), ("zero1", "tiny-llama", 25, True), ("zero2", ODD, 2, False)],
}


def _spec(name):
    return name if isinstance(name, ModelSpec) else models.get(name)


def _plan(world, kind, arg):
    if kind == "zero1":
        return Parallelism(world=world, zero=1, dtype="fp32", bucket_mb=arg)
    return Parallelism(world=world, zero=2, dtype="fp32", global_batch=world * arg)


def zero_steps(rank, world):
    """Module-level (spawned ranks import it): every configuration of this world
    size, two warm-up steps each (DDP's bucket rebuild, Adam's state), then the
    recorded step of each inside a marker."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from commbench import torch_model
    from commbench.strategies import ddp
    steps = []
    for kind, name, arg, view in CONFIGS[world]:
        spec, par = _spec(name), _plan(world, kind, arg)
        if kind == "zero1":
            model = DDP(torch_model.build(spec), **ddp.ddp_kwargs(par))
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                          parameters_as_bucket_view=view)
        else:
            model = torch_model.build(spec)
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)

        def step(model=model, opt=opt, gen=gen, spec=spec, m=par.num_microbatches):
            for _ in range(m):              # FSDP2: no no_sync, gradients reduce-scattered every micro-batch
                tokens = torch.randint(0, spec.vocab, (1, 16), generator=gen)
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
    return world, record(zero_steps, world)


def _want(world, kind, name, arg, view):
    par = _plan(world, kind, arg)
    ops = zero.comm_ops(_spec(name), par, parameters_as_bucket_view=view)
    if kind == "zero2":
        # count m per step = once per micro-batch: the forward all-gathers, then the backward
        # reduce-scatters, m times over
        m = par.num_microbatches
        assert all(o.count == m for o in ops)
        one = [o.__class__(**{**o.to_dict(), "count": 1}) for o in ops]
        ops = ([o for o in one if o.phase == "fwd"] + [o for o in one if o.phase == "bwd"]) * m
    return expected(ops, world)


def test_real_zero_matches(recording):
    world, events = recording
    for rank_events in events:
        got = issued(rank_events)
        for i, cfg in enumerate(CONFIGS[world]):
            assert_same_ops(got[i], _want(world, *cfg))
    got = issued(events[0])
    if world == 2:
        # ZeroRedundancyOptimizer default: one broadcast per parameter (small-gpt has 132)
        calls, gloo = got[0]
        assert calls.count("broadcast") == len(rank_params(models.get("small-gpt"), Parallelism(world=1))) == 132
        # parameters_as_bucket_view: one flat broadcast per rank
        assert got[1][0] == ["all_reduce", "broadcast", "broadcast"]
        # FSDP2, 2 micro-batches: 5 all-gathers (root + 4 layers) and 5 reduce-scatters, twice
        assert got[2][0] == (["all_gather"] * 5 + ["reduce_scatter"] * 5) * 2
    else:
        # the padded odd-llama root: embedding and head 509 -> 512 rows of 48, norm 48; S / 4 per rank
        root = [w for w in got[2][1] if w[0] == "all_gather"][0]
        assert root == ("all_gather", (512 * 48 + 48 + 512 * 48) // 4)


def test_torch_zero2_under_pipelining_once_per_step():
    # torch.distributed.pipelining keeps a unit gathered and defers the gradient sync to
    # the end of the step: one all-gather and one reduce-scatter per unit per step, the
    # reduce-scatter after the backward (not overlapped), whatever the micro-batch count
    m = models.get("gpt3-13b")
    par = Parallelism(world=64, gpus_per_node=4, pp=8, global_batch=64, zero=2)
    assert par.num_microbatches == 8
    ops = zero.comm_ops(m, par)
    assert ops and all(o.count == 1 for o in ops)
    assert {o.overlap for o in ops if o.collective == "reduce_scatter"} == {"none"}
    with pytest.raises(ValueError, match="interleaved"):
        zero.comm_ops(m, Parallelism(world=64, gpus_per_node=4, pp=8, interleave=5, global_batch=64, zero=2))


def test_torch_zero2_units_are_fsdp_units():
    # the same FSDP2 units as ZeRO-3, also where tp does not divide the vocabulary
    # (DTensor's first shard holds ceil(V / tp) rows): 50257 / 2 -> 25129 rows of 2048
    m = models.get("gpt3-1.3b")
    two = Parallelism(world=16, gpus_per_node=8, tp=2, zero=2)
    three = Parallelism(world=16, gpus_per_node=8, tp=2, zero=3)
    root2 = next(o for o in zero.comm_ops(m, two) if o.label == "root params")
    root3 = next(o for o in fsdp.comm_ops(m, three) if o.label.startswith("root") and o.phase == "fwd")
    assert root2.nbytes == root3.nbytes
    n = 8
    rows = lambda d: -(-d // n) * n        # noqa: E731  padded to a multiple of the dp size
    assert root2.nbytes == 2 * (rows(25129) * 2048 + rows(2048) * 2048 + 2 * rows(2048))


@pytest.mark.parametrize("name,pp,zero", [("gpt3-13b", 4, 1), ("llama2-7b", 8, 1), ("gpt3-13b", 5, 0)])
def test_middle_stages_computed_once_match_each_stage_computed_alone(name, pp, zero):
    """The plan's builders compute a stage's Adam shard, DDP buckets and ZeRO-1
    broadcasts once per kind of stage (first, middle, last): every stage's ops
    are those computed from that stage's own parameters."""
    from commbench.compute import ops as compute_ops
    from commbench.parallel import DTYPE_BYTES
    from commbench.strategies import ddp, zero as zero_mod
    model = models.get(name)
    par = Parallelism(world=4 * pp, gpus_per_node=4, pp=pp, zero=zero, global_batch=8 * 4 * pp)
    adams = compute_ops.optimizer_ops(model, par)
    reduces = ddp.gradient_allreduces(model, par)
    bcasts = [c for c in (zero_mod.comm_ops(model, par) if zero else []) if c.collective == "broadcast"]
    for s in range(pp):
        assert (adams[s].m, adams[s].n) == compute_ops._adam_share(model, par, s)
        assert [c.nbytes for c in reduces if c.stage == s] == [
            sum(p.numel for p in b) * DTYPE_BYTES[par.grad_dtype] for b in ddp.buckets(model, par, s)]
        if zero:
            got = [(c.root, c.nbytes) for c in bcasts if c.stage == s for _ in range(c.count)]
            assert got == zero_mod.zero_broadcasts(model, par, s)

