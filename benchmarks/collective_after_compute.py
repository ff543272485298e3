"""A collective issued right after compute, against the same collective back to
back: the gap that makes the predictor underestimate exposed collectives on
CPUs (see the accuracy notes in README.md, "Benchmarks").

commbench, like nccl-tests, times a collective in a back-to-back loop. In a
training step a tensor-parallel all_reduce or a gating all-gather comes right
after a burst of compute. This script runs, on N gloo ranks (one torch thread
each), three loops of the same iterations:

    comm     all_reduce of --nbytes, back to back
    compute  --gemms float32 torch.mm of 64x256 by 256x256, nothing else
    both     the compute, then the all_reduce

and prints, per loop, the mean and percentiles of the all_reduce's and the
compute's own time on rank 0 and the wall time per iteration. If collectives
cost the same in both contexts, `both` per iteration = compute + comm.

    .venv/bin/python benchmarks/collective_after_compute.py [--nprocs 2] [--nbytes 16384] [--gemms 20]
        [--iters 400] [--repeats 2]
"""
import argparse
import sys
import time


def rank_main(nbytes: int, gemms: int, iters: int, repeats: int):
    import numpy as np
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    x = torch.zeros(nbytes // 4)
    a, w = torch.randn(64, 256), torch.randn(256, 256)

    def loop(mode):
        comp, comm = [], []
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            if mode != "comm":
                for _ in range(gemms):
                    torch.mm(a, w)
            t1 = time.perf_counter()
            if mode != "compute":
                dist.all_reduce(x)
            t2 = time.perf_counter()
            comp.append(t1 - t0)
            comm.append(t2 - t1)
        return np.array(comp) * 1e6, np.array(comm) * 1e6, (time.perf_counter() - start) / iters * 1e6

    rows = []
    for rep in range(repeats):
        for mode in ("comm", "compute", "both"):
            comp, comm, per_iter = loop(mode)
            rows.append((rep, mode, comp, comm, per_iter))
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} gloo ranks, all_reduce {nbytes} B, {gemms} mm per iteration, "
              f"{iters} iterations; times in us (rank 0)")
        print(f"{'run':>3} {'loop':<8} {'mm mean':>8} {'ar mean':>8} {'ar p50':>7} {'ar p90':>7} {'ar p99':>7} "
              f"{'per iter':>9}")
        for rep, mode, comp, comm, per_iter in rows:
            ar = comm if mode != "compute" else None
            cells = (f"{ar.mean():>8.0f} {np.percentile(ar, 50):>7.0f} {np.percentile(ar, 90):>7.0f} "
                     f"{np.percentile(ar, 99):>7.0f}") if ar is not None else f"{'-':>8} {'-':>7} {'-':>7} {'-':>7}"
            print(f"{rep:>3} {mode:<8} {comp.mean():>8.0f} {cells} {per_iter:>9.0f}")
        for rep in range(repeats):
            by = {mode: (comp, comm, per_iter) for r, mode, comp, comm, per_iter in rows if r == rep}
            alone = by["compute"][2] + by["comm"][2]
            print(f"run {rep}: both {by['both'][2]:.0f} us per iteration vs compute + comm alone {alone:.0f} us "
                  f"({by['both'][2] / alone - 1:+.0%}); all_reduce after compute {by['both'][1].mean():.0f} us "
                  f"mean vs {by['comm'][1].mean():.0f} back to back ({by['both'][1].mean() / by['comm'][1].mean():.2f}x)")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--nbytes", type=int, default=16384)
    ap.add_argument("--gemms", type=int, default=20)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    from torchrun import ranks_or_launch
    return ranks_or_launch(a.nprocs, __file__, lambda: rank_main(a.nbytes, a.gemms, a.iters, a.repeats))


if __name__ == "__main__":
    sys.exit(main())
