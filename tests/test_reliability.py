"""Reliability (#7): a hung or killed rank ends the job within the timeout plus a
few seconds with one line naming the case and the rank; SIGTERM leaves a valid
file that --resume completes without duplicates; kill -9 mid-write leaves a
loadable file; too-big sweeps and mismatched ranks are refused up front.

Times are measured from the moment the fault happens (the test watches the
results file grow), not from the start: starting torch on a loaded machine
takes longer than the bound itself."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from commbench import memcheck, rankcheck, resume, results, watchdog
from commbench.results import ResultWriter, make_header
from conftest import MPIEXEC, clean_env

PY = sys.executable
SWEEP = ["run", "--collective", "all_reduce", "-b", "8", "-e", "64K", "-n", "3", "-w", "1", "--target-ci", "0",
         "-c", "1", "-q", "--time-budget", "0.2"]
TIMEOUT = 4
SLACK = 15          # launcher reaction, the loaded 2-core CI machine


def start(argv, cwd, launcher=(), **env):
    return subprocess.Popen([*launcher, PY, "-m", "commbench", *argv], cwd=cwd, env=clean_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def lines_of(path):
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def wait_lines(proc, path, n, limit=150):
    """Wait until the results file holds n complete lines (header included)."""
    end = time.monotonic() + limit
    while lines_of(path) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the sweep did not get going"
        time.sleep(0.05)
    return time.monotonic()


def rank_pid(path, rank):
    run_id = json.loads(path.read_text().split("\n")[0])["run_id"]
    d = os.path.join(__import__("tempfile").gettempdir(), f"commbench-{run_id}")
    with open(os.path.join(d, f"rank{rank}.json")) as f:
        return json.load(f)["pid"]


def finish(proc, limit=120):
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out, [ln for ln in err.splitlines() if ln.strip()], time.monotonic()


def assert_partial_file(path, at_least):
    rf = results.load(str(path))
    keys = [m.case.key() for m in rf.measurements]
    assert len(keys) >= at_least and len(keys) == len(set(keys))
    return rf


def test_hung_rank_ends_the_job_with_one_line_naming_it(tmp_path):
    out = tmp_path / "hang.jsonl"
    proc = start([*SWEEP, "--nprocs", "2", "--timeout", str(TIMEOUT), "--out", out], tmp_path,
                 COMMBENCH_INJECT_HANG="1:4")
    t_fault = wait_lines(proc, out, 1 + 4)           # case 4 is where rank 1 stops answering
    code, _, err, t_end = finish(proc)
    assert code == watchdog.EXIT_TIMEOUT, err
    assert len(err) == 1 and "Traceback" not in err[0], "\n".join(err)   # the lines whole
    line = err[0]
    assert line.startswith("commbench: timeout: all_reduce of ") and "group world [0, 1]" in line, line
    assert "rank 1 (still in an earlier step)" in line and str(out) in line, line
    assert t_end - t_fault < TIMEOUT + 0.2 + SLACK
    assert len(assert_partial_file(out, 4).measurements) == 4


def test_killed_rank_under_local_spawn(tmp_path):
    out = tmp_path / "kill.jsonl"
    proc = start([*SWEEP, "-e", "1M", "--nprocs", "2", "--timeout", str(TIMEOUT), "--out", out], tmp_path)
    wait_lines(proc, out, 1 + 3)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    t_fault = time.monotonic()
    code, _, err, t_end = finish(proc)
    assert code == watchdog.EXIT_TIMEOUT, err
    assert len(err) == 1, err
    assert "all_reduce of " in err[0] and "rank 1 (process gone)" in err[0], err
    assert t_end - t_fault < TIMEOUT + SLACK
    assert_partial_file(out, 3)


def test_killed_rank_under_mpiexec(tmp_path):
    """torch (gloo) ranks started by mpiexec. MPICH's hydra itself kills the
    job when a rank dies of a signal and prints its own banner; the ranks left
    may or may not get to print their line first. Either way: the job ends at
    once and the file holds every finished case."""
    out = tmp_path / "mpi.jsonl"
    proc = start([*SWEEP, "-e", "1M", "--timeout", str(TIMEOUT), "--out", out], tmp_path,
                 launcher=[MPIEXEC, "-n", "2"])
    wait_lines(proc, out, 1 + 3)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    t_fault = time.monotonic()
    code, stdout, err, t_end = finish(proc)
    text = stdout + "\n".join(err)          # hydra's banner is on stdout
    assert code != 0
    assert "BAD TERMINATION" in text or "rank 1 (process gone)" in text, text
    assert "Traceback" not in text
    assert t_end - t_fault < TIMEOUT + SLACK
    assert_partial_file(out, 3)


def test_killed_rank_under_torchrun(tmp_path):
    """torchrun stops the other ranks with SIGTERM when one dies: that is not an
    interruption, and the rank left names the dead one, with the timeout status."""
    out = tmp_path / "torchrun.jsonl"
    torchrun = os.path.join(os.path.dirname(PY), "torchrun")
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "commbench", *SWEEP,
                             "-e", "1M", "--timeout", str(TIMEOUT), "--out", str(out)],
                            cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_lines(proc, out, 1 + 3)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    t_fault = time.monotonic()
    code, _, err, t_end = finish(proc)
    ours = [ln for ln in err if ln.startswith("commbench:")]
    assert code != 0
    assert len(ours) == 1 and "all_reduce of " in ours[0] and "rank 1 (process gone)" in ours[0], err
    assert "interrupted" not in ours[0], ours
    assert t_end - t_fault < TIMEOUT + SLACK
    assert_partial_file(out, 3)


COMPUTE = ["compute", "--model", "tiny-gpt", "--nprocs", "2", "--device", "cpu", "-n", "3", "-w", "1",
           "--target-ci", "0", "-q"]


def test_hung_rank_in_compute_ends_the_job_naming_the_kernel_and_rank(tmp_path):
    out = tmp_path / "compute-hang.jsonl"
    proc = start([*COMPUTE, "--timeout", str(TIMEOUT), "--out", out], tmp_path, COMMBENCH_INJECT_HANG="1:4:compute")
    t_fault = wait_lines(proc, out, 1 + 3)       # kernel 4 is where rank 1 stops answering
    code, _, err, t_end = finish(proc)
    assert code == watchdog.EXIT_TIMEOUT, err
    assert len(err) == 1 and "Traceback" not in err[0], "\n".join(err)   # the lines whole
    line = err[0]
    assert line.startswith("commbench: timeout: compute ") and "on ranks 0-1 at once" in line, line
    assert "rank 1 (still in an earlier step)" in line and str(out) in line, line
    assert t_end - t_fault < TIMEOUT + SLACK
    rf = assert_partial_file(out, 3)
    assert len(rf.measurements) == 3 and all(m.status == "ok" for m in rf.measurements)


def test_killed_rank_in_compute_ends_the_job_naming_it(tmp_path):
    out = tmp_path / "compute-kill.jsonl"
    proc = start([*COMPUTE, "--model", "small-gpt", "--timeout", str(TIMEOUT), "--out", out], tmp_path)
    wait_lines(proc, out, 1 + 2)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    t_fault = time.monotonic()
    code, _, err, t_end = finish(proc)
    assert code == watchdog.EXIT_TIMEOUT, err
    assert len(err) == 1 and err[0].startswith("commbench: timeout: compute "), err
    assert "rank 1 (process gone)" in err[0], err
    assert t_end - t_fault < TIMEOUT + SLACK
    assert_partial_file(out, 2)


def test_hung_rank_in_validate_training_names_the_step(tmp_path):
    out = tmp_path / "val"
    # one step: all of it trained after the measurements (validate.bracket), 1 warmup + 1
    proc = start(["validate", "--model", "tiny-gpt", "--nprocs", "2", "--steps", "1", "--warmup-steps", "1",
                  "--timeout", str(TIMEOUT), "--out-dir", out], tmp_path, COMMBENCH_INJECT_HANG="1:3:training")
    code, _, err, _ = finish(proc, limit=400)
    assert code == watchdog.EXIT_TIMEOUT, err
    assert len(err) == 1, err
    assert err[0].startswith("commbench: timeout: training step 2 (1 warmup, then 1 timed or more to fill 1 s) "
                             "(tiny-gpt "), err
    assert "rank 1 (still in an earlier step)" in err[0] and str(out) in err[0], err
    # what was measured before the training is kept
    assert results.load(str(out / "compute.jsonl")).measurements
    assert not (out / "validate.json").exists()


def test_sigterm_then_resume_completes_without_duplicates(tmp_path):
    out = tmp_path / "term.jsonl"
    proc = start([*SWEEP, "--nprocs", "2", "--out", out], tmp_path)
    wait_lines(proc, out, 1 + 3)
    os.kill(proc.pid, signal.SIGTERM)          # as Slurm does at the time limit
    code, _, err, _ = finish(proc)
    assert code == 143, err
    assert len(err) == 1 and "interrupted by SIGTERM" in err[0] and "--resume" in err[0], err
    before = assert_partial_file(out, 3)
    first_lines = out.read_text().splitlines()
    # other settings are refused, naming the difference, before any rank starts
    proc = start([*SWEEP, "-n", "4", "--nprocs", "2", "--resume", out], tmp_path)
    code, _, err, _ = finish(proc)
    assert code == 2 and len(err) == 1 and "iters" in err[0], err
    proc = start([*SWEEP, "--nprocs", "2", "--resume", out], tmp_path)
    code, _, err, _ = finish(proc)
    assert code == 0, err
    after = results.load(str(out))
    keys = [m.case.key() for m in after.measurements]
    assert len(keys) == len(set(keys)) == 14          # all_reduce, 8 B to 64 KiB
    assert out.read_text().splitlines()[: len(first_lines)] == first_lines     # nothing rewritten
    assert after.header["run_id"] == before.header["run_id"]


def test_sigterm_during_compute_keeps_the_finished_kernels(tmp_path):
    out = tmp_path / "compute.jsonl"
    proc = start(["compute", "--model", "small-gpt", "--nprocs", "2", "--device", "cpu", "-n", "3", "-w", "1",
                  "--target-ci", "0", "-q", "--out", out], tmp_path)
    wait_lines(proc, out, 1 + 2)
    os.kill(proc.pid, signal.SIGTERM)
    code, _, err, _ = finish(proc)
    assert code == 143, err
    assert len(err) == 1 and "interrupted by SIGTERM" in err[0] and str(out) in err[0], err
    rf = assert_partial_file(out, 2)
    assert all(m.case.kind == "compute" and m.status == "ok" for m in rf.measurements)


def test_kill_9_during_writes_leaves_a_loadable_file(tmp_path):
    path = tmp_path / "w.jsonl"
    writer = (
        "import sys\n"
        "from commbench.results import ResultWriter, make_header, Case, Measurement\n"
        "w = ResultWriter(sys.argv[1], make_header(run_id='k'))\n"
        "c = Case(kind='collective', op='all_reduce', backend='x', device='cpu', dtype='float32', nbytes=8,"
        " group_size=2, num_nodes=1, axis='world', in_place=False)\n"
        "i = 0\n"
        "while True:\n"
        "    w.append(Measurement(case=c, samples_s=[1e-6] * 2000, warnings=[str(i)])); i += 1\n")
    for delay in (0.6, 0.9):
        path.unlink(missing_ok=True)
        p = subprocess.Popen([PY, "-c", writer, str(path)], env=clean_env())
        end = time.monotonic() + 60
        while lines_of(path) < 3 and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(delay)
        p.kill()
        p.wait()
        rf = results.load(str(path))
        n = len(rf.measurements)
        assert n >= 2 and [m.warnings for m in rf.measurements] == [[str(i)] for i in range(n)]
        # and a resumed writer continues on a line of its own
        with open(path, "a") as f:
            f.write('{"case": {"kind": "coll')           # a partial line, as a crash leaves it
        w = ResultWriter(str(path), {}, append=True)
        w.append(rf.measurements[0])
        w.close()
        assert len(results.load(str(path)).measurements) == n + 1


def test_too_big_a_sweep_is_refused_with_the_numbers(tmp_path):
    proc = start(["run", "--device", "cpu", "--nprocs", "2", "-b", "1G", "-e", "1T", "--collective", "all_gather"],
                 tmp_path)
    code, out, err, _ = finish(proc)
    assert code == 2 and len(err) == 1 and out == "", err
    assert "GiB" in err[0] and "per rank" in err[0] and "all_gather" in err[0] and "-e/--maxbytes" in err[0]
    assert not (tmp_path / "results").exists()


def test_stale_progress_directories_are_removed(tmp_path):
    """Ranks that exit with 124 (or are killed) leave their progress directory;
    the next run on the host removes those whose processes are all gone."""
    def make(name, pids, age_s):
        d = tmp_path / name
        d.mkdir()
        for r, pid in enumerate(pids):
            (d / f"rank{r}.json").write_text(json.dumps({"pid": pid, "pos": [1, 1], "state": "timeout"}))
        os.utime(d, (time.time() - age_s, time.time() - age_s))
        return d
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    gone = make("commbench-aaaaaaaaaaaa", [dead_pid, dead_pid], 120)
    alive = make("commbench-bbbbbbbbbbbb", [dead_pid, os.getpid()], 120)
    young = make("commbench-cccccccccccc", [dead_pid], 5)
    other = make("commbench-not-ours", [dead_pid], 120)
    watchdog.remove_stale(str(tmp_path))
    assert not gone.exists() and alive.exists() and young.exists() and other.exists()


def test_memcheck_numbers():
    need_h, need_d, what = memcheck.largest([("all_reduce", "float32", 1000, 1000)], "cpu", True)
    assert need_d == 0 and need_h == 8000 + 16 * 1000 + 16 * 1000 and "all_reduce" in what
    assert memcheck.check([("all_reduce", "float32", 10**9, 10**9)], "cpu", True, 4, host_free=8 << 30)
    assert memcheck.check([("all_reduce", "float32", 100, 100)], "cpu", True, 4, host_free=8 << 30) is None
    msg = memcheck.check([("x", "float16", 10**9, 10**9)], "cuda", False, 1, host_free=1 << 40, device_free=1 << 30)
    assert msg and "GPU memory" in msg


def test_mismatched_ranks_are_refused_naming_the_difference(tmp_path):
    common = ["-m", "commbench", "run", "--backend", "mpi", "--collective", "all_reduce", "-b", "8", "-e", "8",
              "-w", "1", "--target-ci", "0", "-q", "--out", "m.jsonl"]
    cmd = [MPIEXEC, "-n", "1", PY, *common, "-n", "3", ":", "-n", "1", PY, *common, "-n", "4"]
    p = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(err) == 1 and "rank(s) 1" in err[0] and "iters: 4 vs 3" in err[0], err
    assert not (tmp_path / "m.jsonl").exists()


def test_units_timeout_rule_difference_and_partial_line(tmp_path):
    assert watchdog.collective_timeout_s(8) == 60.0
    assert watchdog.collective_timeout_s(10 * 10**9) == pytest.approx(1000.0)      # 10 x 100 s at 100 MB/s
    assert watchdog.collective_timeout_s(10**12, given=5) == 5.0
    assert watchdog.phase_deadline_s(10**8, 20, None, 1.0) == pytest.approx(60 + 20 + 1)
    assert rankcheck.first_difference({"a": {"b": 1}}, {"a": {"b": 2}}) == "a.b: 1 vs 2"
    assert resume.settings_difference({"iters": 5, "timeout_s": 1}, {"iters": 5, "timeout_s": None}) is None
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(make_header(run_id="p")) + "\n" + '{"half')
    resume.cut_partial_line(str(path))
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 1


def test_two_reports_of_one_stall_print_one_line(tmp_path):
    """The watchdog thread's deadline and the main thread's failed collective can
    find the same stall at once: the rank still prints one line and exits 124."""
    script = tmp_path / "two.py"
    script.write_text(
        "import sys, threading, time\n"
        "from commbench import watchdog\n"
        "class P:\n"
        "    rank, state, watchdog = 0, '', None\n"
        "    def missing(self):\n"
        "        time.sleep(0.3)\n"
        "        return [(1, 'process gone')], [0], []\n"
        "    def write(self):\n"
        "        pass\n"
        "class SlowFlush:\n"
        "    def write(self, text):\n"
        "        sys.stderr.write(text)\n"
        "    def flush(self):\n"
        "        sys.stderr.flush()\n"
        "        time.sleep(0.5)\n"
        "w = watchdog.Watchdog(P(), stream=SlowFlush())\n"
        "threading.Thread(target=w.report, args=('case x', 'within 1 s')).start()\n"
        "w.report('case x', 'because a peer stopped answering')\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == watchdog.EXIT_TIMEOUT, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("commbench: timeout: case x")]
    assert len(lines) == 1 and "rank 1 (process gone)" in lines[0], p.stderr
