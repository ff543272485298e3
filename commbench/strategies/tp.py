"""Tensor parallelism (axis 'tp'): the collectives of Megatron-style tensor
parallelism, with and without sequence parallelism (par.sp), with a
vocabulary-parallel embedding, output layer and cross-entropy. Two flavours:

- 'megatron' (default): what Megatron-core issues (ColumnParallelLinear /
  RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy,
  finalize_model_grads). Its attention input projection is one fused linear_qkv
  and its MLP input projection one fused linear_fc1 (gate and up together).
- 'dtensor': what torch's DTensor tensor parallelism issues
  (torch.distributed.tensor.parallel.parallelize_module with ColwiseParallel on
  attn.q/k/v and mlp.gate/up, RowwiseParallel on attn.o and mlp.down,
  SequenceParallel on the norms, RowwiseParallel(input_layouts=Replicate()) on
  the embedding, ColwiseParallel on the head and loss_parallel()), on the
  separate q/k/v/gate/up Linears of commbench.torch_model. tests/test_strategy_tp.py
  records it over gloo and matches it exactly.

Notation: b micro-batch, s sequence (par.seq_for), h hidden, A = b*s*h elements
of one activation, m micro-batches per step, L layers on the stage. nbytes is S
of DESIGN.md's busbw table: all_reduce the buffer, all_gather the whole gathered
output (b*s*h, each rank contributes b*(s/tp)*h), reduce_scatter the whole input
(b*s*h, each rank keeps b*(s/tp)*h). Activations are in par.dtype, gradients of
parameters in par.grad_dtype, the cross-entropy statistics in fp32. Everything
is on the critical path (overlap 'none'): each collective's output feeds the
next GEMM. Megatron overlaps two of them with a GEMM inside the same linear's
backward (the input re-gather with the dgrad GEMM, the dgrad all-reduce /
reduce-scatter with the wgrad GEMM; CUDA_DEVICE_MAX_CONNECTIONS=1); that is left
to the compute model, the labels say which ones they are.

Per layer and micro-batch (count m*L on each stage):
  megatron, no SP   fwd: all_reduce A after attn out (o), after mlp down
                    bwd: all_reduce A of the input grad of linear_qkv, of linear_fc1
                         (conjugate of the identity copy into the tp region)
  megatron, SP      fwd: all_gather A before linear_qkv and linear_fc1 (sequence ->
                         full), reduce_scatter A after o and down (the all-reduce
                         split in two)
                    bwd: all_gather A of the output grads of o and down (conjugate of
                         their reduce-scatter), reduce_scatter A of the input grads of
                         linear_qkv and linear_fc1 (conjugate of their all-gather),
                         and all_gather A of the inputs of linear_qkv and linear_fc1
                         again: the forward saved only the sequence shard, and the
                         weight gradient needs the full input
                         (LinearWithGradAccumulationAndAsyncCommunication.backward)
  dtensor           as megatron, but each of q, k, v (and gate, up) is its own
                    ColwiseParallel Linear with its own input redistribution: 3
                    (attention) + 2 (gated MLP) or 1 collectives where Megatron has
                    1 + 1; and no input re-gather in backward (autograd keeps the
                    gathered input).
  recompute 'full'  the layer's forward collectives again in backward (every layer
                    checkpointed; dtensor: torch.utils.checkpoint, non-reentrant, stops
                    before the MLP's output collective); 'selective' recomputes core
                    attention only: no collective.
First stage: the vocab-parallel embedding's partial lookups are summed: all_reduce
A in fwd (no SP); with SP reduce_scatter A in fwd and all_gather A in bwd, or, for
GPT with learned positions (added after the sum), all_reduce A in fwd, then a
local split into sequence shards whose bwd is an all_gather A (Megatron
LanguageModelEmbedding: reduce_scatter_embeddings only without position embeddings).
Last stage: the column-parallel output layer's input: bwd all_reduce A (no SP);
with SP fwd all_gather A, bwd reduce_scatter A (+ megatron: the wgrad re-gather,
all_gather A). Vocab-parallel cross-entropy, fwd: 3 all_reduce of b*s values:
max logit, sum of exp, target logit; Megatron computes in fp32; DTensor's
loss_parallel does max and sum-exp in fp32 (the type-promoted computation dtype)
and the target-logit gather in the logits' dtype (torch/distributed/tensor/
parallel/loss.py: _log_softmax, _nll_loss_forward).
Once per step, with SP: the gradients of parameters that see only a sequence shard
(replicated over tp, so each rank holds a partial sum) are all-reduced over tp:
  megatron: one all_reduce of all params with the sequence_parallel attribute
            (norm weights and biases, row-parallel biases; not learned positions,
            which are added before the split), flattened together
            (finalize_model_grads -> _allreduce_layernorm_grads).
  dtensor:  the norm weights (and biases) have Partial gradients: backward
            accumulates them as Partial and every read by the optimizer redistributes
            to Replicate, one all_reduce of that parameter each time (grad_reads:
            1 for SGD, 3 for torch's for-loop AdamW: lerp, mul+addcmul of grad x
            grad). Row-parallel biases are added before the reduce-scatter, so
            their gradient comes from the all-gathered output grad and is complete.
Not modelled: the tied-embedding all-reduce between first and last pipeline stage
(strategies/pp.py), Megatron's vocabulary padding (does not change these sizes),
tp-comm-overlap (userbuffers) splitting of the collectives into chunks."""
from commbench.models import ModelSpec
from commbench.parallel import DTYPE_BYTES, Parallelism
from commbench.strategies.common import grad_bytes, op, rank_params, stage_layers

STRATEGY = "tp"
FLAVOURS = ("megatron", "dtensor")
CE_DTYPE = "fp32"


def implementation_limit(model: ModelSpec, par: Parallelism, flavour: str) -> str | None:
    """What keeps the torch implementation of a flavour (megatron: commbench's
    megatron_tp.py; dtensor: DTensor's tp_plan in training.py) from running the
    plan's tensor parallelism (a plan that passed check_model), or None."""
    if flavour == "megatron":
        if par.sp:
            return "sequence parallelism"
        if par.pp > 1:
            return "pipeline parallelism"
        if model.vocab % par.tp:
            return f"vocabulary {model.vocab} not divisible by tp {par.tp}"
        return None
    if par.recompute == "selective":
        return "selective recompute"
    return None


def _col_inputs(model: ModelSpec, flavour: str) -> list:
    """Names of the column-parallel linears whose input is one activation: one per
    block in Megatron (fused), one per Linear in DTensor."""
    if flavour == "megatron":
        return ["linear_qkv", "linear_fc1"]
    return ["attn.q", "attn.k", "attn.v"] + (["mlp.gate", "mlp.up"] if model.gated_mlp else ["mlp.up"])


def _layer_ops(model: ModelSpec, par: Parallelism, flavour: str) -> list:
    """(collective, phase, label) of one layer and one micro-batch, forward then
    backward. Every one moves one activation of b*s*h."""
    cols = _col_inputs(model, flavour)
    rows = ["linear_proj", "linear_fc2"] if flavour == "megatron" else ["attn.o", "mlp.down"]
    if not par.sp:
        # f/g conjugates: the row-parallel outputs are partial sums (all-reduce in fwd,
        # identity in bwd); the column-parallel inputs are copies (identity in fwd,
        # all-reduce of the partial input gradients in bwd).
        fwd = [("all_reduce", "fwd", f"{r} output") for r in rows]
        bwd = [("all_reduce", "bwd", f"{c} input grad") for c in cols]
    else:
        # The all-reduce A = reduce-scatter A + all-gather A: the row-parallel output is
        # reduce-scattered to sequence shards, the column-parallel input all-gathered
        # back; in bwd each becomes its conjugate.
        attn_cols = [c for c in cols if c.startswith(("attn.", "linear_qkv"))]
        mlp_cols = [c for c in cols if c not in attn_cols]
        fwd = ([("all_gather", "fwd", f"{c} input") for c in attn_cols]
               + [("reduce_scatter", "fwd", f"{rows[0]} output")]
               + [("all_gather", "fwd", f"{c} input") for c in mlp_cols]
               + [("reduce_scatter", "fwd", f"{rows[1]} output")])
        bwd = ([("all_gather", "bwd", f"{rows[1]} output grad")]
               + [("reduce_scatter", "bwd", f"{c} input grad") for c in mlp_cols]
               + [("all_gather", "bwd", f"{rows[0]} output grad")]
               + [("reduce_scatter", "bwd", f"{c} input grad") for c in attn_cols])
        if flavour == "megatron":
            # Megatron saves the sequence shard of a column-parallel input and gathers
            # it again for the weight gradient (overlapped with the dgrad GEMM).
            bwd += [("all_gather", "bwd", f"{c} input re-gather for wgrad") for c in cols]
    if par.recompute == "full":
        # The checkpointed layer runs its forward again in backward, collectives included.
        # Megatron's CheckpointFunction re-runs all of it; torch.utils.checkpoint
        # (non-reentrant, early stop on by default) stops once the last activation that
        # backward saved is rebuilt: the input of mlp.down, so the MLP's output
        # collective (and the residual add after it) is not issued again.
        redo = fwd if flavour == "megatron" else fwd[:-1]
        bwd += [(coll, "bwd", f"{label} (recompute)") for coll, _, label in redo]
    return fwd + bwd


def _embedding_ops(model: ModelSpec, par: Parallelism) -> list:
    """First stage, per micro-batch. Same in both flavours (the DTensor plan of the
    test splits the sequence after the positions, as Megatron does)."""
    if not par.sp:
        return [("all_reduce", "fwd", "embedding output")]
    if model.arch == "gpt":     # learned positions are added to the full sequence, then split
        return [("all_reduce", "fwd", "embedding output"),
                ("all_gather", "bwd", "sequence split after positions: grad")]
    return [("reduce_scatter", "fwd", "embedding output"), ("all_gather", "bwd", "embedding output grad")]


def _logits_ops(par: Parallelism, flavour: str) -> list:
    """Last stage, per micro-batch: the column-parallel output layer's input."""
    if not par.sp:
        return [("all_reduce", "bwd", "head input grad")]
    out = [("all_gather", "fwd", "head input"), ("reduce_scatter", "bwd", "head input grad")]
    if flavour == "megatron":
        out.append(("all_gather", "bwd", "head input re-gather for wgrad"))
    return out


def _sp_params(model: ModelSpec, par: Parallelism, stage: int, flavour: str) -> list:
    """Parameters of the stage whose gradient is a partial sum over the tp group
    under sequence parallelism (see the module docstring)."""
    out = []
    for p in rank_params(model, par, stage):
        if p.tp_sharded or p.name == "pos.weight":
            continue
        module = p.name.rsplit(".", 2)[-2]
        if flavour == "dtensor" and not module.startswith("norm"):
            continue                    # row-parallel biases: complete in DTensor
        out.append(p)
    return out


def comm_ops(model: ModelSpec, par: Parallelism, flavour: str = "megatron", grad_reads: int = 1) -> list:
    """The tensor-parallel CommOps of every pipeline stage; empty for tp = 1.
    grad_reads (flavour 'dtensor' with SP only): how often the optimizer reads each
    gradient; each read of a Partial norm gradient is one all-reduce."""
    if flavour not in FLAVOURS:
        raise ValueError(f"tp flavour {flavour!r}: choose from {', '.join(FLAVOURS)}")
    if not isinstance(grad_reads, int) or grad_reads < 1:
        raise ValueError(f"grad_reads must be a positive integer, got {grad_reads!r}")
    par.check_model(model)
    if par.tp == 1:
        return []
    m = par.num_microbatches
    act = par.micro_batch * par.seq_for(model) * model.hidden * DTYPE_BYTES[par.dtype]
    ce = par.micro_batch * par.seq_for(model)           # one value per token
    out = []

    def add(items, count, stage, nbytes=act, dtype=par.dtype):
        for coll, phase, label in items:
            out.append(op(par, coll, "tp", nbytes, count, phase, STRATEGY, label=label, dtype=dtype, stage=stage))

    for stage in range(par.pp):
        L = len(stage_layers(model, par, stage))
        if stage == 0:
            add(_embedding_ops(model, par), m, stage)
        add(_layer_ops(model, par, flavour), m * L, stage)
        if stage == par.pp - 1:
            add(_logits_ops(par, flavour), m, stage)
            # Vocab-parallel cross-entropy over the tp-sharded logits: global max (for a
            # stable softmax), global sum of exp, and the target's logit from the rank
            # that holds it; b*s values each, fp32 (DTensor: the last in the logits' dtype).
            add([("all_reduce", "fwd", "cross-entropy max"), ("all_reduce", "fwd", "cross-entropy sum-exp")],
                m, stage, ce * DTYPE_BYTES[CE_DTYPE], CE_DTYPE)
            tgt_dtype = CE_DTYPE if flavour == "megatron" else par.dtype
            add([("all_reduce", "fwd", "cross-entropy target logit")], m, stage,
                ce * DTYPE_BYTES[tgt_dtype], tgt_dtype)
        if par.sp:
            params = _sp_params(model, par, stage, flavour)
            if flavour == "megatron":   # flattened into one buffer, once per step
                numel = sum(p.numel for p in params)
                add([("all_reduce", "step", "sequence-parallel grads (norms, row biases), coalesced")],
                    1, stage, numel * grad_bytes(par), par.grad_dtype)
            else:                       # one per parameter and optimizer read
                for numel in sorted({p.numel for p in params}):
                    n = sum(p.numel == numel for p in params)
                    add([("all_reduce", "step", "Partial norm grad -> Replicate, per param and read")],
                        n * grad_reads, stage, numel * grad_bytes(par), par.grad_dtype)
    return out
