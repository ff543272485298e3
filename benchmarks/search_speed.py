"""How long `commbench search` takes before and around the predictor.

What it times (each best of --repeat runs, caches cleared before each run):
  enumerate     list(search.enumerate_plans(...)): build and validate every candidate
  + memory      enumeration plus memory.memory_per_gpu and memory.fits for each valid plan
  search        search.search(...) with --estimate: the above plus one estimate per fitting plan
and prints the counts (candidates, invalid, valid, too big, ranked) and the best plans.

The default estimate is a trivial stand-in, not a prediction: 1 + pipeline bubble
(p-1)/(v m), so that the search's own overhead is what is timed. To time the real
predictor pass --estimate MODULE:FUNCTION, a callable (model, parallelism) -> step time
in seconds.

    .venv/bin/python benchmarks/search_speed.py                       # gpt3-175b, 1024 GPUs
    .venv/bin/python benchmarks/search_speed.py --estimate commbench.predict:step_time_s"""
import argparse
import importlib
import statistics
import time
from collections import Counter

from commbench import memory, models, search


def trivial_estimate(model, par) -> float:
    v = par.interleave if par.schedule == "interleaved" else 1
    return 1.0 + (par.pp - 1) / (v * par.num_microbatches)


def load_callable(spec: str):
    mod, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--estimate {spec!r}: expected MODULE:FUNCTION")
    return getattr(importlib.import_module(mod), name)


def timed(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        memory._stage_numel.cache_clear()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, min(times), statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GPU memory, 1 GB = 1e9 B")
    ap.add_argument("--estimate", default="", help="MODULE:FUNCTION (model, par) -> step time in s")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    model = models.get(a.model)
    est = load_callable(a.estimate) if a.estimate else trivial_estimate
    gpu = a.gpu_memory_gb * 1e9
    kw = dict(seq=a.seq)

    def enum():
        rejected = Counter()
        return list(search.enumerate_plans(model, a.world, a.gpus_per_node, a.global_batch, rejected=rejected,
                                           **kw)), rejected

    def enum_mem():
        plans, _ = enum()
        return sum(memory.fits(memory.memory_per_gpu(model, p), gpu) for p in plans)

    (plans, rejected), e_best, e_med = timed(enum, a.repeat)
    n_fit, m_best, m_med = timed(enum_mem, a.repeat)
    res, s_best, s_med = timed(lambda: search.search(model, a.world, a.gpus_per_node, a.global_batch, gpu, est,
                                                     top=a.top, **kw), a.repeat)
    print(f"{model.name} on {a.world} GPUs ({a.gpus_per_node} per node), global batch {a.global_batch}, "
          f"seq {a.seq}, {a.gpu_memory_gb:g} GB GPUs (10 % reserve), estimate "
          f"{a.estimate or 'trivial (1 + bubble)'}")
    print(f"candidates {len(plans) + sum(rejected.values())}: invalid {sum(rejected.values())}, "
          f"valid {len(plans)}, fit {n_fit}, too big {len(plans) - n_fit}")
    print(f"search: enumerated {res.num_enumerated}, invalid {res.num_invalid}, too big {res.num_too_big}, "
          f"unestimated {res.num_unestimated}, ranked {res.num_ranked}")
    print(f"{'stage':<22}{'best s':>10}{'median s':>10}{'us/valid plan':>15}")
    for name, best, med in (("enumerate", e_best, e_med), ("enumerate + memory", m_best, m_med),
                            ("search", s_best, s_med)):
        print(f"{name:<22}{best:>10.3f}{med:>10.3f}{best / max(len(plans), 1) * 1e6:>15.1f}")
    print("best plans:")
    for r in res.plans:
        print(f"  {r.step_time_s:9.4f} s  {r.samples_per_s:9.1f} samples/s  {r.memory.total / 1e9:5.1f} GB  "
              f"{search.describe(r.parallelism)}")


if __name__ == "__main__":
    main()
