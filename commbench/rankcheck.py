"""Ranks started with different arguments or commbench versions would run
different cases and deadlock or mix results. Right after the backend is
created every rank sends a digest of its configuration and version; if any
differs from rank 0's, every rank refuses with the first difference named."""
import hashlib
import json

import commbench


class RankMismatch(ValueError):
    """A bad start (exit 2); quiet on every rank but 0, so the job prints one line."""

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet


def fingerprint(config: dict) -> dict:
    doc = {"commbench_version": commbench.__version__, **config}
    text = json.dumps(doc, sort_keys=True, default=str)
    return {"digest": hashlib.sha256(text.encode()).hexdigest()[:16], "doc": doc}


def first_difference(a: dict, b: dict, prefix: str = "") -> str | None:
    """'name: A vs B' for the first key (sorted, nested) where a and b differ."""
    for k in sorted(set(a) | set(b), key=str):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(va, dict) and isinstance(vb, dict):
            d = first_difference(va, vb, f"{prefix}{k}.")
            if d:
                return d
        elif va != vb:
            return f"{prefix}{k}: {json.dumps(va, default=str)[:80]} vs {json.dumps(vb, default=str)[:80]}"
    return None


def check_same(backend, config: dict):
    """Compare config (plus the version) across ranks; RankMismatch if any differs."""
    mine = fingerprint(config)
    every = backend.control_allgather(mine)
    ref = every[0]
    bad = [r for r, f in enumerate(every) if f["digest"] != ref["digest"]]
    if bad:
        diff = first_difference(every[bad[0]]["doc"], ref["doc"]) or "digests differ"
        raise RankMismatch(f"rank(s) {', '.join(map(str, bad))} were started differently from rank 0 "
                           f"(rank {bad[0]} vs rank 0: {diff}): start every rank with the same command and "
                           "commbench version", quiet=backend.rank != 0)
