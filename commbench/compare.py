"""`commbench compare A B [...]`: systems side by side for every Case common to
all files. The first file is the reference; every other file is tested against
it with commbench.verdicts (join key, Mann-Whitney U + Holm, --factor). Adds a
geometric mean of the ratios per collective, an optional busbw-vs-size plot, and
the predicted step time of the plans the files were measured for (header
settings.plan, written by `run --plan`)."""
import dataclasses
import os

from commbench import results, verdicts


def load_all(paths: list) -> list:
    if len(paths) < 2:
        raise ValueError(f"compare needs at least two results files, got {len(paths)}")
    return [results.load(p) for p in paths]


def _host_label(rf) -> str:
    cl = rf.header.get("cluster") or {}
    hosts = cl.get("hosts") or list((cl.get("ranks_per_host") or {}).keys())
    if not hosts:
        return os.path.basename(rf.path or "?")
    return hosts[0] + (f"+{len(hosts) - 1}" if len(hosts) > 1 else "")


def labels_for(files: list, labels: list | None) -> list:
    """--labels as given, else each header's hosts; equal labels (the same
    machine twice) get the file name appended."""
    if labels:
        if len(labels) != len(files):
            raise ValueError(f"--labels gives {len(labels)} names for {len(files)} files")
        if len(set(labels)) != len(labels):
            raise ValueError(f"--labels must be distinct, got {', '.join(labels)}")
        return list(labels)
    out = [_host_label(rf) for rf in files]
    if len(set(out)) != len(out):
        out = [f"{lab} ({os.path.basename(rf.path or str(i))})" for i, (lab, rf) in enumerate(zip(out, files))]
    if len(set(out)) != len(out):
        out = [f"{lab} #{i + 1}" for i, lab in enumerate(out)]
    return out


def compare(files: list, labels: list, factor: float = 1.05, alpha: float = verdicts.ALPHA) -> dict:
    """The comparison as one JSON-able document (see README, `commbench compare`)."""
    ref = files[0]
    pairs = [verdicts.compare_pair(ref, rf, factor, alpha) for rf in files[1:]]
    common = set.intersection(*({r.key for r in p.rows} for p in pairs))
    by_key = [{r.key: r for r in p.rows} for p in pairs]
    cases = []
    for r0 in pairs[0].rows:
        if r0.key not in common:
            continue
        c = r0.case
        systems = {labels[0]: {"p50_s": r0.p50_a_s, "busbw_gbps": r0.a.busbw_gbps, "iters": r0.a.iters,
                               "backend": c.backend}}
        versus = {}
        for lab, rows in zip(labels[1:], by_key):
            r = rows[r0.key]
            systems[lab] = {"p50_s": r.p50_b_s, "busbw_gbps": r.b.busbw_gbps, "iters": r.b.iters,
                            "backend": r.b.case.backend}
            versus[lab] = {"ratio": r.ratio, "p_value": r.p_value, "p_adjusted": r.p_adjusted,
                           "verdict": r.verdict}
        cases.append({"op": c.op, "dtype": c.dtype, "nbytes": c.nbytes, "group_size": c.group_size,
                      "num_nodes": c.num_nodes, "axis": c.axis, "in_place": c.in_place,
                      "redop": c.params.get("redop"), "systems": systems, "vs_reference": versus})
    summary = []
    for lab, p in zip(labels[1:], pairs):
        rows = [r for r in p.rows if r.key in common]
        for op, (gm, n) in verdicts.geomean_by_op(rows).items():
            mine = [r for r in rows if r.case.op == op]
            summary.append({"system": lab, "op": op, "geomean_ratio": gm, "cases": n,
                            **{v: sum(r.verdict == v for r in mine) for v in ("slower", "faster", "same",
                                                                              "untested")}})
    notes = [n for p in pairs for n in p.notes]
    if not cases:
        notes.append("no Case is common to all files (join key: kind, op, dtype, nbytes, group_size, "
                     "num_nodes, axis, in_place, concurrent_groups, redop, root)")
    return {"reference": labels[0], "factor": factor, "alpha": alpha, "test": "mann-whitney-u two-sided",
            "correction": "holm", "systems": [{"label": lab, "path": rf.path, "hosts": (rf.header.get("cluster")
                                                                                      or {}).get("hosts")}
                                              for lab, rf in zip(labels, files)],
            "cases": cases, "summary": summary, "notes": notes}


# ----------------------------------------------------------------------------- plans in the headers
def plans_in(files: list) -> dict:
    """{name: workload dict} of the plans the files were measured for."""
    out = {}
    for rf in files:
        wd = (rf.header.get("settings") or {}).get("plan")
        if isinstance(wd, dict) and "model" in wd and "parallelism" in wd:
            p = wd["parallelism"]
            name = (f"{wd['model'].get('name', '?')} world {p.get('world')} dp {p.get('dp')} tp {p.get('tp')} "
                    f"pp {p.get('pp')} zero {p.get('zero')}")
            out.setdefault(name, wd)
    return out


def _model_par(wd: dict):
    from commbench import plan as plan_mod
    from commbench.parallel import Parallelism
    names = {f.name for f in dataclasses.fields(Parallelism)}
    model = {k: v for k, v in wd["model"].items() if k != "num_params"}
    return plan_mod.from_mapping({"model": model, **{k: v for k, v in wd["parallelism"].items() if k in names}})


def predictions(files: list, labels: list, compute_paths: list | None) -> tuple[list, list]:
    """([{plan, system, step_time_s, samples_per_s, notes}], notes). The predictor
    needs kernel times besides the collectives: without --compute (one file per
    system) it says so in one note instead of failing."""
    plans = plans_in(files)
    if not plans:
        return [], []
    if not compute_paths:
        return [], [f"plan(s) in the headers ({'; '.join(plans)}): the predicted step time needs kernel times "
                    "too: give --compute FILE per system (commbench compute)"]
    if len(compute_paths) != len(files):
        raise ValueError(f"--compute gives {len(compute_paths)} files for {len(files)} systems: one per system, "
                         "in the order of the results files")
    from commbench import plan as plan_mod
    from commbench import predict
    rows, notes = [], []
    for name, wd in plans.items():
        model, par = _model_par(wd)
        workload = plan_mod.build(model, par)
        for lab, rf, cp in zip(labels, files, compute_paths):
            try:
                times = predict.load_times([rf.path], [cp])
                sb = predict.predict(workload, par, times.bind(workload.compute_ops))
            except ValueError as e:
                notes.append(f"{name} on {lab}: not predicted: {e}")
                continue
            d = sb.to_dict()
            rows.append({"plan": name, "system": lab, "step_time_s": d["step_time_s"],
                         "samples_per_s": d["samples_per_s"], "tokens_per_s": d["tokens_per_s"],
                         "notes": d.get("notes", [])})
    return rows, notes


# ----------------------------------------------------------------------------- plot
def plot(files: list, labels: list, path: str):
    """busbw vs size, one panel per collective, one line per system (and per
    axis / in-place variant where a file has several)."""
    from commbench import scaling
    plt = scaling._pyplot()
    series = {}
    for lab, rf in zip(labels, files):
        for m in rf.measurements:
            if m.status != "ok" or not m.busbw_gbps or m.case.kind != "collective":
                continue
            c = m.case
            variant = (c.axis, c.dtype, c.in_place, c.group_size)
            series.setdefault(c.op, {}).setdefault((lab, variant), []).append((c.nbytes, m.busbw_gbps))
    if not series:
        raise ValueError("--plot: no collective measurement with a bus bandwidth in the files")
    ops = sorted(series)
    fig, axes = plt.subplots(len(ops), 1, figsize=(8, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        variants = {v for (_, v) in series[op]}
        for (lab, v), pts in sorted(series[op].items(), key=lambda kv: str(kv[0])):
            pts.sort()
            extra = "" if len(variants) == 1 else f" {v[0]} {v[1]} n={v[3]}{' in-place' if v[2] else ''}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=lab + extra)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")      # busbw spans decades from latency- to bandwidth-bound sizes
        ax.set_title(op)
        ax.set_xlabel("size S (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    scaling.save_figure(fig, path, dpi=110)
