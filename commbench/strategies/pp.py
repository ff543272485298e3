"""Pipeline parallelism (axis 'pp'): the point-to-point transfers of activations
and their gradients between pipeline stages, 1F1B / GPipe and interleaved 1F1B
(par.interleave = v model chunks per pp rank), as Megatron-core issues them and
as torch.distributed.pipelining does (tests/test_strategy_pp.py records it).

Every CommOp is one direction of one pair of neighbouring pp ranks, seen from the
rank of pipeline stage `stage` that issues it; the matching op of the peer is the
other end of the same transfer (a send on stage p and a recv on stage p+1 are
one message on the wire). Labels: "<fwd|bwd> <send to|recv from> stage <q>".

Not modelled: the one-off p2p of the first step (torch pipelining votes on
static/dynamic shapes and exchanges pickled tensor metadata; Megatron only
exchanges shapes with variable_seq_lengths); Megatron pads the vocabulary to a
multiple of 128 x tp (we use the model's vocabulary, as rank_params does).
overlap is "none": the p2p sits between the compute slots of the schedule, which
the predictor simulates. Megatron-LM's training loop overlaps it with compute in
the interleaved schedule by default (--no-overlap-p2p-communication turns that
off; the non-interleaved schedule never overlaps); torch pipelining's 1F1B waits
for a receive before the compute that needs it and leaves sends in flight."""
from functools import lru_cache

from commbench.models import ModelSpec
from commbench.parallel import DTYPE_BYTES, Parallelism
from commbench.workload import CommOp

STRATEGY = "pp"


def bubble_fraction(par: Parallelism) -> float:
    """Pipeline bubble as a fraction of the ideal (bubble-free) compute time.

    With p stages, m micro-batches and t_f + t_b the forward + backward time of one
    micro-batch on one stage, 1F1B (and GPipe) needs p - 1 extra forward and
    backward slots to fill and drain the pipeline: bubble (p-1)(t_f+t_b) against the
    ideal m(t_f+t_b), i.e. (p-1)/m. Interleaved 1F1B gives each rank v chunks of
    1/v of its layers; the fill/drain slots are chunk-sized, so the bubble shrinks
    to (p-1)(t_f+t_b)/v and the fraction to (p-1)/(v m) (Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters", sec. 2.2).
    This is relative to the ideal time; of the whole step it is (p-1)/(v m + p-1)."""
    v = par.interleave if par.schedule == "interleaved" else 1
    return (par.pp - 1) / (v * par.num_microbatches)


def message_numel(model: ModelSpec, par: Parallelism) -> int:
    """Elements of one activation (or activation-gradient) message: the hidden
    states of one micro-batch at a stage boundary, b x s x h. With sequence
    parallelism the boundary activation is already split along the sequence over
    the tp group, so each tp rank sends its b x (s/tp) x h shard (Megatron-core
    get_tensor_shapes: seq_length // tp under sequence_parallel). Without SP each
    tp rank sends the full b x s x h to its tp peer of the next stage (Megatron-core
    has no scatter-gather here; legacy Megatron-LM's scatter_gather_tensors_in_pipeline
    sent b*s*h/tp and all-gathered it over tp after the recv: not modelled)."""
    s = par.seq_for(model)
    if par.sp and par.tp > 1:
        s //= par.tp
    return par.micro_batch * s * model.hidden


def _pair_nodes(par: Parallelism, a: int, b: int) -> int:
    """Nodes spanned by the pair (pp rank a, pp rank b): the most over all pp groups
    (each (dp, tp) index has its own pipeline; they may sit differently on nodes)."""
    return _mesh_pair_nodes(par.world, par.gpus_per_node, par.tp, par.pp, par.dp, a, b)


@lru_cache(maxsize=4096)
def _mesh_pair_nodes(world: int, gpus_per_node: int, tp: int, pp: int, dp: int, a: int, b: int) -> int:
    """_pair_nodes of a rank mesh, which only its shape decides: kept per shape, as
    a plan search asks for the same mesh with many other settings."""
    mesh = _mesh(world, gpus_per_node, tp, pp, dp)
    return max(mesh.nodes_spanned((g[a], g[b])) for g in mesh.groups["pp"])


@lru_cache(maxsize=64)
def _mesh(world: int, gpus_per_node: int, tp: int, pp: int, dp: int) -> Parallelism:
    return Parallelism(world=world, gpus_per_node=gpus_per_node, tp=tp, pp=pp, dp=dp, allow_tp_across_nodes=True)


def boundary_nodes(par: Parallelism, k: int) -> int:
    """Nodes the chunk boundary k (virtual stage k on pp rank k % pp -> k + 1)
    spans in the first pipeline: 1 or 2."""
    a, b = par.rank_of(k % par.pp, 0, 0), par.rank_of((k + 1) % par.pp, 0, 0)
    return 1 if par.node_of(a) == par.node_of(b) else 2


def embedding_groups(par: Parallelism) -> list:
    """Megatron's embedding groups: the first and the last stage of every
    pipeline (one per (dp, tp) index), which all-reduce the tied embedding's
    gradient; the whole pipeline group only where pp = 2."""
    return [(g[0], g[-1]) for g in par.groups["pp"]]


def runs_on_embedding_groups(op) -> bool:
    """The op of the pp axis that runs over embedding_groups, not the pipeline
    group: the tied embedding's all-reduce (the axis's one collective that is
    no point-to-point)."""
    return op.axis == "pp" and not op.collective.startswith("send_recv")


def _p2p(par: Parallelism, stage: int, peer: int, phase: str, kind: str, nbytes: int,
         count: int, note: str = "") -> CommOp:
    prep = "to" if kind == "send" else "from"
    return CommOp(collective="send_recv", axis="pp", group_size=2, num_nodes=_pair_nodes(par, stage, peer),
                  nbytes=int(nbytes), count=int(count), phase=phase, overlap="none", dtype=par.dtype,
                  strategy=STRATEGY, label=f"{phase} {kind} {prep} stage {peer}{note}", stage=stage,
                  peer=peer, direction=kind)


def comm_ops(model: ModelSpec, par: Parallelism) -> list:
    """The p2p ops of every pipeline stage, plus the tied-embedding gradient
    all-reduce between the first and last stage. Empty for pp = 1."""
    par.check_model(model)
    P = par.pp
    if P == 1:
        return []
    m = par.num_microbatches
    v = par.interleave if par.schedule == "interleaved" else 1
    nbytes = message_numel(model, par) * DTYPE_BYTES[par.dtype]
    out = []
    for p in range(P):
        nxt, prv = (p + 1) % P, (p - 1) % P
        first, last = p == 0, p == P - 1
        # Rank p runs virtual stages k = c*P + p for chunks c = 0..v-1 (V = v*P in all).
        # In forward every micro-batch crosses every virtual-stage boundary k -> k+1
        # (k < V-1), from rank p to rank (p+1) % P; the last virtual stage sends
        # nothing. So rank p sends v*m activations forward, less the m of its last
        # virtual stage when p = P-1; for v > 1 the sends of rank P-1 go to rank 0
        # (the wrap-around from chunk c to chunk c+1). It receives v*m, less the m
        # of virtual stage 0 when p = 0. Backward mirrors it: gradients of the same
        # size go k -> k-1, from rank p to rank (p-1) % P. With v = 1 (1F1B, GPipe)
        # this is m sends to p+1 unless last, m recvs from p-1 unless first, and the
        # reverse in backward. The schedule (1F1B vs GPipe) changes the order only.
        sends_fwd = m * (v - (1 if last else 0))
        recvs_fwd = m * (v - (1 if first else 0))
        wrap_f = " (wrap-around to the next chunk)" if last and v > 1 else ""
        wrap_fr = " (wrap-around from the previous chunk)" if first and v > 1 else ""
        wrap_b = " (wrap-around to the previous chunk)" if first and v > 1 else ""
        wrap_br = " (wrap-around from the next chunk)" if last and v > 1 else ""
        for peer, phase, kind, count, note in (
                (nxt, "fwd", "send", sends_fwd, wrap_f),
                (prv, "fwd", "recv", recvs_fwd, wrap_fr),
                (prv, "bwd", "send", recvs_fwd, wrap_b),    # a gradient for every activation received
                (nxt, "bwd", "recv", sends_fwd, wrap_br)):  # ... and for every activation sent
            if count:
                out.append(_p2p(par, p, peer, phase, kind, nbytes, count, note))
    if model.tied_embeddings:
        # Tied input/output embeddings live on two ranks once pp > 1: the word
        # embedding on the first stage, its copy as the output layer on the last.
        # Megatron (finalize_model_grads -> _allreduce_word_embedding_grads)
        # all-reduces that gradient over the 2-rank embedding group (first and last
        # rank of each pipeline) once per step, after the micro-batches: the
        # vocab-parallel shard, ceil(vocab / tp) x h elements in the gradient dtype.
        # torch.distributed.pipelining has no tied weights across stages; the test
        # issues this all-reduce itself, as Megatron does.
        nb = -(-model.vocab // par.tp) * model.hidden * DTYPE_BYTES[par.grad_dtype]
        for p in (0, P - 1):
            out.append(CommOp(collective="all_reduce", axis="pp", group_size=2,
                              num_nodes=_pair_nodes(par, 0, P - 1), nbytes=nb, count=1, phase="step",
                              overlap="none", dtype=par.grad_dtype, strategy=STRATEGY,
                              label="tied embedding grad all-reduce (first + last stage)", stage=p))
    return out
