"""Pipeline parallelism: commbench's CommOps against hand-computed values, and
THE PROOF: a real torch.distributed.pipelining run (PipelineStage with a manual
split, ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B) over gloo, whose
point-to-point traffic is recorded by tests/traffic.py and matched against the
CommOps of the same model and plan: count, direction and bytes, exactly."""
import json
import os
import re
from collections import Counter


from commbench import models
from commbench.models import ModelSpec
from commbench.parallel import Parallelism
from commbench.strategies import pp
from commbench.training import lm_loss, stage_module

LABEL = re.compile(r"^(fwd|bwd) (send to|recv from) stage (\d+)")


def p2p_table(ops):
    """{(stage, phase, send|recv, peer): (count, nbytes)} of the send_recv CommOps."""
    out = {}
    for o in ops:
        if o.collective == "send_recv":
            phase, kind, peer = LABEL.match(o.label).groups()
            assert phase == o.phase
            key = (o.stage, phase, kind.split()[0], int(peer))
            assert key not in out
            out[key] = (o.count, o.nbytes)
    return out


# --- hand-computed plans ----------------------------------------------------------

def test_bubble_fraction():
    assert pp.bubble_fraction(Parallelism(world=1)) == 0.0
    assert pp.bubble_fraction(Parallelism(world=4, pp=4, global_batch=8)) == 3 / 8
    assert pp.bubble_fraction(Parallelism(world=4, pp=4, global_batch=8, schedule="gpipe")) == 3 / 8
    assert pp.bubble_fraction(Parallelism(world=4, pp=4, global_batch=8, interleave=2)) == 3 / 16
    # 512 GPUs, tp 4 pp 8 dp 16, global batch 512 of micro-batch 1: m = 32, v = 5
    par = Parallelism(world=512, gpus_per_node=4, tp=4, pp=8, global_batch=512, interleave=5)
    assert par.num_microbatches == 32 and pp.bubble_fraction(par) == 7 / 160


def test_no_pipeline_no_ops():
    assert pp.comm_ops(models.get("gpt3-13b"), Parallelism(world=8, gpus_per_node=8, tp=8)) == []


def test_1f1b_four_stages():
    model = models.get("tiny-llama")         # untied: p2p only
    par = Parallelism(world=4, gpus_per_node=4, pp=4, micro_batch=2, global_batch=16, dtype="bf16")  # m = 8
    ops = pp.comm_ops(model, par)
    msg = 2 * 64 * 64 * 2                    # b s h x 2 bytes
    assert p2p_table(ops) == {
        (0, "fwd", "send", 1): (8, msg), (0, "bwd", "recv", 1): (8, msg),
        (1, "fwd", "recv", 0): (8, msg), (1, "bwd", "send", 0): (8, msg),
        (1, "fwd", "send", 2): (8, msg), (1, "bwd", "recv", 2): (8, msg),
        (2, "fwd", "recv", 1): (8, msg), (2, "bwd", "send", 1): (8, msg),
        (2, "fwd", "send", 3): (8, msg), (2, "bwd", "recv", 3): (8, msg),
        (3, "fwd", "recv", 2): (8, msg), (3, "bwd", "send", 2): (8, msg)}
    assert all(o.collective == "send_recv" and o.axis == "pp" and o.group_size == 2 and o.num_nodes == 1
               and o.overlap == "none" and o.strategy == "pp" and o.dtype == "bf16" for o in ops)
    assert [o.label for o in ops if o.stage == 1] == [
        "fwd send to stage 2", "fwd recv from stage 0", "bwd send to stage 0", "bwd recv from stage 2"]


def test_interleaved_wraps_around():
    model = ModelSpec("llama-8-layers", 8, 64, 4, 512, 64, kv_heads=2, arch="llama", tied_embeddings=False)
    par = Parallelism(world=4, pp=4, micro_batch=1, global_batch=8, interleave=2, dtype="fp32")  # m = 8, v = 2
    msg = 64 * 64 * 4
    t = p2p_table(pp.comm_ops(model, par))
    # every rank sends v*m = 16 forward, except the last virtual stage (rank 3, chunk 1):
    # rank 3 sends m = 8 to rank 0 (chunk 0 -> chunk 1); rank 0 receives those 8
    assert t[(0, "fwd", "send", 1)] == (16, msg) and t[(0, "fwd", "recv", 3)] == (8, msg)
    assert t[(3, "fwd", "send", 0)] == (8, msg) and t[(3, "fwd", "recv", 2)] == (16, msg)
    assert t[(3, "bwd", "recv", 0)] == (8, msg) and t[(0, "bwd", "send", 3)] == (8, msg)
    assert t[(1, "fwd", "send", 2)] == (16, msg) and t[(1, "bwd", "send", 0)] == (16, msg)
    assert len(t) == 16


def test_sends_match_recvs():
    """Every message sent by stage p to q in a phase is received by q from p."""
    for name, kw in (("gpt3-13b", dict(world=512, gpus_per_node=4, tp=4, pp=8, global_batch=512, interleave=5)),
                     ("tiny-gpt", dict(world=4, pp=4, global_batch=4)),
                     ("tiny-gpt", dict(world=2, pp=2, global_batch=6, schedule="gpipe"))):
        t = p2p_table(pp.comm_ops(models.get(name), Parallelism(**kw)))
        sends = {(s, q, ph): v for (s, ph, k, q), v in t.items() if k == "send"}
        recvs = {(q, s, ph): v for (s, ph, k, q), v in t.items() if k == "recv"}
        assert sends == recvs


def test_gpt3_13b_512_gpus():
    """gpt3-13b (40 layers, h 5120, V 50257, s 2048) on 512 GPUs, 4 per node,
    tp 4 x pp 8 x dp 16, micro-batch 1, global batch 512 (m = 32), bf16."""
    model = models.get("gpt3-13b")
    par = Parallelism(world=512, gpus_per_node=4, tp=4, pp=8, micro_batch=1, global_batch=512)
    ops = pp.comm_ops(model, par)
    msg = 1 * 2048 * 5120 * 2                # 20,971,520 B: each tp rank sends the full b s h (no SP)
    assert msg == 20_971_520
    t = p2p_table(ops)
    assert t[(0, "fwd", "send", 1)] == (32, msg) and t[(0, "bwd", "recv", 1)] == (32, msg)
    assert t[(3, "fwd", "recv", 2)] == (32, msg) and t[(3, "bwd", "send", 2)] == (32, msg)
    assert (0, "fwd", "recv", 7) not in t and (7, "fwd", "send", 0) not in t
    assert len(t) == 2 + 6 * 4 + 2
    # rank = pp*64 + dp*4 + tp: neighbouring stages are 64 ranks (16 nodes) apart
    assert all(o.num_nodes == 2 and o.group_size == 2 for o in ops)
    emb = [o for o in ops if o.collective == "all_reduce"]
    assert [(o.stage, o.axis, o.group_size, o.num_nodes, o.nbytes, o.count, o.phase) for o in emb] == [
        (0, "pp", 2, 2, 12565 * 5120 * 2, 1, "step"), (7, "pp", 2, 2, 128_665_600, 1, "step")]
    # (the vocabulary splits unevenly: the largest shard holds ceil(50257 / 4) = 12565 rows)

    # with sequence parallelism each tp rank sends its s/tp shard: 5,242,880 B
    sp = pp.comm_ops(model, Parallelism(world=512, gpus_per_node=4, tp=4, pp=8, sp=True, global_batch=512))
    assert {o.nbytes for o in sp if o.collective == "send_recv"} == {5_242_880}

    # interleaved, v = 5 chunks of one layer: 5x the messages, with the wrap-around 7 -> 0
    t = p2p_table(pp.comm_ops(model, Parallelism(world=512, gpus_per_node=4, tp=4, pp=8, global_batch=512,
                                                 interleave=5)))
    assert t[(0, "fwd", "send", 1)] == (160, msg) and t[(0, "fwd", "recv", 7)] == (128, msg)
    assert t[(0, "bwd", "send", 7)] == (128, msg) and t[(0, "bwd", "recv", 1)] == (160, msg)
    assert t[(7, "fwd", "send", 0)] == (128, msg) and t[(7, "fwd", "recv", 6)] == (160, msg)
    assert t[(4, "fwd", "send", 5)] == (160, msg) and t[(4, "bwd", "send", 3)] == (160, msg)
    assert sum(c for (s, ph, k, q), (c, n) in t.items() if s == 3) == 4 * 160


def test_node_span_of_each_pair():
    """8 ranks on 2 nodes of 4, pp 4 x dp 2: rank = 2 pp + dp, so stages 0,1 live on
    node 0 and 2,3 on node 1; only the boundary 1|2 (and the wrap 3 -> 0) crosses."""
    model = models.get("tiny-llama")
    ops = pp.comm_ops(model, Parallelism(world=8, gpus_per_node=4, pp=4, global_batch=8, interleave=1))
    span = {(o.stage, int(LABEL.match(o.label).group(3))): o.num_nodes for o in ops}
    assert span == {(0, 1): 1, (1, 0): 1, (1, 2): 2, (2, 1): 2, (2, 3): 1, (3, 2): 1}
    inter = pp.comm_ops(models.get("gpt3-125m"), Parallelism(world=8, gpus_per_node=4, pp=4, global_batch=8,
                                                             interleave=3))
    span = {(o.stage, o.label.split(" (")[0]): o.num_nodes for o in inter if o.collective == "send_recv"}
    assert span[(3, "fwd send to stage 0")] == 2 and span[(0, "fwd recv from stage 3")] == 2
    assert span[(0, "fwd send to stage 1")] == 1 and span[(1, "fwd send to stage 2")] == 2
    tied = [o for o in inter if o.collective == "all_reduce"]
    assert [(o.stage, o.num_nodes, o.nbytes, o.dtype) for o in tied] == [
        (0, 2, 50257 * 768 * 2, "bf16"), (3, 2, 50257 * 768 * 2, "bf16")]


def test_tied_embedding_only_for_tied_models():
    par = Parallelism(world=2, pp=2, global_batch=2, grad_dtype="fp32")
    gpt = [o for o in pp.comm_ops(models.get("tiny-gpt"), par) if o.collective == "all_reduce"]
    assert [(o.stage, o.nbytes, o.dtype, o.count, o.phase) for o in gpt] == [
        (0, 512 * 64 * 4, "fp32", 1, "step"), (1, 512 * 64 * 4, "fp32", 1, "step")]
    assert not [o for o in pp.comm_ops(models.get("tiny-llama"), par) if o.collective == "all_reduce"]


# --- THE PROOF: a real torch.distributed.pipelining step over gloo -----------------
#
# Stage split: every rank builds the whole torch_model.Transformer (seed 0, so tied
# weights start equal everywhere) and keeps virtual stage k's layers
# [k L/V, (k+1) L/V) (V = pp x v virtual stages; rank r runs k = c pp + r, chunk c,
# Megatron's interleaved assignment); it deletes the other layers from the
# ModuleDict and sets embed/pos to None off the first virtual stage and norm/head
# to None off the last. Transformer.forward then takes hidden states as input.
#
# Recorded: the second step (one warm-up step first). The first step of a torch
# pipelining schedule adds one-off small p2p: a shape-inference vote (int32 [1]
# forward, its result backward) and the pickled tensor metadata of the forward and
# backward boundary (send_object_list: a [1] size, then ~166 uint8s, each way).
# Megatron with fixed sequence lengths exchanges no shapes; neither belongs in a
# per-step workload.
#
# Direction: the profiler's c10d::send / recv_ events do not record the peer, so
# each stage's get_{fwd,bwd}_{send,recv}_ops are wrapped to log (phase, kind, peer,
# numel) of the P2POps the schedule issues; the test first checks that log against
# the backend events (same sends and recvs, same sizes, same order), then the log
# against the CommOps.
#
# Tied embeddings: torch pipelining has no weights shared across stages, so for
# tiny-gpt the head of the last stage is a separate copy of the embedding, and the
# step all-reduces its gradient with the first stage's embedding gradient over the
# 2-rank group {first, last}, as Megatron's _allreduce_word_embedding_grads does.
# That all-reduce is issued by this test: it proves the CommOp's size and group,
# not that torch does it.

B, M = 2, 4          # micro-batch size, micro-batches per step


def log_p2p_ops(stage, log: list):
    """Make a PipelineStage append (phase, kind, peer, numel) to log for every p2p op
    it builds: the profiler's c10d::send / c10d::recv_ events carry no peer."""
    for phase in ("fwd", "bwd"):
        for kind in ("send", "recv"):
            orig = getattr(stage, f"get_{phase}_{kind}_ops")

            def logged(*a, _orig=orig, _phase=phase, _kind=kind, **k):
                ops = _orig(*a, **k)
                log.extend((_phase, _kind, o.peer, o.tensor.numel()) for o in ops)
                return ops
            setattr(stage, f"get_{phase}_{kind}_ops", logged)


def _pipeline_step(rank, world, name, schedule, v, logdir):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    spec = models.get(name)
    nvirt = world * v
    mods = [stage_module(spec, c * world + rank, nvirt) for c in range(v)]
    stages = [PipelineStage(mod, c * world + rank, nvirt, torch.device("cpu")) for c, mod in enumerate(mods)]
    log = []
    for st in stages:
        log_p2p_ops(st, log)
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, M, loss_fn=lm_loss)
    else:
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], M, loss_fn=lm_loss)
    emb_group = None
    if spec.tied_embeddings:
        emb_group = dist.new_group([0, world - 1]) if world > 2 else dist.group.WORLD
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab, (B * M, spec.seq), generator=gen)
    target = torch.randint(0, spec.vocab, (B * M, spec.seq), generator=gen)

    def step():
        args = (tokens,) if rank == 0 else ()
        kw = {"target": target} if rank == world - 1 else {}
        sched.step(*args, **kw)
        if spec.tied_embeddings and rank in (0, world - 1):
            w = mods[0].embed.weight if rank == 0 else mods[-1].head.weight
            dist.all_reduce(w.grad, group=emb_group)
        for mod in mods:
            mod.zero_grad(set_to_none=False)
    step()                                   # warm-up: shape inference, metadata exchange

    def recorded():
        log.clear()
        step()
        with open(os.path.join(logdir, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)
    return recorded


def _prove(tmp_path, name, schedule, world, v=1):
    import traffic
    events = traffic.record(_pipeline_step, world, name, schedule, v, str(tmp_path))
    model = models.get(name)
    par = Parallelism(world=world, pp=world, micro_batch=B, global_batch=B * M, dtype="fp32",
                      schedule=schedule, interleave=v)
    ops = pp.comm_ops(model, par)
    expected = p2p_table(ops)
    report = []
    for rank in range(world):
        backend = traffic.gloo_ops(events[rank])
        log = [tuple(x) for x in json.load(open(tmp_path / f"rank{rank}.json"))]
        # (1) the logged P2POps are exactly what reached gloo, in order
        assert [(k, n) for _, k, _, n in log] == [(op, n) for op, n in backend if op in ("send", "recv")]
        c10d = Counter(name for name, _ in events[rank] if name.startswith("c10d::"))
        assert c10d["c10d::send"] == sum(k == "send" for _, k, _, _ in log)
        assert c10d["c10d::recv_"] == sum(k == "recv" for _, k, _, _ in log)
        # (2) per (phase, direction, peer): count and bytes as commbench says
        got = Counter((rank, ph, k, peer) for ph, k, peer, _ in log)
        mine = {key: val for key, val in expected.items() if key[0] == rank}
        assert set(got) == set(mine), (rank, got, mine)
        for key, (count, nbytes) in mine.items():
            sizes = {n * 4 for ph, k, peer, n in log if (rank, ph, k, peer) == key}
            assert got[key] == count and sizes == {nbytes}, (key, got[key], sizes, count, nbytes)
            report.append(f"stage {rank} {key[1]} {key[2]} peer {key[3]}: torch {got[key]} x {sizes} B, "
                          f"commbench {count} x {nbytes} B")
        # (3) the only other backend op: the tied-embedding all-reduce of first and last stage
        others = [(op, n) for op, n in backend if op not in ("send", "recv")]
        mine_ar = [o for o in ops if o.collective == "all_reduce" and o.stage == rank]
        assert others == [("all_reduce", o.nbytes // 4) for o in mine_ar for _ in range(o.count)]
        assert all(o.group_size == 2 for o in mine_ar)
        report += [f"stage {rank} all_reduce {n * 4} B (torch) / {o.nbytes} B x {o.count} (commbench)"
                   for (_, n), o in zip(others, mine_ar)]
    print("\n".join(report))


def test_proof_1f1b_tiny_llama_2_stages(tmp_path):
    _prove(tmp_path, "tiny-llama", "1f1b", 2)


def test_proof_gpipe_tiny_gpt_2_stages_tied(tmp_path):
    _prove(tmp_path, "tiny-gpt", "gpipe", 2)


def test_proof_interleaved_tiny_llama_2_ranks_2_chunks(tmp_path):
    _prove(tmp_path, "tiny-llama", "interleaved", 2, v=2)


def test_proof_1f1b_tiny_gpt_4_stages_tied(tmp_path):
    _prove(tmp_path, "tiny-gpt", "1f1b", 4)
