"""Who started this process: commbench.launch.detect() on the environment each
launcher really sets (crafted dicts), the precedence between launchers that
nest, Slurm node lists, and a real `mpiexec -n 2` rendezvous."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commbench import launch
from commbench.launch import LaunchInfo, detect, first_host
from conftest import clean_env

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


# One rank of an 8-rank job on 2 nodes, 4 ranks per node: global rank 5 is
# local rank 1 on the second node (node index 1).
CASES = {
    "mpich-hydra": (
        {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
         "PMI_FD": "9", "PMI_HOSTNAME": "nid002"},
        LaunchInfo("mpich", 5, 8, 1, 4, None, None, None)),
    "openmpi": (
        {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1",
         "OMPI_UNIVERSE_SIZE": "8",
         # Open MPI >= 4 runs over PMIx and sets these too: Open MPI must still win
         "PMIX_RANK": "5", "PMIX_NAMESPACE": "prterun-host-1234@1"},
        LaunchInfo("openmpi", 5, 8, 1, 4, None, None, None)),   # NODE_RANK is no node index
    "cray-pals": (
        # Cray PALS also sets the PMI_* names: it must not be read as hydra
        {"PALS_RANKID": "5", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "4",
         "PALS_NODEID": "1", "PMI_RANK": "5", "PALS_DEPTH": "1"},
        LaunchInfo("pals", 5, 8, 1, 4, 1, None, None)),
    "mvapich": (
        {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8", "MV2_COMM_WORLD_LOCAL_RANK": "1",
         "MV2_COMM_WORLD_LOCAL_SIZE": "4"},
        LaunchInfo("mvapich", 5, 8, 1, 4, None, None, None)),
    "pmix": (
        {"PMIX_RANK": "5", "PMIX_SIZE": "8", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "4",
         "PMIX_NODEID": "1", "PMIX_NAMESPACE": "ns"},
        LaunchInfo("pmix", 5, 8, 1, 4, 1, None, None)),
    "torchrun": (
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
         "ROLE_RANK": "5", "TORCHELASTIC_RUN_ID": "job42", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"},
        LaunchInfo("torchrun", 5, 8, 1, 4, 1, "node0", 29500)),
    "torchrun-single-node": (
        {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "TORCHELASTIC_RUN_ID": "none",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"},
        LaunchInfo("torchrun", 2, 4, 2, 4, None, "127.0.0.1", 29400)),
    "commbench-local": (
        # exactly what launch.spawn_local gives each rank
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000", "COMMBENCH_LAUNCHER": "local"},
        LaunchInfo("local", 1, 2, 1, 2, None, "127.0.0.1", 41000)),
    "none": (
        {"PATH": "/usr/bin", "HOME": "/root"},
        LaunchInfo("none", 0, 1, 0, 1, None, None, None)),
    "empty": ({}, LaunchInfo("none", 0, 1, 0, 1, None, None, None)),
    "stray-RANK-is-no-launcher": (
        # RANK/WORLD_SIZE alone (some other tool's variables) do not make a launch
        {"RANK": "3", "WORLD_SIZE": "4"},
        LaunchInfo("none", 0, 1, 0, 1, None, None, None)),
}

SLURM_8_ON_3 = {   # srun -n 11 over nid[001-002,007]: 4, 4 and 3 tasks per node
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "11", "SLURM_STEP_NUM_TASKS": "11",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_TASKS_PER_NODE": "4(x2),3",
    "SLURM_STEP_NODELIST": "nid[001-002,007]", "SLURM_JOB_NODELIST": "nid[001-002,007]",
    "SLURM_NNODES": "3",
}


@pytest.mark.parametrize("name", list(CASES))
def test_detect(name):
    env, want = CASES[name]
    assert detect(env) == want


@pytest.mark.parametrize("procid, localid, nodeid, local_size", [
    (0, 0, 0, 4),
    (5, 1, 1, 4),
    (9, 1, 2, 3),        # the last node has 3 tasks: '4(x2),3'
    (10, 2, 2, 3),
])
def test_detect_slurm(procid, localid, nodeid, local_size):
    env = dict(SLURM_8_ON_3, SLURM_PROCID=str(procid), SLURM_LOCALID=str(localid), SLURM_NODEID=str(nodeid))
    info = detect(env)
    assert info == LaunchInfo("slurm", procid, 11, localid, local_size, nodeid,
                              "nid001", 20000 + 123456 % 20000)
    assert not info.is_mpi


def test_slurm_port_is_deterministic_and_the_same_on_every_rank():
    infos = [detect(dict(SLURM_8_ON_3, SLURM_PROCID=str(r), SLURM_LOCALID=str(r % 4),
                         SLURM_NODEID=str(r // 4))) for r in range(11)]
    assert {(i.master_addr, i.master_port) for i in infos} == {("nid001", 23456)}
    assert [i.rank for i in infos] == list(range(11))
    # another job gets another port, always in the unprivileged range
    other = detect(dict(SLURM_8_ON_3, SLURM_JOB_ID="123457", SLURM_PROCID="0", SLURM_NODEID="0"))
    assert other.master_port == 23457
    for job in ("0", "19999", "20000", "987654321"):
        port = detect(dict(SLURM_8_ON_3, SLURM_JOB_ID=job, SLURM_PROCID="0", SLURM_NODEID="0")).master_port
        assert 20000 <= port < 40000


def test_slurm_explicit_master_and_fallbacks():
    base = dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_NODEID="0", SLURM_STEP_ID="0")
    # MASTER_ADDR/PORT set by the user win over the derived ones
    info = detect(dict(base, SLURM_JOB_ID="7", SLURM_STEP_NODELIST="gpu[3-4]", SLURM_STEP_TASKS_PER_NODE="2",
                       MASTER_ADDR="10.0.0.9", MASTER_PORT="29555"))
    assert (info.master_addr, info.master_port) == ("10.0.0.9", 29555)
    # no step list: the job's node list; no step tasks-per-node: the job's
    info = detect(dict(base, SLURM_JOB_ID="7", SLURM_JOB_NODELIST="gpu[3-4]", SLURM_TASKS_PER_NODE="2"))
    assert (info.master_addr, info.master_port, info.local_world_size) == ("gpu3", 20007, 2)
    # the step's values win over the job's (srun -n inside a bigger allocation)
    info = detect(dict(base, SLURM_STEP_NODELIST="gpu4", SLURM_JOB_NODELIST="gpu[3-4]",
                       SLURM_STEP_TASKS_PER_NODE="2", SLURM_TASKS_PER_NODE="8(x2)"))
    assert (info.master_addr, info.local_world_size) == ("gpu4", 2)
    assert info.master_port is None                     # no job id: no port to derive


def test_slurm_batch_script_is_no_launch_and_pmi2_is_slurm():
    # the batch script of an sbatch job: process 0 of the job, but no srun step
    batch = {k: v for k, v in SLURM_8_ON_3.items() if not k.startswith("SLURM_STEP")}
    assert detect(dict(batch, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")).launcher == "none"
    # srun --mpi=pmi2 adds PMI_RANK/PMI_SIZE but no local ranks: Slurm's variables say more
    info = detect(dict(SLURM_8_ON_3, SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NODEID="1", PMI_RANK="5",
                       PMI_SIZE="11", PMI_FD="12", PMI_JOBID="123456.0"))
    assert (info.launcher, info.rank, info.local_rank, info.local_world_size) == ("slurm", 5, 1, 4)


@pytest.mark.parametrize("env, word", [
    ({"PMI_RANK": "abc", "PMI_SIZE": "8"}, "PMI_RANK"),
    ({"PMI_RANK": "-1", "PMI_SIZE": "8"}, "PMI_RANK"),
    ({"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "8"}, "rank 9 of a world of 8"),
    ({"PMI_RANK": "0", "PMI_SIZE": "0"}, "world of 0"),
    ({"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "5", "MPI_LOCALNRANKS": "4"}, "local rank 5 of 4"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x", "TORCHELASTIC_RUN_ID": "1"}, "LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "70000"}, "MASTER_PORT"),
])
def test_malformed_or_contradictory_launch_variables_are_refused(env, word):
    with pytest.raises(ValueError, match=word):
        detect(env)


def test_precedence_mpiexec_inside_slurm_allocation():
    # hydra starts its proxies with srun (one task per node), so the ranks inherit
    # SLURM_* describing the proxy step; the MPI launcher's numbers are the truth
    env = dict(SLURM_8_ON_3, SLURM_PROCID="1", SLURM_NTASKS="3", SLURM_LOCALID="0", SLURM_NODEID="1",
               PMI_RANK="5", PMI_SIZE="11", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="4")
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("mpich", 5, 11, 1, 4)
    assert info.is_mpi
    assert info.master_addr is None      # MPI ranks rendezvous over MPI, not the Slurm node list

    env = dict(SLURM_8_ON_3, SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_NODEID="0",
               OMPI_COMM_WORLD_RANK="6", OMPI_COMM_WORLD_SIZE="11",
               OMPI_COMM_WORLD_LOCAL_RANK="2", OMPI_COMM_WORLD_LOCAL_SIZE="4")
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("openmpi", 6, 11, 2)

    env = dict(SLURM_8_ON_3, SLURM_PROCID="0", SLURM_NTASKS="11", SLURM_LOCALID="0", SLURM_NODEID="0",
               PALS_RANKID="3", PMI_RANK="3", PMI_SIZE="11", PALS_LOCAL_RANKID="3", PALS_LOCAL_SIZE="4")
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("pals", 3, 11, 3)


def test_precedence_torchrun_inside_slurm_allocation():
    # torchrun started by srun (one agent per node): the torch names are per rank
    env = dict(SLURM_8_ON_3, SLURM_PROCID="1", SLURM_NTASKS="3", SLURM_LOCALID="0", SLURM_NODEID="1",
               RANK="6", WORLD_SIZE="12", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
               TORCHELASTIC_RUN_ID="r", MASTER_ADDR="nid001", MASTER_PORT="29500")
    assert detect(env) == LaunchInfo("torchrun", 6, 12, 2, 4, 1, "nid001", 29500)


def test_detect_reads_os_environ_by_default(monkeypatch):
    for k in list(os.environ):
        if k not in clean_env():
            monkeypatch.delenv(k)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    info = detect()
    assert (info.launcher, info.rank, info.world_size) == ("openmpi", 3, 4)


def test_openmpi_node_rank_is_not_the_per_node_process_rank():
    env = {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "0"}
    # either the true node index or "unknown", never a wrong node
    assert detect(env).node_rank in (None, 1)


@pytest.mark.parametrize("nodelist, first", [
    ("nid[001-004,007]", "nid001"),
    ("nid[001-004,007],gpu5", "nid001"),
    ("gpu5", "gpu5"),
    ("gpu5,gpu6", "gpu5"),
    ("node[10-12]", "node10"),
    ("node[7]", "node7"),
    ("node[007,001-004]", "node007"),              # the list's first, as Slurm orders it
    ("x1000c0s0b0n[0-1],x1000c0s1b0n0", "x1000c0s0b0n0"),
    ("gpu-a100-[01-08]", "gpu-a100-01"),
    ("  nid[0001-0004]  ", "nid0001"),
    ("", None),
    ("   ", None),
])
def test_first_host(nodelist, first):
    assert first_host(nodelist) == first


def test_first_host_with_suffix_after_the_range():
    assert first_host("nid[001-004]-ib") == "nid001-ib"


# ------------------------------------------------------------ rendezvous

def test_rendezvous_without_mpi():
    info = LaunchInfo("torchrun", 0, 4, 0, 4, None, "node0", 29500)
    assert launch.rendezvous(info) == ("node0", 29500)
    addr, port = launch.rendezvous(LaunchInfo("none", 0, 1, 0, 1))
    assert addr == "127.0.0.1" and 0 < port < 65536
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        launch.rendezvous(LaunchInfo("slurm", 0, 4, 0, 4, 0, None, None))


SNIPPET = r"""
import dataclasses, json, os, sys
from commbench import launch
info = launch.detect()
addr, port = launch.rendezvous(info)
# one file per rank: mpiexec may splice the ranks' stdout lines together
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
    json.dump(dict(dataclasses.asdict(info), rdv=[addr, port]), f)
"""


@pytest.fixture(scope="module")
def mpiexec_two_ranks(tmp_path_factory):
    if not os.access(MPIEXEC, os.X_OK):
        pytest.skip(f"no mpiexec beside {sys.executable}")
    pytest.importorskip("mpi4py")
    out = tmp_path_factory.mktemp("mpiexec")
    proc = subprocess.run(["env", "-u", "MASTER_ADDR", "-u", "MASTER_PORT", MPIEXEC, "-n", "2",
                           sys.executable, "-c", SNIPPET, str(out)],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(out.iterdir())
    assert [f.name for f in files] == ["rank0.json", "rank1.json"], proc.stdout + proc.stderr
    return [json.loads(f.read_text()) for f in files]


def test_mpiexec_detect(mpiexec_two_ranks):
    docs = mpiexec_two_ranks
    assert [d["rank"] for d in docs] == [0, 1]
    for d in docs:
        assert d["launcher"] == "mpich"
        assert d["world_size"] == 2
        assert d["local_world_size"] == 2            # both on this machine
        assert d["master_addr"] is None and d["master_port"] is None
    assert sorted(d["local_rank"] for d in docs) == [0, 1]


def test_mpiexec_rendezvous_agrees_without_master_addr(mpiexec_two_ranks):
    (a0, p0), (a1, p1) = (tuple(d["rdv"]) for d in mpiexec_two_ranks)
    assert (a0, p0) == (a1, p1)
    assert isinstance(a0, str) and a0
    assert isinstance(p0, int) and 0 < p0 < 65536


FAULTS = """
import os, resource, sys
import numpy as np
from commbench import launch
set_ = launch.steady_allocator() if sys.argv[1] == "steady" else None
def cycle():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(1 << 20, dtype=np.float32)        # 4 MiB, every page touched
    del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
cycle()
print(set_, cycle())
"""


@pytest.mark.parametrize("mode", ["dynamic", "steady", "user"])
def test_steady_allocator_keeps_freed_blocks_for_the_next_call(mode):
    """glibc's dynamic thresholds give a fresh process's second 4 MiB block new
    pages again (the first was mmapped and returned; the second grows the
    heap); with steady_allocator the second reuses the first's heap. A user's
    MALLOC_MMAP_THRESHOLD_ is left as it is."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    if mode == "user":
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)       # 64 KiB: every 4 MiB block mmapped and returned
    p = subprocess.run([sys.executable, "-c", FAULTS, "steady" if mode != "dynamic" else "no"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    set_, faults = p.stdout.split()
    pages = (4 << 20) // os.sysconf("SC_PAGE_SIZE")
    if mode == "steady":
        assert set_ == str(32 << 20) and int(faults) < pages // 10
    else:
        assert set_ == "None" and int(faults) > pages // 4     # 470-981 of 1024 seen


DENORMALS = """
import sys, torch
from commbench import launch
if sys.argv[1] != "none":
    launch.setup_cpu_rank(launch.LaunchInfo("local", 0, 1, 0, 1), sys.argv[1])
x = torch.full((4,), 1e-39)                      # a denormal float32
print(launch.FLUSH_DENORMAL, bool((x * 1.0 == 0).all()), bool((x * 1e30).sum() > 0))
"""


@pytest.mark.parametrize("device", ["cpu", "cuda", "none"])
def test_cpu_ranks_flush_denormal_numbers(device):
    """A CPU rank computes with denormals as zero (as compute timing and
    validate both set it up): 1e-39 reads as 0; untouched otherwise, where
    1e-39 x 1e30 is 1e-9."""
    p = subprocess.run([sys.executable, "-c", DENORMALS, device], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == (["True", "True", "False"] if device == "cpu" else ["None", "False", "True"])


def test_more_ranks_than_gpus_is_one_clear_error(monkeypatch):
    """NCCL needs a GPU per rank: 2 local ranks on a host with 1 visible GPU stop
    before any process group, naming both counts (not NCCL's "Duplicate GPU")."""
    import torch

    from commbench.backends.base import check_gpu_per_rank
    from commbench.backends.torch_dist import TorchBackend
    from commbench.launch import LaunchInfo
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    info = LaunchInfo(launcher="local", rank=1, world_size=2, local_rank=1, local_world_size=2)
    with pytest.raises(ValueError) as e:
        TorchBackend(info, "cuda", 10)
    assert str(e.value) == ("--device cuda: 2 ranks on this host and 1 GPU(s) visible; NCCL needs a GPU of its "
                            "own for each rank (start at most 1 rank(s) per host, or check CUDA_VISIBLE_DEVICES)")
    check_gpu_per_rank(4, 4, "x")            # one GPU each: fine


def test_cupy_version_from_any_wheel(monkeypatch):
    """The header names cupy's version whatever its wheel is called (an H200
    node's cupy-cuda13x read as None before)."""
    import importlib.metadata as md

    from commbench import env
    real = md.version
    monkeypatch.setattr(md, "packages_distributions", lambda: {"cupy": ["cupy-cuda13x"], "numpy": ["numpy"]})
    monkeypatch.setattr(md, "version", lambda d: "14.2.0" if d == "cupy-cuda13x" else real(d))
    assert env.cupy_version() == "14.2.0" and env.versions()["cupy"] == "14.2.0"
    monkeypatch.setattr(md, "packages_distributions", lambda: {})
    monkeypatch.setattr(md, "version", lambda d: (_ for _ in ()).throw(md.PackageNotFoundError(d)))
    assert env.cupy_version() is None
