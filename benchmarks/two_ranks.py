"""The launcher of the two-rank TP benchmarks (tp_group.py, tp_after_kernels.py):
a script's own command line run as two ranks, locally under torchrun or, with
--emulate RATE, on an emulated 2-node cluster (`commbench emulate`, root), one
thread per rank and this checkout on PYTHONPATH."""
import argparse
import os
import subprocess
import sys


def main(script: str, description: str, rank_main, reps: int) -> int:
    """Parse --model, --reps, --emulate; on a rank (RANK set) call
    rank_main(model, reps), else launch the two ranks and return their status."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--emulate", metavar="RATE")
    a = ap.parse_args()
    if "RANK" in os.environ:
        return rank_main(a.model, a.reps)
    me = [os.path.abspath(script), "--model", a.model, "--reps", str(a.reps)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    if a.emulate:
        return subprocess.call([sys.executable, "-m", "commbench", "emulate", "--nodes", "2",
                                "--inter-bw", a.emulate, "--", sys.executable, *me], env=env)
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *me], env=env)


def tp_rank(model_name: str) -> tuple:
    """On a rank: the benchmarks' plan (Megatron TP x 2, micro-batch 1, 4
    micro-batches, fp32) set up as validate runs it. Returns (launch info, model,
    parallelism, the plan's compute ops, an open torch backend, validate's timing)."""
    from commbench import launch, plan, validate, watchdog
    from commbench.models import get
    from commbench.parallel import Parallelism
    info = launch.detect()
    launch.setup_cpu_rank(info, "cpu")
    model = get(model_name)
    par = Parallelism(world=2, gpus_per_node=1, tp=2, micro_batch=1, global_batch=4, dtype="fp32",
                      allow_tp_across_nodes=True)
    backend = watchdog.open_backend("torch", info, "cpu", 300)
    timing = validate.timing_settings(0.5)     # as benchmarks/validate_accuracy.py runs validate
    return info, model, par, plan.build(model, par).compute_ops, backend, timing
