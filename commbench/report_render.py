"""The report's content as a list of blocks, rendered twice: as one HTML page
(figures as data: URIs, styles inline, no scripts and no network resources) and
as markdown (figures as relative links to figures/*.png)."""
import datetime
import html

from commbench import __version__ as VERSION

PARTS = (("compute_s", "compute"), ("tp_exposed_s", "TP exposed"), ("pp_exposed_s", "PP exposed"),
         ("dp_exposed_s", "DP/ZeRO exposed"), ("bubble_s", "pipeline bubble"), ("optimizer_s", "optimizer"),
         ("hidden_comm_s", "hidden DP/ZeRO comm (overlapped, not in the sum)"))
TABLE_COLUMNS = ("op", "axis", "group", "nodes", "dtype", "variant", "size (B)", "p50 (us)", "busbw (GB/s)", "CV",
                 "#wrong", "warnings")


def _s(x) -> str:
    return "" if x is None else (f"{x * 1e3:.3f} ms" if x < 1 else f"{x:.3f} s")


def _env_rows(h: dict) -> list:
    c, v = h.get("cluster") or {}, h.get("versions") or {}
    gpus = c.get("gpus") or []
    names = {}
    for g in gpus:
        names[g.get("name", "?")] = names.get(g.get("name", "?"), 0) + 1
    rows = [("run", f"{h.get('run_id', '')}  {h.get('created_at', '')}"),
            ("command", " ".join(h.get("command_line") or [])),
            ("launcher", str(h.get("launcher", ""))),
            ("ranks", f"{c.get('num_ranks', '?')} on {c.get('num_hosts', '?')} host(s): " +
             ", ".join(f"{k} x {n}" for k, n in (c.get("ranks_per_host") or {}).items())),
            ("cpu", f"{c.get('cpu_model', '')} ({c.get('cpu_count', '?')} cores)"),
            ("gpus", ", ".join(f"{n} x {k}" for k, n in names.items()) or "none recorded")]
    rows += [(k, str(x)) for k, x in v.items() if x is not None]
    rows += [(k, str(x)) for k, x in (h.get("env") or {}).items()]
    if h.get("reference"):
        rows = [("REFERENCE", "published figures, not measured by commbench"),
                ("source", str(h.get("source", ""))), ("url", str(h.get("url", ""))),
                ("notes", str(h.get("notes", "")))] + rows
    return rows


def _measurement_rows(rf) -> list:
    rows = []
    for m in rf.measurements:
        c, s = m.case, m.stats or {}
        group = f"{c.group_size}" + (f" x{c.concurrent_groups}" if c.concurrent_groups != 1 else "")
        # what else tells two cases of one shape apart: in place or not, the reduction op
        variant = ("in-place" if c.in_place else "out-of-place") + \
            (f" {c.params['redop']}" if c.params.get("redop") else "")
        if m.status != "ok":
            rows.append((c.op, c.axis, group, str(c.num_nodes), c.dtype, variant, str(c.nbytes), "", "", "", "",
                         f"skipped: {m.skip_reason}"))
            continue
        p50, cv = s.get("time_p50_s"), s.get("cv")
        rows.append((c.op, c.axis, group, str(c.num_nodes), c.dtype, variant, str(c.nbytes),
                     "" if p50 is None else f"{p50 * 1e6:.2f}",
                     "" if m.busbw_gbps is None else f"{m.busbw_gbps:.4g}",
                     "" if cv is None else f"{cv:.1%}", str(m.num_wrong), "; ".join(m.warnings)))
    return rows


def _step_rows(doc: dict, validation: dict | None) -> list:
    rows = []
    if validation:
        rows += [("measured step (median)", _s(validation["measured_step_time_s"])),
                 ("predicted step", _s(validation["predicted_step_time_s"])),
                 ("error", f"{validation['error_pct']:+.1f} %"),
                 ("implementation", str(validation.get("implementation", "")))]
        if validation.get("plan"):
            rows.append(("plan", ", ".join(f"{k} {v}" for k, v in validation["plan"].items())))
    mfu = doc.get("mfu")
    rows += [("step (predicted)", f"{_s(doc['step_time_s'])} (band {_s(doc.get('step_time_low_s'))} - "
                                  f"{_s(doc.get('step_time_high_s'))})"),
             ("throughput", f"{doc.get('samples_per_s', 0):.3f} samples/s, {doc.get('tokens_per_s', 0):.1f} tokens/s"),
             ("model TFLOPS per GPU", f"{doc.get('tflops_per_gpu', 0):.3f}" + (f" (MFU {mfu:.1%})" if mfu else "")),
             ("critical stage", str(doc.get("critical_stage", "")))]
    b, step = doc["breakdown"], doc["step_time_s"]
    for key, name in PARTS:
        if key in b:
            share = f" ({b[key] / step:.1%})" if step and key != "hidden_comm_s" else ""
            rows.append((name, _s(b[key]) + share))
    rows += [("note", n) for n in doc.get("notes") or []]
    return rows


def _scaling_rows(sc: dict) -> list:
    out = []
    for r in sc["rows"]:
        b = r["breakdown"]
        eff = r.get("scaling_efficiency")
        out.append((str(r["gpus"]), str(r.get("dp", "")), str(r.get("global_batch", "")), _s(r.get("step_time_s")),
                    f"{r['samples_per_s']:.2f}", "" if eff is None else f"{eff:.1%}", _s(b["compute_s"]),
                    _s(b["tp_exposed_s"]), _s(b["pp_exposed_s"]), _s(b["dp_exposed_s"]), _s(b["bubble_s"]),
                    ", ".join(f for f, on in (("extrapolated", r.get("extrapolated")), ("spec", r.get("from_spec")))
                              if on)))
    return out


def blocks(title, sources, figs, step_figs) -> list:
    """The report's content: ("h1"|"h2"|"h3"|"p", text), ("kv", rows), ("table", header, rows), ("fig", Figure)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [("h1", title), ("p", f"commbench {VERSION}, {now}. Inputs: " +
                           ", ".join(f"{s.label} ({s.kind}: {s.path})" for s in sources))]
    res = [s for s in sources if s.kind == "results"]
    if figs:
        out.append(("h2", "Bus bandwidth against size, per collective and group"))
        out.append(("p", "busbw from the p50 time (nccl-tests' definitions, 1 GB = 1e9 B); one line per results file."))
        out += [("fig", f) for f in figs]
    steps = [s for s in sources if s.kind in ("predict", "validate")]
    if steps:
        out.append(("h2", "Training step"))
        out += [("fig", f) for f in step_figs]
        for s in steps:
            doc = s.data["prediction"] if s.kind == "validate" else s.data
            out.append(("h3", f"{s.label} ({s.kind})"))
            out.append(("kv", _step_rows(doc, s.data if s.kind == "validate" else None)))
            if s.kind == "predict" and s.data.get("scaling"):
                sc = s.data["scaling"]
                out.append(("p", f"scaling ({sc.get('mode', 'weak')})"))
                out.append(("table", ("GPUs", "dp", "global batch", "step", "samples/s", "efficiency", "compute",
                                      "TP exp", "PP exp", "DP exp", "bubble", "notes"), _scaling_rows(sc)))
    for s in res:
        out.append(("h2", f"Measurements: {s.label}"))
        out.append(("kv", _env_rows(s.data.header)))
        out.append(("table", TABLE_COLUMNS, _measurement_rows(s.data)))
    return out


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0;"
         "font-size:90%}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td.l,th.l{text-align:left}"
         "th{background:#eee}img{max-width:100%}table.kv td{text-align:left}"
         "figure{display:inline-block;vertical-align:top;max-width:640px;margin:0.5em}")


LEFT = ' class="l"'


def render_html(title, sources, figs, step_figs) -> str:
    e = html.escape
    parts = ["<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
             f"<title>{e(title)}</title><style>{STYLE}</style></head><body>"]
    for b in blocks(title, sources, figs, step_figs):
        kind = b[0]
        if kind in ("h1", "h2", "h3", "p"):
            parts.append(f"<{kind}>{e(b[1])}</{kind}>")
        elif kind == "kv":
            parts.append("<table class=\"kv\">" + "".join(f"<tr><th class=\"l\">{e(k)}</th><td>{e(v)}</td></tr>"
                                                          for k, v in b[1]) + "</table>")
        elif kind == "table":
            cls = [LEFT if h in ("op", "axis", "dtype", "warnings", "notes") else "" for h in b[1]]
            head = "".join(f"<th{cls[i]}>{e(h)}</th>" for i, h in enumerate(b[1]))
            body = "".join("<tr>" + "".join(f"<td{cls[i]}>{e(c)}</td>" for i, c in enumerate(r)) + "</tr>"
                           for r in b[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            f = b[1]
            parts.append(f"<figure id=\"{e(f.name)}\"><img alt=\"{e(f.title)}\" src=\"{f.data_uri()}\">"
                         f"<figcaption>{e(f.title)}</figcaption></figure>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(title, sources, figs, step_figs) -> str:
    out = []
    for b in blocks(title, sources, figs, step_figs):
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + b[1] + "\n")
        elif kind == "p":
            out.append(b[1] + "\n")
        elif kind == "kv":
            out.append("| | |\n|---|---|\n" + "".join(f"| {_md(k)} | {_md(v)} |\n" for k, v in b[1]))
        elif kind == "table":
            out.append("| " + " | ".join(b[1]) + " |\n|" + "---|" * len(b[1]) + "\n" +
                       "".join("| " + " | ".join(_md(c) for c in r) + " |\n" for r in b[2]))
        else:
            out.append(f"![{_md(b[1].title)}](figures/{b[1].name}.png)\n")
    return "\n".join(out)
