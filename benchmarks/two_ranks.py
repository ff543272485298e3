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
