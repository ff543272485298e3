"""SystemSpec: a cluster described by its datasheet figures, for what-if
predictions without measurements (DESIGN.md "Data model"). JSON files in
commbench/systems/NAME.json; load("polaris") or load("path/to/file.json").

Units follow the project (1 GB = 1e9 B; *_gbps is GB/s, as busbw_gbps):
  gpu_memory_gb       memory of one GPU: the datasheet's marketed capacity (40, 80, 141)
                      taken as that many 1e9 B (the project's GB). The HBM is sized in
                      binary units, so the device has at least this much: a memory
                      filter using it errs on the safe side. gpu_memory_bytes = x 1e9
  peak_tflops         dense TFLOPS per dtype (bf16, fp16, tf32, fp32), no sparsity
  gemm_efficiency     [[FLOPs of one call, achieved fraction of peak], ...]
  hbm_gbps            HBM bandwidth, GB/s; hbm_efficiency the achievable fraction
  intra_bw_gbps       NVLink bandwidth per GPU, one direction, GB/s
  intra_latency_us    per ring step inside a node
  nics_per_node, nic_gbit_s   NICs of a node for GPU traffic and each one's line
                      rate in Gb/s (bits, as NICs are sold)
  inter_latency_us    per ring step across nodes
  *_efficiency        achievable fraction of the link rate (NCCL bus efficiency)
  sources             field -> where its value comes from (datasheet, or "assumption: ...")
How a node's NICs are shared, and the collective law: alphabeta.py.
"""
import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields

from commbench import alphabeta

SYSTEMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "systems")
PEAK_DTYPES = ("bf16", "fp16", "tf32", "fp32")
COMPUTE_KINDS = ("gemm", "attention", "elementwise", "optimizer", "other")
MATMUL_KINDS = ("gemm", "attention")
# ComputeOp dtype spellings -> the peak table's keys. fp32 GEMMs run at the fp32
# peak: torch leaves TF32 matmuls off unless asked (torch.backends.cuda.matmul.allow_tf32)
_DTYPE_KEYS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
               "fp32": "fp32", "float32": "fp32", "float": "fp32", "tf32": "tf32"}


def peak_key(dtype: str) -> str | None:
    """The peak table's key for a dtype spelling (None: not a GEMM dtype): the
    peak a GEMM in that dtype is timed at, and MFU is taken against."""
    return _DTYPE_KEYS.get(str(dtype).lower())


def _positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@dataclass(frozen=True)
class SystemSpec:
    name: str
    gpu: str
    gpus_per_node: int
    gpu_memory_gb: float
    peak_tflops: dict
    gemm_efficiency: tuple
    hbm_gbps: float
    hbm_efficiency: float
    intra_bw_gbps: float
    intra_latency_us: float
    intra_efficiency: float
    nics_per_node: int
    nic_gbit_s: float
    inter_latency_us: float
    inter_efficiency: float
    sources: dict = field(default_factory=dict)
    description: str = ""

    def __post_init__(self):
        def bad(f, rule, v):
            raise ValueError(f"system spec {self.name!r}: {f} {rule}, got {v!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"system spec: name must be a non-empty string, got {self.name!r}")
        for f in ("gpu", "description"):
            if not isinstance(getattr(self, f), str):
                bad(f, "must be a string", getattr(self, f))
        for f in ("gpus_per_node", "nics_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f, "must be a positive integer", v)
        for f in ("gpu_memory_gb", "hbm_gbps", "intra_bw_gbps", "nic_gbit_s"):
            if not _positive_number(getattr(self, f)):
                bad(f, "must be a positive number", getattr(self, f))
        for f in ("intra_latency_us", "inter_latency_us"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                bad(f, "must be a number >= 0", v)
        for f in ("hbm_efficiency", "intra_efficiency", "inter_efficiency"):
            v = getattr(self, f)
            if not _positive_number(v) or v > 1:
                bad(f, "must be a fraction in (0, 1]", v)
        if not isinstance(self.peak_tflops, dict):
            bad("peak_tflops", "must be a mapping dtype -> TFLOPS", self.peak_tflops)
        for d in PEAK_DTYPES:
            if d not in self.peak_tflops:
                raise ValueError(f"system spec {self.name!r}: peak_tflops.{d} is missing "
                                 f"(needs {', '.join(PEAK_DTYPES)})")
        for d, v in self.peak_tflops.items():
            if d not in PEAK_DTYPES:
                bad(f"peak_tflops.{d}", f"is not a dtype of the table ({', '.join(PEAK_DTYPES)})", v)
            if not _positive_number(v):
                bad(f"peak_tflops.{d}", "must be a positive number", v)
        pts = self.gemm_efficiency
        if not isinstance(pts, (list, tuple)) or not pts:
            bad("gemm_efficiency", "must be a non-empty list of [flops, fraction] points", pts)
        for i, p in enumerate(pts):
            if (not isinstance(p, (list, tuple)) or len(p) != 2 or not _positive_number(p[0])
                    or not _positive_number(p[1]) or p[1] > 1):
                bad(f"gemm_efficiency[{i}]", "must be [flops > 0, fraction in (0, 1]]", p)
            if i and p[0] <= pts[i - 1][0]:
                bad(f"gemm_efficiency[{i}]", "must have more FLOPs than the point before it", p)
        object.__setattr__(self, "gemm_efficiency", tuple((float(a), float(b)) for a, b in pts))
        if not isinstance(self.sources, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()):
            bad("sources", "must be a mapping field -> citation text", self.sources)

    # ------------------------------------------------------------ derived figures
    @property
    def gpu_memory_bytes(self) -> float:
        """Memory of one GPU in bytes (gpu_memory_gb x 1e9)."""
        return self.gpu_memory_gb * 1e9

    @property
    def inter_bw_gbps(self) -> float:
        """Inter-node bandwidth per GPU, one direction, GB/s: the node's NICs shared
        by its GPUs = NICs per node x NIC rate (Gb/s / 8 = GB/s) / GPUs per node."""
        return self.nics_per_node * self.nic_gbit_s / 8.0 / self.gpus_per_node

    def missing_sources(self) -> list:
        """Numeric fields without a citation in sources."""
        numeric = [f.name for f in fields(self) if f.name not in ("name", "gpu", "sources", "description")]
        return [f for f in numeric if not self.sources.get(f, "").strip()]

    def gemm_fraction(self, flops: float) -> float:
        """Achieved fraction of peak for a matmul of this many FLOPs: the points of
        gemm_efficiency joined by straight lines in log10(FLOPs), flat beyond the ends."""
        pts = self.gemm_efficiency
        if flops <= pts[0][0]:
            return pts[0][1]
        if flops >= pts[-1][0]:
            return pts[-1][1]
        x = math.log10(flops)
        for (f0, e0), (f1, e1) in zip(pts, pts[1:]):
            if flops <= f1:
                w = (x - math.log10(f0)) / (math.log10(f1) - math.log10(f0))
                return e0 + w * (e1 - e0)
        return pts[-1][1]

    # ------------------------------------------------------------ times
    def collective_time_s(self, collective: str, nbytes: int, group_size: int, num_nodes: int) -> float:
        """Ring alpha-beta time (alphabeta.py): steps x latency + S x busbw factor / bw.
        Intra-node: bw = NVLink per GPU x efficiency. Inter-node: bw = r x inter-node
        bandwidth per GPU x efficiency, r = ranks of the group per node (r NIC shares;
        see alphabeta.py), at most the NVLink rate the group's GPUs have."""
        coll = alphabeta.collective_name(collective)
        alphabeta.check_shape(group_size, num_nodes, nbytes)
        if group_size == 1:
            return 0.0
        r = alphabeta.ranks_per_node(group_size, num_nodes)
        if r > self.gpus_per_node:
            raise ValueError(f"{self.name}: a group of {group_size} on {num_nodes} node(s) puts {r} ranks "
                             f"on a node of {self.gpus_per_node} GPUs")
        intra = self.intra_bw_gbps * 1e9 * self.intra_efficiency
        if num_nodes == 1:
            bw, latency = intra, self.intra_latency_us * 1e-6
        else:
            bw = min(r * self.inter_bw_gbps * 1e9 * self.inter_efficiency, intra)
            latency = self.inter_latency_us * 1e-6
        return (alphabeta.steps(coll, group_size) * latency
                + nbytes * alphabeta.factor(coll, group_size) / bw)

    def compute_time_s(self, op) -> float:
        """Time of one call of a workload.ComputeOp: the larger of two rooflines.
        Compute: flops / (peak x efficiency); gemm and attention run on tensor cores
        at peak_tflops[dtype] x gemm_fraction(flops); elementwise, optimizer and
        other kernels on CUDA cores at the fp32 peak, efficiency 1 (a bound that
        rarely binds: they are memory-bound). Memory: nbytes (read + written) /
        (HBM x hbm_efficiency)."""
        if op.kind not in COMPUTE_KINDS:
            raise ValueError(f"compute op {op.name!r}: kind {op.kind!r}: choose from {', '.join(COMPUTE_KINDS)}")
        for f in ("flops", "nbytes"):
            v = getattr(op, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"compute op {op.name!r}: {f} must be a number >= 0, got {v!r}")
        if op.kind in MATMUL_KINDS:
            key = peak_key(op.dtype)
            if key is None:
                raise ValueError(f"compute op {op.name!r}: dtype {op.dtype!r} has no peak in {self.name} "
                                 f"(peaks for {', '.join(PEAK_DTYPES)})")
            rate = self.peak_tflops[key] * 1e12 * self.gemm_fraction(op.flops) if op.flops else 0.0
        else:
            rate = self.peak_tflops["fp32"] * 1e12
        t_compute = op.flops / rate if op.flops else 0.0
        t_memory = op.nbytes / (self.hbm_gbps * 1e9 * self.hbm_efficiency)
        return max(t_compute, t_memory)


def available() -> list:
    """Names of the shipped system specs."""
    if not os.path.isdir(SYSTEMS_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(SYSTEMS_DIR) if f.endswith(".json"))


def from_dict(d, origin: str = "<dict>") -> SystemSpec:
    """A SystemSpec from a JSON mapping; unknown and missing fields are ValueErrors naming them."""
    if not isinstance(d, dict):
        raise ValueError(f"{origin}: a system spec is a JSON object, got {type(d).__name__}")
    known = {f.name: f for f in fields(SystemSpec)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{origin}: unknown field(s) {', '.join(unknown)} (fields: {', '.join(known)})")
    required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in d]
    if missing:
        raise ValueError(f"{origin}: missing field(s) {', '.join(missing)}")
    try:
        return SystemSpec(**d)
    except ValueError as e:
        raise ValueError(f"{origin}: {e}") from None


def check_node(spec: SystemSpec, gpus_per_node: int, comm_measured: bool):
    """A plan priced on spec's network must have spec's nodes (its intra-node
    bandwidth holds inside one of them): ValueError otherwise. Measured
    collectives (comm_measured) bring their own node spans."""
    if not comm_measured and gpus_per_node != spec.gpus_per_node:
        raise ValueError(f"--gpus-per-node {gpus_per_node} contradicts SystemSpec {spec.name} "
                         f"({spec.gpus_per_node} GPUs per node): leave it out, or give a spec of such nodes")


def load(path_or_name: str) -> SystemSpec:
    """A shipped spec by name (commbench/systems/NAME.json) or a JSON file by path."""
    if os.path.sep in path_or_name or path_or_name.endswith(".json") or os.path.isfile(path_or_name):
        path = path_or_name
    else:
        path = os.path.join(SYSTEMS_DIR, path_or_name + ".json")
        if not os.path.isfile(path):
            raise ValueError(f"unknown system {path_or_name!r}: choose from {', '.join(available())} "
                             "or give the path of a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read system spec {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON system spec ({e})") from None
    return from_dict(d, origin=path)
