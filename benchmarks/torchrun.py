"""Run a benchmark script's ranks under torch.distributed.run: the script's
main() calls ranks_or_launch, which in a rank runs the rank's work and
otherwise launches the script on N local ranks (one torch thread each)."""
import os
import subprocess
import sys


def ranks_or_launch(nprocs: int, script: str, rank_work):
    """rank_work() where torchrun started this process (RANK is set), else
    torchrun of script with this command line on nprocs ranks; the exit status."""
    if "RANK" in os.environ:
        return rank_work()
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
                            script, *sys.argv[1:]], env=dict(os.environ, OMP_NUM_THREADS="1"))
