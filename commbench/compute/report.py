"""What `commbench compute` prints: a table per part of the model (a transformer
layer, the embedding, the head, the optimizer step) with each op's measured
time, achieved TFLOPS and GB/s, and the forward and backward totals; and the
`--json` document of DESIGN.md ("ops": name, kind, m, n, k, flops, bytes, count,
time_p50_s)."""
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from commbench.compute.runner import op_time_s

SCOPES = (("layer", "transformer layer, kernel by kernel (one micro-batch)"),
          ("layer_module", "transformer layer as one module (one micro-batch)"),
          ("embedding", "embedding (first stage)"), ("head", "head, kernel by kernel (last stage)"),
          ("head_module", "head as one module (last stage)"),
          ("stage_module", "each pipeline stage as one module (one micro-batch)"), ("optimizer", "optimizer step"),
          ("framework", "data-parallel framework on a rank alone, bare and wrapped"),
          ("tp_stage", "each stage's micro-batch with its tensor parallelism in place"),
          ("pp_stage", "each virtual stage inside the plan's pipeline (one micro-batch)"),
          ("pp_optimizer", "each stage's optimizer step inside the plan's pipeline"),
          ("pp_p2p", "the stage boundaries' transfers inside the plan's pipeline (after the later of their posts)"))
# tables whose ops are counted differently from one another: no "x count" in the title
UNCOUNTED = ("optimizer", "framework", "pp_optimizer", "pp_p2p")


def json_doc(ops, matched) -> dict:
    rows = []
    for op in ops:
        m = matched.get(op)
        rows.append({"name": op.name, "kind": op.kind, "m": op.m, "n": op.n, "k": op.k, "flops": op.flops,
                     "bytes": op.nbytes, "count": op.count, "phase": op.phase, "stage": op.stage,
                     "scope": op.scope, "impl": op.impl, "dtype": op.dtype,
                     "time_p50_s": op_time_s(m) if m else None,
                     "precision": m.stats.get("precision") if m else None})
    return {"ops": rows}


def _shape(op) -> str:
    if op.kind == "gemm":
        return f"{op.m}x{op.n}x{op.k}"
    if op.kind == "attention":
        return f"{op.batch}x{op.m}x{op.n}x{op.k}"
    return f"{op.m}x{op.n}" if op.n > 1 else str(op.m)


def _table(title, ops, matched) -> Table:
    t = Table(title=title)
    for col in ("op", "kernel", "shape (m x n x k)", "p50 (us)", "+-CI", "TFLOPS", "GB/s", "notes"):
        t.add_column(col, justify="left" if col in ("op", "kernel", "notes") else "right")
    totals = {}
    for op in ops:
        m = matched.get(op)
        if m is None:
            t.add_row(op.name, op.impl, _shape(op), "-", "", "", "", "not measured")
            continue
        sec = op_time_s(m)
        totals[op.phase] = totals.get(op.phase, 0.0) + sec
        prec = m.stats.get("precision")
        t.add_row(op.name, op.impl, _shape(op), f"{sec * 1e6:.1f}", "" if prec is None else f"{prec:.1%}",
                  f"{op.flops / sec / 1e12:.3f}" if op.flops and sec > 0 else "",
                  f"{op.nbytes / sec / 1e9:.1f}" if sec > 0 else "", "; ".join(m.warnings)[:60])
    for phase in ("fwd", "bwd", "step"):
        if phase in totals:
            t.add_row(f"[bold]total {phase}[/]", "", "", f"[bold]{totals[phase] * 1e6:.1f}[/]", "", "", "", "")
    return t


def print_tables(ops, matched, console: Console | None = None):
    console = console or Console(width=200)
    for scope, title in SCOPES:
        part = [op for op in ops if op.scope == scope]
        if scope == "optimizer":
            part = part[:1] if len({op.m for op in part}) == 1 else part
        if part:
            count = part[0].count
            console.print(_table(f"{title}: x {count} per step" if scope not in UNCOUNTED else title, part, matched))
    per_stage = stage_totals(ops, matched)
    if per_stage:
        t = Table(title="compute per optimizer step, per rank of each stage")
        for col in ("stage", "fwd (s)", "bwd (s)", "optimizer (s)", "total (s)"):
            t.add_column(col, justify="right")
        for stage, tot in sorted(per_stage.items()):
            t.add_row(str(stage), f"{tot['fwd']:.6f}", f"{tot['bwd']:.6f}", f"{tot['step']:.6f}",
                      f"{sum(tot.values()):.6f}")
        console.print(t)


def stage_totals(ops, matched) -> dict:
    """stage -> {fwd, bwd, step}: seconds per optimizer step (time x count) of
    the measured ops at the coarsest granularity measured (as the predictor
    takes them); {} if any op is unmeasured."""
    from commbench.predict import granularity

    class Measured:
        @staticmethod
        def measured(op):
            return op in matched
    stages = sorted({op.stage for op in ops if op.stage >= 0} | {0})
    out = {}
    for s in stages:
        chosen = granularity(ops, Measured, s)
        if any(op not in matched for op in chosen):
            return {}
        out[s] = {"fwd": 0.0, "bwd": 0.0, "step": 0.0}
        for op in chosen:
            out[s][op.phase] += op_time_s(matched[op]) * op.count
    return out


class ComputeProgress:
    """A progress bar on a terminal's stderr while the kernels are timed."""

    def __init__(self, quiet: bool):
        self.progress = None if quiet or not sys.stderr.isatty() else Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=Console(file=sys.stderr), transient=True)

    def start(self, total):
        if self.progress:
            self.progress.start()
            self.task = self.progress.add_task("compute", total=total)

    def advance(self, m):
        if self.progress:
            self.progress.update(self.task, advance=1, description=f"{m.case.op}")

    def finish(self):
        if self.progress:
            self.progress.stop()
