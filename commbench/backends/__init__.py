"""Backend registry: --backend NAME -> class (imported only when chosen)."""
import importlib

BACKENDS = {
    "torch": ("commbench.backends.torch_dist", "TorchBackend"),
    "mpi": ("commbench.backends.mpi", "MPIBackend"),
    "cupy": ("commbench.backends.cupy_nccl", "CupyNcclBackend"),
}

# backends whose ranks must be started by mpiexec when commbench spawns them itself
NEEDS_MPIEXEC = ("mpi", "cupy")


def create(name: str, launch, device: str, timeout_s: float, **options):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose from {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(launch, device, timeout_s, **options)
