"""The study's tables (rich) and figures (matplotlib, Agg): one of each per
experiment, from the study document (study.run)."""
from rich.console import Console
from rich.table import Table

PARTS = (("compute_s", "compute"), ("tp_exposed_s", "TP"), ("pp_exposed_s", "PP"), ("dp_exposed_s", "DP/ZeRO"),
         ("bubble_s", "bubble"), ("optimizer_s", "optimizer"))


def _fit_text(r: dict) -> str:
    need = r["memory_bytes"]["total"] / 1e9
    if r["fits"]:
        return f"{need:.1f} GB"
    return f"[red]does not fit: {need:.1f} GB > {r['usable_bytes'] / 1e9:.1f}[/]"


def table(exp: dict) -> Table:
    t = Table(title=f"{exp['title']}  ({exp['why']})", title_justify="left")
    cols = ["system", "model", "plan", "GPUs", "memory/GPU", "samples/s", "tokens/s", "TFLOPS/GPU", "MFU"]
    if exp["scaling"]:
        cols.append("efficiency")
    cols += [name for _, name in PARTS]
    for c in cols:
        t.add_column(c, justify="left" if c in ("system", "model", "plan", "memory/GPU") else "right")
    for r in exp["rows"]:
        if "error" in r:
            t.add_row(r["system"], r["model"], r["label"], "", f"[red]invalid: {r['error']}[/]",
                      *[""] * (len(cols) - 5))
            continue
        plan = r["series"] if r["series"] != r["model"] else f"{r['label']} GPUs"
        row = [r["system"], r["model"], plan, str(r["gpus"]), _fit_text(r), f"{r['samples_per_s']:.1f}",
               f"{r['tokens_per_s']:,.0f}", f"{r['tflops_per_gpu']:.1f}",
               "" if r["mfu"] is None else f"{r['mfu']:.1%}"]
        if exp["scaling"]:
            row.append(f"{r['scaling_efficiency']:.1%}")
        step = r["step_time_s"]
        row += [f"{r['breakdown'][k] / step:.1%}" for k, _ in PARTS]
        t.add_row(*row)
    return t


def print_study(doc: dict, console: Console):
    console.print("systems: " + "; ".join(
        f"{s['name']} ({s['gpu']}, {s['gpus_per_node']} per node, {s['gpu_memory_gb']:g} GB, NVLink "
        f"{s['intra_bw_gbps']:g} GB/s, network {s['inter_bw_gbps']:g} GB/s per GPU)" for s in doc["systems"]))
    for exp in doc["experiments"]:
        console.print(table(exp))
    console.print("breakdown columns: share of the predicted step time (critical pipeline stage)")
    for note in doc.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")


# ----------------------------------------------------------------------------- figures
def _plt():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--out draws figures with matplotlib (pip install 'commbench[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _ok(rows):
    return [r for r in rows if "error" not in r]


def _systems(rows):
    return list(dict.fromkeys(r["system"] for r in rows))


def _scaling_figure(exp, plt):
    rows = _ok(exp["rows"])
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    for system in _systems(rows):
        rs = sorted((r for r in rows if r["system"] == system), key=lambda r: r["gpus"])
        gpus = [r["gpus"] for r in rs]
        line, = a.plot(gpus, [r["samples_per_s"] for r in rs], "o-", label=system)
        a.plot(gpus, [rs[0]["samples_per_s"] * g / gpus[0] for g in gpus], "--", color=line.get_color(), alpha=0.4)
        b.plot(gpus, [r["scaling_efficiency"] for r in rs], "o-", label=system)
        c.plot(gpus, [r["breakdown"]["dp_exposed_s"] / r["step_time_s"] for r in rs], "o-", label=system)
    for ax, ylabel in ((a, "samples/s (dashed: linear)"), (b, "scaling efficiency"),
                       (c, "exposed DP share of the step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize="small")
    b.set_ylim(0, 1.05)
    a.set_title(exp["title"], fontsize="medium", loc="left")
    return fig


def _bars_figure(exp, plt):
    """Per system one panel: stacked breakdown bars per point, samples/s on top;
    plans that do not fit are hatched and labelled."""
    rows = _ok(exp["rows"])
    systems = _systems(rows)
    fig, axes = plt.subplots(len(systems), 1, figsize=(max(8, 0.55 * len(rows) / len(systems) + 3),
                                                       4 * len(systems)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, system in zip(axes[:, 0], systems):
        rs = [r for r in rows if r["system"] == system]
        x = list(range(len(rs)))
        bottom = [0.0] * len(rs)
        for i, (key, name) in enumerate(PARTS):
            vals = [r["breakdown"][key] for r in rs]
            ax.bar(x, vals, bottom=bottom, color=colors[i % len(colors)], label=name,
                   hatch=None, edgecolor="white")
            bottom = [p + v for p, v in zip(bottom, vals)]
        for xi, r, top in zip(x, rs, bottom):
            text = f"{r['samples_per_s']:.0f}/s" if r["fits"] else "does not fit"
            ax.text(xi, top, text, ha="center", va="bottom", fontsize="x-small", rotation=90,
                    color="black" if r["fits"] else "red")
            if not r["fits"]:
                ax.bar([xi], [top], fill=False, hatch="//", edgecolor="red", linewidth=0)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{r['model']}\n{r['series']}" if r["series"] != r["model"] else r["label"]
                            for r in rs], fontsize="x-small", rotation=90)
        ax.set_ylabel(f"{system}: step time (s)")
        ax.margins(y=0.25)
        ax.legend(fontsize="x-small", ncol=len(PARTS))
    axes[0, 0].set_title(exp["title"], fontsize="medium", loc="left")
    return fig


def figure(exp: dict, path: str):
    """One PNG of an experiment: scaling curves, or stacked breakdown bars per system."""
    plt = _plt()
    fig = _scaling_figure(exp, plt) if exp["scaling"] else _bars_figure(exp, plt)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
