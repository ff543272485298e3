"""What full recompute costs a whole stage on this machine: the stage module
(the whole model on one rank: training.stage_module) timed forward and
forward + backward, without recompute and with each layer checkpointed as
training checkpoints it (training.apply_recompute), one process, one thread,
denormals flushed as on a validate rank. Rounds alternate the two modules;
each round's figure is the median of its calls (the first 5 left out).

    .venv/bin/python benchmarks/recompute_cost.py [--model tiny-gpt] [--rounds 5] [--calls 40]
"""
import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=40)
    a = ap.parse_args()
    from commbench import training
    from commbench.models import get
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    spec = get(a.model)
    mods = {"none": training.stage_module(spec, 0, 1, seed=0), "full": training.stage_module(spec, 0, 1, seed=0)}
    training.apply_recompute(mods["full"])
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, spec.vocab, (1, spec.seq), generator=g) for _ in range(2))
    res = {}
    for _ in range(a.rounds):
        for name, m in mods.items():
            whole, fwd = [], []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                out = m(x)
                t1 = time.perf_counter()
                training.lm_loss(out, y).backward()
                t2 = time.perf_counter()
                fwd.append(t1 - t0)
                whole.append(t2 - t0)
            res.setdefault((name, "forward"), []).append(statistics.median(fwd[5:]))
            res.setdefault((name, "forward + backward"), []).append(statistics.median(whole[5:]))
    print(f"{a.model}, whole model as one stage, micro-batch 1, fp32, 1 thread; ms, median per round")
    for (name, what), v in res.items():
        print(f"  recompute {name:5s} {what:19s} median {statistics.median(v) * 1e3:6.2f}  "
              f"({' '.join(f'{t * 1e3:.2f}' for t in v)})")


if __name__ == "__main__":
    main()
