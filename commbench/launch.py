"""Rank, world size, local rank and node from the launcher's environment
(mpiexec of MPICH/Open MPI/Cray PALS/MVAPICH, srun, torchrun, or commbench's own
local spawn), the torch rendezvous address, and the local spawn itself."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str            # none | local | torchrun | mpich | openmpi | pals | mvapich | pmix | slurm
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def is_mpi(self) -> bool:
        return self.launcher in ("mpich", "openmpi", "pals", "mvapich", "pmix")


def _ints(env, *names):
    """The variables as integers; None where one is not set. A variable that is
    set but not a non-negative integer is a ValueError naming it: a launch whose
    rank cannot be read must not pass for no launch at all."""
    vals = []
    for n in names:
        v = env.get(n)
        if v is None:
            return None
        if not re.fullmatch(r"\s*\d+\s*", v):
            raise ValueError(f"launcher variable {n}={v!r} is not a non-negative integer")
        vals.append(int(v))
    return vals


def _slurm_step(env) -> bool:
    """Whether this process is a task of an srun step (the batch script of an
    sbatch job has SLURM_PROCID 0 and the job's SLURM_NTASKS, but no step id)."""
    return any(v in env for v in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS"))


def _checked(info: "LaunchInfo") -> "LaunchInfo":
    """One ValueError where the launcher's numbers contradict each other."""
    who = f"{info.launcher} launch"
    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise ValueError(f"{who}: rank {info.rank} of a world of {info.world_size}: need 0 <= rank < world size")
    if not 0 <= info.local_rank < info.local_world_size <= info.world_size:
        raise ValueError(f"{who}: local rank {info.local_rank} of {info.local_world_size} on a node, in a world of "
                         f"{info.world_size}: need 0 <= local rank < local size <= world size")
    if info.master_port is not None and not 1 <= info.master_port <= 65535:
        raise ValueError(f"{who}: MASTER_PORT {info.master_port} is not a TCP port (1-65535)")
    return info


# Each launcher: (name, rank var, size var, local rank var, local size var, node var).
# Order matters: MPI launchers before Slurm (mpiexec inside an allocation inherits
# SLURM_* from the allocation, and hydra starts its proxies with srun).
_LAUNCHERS = [
    # (OMPI_COMM_WORLD_NODE_RANK is a per-node process rank, not a node index)
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", None),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
     "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", None),
    ("pals", "PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE", "PALS_NODEID"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
    ("pmix", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE", "PMIX_NODEID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, "SLURM_NODEID"),
]


def detect(env=None) -> LaunchInfo:
    """The launch this process is part of, read from its environment."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR")
    port = _ints(env, "MASTER_PORT")
    port = port[0] if port else None
    # torchrun / torch elastic, and commbench's own local spawn, set the torch names
    torch_vars = _ints(env, "RANK", "WORLD_SIZE")
    if torch_vars and ("TORCHELASTIC_RUN_ID" in env or env.get("COMMBENCH_LAUNCHER") == "local"
                       or "LOCAL_RANK" in env):
        rank, size = torch_vars
        local = _ints(env, "LOCAL_RANK")
        local_size = _ints(env, "LOCAL_WORLD_SIZE")
        node = _ints(env, "GROUP_RANK")
        launcher = env["COMMBENCH_LAUNCHER"] if env.get("COMMBENCH_LAUNCHER") in ("local", "emulate") else "torchrun"
        return _checked(LaunchInfo(launcher, rank, size, local[0] if local else 0,
                                   local_size[0] if local_size else size, node[0] if node else None, addr, port))
    for name, rv, sv, lrv, lsv, nv in _LAUNCHERS:
        if name == "slurm" and not _slurm_step(env):
            continue
        if name == "mpich" and lrv not in env and "SLURM_PROCID" in env and _slurm_step(env):
            continue        # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE only: Slurm's own variables say more
        got = _ints(env, rv, sv)
        if not got:
            continue
        rank, size = got
        local = _ints(env, lrv) if lrv else None
        local_size = _ints(env, lsv) if lsv else None
        if name == "slurm" and not local_size:
            local_size = _slurm_local_size(env)
        node = _ints(env, nv) if nv else None
        if name == "slurm":
            addr = addr or first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                      or env.get("SLURM_NODELIST") or "")
            if not port and _ints(env, "SLURM_JOB_ID"):
                port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
        return _checked(LaunchInfo(name, rank, size, local[0] if local else 0,
                                   local_size[0] if local_size else 1, node[0] if node else None, addr, port))
    return _checked(LaunchInfo("none", 0, 1, 0, 1, None, addr, port))


def _slurm_local_size(env):
    """SLURM_STEP_TASKS_PER_NODE looks like '4(x2),3': this node's count is the
    entry for SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = _ints(env, "SLURM_NODEID")
    if not spec:
        return None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    idx = node[0] if node else 0
    return [counts[idx]] if idx < len(counts) else None


def first_host(nodelist: str) -> str | None:
    """First host of a Slurm node list: 'nid[001-004,007],gpu5' -> 'nid001';
    'nid[01-04]-ib' -> 'nid01-ib' (prefix[range]suffix)."""
    nodelist = nodelist.strip()
    if not nodelist:
        return None
    m = re.match(r"([^,\[]*)(?:\[([^\]]+)\]([^,\[]*))?", nodelist)
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3) or ""
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def hostname() -> str:
    """This rank's node name; COMMBENCH_HOSTNAME overrides it (the emulated
    cluster runs several 'nodes' on one kernel)."""
    return os.environ.get("COMMBENCH_HOSTNAME") or socket.gethostname()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def own_address() -> str:
    """An address of this host that the other ranks can reach."""
    if os.environ.get("COMMBENCH_MASTER_ADDR"):
        return os.environ["COMMBENCH_MASTER_ADDR"]
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


def rendezvous(info: LaunchInfo) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT for torch.distributed. Under MPI, rank 0 picks its
    own address and a free port and broadcasts them over MPI, so the user never
    sets MASTER_ADDR."""
    if info.master_addr and info.master_port:
        return info.master_addr, info.master_port
    if info.world_size == 1:
        return "127.0.0.1", info.master_port or free_port()
    if info.is_mpi:
        try:
            from mpi4py import MPI
        except ImportError:
            raise ValueError("under mpiexec the torch backend needs mpi4py to find the rendezvous "
                             "address (pip install mpi4py), or set MASTER_ADDR and MASTER_PORT") from None
        comm = MPI.COMM_WORLD
        addr = info.master_addr or own_address()
        found = comm.bcast((addr, info.master_port or free_port()) if comm.rank == 0 else None, root=0)
        return found
    raise ValueError(f"launcher {info.launcher}: MASTER_ADDR and MASTER_PORT are not set; "
                     "set them to rank 0's address and a free port")


def find_mpiexec() -> str | None:
    """mpiexec beside this Python (the mpich wheel in a venv) first, then PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


MAX_LOCAL_RANKS = 512       # one machine's ranks, started without a launcher


def check_nprocs(nprocs: int):
    if not 1 <= nprocs <= MAX_LOCAL_RANKS:
        raise ValueError(f"--nprocs {nprocs}: spawn between 1 and {MAX_LOCAL_RANKS} local ranks "
                         "(a launcher starts larger jobs)")


def spawn_local(nprocs: int, argv: list[str], use_mpiexec: bool) -> int:
    """Run `python -m commbench ARGV` as nprocs local ranks and wait for them.
    With use_mpiexec the ranks are started by mpiexec (MPI backends); otherwise
    each gets the torch variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).
    If a rank fails, the others are stopped; the exit status is the worst one."""
    check_nprocs(nprocs)
    cmd = [sys.executable, "-m", "commbench", *argv]
    procs = []
    if use_mpiexec:
        mpiexec = find_mpiexec()
        if not mpiexec:
            raise ValueError("the MPI backends need mpiexec to start local ranks; "
                             "install the mpich wheel (pip install mpich) or launch with your MPI")
        procs.append(subprocess.Popen([mpiexec, "-n", str(nprocs), *cmd], start_new_session=True))
    else:
        port = free_port()
        for r in range(nprocs):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), COMMBENCH_LAUNCHER="local")
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return _wait_all(procs)


def _wait_all(procs, grace_s: float = 10.0) -> int:
    """Wait for every rank. After the first failure the others get grace_s to end
    on their own (they may be writing results), then SIGTERM, then SIGKILL."""
    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signum)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        worst, deadline = 0, None
        while any(p.poll() is None for p in procs):
            for p in procs:
                code = p.poll()
                if code is not None and code != 0 and not worst:
                    worst = code if code > 0 else 128 - code
                    # 124: a rank gave up on the others (watchdog.py): whoever is left is hung
                    deadline = time.monotonic() + (min(grace_s, 3.0) if worst == 124 else grace_s)
            if deadline is not None and time.monotonic() > deadline:
                _stop(procs)
            time.sleep(0.05)
        for p in procs:
            if not worst and p.returncode:
                worst = p.returncode if p.returncode > 0 else 128 - p.returncode
        if worst > 128 and any(p.returncode == 124 for p in procs):
            return 124        # a rank died of a signal and the others reported it: the job timed out
        return worst
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(procs, grace_s: float = 5.0):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# glibc's malloc: allocations from M_MMAP_THRESHOLD up get pages of their own
# (faulted in on first touch, returned on free), and the threshold starts at 128
# KiB and rises to each freed block's size, up to 32 MiB on 64 bits; the heap is
# trimmed above M_TRIM_THRESHOLD, twice that
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
STEADY_MMAP_THRESHOLD_B = 32 * 2 ** 20
ALLOCATOR_MMAP_THRESHOLD_B = None     # what setup_cpu_rank fixed in this process, if anything
FLUSH_DENORMAL = None                 # whether setup_cpu_rank made torch flush denormal numbers to zero


def steady_allocator() -> int | None:
    """Fix glibc malloc's mmap threshold at 32 MiB and its trim threshold at 64
    MiB, where a long-running process's dynamic thresholds end, unless the user
    set them (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_). Left dynamic, a
    rank's first calls of a module that allocates blocks larger than any freed
    so far fault their pages in afresh: tiny-gpt's ZeRO-2 micro-batch timed in
    place at the start of a job took 21-23 ms over its first half and 18-21 ms
    over its second, while training a minute later ran 18-19 ms per
    micro-batch. Returns the mmap threshold set, None where nothing was set."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return None
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):      # not glibc
        return None
    if mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD_B) and mallopt(M_TRIM_THRESHOLD, 2 * STEADY_MMAP_THRESHOLD_B):
        return STEADY_MMAP_THRESHOLD_B
    return None


def setup_cpu_rank(info: LaunchInfo, device: str):
    """On a CPU, give each of a host's ranks an equal share of its cores for
    torch's kernels (as torchrun's OMP_NUM_THREADS=1 default intends), unless the
    user chose with OMP_NUM_THREADS: ranks that oversubscribe the cores time
    each other's contention, not the kernels; and fix malloc's thresholds
    (steady_allocator; the value set is in ALLOCATOR_MMAP_THRESHOLD_B); and flush
    denormal numbers to zero (torch.set_flush_denormal; whether it took is in
    FLUSH_DENORMAL), as a GPU's kernels run at full speed on them and a CPU's
    do not (small-gpt's tied head's two GEMMs took 13.9 ms each on them, in a
    torch profile, against 0.2 ms timed as kernels), and a freshly initialised
    model's tied head makes them (small-gpt's softmax probabilities went down to
    3e-40), so that a module's time depended on how far its weights had been
    trained: small-gpt's whole-model stage backward took 40 ms on its initial
    weights, 23 ms after one Adam step, 13 ms with the head untied. Compute
    timing and validation call this alike, so their kernels run with the same
    threads, allocator and numerics."""
    global ALLOCATOR_MMAP_THRESHOLD_B, FLUSH_DENORMAL
    if device != "cpu":
        return
    import torch
    ALLOCATOR_MMAP_THRESHOLD_B = steady_allocator() or ALLOCATOR_MMAP_THRESHOLD_B
    FLUSH_DENORMAL = torch.set_flush_denormal(True)
    if os.environ.get("OMP_NUM_THREADS"):
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, info.local_world_size)))
