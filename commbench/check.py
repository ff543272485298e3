"""`commbench check --baseline BASE NEW`: the regression gate. Every Case common
to both files is judged by commbench.verdicts (Mann-Whitney U on the raw samples,
Holm-corrected, and the practical --factor); exit 1 when any is slower, 0
otherwise. Bad input exits 2 through a ValueError: an unreadable or invalid
file, and also no Case in common (a gate that passes because nothing joined
would hide a broken or mislabelled run). The report is markdown, fit for a CI
job's log and its step summary, and lists what differs between the two
environments (versions, hosts, GPUs, allow-listed env vars, commbench version,
command line, backends)."""
import json
import shlex

from commbench import results, verdicts

EXIT_OK, EXIT_REGRESSION = 0, 1


def _gpu_names(h: dict) -> str:
    gpus = (h.get("cluster") or {}).get("gpus") or []
    names = [g.get("name", "?") if isinstance(g, dict) else str(g) for g in gpus]
    return ", ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names)) or "none"


def _cmdline(h: dict) -> str:
    c = h.get("command_line")
    return shlex.join(map(str, c)) if isinstance(c, list) else str(c or "")


def _backends(rf) -> str:
    return ", ".join(sorted({f"{m.case.backend}/{m.case.device}" for m in rf.measurements}))


def env_diff(base, new) -> list:
    """[(what, baseline value, new value)] for everything that differs."""
    hb, hn = base.header, new.header
    out = []

    def cmp(what, a, b):
        if a != b:
            out.append((what, "" if a is None else str(a), "" if b is None else str(b)))

    cmp("commbench version", hb.get("commbench_version"), hn.get("commbench_version"))
    vb, vn = hb.get("versions") or {}, hn.get("versions") or {}
    for k in sorted(set(vb) | set(vn)):
        cmp(f"version: {k}", vb.get(k), vn.get(k))
    cb, cn = hb.get("cluster") or {}, hn.get("cluster") or {}
    cmp("hosts", ", ".join(cb.get("hosts") or []), ", ".join(cn.get("hosts") or []))
    cmp("ranks", cb.get("num_ranks"), cn.get("num_ranks"))
    cmp("cpu", cb.get("cpu_model"), cn.get("cpu_model"))
    cmp("gpus", _gpu_names(hb), _gpu_names(hn))
    eb, en = hb.get("env") or {}, hn.get("env") or {}
    for k in sorted(set(eb) | set(en)):
        cmp(f"env: {k}", eb.get(k), en.get(k))
    cmp("launcher", hb.get("launcher"), hn.get("launcher"))
    cmp("backend/device", _backends(base), _backends(new))
    cmp("command line", _cmdline(hb), _cmdline(hn))
    return out


def check(base_path: str, new_path: str, factor: float = 1.05, alpha: float = verdicts.ALPHA) -> dict:
    base, new = results.load(base_path), results.load(new_path)
    pair = verdicts.compare_pair(base, new, factor, alpha)
    if not pair.rows:
        raise ValueError(f"{base_path} and {new_path} have no Case in common (join key: kind, op, dtype, nbytes, "
                         "group_size, num_nodes, axis, in_place, concurrent_groups, redop, root): nothing to check")
    counts = {v: sum(r.verdict == v for r in pair.rows) for v in ("slower", "faster", "same", "untested")}
    # a side with one sample (an imported nccl-tests log) cannot be tested: the factor alone judges it
    counts["untested_slower"] = sum(r.verdict == "untested" and r.ratio > factor for r in pair.rows)
    wrong = [f"{m.case.op} {m.case.nbytes} B {m.case.dtype} on {m.case.axis}: {m.num_wrong} wrong element(s)"
             for m in new.measurements if m.num_wrong]
    return {"baseline": base_path, "new": new_path, "factor": factor, "alpha": alpha,
            "test": "mann-whitney-u two-sided", "correction": "holm",
            "regression": counts["slower"] > 0 or counts["untested_slower"] > 0 or bool(wrong),
            "wrong_results": wrong, "counts": counts, "common_cases": len(pair.rows),
            "only_in_baseline": len(pair.only_a), "only_in_new": len(pair.only_b),
            "cases": [r.to_dict() for r in pair.rows],
            "environment_differences": [{"what": w, "baseline": a, "new": b} for w, a, b in env_diff(base, new)],
            "notes": pair.notes}


def exit_code(doc: dict) -> int:
    return EXIT_REGRESSION if doc["regression"] else EXIT_OK


def _bw(x) -> str:
    return "" if x is None else f"{x:.3f}"


def _case_table(rows: list) -> list:
    lines = ["| op | dtype | size (B) | n | nodes | axis | in-place | base p50 (us) | new p50 (us) | ratio "
             "| base busbw | new busbw | p (Holm) |",
             "|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = "" if r["p_adjusted"] is None else f"{r['p_adjusted']:.2g}"
        lines.append(f"| {r['op']} | {r['dtype']} | {r['nbytes']} | {r['group_size']} | {r['num_nodes']} "
                     f"| {r['axis']} | {'yes' if r['in_place'] else 'no'} | {r['p50_a_s'] * 1e6:.2f} "
                     f"| {r['p50_b_s'] * 1e6:.2f} | {r['ratio']:.3f} | {_bw(r['busbw_a_gbps'])} "
                     f"| {_bw(r['busbw_b_gbps'])} | {p} |")
    return lines


def markdown(doc: dict) -> str:
    c = doc["counts"]
    head = "REGRESSION" if doc["regression"] else "OK"
    out = [f"## commbench check: {head}", "",
           f"baseline `{doc['baseline']}` vs new `{doc['new']}`: {doc['common_cases']} common case(s); "
           f"slower {c['slower']}, faster {c['faster']}, same {c['same']}, untested {c['untested']} "
           f"(of which beyond the factor {c['untested_slower']}); "
           f"only in baseline {doc['only_in_baseline']}, only in new {doc['only_in_new']}; "
           f"new measurements with wrong results {len(doc['wrong_results'])}.", "",
           f"Rule: slower = ratio p50(new)/p50(base) > {doc['factor']} and two-sided Mann-Whitney U on the raw "
           f"samples, Holm-corrected over the {doc['common_cases']} cases, p < {doc['alpha']}; a case with "
           f"fewer than {verdicts.MIN_SAMPLES} samples on a side (an imported log) fails on the ratio alone; "
           "any wrong result in the new file fails.", ""]
    if doc["wrong_results"]:
        out += ["### Wrong results in the new file", "", *[f"- {w}" for w in doc["wrong_results"]], ""]
    for verdict, title in (("slower", "Slower (regressions)"), ("faster", "Faster"), ("untested", "Untested")):
        rows = [r for r in doc["cases"] if r["verdict"] == verdict]
        if rows:
            out += [f"### {title}", "", *_case_table(rows), ""]
    diffs = doc["environment_differences"]
    out += ["### Environment differences", ""]
    if diffs:
        out += ["| what | baseline | new |", "|---|---|---|"]
        out += [f"| {d['what']} | {d['baseline'].replace('|', '/')} | {d['new'].replace('|', '/')} |" for d in diffs]
    else:
        out.append("none recorded")
    if doc["notes"]:
        out += ["", "### Notes", "", *[f"- {n}" for n in doc["notes"]]]
    return "\n".join(out) + "\n"


def to_json(doc: dict) -> str:
    return json.dumps(doc)
