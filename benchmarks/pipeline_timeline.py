"""Where a real pipeline step's time goes, rank by rank: the plan's torch
pipelining step (training.pipeline, what `validate` trains, with DDP when
dp > 1) run --steps times after --warmup, each rank recording when its chunks'
forwards and backwards, its posts of sends and receives (torch's _batch_p2p) and
its waits for them (_wait_batch_p2p), the schedule's micro-batches
(_step_microbatches: torch's split of the batch and merge of the outputs are
outside), the tied-embedding all-reduce and the optimizer step start and end
(time.perf_counter: one clock for every process of the machine, emulated nodes
included); "before schedule" is the step's zero_grad, "after optimizer" the
losses' mean. Prints, per rank, the mean per step of each part, and the events of
the last step on one time axis: what the predictor's pipeline simulation
(commbench/schedule.py) is to be checked against.

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_timeline.py [--model tiny-gpt] [--nprocs 4] [--pp 2]
        [--microbatches 4] [--schedule 1f1b|gpipe] [--interleave 1]
    sudo PYTHONPATH=. .venv/bin/python -m commbench emulate --nodes 2 --ranks-per-node 2 --inter-bw 200mbit -- \\
        .venv/bin/python benchmarks/pipeline_timeline.py --pp 2
"""
import argparse
import statistics
import sys
import time


def rank_main(a):
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.device_mesh import init_device_mesh

    from commbench import launch, models, training
    from commbench.parallel import Parallelism
    dist.init_process_group("gloo")
    launch.setup_cpu_rank(launch.detect(), "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // a.pp
    par = Parallelism(world=world, gpus_per_node=world, pp=a.pp, global_batch=a.microbatches * dp, dtype="fp32",
                      schedule="interleaved" if a.interleave > 1 else a.schedule, interleave=a.interleave)
    mesh = init_device_mesh("cpu", (par.pp, par.dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))
    step, stages, sched, opt = training.pipeline(models.get(a.model), par, mesh, torch.device("cpu"), seed=0)
    events = []                                   # (kind, start, end) of the step running now

    def timed(fn, kind):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            k = kind(args, kwargs) if callable(kind) else kind
            events.append((k, t0, time.perf_counter()))
            return out
        return call

    for st in stages:
        st.forward_one_chunk = timed(st.forward_one_chunk, lambda args, kw, s=st.stage_index: f"F{args[0]}@{s}")
        st.backward_one_chunk = timed(
            st.backward_one_chunk,
            lambda args, kw, s=st.stage_index: f"B{args[0]}@{s}" + ("+reduce" if kw.get("last_backward") else ""))
    sched.step = timed(sched.step, "schedule")
    sched._step_microbatches = timed(sched._step_microbatches, "micro-batches")
    opt.step = timed(opt.step, "optimizer")
    wait, post = schedules._wait_batch_p2p, schedules._batch_p2p
    from commbench.compute.pipeline_stage import TransferLog
    log = TransferLog(lambda: None)               # each post and its wait, as `compute` records them
    schedules._wait_batch_p2p = timed(log.wait(wait), "wait")
    schedules._batch_p2p = timed(log.post(post), "post")
    steps = []
    for i in range(a.warmup + a.steps):
        dist.barrier()
        events = []
        log.clear()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        if i >= a.warmup:
            steps.append((t0, t1, events, log.records))
    schedules._wait_batch_p2p, schedules._batch_p2p = wait, post
    gathered = [None] * world
    dist.all_gather_object(gathered, steps)
    if rank == 0:
        report(gathered, a, par)
        latencies(gathered)
    dist.destroy_process_group()


def parts(t0, t1, events, transfers=()) -> dict:
    """One rank's step split into its parts (ms)."""
    out = {"step": (t1 - t0) * 1e3}
    sched = next(e for e in events if e[0] == "schedule")
    opt = next(e for e in events if e[0] == "optimizer")
    for name, test in (("fwd", lambda k: k.startswith("F")),
                       ("bwd", lambda k: k.startswith("B") and not k.endswith("+reduce")),
                       ("last bwd+reduce", lambda k: k.endswith("+reduce")),
                       ("p2p post", lambda k: k == "post"),
                       ("p2p wait", lambda k: k == "wait")):
        out[name] = sum(e - s for k, s, e in events if test(k)) * 1e3
    inside = sum(out[k] for k in ("fwd", "bwd", "last bwd+reduce", "p2p post", "p2p wait"))
    inner = next(e for e in events if e[0] == "micro-batches")
    out["schedule other"] = (inner[2] - inner[1]) * 1e3 - inside
    out["split+merge"] = ((sched[2] - sched[1]) - (inner[2] - inner[1])) * 1e3
    out["before schedule"] = (sched[1] - t0) * 1e3
    out["after optimizer"] = (t1 - opt[2]) * 1e3
    out["tied all-reduce"] = (opt[1] - sched[2]) * 1e3
    out["optimizer"] = (opt[2] - opt[1]) * 1e3
    return out


def report(gathered, a, par):
    print(f"{a.model}, pp {par.pp} x dp {par.dp}, {par.schedule} x {par.interleave}, {par.num_microbatches} "
          f"micro-batches, {a.steps} steps after {a.warmup}: mean ms per step")
    names = list(parts(*gathered[0][0]))
    print("rank  " + "".join(f"{n:>17}" for n in names))
    for r, steps in enumerate(gathered):
        rows = [parts(*s) for s in steps]
        print(f"{r:4d}  " + "".join(f"{statistics.mean(x[n] for x in rows):17.2f}" for n in names))
    print("last step's events (ms from the earliest rank's start; F/B micro-batch@stage):")
    base = min(steps[-1][0] for steps in gathered)
    for r, steps in enumerate(gathered):
        t0, t1, events, _ = steps[-1]
        evs = sorted((s, e, k) for k, s, e in events if k not in ("schedule", "micro-batches"))
        line = " ".join(f"{k}[{(s - base) * 1e3:.1f},{(e - base) * 1e3:.1f}]" for s, e, k in evs)
        print(f"  rank {r} ({(t0 - base) * 1e3:.1f}..{(t1 - base) * 1e3:.1f}): {line}")


def latencies(gathered):
    """The transfers' p2p time as `compute` times it inside the pipeline
    (compute/pipeline_stage.transfer_times: the n-th send from rank a to b
    met with the n-th receive at b from a; for each whose receiver's wait
    blocked, from the later of the two posts' ends to the wait's end, at
    least 0), over all the timed steps."""
    from commbench.compute.pipeline_stage import transfer_times
    got = transfer_times([[rec for *_, records in steps for rec in records] for steps in gathered]).get("intra", [])
    if len(got) > 1:
        q = statistics.quantiles(got, n=10)
        print(f"p2p after the later post, {len(got)} transfers whose receiver waited: mean "
              f"{statistics.mean(got) * 1e3:.3f} ms, p10 {q[0] * 1e3:.3f}, p50 {statistics.median(got) * 1e3:.3f}, "
              f"p90 {q[-1] * 1e3:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--nprocs", type=int, default=4, help="ranks, without `commbench emulate` (torchrun)")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="with --interleave 1")
    ap.add_argument("--interleave", type=int, default=1, help="virtual stages per rank (> 1: interleaved 1F1B)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    from torchrun import ranks_or_launch
    return ranks_or_launch(a.nprocs, __file__, lambda: rank_main(a))


if __name__ == "__main__":
    sys.exit(main())
