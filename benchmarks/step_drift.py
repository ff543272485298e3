"""How far the machine's own speed drifts while a job runs: one plan's real
training step (training.train_steps' step function, a barrier before each
step, as `validate` times them) run back to back for --seconds, the median
step (the slowest rank's) printed per --window. The measurement behind
validate's rounds that train on both sides of their measurements.

    .venv/bin/python benchmarks/step_drift.py [--model tiny-gpt] [--pp 2] [--seconds 45] [--window 3]
"""
import argparse
import statistics
import sys
import time


def rank_main(model: str, pp: int, seconds: float, window: float):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from commbench import models, training
    from commbench.parallel import Parallelism
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    par = Parallelism(world=world, gpus_per_node=world, pp=pp, global_batch=4 * (world // pp), dtype="fp32")
    mesh = init_device_mesh("cpu", (par.pp, par.dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))
    step = (training.pipeline(models.get(model), par, mesh, torch.device("cpu"), seed=0)[0] if pp > 1 else
            training._flat_step(models.get(model), par, mesh, torch.device("cpu"), seed=0))
    for _ in range(3):
        dist.barrier()
        step()
    start, k, durations, medians = time.perf_counter(), 1, [], []
    while True:
        dist.barrier()
        t0 = time.perf_counter()
        step()
        durations.append(time.perf_counter() - t0)
        # rank 0's clock decides, after every step, whether a window closes (1)
        # and whether the run goes on (2): every rank follows it
        now = time.perf_counter() - start
        decide = torch.tensor([2.0 if now >= seconds else 1.0 if now >= k * window else 0.0])
        dist.broadcast(decide, src=0)
        if decide.item() > 0:
            t = torch.tensor(durations, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            medians.append((k, len(durations), statistics.median(t.tolist()) * 1e3))
            durations, k = [], k + 1
            if decide.item() == 2.0:
                break
    if dist.get_rank() == 0:
        print(f"{model}, pp {pp} over {world} gloo ranks: median step (slowest rank) per {window:g} s window")
        for i, n, med in medians:
            print(f"  {(i - 1) * window:6.0f}-{i * window:<4.0f} s  {n:5d} steps  {med:7.2f} ms")
        ms = [m for _, _, m in medians]
        print(f"windows: {min(ms):.2f}-{max(ms):.2f} ms, the slowest {max(ms) / min(ms):.2f} x the fastest")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--window", type=float, default=3.0)
    a = ap.parse_args()
    from torchrun import ranks_or_launch
    return ranks_or_launch(a.nprocs, __file__, lambda: rank_main(a.model, a.pp, a.seconds, a.window))


if __name__ == "__main__":
    sys.exit(main())
