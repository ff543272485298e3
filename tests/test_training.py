"""commbench.training: real, timed training steps of each kind of plan over gloo
(tiny-gpt, seq 32, 2 micro-batches per step, fp32). Besides the timing contract,
the losses prove that the optimizer stepped (the same batches every step: the
loss can only fall if the parameters changed) and that each implementation
computes the same training as the others: plans that see the same data (same
dp size, same micro-batches) must produce the same losses, whatever the
parallelism."""
import math
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from commbench import models
from commbench.parallel import Parallelism
from commbench.training import check_plan, train_steps
from traffic import _context, _free_port

STEPS, WARMUP, SEQ = 3, 1, 32
SPEC = models.get("tiny-gpt")

# name -> (Parallelism keywords, words the implementation description must hold).
# Micro-batches of 1: "dp2" plans run 4 per replica on the data of two replicas (PP+DDP
# with as many micro-batches as stages trips a torch DDP assertion: training.check_plan),
# "dp1" plans 2 on the data of one.
TWO = {
    "ddp": (dict(global_batch=8), ["DDP(bucket 25 MB) over dp 2", "no_sync"]),
    "zero1": (dict(zero=1, global_batch=8), ["ZeroRedundancyOptimizer"]),
    "zero2": (dict(zero=2, global_batch=8), ["fully_shard", "reshard_after_forward=False"]),
    "zero3": (dict(zero=3, global_batch=8), ["fully_shard", "reshard_after_forward=True"]),
    "tp2": (dict(tp=2, global_batch=2), ["DTensor TP x 2"]),
    "pp2-1f1b": (dict(pp=2, global_batch=2, schedule="1f1b"), ["Schedule1F1B over pp 2"]),
}
FOUR = {
    "tp2-dp2": (dict(tp=2, global_batch=8), ["DTensor TP x 2", "DDP(bucket 25 MB) over dp 2"]),
    "pp2-dp2": (dict(pp=2, global_batch=8), ["Schedule1F1B over pp 2", "DDP(bucket 25 MB) over dp 2"]),
    "tp2-pp2": (dict(tp=2, pp=2, global_batch=2), ["DTensor TP x 2", "Schedule1F1B over pp 2"]),
}
SAME_DATA = {"dp2": ["ddp", "zero1", "zero2", "zero3", "tp2-dp2", "pp2-dp2"], "dp1": ["tp2", "pp2-1f1b", "tp2-pp2"]}


def _plan(world, kw):
    return Parallelism(world=world, gpus_per_node=world, dtype="fp32", seq=SEQ, **kw)


def _worker(rank, world, port, plans, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = {}
        for name, (kw, _) in plans.items():
            kw = dict(kw)
            min_time_s = kw.pop("min_time_s", 0.0)
            out[name] = train_steps(SPEC, _plan(world, kw), STEPS, warmup=WARMUP, min_time_s=min_time_s)
        dist.destroy_process_group()
        queue.put((rank, out, None))
    except Exception:
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(world: int, plans: dict, timeout_s: float = 240.0) -> list:
    """Per rank, {plan name: StepTimes}: every plan trained in one launch of world gloo ranks."""
    ctx = _context()
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, plans, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out, errors = [None] * world, []
    try:
        for _ in range(world):
            rank, res, err = queue.get(timeout=timeout_s)
            errors += [f"rank {rank}:\n{err}"] if err else []
            out[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return out


@pytest.fixture(scope="module")
def results():
    ranks2, ranks4 = run_ranks(2, TWO), run_ranks(4, FOUR)
    for name in TWO:
        print(f"{name}: step {[f'{t * 1e3:.1f} ms' for t in ranks2[0][name].step_s]} "
              f"loss {[f'{x:.4f}' for x in ranks2[0][name].losses]} | {ranks2[0][name].implementation}")
    for name in FOUR:
        print(f"{name}: step {[f'{t * 1e3:.1f} ms' for t in ranks4[0][name].step_s]} "
              f"loss {[f'{x:.4f}' for x in ranks4[0][name].losses]} | {ranks4[0][name].implementation}")
    return {name: [r[name] for r in ranks2] for name in TWO} | {name: [r[name] for r in ranks4] for name in FOUR}


@pytest.mark.parametrize("name", list(TWO) + list(FOUR))
def test_plan_trains_and_is_timed(results, name):
    words = (TWO | FOUR)[name][1]
    for rank, r in enumerate(results[name]):
        assert len(r.step_s) == len(r.rank_step_s) == len(r.losses) == STEPS and r.warmup == WARMUP
        assert all(math.isfinite(t) and t > 0 for t in r.step_s + r.rank_step_s)
        assert all(mine <= slowest for mine, slowest in zip(r.rank_step_s, r.step_s)), (rank, r)
        assert all(math.isfinite(x) for x in r.losses)
        # the same batches every step: without an optimizer step the loss would not move
        assert all(b < a for a, b in zip(r.losses, r.losses[1:])), (rank, r.losses)
        assert r.losses == results[name][0].losses and r.step_s == results[name][0].step_s
        assert all(w in r.implementation for w in words), r.implementation


@pytest.mark.parametrize("group", list(SAME_DATA))
def test_same_data_same_training(results, group):
    """DDP, ZeRO-1/2/3, TP+DP and PP+DP on the same two replicas' data, and TP, PP
    and TP+PP on one replica's, train identically (to float rounding)."""
    first, *others = SAME_DATA[group]
    for name in others:
        assert results[name][0].losses == pytest.approx(results[first][0].losses, rel=1e-4), name


def test_min_time_adds_steps_until_the_timed_steps_fill_it():
    """min_time_s times steps beyond those asked until the timed steps took
    min_time_s (the slowest rank's total), the same count on every rank; 0
    times exactly the steps asked."""
    min_time = 0.4
    ranks = run_ranks(2, {"paced": (dict(global_batch=8, min_time_s=min_time), []),
                          "exact": (dict(global_batch=8), [])})
    n = len(ranks[0]["paced"].step_s)
    totals = [sum(r["paced"].rank_step_s) for r in ranks]
    short = [sum(r["paced"].rank_step_s[:-1]) for r in ranks]
    print(f"{n} steps, each rank's total {totals} s")
    assert n > STEPS and max(totals) >= min_time > max(short)
    for r in ranks:
        assert len(r["paced"].step_s) == len(r["paced"].rank_step_s) == len(r["paced"].losses) == n
        assert len(r["exact"].step_s) == STEPS
    assert ranks[0]["paced"].step_s == ranks[1]["paced"].step_s


def test_plans_validate_cannot_run():
    with pytest.raises(ValueError, match="selective.*not supported by validate"):
        check_plan(SPEC, Parallelism(world=2, recompute="selective"))
    with pytest.raises(ValueError, match="deepspeed.*not supported by validate"):
        check_plan(SPEC, Parallelism(world=2, zero=1, zero_flavour="deepspeed"))
    with pytest.raises(ValueError, match="DDP reduces gradients"):
        check_plan(SPEC, Parallelism(world=2, dtype="bf16", grad_dtype="fp32"))
    with pytest.raises(ValueError, match="kv heads"):
        check_plan(models.get("tiny-llama"), Parallelism(world=4, gpus_per_node=4, tp=4))
    with pytest.raises(ValueError, match="longer than the 64 learned positions"):
        check_plan(SPEC, Parallelism(world=1, seq=128))
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        check_plan(SPEC, Parallelism(world=2, pp=2))
    with pytest.raises(ValueError, match="DDP's bucket rebuild"):
        check_plan(SPEC, Parallelism(world=4, pp=2, global_batch=4))
    # interleaved: up to as many micro-batches as virtual stages (4, 2) fail; more (6) run
    for gb in (8, 4):
        with pytest.raises(ValueError, match=r"on 4 virtual stages \(pp 2 x interleave 2\) with DDP"):
            check_plan(SPEC, Parallelism(world=4, pp=2, schedule="interleaved", interleave=2, global_batch=gb))
    check_plan(SPEC, Parallelism(world=4, pp=2, schedule="interleaved", interleave=2, global_batch=12))
    with pytest.raises(ValueError, match="initialized default process group"):
        train_steps(SPEC, Parallelism(world=1), 1)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        train_steps(SPEC, Parallelism(world=1), 0)
    with pytest.raises(ValueError, match="min_time_s must be >= 0 seconds"):
        train_steps(SPEC, Parallelism(world=1), 1, min_time_s=float("nan"))
