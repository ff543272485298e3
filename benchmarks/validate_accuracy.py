"""Prediction accuracy: a matrix of `commbench validate` runs on the CPU (gloo),
each one real training steps of a plan against the step predicted from that
job's own measured collectives and kernels. Prints one row per run and the
median and worst absolute error of the step time.

    .venv/bin/python benchmarks/validate_accuracy.py [--models tiny-gpt,small-gpt] [--steps 42]
        [--only ddp,tp] [--keep DIR] [--emulate 200mbit] [--rounds R] [--time-budget S] [--repeat N]
        [--plans matrix|extended]

--emulate RATE runs every validation on an emulated two-node cluster (`commbench
emulate --nodes 2`, root): the ranks split evenly over the two nodes, whose link
is shaped to RATE, so data-parallel traffic (and, on 2 ranks, tensor-parallel and
pipeline traffic too) crosses the slow network.

--rounds R and --time-budget S are passed to every `validate`: R rounds of
measuring then training within each run, S seconds per measured case and round.
The defaults (--steps 42 --rounds 6 --time-budget 0.25) are the settings of the
matrix quoted in README.md: on a noisy 2-core VM, more and shorter rounds gave
steadier medians than three longer ones.

--plans extended runs, instead of the matrix, the plans it leaves out (EXTENDED:
full recompute, SP, GPipe, interleaved, micro-batch 2, TP+PP, TP+ZeRO-1, an
interleaved pipeline under DDP, a pipeline under ZeRO-1).

--repeat N runs every validation N times and gives each row the median of its
runs' errors as well (this VM's run-to-run spread is as large as the errors).

Runs one validation at a time (they would time each other otherwise); a few
minutes each on a 2-core machine (the matrix: 48-50 min on loopback, 77 min
emulated at 200mbit)."""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, ranks, plan flags): every strategy and the combined ones; 4 micro-batches
# per replica everywhere (torch's pipelining + DDP needs more micro-batches than stages)
PLANS = [
    ("ddp", 2, ["--zero", "0", "--global-batch", "8"]),
    ("zero1", 2, ["--zero", "1", "--global-batch", "8"]),
    ("zero2", 2, ["--zero", "2", "--global-batch", "8"]),
    ("zero3", 2, ["--zero", "3", "--global-batch", "8"]),
    ("tp", 2, ["--tp", "2", "--global-batch", "4"]),
    ("pp", 2, ["--pp", "2", "--global-batch", "4"]),
    ("ddp", 4, ["--zero", "0", "--global-batch", "16"]),
    ("tp+dp", 4, ["--tp", "2", "--global-batch", "8"]),
    ("pp+dp", 4, ["--pp", "2", "--global-batch", "8"]),
]

# --plans extended: what the matrix leaves out (recompute, sequence parallelism,
# GPipe and interleaved schedules, a micro-batch of 2, TP with a pipeline or ZeRO-1,
# an interleaved pipeline under DDP, a pipeline under ZeRO-1, four pipeline stages);
# DTensor runs TP where Megatron's cannot (SP, PP)
EXTENDED = [
    ("ddp+rc", 2, ["--zero", "0", "--recompute", "full", "--global-batch", "8"]),
    ("zero3+rc", 2, ["--zero", "3", "--recompute", "full", "--global-batch", "8"]),
    ("tp+rc", 2, ["--tp", "2", "--recompute", "full", "--global-batch", "4"]),
    ("tp+sp", 2, ["--tp", "2", "--sp", "--global-batch", "4"]),
    ("gpipe", 2, ["--pp", "2", "--schedule", "gpipe", "--global-batch", "4"]),
    ("pp-int", 2, ["--pp", "2", "--schedule", "interleaved", "--interleave", "2", "--global-batch", "4"]),
    ("zero1mb2", 2, ["--zero", "1", "--micro-batch", "2", "--global-batch", "8"]),
    ("tp+pp", 4, ["--tp", "2", "--pp", "2", "--global-batch", "4"]),
    ("tp+zero1", 4, ["--tp", "2", "--zero", "1", "--global-batch", "8"]),
    ("pp-int+dp", 4, ["--pp", "2", "--schedule", "interleaved", "--interleave", "2", "--global-batch", "12"]),
    ("pp+zero1", 4, ["--pp", "2", "--zero", "1", "--global-batch", "8"]),
    ("pp4", 4, ["--pp", "4", "--global-batch", "8"]),
]


def run(model, ranks, flags, steps, out_dir, emulate=None, rounds=1, time_budget=0.5):
    validate = ["validate", "--model", model, "--device", "cpu", "--steps", str(steps), "--warmup-steps", "2",
                "--rounds", str(rounds), "--time-budget", str(time_budget),
                "--out-dir", str(out_dir), "--force", "--json", *flags]
    if emulate:
        cmd = [sys.executable, "-m", "commbench", "emulate", "--nodes", "2", "--ranks-per-node", str(ranks // 2),
               "--inter-bw", emulate, "--", sys.executable, "-m", "commbench", *validate,
               "--allow-tp-across-nodes"]
    else:
        cmd = [sys.executable, "-m", "commbench", *validate, "--nprocs", str(ranks)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        return None, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"
    return json.loads(p.stdout), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-gpt,small-gpt")
    ap.add_argument("--steps", type=int, default=42)
    ap.add_argument("--plans", choices=("matrix", "extended"), default="matrix",
                    help="the accuracy matrix, or the plans it leaves out (EXTENDED)")
    ap.add_argument("--only", default=None, help="comma-separated plan names")
    ap.add_argument("--keep", default=None, help="keep every run's files under this directory")
    ap.add_argument("--emulate", default=None, metavar="RATE",
                    help="run on an emulated 2-node cluster whose link is shaped to RATE (e.g. 200mbit; root)")
    ap.add_argument("--rounds", type=int, default=6,
                    help="validate --rounds: alternate measuring and training this many times within each run")
    ap.add_argument("--time-budget", type=float, default=0.25, help="validate --time-budget (seconds per case)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each validation this many times; each row's error is then the median of its runs'")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="commbench-accuracy-"))
    errors, row_errors = [], []
    print(f"validate --steps {a.steps} --rounds {a.rounds} --time-budget {a.time_budget}")
    if a.emulate:
        print(f"emulated cluster: 2 nodes, inter-node link {a.emulate}")
    print(f"{'model':<10} {'plan':<9} {'ranks':>5} {'measured ms':>12} {'predicted ms':>13} {'band ms':>17} "
          f"{'error':>8}  biggest predicted part")
    for model in a.models.split(","):
        for name, ranks, flags in (PLANS if a.plans == "matrix" else EXTENDED):
            if only and name not in only:
                continue
            mine = []
            for i in range(a.repeat):
                out = root / f"{model}-{name}-{ranks}" / (f"run{i + 1}" if a.repeat > 1 else "")
                doc, err = run(model, ranks, flags, a.steps, out, a.emulate, a.rounds, a.time_budget)
                if doc is None:
                    print(f"{model:<10} {name:<9} {ranks:>5}  failed: {err}")
                    continue
                b = doc["prediction"]["breakdown"]
                top = max((k for k in b if k != "hidden_comm_s"), key=lambda k: b[k])
                lo, hi = doc["predicted_band_s"]
                print(f"{model:<10} {name:<9} {ranks:>5} {doc['measured_step_time_s'] * 1e3:>12.2f} "
                      f"{doc['predicted_step_time_s'] * 1e3:>13.2f} {lo * 1e3:>8.1f}-{hi * 1e3:<8.1f} "
                      f"{doc['error_pct']:>+7.1f}%  {top} {b[top] / doc['predicted_step_time_s']:.0%}", flush=True)
                mine.append(doc["error_pct"])
            errors += [abs(e) for e in mine]
            if a.repeat > 1 and mine:
                row_errors.append(statistics.median(mine))
                print(f"{'median of ' + str(len(mine)) + ' runs':>72} {row_errors[-1]:>+7.1f}%", flush=True)
    if errors:
        print(f"\n{len(errors)} runs: median |error| {statistics.median(errors):.1f} %, worst {max(errors):.1f} %")
    if row_errors:
        worst = max(abs(e) for e in row_errors)
        print(f"{len(row_errors)} rows, each the median of its runs: median |error| "
              f"{statistics.median(abs(e) for e in row_errors):.1f} %, worst {worst:.1f} %")
    print(f"files: {root}")


if __name__ == "__main__":
    main()
