"""`commbench run --resume FILE`: continue a sweep where it stopped. The file's
header settings must match the command's (the timeout aside); Cases already
measured (status ok or skipped) are not run again; the rest is appended."""
import json
import os

from commbench import results

IGNORED = ("timeout_s",)     # settings that may change between the parts of one sweep
DEFAULTS = {"ci_of": "median"}   # settings older files do not record, at the value they ran with


def settings_difference(saved: dict, now: dict) -> str | None:
    for k in sorted(set(saved) | set(now)):
        if k in IGNORED:
            continue
        a, b = saved.get(k, DEFAULTS.get(k, "<absent>")), now.get(k, DEFAULTS.get(k, "<absent>"))
        if json.loads(json.dumps(a)) != json.loads(json.dumps(b)):
            return f"{k}: {json.dumps(a)[:80]} in the file, {json.dumps(b)[:80]} now"
    return None


def load_for_resume(path: str, settings: dict) -> results.ResultFile:
    """The file to continue, or a ValueError naming why it cannot be."""
    if not os.path.exists(path):
        raise ValueError(f"--resume {path}: no such file")
    rf = results.load(path)
    diff = settings_difference(rf.header.get("settings") or {}, settings)
    if diff:
        raise ValueError(f"--resume {path}: the file was made with other settings ({diff}); "
                         "repeat the original command's flags")
    return rf


def done_keys(rf: results.ResultFile) -> set:
    return {m.case.key() for m in rf.measurements if m.status in ("ok", "skipped")}


def cut_partial_line(path: str):
    """A crash mid-write leaves a last line without its newline, which load()
    skips; cut it off so the appended lines start on a line of their own."""
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return
        # find the last newline
        block, pos = 1 << 16, size
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                f.truncate(start + i + 1)
                return
            pos = start
        f.truncate(0)
