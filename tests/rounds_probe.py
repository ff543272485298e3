"""A rank of `validate --rounds 3` (tiny-gpt, pp 2, the world's ranks) that
prints, after each round, a JSON line of its live process groups, threads and
open files (tests/test_process_groups.py runs it under torchrun)."""
import gc
import json
import os
import sys

from torch.distributed import distributed_c10d

from commbench import launch, models, validate
from commbench.parallel import Parallelism


def counts() -> dict:
    gc.collect()
    return {"groups": len(distributed_c10d._world.pg_map), "threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd"))}


def main(out_dir: str):
    info = launch.detect()
    model = models.get("tiny-gpt")
    par = Parallelism(world=info.world_size, gpus_per_node=info.world_size, pp=2, global_batch=2 * info.world_size,
                      seq=32, dtype="fp32")
    run_round = validate.run_round

    def counted(backend, *args, **kwargs):
        r = run_round(backend, *args, **kwargs)
        print(json.dumps({"rank": backend.rank, **counts()}), flush=True)
        return r
    validate.run_round = counted
    validate.run_on_rank(model, par, info, "cpu", 3, 1, os.path.join(out_dir, f"rank{info.rank}"), [],
                         timing=validate.timing_settings(0.05, 20), tp_impl=validate.tp_impl_for(model, par),
                         rounds=3)


if __name__ == "__main__":
    main(sys.argv[1])
