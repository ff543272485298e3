"""A plan predicted at several GPU counts: tp and pp held, dp grown with the
world; weak scaling holds the micro-batch and the micro-batches per step (so
the global batch grows with dp), strong scaling holds the global batch (so
each replica gets fewer micro-batches). Efficiency = throughput per GPU
relative to the first (smallest) count's."""
import dataclasses

from commbench import plan as plan_mod
from commbench.parallel import Parallelism


def parse_counts(text: str) -> list:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--scale {text!r}: a comma-separated list of GPU counts, e.g. 8,16,32") from None
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"--scale {text!r}: GPU counts must be positive integers")
    from commbench.parallel import MAX_WORLD
    if max(counts) > MAX_WORLD:
        raise ValueError(f"--scale {text!r}: commbench models jobs of up to {MAX_WORLD} GPUs")
    return sorted(set(counts))


def plan_at(par: Parallelism, world: int, mode: str) -> Parallelism:
    dp = world // (par.tp * par.pp) if world % (par.tp * par.pp) == 0 else 0
    if dp == 0:
        raise ValueError(f"{world} GPUs: not a multiple of tp x pp = {par.tp * par.pp}")
    if mode == "weak":
        gb = par.micro_batch * dp * par.num_microbatches
    else:
        gb = par.global_batch
        if gb % (par.micro_batch * dp):
            raise ValueError(f"strong scaling to {world} GPUs: global batch {gb} is not a multiple of "
                             f"micro-batch x dp = {par.micro_batch} x {dp}")
    return dataclasses.replace(par, world=world, dp=dp, global_batch=gb)


def scale(model, par: Parallelism, counts, mode: str, times_for, predict_fn) -> list:
    """One row per GPU count: the prediction's figures, its breakdown and the
    scaling efficiency. times_for(workload) -> Times bound to the workload's ops."""
    rows = []
    for world in counts:
        p = plan_at(par, world, mode)
        workload = plan_mod.build(model, p)
        times = times_for(workload)
        sb = predict_fn(workload, p, times)
        rows.append({"gpus": world, "dp": p.dp, "global_batch": p.global_batch, "step_time_s": sb.step_time_s,
                     "samples_per_s": sb.samples_per_s, "tokens_per_s": sb.tokens_per_s,
                     "tflops_per_gpu": sb.tflops_per_gpu, "mfu": sb.mfu, "breakdown": sb.breakdown,
                     "extrapolated": any(n.startswith("extrapolated") for n in sb.notes),
                     "from_spec": any("SystemSpec" in n or n.startswith("spec:") for n in sb.notes),
                     "notes": sb.notes})
    base = rows[0]["samples_per_s"] / rows[0]["gpus"]
    for r in rows:
        r["scaling_efficiency"] = (r["samples_per_s"] / r["gpus"]) / base
    return rows


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib (pip install 'commbench[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str, **kw):
    """fig to path, then closed; a path that cannot be written is a ValueError."""
    try:
        fig.savefig(path, **kw)
    except OSError as e:
        raise ValueError(f"--plot {path}: cannot write it ({e.strerror or e})") from None
    finally:
        _pyplot().close(fig)


BREAKDOWN_BARS = (("compute_s", "compute"), ("tp_exposed_s", "TP"), ("pp_exposed_s", "PP"),
                  ("dp_exposed_s", "DP/ZeRO"), ("bubble_s", "bubble"), ("optimizer_s", "optimizer"))


def stacked_breakdown(ax, labels: list, breakdowns: list):
    """The parts of each step (a StepBreakdown's breakdown dict) as one stacked bar per label."""
    bottom = [0.0] * len(labels)
    for key, name in BREAKDOWN_BARS:
        vals = [b[key] for b in breakdowns]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax.set_ylabel("step time (s)")
    ax.legend(fontsize="small")


def figure(rows: list, mode: str, title: str):
    """Throughput against GPUs (with linear scaling for reference) and the
    breakdown at each count as stacked bars; a matplotlib Figure."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    gpus = [r["gpus"] for r in rows]
    a.plot(gpus, [r["samples_per_s"] for r in rows], "o-", label="predicted")
    a.plot(gpus, [rows[0]["samples_per_s"] * g / gpus[0] for g in gpus], "--", color="grey", label="linear")
    a.set_xscale("log", base=2)
    a.set_xlabel("GPUs")
    a.set_ylabel("samples/s")
    a.set_title(f"{title} ({mode} scaling)")
    a.legend()
    stacked_breakdown(b, [str(g) for g in gpus], [r["breakdown"] for r in rows])
    b.set_xlabel("GPUs")
    fig.tight_layout()
    return fig


def plot(rows: list, mode: str, title: str, path: str):
    """Throughput and efficiency against GPUs, and the breakdown as stacked bars, to a file."""
    try:
        fig = figure(rows, mode, title)
    except ValueError as e:
        raise ValueError(f"--plot: {e}") from None
    save_figure(fig, path)
