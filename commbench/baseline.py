"""`commbench baseline promote RESULT NAME`: file a results file under
baselines/NAME.jsonl with its provenance. The measurements are copied as
loaded (a truncated last line is dropped); the header is kept whole and gains
a `provenance` entry (who, when, on which host, from which file and its
sha256; an earlier provenance is kept under `previous`). An existing baseline is never replaced without force."""
import datetime
import getpass
import hashlib
import json
import os
import re
import socket

from commbench import results

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _who() -> str:
    try:
        return getpass.getuser()
    except Exception:      # no login name (a container without a passwd entry)
        return os.environ.get("USER", "unknown")


def promote(result_path: str, name: str, force: bool = False, directory: str = "baselines") -> str:
    """Write directory/NAME.jsonl; returns its path. ValueError on a bad name, an
    invalid results file, or an existing baseline without force."""
    if name.endswith(".jsonl"):
        name = name[: -len(".jsonl")]
    if not NAME_RE.match(name):
        raise ValueError(f"baseline name {name!r}: use letters, digits, '.', '_' and '-' (no '/'), "
                         "starting with a letter or digit")
    rf = results.load(result_path)       # refuses what is not a valid results file
    if not rf.measurements:
        raise ValueError(f"{result_path} has no measurements: nothing to promote")
    with open(result_path, "rb") as f:
        raw = f.read()
    header = dict(rf.header)
    prov = {"promoted_by": _who(), "promoted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "promoted_on": socket.gethostname(), "source": os.path.abspath(result_path),
        "source_sha256": hashlib.sha256(raw).hexdigest(), "measurements": len(rf.measurements)}
    if "provenance" in header:
        prov["previous"] = header["provenance"]
    header["provenance"] = prov
    if not directory:
        raise ValueError("--dir: give a folder, not an empty string")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"--dir {directory} exists and is not a folder")
    out = os.path.join(directory, name + ".jsonl")
    if os.path.isdir(out):
        raise ValueError(f"{out} is a folder: choose another baseline name")
    if os.path.exists(out) and not force:
        raise ValueError(f"{out} exists: give --force to replace it")
    lines = [json.dumps(header)] + [json.dumps(m.to_dict(), allow_nan=False) for m in rf.measurements]
    tmp = out + ".tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ValueError(f"cannot write {out}: {e.strerror or e}") from None
    return out
