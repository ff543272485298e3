"""GPU memory of a training plan on its most-loaded rank: weights, gradients,
optimizer state and activations, in bytes.

Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", sec. 3.1 and Fig. 1): with Psi parameters
on a rank, mixed-precision Adam holds 2 Psi (16-bit weights) + 2 Psi (16-bit
gradients) + 12 Psi (fp32 master weights, momentum, variance) = 16 Psi bytes;
fp32 training holds 4 + 4 + 8 (no master copy). ZeRO-1 divides the optimizer
state by the dp size n, ZeRO-2 also the gradients, ZeRO-3 also the weights:
(2 + 2 + 12/n), (2 + (2 + 12)/n), (2 + 2 + 12)/n bytes per parameter.
Gradients are counted in par.grad_dtype (Megatron's fp32 main grads are
grad_dtype="fp32"). torch's ZeroRedundancyOptimizer (ZeRO-1, torch flavour)
assigns whole parameters, largest first, to the least-loaded rank
(strategies.zero.zero_partition): the busiest rank's optimizer state is its
share, which exceeds Psi/n wherever one parameter (an embedding) is larger
than that.

Psi is the rank's share after tensor and pipeline parallelism, exactly the
parameters strategies.common.rank_params lists: layer matrices divided by tp,
norms, row-parallel biases and learned positions replicated (sequence
parallelism does not shard them either: Megatron keeps them replicated and
all-reduces their gradients), stage 0 holds the vocab-parallel embedding (+
positions), the last stage the final norm and the output layer (for a tied
embedding, a copy of it when pp > 1).

Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", sec. 4, generalised from its GPT shapes (see
layer_activation_bytes), and the number of micro-batches a stage keeps in
flight under the pipeline schedule (layers_in_flight).

Not counted (left to fits()'s reserve): the CUDA context and NCCL buffers,
allocator fragmentation, temporary buffers of kernels and collectives (DDP
buckets are views of the gradients), the optimizer's temporaries."""
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from commbench.models import ModelSpec
from commbench.parallel import DTYPE_BYTES, Parallelism
from commbench.strategies.common import layer_params, rank_params
from commbench.strategies.zero import DS_REDUCE_BUCKET_ELEMS

# bytes per parameter of optimizer state: (16-bit training, fp32 training).
# Adam / AdamW: fp32 master weights + m + v = 4 + 4 + 4; in fp32 the weights
# are their own master: m + v = 8 (ZeRO paper, sec. 3.1, K = 12).
# SGD with momentum: master + momentum = 8; in fp32 momentum only = 4.
OPTIMIZER_BYTES = {"adam": (12, 8), "adamw": (12, 8), "sgd": (8, 4)}
MASK_BYTES = 1          # dropout masks are stored as bytes (Korthikanti sec. 4.1)
LOGIT_BYTES = 4         # cross-entropy keeps fp32 logits (Korthikanti sec. 4.3: 4sbv/t)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU of the most-loaded pipeline stage `stage`."""
    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    total: int
    stage: int

    def to_dict(self) -> dict:
        return asdict(self)


# --- parameters ----------------------------------------------------------------------
@lru_cache(maxsize=4096)
def _stage_numel(model: ModelSpec, tp: int, pp: int, stage: int) -> tuple:
    """(all parameters, one transformer block, the rest = FSDP root) on a rank of
    `stage`, after tp. Cached: a search asks for the same (tp, pp) many times."""
    par = Parallelism(world=tp * pp, gpus_per_node=tp, tp=tp, pp=pp)
    total = sum(p.numel for p in rank_params(model, par, stage))
    block = sum(p.numel for p in layer_params(model, tp, 0))
    return total, block, total - block * (model.num_layers // pp)


@lru_cache(maxsize=4096)
def _zero1_largest_share(model: ModelSpec, tp: int, pp: int, stage: int, dp: int) -> int:
    """The most parameter elements one rank of `stage` owns under torch's
    ZeroRedundancyOptimizer (whole parameters, largest first, to the least
    loaded rank)."""
    from commbench.strategies.zero import zero_partition
    par = Parallelism(world=tp * pp, gpus_per_node=tp, tp=tp, pp=pp)
    return max(sum(p.numel for p in owned) for owned in zero_partition(rank_params(model, par, stage), dp))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def model_state_bytes(model: ModelSpec, par: Parallelism, stage: int, optimizer: str = "adam") -> tuple:
    """(weights, gradients, optimizer state) bytes on a rank of `stage`."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer {optimizer!r}: choose from {', '.join(OPTIMIZER_BYTES)}")
    psi, block, root = _stage_numel(model, par.tp, par.pp, stage)
    wb, gb = DTYPE_BYTES[par.dtype], DTYPE_BYTES[par.grad_dtype]
    ob = OPTIMIZER_BYTES[optimizer][0 if wb < 4 else 1]
    shard = _ceil_div(psi, par.dp)          # ZeRO's equal flat partition
    weights, grads, opt = psi * wb, psi * gb, psi * ob
    if par.zero == 1 and par.zero_flavour == "torch" and par.dp > 1:
        opt = _zero1_largest_share(model, par.tp, par.pp, stage, par.dp) * ob
    elif par.zero >= 1:
        opt = shard * ob
    if par.zero >= 2:
        if par.pp == 1:
            grads = shard * gb
            if par.zero == 2 and par.zero_flavour == "torch":
                # FSDP2 without resharding (strategies/fsdp.py): a unit's gradient is
                # unsharded until its reduce-scatter, as under ZeRO-3 below
                grads += max(block, root) * gb
            elif par.zero == 2:
                # DeepSpeed reduces through one contiguous bucket of reduce_bucket_size elements
                grads += min(psi, DS_REDUCE_BUCKET_ELEMS) * gb
        # pp > 1: torch.distributed.pipelining defers every reduce-scatter to the end of
        # the step (strategies/fsdp.py), so gradients accumulate unsharded; DeepSpeed
        # refuses ZeRO-2/3 with its pipeline engine. Either way no gradient saving.
    if par.zero == 3:
        if par.pp == 1:
            # FSDP2 (strategies/fsdp.py): the root unit (embedding, final norm, head) stays
            # gathered from its forward to its backward (reshard_after_forward=None -> False
            # for the root); a block is gathered while it runs and the next one is prefetched:
            # root + 2 blocks unsharded at a time. Their unsharded gradients exist until the
            # unit's reduce-scatter: at most the larger unit's, one at a time.
            gathered = min(psi, root + 2 * block)
            weights = shard * wb + gathered * wb
            grads += max(block, root) * gb
        else:
            # pipelining: no reshard after backward, so by the end of the stage's backward
            # every unit is unsharded, next to its shard
            weights = shard * wb + psi * wb
    return weights, grads, opt


# --- activations ---------------------------------------------------------------------
def layer_activation_bytes(model: ModelSpec, seq: int, micro_batch: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", act_bytes: int = 2, flash: bool = True) -> int:
    """Activations one transformer layer keeps for its backward, for one micro-batch,
    on one tp rank (Korthikanti et al. 2022, sec. 4.1-4.2, derived from the shapes).

    With s = seq, b = micro_batch, h, a heads, f = ffn_hidden, kv = kv dim, t = tp,
    d = act_bytes (2 for 16-bit) and 1-byte dropout masks, a layer stores:
      replicated over tp (split over t only with sequence parallelism):
        two norm inputs 2 sbh d; QKV input sbh d; MLP input sbh d;
        attention-output and MLP-output dropout masks 2 sbh (GPT only)
      split over tp (heads / ffn columns):
        Q (sbh d) and K (sb kv d) for QK^T, V (sb kv d), output-projection input (sbh d),
        MLP: GELU input + GELU output 2 sbf d (GPT); SwiGLU (Megatron's fused swiglu saves
        its input and recomputes silu): gate and up outputs 2 sbf d + down-projection
        input sbf d = 3 sbf d
      attention scores, split over tp: softmax output a s^2 b d, and with dropout (GPT)
        its mask a s^2 b and output a s^2 b d.
    GPT, f = 4h, kv = h, d = 2: replicated (4+2+2+2) sbh = 10 sbh, split (4+2+2+16) sbh
    = 24 sbh, scores 5 a s^2 b: s b h (10 + 24/t + 5as/(ht)) with tp,
    s b h/t (34 + 5as/h) with tp and sp, s b h (34 + 5as/h) at t = 1 (Korthikanti eqs.
    1-3). Llama (no dropout, SwiGLU, GQA) follows from the same shapes.
    selective recompute: the score terms are recomputed, not stored.
    flash (the default): the attention core is one fused kernel, as the compute
    model times it (torch's scaled_dot_product_attention: flash or memory-efficient
    on GPUs) and as Megatron runs it with flash attention: it never stores the s^2
    scores (nor a dropout mask: it regenerates it), so none and selective keep
    the same; flash=False is Korthikanti's unfused attention.
    full recompute: only the layer input, sbh d (split over t with sp: the stored
    hidden states are the sequence-parallel shard); the stage adds one layer's full
    activations for the recomputation (stage_activation_bytes)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute {recompute!r}: choose from none, selective, full")
    s, b, h, t, d = seq, micro_batch, model.hidden, tp, act_bytes
    tokens = s * b
    rep_tokens = tokens // t if sp else tokens     # the replicated parts, per rank
    if recompute == "full":
        return rep_tokens * h * d
    dropout = model.arch == "gpt"
    mask = MASK_BYTES if dropout else 0
    kv_local = model.kv_heads // t * model.head_dim     # kv heads split over tp (check_model: t divides them)
    q_local, f_local, a_local = h // t, model.ffn_hidden // t, model.heads // t
    replicated = rep_tokens * h * (4 * d + 2 * mask)
    mlp = (3 if model.gated_mlp else 2) * f_local * d
    split = tokens * ((2 * q_local + 2 * kv_local) * d + mlp)
    scores = 0
    if recompute == "none" and not flash:
        scores = b * a_local * s * s * (d + (mask + d if dropout else 0))
    return replicated + split + scores


def layers_in_flight(par: Parallelism, stage: int, num_layers: int) -> tuple:
    """(layer-micro-batches whose activations a rank of `stage` holds at its peak,
    micro-batches holding the stage's embedding/head activations).

    1F1B (Narayanan et al. 2021; Megatron forward_backward_pipelining_without_interleaving):
    stage s runs min(p - s, m) warm-up forwards before its first backward, so it keeps
    that many micro-batches of its L/p layers: stage 0 keeps p x L/p = L layers' worth.
    GPipe keeps all m. pp = 1 (gradient accumulation) keeps one.
    Interleaved 1F1B with v chunks (Megatron forward_backward_pipelining_with_interleaving):
    rank r warms up (p - r - 1) * 2 + (v - 1) * p chunk-micro-batches and holds one more,
    at most m v, each of L/(p v) layers. For rank 0 with m >= p + (p-1)/v that is
    (v p + p - 1) L/(p v) = L (1 + (p-1)/(p v)), Korthikanti's interleaving factor.
    The embedding/head activations: min(p, m) micro-batches on stage 0 (approximated so
    for interleaving too), one on the last stage (m with GPipe)."""
    p, m, lp = par.pp, par.num_microbatches, num_layers // par.pp
    if p == 1:
        return lp, 1
    if par.schedule == "gpipe":
        return m * lp, m
    if par.schedule == "interleaved" and par.interleave > 1:     # v = 1 runs as plain 1F1B
        v = par.interleave
        chunks = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
        return chunks * (num_layers // (p * v)), (min(p, m) if stage == 0 else 1)
    n = min(p - stage, m)
    return n * lp, (n if stage == 0 else 1)


def stage_activation_bytes(model: ModelSpec, par: Parallelism, stage: int) -> int:
    """Peak activations on a rank of `stage`: its layers' activations for the
    micro-batches in flight, plus the embedding (stage 0) and head (last stage)
    ones (Korthikanti sec. 4.3: embedding dropout mask sbh/t, final norm and output
    layer inputs 4sbh/t, fp32 logits 4 s b v / t; /t for the first two only with sp)."""
    s, b, t, h = par.seq_for(model), par.micro_batch, par.tp, model.hidden
    d = DTYPE_BYTES[par.dtype]
    rep_tokens = s * b // t if par.sp else s * b
    layers, mbs = layers_in_flight(par, stage, model.num_layers)
    per = layer_activation_bytes(model, s, b, t, par.sp, par.recompute, d)
    total = layers * per
    if par.recompute == "full":     # the layer being recomputed holds all its activations once
        total += layer_activation_bytes(model, s, b, t, par.sp, "none", d)
    extra = 0
    if stage == 0 and model.arch == "gpt":
        extra += rep_tokens * h * MASK_BYTES                          # embedding dropout mask
    if stage == par.pp - 1:
        extra += 2 * rep_tokens * h * d                               # final norm + output layer inputs
        extra += s * b * _ceil_div(model.vocab, t) * LOGIT_BYTES      # fp32 logits (vocab-parallel)
    return total + mbs * extra


# --- the plan ------------------------------------------------------------------------
def stage_memory(model: ModelSpec, par: Parallelism, stage: int, optimizer: str = "adam") -> MemoryEstimate:
    if not 0 <= stage < par.pp:
        raise ValueError(f"stage {stage} is outside 0..{par.pp - 1}")
    par.check_model(model)
    w, g, o = model_state_bytes(model, par, stage, optimizer)
    a = stage_activation_bytes(model, par, stage)
    return MemoryEstimate(weights=w, gradients=g, optimizer_state=o, activations=a, total=w + g + o + a, stage=stage)


def memory_per_gpu(model: ModelSpec, par: Parallelism, optimizer: str = "adam") -> MemoryEstimate:
    """The estimate of the most-loaded stage. Only the first and last stages can be:
    a middle stage has stage 0's layers without the embedding and fewer (or as many)
    micro-batches in flight. The model as the plan runs it: its vocabulary
    padded at the plan's tp where it asks for that (ModelSpec.at_tp)."""
    model = model.at_tp(par.tp)
    stages = (0,) if par.pp == 1 else (0, par.pp - 1)
    return max((stage_memory(model, par, s, optimizer) for s in stages), key=lambda e: e.total)


def fits(estimate: MemoryEstimate, gpu_memory_bytes: int, reserve_fraction: float = 0.1) -> bool:
    """Whether the estimate fits in a GPU of gpu_memory_bytes, keeping reserve_fraction
    of it for what the estimate leaves out (CUDA context, NCCL buffers, fragmentation)."""
    if not (isinstance(gpu_memory_bytes, (int, float)) and gpu_memory_bytes > 0 and math.isfinite(gpu_memory_bytes)):
        raise ValueError(f"gpu memory must be a positive number of bytes, got {gpu_memory_bytes!r}")
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve fraction must be in [0, 1), got {reserve_fraction!r}")
    return estimate.total <= gpu_memory_bytes * (1 - reserve_fraction)


__all__ = ["MemoryEstimate", "memory_per_gpu", "fits", "stage_memory", "model_state_bytes",
           "layer_activation_bytes", "layers_in_flight", "stage_activation_bytes"]
