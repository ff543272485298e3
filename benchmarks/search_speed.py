"""How long `commbench search` takes: every plan of a model on a cluster ranked
by the real predictor (ranking.run, what `commbench search --system SPEC` runs).

What it times (each best of --repeat runs; wall clock and this process's CPU
time, which a busy machine inflates less):
  enumerate     list(search.enumerate_plans(...)): build and validate every candidate
  + memory      enumeration plus memory.memory_per_gpu and memory.fits for each valid plan
  search        ranking.run(...): the above plus, for each plan that fits, plan.build and
                predict.predict with the spec's Times (the same as `commbench predict
                --system SPEC`), keeping the best --top
and prints the counts (candidates, invalid, valid, too big, ranked) and the best plans.
The issue's target: gpt3-175b on 1024 GPUs (global batch 1536, seq 2048) in under 30 s.

--estimate trivial replaces the predictor by a stand-in, 1 + pipeline bubble
(p-1)/(v m), to time the search's own overhead; --estimate MODULE:FUNCTION by any
callable (model, parallelism) -> step time in seconds.

    .venv/bin/python benchmarks/search_speed.py                       # gpt3-175b, 1024 GPUs, dgx-h100
    .venv/bin/python benchmarks/search_speed.py --system thetagpu
    .venv/bin/python benchmarks/search_speed.py --estimate trivial --repeat 3"""
import argparse
import importlib
import statistics
import time
from collections import Counter

from commbench import memory, models, predict, ranking, search, system


def trivial_estimate(model, par) -> float:
    v = par.interleave if par.schedule == "interleaved" else 1
    return 1.0 + (par.pp - 1) / (v * par.num_microbatches)


def load_callable(spec: str):
    mod, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--estimate {spec!r}: expected trivial or MODULE:FUNCTION")
    return getattr(importlib.import_module(mod), name)


def timed(fn, repeat: int):
    """(last result, best wall s, median wall s, best CPU s)."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        memory._stage_numel.cache_clear()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return out, min(walls), statistics.median(walls), min(cpus)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--system", default="dgx-h100", help="SystemSpec: times, GPUs per node and GPU memory")
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--estimate", default="predict", help="predict (default), trivial, or MODULE:FUNCTION")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    model = models.get(a.model)
    spec = system.load(a.system)
    gpn, gpu = spec.gpus_per_node, spec.gpu_memory_bytes
    kw = dict(seq=a.seq)

    def enum():
        rejected = Counter()
        return list(search.enumerate_plans(model, a.world, gpn, a.global_batch, rejected=rejected, **kw)), rejected

    def enum_mem():
        plans, _ = enum()
        return sum(memory.fits(memory.memory_per_gpu(model, p), gpu) for p in plans)

    if a.estimate == "predict":
        peak = ranking.peak_tflops(spec, "bf16")

        def run_search():
            times = predict.load_times((), (), a.system)       # fresh caches every run
            return ranking.run(model, a.world, gpn, a.global_batch, times, gpu, top=a.top, peak=peak, **kw).result
        label = f"the predictor on {spec.name}"
    else:
        est = trivial_estimate if a.estimate == "trivial" else load_callable(a.estimate)

        def run_search():
            return search.search(model, a.world, gpn, a.global_batch, gpu, est, top=a.top, **kw)
        label = a.estimate

    (plans, rejected), e_best, e_med, e_cpu = timed(enum, a.repeat)
    n_fit, m_best, m_med, m_cpu = timed(enum_mem, a.repeat)
    res, s_best, s_med, s_cpu = timed(run_search, a.repeat)
    print(f"{model.name} on {a.world} GPUs of {spec.name} ({gpn} per node, {spec.gpu_memory_gb:g} GB, 10 % "
          f"reserve), global batch {a.global_batch}, seq {a.seq}; ranked by {label}")
    print(f"candidates {len(plans) + sum(rejected.values())}: invalid {sum(rejected.values())}, "
          f"valid {len(plans)}, fit {n_fit}, too big {len(plans) - n_fit}")
    print(f"search: enumerated {res.num_enumerated}, invalid {res.num_invalid}, too big {res.num_too_big}, "
          f"unestimated {res.num_unestimated}, ranked {res.num_ranked}")
    print(f"{'stage':<22}{'best s':>10}{'median s':>10}{'CPU s':>10}{'ms/ranked plan':>16}")
    for name, best, med, cpu in (("enumerate", e_best, e_med, e_cpu), ("enumerate + memory", m_best, m_med, m_cpu),
                                 ("search", s_best, s_med, s_cpu)):
        print(f"{name:<22}{best:>10.2f}{med:>10.2f}{cpu:>10.2f}{best / max(res.num_ranked, 1) * 1e3:>16.1f}")
    print("best plans:")
    for r in res.plans:
        print(f"  {r.step_time_s:9.4f} s  {r.samples_per_s:9.1f} samples/s  {r.memory.total / 1e9:5.1f} GB  "
              f"{search.describe(r.parallelism)}")


if __name__ == "__main__":
    main()
