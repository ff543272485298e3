"""`commbench report`: results files, predictions and validations as one
self-contained HTML page (figures embedded as base64 PNG, no network resources)
and a markdown report (figures as PNG files beside it).

Inputs, detected by content: a results file (JSON Lines whose line 1 is a
commbench header), the JSON document of `commbench predict --json` (keys
step_time_s and breakdown; with --scale also scaling.rows) and a validate.json
(keys measured_step_time_s, predicted_step_time_s, prediction)."""
import base64
import io
import json
import os
from dataclasses import dataclass

from commbench import outputs, results, scaling
from commbench.report_render import render_html, render_markdown

BREAKDOWN_KEYS = ("compute_s", "tp_exposed_s", "pp_exposed_s", "dp_exposed_s", "bubble_s", "optimizer_s")


@dataclass
class Source:
    path: str
    kind: str               # results | predict | validate
    data: object            # a ResultFile, or the JSON document
    label: str = ""


@dataclass
class Figure:
    name: str               # file name stem, unique in the report
    title: str
    png: bytes

    def data_uri(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


def _check_numbers(path: str, doc: dict, keys: tuple):
    for k in keys:
        v = doc.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"{path}: {k} is {v!r}, not a number")


def _check_breakdown(path: str, b, where: str):
    if not isinstance(b, dict) or any(not isinstance(b.get(k), (int, float)) for k in BREAKDOWN_KEYS):
        raise ValueError(f"{path}: {where} lacks a breakdown with {', '.join(BREAKDOWN_KEYS)}")


def load_input(path: str) -> Source:
    """A results file, a predict --json document or a validate.json, by content."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text: not a results file or a predict/validate JSON document") from None
    try:
        head = json.loads(text.lstrip().split("\n", 1)[0])
    except json.JSONDecodeError:
        head = None
    if isinstance(head, dict) and head.get("type") == "header":
        return Source(path, "results", results.load(path))
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{path}: neither a commbench results file (JSON Lines with a header line) "
                         "nor a predict --json / validate.json document") from None
    if isinstance(doc, dict) and {"measured_step_time_s", "predicted_step_time_s", "prediction"} <= doc.keys():
        _check_numbers(path, doc, ("measured_step_time_s", "predicted_step_time_s", "error_pct"))
        _check_breakdown(path, doc["prediction"].get("breakdown") if isinstance(doc["prediction"], dict) else None,
                         "the validation's prediction")
        return Source(path, "validate", doc)
    if isinstance(doc, dict) and {"step_time_s", "breakdown"} <= doc.keys():
        _check_numbers(path, doc, ("step_time_s", "samples_per_s"))
        _check_breakdown(path, doc["breakdown"], "the prediction")
        sc = doc.get("scaling")
        if sc is not None:
            rows = sc.get("rows") if isinstance(sc, dict) else None
            if not rows or not isinstance(rows, list) or any(
                    not isinstance(r, dict) or not {"gpus", "samples_per_s", "breakdown"} <= r.keys() for r in rows):
                raise ValueError(f"{path}: scaling must be {{\"mode\", \"rows\": [{{\"gpus\", \"samples_per_s\", "
                                 "\"breakdown\", ...}}]}} as commbench predict --scale --json writes it")
            for r in rows:
                _check_breakdown(path, r["breakdown"], f"scaling row at {r['gpus']} GPUs")
        return Source(path, "predict", doc)
    raise ValueError(f"{path}: a JSON document without the keys of commbench predict --json (step_time_s, breakdown) "
                     "or of validate.json (measured_step_time_s, predicted_step_time_s, prediction)")


def _labels(sources: list):
    """File names without extension; the parent folder is added where two collide."""
    names = [os.path.splitext(os.path.basename(s.path))[0] for s in sources]
    for s, n in zip(sources, names):
        s.label = n if names.count(n) == 1 else os.path.join(os.path.basename(os.path.dirname(os.path.abspath(s.path))), n)
    labels = [s.label for s in sources]
    for i, s in enumerate(sources):
        if labels.count(s.label) > 1:
            s.label = f"{s.label} ({i + 1})"


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    scaling._pyplot().close(fig)
    return buf.getvalue()


def _variant(c) -> tuple:
    """What tells two lines of one file apart in a figure (only the differing parts are shown)."""
    return (c.backend, c.device, c.dtype, "in-place" if c.in_place else "out-of-place", c.params.get("redop") or "",
            f"x{c.concurrent_groups} groups" if c.concurrent_groups != 1 else "")


def busbw_figures(sources: list) -> list:
    """One figure per collective and group (op, axis, group size, nodes): busbw
    against size, one line per results file (and per dtype/backend/in-place
    variant where a figure holds several)."""
    plt = scaling._pyplot()
    groups = {}
    for s in sources:
        if s.kind != "results":
            continue
        for m in s.data.measurements:
            c = m.case
            if c.kind != "collective" or m.status != "ok" or not m.busbw_gbps or c.nbytes <= 0:
                continue
            key = (c.op, c.axis, c.group_size, c.num_nodes)
            groups.setdefault(key, {}).setdefault((s.label, _variant(c)), []).append((c.nbytes, m.busbw_gbps))
    figs = []
    for i, ((op, axis, size, nodes), lines) in enumerate(sorted(groups.items())):
        variants = {v for _, v in lines}
        differs = [i for i in range(len(next(iter(variants)))) if len({v[i] for v in variants}) > 1]
        fig, ax = plt.subplots(figsize=(9, 3.8))
        for (label, variant), pts in sorted(lines.items()):
            pts.sort()
            name = " ".join([label] + [variant[i] for i in differs if variant[i]])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size S (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        title = f"{op}, {axis}: groups of {size} rank{'s' if size != 1 else ''}, {nodes} node{'s' if nodes != 1 else ''}"
        ax.set_title(title, fontsize="medium")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        figs.append(Figure(f"busbw-{i + 1:02d}-{op}-{axis}-{size}", f"busbw vs size: {title}", _png(fig)))
    return figs


def breakdown_figure(sources: list):
    """The step-time breakdown of every prediction and validation, stacked bars;
    a validation's measured step is drawn as a black marker on its bar."""
    steps = [s for s in sources if s.kind in ("predict", "validate")]
    if not steps:
        return None
    plt = scaling._pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(steps) + 3), 4.2))
    pred = [s.data["prediction"] if s.kind == "validate" else s.data for s in steps]
    scaling.stacked_breakdown(ax, [s.label for s in steps], [p["breakdown"] for p in pred])
    measured = [(s.label, s.data["measured_step_time_s"]) for s in steps if s.kind == "validate"]
    if measured:
        ax.plot([m[0] for m in measured], [m[1] for m in measured], "kx", markersize=10, mew=2,
                label="measured step (median)")
        ax.legend(fontsize="small")
    ax.set_title("predicted step time, critical stage (the parts sum to the step)", fontsize="medium")
    fig.tight_layout()
    return Figure("breakdown", "step-time breakdown", _png(fig))


def scaling_figures(sources: list) -> list:
    out = []
    for i, s in enumerate(sources):
        sc = s.data.get("scaling") if s.kind == "predict" else None
        if sc:
            fig = scaling.figure(sc["rows"], sc.get("mode", "weak"), s.label)
            out.append(Figure(f"scaling-{i + 1:02d}", f"scaling: {s.label} ({sc.get('mode', 'weak')})", _png(fig)))
    return out


def build(paths: list, out_dir: str, title: str = "commbench report", force: bool = False) -> dict:
    """Write out_dir/report.html, out_dir/report.md and out_dir/figures/*.png;
    returns {"html", "markdown", "figures"} paths. Never replaces an existing
    report without force."""
    if not paths:
        raise ValueError("report: give at least one results file or predict/validate JSON document")
    html_path, md_path = os.path.join(out_dir, "report.html"), os.path.join(out_dir, "report.md")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out {out_dir} exists and is not a folder")
    for p in (html_path, md_path):
        outputs.check_new(p, force, "--out")
    sources = [load_input(p) for p in paths]
    _labels(sources)
    figs = busbw_figures(sources)
    bd = breakdown_figure(sources)
    step_figs = ([bd] if bd else []) + scaling_figures(sources)
    fig_dir = os.path.join(out_dir, "figures")
    fig_paths = [os.path.join(fig_dir, f.name + ".png") for f in figs + step_figs]
    for p in fig_paths:
        outputs.check_new(p, force, "--out")
    # everything is rendered before the first file is written: a failure leaves nothing behind
    pages = render_html(title, sources, figs, step_figs), render_markdown(title, sources, figs, step_figs)
    os.makedirs(fig_dir, exist_ok=True)
    for p, f in zip(fig_paths, figs + step_figs):
        with open(p, "wb") as fh:
            fh.write(f.png)
    for path, page in zip((html_path, md_path), pages):
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(page)
    return {"html": html_path, "markdown": md_path, "figures": fig_paths}
