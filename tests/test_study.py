"""`commbench study`: the three experiments on the shipped specs, with facts that
hold by construction of the model (not numbers copied from its output): weak
scaling efficiency starts at 1 and, for pure DDP on a spec, cannot rise with
the GPU count; ZeRO-3 moves more data-parallel bytes than DDP (three passes of
the parameters per micro-batch against the all-reduce's two); sharding the
optimizer state takes memory off; plans that do not fit stay in the table, marked; --out writes a PNG per
experiment and study.json."""
import json

import pytest

from commbench import cli, study, system

NAMES = {"dp-weak-scaling", "zero-stages", "model-parallel"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *args):
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def doc():
    return study.run(["thetagpu"])


def experiment(doc, name):
    return next(e for e in doc["experiments"] if e["name"] == name)


def test_json_has_the_three_experiments(capsys):
    code, out, err = run(capsys, "study", "--system", "thetagpu", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert {e["name"] for e in d["experiments"]} == NAMES
    assert [s["name"] for s in d["systems"]] == ["thetagpu"]
    for e in d["experiments"]:
        assert e["rows"] and all("error" not in r for r in e["rows"])
        for r in e["rows"]:
            assert r["samples_per_s"] == pytest.approx(r["parallelism"]["global_batch"] / r["step_time_s"], rel=1e-12)


def test_layouts_come_from_the_spec(doc):
    spec = system.load("thetagpu")
    for e in doc["experiments"]:
        assert all(r["parallelism"]["gpus_per_node"] == spec.gpus_per_node for r in e["rows"])


def test_dp_weak_scaling_efficiency(doc):
    rows = sorted(experiment(doc, "dp-weak-scaling")["rows"], key=lambda r: r["gpus"])
    assert [r["gpus"] for r in rows] == list(study.DP_COUNTS)
    assert all(r["parallelism"]["tp"] == r["parallelism"]["pp"] == 1 and r["parallelism"]["zero"] == 0
               for r in rows)                                               # pure DDP
    assert all(r["parallelism"]["num_microbatches"] == 1 for r in rows)    # weak: batch grows with the GPUs
    assert rows[0]["scaling_efficiency"] == 1.0
    # same work per GPU at every count, and on a spec a larger ring all-reduce is never faster:
    # per-GPU throughput cannot rise
    eff = [r["scaling_efficiency"] for r in rows]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(eff, eff[1:]))
    assert all(r["breakdown"]["compute_s"] == pytest.approx(rows[0]["breakdown"]["compute_s"], rel=1e-12)
               for r in rows)


def test_zero_stages_bytes_memory_and_the_plans_that_do_not_fit(doc):
    rows = experiment(doc, "zero-stages")["rows"]
    assert len(rows) == len(study.ZERO_MODELS) * len(study.ZERO_VARIANTS)     # nothing dropped
    by = {(r["model"], r["series"]): r for r in rows}
    for m in study.ZERO_MODELS:
        ddp, z1, z3 = by[(m, "DDP")], by[(m, "ZeRO-1")], by[(m, "ZeRO-3")]
        assert z3["comm_bytes_per_rank"]["dp"] > ddp["comm_bytes_per_rank"]["dp"]
        # ZeRO-1 shards the optimizer state and keeps the rest as DDP has it; ZeRO-3 shards it too
        assert z1["memory_bytes"]["total"] < ddp["memory_bytes"]["total"]
        assert z3["memory_bytes"]["optimizer_state"] < ddp["memory_bytes"]["optimizer_state"]
    unfit = [r for r in rows if not r["fits"]]
    assert unfit, "on 40 GB GPUs the largest model does not fit with DDP"
    for r in rows:
        assert r["fits"] == (r["memory_bytes"]["total"] <= r["usable_bytes"])
        assert r["step_time_s"] > 0                                         # predicted, fitting or not
    assert not by[("gpt3-6.7b", "DDP")]["fits"] and by[("gpt3-6.7b", "ZeRO-3")]["fits"]


def test_model_parallel_plans(doc):
    rows = experiment(doc, "model-parallel")["rows"]
    shapes = {(r["parallelism"]["tp"], r["parallelism"]["pp"], r["parallelism"]["dp"]) for r in rows}
    assert shapes == {(4, 1, 16), (1, 4, 16), (2, 2, 16)}
    for r in rows:
        p, b = r["parallelism"], r["breakdown"]
        assert (b["tp_exposed_s"] > 0) == (p["tp"] > 1)
        assert (b["bubble_s"] > 1e-6 * r["step_time_s"]) == (p["pp"] > 1)


def test_out_writes_pngs_and_study_json(capsys, tmp_path):
    out = tmp_path / "study"
    code, stdout, err = run(capsys, "study", "--system", "thetagpu", "--out", out)
    assert code == 0, err
    for name in NAMES:
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        assert f"{name}.png" in stdout
    d = json.loads((out / "study.json").read_text())
    assert {e["name"] for e in d["experiments"]} == NAMES
    assert "efficiency" in stdout and "does not fit" in stdout


def test_two_systems_side_by_side():
    d = study.run(["thetagpu", "dgx-h100"])
    assert [s["name"] for s in d["systems"]] == ["thetagpu", "dgx-h100"]
    for e in d["experiments"]:
        rows = {(r["system"], r["model"], r["label"], r["series"]) for r in e["rows"]}
        assert {x[0] for x in rows} == {"thetagpu", "dgx-h100"}
        per = {x[1:] for x in rows if x[0] == "thetagpu"}
        assert per == {x[1:] for x in rows if x[0] == "dgx-h100"}        # the same points on each
        assert len(e["rows"]) == 2 * len(per)


@pytest.mark.parametrize("value, word", [("frontier", "'frontier'"), (",", "--system"),
                                         ("thetagpu,thetagpu", "twice")])
def test_bad_system_exits_2_with_one_line(capsys, value, word):
    code, out, err = run(capsys, "study", "--system", value, "--json")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and word in err
