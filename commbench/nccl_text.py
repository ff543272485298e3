"""Reader of nccl-tests' text output (stdout of all_reduce_perf and friends)
into plain dicts; commbench.import_nccl turns them into a ResultFile.

Formats read (written from nccl-tests' src/common.cu and src/util.cu of several
versions):
- `# nccl-tests version 2.x.y nccl-headers=N nccl-library=M` (newer versions)
- `# Collective test starting: all_reduce_perf` / `... concluded: ...` (newer)
- the settings line `# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728
  step: 2(factor) warmup iters: 5 iters: 20 [agg iters: 1] validation: 1
  [graph: 0] [unalign: 0]` (older versions have fewer fields)
- device lines `#  Rank  0 [Group  0] Pid 1234 on host device  0 [0x07] NVIDIA ...`
- the column header: `size count type [redop] [root] time algbw busbw #wrong
  time algbw busbw #wrong` (older: `error` instead of `#wrong`, all_gather and
  broadcast without redop; `cputime` with -C; `i_min i_max i_p99 i_cv%` after
  each group with per-iteration timing; a trailing `timestamp` with -T)
- rows, where a blank redop or root just leaves the column out; `N/A` for
  #wrong when results are not checked
- footers `# Out of bounds values : 0 OK` and `# Avg bus bandwidth : 12.3 [OK]`.
Several tests concatenated in one log are several sections. Anything else
(NCCL INFO lines, launcher noise) is ignored; a row that does not parse is a
ValueError naming its line, and a section without its footer is a truncated log."""
import re

VERSION_RE = re.compile(r"^#\s*nccl-tests version\s+(\S+)(?:\s+nccl-headers=(\d+))?(?:\s+nccl-library=(\d+))?")
TEST_RE = re.compile(r"^#\s*Collective test (?:starting|concluded):\s*(\S+)")
SETTINGS_RE = re.compile(r"^#\s*nThread\s+\d+")
RANK_RE = re.compile(r"^#\s*Rank\s+(\d+)(?:\s+Group\s+(\d+))?\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)"
                     r"\s+\[([^\]]*)\]\s*(.*)$")
OOB_RE = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s*(OK|FAILED)?")
AVG_RE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)\s*(OK|FAILED)?")
ROW_START_RE = re.compile(r"^\s*\d+\s+\d+\s+[A-Za-z]")
DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
TIME_NAMES = ("time", "cputime")


def parse_settings(line: str) -> dict:
    """The `# nThread ...` line as {name: int} (step as step_factor or step_bytes)."""
    body = line.lstrip("#").strip()
    out = {}
    m = re.search(r"step:\s*(\d+)\((factor|bytes)\)", body)
    if m:
        out["step_" + m.group(2)] = int(m.group(1))
        body = body[:m.start()] + body[m.end():]
    for name, value in re.findall(r"([A-Za-z][A-Za-z ]*?):?\s+(-?\d+)(?=\s|$)", body):
        out[name.strip().replace(" ", "_")] = int(value)
    return out


def _columns(tokens: list, lineno: int) -> dict:
    """Layout of a column header: prefix columns before the first time, the
    width of one result group, and whether a timestamp ends the row."""
    times = [i for i, t in enumerate(tokens) if t in TIME_NAMES]
    if len(times) != 2:
        raise ValueError(f"line {lineno}: a column header with {len(times)} time columns "
                         "(expected out-of-place and in-place)")
    prefix, group = tokens[:times[0]], tokens[times[0]:times[1]]
    if prefix[:3] != ["size", "count", "type"] or group[1:3] != ["algbw", "busbw"] or len(group) not in (4, 8):
        raise ValueError(f"line {lineno}: unrecognized nccl-tests column header: {' '.join(tokens)}")
    return {"prefix": prefix, "group": group, "wrong": group[3], "timestamp": tokens[-1] == "timestamp",
            "cputime": group[0] == "cputime"}


def _num(tok: str, lineno: int, what: str) -> float:
    try:
        return float(tok)
    except ValueError:
        raise ValueError(f"line {lineno}: {what} {tok!r} is not a number") from None


def _result(vals: list, cols: dict, lineno: int) -> dict:
    res = {"time_us": _num(vals[0], lineno, "time"), "algbw_gbps": _num(vals[1], lineno, "algbw"),
           "busbw_gbps": _num(vals[2], lineno, "busbw"), "wrong": None, "max_error": None, "per_iter": None}
    if vals[3] != "N/A":
        v = _num(vals[3], lineno, cols["wrong"])
        if cols["wrong"] == "error":     # old versions: the largest deviation, not a count
            res["max_error"] = v
        else:
            res["wrong"] = int(v)
    if len(vals) == 8:                   # i_min i_max i_p99 (us) i_cv% of the per-iteration times
        res["per_iter"] = {"min_us": _num(vals[4], lineno, "i_min"), "max_us": _num(vals[5], lineno, "i_max"),
                           "p99_us": _num(vals[6], lineno, "i_p99"), "cv_pct": _num(vals[7], lineno, "i_cv%")}
    return res


def _row(line: str, cols: dict, lineno: int) -> dict:
    tokens = line.split()
    if cols["timestamp"] and len(tokens) >= 2 and DATE_RE.match(tokens[-2]):
        tokens = tokens[:-2]
    g = len(cols["group"])
    middle = tokens[3:len(tokens) - 2 * g]
    if len(tokens) < 3 + 2 * g or len(middle) > len(cols["prefix"]) - 3:
        raise ValueError(f"line {lineno}: a result row with {len(tokens)} fields does not fit the column header "
                         f"({' '.join(cols['prefix'])} and two groups of {g}): truncated or garbled")
    try:
        size, count = int(tokens[0]), int(tokens[1])
    except ValueError:
        raise ValueError(f"line {lineno}: size and count must be integers") from None
    redop, root = None, None
    for t in middle:
        if re.fullmatch(r"-?\d+", t):
            root = int(t)
        else:
            redop = t
    oop, ip = tokens[len(tokens) - 2 * g:len(tokens) - g], tokens[len(tokens) - g:]
    return {"size": size, "count": count, "type": tokens[2], "redop": None if redop == "none" else redop,
            "root": None if root is None or root < 0 else root, "line": lineno,
            "results": {False: _result(oop, cols, lineno), True: _result(ip, cols, lineno)}}


def parse(text: str) -> dict:
    run = {"format": "nccl-tests text", "version_line": None, "nccl_tests_version": None, "nccl_version_code": None,
           "settings_line": None, "settings": {}, "devices": [], "sections": []}
    test_name, cols, section = None, None, None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if m := VERSION_RE.match(line):
            run["version_line"] = line
            run["nccl_tests_version"] = m.group(1)
            run["nccl_version_code"] = int(m.group(3) or m.group(2)) if (m.group(3) or m.group(2)) else None
        elif m := TEST_RE.match(line):
            test_name = m.group(1)
        elif SETTINGS_RE.match(line):
            run["settings_line"] = line
            run["settings"] = parse_settings(line)
        elif m := RANK_RE.match(line):
            rank = int(m.group(1))
            if not any(d["rank"] == rank for d in run["devices"]):
                run["devices"].append({"rank": rank, "group": int(m.group(2) or 0), "pid": int(m.group(3)),
                                       "host": m.group(4), "device": int(m.group(5)), "pci": m.group(6),
                                       "name": m.group(7).strip()})
        elif line.startswith("#") and "size" in line.split() and any(t in line.split() for t in TIME_NAMES):
            if section is not None and section["avg_busbw_gbps"] is None:
                raise ValueError(f"line {lineno}: a new table starts before the footer of the one at line "
                                 f"{section['line']}: truncated log")
            cols = _columns(line.lstrip("#").split(), lineno)
            section = {"test": test_name, "line": lineno, "columns": cols, "rows": [], "avg_busbw_gbps": None,
                       "out_of_bounds": None, "ok": None}
            run["sections"].append(section)
        elif m := OOB_RE.match(line):
            if section is not None:
                section["out_of_bounds"] = int(m.group(1))
        elif m := AVG_RE.match(line):
            if section is None:
                raise ValueError(f"line {lineno}: an 'Avg bus bandwidth' footer without a result table before it")
            section["avg_busbw_gbps"] = _num(m.group(1), lineno, "average bus bandwidth")
            section["ok"] = m.group(2) != "FAILED" and not section["out_of_bounds"]
            cols = None
        elif cols is not None and ROW_START_RE.match(line):
            section["rows"].append(_row(line, cols, lineno))
        elif cols is not None and re.match(r"^\s*\d+(\s|$)", line):
            raise ValueError(f"line {lineno}: not an nccl-tests result row: {line.strip()[:60]!r}")
    if not run["sections"]:
        raise ValueError("no nccl-tests result table (a '#  size  count  type ... time  algbw  busbw' header) found")
    for s in run["sections"]:
        if not s["rows"]:
            raise ValueError(f"line {s['line']}: a result table without rows")
        if s["avg_busbw_gbps"] is None:
            last, start = s["rows"][-1]["line"], s["line"]
            raise ValueError(f"line {last}: the log ends without the '# Avg bus bandwidth' footer of the table "
                             f"at line {start}: truncated log")
    return run
