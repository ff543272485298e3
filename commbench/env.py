"""What a run records about where it ran: hosts, ranks per host, devices,
versions, topology (NVML where present) and allow-listed environment variables
(never the whole environment)."""
import importlib.metadata
import os
import platform
import sys

import commbench

ENV_PREFIXES = ("NCCL_", "FI_", "UCX_", "OMP_", "CUDA_", "MPICH_", "OMPI_MCA_", "I_MPI_", "MV2_",
                "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "HCOLL_", "NVSHMEM_", "CXI_",
                "PALS_", "PBS_JOBID", "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NTASKS", "MKL_",
                "OPENBLAS_", "COMMBENCH_", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")


def allowed_env(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(ENV_PREFIXES) and not any(w in k.upper() for w in SECRET_WORDS)}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cupy_version() -> str | None:
    """cupy's version, whichever wheel brought it (cupy-cuda11x, -cuda12x,
    -cuda13x, cupy-rocm-*, or a source build named cupy)."""
    try:
        dists = list(importlib.metadata.packages_distributions().get("cupy", []))
    except Exception:          # a broken distribution's metadata must not stop a run
        dists = []
    for dist in dists + ["cupy"]:
        v = _version(dist)
        if v:
            return v
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    out = {"python": platform.python_version(), "commbench": commbench.__version__,
           "numpy": _version("numpy"), "mpi4py": _version("mpi4py"), "mpich_wheel": _version("mpich"),
           "cupy": cupy_version(), "platform": platform.platform()}
    try:
        import torch
        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except ImportError:
        out["torch"] = None
    mpi = sys.modules.get("mpi4py.MPI")   # only when MPI is already up: importing it starts MPI
    if mpi is not None:
        out["mpi_library"] = mpi.Get_library_version().strip().splitlines()[0]
        out["mpi_standard"] = "%d.%d" % mpi.Get_version()
    out.update(nvml_versions())
    return out


def _nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml
    except Exception:   # no library, no driver or no GPU: NVML is optional
        return None


def nvml_versions() -> dict:
    nv = _nvml()
    if nv is None:
        return {}
    return {"driver": nv.nvmlSystemGetDriverVersion(), "nvml_cuda": nv.nvmlSystemGetCudaDriverVersion()}


def gpus() -> list:
    """This node's GPUs with NVLink counts and the PCIe/NVLink path to every other GPU."""
    nv = _nvml()
    if nv is None:
        return []
    count = nv.nvmlDeviceGetCount()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    levels = {getattr(nv, n): n.replace("NVML_TOPOLOGY_", "") for n in dir(nv) if n.startswith("NVML_TOPOLOGY_")}
    out = []
    for i, h in enumerate(handles):
        links = 0
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                links += nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
            except Exception:
                break
        paths = {}
        for j, other in enumerate(handles):
            if j != i:
                try:
                    paths[j] = levels.get(nv.nvmlDeviceGetTopologyCommonAncestor(h, other), "?")
                except Exception:
                    paths[j] = "?"
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        name = nv.nvmlDeviceGetName(h)
        out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_bytes": int(mem.total), "nvlinks": int(links), "path_to": paths})
    return out


def rank_info(launch, device: str) -> dict:
    """What each rank reports about itself (gathered to rank 0)."""
    from commbench.launch import hostname
    info = {"rank": launch.rank, "host": hostname(), "local_rank": launch.local_rank, "pid": os.getpid(),
            "machine": machine_id(), "threads": compute_threads()}
    if device == "cuda":
        try:
            import torch
            idx = launch.local_rank % torch.cuda.device_count()
            info["gpu"] = {"index": idx, "name": torch.cuda.get_device_name(idx)}
        except Exception as e:   # pragma: no cover - GPU only
            info["gpu"] = {"error": str(e)}
    return info


def machine_id() -> str:
    """The running kernel's boot id: one per machine, the same in every network
    namespace of it (commbench emulate's nodes share one machine's cores); the
    host name where the kernel does not expose it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        from commbench.launch import hostname
        return hostname()


def compute_threads() -> int:
    """The threads this rank's torch kernels run on (launch.setup_cpu_rank sets
    them on a CPU); without torch loaded (an MPI or cupy run), OMP_NUM_THREADS
    or 1."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def cluster(ranks: list) -> dict:
    """ranks_per_machine: ranks per physical machine (machine_id), whose cores
    they share: emulated nodes are host names on one machine."""
    hosts = []
    for r in ranks:
        if r["host"] not in hosts:
            hosts.append(r["host"])
    per_host = {h: sum(1 for r in ranks if r["host"] == h) for h in hosts}
    machines = [r.get("machine", r["host"]) for r in ranks]
    return {"num_ranks": len(ranks), "num_hosts": len(hosts), "hosts": hosts,
            "ranks_per_host": per_host, "ranks_per_machine": {k: machines.count(k) for k in dict.fromkeys(machines)},
            "threads_per_rank": max((r.get("threads", 1) for r in ranks), default=1),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "gpus": gpus(), "rank_devices": {r["rank"]: r.get("gpu") for r in ranks if r.get("gpu")}}


def cores_shared(cluster_info: dict) -> bool:
    """Whether the ranks of a run on CPUs had more threads on a machine than it
    has cores (older results without ranks_per_machine: per host)."""
    per = cluster_info.get("ranks_per_machine") or cluster_info.get("ranks_per_host") or {}
    cores = cluster_info.get("cpu_count") or 0
    threads = cluster_info.get("threads_per_rank") or 1
    return bool(cores) and any(n * threads > cores for n in per.values())


def header(launch, ranks: list, argv: list, run_id: str, created_at: str, settings: dict) -> dict:
    from commbench.results import make_header
    return make_header(commbench_version=commbench.__version__, run_id=run_id, created_at=created_at,
                       command_line=argv, launcher=launch.launcher, cluster=cluster(ranks),
                       versions=versions(), env=allowed_env(), settings=settings)
