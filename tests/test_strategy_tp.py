"""Tensor parallelism: hand-computed CommOps for a few plans (Megatron formulas,
the default flavour), and the proof: torch DTensor tensor parallelism
(parallelize_module, loss_parallel) on tiny-llama and tiny-gpt over gloo issues
exactly the collectives that strategies/tp.py generates with flavour='dtensor',
in kind, count, bytes and phase.

How DTensor differs from Megatron (both are modelled; flavour 'megatron' is the
default), as recorded here:
- q, k, v (and gate, up) are separate ColwiseParallel Linears, each redistributing
  its own input: 3 + 2 (llama) or 3 + 1 (gpt) backward all-reduces per layer, or
  with SP as many forward all-gathers and backward reduce-scatters, where
  Megatron's fused linear_qkv / linear_fc1 issue 1 + 1.
- with SP, no all-gather of the input again in backward (Megatron saves only the
  sequence shard and re-gathers it for the weight gradient).
- with SP, the norm weights' (and LayerNorm biases') gradients are Partial
  DTensors; backward accumulates them as Partial and the optimizer's every read
  all-reduces one parameter (SGD: 1 read, AdamW: 3; recorded in the 'step'
  phase). Megatron all-reduces them once per step, flattened into one buffer,
  together with the row-parallel biases (which DTensor adds before the
  reduce-scatter, so their gradients are complete).
- full recompute with torch.utils.checkpoint (non-reentrant, early stop on by
  default) stops once the last activation saved for backward (mlp.down's input)
  is rebuilt, so the MLP's output all-reduce / reduce-scatter is not issued again;
  Megatron's CheckpointFunction re-runs the whole layer.
- loss_parallel's target-logit all-reduce is in the logits' dtype (fp32 here, so
  not visible in this recording; the max and sum-exp ones are fp32 as Megatron's).

The DTensor plan follows torch's tensor-parallel tutorial: ColwiseParallel on
attn.q/k/v, mlp.gate/up, RowwiseParallel on attn.o, mlp.down; with SP
SequenceParallel on the norms, Shard(1) input layouts on the colwise and output
layouts on the rowwise Linears; the embedding RowwiseParallel(input_layouts=
Replicate()) and the head ColwiseParallel(output_layouts=Shard(-1),
use_local_output=False) under loss_parallel(). tiny-gpt's tied embeddings are
tied again after parallelize_module (embedding and head weight are both
Shard(0) over the vocabulary, so one DTensor serves both; no collective). With SP,
GPT's learned positions are added to the full sequence and the sum is split
into sequence shards by PrepareModuleInput(Replicate -> Shard(1)) on layer 0, as
Megatron's LanguageModelEmbedding does (all-reduce in forward, all-gather of the
gradient in backward); tiny-llama (no positions) reduce-scatters the embedding
output directly. torch_model's attention reshapes with -1 heads and takes b, s
from the norm output, which under SequenceParallel is a DTensor of global shape,
so the local heads work unchanged. Full recompute is torch.utils.checkpoint
(use_reentrant=False) around every block.

Each configuration runs one warm-up step (and checks that its loss equals the
unsharded model's: the sharded model is the same model), then the recorded step
of 1 or 2 micro-batches. Profiler ranges named `c10d::commbench_marker
<config> <phase>` around each micro-batch's forward, its backward and the
optimizer step assign every collective to its phase; several configurations share
one recording (spawning gloo ranks is the expensive part)."""
import functools
from collections import Counter

import pytest
import torch

from commbench import models
from commbench.parallel import Parallelism
from commbench.strategies import tp
from commbench.strategies.common import rank_params
from commbench.training import tp_plan
from traffic import record

MARKER = "c10d::commbench_marker"
C10D_KIND = {"c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather",
             "c10d::allgather_into_tensor_coalesced_": "all_gather",
             "c10d::_reduce_scatter_base_": "reduce_scatter",
             "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter"}
B = 2                                # micro-batch size in the proof


def per_phase(ops) -> Counter:
    """CommOps -> {(phase, collective, nbytes): count per step}."""
    out = Counter()
    for o in ops:
        out[(o.phase, o.collective, o.nbytes)] += o.count
    return out


def by_label(ops) -> dict:
    return {(o.stage, o.label): o for o in ops}


# --- hand-computed (Megatron) -----------------------------------------------------------------
def test_gpt3_13b_on_512_gpus_sp_full_recompute():
    # tp 4 inside a node of 4, pp 8 (5 layers a stage), dp 16; global batch 512 of micro-batch 1:
    # m = 512 / 16 = 32 micro-batches. One activation: 1 x 2048 x 5120 bf16 = 20971520 B.
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, tp=4, pp=8, sp=True, micro_batch=1, global_batch=512,
                      seq=2048, recompute="full")
    ops = tp.comm_ops(m, par)
    A = 2048 * 5120 * 2
    assert all((o.axis, o.group_size, o.num_nodes, o.overlap, o.strategy) == ("tp", 4, 1, "none", "tp")
               for o in ops)
    assert {o.stage for o in ops} == set(range(8))
    layer = 32 * 5                                                  # m x L per step
    for s in range(8):
        c = per_phase(o for o in ops if o.stage == s)
        first, last = s == 0, s == 7
        # fwd: AG before linear_qkv, RS after linear_proj, AG before linear_fc1, RS after fc2
        assert c[("fwd", "all_gather", A)] == 2 * layer + 32 * last           # + head input
        assert c[("fwd", "reduce_scatter", A)] == 2 * layer
        assert c[("fwd", "all_reduce", A)] == 32 * first                      # embedding (+ positions)
        # bwd: AG of the 2 row outputs' grads + 2 re-gathers for wgrad + 2 recomputed AG;
        # RS of the 2 column inputs' grads + 2 recomputed RS
        assert c[("bwd", "all_gather", A)] == 6 * layer + 32 * first + 32 * last  # split grad; head re-gather
        assert c[("bwd", "reduce_scatter", A)] == 4 * layer + 32 * last          # head input grad
        # cross-entropy: max, sum-exp, target logit, b*s fp32 each
        assert c[("fwd", "all_reduce", 2048 * 4)] == 3 * 32 * last
        # once per step: LayerNorm weights+biases (4h) and row-parallel biases (o, fc2: 2h) of
        # 5 layers, bf16; the last stage adds the final LayerNorm (2h)
        sp_numel = 5 * 6 * 5120 + 2 * 5120 * last
        assert c[("step", "all_reduce", sp_numel * 2)] == 1
        assert sum(c.values()) == layer * 14 + (32 * 2 if first else 0) + (1 + 32 * 6 if last else 1)
    lab = by_label(ops)
    assert lab[(0, "linear_qkv input re-gather for wgrad")].count == layer
    assert lab[(7, "cross-entropy target logit")].dtype == "fp32"


def test_gpt3_13b_no_sp():
    # 4 all-reduces of b*s*h per layer and micro-batch: 2 fwd (row outputs), 2 bwd (column inputs)
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, tp=4, pp=8, micro_batch=2, global_batch=512, seq=2048)
    assert par.num_microbatches == 16
    ops = tp.comm_ops(m, par)
    A = 2 * 2048 * 5120 * 2
    assert {o.collective for o in ops} == {"all_reduce"}
    c0, c3, c7 = (per_phase(o for o in ops if o.stage == s) for s in (0, 3, 7))
    assert c3 == {("fwd", "all_reduce", A): 2 * 16 * 5, ("bwd", "all_reduce", A): 2 * 16 * 5}
    assert c0 == {("fwd", "all_reduce", A): 2 * 80 + 16, ("bwd", "all_reduce", A): 2 * 80}
    assert c7 == {("fwd", "all_reduce", A): 2 * 80, ("bwd", "all_reduce", A): 2 * 80 + 16,   # head input grad
                  ("fwd", "all_reduce", 2 * 2048 * 4): 3 * 16}
    # bytes per rank per step of one middle stage: 4 x 80 x 42 MB
    assert sum(o.nbytes * o.count for o in ops if o.stage == 3) == 4 * 80 * A


def test_tp_across_nodes_and_selective_recompute():
    m = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, tp=8, pp=4, allow_tp_across_nodes=True, seq=2048,
                      recompute="selective")
    ops = tp.comm_ops(m, par)
    assert all((o.group_size, o.num_nodes) == (8, 2) for o in ops)
    # selective recompute re-runs core attention only: no collective is repeated
    assert per_phase(ops) == per_phase(tp.comm_ops(m, Parallelism(world=512, gpus_per_node=4, tp=8, pp=4,
                                                                  allow_tp_across_nodes=True, seq=2048)))


def test_llama_sp_megatron_vs_dtensor():
    # tiny-llama tp 2, SP, b 2, s 64, h 64, fp32: A = 8192 elements = 32768 B, 4 layers, 1 micro-batch.
    m = models.get("tiny-llama")
    par = Parallelism(world=2, gpus_per_node=2, tp=2, sp=True, micro_batch=2, seq=64, dtype="fp32")
    A = 2 * 64 * 64 * 4
    meg, dt = per_phase(tp.comm_ops(m, par)), per_phase(tp.comm_ops(m, par, flavour="dtensor"))
    # Megatron: per layer fwd 2 AG + 2 RS; bwd 2 AG + 2 RS + 2 AG (re-gather); no positions:
    # embedding RS fwd / AG bwd; head AG fwd, RS + AG bwd; one coalesced all-reduce of the
    # 9 RMSNorm weights (no biases in llama) in fp32.
    assert meg == {("fwd", "all_gather", A): 8 + 1, ("fwd", "reduce_scatter", A): 8 + 1,
                   ("bwd", "all_gather", A): 16 + 1 + 1, ("bwd", "reduce_scatter", A): 8 + 1,
                   ("fwd", "all_reduce", 128 * 4): 3, ("step", "all_reduce", 9 * 64 * 4): 1}
    # DTensor: q, k, v, gate, up each gather their input: 5 AG fwd and 5 RS bwd per layer
    assert dt == {("fwd", "all_gather", A): 20 + 1, ("fwd", "reduce_scatter", A): 8 + 1,
                  ("bwd", "all_gather", A): 8 + 1, ("bwd", "reduce_scatter", A): 20 + 1,
                  ("fwd", "all_reduce", 128 * 4): 3, ("step", "all_reduce", 64 * 4): 9}
    dt3 = per_phase(tp.comm_ops(m, par, flavour="dtensor", grad_reads=3))
    assert dt3[("step", "all_reduce", 64 * 4)] == 27
    # bf16: DTensor's target-logit all-reduce follows the logits' dtype, the others stay fp32
    bf = tp.comm_ops(m, Parallelism(world=2, gpus_per_node=2, tp=2, micro_batch=2, seq=64), flavour="dtensor")
    assert {o.label: (o.nbytes, o.dtype) for o in bf if "cross" in o.label} == {
        "cross-entropy max": (512, "fp32"), "cross-entropy sum-exp": (512, "fp32"),
        "cross-entropy target logit": (256, "bf16")}


def test_megatron_sp_grads_include_row_biases_not_positions():
    m = models.get("tiny-gpt")
    par = Parallelism(world=2, gpus_per_node=2, tp=2, sp=True, dtype="bf16", grad_dtype="fp32")
    step = [o for o in tp.comm_ops(m, par) if o.phase == "step"]
    # per layer: norm1 w+b, norm2 w+b, o.bias, down.bias = 6h; final norm 2h; fp32 grads
    assert [(o.nbytes, o.count, o.dtype) for o in step] == [((4 * 6 + 2) * 64 * 4, 1, "fp32")]
    dstep = [o for o in tp.comm_ops(m, par, flavour="dtensor") if o.phase == "step"]
    assert [(o.nbytes, o.count) for o in dstep] == [(64 * 4, 18)]


def test_no_tp_and_bad_arguments():
    m = models.get("tiny-gpt")
    assert tp.comm_ops(m, Parallelism(world=4, gpus_per_node=4)) == []
    assert tp.comm_ops(m, Parallelism(world=4, gpus_per_node=4, pp=2)) == []
    with pytest.raises(ValueError, match="flavour 'nccl'"):
        tp.comm_ops(m, Parallelism(world=2, gpus_per_node=2, tp=2), flavour="nccl")
    with pytest.raises(ValueError, match="grad_reads"):
        tp.comm_ops(m, Parallelism(world=2, gpus_per_node=2, tp=2), grad_reads=0)
    # tiny-llama has 2 kv heads: Megatron-core divides the query groups over tp, as DTensor
    # splits k/v: neither runs tp 4
    llama = models.get("tiny-llama")
    for flavour in ("megatron", "dtensor"):
        with pytest.raises(ValueError, match="kv heads 2 of tiny-llama are not divisible by tp 4"):
            tp.comm_ops(llama, Parallelism(world=4, gpus_per_node=4, tp=4), flavour=flavour)
    with pytest.raises(ValueError, match="heads 4 of tiny-gpt are not divisible by tp 8"):
        tp.comm_ops(m, Parallelism(world=8, gpus_per_node=8, tp=8))


# --- the proof: DTensor tensor parallelism over gloo ------------------------------------------
# (model, sp, recompute, micro-batches per step, optimizer, grad_reads of that optimizer);
# 2 micro-batches where SP shows that the norm gradients are reduced once per step
CONFIGS = {
    "llama": (2, [("tiny-llama", False, "none", 1, "SGD", 1), ("tiny-llama", True, "full", 2, "AdamW", 3)]),
    "gpt": (2, [("tiny-gpt", False, "full", 1, "AdamW", 3), ("tiny-gpt", True, "none", 2, "SGD", 1)]),
    "gpt-tp4": (4, [("tiny-gpt", True, "none", 1, "SGD", 1)]),
}


def _plan(world, sp, recompute, m):
    return Parallelism(world=world, gpus_per_node=world, tp=world, sp=sp, micro_batch=B, global_batch=B * m,
                       dtype="fp32", recompute=recompute)


def tp_steps(rank, world, key):
    """Module-level (spawned ranks import it): builds every configuration of CONFIGS[key],
    runs a warm-up step of each (one micro-batch: DTensor has no first-step-only
    collectives; the warm-up fills its sharding-propagation caches and the optimizer
    state), returns the recorded steps."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.profiler import record_function
    from torch.utils.checkpoint import checkpoint

    from commbench import torch_model
    mesh = init_device_mesh("cpu", (world,))
    steps = []
    for ci, (name, sp, recompute, m, optim, _) in enumerate(CONFIGS[key][1]):
        spec = models.get(name)
        model = torch_model.build(spec)
        gen = torch.Generator().manual_seed(1)          # the same batches on every tp rank
        batches = [(torch.randint(0, spec.vocab, (B, spec.seq), generator=gen),
                    torch.randint(0, spec.vocab, (B, spec.seq), generator=gen)) for _ in range(m)]
        with torch.no_grad():
            ref = F.cross_entropy(copy.deepcopy(model)(batches[0][0]).flatten(0, 1), batches[0][1].flatten())
        parallelize_module(model, mesh, tp_plan(spec, sp))
        if spec.tied_embeddings:
            model.head.weight = model.embed.weight
        # the local shards are those that strategies/common.rank_params describes
        local = [(n, p.to_local().numel() if hasattr(p, "to_local") else p.numel())
                 for n, p in model.named_parameters()]
        assert local == [(p.name, p.numel) for p in rank_params(spec, _plan(world, sp, recompute, m))], local
        if recompute == "full":
            for block in model.layers.values():
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        opt = getattr(torch.optim, optim)(model.parameters(), lr=1e-3)

        def step(batches, ci=ci, model=model, opt=opt, check=None):
            for tokens, targets in batches:
                with record_function(f"{MARKER} {ci} fwd"), loss_parallel():
                    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                if check is not None:
                    torch.testing.assert_close(loss.full_tensor(), check, rtol=1e-5, atol=1e-5)
                with record_function(f"{MARKER} {ci} bwd"), loss_parallel():
                    (loss / len(batches)).backward()
            with record_function(f"{MARKER} {ci} step"):
                opt.step()
                opt.zero_grad()
        step(batches[:1], check=ref)
        steps.append(functools.partial(step, batches))

    def recorded():
        for step in steps:
            step()
    return recorded


GLOO_CARRIES = {"all_reduce": ("all_reduce", "reduce_scatter"), "all_gather": ("all_gather",)}


def issued(events, world) -> dict:
    """{config index: Counter{(phase, collective, S in bytes): count}} from one rank's
    events. Each c10d:: collective (main thread, no shapes for tensor-list ops) is
    carried out by one gloo: operation, whose input gives the size (fp32 here). S as
    the busbw table: gloo's all_gather input is one rank's part, S = world x it; a
    reduce_scatter runs on gloo as an all_reduce of the whole input, which is S.
    DTensor's functional collectives are asynchronous and gloo runs them on its own
    worker threads (2 by default), so a gloo event may come after the next c10d
    event: each gloo event is paired with the oldest pending c10d event it can carry.
    Every collective is waited for inside the marker range that issued it (its result
    is used there), so a range holds both events of each of its collectives."""
    out, pending, cur = {}, [], None
    for name, shapes in events:
        if name.startswith(MARKER):
            assert not pending, f"unfinished collectives at {name}: {pending}"
            ci, phase = name.split()[1:]
            cur = (int(ci), phase)
            out.setdefault(cur[0], Counter())
        elif name in C10D_KIND:
            assert cur is not None, f"{name} outside a marker"
            pending.append(C10D_KIND[name])
        elif name.startswith("gloo:"):
            gop = name[len("gloo:"):]
            j = next(j for j, kind in enumerate(pending) if kind in GLOO_CARRIES[gop])
            kind = pending.pop(j)
            numel = 1
            for d in shapes[0]:
                numel *= d
            out[cur[0]][(cur[1], kind, 4 * numel * (world if kind == "all_gather" else 1))] += 1
        elif name.startswith("c10d::"):
            raise AssertionError(f"unexpected collective {name}")
    assert not pending, f"unfinished collectives at the end: {pending}"
    return out


@pytest.mark.parametrize("key", list(CONFIGS))
def test_proof_dtensor_matches_comm_ops(key):
    world, configs = CONFIGS[key]
    ranks = record(tp_steps, world, key)
    for ci, (name, sp, recompute, m, _, reads) in enumerate(configs):
        ops = tp.comm_ops(models.get(name), _plan(world, sp, recompute, m), flavour="dtensor", grad_reads=reads)
        want = per_phase(ops)
        for rank, events in enumerate(ranks):
            got = issued(events, world)[ci]
            assert got == want, f"{name} sp={sp} recompute={recompute} rank {rank}:\n got {sorted(got.items())}" \
                                f"\nwant {sorted(want.items())}"
