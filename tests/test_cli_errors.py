"""Bad input to the command line, as a job script meets it: `python -m commbench ...`
as a real subprocess must exit 2 with exactly one line on stderr that names
the bad value, never a traceback, never a results file and nothing on stdout.

Every case is started at once by a module fixture (each is a fresh Python that
imports scipy, some torch), so the file takes the time of the slowest few
rather than the sum."""
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from commbench.results import make_header
from conftest import clean_env

PY = sys.executable
# --device cpu where the device is not the point: resolving --device auto imports
# torch (seconds); the other values are validated before it either way
CPU = ["--device", "cpu"]


def _header_999(d):
    (d / "v999.jsonl").write_text(json.dumps({"type": "header", "schema_version": 999, "run_id": "x"}) + "\n")


def _existing(d):
    (d / "existing.jsonl").write_text("precious results\n")


# id: (argv, regexes the stderr line must all match, setup(dir) or None, extra env or None, marks)
CASES = {
    "inverted-sizes": (["run", "-b", "1M", "-e", "1K", *CPU], [r"\b1024\b", r"\b1048576\b"], None, None, ()),
    "negative-size": (["run", "-b", "-8"], [r"'-8'"], None, None, ()),
    "garbage-size": (["run", "-b", "12Q"], [r"'12Q'"], None, None, ()),
    "stepfactor-1": (["run", "-f", "1", *CPU], [r"stepfactor", r"\b1(\.0)?\b"], None, None, ()),
    "stepfactor-0.5": (["run", "-f", "0.5", *CPU], [r"stepfactor", r"\b0\.5\b"], None, None, ()),
    "stepfactor-not-a-number": (["run", "-f", "two"], [r"'two'"], None, None, ()),
    "zero-minbytes-multiplicative": (["run", "-b", "0", *CPU], [r"minbytes"], None, None, ()),
    "stepbytes-0-without-f": (["run", "-i", "0", "--out", "existing.jsonl", *CPU],
                              [r"stepbytes|-i\b", r"\b0\b"], _existing, None, ()),
    "unknown-collective": (["run", "--collective", "all_reduce,allreducex", *CPU], [r"'allreducex'"],
                           None, None, ()),
    "unknown-dtype": (["run", "-d", "float33", *CPU], [r"'float33'"], None, None, ()),
    "unknown-backend": (["run", "--backend", "nccl2", *CPU], [r"'nccl2'"], None, None, ()),
    "unknown-redop": (["run", "-o", "foo", *CPU], [r"'foo'", r"reduction op"], None, None, ()),
    "iters-0": (["run", "-n", "0", *CPU], [r"-n|iters", r"\b0\b"], None, None, ()),
    "iters-not-int": (["run", "-n", "ten"], [r"'ten'"], None, None, ()),
    "warmup-negative": (["run", "-w", "-1", *CPU], [r"warmup", r"-1\b"], None, None, ()),
    "check-negative": (["run", "-c", "-1", *CPU], [r"check", r"-1\b"], None, None, ()),
    "target-ci-1.5": (["run", "--target-ci", "1.5", *CPU], [r"target-ci", r"\b1\.5\b"], None, None, ()),
    "max-iters-below-iters": (["run", "-n", "50", "--max-iters", "10", *CPU],
                              [r"max-iters", r"\b10\b", r"\b50\b"], None, None, ()),
    "groups-mod-0": (["run", "--groups", "MOD 0", *CPU], [r"'MOD 0'"], None, None, ()),
    "groups-foo": (["run", "--groups", "world,foo", *CPU], [r"'foo'"], None, None, ()),
    "in-place-bad-choice": (["run", "--in-place", "maybe"], [r"'maybe'"], None, None, ()),
    "device-nonsense": (["run", "--device", "nonsense"], [r"'nonsense'"], None, None, ()),
    # CUDA_VISIBLE_DEVICES='' hides any GPU, so this holds on a GPU machine too
    "device-cuda-without-gpu": (["run", "--device", "cuda"], [r"cuda"], None,
                                {"CUDA_VISIBLE_DEVICES": ""}, ()),
    "nprocs-0": (["run", "--nprocs", "0", *CPU], [r"nprocs", r"\b0\b"], None, None, ()),
    "json-and-csv": (["run", "--json", "--csv"], [r"--csv", r"--json"], None, None, ()),
    "unknown-verb": (["benchmark"], [r"'benchmark'"], None, None, ()),
    "missing-verb": ([], [r"VERB", r"required"], None, None, ()),
    "show-missing-file": (["show", "nope.jsonl"], [r"nope\.jsonl"], None, None, ()),
    "show-not-json": (["show", "notes.txt"], [r"notes\.txt", r"JSON"],
                      lambda d: (d / "notes.txt").write_text("all_reduce 8 1.2us\n"), None, ()),
    "show-not-text": (["show", "blob.bin"], [r"blob\.bin"],
                      lambda d: (d / "blob.bin").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00"), None, ()),
    "show-empty-file": (["show", "empty.jsonl"], [r"empty\.jsonl", r"empty"],
                        lambda d: (d / "empty.jsonl").write_text(""), None, ()),
    "show-schema-999": (["show", "v999.jsonl"], [r"\b999\b", r"v999\.jsonl"], _header_999, None, ()),
    "show-no-file-argument": (["show"], [r"file"], None, None, ()),
    "out-exists-without-force": (["run", "--out", "existing.jsonl", *CPU], [r"existing\.jsonl", r"--force"],
                                 _existing, None, ()),
}


def _run(argv, cwd, extra_env=None, timeout=180):
    env = clean_env(**(extra_env or {}))
    return subprocess.run([PY, "-m", "commbench", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run every case concurrently, each in its own empty working directory."""
    jobs = {}
    for name, (argv, _, setup, extra_env, _) in CASES.items():
        d = tmp_path_factory.mktemp(name)
        if setup:
            setup(d)
        jobs[name] = (argv, d, extra_env)
    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        futures = {name: pool.submit(_run, argv, d, env) for name, (argv, d, env) in jobs.items()}
        return {name: (f.result(), jobs[name][1]) for name, f in futures.items()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=c[4], id=n) for n, c in CASES.items()])
def test_bad_input_is_one_line_and_exit_2(name, outcomes):
    proc, cwd = outcomes[name]
    _, patterns, setup, _, _ = CASES[name]
    everything = proc.stdout + proc.stderr
    assert "Traceback" not in everything, everything
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("commbench"), line
    assert "error" in line, line
    for pat in patterns:
        assert re.search(pat, line), f"{pat!r} not in {line!r}"
    assert proc.returncode == 2, (proc.returncode, line)
    assert proc.stdout == "", proc.stdout
    # bad input writes no results anywhere
    assert not (cwd / "results").exists()
    if setup is _existing:
        assert (cwd / "existing.jsonl").read_text() == "precious results\n"
        assert sorted(p.name for p in cwd.iterdir()) == ["existing.jsonl"]


def test_show_skips_a_truncated_last_line(tmp_path):
    header = make_header(run_id="x")
    partial = json.dumps({"case": {"kind": "collective", "op": "all_reduce", "backend": "torch-gloo",
                                   "device": "cpu", "dtype": "float32", "nbytes": 1024},
                          "status": "ok", "samples_s": [1e-5, 2e-5]})
    path = tmp_path / "crashed.jsonl"
    # the process died mid-write: the last line stops halfway, without a newline
    path.write_text(json.dumps(header) + "\n" + partial[: len(partial) // 2])

    proc = _run(["show", "crashed.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    warn = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warn) == 1 and "warning" in warn[0] and "truncated" in warn[0], proc.stderr
    assert "crashed.jsonl" in warn[0] and "2" in warn[0]
    assert "run x" in proc.stdout

    proc = _run(["show", "--json", "crashed.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["header"]["run_id"] == "x" and doc["header"]["type"] == "header"
    assert doc["measurements"] == []
    assert "truncated" in proc.stderr
    assert path.read_text().startswith(json.dumps(header))      # show never rewrites the file


def test_a_closed_stdout_ends_quietly_with_141():
    """`commbench ... | head`: no "failed: BrokenPipeError" and not status 1 ("a
    result was wrong"), whether the verb prints JSON or a rich table."""
    for verb in (["models", "--json"], ["plan", "--model", "gpt3-13b", "--world", "64", "--gpus-per-node", "8",
                                          "--tp", "8"]):
        p = subprocess.Popen([sys.executable, "-m", "commbench", *verb], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=clean_env())
        p.stdout.close()
        err = p.stderr.read()
        assert p.wait(timeout=120) == 141 and err == b"", (verb, err)
