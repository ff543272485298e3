"""Replay kept `commbench validate` runs through the current predictor: each
round's prediction made again from that round's own measured files
(validate._predict, as validate made it), the median of the rounds (what
validate reports), against the run's measured step. Shows what a change of
the predictor does to runs already made, without training again; the
measurements and the measured steps are the run's, so only the model moved.

    PYTHONPATH=. .venv/bin/python benchmarks/replay_validate.py DIR [DIR ...]

DIR: a `validate --out-dir` (holding validate.json), or a directory of them
(`validate_accuracy.py --keep`). The plan (model and parallelism, GPUs per
node included) is read back from the run's measured files; the tensor-parallel
implementation is validate's default (--tp-impl auto)."""
import argparse
import dataclasses
import json
import os
import statistics
import sys

from commbench import models, plan, predict, results, validate
from commbench.parallel import Parallelism


def run_dirs(paths: list) -> list:
    out = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "validate.json")):
            out.append(p)
        elif os.path.isdir(p):
            out += sorted(os.path.join(p, d) for d in os.listdir(p)
                          if os.path.isfile(os.path.join(p, d, "validate.json")))
    return out


def plan_of(rf) -> tuple:
    """(ModelSpec, Parallelism) of a measured file's header (settings.plan)."""
    stored = rf.header["settings"]["plan"]
    m = stored["model"]
    model = (models.get(m["name"]) if m["name"] in models.CATALOGUE else
             models.ModelSpec(**{f.name: m[f.name] for f in dataclasses.fields(models.ModelSpec) if f.name in m}))
    par = Parallelism(**{f.name: stored["parallelism"][f.name] for f in dataclasses.fields(Parallelism)
                         if f.name in stored["parallelism"]})
    return model.at_tp(par.tp), par


def replay(run_dir: str) -> tuple:
    """(measured s, as-run prediction s, replayed prediction s)."""
    with open(os.path.join(run_dir, "validate.json")) as f:
        report = json.load(f)
    sbs = []
    for rnd in report["rounds"]:
        rf = {k: (results.load(v) if v else None) for k, v in rnd["results"].items()}
        model, par = plan_of(rf["comm"] or rf["compute"])
        workload = plan.build(model, par, tp_flavour=validate.tp_impl_for(model, par))
        sb, _ = validate._predict(workload, par, rf["comm"], rf["compute"], rf["interference"], report["device"])
        sbs.append(sb)
    return (report["measured_step_time_s"], report["predicted_step_time_s"],
            predict.median_breakdown(sbs).step_time_s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+")
    a = ap.parse_args()
    dirs = run_dirs(a.dirs)
    if not dirs:
        sys.exit(f"no validate.json under {', '.join(a.dirs)}")
    print(f"{'run':22s} {'measured ms':>12s} {'as run ms':>10s} {'error':>7s} {'replayed ms':>12s} {'error':>7s}")
    errors = []
    for d in dirs:
        meas, ran, now = replay(d)
        errors.append(100 * (now / meas - 1))
        print(f"{os.path.basename(d.rstrip('/')):22s} {meas * 1e3:12.2f} {ran * 1e3:10.2f} {100 * (ran / meas - 1):+6.1f}% "
              f"{now * 1e3:12.2f} {errors[-1]:+6.1f}%")
    print(f"{len(errors)} runs replayed: median |error| {statistics.median(abs(e) for e in errors):.1f} %, "
          f"worst {max(abs(e) for e in errors):.1f} %")


if __name__ == "__main__":
    main()
