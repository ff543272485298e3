"""ComputeOps of a plan against hand-computed shapes and FLOPs (a GPT and a
Llama layer at tp = 1, 2, 4), their sum against Megatron's formula, recompute,
sequence parallelism, the optimizer shard and stage placement."""
import pytest

from commbench import models, plan
from commbench.compute.ops import compute_ops
from commbench.models import ModelSpec
from commbench.parallel import Parallelism

GPT = ModelSpec("gpt-test", num_layers=8, hidden=1024, heads=16, vocab=50304, seq=2048, arch="gpt")
LLAMA = ModelSpec("llama-test", num_layers=8, hidden=4096, heads=32, vocab=32000, seq=4096, kv_heads=8,
                  ffn_hidden=11008, arch="llama", tied_embeddings=False)


def by_name(ops):
    out = {}
    for op in ops:
        assert op.name not in out, f"two ops named {op.name}"
        out[op.name] = op
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_layer_gemms_and_attention(tp):
    b, s, h = 2, 2048, 1024
    par = Parallelism(world=tp, gpus_per_node=tp, tp=tp, micro_batch=b, global_batch=b * 3)
    ops = by_name(compute_ops(GPT, par))
    T = b * s
    # (name, m, n, k) written out: Linear weights [out, in]; fwd T x out x in,
    # dgrad T x in x out, wgrad out x in x T
    expected = {
        "qkv fwd": (T, 3 * h // tp, h), "qkv dgrad": (T, h, 3 * h // tp), "qkv wgrad": (3 * h // tp, h, T),
        "attn out fwd": (T, h, h // tp), "attn out dgrad": (T, h // tp, h), "attn out wgrad": (h, h // tp, T),
        "mlp up fwd": (T, 4 * h // tp, h), "mlp up dgrad": (T, h, 4 * h // tp), "mlp up wgrad": (4 * h // tp, h, T),
        "mlp down fwd": (T, h, 4 * h // tp), "mlp down dgrad": (T, 4 * h // tp, h),
        "mlp down wgrad": (h, 4 * h // tp, T),
        "logits fwd": (T, 50304 // tp, h),
    }
    for name, (m, n, k) in expected.items():
        op = ops[name]
        assert (op.m, op.n, op.k) == (m, n, k), name
        assert op.flops == 2 * m * n * k, name
        assert op.kind == "gemm"
    assert "mlp gate fwd" not in ops
    # 3 micro-batches per step, 8 layers on the one stage
    assert ops["qkv fwd"].count == 8 * 3 and ops["logits fwd"].count == 3
    att = ops["attention fwd"]
    assert (att.m, att.n, att.k, att.batch) == (s, s, 64, b * 16 // tp)
    assert att.flops == 4 * b * s * s * h / tp
    assert ops["attention bwd"].flops == 2 * att.flops
    assert dict(att.params)["kv_heads"] == 16 // tp
    # norms, dropout-add and GELU are memory-bound: rows x width, bytes at bf16
    ln = ops["norm1 fwd"]
    assert (ln.m, ln.n, ln.impl) == (T, h, "layernorm_fwd") and ln.nbytes == 2 * 2 * T * h
    gelu = ops["gelu fwd"]
    assert (gelu.m, gelu.n) == (T, 4 * h // tp) and gelu.nbytes == 2 * 2 * T * 4 * h // tp
    assert ops["residual1 fwd"].impl == "dropout_add_fwd"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_layer_gqa_and_swiglu(tp):
    b, s, h, d, f = 1, 4096, 4096, 128, 11008
    par = Parallelism(world=tp, gpus_per_node=tp, tp=tp, micro_batch=b)
    ops = by_name(compute_ops(LLAMA, par))
    T = b * s
    kv_local = 8 // tp                      # 8 kv heads split over tp
    qkv_out = h // tp + 2 * kv_local * d
    assert (ops["qkv fwd"].m, ops["qkv fwd"].n, ops["qkv fwd"].k) == (T, qkv_out, h)
    assert ops["qkv fwd"].flops == 2 * T * qkv_out * h
    for proj in ("mlp gate", "mlp up"):
        assert (ops[f"{proj} fwd"].n, ops[f"{proj} fwd"].k) == (f // tp, h)
        assert (ops[f"{proj} wgrad"].m, ops[f"{proj} wgrad"].n, ops[f"{proj} wgrad"].k) == (f // tp, h, T)
    assert (ops["mlp down fwd"].n, ops["mlp down fwd"].k) == (h, f // tp)
    att = ops["attention fwd"]
    assert dict(att.params)["heads"] == 32 // tp and dict(att.params)["kv_heads"] == kv_local
    assert att.flops == 4 * b * s * s * h / tp
    sw = ops["swiglu fwd"]
    assert (sw.m, sw.n, sw.nbytes) == (T, f // tp, 3 * 2 * T * f // tp)
    assert ops["norm1 fwd"].impl == "rmsnorm_fwd" and ops["residual1 fwd"].impl == "add_fwd"
    assert ops["rope fwd"].n == h // tp + kv_local * d
    assert (ops["logits fwd"].n, ops["embedding fwd"].k) == (32000 // tp, 32000 // tp)


def test_kv_heads_split_over_tp():
    m = ModelSpec("gqa", num_layers=2, hidden=512, heads=8, vocab=1000, seq=128, kv_heads=2, arch="llama",
                  tied_embeddings=False)
    ops = by_name(compute_ops(m, Parallelism(world=2, gpus_per_node=2, tp=2)))
    # 2 kv heads on 2 ranks: one kv head of 64 each, for K and for V
    assert ops["qkv fwd"].n == 512 // 2 + 2 * 64
    assert dict(ops["attention fwd"].params)["kv_heads"] == 1
    # Megatron-core divides the query groups over tp: 2 kv heads do not go 4 ways
    with pytest.raises(ValueError, match="kv heads 2 of gqa are not divisible by tp 4"):
        plan.build(m, Parallelism(world=4, gpus_per_node=4, tp=4))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_step_flops_equal_megatron_formula(tp, pp):
    """72 B s L h^2 (1 + s/6h + V/(12 L h)) summed over every rank of a model
    replica: the per-rank ops x tp ranks, over the pp stages."""
    B, s, L, h, V = 8, 2048, 8, 1024, 50304
    par = Parallelism(world=tp * pp * 2, gpus_per_node=tp * pp * 2, tp=tp, pp=pp, micro_batch=2, global_batch=B)
    ops = compute_ops(GPT, par)
    per_replica = 0.0
    for op in ops:
        if op.kind in ("gemm", "attention"):
            stages = pp if op.stage < 0 else 1
            per_replica += op.flops * op.count * tp * stages
    megatron = 72 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (12 * L * h))
    # the replica does B / dp samples; 2 replicas
    assert per_replica * 2 == pytest.approx(megatron, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_model_flops_are_megatrons_with_a_vocabulary_tp_does_not_divide(tp):
    # gpt3-350m's 50257 rows split unevenly: each rank's logits GEMM has ceil(V / tp)
    # rows, the model's FLOPs count V once
    from commbench.predict import model_flops
    m = models.get("gpt3-350m")
    par = Parallelism(world=tp, gpus_per_node=tp, tp=tp, global_batch=4, micro_batch=2)
    B, s, L, h, V = 4, m.seq, m.num_layers, m.hidden, m.vocab
    megatron = 72 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert model_flops(plan.build(m, par), par) == pytest.approx(megatron, rel=1e-12)


def test_tp_in_place_op_is_sized_without_recompute_and_has_a_twin_without_it():
    """The in-place op of a plan with recompute runs it (params.recompute) but is
    sized as the work without it, so the same plan without recompute gives its
    twin (ops.without_recompute), which the predictor may take in its place."""
    from commbench.compute.ops import without_recompute
    llama = models.get("tiny-llama")
    par = Parallelism(world=2, gpus_per_node=2, tp=2, global_batch=4, recompute="full")
    ops = compute_ops(llama, par)
    whole = next(o for o in ops if o.scope == "tp_stage")
    kernels = sum(o.flops * o.count for o in ops if o.scope in ("layer", "embedding", "head")
                  and not o.name.endswith("(recompute)"))
    assert any(o.name.endswith("(recompute)") for o in ops) and dict(whole.params)["recompute"] == "full"
    assert whole.flops * whole.count == pytest.approx(kernels, rel=1e-12)
    plain = next(o for o in compute_ops(llama, Parallelism(world=2, gpus_per_node=2, tp=2, global_batch=4))
                 if o.scope == "tp_stage")
    assert without_recompute(whole) == plain


def test_recomputed_forwards_sit_on_top_of_the_modules():
    """Every recompute mode times the whole stage (without recompute) and adds
    its recomputed forwards as their own ops: the layer forward module (full),
    the attention core (selective)."""
    for rc, extra in (("full", "layer fwd (module, recompute)"), ("selective", "attention fwd (recompute)")):
        ops = compute_ops(GPT, Parallelism(world=1, micro_batch=1, recompute=rc))
        assert {o.scope for o in ops if o.scope == "stage_module"} == {"stage_module"}
        (redo,) = [o for o in ops if o.scope == "recompute_module"]
        assert redo.name == extra and redo.phase == "bwd"


def test_recompute_adds_forward_work():
    base = Parallelism(world=1, micro_batch=1)
    none = compute_ops(GPT, base)
    sel = compute_ops(GPT, Parallelism(world=1, micro_batch=1, recompute="selective"))
    full = compute_ops(GPT, Parallelism(world=1, micro_batch=1, recompute="full"))
    extra_sel = {op.name for op in sel} - {op.name for op in none}
    assert extra_sel == {"attention fwd (recompute)"}
    extra_full = [op for op in full if op.name.endswith("(recompute)")]
    layer_fwd = [op for op in none if op.scope == "layer" and op.phase == "fwd"]
    assert sorted(op.impl for op in extra_full) == sorted(op.impl for op in layer_fwd)
    assert all(op.phase == "bwd" for op in extra_full)


def test_sequence_parallel_shrinks_norm_rows():
    par = Parallelism(world=4, gpus_per_node=4, tp=4, sp=True, micro_batch=1)
    ops = by_name(compute_ops(GPT, par))
    assert ops["norm1 fwd"].m == 2048 // 4 and ops["residual2 bwd"].m == 2048 // 4
    assert ops["qkv fwd"].m == 2048          # GEMMs see the all-gathered sequence


def test_optimizer_shard_and_stages():
    whole = by_name(compute_ops(GPT, Parallelism(world=1)))["adam step"]
    assert whole.m == GPT.num_params and whole.phase == "step" and whole.count == 1
    # mixed precision: 24 B of fp32 state read+written, 2 B gradient read, 2 B bf16 copy written
    assert whole.nbytes == GPT.num_params * (24 + 2 + 2)
    # ZeroRedundancyOptimizer hands out whole parameters, largest first: the 50304 x 1024
    # embedding alone is more than a quarter of the model, so its owner steps it and
    # nothing else, and the step waits for that rank
    z1 = by_name(compute_ops(GPT, Parallelism(world=4, gpus_per_node=4, zero=1)))["adam step"]
    assert 50304 * 1024 > GPT.num_params / 4 and (z1.m, z1.n) == (50304 * 1024, 1)
    # DeepSpeed steps one flat partition of ceil(numel / dp)
    ds = by_name(compute_ops(GPT, Parallelism(world=4, gpus_per_node=4, zero=1, zero_flavour="deepspeed")))
    assert (ds["adam step"].m, ds["adam step"].n) == (-(-GPT.num_params // 4), 1)
    # FSDP2 pads every parameter's dim 0 to a multiple of dp: tiny-gpt over 3 ranks, the
    # padded units of tests/test_strategy_zero.py's test_fsdp_padding_small, a third each
    root = 513 * 64 + 66 * 64 + 2 * 66
    layer = 4 * 66 * 64 + 66 * 256 + 258 * 64 + 258 + 5 * 66 + 4 * 66
    tiny = models.get("tiny-gpt")
    z3 = by_name(compute_ops(tiny, Parallelism(world=3, gpus_per_node=3, zero=3, global_batch=3)))["adam step"]
    assert z3.m == (root + 4 * layer) // 3
    z0 = by_name(compute_ops(GPT, Parallelism(world=4, gpus_per_node=4, zero=0)))["adam step"]
    assert z0.m == GPT.num_params
    ops = compute_ops(GPT, Parallelism(world=2, gpus_per_node=2, pp=2))
    assert {op.stage for op in ops if op.scope == "embedding"} == {0}
    assert {op.stage for op in ops if op.scope == "head"} == {1}
    assert {op.stage for op in ops if op.scope == "layer"} == {-1}
    adam = sorted((op.stage, op.m) for op in ops if op.scope == "optimizer")
    assert [s for s, _ in adam] == [0, 1]
    # both stages hold 4 layers; stage 0 also the embedding and positions, stage 1
    # the final norm and a copy of the tied embedding for the logits
    layer = GPT.layer_params()
    assert adam[0][1] == 4 * layer + GPT.vocab * GPT.hidden + GPT.seq * GPT.hidden
    assert adam[1][1] == 4 * layer + 2 * GPT.hidden + GPT.vocab * GPT.hidden


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_timed_layer_module_is_the_models_layer_at_the_rank_shard(spec, tp):
    """The layer timed as a module holds the layer's parameters at tp = 1 and one
    rank's share of every projection at tp > 1 (norms replicated)."""
    from commbench.compute.modules import local_layer
    par = Parallelism(world=tp, gpus_per_node=tp, tp=tp, micro_batch=1, global_batch=2)
    op = next(o for o in compute_ops(spec, par) if o.impl == "layer_fwd")
    layer = local_layer(dict(op.params))
    h, f, kv = spec.hidden, spec.ffn_hidden, spec.kv_dim
    norms = (4 if spec.arch == "gpt" else 2) * h
    weights = (2 * h * h + 2 * h * kv + (3 if spec.arch == "llama" else 2) * h * f) // tp
    biases = (h + 2 * kv + f) // tp + 2 * h if spec.arch == "gpt" else 0    # column shards split, row ones do not
    assert sum(p.numel() for p in layer.parameters()) == norms + weights + biases
    if tp == 1:
        assert sum(p.numel() for p in layer.parameters()) == spec.layer_params()


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
@pytest.mark.parametrize("pp", [1, 2])
def test_timed_stages_hold_the_parameters_training_shards(name, pp):
    """The stages timed whole (and under FSDP in place) hold what training.py
    trains: one stage ties its head to its embedding as the model does (an
    untied copy would gather and reduce-scatter V x h more under ZeRO-2/3),
    while pipeline stages each keep their own copy of a tied embedding."""
    import torch

    from commbench import torch_model
    from commbench.compute import modules
    spec = models.get(name)
    par = Parallelism(world=pp, gpus_per_node=pp, pp=pp, micro_batch=1, global_batch=4)
    stages = [o for o in compute_ops(spec, par) if o.impl == "stage_fwd"]
    held = sum(sum(p.numel() for p in modules.build(o, "cpu", torch.float32)[0].parameters()) for o in stages)
    whole = sum(p.numel() for p in torch_model.build(spec).parameters())
    copies = spec.vocab * spec.hidden if spec.tied_embeddings and pp > 1 else 0
    assert held == whole + copies
