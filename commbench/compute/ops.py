"""ModelSpec + Parallelism -> ComputeOps: the kernels one optimizer step of a
plan runs on one rank, at its tensor-parallel shard's shapes (Megatron layout:
fused QKV and gate/up column-parallel, attention output and MLP down row-parallel,
vocabulary-parallel embedding and logits).

Notation: b micro-batch, s sequence, T = b s tokens, h hidden, a heads, d head
dim, kv = kv heads x d, f ffn hidden, V vocab, t tensor-parallel size, e bytes
per element of the plan's dtype, m micro-batches per step, L layers per stage.

FLOPs: a GEMM C[m,n] = A[m,k] B[k,n] is 2 m n k (one multiply and one add per
term). A Linear's backward is two GEMMs of the forward's FLOPs: the input
gradient (dgrad) and the weight gradient (wgrad). Attention is counted as
Megatron counts it for model FLOPs: the full s x s score matrix (QK^T and AV,
4 b s^2 h / t forward, twice that backward), although a causal flash kernel
skips the masked half. With these conventions the FLOPs of all GEMM and
attention ops of a step sum to Megatron's 72 B s L h^2 (1 + s/6h + V/(12 L h))
for a GPT with 4h MLP and no recompute (tests/test_compute_ops.py checks it).

Bytes: what a kernel must read and write at least once from device memory;
the derivation is written beside each op."""
import json
from dataclasses import asdict, replace

from commbench.models import ModelSpec
from commbench.parallel import DTYPE_BYTES, Parallelism
from commbench.strategies import pp, tp
from commbench.strategies.common import rank_params, stage_kind
from commbench.workload import ComputeOp

# fp32 master weights, Adam's m and v: read and written once per step (24 B per
# element), the gradient read once (grad dtype), and for 16-bit training the
# 16-bit copy of the parameters written (2 B).
ADAM_STATE_RW_BYTES = 24
# FLOPs per element of one Adam update (m, v moments, bias corrections, sqrt,
# division, the update): about 12 by the usual count.
ADAM_FLOPS_PER_ELEMENT = 12


def _gemm(name, m, n, k, count, phase, dtype, e, impl, **kw):
    """C[m,n] = A[m,k] B[k,n]: 2mnk FLOPs; reads A and B, writes C once."""
    return ComputeOp(name=name, kind="gemm", m=m, n=n, k=k, flops=2.0 * m * n * k,
                     nbytes=e * (m * k + k * n + m * n), count=count, phase=phase, dtype=dtype, impl=impl, **kw)


def linear(name, tokens, in_dim, out_dim, count, dtype, e, recompute=False, **kw):
    """A Linear y[T,out] = x[T,in] W[out,in]^T and its backward:
    fwd   y  = x  W^T     m=T   n=out k=in   (gemm_nt)
    dgrad dx = dy W       m=T   n=in  k=out  (gemm_nn)
    wgrad dW = dy^T x     m=out n=in  k=T    (gemm_tn)"""
    ops = [_gemm(f"{name} fwd", tokens, out_dim, in_dim, count, "fwd", dtype, e, "gemm_nt", **kw),
           _gemm(f"{name} dgrad", tokens, in_dim, out_dim, count, "bwd", dtype, e, "gemm_nn", **kw),
           _gemm(f"{name} wgrad", out_dim, in_dim, tokens, count, "bwd", dtype, e, "gemm_tn", **kw)]
    if recompute:
        ops.append(replace(ops[0], name=f"{name} fwd (recompute)", phase="bwd"))
    return ops


def _elementwise(name, impl, rows, cols, nbytes, flops, count, phase, dtype, **kw):
    return ComputeOp(name=name, kind="elementwise", m=rows, n=cols, flops=float(flops), nbytes=int(nbytes),
                     count=count, phase=phase, dtype=dtype, impl=impl, **kw)


def attention_ops(model: ModelSpec, par: Parallelism, count: int) -> list:
    """Core attention (scaled_dot_product_attention, causal) on the t-th share of
    the heads: q (b, a/t, s, d), k and v (b, kv heads/t, s, d).
    fwd FLOPs 2 b (a/t) s^2 d for QK^T + the same for AV = 4 b s^2 h / t;
    bwd twice the forward (dQ, dK, dV and dS). Bytes (flash: scores never leave
    on-chip memory): fwd reads q, k, v and writes o; bwd reads q, k, v, o, do and
    writes dq, dk, dv."""
    b, s, d, e = par.micro_batch, par.seq_for(model), model.head_dim, DTYPE_BYTES[par.dtype]
    heads = model.heads // par.tp
    kv_heads = max(1, model.kv_heads // par.tp)
    fwd_flops = 4.0 * b * heads * s * s * d
    q_bytes, kv_bytes = e * b * s * d * heads, e * b * s * d * kv_heads
    common = dict(m=s, n=s, k=d, batch=b * heads, dtype=par.dtype,
                  params=(("causal", True), ("heads", heads), ("kv_heads", kv_heads), ("micro_batch", b)))
    ops = [ComputeOp(name="attention fwd", kind="attention", flops=fwd_flops, nbytes=2 * q_bytes + 2 * kv_bytes,
                     count=count, phase="fwd", impl="sdpa_fwd", **common),
           ComputeOp(name="attention bwd", kind="attention", flops=2 * fwd_flops, nbytes=4 * q_bytes + 4 * kv_bytes,
                     count=count, phase="bwd", impl="sdpa_bwd", **common)]
    if par.recompute in ("selective", "full"):
        # selective recompute (Korthikanti et al. 2022) reruns exactly the core attention forward
        ops.append(replace(ops[0], name="attention fwd (recompute)", phase="bwd"))
    return ops


def _norm_ops(name, model, rows, count, dtype, e, recompute):
    """LayerNorm (GPT) / RMSNorm (Llama) over h: fwd reads x, writes y (2 T h e);
    bwd reads dy and x, writes dx (3 T h e); the per-row statistics are negligible.
    About 8 FLOPs per element forward (mean, variance, normalize, scale, shift)
    and 12 backward."""
    h = model.hidden
    kind = "layernorm" if model.arch == "gpt" else "rmsnorm"
    ops = [_elementwise(f"{name} fwd", f"{kind}_fwd", rows, h, 2 * e * rows * h, 8 * rows * h, count, "fwd", dtype),
           _elementwise(f"{name} bwd", f"{kind}_bwd", rows, h, 3 * e * rows * h, 12 * rows * h, count, "bwd", dtype)]
    if recompute:
        ops.append(replace(ops[0], name=f"{name} fwd (recompute)", phase="bwd"))
    return ops


def _residual_ops(name, model, rows, count, dtype, e, recompute):
    """GPT: Megatron's fused bias-dropout-add, out = residual + dropout(x + bias):
    fwd reads x and the residual, writes out and a 1-byte mask (3 T h e + T h);
    bwd reads dy and the mask, writes dx (2 T h e + T h); the residual's gradient
    is dy itself. Llama (no dropout, no bias): out = residual + x, 3 T h e
    forward; backward sums the two branches' gradients, 3 T h e."""
    h = model.hidden
    if model.arch == "gpt":
        ops = [_elementwise(f"{name} fwd", "dropout_add_fwd", rows, h, 3 * e * rows * h + rows * h, 3 * rows * h,
                            count, "fwd", dtype),
               _elementwise(f"{name} bwd", "dropout_add_bwd", rows, h, 2 * e * rows * h + rows * h, rows * h,
                            count, "bwd", dtype)]
        fwd = ops[0]
    else:
        ops = [_elementwise(f"{name} fwd", "add_fwd", rows, h, 3 * e * rows * h, rows * h, count, "fwd", dtype),
               _elementwise(f"{name} bwd", "add_bwd", rows, h, 3 * e * rows * h, rows * h, count, "bwd", dtype)]
    if recompute:
        fwd = ops[0]
        ops.append(replace(fwd, name=f"{fwd.name} (recompute)", phase="bwd"))
    return ops


def _activation_ops(model, tokens, f_local, count, dtype, e, recompute):
    """GPT: GELU on T x f/t: fwd reads x, writes y (2 T f/t e), bwd reads dy, x,
    writes dx (3); about 8 FLOPs per element (tanh form) forward, 12 backward.
    Llama: SwiGLU silu(g) * u: fwd reads g and u, writes y (3 T f/t e); bwd reads
    dy, g, u and writes dg, du (5); about 6 and 10 FLOPs per element."""
    n = tokens * f_local
    if model.gated_mlp:
        ops = [_elementwise("swiglu fwd", "swiglu_fwd", tokens, f_local, 3 * e * n, 6 * n, count, "fwd", dtype),
               _elementwise("swiglu bwd", "swiglu_bwd", tokens, f_local, 5 * e * n, 10 * n, count, "bwd", dtype)]
    else:
        ops = [_elementwise("gelu fwd", "gelu_fwd", tokens, f_local, 2 * e * n, 8 * n, count, "fwd", dtype),
               _elementwise("gelu bwd", "gelu_bwd", tokens, f_local, 3 * e * n, 12 * n, count, "bwd", dtype)]
    if recompute:
        ops.append(replace(ops[0], name=f"{ops[0].name} (recompute)", phase="bwd"))
    return ops


def layer_ops(model: ModelSpec, par: Parallelism, count: int) -> list:
    """One transformer layer, forward and backward, at the rank's TP shard:
    count = layers on the stage x micro-batches per step."""
    t, e, dtype = par.tp, DTYPE_BYTES[par.dtype], par.dtype
    tokens = par.micro_batch * par.seq_for(model)
    # with sequence parallelism norms, dropout and residuals run on s/t tokens
    rows = tokens // t if par.sp else tokens
    h, f = model.hidden, model.ffn_hidden
    kv = model.kv_heads // t * model.head_dim       # kv heads split over tp (check_model: t divides them)
    full = par.recompute == "full"
    ops = _norm_ops("norm1", model, rows, count, dtype, e, full)
    ops += linear("qkv", tokens, h, h // t + 2 * kv, count, dtype, e, full)
    if model.arch == "llama":
        # rotary embedding of the local q and k: fwd reads and writes them
        # (2 e per element), bwd rotates dq and dk back the same way; 3 FLOPs per element
        width = h // t + kv
        n = tokens * width
        ops.append(_elementwise("rope fwd", "rope_fwd", tokens, width, 2 * e * n, 3 * n, count, "fwd", dtype))
        ops.append(_elementwise("rope bwd", "rope_bwd", tokens, width, 2 * e * n, 3 * n, count, "bwd", dtype))
        if full:
            ops.append(replace(ops[-2], name="rope fwd (recompute)", phase="bwd"))
    ops += attention_ops(model, par, count)
    ops += linear("attn out", tokens, h // t, h, count, dtype, e, full)
    ops += _residual_ops("residual1", model, rows, count, dtype, e, full)
    ops += _norm_ops("norm2", model, rows, count, dtype, e, full)
    if model.gated_mlp:
        ops += linear("mlp gate", tokens, h, f // t, count, dtype, e, full)
    ops += linear("mlp up", tokens, h, f // t, count, dtype, e, full)
    ops += _activation_ops(model, tokens, f // t, count, dtype, e, full)
    ops += linear("mlp down", tokens, f // t, h, count, dtype, e, full)
    ops += _residual_ops("residual2", model, rows, count, dtype, e, full)
    return ops


def embedding_ops(model: ModelSpec, par: Parallelism, count: int) -> list:
    """Stage 0: vocabulary-parallel lookup of T tokens in V/t rows of h. fwd reads
    T rows and writes T x h (2 T h e; GPT adds learned positions: 3 T h e more);
    bwd zeroes the V/t x h gradient and scatter-adds T rows into it
    (V/t h e + 3 T h e)."""
    e, dtype = DTYPE_BYTES[par.dtype], par.dtype
    tokens, h, vl = par.micro_batch * par.seq_for(model), model.hidden, -(-model.vocab // par.tp)
    pos = 3 * e * tokens * h if model.arch == "gpt" else 0
    kw = dict(stage=0, scope="embedding")
    return [ComputeOp(name="embedding fwd", kind="elementwise", m=tokens, n=h, k=vl, flops=float(tokens * h if pos else 0),
                      nbytes=2 * e * tokens * h + pos, count=count, phase="fwd", dtype=dtype, impl="embedding_fwd", **kw),
            ComputeOp(name="embedding bwd", kind="elementwise", m=tokens, n=h, k=vl, flops=float(tokens * h),
                      nbytes=e * vl * h + 3 * e * tokens * h, count=count, phase="bwd", dtype=dtype,
                      impl="embedding_bwd", **kw)]


def head_ops(model: ModelSpec, par: Parallelism, count: int) -> list:
    """Last stage: final norm, the vocabulary-parallel logits GEMM (T x h by
    h x V/t) and the cross-entropy over the local V/t logits. Cross-entropy fwd
    reads the logits twice (max, then the sum of exponentials) = 2 T V/t e; bwd
    reads them and writes their gradient (2 T V/t e); about 5 FLOPs per logit
    each way. (Its max and sum all-reduces over tp are CommOps.)"""
    e, dtype, last = DTYPE_BYTES[par.dtype], par.dtype, par.pp - 1
    tokens = par.micro_batch * par.seq_for(model)
    rows = tokens // par.tp if par.sp else tokens
    vl = -(-model.vocab // par.tp)          # the vocabulary padded to a multiple of t
    kw = dict(stage=last, scope="head")
    norm = _norm_ops("final norm", model, rows, count, dtype, e, False)
    logits = linear("logits", tokens, model.hidden, vl, count, dtype, e, False)
    n = tokens * vl
    ce = [_elementwise("cross entropy fwd", "cross_entropy_fwd", tokens, vl, 2 * e * n, 5 * n, count, "fwd", dtype),
          _elementwise("cross entropy bwd", "cross_entropy_bwd", tokens, vl, 2 * e * n, 5 * n, count, "bwd", dtype)]
    return [replace(op, **kw) for op in norm + logits + ce]


def _adam_share(model: ModelSpec, par: Parallelism, stage: int) -> tuple:
    """(elements, tensors) the busiest rank of a stage steps (the step waits for it):
    - no ZeRO: its whole TP/PP shard;
    - ZeRO-1, torch: ZeroRedundancyOptimizer's greedy partition of whole
      parameters (strategies.zero.zero_partition): its largest owner's;
    - ZeRO-1/2, DeepSpeed: one flat partition of ceil(numel / dp) elements;
    - ZeRO-2/3, torch (FSDP2): every parameter's dim 0 padded to a multiple of
      dp, 1/dp of each (strategies.fsdp units)."""
    params = rank_params(model, par, stage)
    numel, n = sum(p.numel for p in params), par.dp
    if par.zero == 0 or n == 1:
        return numel, len(params)
    if par.zero_flavour == "deepspeed":
        return -(-numel // n), 1
    if par.zero == 1:
        from commbench.strategies.zero import zero_partition
        owned = max(zero_partition(params, n), key=lambda ps: sum(p.numel for p in ps))
        return sum(p.numel for p in owned), len(owned)
    from commbench.strategies import fsdp
    return sum(u.padded_numel(n) for u in fsdp.fsdp_units(model, par, stage)) // n, len(params)


def optimizer_ops(model: ModelSpec, par: Parallelism) -> list:
    """Adam over the parameters the busiest rank of each stage updates
    (_adam_share). Bytes per element: ADAM_STATE_RW_BYTES (fp32 master, m, v
    read and written) + the gradient read (grad dtype) + the 16-bit parameter
    copy written when training in 16 bits."""
    e, eg = DTYPE_BYTES[par.dtype], DTYPE_BYTES[par.grad_dtype]
    copy = e if e < 4 else 0
    ops, shares = [], {}
    for stage in range(par.pp):
        kind = stage_kind(par, stage)
        if kind not in shares:
            shares[kind] = _adam_share(model, par, stage)
        numel, tensors = shares[kind]
        ops.append(ComputeOp(name="adam step", kind="optimizer", m=numel, n=tensors,
                             flops=float(ADAM_FLOPS_PER_ELEMENT * numel),
                             nbytes=numel * (ADAM_STATE_RW_BYTES + eg + copy), count=1, phase="step",
                             dtype=par.dtype, impl="adam", stage=stage, scope="optimizer"))
    return ops


def _module_op(name, impl, kernel_ops, phase, count, scope, stage, params, dtype):
    """One module's forward or backward as a single timed call (kind 'other'):
    its FLOPs and bytes are those of its kernels of that phase."""
    mine = [op for op in kernel_ops if op.phase == phase and "(recompute)" not in op.name]
    return ComputeOp(name=name, kind="other", m=params["tokens"], n=params["hidden"],
                     flops=float(sum(op.flops for op in mine)), nbytes=sum(op.nbytes for op in mine), count=count,
                     phase="fwd" if phase == "fwd" else "bwd", dtype=dtype, impl=impl, stage=stage, scope=scope,
                     params=tuple(sorted(params.items())))


def _layer_shape(model: ModelSpec, par: Parallelism) -> dict:
    """A transformer layer at the rank's TP shard, as compute.modules builds it."""
    t = par.tp
    return {"arch": model.arch, "hidden": model.hidden, "tokens": par.micro_batch * par.seq_for(model),
            "micro_batch": par.micro_batch, "seq": par.seq_for(model), "heads": model.heads // t,
            "kv_heads": max(1, model.kv_heads // t), "head_dim": model.head_dim, "ffn": model.ffn_hidden // t}


def _stage_shape(model: ModelSpec, par: Parallelism, stage: int) -> dict:
    """A pipeline stage at the rank's TP shard (compute.modules.LocalStage); tied:
    its head is its embedding's weight, as training.py ties them where one
    stage holds both (torch's pipelining shares no weight across stages)."""
    first, last = stage == 0, stage == par.pp - 1
    return dict(_layer_shape(model, par), vocab=-(-model.vocab // par.tp), layers=model.num_layers // par.pp,
                first=first, last=last, tied=bool(model.tied_embeddings and first and last))


def _stage_work(model: ModelSpec, par: Parallelism, stage: int, layer: list) -> list:
    """The kernels of one micro-batch of a stage: its layers (layer: one layer's
    ops), the embedding on the first stage, the head on the last."""
    return layer * (model.num_layers // par.pp) + (embedding_ops(model, par, 1) if stage == 0 else []) + \
        (head_ops(model, par, 1) if stage == par.pp - 1 else [])


def module_ops(model: ModelSpec, par: Parallelism, count_layers: int, count_head: int) -> list:
    """The same work timed a module at a time, as a framework runs it: a
    transformer layer at the rank's TP shard (commbench.compute.modules), the
    head (final norm, logits, cross-entropy), and each pipeline stage whole,
    forward and backward of one micro-batch. Their times include what the kernel
    sum leaves out: launch and autograd overhead, framework glue, fusion, and
    (timed as the slowest rank of each iteration) the ranks' drift over a whole
    micro-batch. The predictor uses the coarsest one measured (predict.py)."""
    common = _layer_shape(model, par)
    layer = layer_ops(model, replace(par, recompute="none"), 1)
    ops = [_module_op("layer fwd (module)", "layer_fwd", layer, "fwd", count_layers, "layer_module", -1, common,
                      par.dtype),
           _module_op("layer bwd (module)", "layer_bwd", layer, "bwd", count_layers, "layer_module", -1, common,
                      par.dtype)]
    # the recomputed forwards, on top of the modules (with or without the whole stage)
    if par.recompute == "full":
        ops.append(replace(ops[0], name="layer fwd (module, recompute)", phase="bwd", scope="recompute_module"))
    elif par.recompute == "selective":
        att = next(op for op in attention_ops(model, par, count_layers) if op.name == "attention fwd (recompute)")
        ops.append(replace(att, scope="recompute_module"))
    head = head_ops(model, par, 1)
    hp = dict(common, vocab=-(-model.vocab // par.tp))
    ops += [_module_op("head fwd (module)", "head_fwd", head, "fwd", count_head, "head_module", par.pp - 1, hp,
                       par.dtype),
            _module_op("head bwd (module)", "head_bwd", head, "bwd", count_head, "head_module", par.pp - 1, hp,
                       par.dtype)]
    # the whole stage as the step calls it, one micro-batch: what the kernel and
    # layer sums leave out between modules is in it too, and under full
    # recompute its layers checkpointed as training checkpoints them (the
    # recomputed forwards and the checkpoint's own work in its backward)
    for stage in range(par.pp):
        sp, work = stage_module_shape(model, par, stage), _stage_work(model, par, stage, layer)
        for phase in ("fwd", "bwd"):
            op = _module_op(f"stage {stage} {phase} (module)", f"stage_{phase}", work, phase, count_head,
                            "stage_module", stage, sp, par.dtype)
            if phase == "bwd" and stage_recomputes(op):
                again = [o for o in layer if o.phase == "fwd"] * (model.num_layers // par.pp)
                op = replace(op, flops=op.flops + sum(o.flops for o in again),
                             nbytes=op.nbytes + sum(o.nbytes for o in again))
            ops.append(op)
    return ops


def stage_module_shape(model: ModelSpec, par: Parallelism, stage: int) -> dict:
    """A whole stage as a module op times it: its shape (_stage_shape) and,
    under full recompute, recompute 'full' (compute.modules checkpoints each
    of its layers). Selective recompute is not in it: the recomputed attention
    core comes on top (scope recompute_module)."""
    sp = _stage_shape(model, par, stage)
    return dict(sp, recompute="full") if par.recompute == "full" else sp


def stage_recomputes(op) -> bool:
    """Whether a stage-level op (a stage module, a micro-batch under FSDP in
    place) runs the plan's full recompute in its own time."""
    return dict(op.params).get("recompute") == "full"


def without_recompute(op):
    """The same stage micro-batch timed with TP in place (scope 'tp_stage') but
    without recompute: a plan with recompute is predicted from it plus its
    recomputed forwards where only that was measured (predict.tp_in_place)."""
    return replace(op, params=tuple(sorted(dict(op.params, recompute="none").items())))


# FSDP2 with and without reshard after forward: the same wrapper, one stands in for the other
FRAMEWORK_STAND_INS = {"fsdp": "fsdp_reshard", "fsdp_reshard": "fsdp"}


def framework_stand_in(op):
    """The framework op (scope 'framework') of the closest other wrapper, timed
    in another plan's measurements (ZeRO-3's FSDP micro-batch for ZeRO-2's and
    back), or None."""
    other = FRAMEWORK_STAND_INS.get(dict(op.params).get("wrapper"))
    if op.scope != "framework" or other is None:
        return None
    return replace(op, params=tuple(sorted(dict(op.params, wrapper=other).items())))


def framework_ops(model: ModelSpec, par: Parallelism) -> list:
    """The data-parallel framework's own work on a rank, per stage, timed on one
    rank bare and wrapped (compute/framework.py; kind 'other', scope
    'framework'): a micro-batch's forward and backward (phase 'fwd+bwd') under
    the plan's wrapper (DDP: the last micro-batch of a step synchronises, the
    others run under no_sync; ZeRO-2/3: FSDP2 on every micro-batch) and the bare
    stage as often; the optimizer step (ZeRO-1: ZeroRedundancyOptimizer;
    ZeRO-2/3: Adam over FSDP2's shards) and bare Adam. Without data parallelism
    there is no wrapper: no ops. The predictor uses them only where measured:
    a SystemSpec has no framework cost."""
    if par.dp == 1:
        return []
    m = par.num_microbatches
    wrapped = {0: [("ddp", 1), ("ddp_no_sync", m - 1)], 1: [("ddp", 1), ("ddp_no_sync", m - 1)],
               2: [("fsdp", m)], 3: [("fsdp_reshard", m)]}[par.zero]
    optimizer = {1: "zero1", 2: "fsdp", 3: "fsdp"}.get(par.zero)
    layer = layer_ops(model, replace(par, recompute="none"), 1)
    adams = optimizer_ops(model, replace(par, zero=0))
    ops = []
    for stage in range(par.pp):
        sp = dict(_stage_shape(model, par, stage), dtype=par.dtype, grad_dtype=par.grad_dtype,
                  bucket_mb=par.bucket_mb, dp=par.dp)
        work = _stage_work(model, par, stage, layer)
        adam = adams[stage]

        def op(name, impl, wrapper, count, phase, like):
            return ComputeOp(name=f"stage {stage} {name} ({wrapper})", kind="other", m=sp["tokens"], n=model.hidden,
                             flops=float(sum(o.flops for o in like)), nbytes=sum(o.nbytes for o in like),
                             count=count, phase=phase, dtype=par.dtype, impl=impl, stage=stage, scope="framework",
                             params=tuple(sorted(dict(sp, wrapper=wrapper).items())))
        ops += [op("micro-batch", "dp_microbatch", w, c, "fwd+bwd", work) for w, c in wrapped + [("none", m)] if c > 0]
        if optimizer:
            ops += [op("optimizer step", "dp_optimizer", w, 1, "step", [adam]) for w in (optimizer, "none")]
    return ops


def fsdp_stage_ops(model: ModelSpec, par: Parallelism) -> list:
    """ZeRO-2/3 (torch flavour, data parallelism alone): the micro-batch under
    FSDP2 over the plan's dp group, its collectives in place
    (compute/fsdp_stage.py; kind 'other', scope 'dp_in_place', phase 'fwd+bwd',
    counted m times a step). Under pipelining FSDP defers its reduce-scatters to
    the end of the step, which one micro-batch alone does not do, and with
    tensor parallelism the stage's TP is timed in place on its own: none there."""
    if par.zero not in (2, 3) or par.zero_flavour != "torch" or par.pp > 1 or par.tp > 1 or par.dp == 1:
        return []
    layer = layer_ops(model, replace(par, recompute="none"), 1)
    wrapper = "fsdp" if par.zero == 2 else "fsdp_reshard"
    work = _stage_work(model, par, 0, layer)
    if par.recompute == "full":         # timed with its layers checkpointed (stage_module_shape)
        work += [o for o in layer if o.phase == "fwd"] * (model.num_layers // par.pp)
    sp = dict(stage_module_shape(model, par, 0), dtype=par.dtype, grad_dtype=par.grad_dtype, wrapper=wrapper,
              world=par.world, tp=par.tp, pp=par.pp, dp=par.dp)
    return [ComputeOp(name=f"stage 0 micro-batch with FSDP in place ({wrapper})", kind="other", m=sp["tokens"],
                      n=model.hidden, flops=float(sum(o.flops for o in work)), nbytes=sum(o.nbytes for o in work),
                      count=par.num_microbatches, phase="fwd+bwd", dtype=par.dtype, impl="fsdp_microbatch",
                      stage=0, scope="dp_in_place", params=tuple(sorted(sp.items())))]


def tp_stage_ops(model: ModelSpec, par: Parallelism, flavour: str) -> list:
    """Each stage's micro-batch forward and backward timed in place
    (compute/tp_stage.py; kind 'other', scope 'tp_stage', phase 'fwd+bwd',
    counted m times a step): the stage as the torch implementation of the tp
    flavour runs it over the rank's tensor-parallel group, its compute and its
    TP collectives together. None without tensor parallelism, or where that
    implementation cannot run the plan (strategies.tp.implementation_limit)."""
    if par.tp == 1 or tp.implementation_limit(model, par, flavour):
        return []
    layer = layer_ops(model, replace(par, recompute="none"), 1)   # its size: the work without recompute
    spec = json.dumps(asdict(model), sort_keys=True)      # the implementation builds the real model
    ops = []
    for stage in range(par.pp):
        work = _stage_work(model, par, stage, layer)
        sp = dict(_stage_shape(model, par, stage), tp=par.tp, pp=par.pp, sp=par.sp, dtype=par.dtype,
                  recompute=par.recompute, flavour=flavour, model=spec)
        ops.append(ComputeOp(name=f"stage {stage} micro-batch with TP in place ({flavour})", kind="other",
                             m=sp["tokens"], n=model.hidden, flops=float(sum(o.flops for o in work)),
                             nbytes=sum(o.nbytes for o in work), count=par.num_microbatches, phase="fwd+bwd",
                             dtype=par.dtype, impl="tp_microbatch", stage=stage, scope="tp_stage",
                             params=tuple(sorted(sp.items()))))
    return ops


def pipeline_stage_ops(model: ModelSpec, par: Parallelism) -> list:
    """Each virtual stage's micro-batch forward and backward timed inside the
    pipeline that runs them (compute/pipeline_stage.py; kind 'other', scope
    'pp_stage', stage = the pp rank that holds it, counted m times a step):
    its share of the rank's busy time between waits for the peers in the
    plan's own torch.distributed.pipelining schedule (forward_one_chunk /
    backward_one_chunk and the step's work around them), with the other
    micro-batches' activations alive and the peers computing; and each pp
    rank's optimizer step as that step runs it, to the step's end (scope
    'pp_optimizer', phase 'step', once a step: the Adam of optimizer_ops,
    timed in place); and the stage boundaries' transfers as that pipeline
    meets them, one op per tier (intra-, inter-node) of its boundaries
    (scope 'pp_p2p', the p2p time of the pipeline simulation). For a
    pipeline (pp > 1) without recompute, alone or under DDP (dp > 1, ZeRO 0 or
    torch's ZeRO-1, DDP with ZeroRedundancyOptimizer), with or without tensor
    parallelism (DTensor's, as training runs a TP pipeline): with TP a chunk
    holds its stage's TP collectives as they run between its kernels, the peer
    stages' ranks computing meanwhile or idle in the fill and drain, as in the
    step; under DDP each chunk's last backward of a step, which holds DDP's
    gradient reduction, is left out of its backward's samples and every dp
    replica of a stage times it (so it needs two micro-batches at least).
    Under ZeRO-1 the chunks only: its optimizer step holds the parameters'
    broadcasts, which the predictor places on their own. ZeRO-2/3 put FSDP's
    collectives in every chunk: no ops."""
    ddp_ok = (par.zero == 0 or (par.zero == 1 and par.zero_flavour == "torch")) and par.num_microbatches >= 2
    if par.pp == 1 or (par.dp > 1 and not ddp_ok) or par.recompute != "none":
        return []
    layer = layer_ops(model, par, 1)
    nvirt = par.pp * par.interleave
    plan = json.dumps({"world": par.world, "pp": par.pp, "micro_batch": par.micro_batch,
                       "global_batch": par.global_batch, "seq": par.seq_for(model), "dtype": par.dtype,
                       "schedule": par.schedule, "interleave": par.interleave,
                       **({"bucket_mb": par.bucket_mb, "grad_dtype": par.grad_dtype} if par.dp > 1 else {}),
                       **({"zero": par.zero} if par.dp > 1 and par.zero else {}),
                       **({"tp": par.tp, "sp": par.sp} if par.tp > 1 else {})},
                      sort_keys=True)
    common = dict(_layer_shape(model, par), plan=plan, model=json.dumps(asdict(model), sort_keys=True))
    ops = []
    for k in range(nvirt):
        work = layer * (model.num_layers // nvirt) + (embedding_ops(model, par, 1) if k == 0 else []) + \
            (head_ops(model, par, 1) if k == nvirt - 1 else [])
        for phase in ("fwd", "bwd"):
            ops.append(_module_op(f"virtual stage {k} {phase} (in the pipeline)", f"pipeline_{phase}", work, phase,
                                  par.num_microbatches, "pp_stage", k % par.pp, dict(common, chunk=k), par.dtype))
    for adam in optimizer_ops(model, par) if par.zero == 0 or par.dp == 1 else []:
        ops.append(replace(adam, name=f"stage {adam.stage} adam step (in the pipeline)",
                           impl="pipeline_optimizer", scope="pp_optimizer",
                           params=tuple(sorted(dict(common, rank_stage=adam.stage).items()))))
    message = pp.message_numel(model, par) * DTYPE_BYTES[par.dtype]
    for nodes in sorted({pp.boundary_nodes(par, k) for k in range(nvirt - 1)}):
        tier = "intra" if nodes == 1 else "inter"
        ops.append(ComputeOp(name=f"{tier}-node p2p transfer (in the pipeline)", kind="other", m=message,
                             nbytes=message, count=1, phase="step", dtype=par.dtype, impl="pipeline_p2p",
                             stage=0, scope="pp_p2p", params=tuple(sorted(dict(common, tier=tier).items()))))
    return ops


def compute_ops(model: ModelSpec, par: Parallelism, tp_flavour: str = "megatron") -> list:
    """Every ComputeOp of one optimizer step, per rank: the layer ops (stage -1:
    every stage runs L/pp layers), stage 0's embedding, the last stage's head,
    each stage's optimizer step, the layer and head again as whole modules
    (an alternative granularity, not extra work), the data-parallel
    framework's own work (framework_ops), and each stage's micro-batch with its
    tensor parallelism in place (tp_stage_ops; tp_flavour: whose
    implementation), with ZeRO-2/3's FSDP in place (fsdp_stage_ops), and each
    virtual stage inside a pipeline (pipeline_stage_ops).
    Counts are per optimizer step."""
    m = par.num_microbatches
    layers = model.num_layers // par.pp
    return (layer_ops(model, par, layers * m) + embedding_ops(model, par, m) + head_ops(model, par, m)
            + optimizer_ops(model, par) + module_ops(model, par, layers * m, m) + framework_ops(model, par)
            + tp_stage_ops(model, par, tp_flavour) + fsdp_stage_ops(model, par) + pipeline_stage_ops(model, par))
