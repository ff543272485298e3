"""Terminal tables of `commbench compare` (rich), from compare.compare()'s document."""
from rich.table import Table

STYLE = {"slower": "red", "faster": "green", "same": "", "untested": "yellow"}


def _bw(x):
    return "" if x is None else f"{x:.3f}"


def print_compare(doc: dict, con):
    labels = [s["label"] for s in doc["systems"]]
    ref, others = labels[0], labels[1:]
    con.print(f"reference: {ref}  ({doc['systems'][0]['path']})")
    for s in doc["systems"][1:]:
        con.print(f"vs {s['label']}  ({s['path']})")
    con.print(f"verdict: p50 ratio beyond x{doc['factor']} (or below 1/{doc['factor']}) and two-sided Mann-Whitney U "
              f"on the raw samples, Holm-corrected, p < {doc['alpha']}")
    t = Table(title="common cases: p50 time (us) and busbw (GB/s) per system; ratio = system / reference",
              title_justify="left")
    for col in ("op", "type", "redop", "size (B)", "n", "nodes", "axis", "in-place"):
        t.add_column(col, justify="right" if col in ("size (B)", "n", "nodes") else "left")
    for lab in labels:
        t.add_column(f"{lab} p50", justify="right")
        t.add_column(f"{lab} busbw", justify="right")
    for lab in others:
        t.add_column(f"{lab} ratio", justify="right")
        t.add_column(f"{lab} verdict")
    for c in doc["cases"]:
        cells = [c["op"], c["dtype"], c["redop"] or "", str(c["nbytes"]), str(c["group_size"]), str(c["num_nodes"]),
                 c["axis"], "yes" if c["in_place"] else "no"]
        for lab in labels:
            s = c["systems"][lab]
            cells += [f"{s['p50_s'] * 1e6:.2f}", _bw(s["busbw_gbps"])]
        for lab in others:
            v = c["vs_reference"][lab]
            style = STYLE[v["verdict"]]
            cells += [f"{v['ratio']:.3f}", f"[{style}]{v['verdict']}[/{style}]" if style else v["verdict"]]
        t.add_row(*cells)
    con.print(t)
    if doc["summary"]:
        s = Table(title="per collective: geometric mean of the p50 ratios (system / reference)", title_justify="left")
        for col in ("system", "op", "geomean ratio", "cases", "slower", "faster", "same", "untested"):
            s.add_column(col, justify="left" if col in ("system", "op") else "right")
        for r in doc["summary"]:
            s.add_row(r["system"], r["op"], f"{r['geomean_ratio']:.3f}", str(r["cases"]), str(r["slower"]),
                      str(r["faster"]), str(r["same"]), str(r["untested"]))
        con.print(s)
    if doc.get("predictions"):
        p = Table(title="predicted step time of the plans in the headers", title_justify="left")
        for col in ("plan", "system", "step (s)", "samples/s", "tokens/s"):
            p.add_column(col, justify="left" if col in ("plan", "system") else "right")
        for r in doc["predictions"]:
            p.add_row(r["plan"], r["system"], f"{r['step_time_s']:.4f}", f"{r['samples_per_s']:.2f}",
                      f"{r['tokens_per_s']:.0f}")
        con.print(p)
    for n in doc["notes"]:
        con.print(f"note: {n}")
    if doc.get("plot"):
        con.print(f"plot: {doc['plot']}")
