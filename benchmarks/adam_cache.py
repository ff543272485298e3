"""What the cache does to the optimizer step on this machine: the plan's `adam`
op (compute/optimizer.py: the model's elements as as many fp32 tensors as it
has parameters) timed back to back and after an overwrite of twice the
last-level cache (what `commbench compute` now times), against torch Adam over
the model's own parameters right after four micro-batches' forward and
backward (as a training step runs it) and back to back. One process, one
thread, denormals flushed; per round the mean of 35 calls (5 more left out).

    .venv/bin/python benchmarks/adam_cache.py [--model tiny-gpt] [--rounds 5]
"""
import argparse
import statistics
import time

import torch


def _mean_s(call, n=40, before=None):
    out = []
    for _ in range(n):
        if before:
            before()
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return statistics.mean(out[5:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from commbench import plan, training
    from commbench.compute import optimizer
    from commbench.models import get
    from commbench.parallel import Parallelism
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    spec = get(a.model)
    op = next(o for o in plan.build(spec, Parallelism(world=1, gpus_per_node=1, global_batch=4, dtype="fp32"))
              .compute_ops if o.impl == "adam")
    staged = optimizer.prepare(op, "cpu", torch.float32)
    model = training.stage_module(spec, 0, 1, seed=0)
    opt = torch.optim.Adam(training.adam_groups(model.parameters()), **training.adam_kwargs("cpu"))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, spec.vocab, (1, spec.seq), generator=g) for _ in range(2))

    def four_micro_batches():
        opt.zero_grad(set_to_none=True)
        for _ in range(4):
            training.lm_loss(model(x), y).backward()
    four_micro_batches()
    rows = {"adam op, back to back": lambda: _mean_s(staged.timed),
            "adam op, after the cache overwrite (timed so)": lambda: _mean_s(staged.timed, before=staged.before),
            "model's Adam after 4 micro-batches": lambda: _mean_s(opt.step, before=four_micro_batches),
            "model's Adam, back to back": lambda: _mean_s(opt.step)}
    res = {k: [] for k in rows}
    for _ in range(a.rounds):
        for k, f in rows.items():
            res[k].append(f())
    print(f"{a.model}: {op.m} elements in {op.n} tensors, fp32, 1 thread; ms, mean per round")
    for k, v in res.items():
        print(f"  {k:46s} median {statistics.median(v) * 1e3:6.2f}  ({' '.join(f'{t * 1e3:.2f}' for t in v)})")


if __name__ == "__main__":
    main()
