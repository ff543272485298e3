"""What denormal numbers cost a module timing on a CPU: a model's whole stage
(commbench compute's `stage_bwd`, embedding to loss, one rank, one thread)
backward on its initial weights, its head tied to the embedding as the model
does and untied, with denormals computed and flushed to zero (what
launch.setup_cpu_rank sets on every CPU rank). Each case runs in a process of
its own: the flush is a thread's floating-point state.

    PYTHONPATH=. .venv/bin/python benchmarks/denormal_stage.py [--model small-gpt] [--calls 8]
"""
import argparse
import json
import subprocess
import sys

CASE = """
import json, statistics, sys, time
from dataclasses import replace
import torch
from commbench import models
from commbench.compute import modules, ops
from commbench.parallel import Parallelism
model, tied, flush, calls = sys.argv[1], sys.argv[2] == "tied", sys.argv[3] == "flush", int(sys.argv[4])
torch.set_num_threads(1)
torch.set_flush_denormal(flush)
par = Parallelism(world=1, global_batch=1, dtype="fp32")
op = next(o for o in ops.compute_ops(models.get(model), par) if o.impl == "stage_bwd")
op = replace(op, params=tuple(sorted(dict(dict(op.params), tied=tied).items())))
st = modules.prepare(op, "cpu", torch.float32)
times = []
for _ in range(calls + 1):
    st.before()
    t0 = time.perf_counter()
    st.timed()
    times.append(time.perf_counter() - t0)
print(json.dumps(statistics.median(times[1:]) * 1e3))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-gpt")
    ap.add_argument("--calls", type=int, default=8)
    a = ap.parse_args()
    print(f"{a.model} whole-stage backward, median of {a.calls} calls (ms)")
    for tied in ("tied", "untied"):
        row = []
        for flush in ("denormals", "flush"):
            p = subprocess.run([sys.executable, "-c", CASE, a.model, tied, flush, str(a.calls)],
                               capture_output=True, text=True, check=True)
            row.append(f"{flush} {json.loads(p.stdout):6.1f}")
        print(f"  head {tied:7s} " + "   ".join(row))


if __name__ == "__main__":
    main()
