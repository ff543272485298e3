"""The wait for the last data-parallel rank inside a real DDP step, against what
the predictor adds for it (`commbench predict`, the wait at the gradient
synchronisation; see README.md, "Benchmarks").

On N gloo ranks (one torch thread each, the plan commbench validate runs) this
builds the model under torch DDP and runs --steps steps of --microbatches
micro-batches, all under no_sync, then, timed apart on every rank:

    barrier     the wait for the last rank to finish its micro-batches
    all_reduce  the gradients' all-reduce (one flat buffer of their bytes)
    adam        the optimizer step

and prints each rank's mean forward, backward, barrier, all-reduce and Adam
time, and, from each rank's own step compute (its micro-batches and Adam), the
spread of the ranks' compute relative to each other (the predictor's sigma,
stats.relative_spread, as predict.spread_s takes it) and E[max of N normals]
x sigma, the wait the predictor would add.

    .venv/bin/python benchmarks/dp_sync_wait.py [--nprocs 4] [--model tiny-gpt] [--microbatches 4] [--steps 40]
"""
import argparse
import os
import sys
import time


def rank_main(model_name: str, m: int, steps: int):
    import numpy as np
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from commbench import launch, models, stats, torch_model, training
    from commbench.parallel import Parallelism
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    launch.steady_allocator()
    spec = models.get(model_name)
    par = Parallelism(world=world, gpus_per_node=world, global_batch=m * world, dtype="fp32")
    mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
    model = training._parallelize(torch_model.build(spec, 0), spec, par, mesh, torch.device("cpu"))
    opt = training._optimizer(list(model.parameters()), par, mesh)
    x, y = training._tokens(spec, (m, 1, spec.seq), training._data_seed(0, rank), torch.device("cpu"))
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    times = {k: [] for k in ("fwd", "bwd", "barrier", "all_reduce", "adam", "compute")}

    def step(record):
        opt.zero_grad(set_to_none=True)
        compute = 0.0
        for i in range(m):
            with model.no_sync():
                t0 = time.perf_counter()
                loss = training.lm_loss(model(x[i]), y[i]) / m
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            compute += t2 - t0
            if record:
                times["fwd"].append(t1 - t0)
                times["bwd"].append(t2 - t1)
        t0 = time.perf_counter()
        dist.barrier()
        t1 = time.perf_counter()
        dist.all_reduce(flat)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if record:
            times["barrier"].append(t1 - t0)
            times["all_reduce"].append(t2 - t1)
            times["adam"].append(t3 - t2)
            times["compute"].append(compute + t3 - t2)

    for _ in range(3):
        step(False)
    for _ in range(steps):
        step(True)
    mine = {k: np.asarray(v) for k, v in times.items()}
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        print(f"{model_name} DDP on {world} gloo ranks, {m} micro-batches under no_sync, {steps} steps; "
              f"means in ms per rank")
        for k in ("fwd", "bwd", "barrier", "all_reduce", "adam"):
            print(f"  {k:<10} " + " ".join(f"{r[k].mean() * 1e3:7.2f}" for r in every))
        sigma = stats.relative_spread([r["compute"] for r in every])
        wait = stats.expected_max_normal(world) * sigma
        print(f"step compute (micro-batches + Adam): spread of the ranks relative to each other {sigma * 1e3:.2f} ms;"
              f" E[max of {world} normals] x that = {wait * 1e3:.2f} ms; barrier measured "
              f"{np.mean([r['barrier'].mean() for r in every]) * 1e3:.2f} ms (mean over ranks)")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    from torchrun import ranks_or_launch
    return ranks_or_launch(a.nprocs, __file__, lambda: rank_main(a.model, a.microbatches, a.steps))


if __name__ == "__main__":
    sys.exit(main())
