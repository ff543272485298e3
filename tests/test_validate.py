"""`commbench validate` end to end on 2 gloo ranks: real training steps, the
plan's collectives and kernels measured on the same ranks, and a report whose
error is computed from the two numbers it shows."""
import json
import os
import statistics
import sys

import pytest

from commbench import results
from conftest import ROOT, clean_env, commbench, run_job


def test_validate_ddp_two_ranks(tmp_path):
    out = tmp_path / "v"
    p = commbench("validate", "--model", "tiny-gpt", "--nprocs", "2", "--global-batch", "4", "--seq", "32",
                  "--steps", "3", "--warmup-steps", "1", "--device", "cpu", "--out-dir", out, "--json",
                  cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc == json.loads((out / "validate.json").read_text())
    meas, pred = doc["measured_step_time_s"], doc["predicted_step_time_s"]
    # --steps 3 asked, but each half of the round trains at least --train-time's default,
    # a step op's budget in one window (2 x 0.5 s): more steps, as short as these are
    n = len(doc["measured_steps_s"])
    assert meas == statistics.median(doc["measured_steps_s"]) and n > 3
    assert doc["error_pct"] == pytest.approx(100 * (pred - meas) / meas)
    assert pred == doc["prediction"]["step_time_s"] > 0
    parts = sum(v for k, v in doc["prediction"]["breakdown"].items() if k != "hidden_comm_s")
    assert parts == pytest.approx(pred)
    assert doc["plan"]["dp"] == 2 and doc["plan"]["num_microbatches"] == 2 and doc["plan"]["dtype"] == "fp32"
    assert "DDP" in doc["implementation"] and all(x == x for x in doc["losses"])
    # the two measurements it predicted from are on disk, from the same 2 ranks
    assert doc["timing"] == {"time_budget_s": 0.5, "step_op_time_budget_s": 2.0, "step_op_min_time_s": 0.5,
                             "max_iters": 2000, "target_ci": 0.02, "ci_of": "mean", "train_time_s": 1.0}
    assert doc["malloc_mmap_threshold_b"] == 32 << 20      # launch.steady_allocator on every rank
    assert doc["flush_denormal"] is True                    # and denormal numbers flushed to zero
    (one,) = doc["rounds"]
    assert one["measured_steps_s"] == doc["measured_steps_s"] and one["error_pct"] == doc["error_pct"]
    k = one["steps_before"]
    assert 1 <= k < n and min(sum(doc["measured_steps_s"][:k]), sum(doc["measured_steps_s"][k:])) >= 1.0
    assert one["results"]["comm"] == doc["results"]["comm"][0] == str(out / "comm.jsonl")
    comm = results.load(doc["results"]["comm"][0])
    assert {m.case.op for m in comm.measurements} == {"all_reduce"}
    assert all(m.case.axis == "dp" and m.case.group_size == 2 for m in comm.measurements)
    compute = results.load(doc["results"]["compute"][0])
    assert all(m.case.kind == "compute" and m.case.concurrent_groups == 2 for m in compute.measurements)
    assert {"stage_fwd", "stage_bwd", "adam", "gemm_nt"} <= {m.case.op for m in compute.measurements}
    assert compute.header["settings"]["step_op_time_budget_s"] == 2.0
    # the step ops were timed in two windows (either side of the kernels, the
    # collectives and the interference), each with half the budget; compute.jsonl
    # holds each one's samples of both, in order
    before, after = (results.load(str(out / f"compute-steps-{w}.jsonl")) for w in ("before", "after"))
    assert [before.header["settings"]["step_op_window"], after.header["settings"]["step_op_window"]] == [1, 2]
    ops = {m.case.op for m in before.measurements}
    assert {"dp_microbatch", "stage_fwd", "stage_bwd", "adam"} <= ops and "gemm_nt" not in ops
    for a, b in zip(before.measurements, after.measurements):
        (m,) = [m for m in compute.measurements if m.case.key() == a.case.key()]
        assert m.samples_s == a.samples_s + b.samples_s and m.iters == a.iters + b.iters
        assert m.stats["time_mean_s"] == pytest.approx(statistics.mean(a.samples_s + b.samples_s))
    assert doc["interference"]["compute"] >= 1 and doc["interference"]["comm"] >= 1
    # `show` prints the saved validation as validate does
    p = commbench("show", out / "validate.json")
    assert p.returncode == 0, p.stderr
    assert (f"measured {meas * 1e3:.2f} ms per step (median of {n}" in p.stdout
            and f"predicted {pred * 1e3:.2f} ms   error {doc['error_pct']:+.1f} %" in p.stdout)
    assert "step time breakdown" in p.stdout and doc["implementation"][:40] in p.stdout


def test_validate_trains_the_padded_vocabulary(tmp_path):
    """--vocab-divisible-by 100 at tp 2: tiny-gpt's 512 words padded to 600
    (3 x 200): Megatron-style TP trains it, and the head timed in place holds
    its vocabulary-parallel half."""
    out = tmp_path / "v"
    p = commbench("validate", "--model", "tiny-gpt", "--tp", "2", "--nprocs", "2", "--global-batch", "2",
                  "--seq", "32", "--steps", "2", "--warmup-steps", "1", "--device", "cpu",
                  "--vocab-divisible-by", "100", "--out-dir", out, "--json", cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["implementation"].startswith("Megatron-style TP x 2") and all(x == x for x in doc["losses"])
    compute = results.load(doc["results"]["compute"][0])
    heads = [m.case.params["vocab"] for m in compute.measurements if m.case.op in ("head_fwd", "head_bwd")]
    assert heads == [300, 300]
    (tp,) = [m for m in compute.measurements if m.case.op == "tp_microbatch"]
    assert json.loads(tp.case.params["model"])["vocab"] == 600 and tp.status == "ok"


def test_validate_in_rounds(tmp_path):
    """--rounds 2: train, measure, train twice over; the steps shared 2 + 1; the
    prediction the mean of the two rounds' own, each from its round's files;
    the measured step the median of all three steps."""
    from commbench import models, plan as plan_mod, predict as predict_mod
    from commbench.commmodel import CommModel
    from commbench.parallel import Parallelism
    out = tmp_path / "v"
    p = commbench("validate", "--model", "tiny-gpt", "--nprocs", "2", "--global-batch", "4", "--seq", "32",
                  "--steps", "3", "--warmup-steps", "1", "--rounds", "2", "--time-budget", "0.2", "--max-iters", "400",
                  "--train-time", "0",
                  "--device", "cpu", "--out-dir", out, "--json", cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    r1, r2 = doc["rounds"]
    assert len(r1["measured_steps_s"]) == 2 and len(r2["measured_steps_s"]) == 1     # --train-time 0: as asked
    assert r1["steps_before"] == 1 and r2["steps_before"] == 0
    assert doc["measured_steps_s"] == r1["measured_steps_s"] + r2["measured_steps_s"]
    assert doc["measured_step_time_s"] == statistics.median(doc["measured_steps_s"])
    assert doc["timing"]["time_budget_s"] == 0.2 and doc["timing"]["max_iters"] == 400
    assert doc["timing"]["train_time_s"] == 0
    files = {k: [str(out / f"round-{i}" / f"{k}.jsonl") for i in (1, 2)] for k in ("comm", "compute", "interference")}
    assert doc["results"] == files and not (out / "comm.jsonl").exists()
    par = Parallelism(world=2, gpus_per_node=2, global_batch=4, seq=32, dtype="fp32")
    workload = plan_mod.build(models.get("tiny-gpt"), par, tp_flavour="megatron")
    preds = []
    for i, r in enumerate((r1, r2)):
        assert r["results"] == {k: files[k][i] for k in files}
        assert r["measured_step_time_s"] == statistics.median(r["measured_steps_s"])
        assert r["error_pct"] == pytest.approx(100 * (r["predicted_step_time_s"] - r["measured_step_time_s"])
                                               / r["measured_step_time_s"])
        loaded = {k: results.load(f) for k, f in r["results"].items()}
        assert all(m.iters <= 400 for rf in loaded.values() for m in rf.measurements)
        times = predict_mod.MeasuredTimes(CommModel.from_results([loaded["comm"]], statistic="mean"),
                                          [loaded["compute"]], device="cpu",
                                          interference=predict_mod.interference_factors(loaded["interference"]))
        times.bind(workload.compute_ops)
        preds.append(predict_mod.predict(workload, par, times))
        assert preds[-1].step_time_s == pytest.approx(r["predicted_step_time_s"])
    assert doc["predicted_step_time_s"] == pytest.approx((preds[0].step_time_s + preds[1].step_time_s) / 2)
    assert doc["error_pct"] == pytest.approx(100 * (doc["predicted_step_time_s"] - doc["measured_step_time_s"])
                                             / doc["measured_step_time_s"])
    parts = doc["prediction"]["breakdown"]
    assert sum(v for k, v in parts.items() if k != "hidden_comm_s") == pytest.approx(doc["predicted_step_time_s"])
    for k, v in parts.items():
        assert v == pytest.approx((preds[0].breakdown[k] + preds[1].breakdown[k]) / 2)
    # benchmarks/replay_validate.py reads the plan back from the run's files and,
    # with the predictor the run used, makes the run's own prediction again
    rp = run_job([sys.executable, str(ROOT / "benchmarks" / "replay_validate.py"), str(tmp_path)],
                 env=clean_env(PYTHONPATH=str(ROOT)), timeout=120)
    assert rp.returncode == 0, rp.stderr
    row = rp.stdout.splitlines()[1].split()
    assert row[0] == "v" and float(row[1]) == pytest.approx(doc["measured_step_time_s"] * 1e3, abs=0.006)
    assert float(row[2]) == float(row[4]) == pytest.approx(doc["predicted_step_time_s"] * 1e3, abs=0.006)


def test_validate_zero1_times_its_broadcast_burst_as_a_step_op(tmp_path):
    """ZeRO-1's parameter-broadcast burst, the optimizer side's whole exchange,
    is timed with the step ops' budget (4 x) and minimum time (the budget);
    the other collectives with the collectives' (no minimum)."""
    out = tmp_path / "v"
    p = commbench("validate", "--model", "tiny-gpt", "--zero", "1", "--nprocs", "2", "--global-batch", "4",
                  "--seq", "32", "--steps", "2", "--warmup-steps", "1", "--time-budget", "0.1", "--train-time", "0",
                  "--device", "cpu", "--out-dir", out, "--json", cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    comm = results.load(doc["results"]["comm"][0])
    s = comm.header["settings"]
    assert (s["time_budget_s"], s["burst_time_budget_s"], s["burst_min_time_s"]) == (0.1, 0.4, 0.1)
    (burst,) = [m for m in comm.measurements if m.case.op == "broadcast_burst"]
    assert burst.status == "ok" and burst.num_wrong == 0
    assert sum(burst.samples_s) >= 0.07, burst.samples_s      # timed for at least 0.1 s


def test_validate_refuses_what_it_cannot_run(tmp_path):
    p = commbench("validate", "--model", "tiny-gpt", "--nprocs", "2", "--recompute", "selective",
                  "--out-dir", tmp_path / "v", cwd=tmp_path)
    assert p.returncode == 2 and "selective" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "v").exists()


def test_step_ops_get_the_larger_budget():
    """The ops a step's prediction is made of (whole micro-batches, the
    framework's work, the optimizer) are timed 4 x longer than the kernels,
    which stand in only where their module was not measured."""
    from commbench import models, validate
    from commbench.parallel import Parallelism
    from commbench.plan import build
    timing = validate.timing_settings(0.25, 300)
    of = validate.settings_for(timing)
    par = Parallelism(world=4, gpus_per_node=4, tp=2, zero=0, global_batch=8, dtype="fp32")
    ops = build(models.get("tiny-gpt"), par).compute_ops
    by_scope = {}
    for op in ops:
        by_scope.setdefault(op.scope, set()).add(of(op).time_budget_s)
    assert by_scope["stage_module"] == by_scope["tp_stage"] == by_scope["optimizer"] == {1.0}
    assert by_scope["layer_module"] == {0.25} and by_scope["layer"] == {0.25}
    # and are timed for at least the kernels' budget, their CI met or not
    assert {of(op).min_time_s for op in ops if op.scope in validate.STEP_SCOPES} == {0.25}
    assert {of(op).min_time_s for op in ops if op.scope not in validate.STEP_SCOPES} == {0.0}
    assert all(of(op).max_iters == 300 and of(op).target_ci == timing.target_ci for op in ops)


def test_each_round_trains_on_both_sides_of_its_measurements(monkeypatch, tmp_path):
    """A round trains half its steps, times the step ops (first window),
    the kernels, the collectives and their interference, the step ops again
    (second window), then trains the rest; its steps are both halves'."""
    from types import SimpleNamespace

    from commbench import interference, models, plan as plan_mod, results, sweep, training, validate
    from commbench.compute import runner
    from commbench.parallel import Parallelism
    calls = []

    def train(backend, info, workload, model, par, steps, *rest):
        calls.append(("train", steps, rest[-1]))         # rest[-1]: the half's --train-time
        k = sum(c[0] == "train" for c in calls)
        return training.StepTimes(step_s=[float(k)] * steps, rank_step_s=[k + 0.5] * steps, losses=[-k] * steps,
                                  implementation="fake")

    def compute(ops, info, device, timing, path, *a, settings_for=None, **k):
        scopes = {op.scope in validate.STEP_SCOPES for op in ops}
        budget = {settings_for(op).time_budget_s for op in ops} if settings_for else {timing.time_budget_s}
        calls.append(("compute", os.path.basename(path), scopes, budget))
        return results.ResultFile(header=results.make_header(settings={}), measurements=[], path=path)
    monkeypatch.setattr(validate, "train_guarded", train)
    monkeypatch.setattr(runner, "run", compute)
    # the collectives' timing, and ZeRO-1's parameter-broadcast burst's: the step ops'
    monkeypatch.setattr(sweep, "run", lambda config, *a, **k: calls.append(
        ("comm", config.timing.time_budget_s, config.timing_of("broadcast_burst").time_budget_s,
         config.timing_of("broadcast_burst").min_time_s, config.timing_of("all_reduce").min_time_s))
        or ("comm-file", 0))
    monkeypatch.setattr(interference, "run", lambda *a, **k: calls.append(("interference",)) or "inter-file")
    par = Parallelism(world=2, gpus_per_node=2, global_batch=4)
    model = models.get("tiny-gpt")
    workload = plan_mod.build(model, par)
    info, backend = SimpleNamespace(rank=0), SimpleNamespace(control_bcast=lambda x: x)
    r = validate.run_round(backend, info, workload, model, par, "cpu", 5, 1, str(tmp_path / "a"), [], False, None,
                           validate.timing_settings(), "megatron", 0.7)
    steps = ("compute", "compute-steps-before.jsonl", {True}, {1.0})
    assert calls == [("train", 2, 0.7), steps, ("compute", "compute-kernels.jsonl", {False}, {0.5}),
                     ("comm", 0.5, 2.0, 0.5, 0.0), ("interference",),
                     (*steps[:1], "compute-steps-after.jsonl", *steps[2:]), ("train", 3, 0.7)]
    assert r.steps_before == 2
    assert r.compute.header["settings"]["step_op_windows"] == 2 and r.compute.path == str(tmp_path / "a" / "compute.jsonl")
    assert results.load(r.compute.path).header["settings"]["step_op_windows"] == 2
    assert (r.comm, r.interference) == ("comm-file", "inter-file")
    assert r.measured.step_s == [1.0, 1.0, 2.0, 2.0, 2.0] and r.measured.rank_step_s == [1.5] * 2 + [2.5] * 3
    assert r.measured.losses == [-1, -1, -2, -2, -2]
    # one step: it goes after the measurements
    calls.clear()
    r = validate.run_round(backend, info, workload, model, par, "cpu", 1, 1, str(tmp_path / "b"), [], False, None,
                           validate.timing_settings(), "megatron")
    assert calls[0][0] == "compute" and calls[-1] == ("train", 1, 0.0) and r.measured.step_s == [1.0]
    assert r.steps_before == 0
