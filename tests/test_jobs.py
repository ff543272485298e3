"""jobs/: the launch scripts parse, document the variables a user edits (and each
documented variable is really read, environment first), and the mpiexec and
torchrun scripts run for real on this machine with 2 ranks, writing results files."""
import re
import socket
import subprocess
import sys

import pytest

from conftest import BIN, MPIEXEC, ROOT, clean_env

JOBS = ROOT / "jobs"
SCRIPTS = {"slurm.sbatch": ("#SBATCH --nodes", "--cpus-per-task \"${SLURM_CPUS_PER_TASK:-1}\""),
           "pbs-polaris.sh": ("#PBS -l select=", "--ppn \"$RANKS_PER_NODE\" --depth \"$DEPTH\" --cpu-bind depth"),
           "mpiexec.sh": ("HOSTFILE_FLAG=${HOSTFILE_FLAG:--f}", "\"$HOSTFILE_FLAG\" \"$HOSTFILE\""),
           "torchrun.sh": ("--rdzv-backend c10d", "--rdzv-endpoint \"$RDZV_ENDPOINT\"")}
COMMON = {"COMMBENCH", "COLLECTIVES", "LAYOUTS", "SIZES", "RUN_ARGS", "PLAN", "OUT_DIR", "REPORT"}
FAST_RUN = "-n 5 -w 1 --target-ci 0 -q"
PY = f"{sys.executable} -m commbench"


def documented(text: str) -> list:
    """The names in the script's '# Variables' block: lines '#   NAME   what it is'."""
    block = text.split("# Variables", 1)[1].split("\nset -euo pipefail", 1)[0]
    return re.findall(r"^#   ([A-Z][A-Z0-9_]+) +\S", block, re.M)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_syntax_and_documented_variables(name):
    path = JOBS / name
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    names = documented(text)
    assert COMMON <= set(names), COMMON - set(names)
    for v in names:       # each documented variable is read, the environment's value first
        assert re.search(rf"^{v}=\$\{{{v}:-", text, re.M), f"{name}: {v} is documented but not read as ${{{v}:-...}}"
    for v in re.findall(r"^([A-Z][A-Z0-9_]+)=\$\{\1:-", text, re.M):
        assert v in names, f"{name}: {v} is read from the environment but not documented"
    assert "GROUPS=" not in text      # bash's own GROUPS (the user's group ids) ignores assignments
    for needle in SCRIPTS[name]:
        assert needle in text, f"{name}: {needle!r} missing"
    assert "commbench" in text and " run " in text and "compute $PLAN" in text


def _check_results(out, plan: bool):
    from commbench import results
    sweep = results.load(str(out / "sweep.jsonl"))
    assert sweep.header["cluster"]["num_ranks"] == 2
    assert {m.case.op for m in sweep.measurements} == {"all_reduce", "all_gather"}
    assert {m.case.axis for m in sweep.measurements} == {"world", "intra"}
    assert all(m.num_wrong == 0 for m in sweep.measurements)
    if plan:
        comm = results.load(str(out / "plan-comm.jsonl"))
        assert {m.case.axis for m in comm.measurements} == {"dp"}
        compute = results.load(str(out / "compute.jsonl"))
        assert compute.measurements and all(m.case.kind == "compute" for m in compute.measurements)
    assert (out / "report" / "report.html").stat().st_size > 10000


def test_mpiexec_script_runs_locally(tmp_path):
    out = tmp_path / "out"
    env = clean_env(MPIEXEC=MPIEXEC, COMMBENCH=PY, NODES="1", PPN="2", COLLECTIVES="all_reduce,all_gather",
                    LAYOUTS="world,intra", SIZES="-b 1K -e 16K -f 4", RUN_ARGS=FAST_RUN, OUT_DIR=str(out),
                    PLAN="--model tiny-gpt --global-batch 8 --dtype fp32 -n 3 -w 1 --target-ci 0 --time-budget 0.1")
    r = subprocess.run(["bash", str(JOBS / "mpiexec.sh")], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith(f"results: {out}")
    _check_results(out, plan=True)


def test_torchrun_script_runs_locally(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    env = clean_env(TORCHRUN=str(BIN / "torchrun"), COMMBENCH=PY, NNODES="1", NPROC_PER_NODE="2",
                    RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="test", COLLECTIVES="all_reduce,all_gather",
                    LAYOUTS="world,intra", SIZES="-b 1K -e 4K -f 4", RUN_ARGS=FAST_RUN, OUT_DIR=str(out), REPORT="1")
    r = subprocess.run(["bash", str(JOBS / "torchrun.sh")], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_results(out, plan=False)
