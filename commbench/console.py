"""Terminal output (rank 0 only): a progress bar over the sweep and, per
collective, an nccl-tests-like table. Tables are built from Measurements, so a
saved file prints exactly as the live run did (`commbench show`)."""
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _block_key(m):
    c = m.case
    return (c.axis, c.op, c.backend, c.device, c.dtype, c.params.get("redop"), c.in_place)


def _us(x):
    return "" if x is None else f"{x * 1e6:.2f}"


def _gbps(x):
    return "" if x is None else f"{x:.3f}"


def short_notes(m) -> str:
    """The warnings in a few characters each (the file keeps them in full)."""
    s, notes = m.stats, []
    if s["cv"] > 0.10:
        notes.append("unstable")
    if s["num_outliers"]:
        notes.append(f"{s['num_outliers']} outliers")
    if m.target_ci and (s.get("precision") is None or s["precision"] > m.target_ci):
        notes.append("CI>target")
    if m.iters < 10:
        notes.append("few samples")
    return ", ".join(notes)


def table(block: list) -> Table:
    first = block[0].case
    where = (f"{first.axis}: groups of {first.group_size} ranks x {first.concurrent_groups} at once, "
             f"{first.num_nodes} node{'s' if first.num_nodes != 1 else ''} per group")
    mode = "in-place" if first.in_place else "out-of-place"
    t = Table(title=f"{first.op}  {first.backend} {first.device}  {mode}  ({where})", title_justify="left")
    for name in ("size (B)", "count", "type", "redop", "root", "time p50 (us)", "p95 (us)",
                 "algbw (GB/s)", "busbw (GB/s)", "#wrong", "CV", "+-CI", "iters", "slowest", "notes"):
        t.add_column(name, justify="left" if name in ("type", "redop", "notes", "slowest") else "right")
    for m in block:
        c = m.case
        if m.status != "ok":
            t.add_row(str(c.nbytes), str(c.params.get("count", "")), c.dtype, c.params.get("redop") or "",
                      str(c.params.get("root", "")), "", "", "", "", "", "", "", "", "",
                      f"skipped: {m.skip_reason}")
            continue
        s = m.stats
        prec = s.get("precision")
        t.add_row(str(c.nbytes), str(c.params.get("count", "")), c.dtype, c.params.get("redop") or "",
                  str(c.params.get("root", "")), _us(s["time_p50_s"]), _us(s["time_p95_s"]),
                  _gbps(m.algbw_gbps), _gbps(m.busbw_gbps),
                  f"[red]{m.num_wrong}[/red]" if m.num_wrong else "0",
                  f"{s['cv']:.1%}", "" if prec is None else f"{prec:.1%}", str(m.iters),
                  "" if m.slowest_rank is None else f"{m.slowest_host}:{m.slowest_rank}", short_notes(m))
    return t


def print_tables(measurements, console: Console):
    block = []
    for m in measurements:
        if block and _block_key(m) != _block_key(block[-1]):
            console.print(table(block))
            block = []
        block.append(m)
    if block:
        console.print(table(block))


class Reporter:
    """Live output of a sweep: a progress bar (on a terminal's stderr) and each
    collective's table once its sizes are done."""

    def __init__(self, quiet: bool = False, to_stderr: bool = False):
        self.quiet = quiet
        self.console = Console(file=sys.stderr if to_stderr else sys.stdout, width=200)
        self.block = []
        self.progress = None

    def start(self, total: int):
        if self.quiet or not sys.stderr.isatty():
            return
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
        self.progress.start()
        self.task = self.progress.add_task("sweep", total=total)

    def add(self, m):
        if self.quiet:
            return
        if self.block and _block_key(m) != _block_key(self.block[-1]):
            self._flush()
        self.block.append(m)
        if self.progress:
            self.progress.update(self.task, advance=1, description=f"{m.case.op} {m.case.nbytes} B")

    def _flush(self):
        if not self.block:
            return
        # on a terminal, print above the live bar so the two do not interleave
        on_tty = self.progress is not None and self.console.file.isatty()
        (self.progress.console if on_tty else self.console).print(table(self.block))
        self.block = []

    def finish(self):
        if self.quiet:
            return
        if self.progress:
            self.progress.stop()
        self._flush()


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def print_plan(workload, par, console: Console):
    """The per-step CommOps of a plan (identical ops folded into one row) and the
    per-rank volume per axis, intra- and inter-node."""
    m = workload.model
    console.print(f"{m['name']} ({m['num_params'] / 1e9:.2f}B params) on {par.world} GPUs "
                  f"({par.num_nodes} nodes x {par.gpus_per_node}): dp {par.dp} x tp {par.tp} x pp {par.pp}, "
                  f"zero {par.zero}{' +sp' if par.sp else ''}, micro-batch {par.micro_batch}, "
                  f"global batch {par.global_batch} ({par.num_microbatches} micro-batches per step), "
                  f"seq {workload.parallelism['seq'] or m['seq']}, {par.dtype}"
                  + (f", vocab {m['vocab']} (padded to a multiple of {m['vocab_divisible_by']} x tp {par.tp})"
                     if m.get("vocab_divisible_by", 1) > 1 else ""))
    folded = {}
    for c in workload.comm_ops:
        key = (c.stage, c.strategy, c.axis, c.collective, c.phase, c.nbytes, c.group_size, c.num_nodes, c.overlap)
        entry = folded.setdefault(key, [0, 0, c.label])
        entry[0] += c.count
        entry[1] += 1
    t = Table(title="collectives per optimizer step, per rank", title_justify="left")
    for col in ("stage", "strategy", "axis", "collective", "phase", "size", "group", "nodes", "count/step",
                "overlaps", "ops", "example"):
        t.add_column(col, justify="right" if col in ("size", "group", "nodes", "count/step", "ops", "stage") else "left")
    for (stage, strat, axis, coll, phase, nbytes, g, nodes, overlap), (count, ops, label) in folded.items():
        t.add_row(str(stage), strat, axis, coll, phase, _bytes(nbytes), str(g), str(nodes), str(count), overlap,
                  str(ops), label)
    console.print(t)
    vol = Table(title="bytes each rank sends per step (S x count x busbw factor)", title_justify="left")
    for col in ("stage", "axis", "intra-node", "inter-node"):
        vol.add_column(col, justify="left" if col == "axis" else "right")
    per = {}
    for (stage, axis, where), v in workload.volume_per_axis().items():
        per.setdefault((stage, axis), {})[where] = v
    for (stage, axis), d in sorted(per.items()):
        vol.add_row(str(stage), axis, _bytes(d.get("intra", 0)), _bytes(d.get("inter", 0)))
    console.print(vol)


BREAKDOWN_PARTS = (("compute_s", "compute"), ("tp_exposed_s", "TP exposed"), ("pp_exposed_s", "PP exposed"),
                   ("dp_exposed_s", "DP/ZeRO exposed"), ("bubble_s", "pipeline bubble"),
                   ("optimizer_s", "optimizer"))


def _s(x: float) -> str:
    return f"{x * 1e3:.3f} ms" if x < 1 else f"{x:.3f} s"


def print_breakdown(sb, console: Console):
    """A StepBreakdown: throughput first, then where the step's time goes."""
    mfu = f"  MFU {sb.mfu:.1%}" if sb.mfu is not None else ""
    console.print(f"step {_s(sb.step_time_s)} (band {_s(sb.step_time_low_s)} - {_s(sb.step_time_high_s)})  "
                  f"{sb.samples_per_s:.3f} samples/s  {sb.tokens_per_s:.1f} tokens/s  "
                  f"{sb.tflops_per_gpu:.3f} model TFLOPS/GPU{mfu}  (critical stage {sb.critical_stage})")
    t = Table(title="step time breakdown (critical stage; the parts sum to the step)", title_justify="left")
    for col in ("part", "time", "share"):
        t.add_column(col, justify="left" if col == "part" else "right")
    for key, name in BREAKDOWN_PARTS:
        v = sb.breakdown[key]
        t.add_row(name, _s(v), f"{v / sb.step_time_s:.1%}")
    t.add_row("[dim]hidden DP/ZeRO comm (overlapped, not in the sum)[/]", _s(sb.breakdown["hidden_comm_s"]), "")
    console.print(t)
    for note in sb.notes:
        console.print(f"[yellow]note:[/] {note}")


def print_scaling(rows: list, mode: str, console: Console):
    t = Table(title=f"scaling ({mode}: {'micro-batch per GPU' if mode == 'weak' else 'global batch'} held)",
              title_justify="left")
    for col in ("GPUs", "dp", "global batch", "step", "samples/s", "tokens/s", "TFLOPS/GPU", "efficiency",
                "compute", "TP exp", "PP exp", "DP exp", "bubble", "notes"):
        t.add_column(col, justify="left" if col == "notes" else "right")
    for r in rows:
        b = r["breakdown"]
        t.add_row(str(r["gpus"]), str(r["dp"]), str(r["global_batch"]), _s(r["step_time_s"]),
                  f"{r['samples_per_s']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['tflops_per_gpu']:.2f}",
                  f"{r['scaling_efficiency']:.1%}", _s(b["compute_s"]), _s(b["tp_exposed_s"]),
                  _s(b["pp_exposed_s"]), _s(b["dp_exposed_s"]), _s(b["bubble_s"]),
                  ", ".join(f for f, on in (("extrapolated", r["extrapolated"]), ("spec", r["from_spec"])) if on))
    console.print(t)
