"""Case / Measurement / ResultFile: the JSON Lines results format.

Line 1 is a header (schema version, run id, command line, cluster, versions,
allow-listed env vars); each further line is one Measurement, appended and
flushed as it completes, so a crash loses nothing that finished."""
import dataclasses
import errno
import json
import math
import os
import sys
from dataclasses import dataclass, field

SCHEMA_VERSION = 1
SUPPORTED_SCHEMAS = (1,)


@dataclass(frozen=True)
class Case:
    """Identity of a measurement: the key that baselines and comparisons join on."""
    kind: str                 # collective | compute
    op: str                   # all_reduce, all_gather, ...
    backend: str              # torch-gloo, torch-nccl, mpi, cupy-nccl, ...
    device: str               # cpu | cuda
    dtype: str
    nbytes: int               # S of DESIGN.md's busbw table
    group_size: int
    num_nodes: int            # nodes spanned by one group
    axis: str                 # world | intra | inter | mod4 | div2 | tp | dp | pp ...
    in_place: bool
    concurrent_groups: int = 1
    params: dict = field(default_factory=dict)   # redop, root, count, ...

    def key(self) -> tuple:
        return (self.kind, self.op, self.backend, self.device, self.dtype, self.nbytes,
                self.group_size, self.num_nodes, self.axis, self.in_place,
                self.concurrent_groups, json.dumps(self.params, sort_keys=True))


@dataclass
class Measurement:
    case: Case
    status: str = "ok"                     # ok | skipped
    skip_reason: str | None = None
    samples_s: list = field(default_factory=list)   # per iteration, max over ranks
    warmup: int = 0
    target_ci: float = 0.0
    stats: dict = field(default_factory=dict)       # derived: stats.summarize
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    num_wrong: int = 0
    wrong_ranks: list = field(default_factory=list)
    rank_time_p50_s: list = field(default_factory=list)   # per rank, its own p50
    rank_samples_s: list | None = None     # per rank raw samples, when kept
    slowest_rank: int | None = None
    slowest_host: str | None = None
    warnings: list = field(default_factory=list)

    @property
    def iters(self) -> int:
        return len(self.samples_s)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["type"] = "measurement"
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        """A Measurement from its JSON form; TypeError (naming the field) where a
        field has the wrong type."""
        if not isinstance(d, dict) or not isinstance(d.get("case"), dict):
            raise TypeError("not an object with a case")
        d = dict(d)
        d.pop("type", None)
        case = Case(**d.pop("case"))
        _check_types(case, CASE_TYPES, "case.")
        names = {f.name for f in dataclasses.fields(cls)}
        m = cls(case=case, **{k: v for k, v in d.items() if k in names})
        _check_types(m, MEASUREMENT_TYPES, "")
        if not all(_is_number(x) and math.isfinite(x) for x in m.samples_s):
            raise TypeError("samples_s holds something other than finite numbers")
        if m.status == "ok" and m.samples_s and "time_p50_s" not in m.stats:
            from commbench.stats import summarize       # statistics are derived from the samples
            m.stats = summarize(m.samples_s)
        return m


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# field -> what it must be (None allowed where the tuple says so)
CASE_TYPES = {"kind": (str,), "op": (str,), "backend": (str,), "device": (str,), "dtype": (str,),
              "nbytes": (int,), "group_size": (int,), "num_nodes": (int,), "axis": (str,), "in_place": (bool,),
              "concurrent_groups": (int,), "params": (dict,)}
MEASUREMENT_TYPES = {"status": (str,), "skip_reason": (str, None), "samples_s": (list,), "warmup": (int,),
                     "target_ci": (float,), "stats": (dict,), "algbw_gbps": (float, None), "busbw_gbps": (float, None),
                     "num_wrong": (int,), "wrong_ranks": (list,), "rank_time_p50_s": (list,),
                     "rank_samples_s": (list, None), "slowest_rank": (int, None), "slowest_host": (str, None),
                     "warnings": (list,)}


def _check_types(obj, types: dict, prefix: str):
    for name, allowed in types.items():
        v = getattr(obj, name)
        if v is None and None in allowed:
            continue
        ok = any(_is_number(v) if t is float else
                 (isinstance(v, int) and not isinstance(v, bool)) if t is int else
                 isinstance(v, t) for t in allowed if t is not None)
        if not ok:
            raise TypeError(f"{prefix}{name} is {v!r}")


@dataclass
class ResultFile:
    header: dict
    measurements: list
    path: str | None = None

    def to_dataframe(self):
        import pandas as pd
        rows = []
        for m in self.measurements:
            c = m.case
            row = {
                "kind": c.kind, "op": c.op, "backend": c.backend, "device": c.device,
                "dtype": c.dtype, "nbytes": c.nbytes, "group_size": c.group_size,
                "num_nodes": c.num_nodes, "axis": c.axis, "in_place": c.in_place,
                "concurrent_groups": c.concurrent_groups,
                "redop": c.params.get("redop"), "status": m.status, "iters": m.iters,
                "warmup": m.warmup,
            }
            for k in ("time_min_s", "time_p50_s", "time_mean_s", "time_p95_s", "time_p99_s",
                      "time_max_s", "time_stdev_s", "cv", "precision"):
                row[k] = m.stats.get(k)
            row.update(algbw_gbps=m.algbw_gbps, busbw_gbps=m.busbw_gbps, num_wrong=m.num_wrong,
                       slowest_rank=m.slowest_rank, slowest_host=m.slowest_host,
                       warnings="; ".join(m.warnings))
            rows.append(row)
        return pd.DataFrame(rows)

    def to_json(self) -> dict:
        return {"header": self.header, "measurements": [m.to_dict() for m in self.measurements]}


def make_header(**fields) -> dict:
    return dict(fields, type="header", schema_version=SCHEMA_VERSION)


class ResultWriter:
    """Appends one JSON line per measurement and flushes it to disk at once.
    Opens with O_EXCL unless overwrite is asked for: a user's results are never
    replaced by accident."""

    def __init__(self, path: str, header: dict, overwrite: bool = False, append: bool = False):
        """header: a make_header() dict. append: continue an existing file
        (`run --resume`): its lines stay as they are (a partial last line left
        by a crash is cut off) and no header is written."""
        self.path = path
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "it is a folder", path)
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise NotADirectoryError(errno.ENOTDIR, "a folder on its path is a file", path) from None
        if append:
            from commbench.resume import cut_partial_line
            cut_partial_line(path)
            self._f = open(path, "a", encoding="utf-8")
            return
        self._f = open(path, "w" if overwrite else "x", encoding="utf-8")
        self._write(header)

    def _write(self, obj: dict):
        self._f.write(json.dumps(obj, allow_nan=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def append(self, m: Measurement):
        self._write(m.to_dict())

    def close(self):
        self._f.close()


def open_on_rank0(rank: int, bcast, path: str, header: dict, overwrite: bool = False):
    """The job's ResultWriter: opened by rank 0 (None on the others); when rank 0
    cannot open it, every rank raises the same refusal (printed once, by rank 0).
    bcast: the job's control broadcast from rank 0."""
    from commbench.rankcheck import RankMismatch
    writer, err = None, None
    if rank == 0:
        try:
            writer = ResultWriter(path, header, overwrite)
        except FileExistsError:
            err = f"{path} exists: commbench never overwrites results (use --force or another --out)"
        except OSError as e:
            err = f"cannot write {path}: {e.strerror}"
    err = bcast(err)
    if err:
        raise RankMismatch(err, quiet=rank != 0)
    return writer


def load(path: str) -> ResultFile:
    """Read a results file. A truncated last line (a crash mid-write) is skipped
    with a warning; anything else malformed is a ValueError naming the line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise ValueError(f"cannot read results file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a commbench results file (not UTF-8 text)") from None
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise ValueError(f"{path} is empty: not a commbench results file")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        raise ValueError(f"{path}: line 1 is not JSON: not a commbench results file") from None
    if not isinstance(header, dict) or header.get("type") != "header":
        raise ValueError(f"{path}: line 1 is not a commbench header")
    for name in ("cluster", "versions", "env", "settings"):
        if not isinstance(header.get(name, {}), dict):
            raise ValueError(f"{path}: line 1: the header's {name} is {header[name]!r}, not an object")
    version = header.get("schema_version")
    if version not in SUPPORTED_SCHEMAS:
        raise ValueError(f"{path}: schema version {version!r} is not supported "
                         f"(this commbench reads {', '.join(map(str, SUPPORTED_SCHEMAS))})")
    measurements = []
    for i, line in enumerate(lines[1:], start=2):
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                print(f"commbench: warning: {path}: skipped a truncated last line {i}", file=sys.stderr)
                break
            raise ValueError(f"{path}: line {i} is not valid JSON") from None
        try:
            measurements.append(Measurement.from_dict(d))
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{path}: line {i} is not a commbench measurement ({e})") from None
    return ResultFile(header=header, measurements=measurements, path=path)
