"""`commbench import nccl-tests LOG`: an nccl-tests text log (commbench.nccl_text)
or JSON output file (-J / --output_file, JSON format version 2 of src/util.cu)
into a commbench ResultFile, so existing logs become baselines.

Mapping of a row to a Measurement:
- op: the binary (`all_reduce_perf` -> all_reduce, `alltoall_perf` ->
  all_to_all, `sendrecv_perf` -> sendrecv: nccl-tests' ring shift, every rank
  sends to the next, not commbench's send_recv pairs), from the `Collective test
  starting` line, the JSON args, the log's file name, or --op;
- nbytes = the size column, which nccl-tests prints as max(send bytes, receive
  bytes): the whole buffer for all_reduce/broadcast/reduce, the gathered output
  for all_gather, the total input for reduce_scatter, all bytes a rank sends for
  alltoall: exactly commbench's S (DESIGN.md, busbw table, after nccl-tests'
  doc/PERFORMANCE.md);
- group_size = ranks in the `#  Rank` lines / number of groups (NCCL_TESTS_SPLIT
  makes several), num_nodes = hosts of group 0, concurrent_groups = groups;
- in_place from the column group (out-of-place first, in-place second);
- samples_s = the per-iteration times where the JSON has them (per-iteration
  timing: max over processes), else one sample, the reported time (nccl-tests'
  mean over its loop, averaged over ranks), with the warning
  "imported: nccl-tests reports one averaged time, no raw samples";
- algbw/busbw as reported (not recomputed); num_wrong = #wrong (old versions'
  `error` column is the largest deviation, not a count: num_wrong 0 and a
  warning when it is non-zero; their footer's out-of-bounds count is kept).
The header records the source (path, sha256), the version and settings lines,
each table's footer, the devices, and the JSON's args and allow-listed env."""
import datetime
import hashlib
import json
import os
import re

import commbench
from commbench import env as env_mod
from commbench import nccl_text, results, stats
from commbench.dtypes import ALIASES

OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
       "broadcast": "broadcast", "reduce": "reduce", "alltoall": "all_to_all", "sendrecv": "sendrecv",
       "gather": "gather", "scatter": "scatter", "hypercube": "hypercube"}
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ONE_SAMPLE = "imported: nccl-tests reports one averaged time, no raw samples"


def op_from_name(name: str | None) -> str | None:
    if not name:
        return None
    m = re.search(r"(all_reduce|all_gather|reduce_scatter|broadcast|alltoall|sendrecv|hypercube|gather|scatter|"
                  r"reduce)_perf", os.path.basename(name))
    return OPS[m.group(1)] if m else None


def _json_bool(v):
    return v in (True, "true") if v is not None else None


def _json_result(r: dict | None, per_iter: dict | None) -> dict | None:
    if r is None:
        return None
    t = r.get("time", r.get("cpu_time"))
    out = {"time_us": float(t), "algbw_gbps": float(r["alg_bw"]), "busbw_gbps": float(r["bus_bw"]),
           "wrong": None if r.get("nwrong") is None else int(float(r["nwrong"])), "max_error": None,
           "per_iter": None, "cputime": "cpu_time" in r}
    if per_iter:
        out["per_iter"] = {k: per_iter[k] for k in ("min_us", "max_us", "p99_us", "cv_pct") if k in per_iter}
        if per_iter.get("times_us"):
            out["times_us"] = [float(x) for x in per_iter["times_us"]]
    return out


def parse_json(text: str) -> dict:
    """nccl-tests' JSON output as the same dict nccl_text.parse returns."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {e.lineno}: not valid JSON ({e.msg}): truncated or not an nccl-tests JSON file") \
            from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list) or "config" not in doc:
        raise ValueError("a JSON file without nccl-tests' 'config' and 'results': not nccl-tests JSON output")
    cfg = doc["config"]
    devices = [{"rank": d["rank"], "group": d.get("group", 0), "pid": d.get("pid"), "host": d.get("hostname"),
                "device": d.get("device"), "pci": d.get("device_hex"), "name": d.get("device_info")}
               for d in cfg.get("devices", [])]
    rows = []
    for i, r in enumerate(doc["results"]):
        try:
            root = int(str(r.get("root", "")).strip() or -1)
            rows.append({"size": int(r["size"]), "count": int(r["count"]), "type": r["type"],
                         "redop": None if r.get("redop") in (None, "", "none") else r["redop"],
                         "root": None if root < 0 else root, "line": f"results[{i}]",
                         "results": {False: _json_result(r.get("out_of_place"), r.get("out_of_place_per_iter")),
                                     True: _json_result(r.get("in_place"), r.get("in_place_per_iter"))}})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"results[{i}]: not an nccl-tests result record ({type(e).__name__}: {e})") from None
    if not rows:
        raise ValueError("an nccl-tests JSON file without results")
    avg = doc.get("average_bus_bandwidth") or {}
    oob = doc.get("out_of_bounds") or {}
    args = doc.get("args") or []
    section = {"test": args[0] if args else None, "line": "results", "rows": rows,
               "avg_busbw_gbps": avg.get("bandwidth"), "out_of_bounds": oob.get("count"),
               "ok": _json_bool(oob.get("okay")), "columns": {"wrong": "#wrong"}}
    environ = dict(e.split("=", 1) for e in doc.get("env", []) if isinstance(e, str) and "=" in e)
    return {"format": f"nccl-tests json v{doc.get('version')}", "version_line": None, "nccl_tests_version": None,
            "nccl_version_code": doc.get("nccl_version"), "settings_line": None,
            "settings": {k: v for k, v in cfg.items() if k != "devices"}, "devices": devices,
            "sections": [section], "args": args, "env": env_mod.allowed_env(environ),
            "start_time": doc.get("start_time"), "end_time": doc.get("end_time"), "errors": doc.get("errors")}


def nccl_version(code) -> str | None:
    """NCCL_VERSION_CODE to x.y.z: major*10000 + minor*100 + patch since 2.9, major*1000 + ... before."""
    if not code:
        return None
    code = int(code)
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _layout(run: dict, env: dict) -> dict:
    devices = run["devices"]
    if not devices:
        raise ValueError("no '#  Rank N ... device N [...] GPU' lines: the number of ranks is unknown")
    groups = sorted({d["group"] for d in devices})
    n = len(devices)
    if n % len(groups):
        raise ValueError(f"{n} ranks do not split evenly into {len(groups)} groups")
    hosts = list(dict.fromkeys(d["host"] for d in devices))
    g0_hosts = {d["host"] for d in devices if d["group"] == groups[0]}
    split = env.get("NCCL_TESTS_SPLIT")
    axis = "world" if len(groups) == 1 else (re.sub(r"\s+", "", split).lower() if split else f"split{len(groups)}")
    return {"num_ranks": n, "group_size": n // len(groups), "groups": len(groups), "num_nodes": len(g0_hosts),
            "hosts": hosts, "axis": axis}


NOT_CHECKED = "results not checked (nccl-tests -c 0: #wrong N/A): num_wrong 0 is not a verdict"


def _measurement(op: str, row: dict, in_place: bool, res: dict, lay: dict, wrong_col: str) -> results.Measurement:
    params = {"count": row["count"], "world_size": lay["num_ranks"]}
    if row["redop"]:
        params["redop"] = row["redop"]
    if op in ROOTED and row["root"] is not None:
        params["root"] = row["root"]
    case = results.Case(kind="collective", op=op, backend="nccl-tests", device="cuda",
                        dtype=ALIASES.get(row["type"], row["type"]), nbytes=row["size"],
                        group_size=lay["group_size"], num_nodes=lay["num_nodes"], axis=lay["axis"],
                        in_place=in_place, concurrent_groups=lay["groups"], params=params)
    warnings = []
    samples = [t * 1e-6 for t in res.get("times_us") or []]
    if not samples:
        samples = [res["time_us"] * 1e-6]
        warnings.append(ONE_SAMPLE)
    if res.get("cputime"):
        warnings.append("time is host CPU time (nccl-tests -C)")
    if res.get("max_error"):
        warnings.append(f"nccl-tests '{wrong_col}' column: largest deviation {res['max_error']:g} "
                        "(a deviation, not a count of wrong elements)")
    elif res.get("wrong") is None:
        warnings.append(NOT_CHECKED)
    s = stats.summarize(samples)
    if res.get("per_iter"):
        s["nccl_tests_per_iter"] = res["per_iter"]
    return results.Measurement(case=case, samples_s=samples, stats=s, algbw_gbps=res["algbw_gbps"],
                               busbw_gbps=res["busbw_gbps"], num_wrong=res["wrong"] or 0, warnings=warnings)


def convert(path: str, op: str | None = None) -> results.ResultFile:
    """Read LOG (text or JSON, told apart by its first character) into a ResultFile."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text: not an nccl-tests log") from None
    try:
        run = parse_json(text) if text.lstrip().startswith("{") else nccl_text.parse(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if op is not None and op not in OPS.values():
        raise ValueError(f"--op {op!r}: choose from {', '.join(sorted(set(OPS.values())))}")
    lay = _layout(run, run.get("env", {}))
    measurements, footers = [], []
    for sec in run["sections"]:
        said = op_from_name(sec["test"]) or op_from_name((run.get("args") or [None])[0])
        if op is not None and said is not None and said != op:
            raise ValueError(f"{path}: line {sec['line']}: --op {op}, but the log says it tested {said}")
        name = op or said or op_from_name(path)
        if name is None:
            raise ValueError(f"{path}: line {sec['line']}: which collective? no 'Collective test starting' line, "
                             "and the file name names no nccl-tests binary: give --op (e.g. all_reduce)")
        redops = sorted({row["redop"] for row in sec["rows"] if row["redop"]})
        if bool(redops) != (name in REDUCING):
            has = f"a reduction op ({', '.join(redops)})" if redops else "no reduction op"
            raise ValueError(f"{path}: line {sec['line']}: its rows have {has}: not a {name} log"
                             + (" (--op)" if op else ""))
        footers.append({"op": name, "avg_busbw_gbps": sec["avg_busbw_gbps"], "out_of_bounds": sec["out_of_bounds"],
                        "ok": sec["ok"], "table_line": sec["line"]})
        for in_place in (False, True):      # out-of-place table first, as `run --in-place both` writes
            for row in sec["rows"]:
                res = row["results"][in_place]
                if res is not None:
                    measurements.append(_measurement(name, row, in_place, res, lay, sec["columns"]["wrong"]))
    header = results.make_header(
        commbench_version=commbench.__version__, run_id="nccl-tests-" + hashlib.sha256(raw).hexdigest()[:12],
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command_line=run.get("args") or None, launcher="nccl-tests",
        cluster={"num_ranks": lay["num_ranks"], "num_hosts": len(lay["hosts"]), "hosts": lay["hosts"],
                 "ranks_per_host": {h: sum(d["host"] == h for d in run["devices"]) for h in lay["hosts"]},
                 "gpus": [{"host": d["host"], "index": d["device"], "name": d["name"], "pci": d["pci"]}
                          for d in run["devices"]],
                 "rank_devices": {d["rank"]: d["device"] for d in run["devices"]}},
        versions={"nccl-tests": run["nccl_tests_version"], "nccl": nccl_version(run["nccl_version_code"])},
        env=run.get("env", {}),
        settings={"imported_from": {"path": os.path.abspath(path), "sha256": hashlib.sha256(raw).hexdigest(),
                                    "format": run["format"]},
                  "nccl_tests": {"version_line": run["version_line"], "settings_line": run["settings_line"],
                                 "settings": run["settings"], "footers": footers,
                                 "start_time": run.get("start_time"), "end_time": run.get("end_time")}})
    return results.ResultFile(header=header, measurements=measurements, path=path)


def write(rf: results.ResultFile, out: str, force: bool = False) -> str:
    try:
        w = results.ResultWriter(out, rf.header, overwrite=force)
    except FileExistsError:
        raise ValueError(f"{out} exists: give --force to replace it") from None
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        for m in rf.measurements:
            w.append(m)
    finally:
        w.close()
    return out


def default_out(log_path: str) -> str:
    stem = os.path.splitext(os.path.basename(log_path))[0]
    return os.path.join("results", f"nccl-tests-{stem}.jsonl")
