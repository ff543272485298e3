"""ZeRO-1's per-parameter broadcasts: issued together (async, as torch's
ZeroRedundancyOptimizer does), one after another, and as one coalesced
broadcast of their total bytes. The predictor takes them in series; this is
the measurement behind that choice.

The broadcasts are the plan's own (`commbench plan --zero 1`, phase step: one
per parameter; their sources alternate over the ranks), on N gloo ranks with one torch thread each.

    .venv/bin/python benchmarks/zero1_broadcasts.py [--model tiny-gpt] [--nprocs 2] [--iters 30]
"""
import argparse
import os
import sys
import time


def plan_broadcasts(model: str, nprocs: int) -> list:
    """(elements, owner) of each step-phase broadcast of the ZeRO-1 plan, in order."""
    from commbench import models, plan
    from commbench.parallel import Parallelism
    par = Parallelism(world=nprocs, gpus_per_node=nprocs, zero=1, global_batch=4 * nprocs, dtype="fp32")
    out = []
    for c in plan.build(models.get(model), par).comm_ops:
        if c.phase == "step" and c.collective == "broadcast":
            out += [(c.nbytes // 4, len(out) % nprocs)] * c.count
    return out


def rank_main(model: str, iters: int):
    import numpy as np
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    casts = plan_broadcasts(model, dist.get_world_size())
    tensors = [(torch.zeros(n), src) for n, src in casts]
    whole = torch.zeros(sum(n for n, _ in casts))

    def issued_together():
        for w in [dist.broadcast(t, src=src, async_op=True) for t, src in tensors]:
            w.wait()

    def one_after_another():
        for t, src in tensors:
            dist.broadcast(t, src=src)

    def coalesced():
        dist.broadcast(whole, src=0)

    rows = []
    for rep in range(2):
        for name, f in (("async, then wait all", issued_together), ("one after another", one_after_another),
                        ("one coalesced", coalesced)):
            dist.barrier()
            v = []
            for _ in range(iters):
                t0 = time.perf_counter()
                f()
                v.append(time.perf_counter() - t0)
            rows.append((rep, name, np.array(v) * 1e3))
    if dist.get_rank() == 0:
        print(f"{model}, ZeRO-1 over {dist.get_world_size()} gloo ranks: {len(casts)} broadcasts, "
              f"{whole.numel() * 4} B in all; {iters} iterations; ms (rank 0)")
        for rep, name, v in rows:
            print(f"  run {rep}  {name:<22} mean {v.mean():7.2f}  p50 {np.median(v):7.2f}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    if "RANK" in os.environ:
        return rank_main(a.model, a.iters)
    import subprocess
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nprocs),
                            __file__, *sys.argv[1:]], env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    sys.exit(main())
