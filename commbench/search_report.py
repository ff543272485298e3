"""The terminal output of `commbench search`: the best plans as a table, then
what happened to every candidate (the counts add up to the enumerated total)."""
from rich.console import Console
from rich.table import Table

from commbench import ranking, search


def _s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def _top_reasons(reasons: dict, k: int = 3) -> list:
    return sorted(reasons.items(), key=lambda kv: -kv[1])[:k]


def print_report(rep: ranking.SearchReport, console: Console, system: str | None = None):
    r = rep.result
    where = f" of {system}" if system else ""
    console.print(f"{rep.model} on {rep.world} GPUs ({max(1, rep.world // rep.gpus_per_node)} nodes x "
                  f"{rep.gpus_per_node}){where}, global batch {rep.global_batch}, seq {rep.seq}, {rep.dtype}; "
                  f"{rep.gpu_memory_bytes / 1e9:g} GB per GPU, {r.usable_bytes / 1e9:.1f} GB usable")
    if rep.ranked:
        t = Table(title=f"best {len(rep.ranked)} of {r.num_ranked} ranked plans (by predicted step time)",
                  title_justify="left")
        cols = ["#", "plan", "step", "samples/s", "tokens/s", "TFLOPS/GPU"]
        if rep.peak_tflops:
            cols.append("MFU")
        cols += ["memory/GPU", "largest exposed"]
        for c in cols:
            t.add_column(c, justify="left" if c in ("plan", "largest exposed") else "right")
        for i, x in enumerate(rep.ranked, 1):
            sb, mem = x.prediction, x.plan.memory
            name, secs = ranking.largest_exposed(sb.breakdown)
            row = [str(i), search.describe(x.plan.parallelism), _s(sb.step_time_s), f"{sb.samples_per_s:.2f}",
                   f"{sb.tokens_per_s:,.0f}", f"{sb.tflops_per_gpu:.1f}"]
            if rep.peak_tflops:
                row.append(f"{sb.mfu:.1%}")
            row += [f"{mem.total / 1e9:.1f} GB", f"{name} {secs / sb.step_time_s:.1%}"]
            t.add_row(*row)
        console.print(t)
    else:
        console.print("[bold]no plan to rank[/]: none of the valid plans fits and could be estimated")
    c = rep.counts()
    console.print(f"enumerated {c['enumerated']} = invalid {c['invalid']} + too big {c['too_big']} + "
                  f"unestimated {c['unestimated']} + ranked {c['ranked']}")
    for reason, n in _top_reasons(r.invalid_reasons):
        console.print(f"  [dim]invalid x{n}:[/] {reason}")
    for reason, n in _top_reasons(r.unestimated_reasons):
        console.print(f"  [yellow]unestimated x{n}:[/] {reason}")
    small = rep.smallest_too_big()
    if small is not None and not rep.ranked:
        console.print(f"  smallest plan that does not fit: {search.describe(small.parallelism)} {small.reason}")
    for note in rep.notes:
        console.print(f"[yellow]note:[/] {note}")
