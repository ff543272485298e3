"""`commbench validate` end to end on 2 gloo ranks: real training steps, the
plan's collectives and kernels measured on the same ranks, and a report whose
error is computed from the two numbers it shows."""
import json
import statistics

import pytest

from commbench import results
from conftest import commbench


def test_validate_ddp_two_ranks(tmp_path):
    out = tmp_path / "v"
    p = commbench("validate", "--model", "tiny-gpt", "--nprocs", "2", "--global-batch", "4", "--seq", "32",
                  "--steps", "3", "--warmup-steps", "1", "--device", "cpu", "--out-dir", out, "--json",
                  cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc == json.loads((out / "validate.json").read_text())
    meas, pred = doc["measured_step_time_s"], doc["predicted_step_time_s"]
    assert meas == statistics.median(doc["measured_steps_s"]) and len(doc["measured_steps_s"]) == 3
    assert doc["error_pct"] == pytest.approx(100 * (pred - meas) / meas)
    assert pred == doc["prediction"]["step_time_s"] > 0
    parts = sum(v for k, v in doc["prediction"]["breakdown"].items() if k != "hidden_comm_s")
    assert parts == pytest.approx(pred)
    assert doc["plan"]["dp"] == 2 and doc["plan"]["num_microbatches"] == 2 and doc["plan"]["dtype"] == "fp32"
    assert "DDP" in doc["implementation"] and all(x == x for x in doc["losses"])
    # the two measurements it predicted from are on disk, from the same 2 ranks
    comm = results.load(doc["results"]["comm"])
    assert {m.case.op for m in comm.measurements} == {"all_reduce"}
    assert all(m.case.axis == "dp" and m.case.group_size == 2 for m in comm.measurements)
    compute = results.load(doc["results"]["compute"])
    assert all(m.case.kind == "compute" and m.case.concurrent_groups == 2 for m in compute.measurements)
    assert {"stage_fwd", "stage_bwd", "adam", "gemm_nt"} <= {m.case.op for m in compute.measurements}
    assert doc["interference"]["compute"] >= 1 and doc["interference"]["comm"] >= 1


def test_validate_refuses_what_it_cannot_run(tmp_path):
    p = commbench("validate", "--model", "tiny-gpt", "--nprocs", "2", "--recompute", "selective",
                  "--out-dir", tmp_path / "v", cwd=tmp_path)
    assert p.returncode == 2 and "selective" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "v").exists()
