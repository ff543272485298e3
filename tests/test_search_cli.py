"""`commbench search`: every returned plan is a valid Parallelism that fits,
ranked by the step time `commbench predict` gives for it; the counts account
for every candidate; the memory filter can drop everything (exit 0, no plans,
the counts say why); measured results files rank the plans they cover and
count the others as unestimated with the reason; bad input exits 2 with one line."""
import dataclasses
import json
import math

import pytest

from commbench import cli, models, stats
from commbench import plan as plan_mod
from commbench.parallel import Parallelism
from commbench.results import Case, Measurement, ResultWriter, make_header
from conftest import commbench

SMALL = ["--model", "gpt3-125m", "--world", "16", "--global-batch", "64", "--seq", "1024"]


def run(capsys, *args):
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def search_json(capsys, *args):
    code, out, err = run(capsys, "search", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def parallelism(d: dict) -> Parallelism:
    fields = {f.name for f in dataclasses.fields(Parallelism)}
    return Parallelism(**{k: v for k, v in d.items() if k in fields})


def predict_flags(par: Parallelism) -> list:
    return ["--world", par.world, "--gpus-per-node", par.gpus_per_node, "--tp", par.tp, "--pp", par.pp,
            "--dp", par.dp, "--zero", par.zero, "--micro-batch", par.micro_batch, "--global-batch",
            par.global_batch, "--seq", par.seq, "--dtype", par.dtype, "--interleave", par.interleave,
            "--schedule", par.schedule, "--recompute", par.recompute, *(["--sp"] if par.sp else [])]


def check_counts(doc: dict, top: int):
    c = doc["counts"]
    assert c["enumerated"] == c["invalid"] + c["too_big"] + c["unestimated"] + c["ranked"]
    assert c["valid"] == c["enumerated"] - c["invalid"]
    assert c["returned"] == len(doc["plans"]) == min(top, c["ranked"])
    assert sum(doc["invalid_reasons"].values()) == c["invalid"]
    assert sum(doc["unestimated_reasons"].values()) == c["unestimated"]


def test_search_on_a_spec_ranks_valid_fitting_plans_by_predicted_step_time(capsys):
    doc = search_json(capsys, *SMALL, "--system", "dgx-h100", "--top", "8")
    check_counts(doc, 8)
    assert doc["counts"]["ranked"] > 8 and doc["gpus_per_node"] == 8          # the spec's layout
    assert doc["gpu_memory_bytes"] == 80e9                                   # the spec's gpu_memory_gb
    model = models.get("gpt3-125m")
    times = [p["step_time_s"] for p in doc["plans"]]
    assert times == sorted(times)
    for p in doc["plans"]:
        par = parallelism(p["parallelism"])
        par.check_model(model)
        assert (par.world, par.global_batch, par.seq) == (16, 64, 1024)
        assert p["memory_bytes"]["total"] <= doc["usable_bytes"]
        assert p["samples_per_s"] == pytest.approx(64 / p["step_time_s"], rel=1e-12)
        assert p["tokens_per_s"] == pytest.approx(64 * 1024 / p["step_time_s"], rel=1e-12)
        assert p["mfu"] == pytest.approx(p["tflops_per_gpu"] / 989, rel=1e-12)   # H100 bf16 dense peak
        parts = [p["breakdown"][k] for k in ("compute_s", "tp_exposed_s", "pp_exposed_s", "dp_exposed_s",
                                             "bubble_s", "optimizer_s")]
        assert math.fsum(parts) == pytest.approx(p["step_time_s"], rel=1e-9)
    # the ranking is the real predictor's: `commbench predict` gives the best and the
    # last returned plan exactly the step time the search ranked them by
    for p in (doc["plans"][0], doc["plans"][-1]):
        par = parallelism(p["parallelism"])
        code, out, err = run(capsys, "predict", "--model", "gpt3-125m", *predict_flags(par), "--system", "dgx-h100",
                             "--json")
        assert code == 0, err
        assert json.loads(out)["step_time_s"] == p["step_time_s"]


def test_the_default_global_batch_is_the_world_and_the_table_prints(capsys):
    doc = search_json(capsys, "--model", "gpt3-125m", "--world", "8", "--system", "thetagpu", "--top", "3")
    assert doc["global_batch"] == 8
    code, out, _ = run(capsys, "search", "--model", "gpt3-125m", "--world", "8", "--system", "thetagpu", "--top", "3")
    assert code == 0
    assert "best 3 of" in out and "enumerated" in out and "samples/s" in out and "MFU" in out


def test_a_tiny_gpu_drops_every_plan_and_says_so(capsys):
    doc = search_json(capsys, *SMALL, "--system", "dgx-h100", "--gpu-memory-gb", "0.01")
    check_counts(doc, 10)
    c = doc["counts"]
    assert doc["plans"] == [] and c["ranked"] == 0 and c["too_big"] == c["valid"] > 0
    assert doc["gpu_memory_bytes"] == pytest.approx(0.01e9)
    small = doc["smallest_too_big"]
    assert small["memory_bytes"]["total"] > doc["usable_bytes"] and "GB usable" in small["reason"]
    code, out, _ = run(capsys, "search", *SMALL, "--system", "dgx-h100", "--gpu-memory-gb", "0.01")
    assert code == 0 and "no plan to rank" in out and "smallest plan that does not fit" in out


# --- measured results files ------------------------------------------------------------
SIZES = [1 << k for k in range(10, 27, 2)]


def _collective(op, nbytes, n):
    t = 5e-6 * 2 * (n - 1) + nbytes * 2 * (n - 1) / n / 50e9       # an alpha-beta law, intra-node
    samples = [t * (1 + 0.01 * k) for k in range(-5, 6)]
    case = Case(kind="collective", op=op, backend="torch-nccl", device="cuda", dtype="bfloat16", nbytes=nbytes,
                group_size=n, num_nodes=1, axis="world", in_place=False, concurrent_groups=1)
    return Measurement(case=case, samples_s=samples, stats=stats.summarize(samples))


def _compute(op):
    from commbench.compute.runner import case_of
    t = 1e-6 + op.flops / 100e12 + op.nbytes / 1e12               # any positive time per kernel
    samples = [t * (1 + 0.01 * k) for k in range(-5, 6)]
    return Measurement(case=case_of(op, "cuda", "torch", 1), samples_s=samples, stats=stats.summarize(samples))


def _write(path, measurements):
    w = ResultWriter(str(path), make_header(run_id="synthetic"))
    for m in measurements:
        w.append(m)
    w.close()
    return str(path)


MEASURED = Parallelism(world=4, gpus_per_node=4, micro_batch=2, global_batch=8)    # DDP, dp 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("measured")
    comm = _write(d / "comm.jsonl", [_collective(op, s, n) for op in ("all_reduce", "all_gather") for n in (2, 4)
                                     for s in SIZES])
    ops = plan_mod.build(models.get("small-gpt"), MEASURED).compute_ops
    seen, ms = set(), []
    for op in ops:
        m = _compute(op)
        if m.case.key() not in seen:
            seen.add(m.case.key())
            ms.append(m)
    return comm, _write(d / "compute.jsonl", ms)


def test_search_with_measured_files_ranks_the_measured_shapes(capsys, files):
    comm, compute = files
    args = ["--model", "small-gpt", "--world", "4", "--gpus-per-node", "4", "--global-batch", "8",
            "--micro-batches", "1,2", "--comm", comm, "--compute", compute, "--gpu-memory-gb", "80", "--top", "50"]
    doc = search_json(capsys, *args)
    check_counts(doc, 50)
    assert doc["system"] is None and doc["peak_tflops"] is None
    ranked = [parallelism(p["parallelism"]) for p in doc["plans"]]
    # the kernels measured are those of tp 1 and micro-batch 2 (tp and the micro-batch set the
    # shapes); plans of other stages, pipelines, recompute and ZeRO stages run the same kernels
    # (Adam is scaled to the shard), every other tp or micro-batch has no kernel times
    assert MEASURED in ranked
    assert {(p.tp, p.micro_batch) for p in ranked} == {(1, 2)}
    assert {p.zero for p in ranked} == {0, 1, 2, 3} and {p.pp for p in ranked} == {1, 2, 4}
    assert doc["counts"]["unestimated"] > 0
    assert all("no compute measurement" in r for r in doc["unestimated_reasons"])
    assert all(p["mfu"] is None for p in doc["plans"])                  # no peak without a spec
    # the same prediction `commbench predict` makes from the same files
    best = doc["plans"][0]
    par = parallelism(best["parallelism"])
    code, out, err = run(capsys, "predict", "--model", "small-gpt", *predict_flags(par), "--comm", comm,
                         "--compute", compute, "--json")
    assert code == 0, err
    pred = json.loads(out)
    assert (pred["step_time_s"], pred["step_time_low_s"], pred["step_time_high_s"]) == \
        (best["step_time_s"], best["step_time_low_s"], best["step_time_high_s"])


# --- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--model", "gpt-nosuch", "--world", "8", "--system", "thetagpu"], ["'gpt-nosuch'"]),
    (["--model", "gpt3-125m", "--world", "8", "--system", "frontier"], ["'frontier'"]),
    (["--model", "gpt3-125m", "--world", "8", "--system", "thetagpu", "--top", "0"], ["--top", "0"]),
    (["--model", "gpt3-125m", "--world", "8"], ["--system", "--comm"]),
    (["--model", "gpt3-125m", "--world", "8", "--comm", "c.jsonl", "--compute", "k.jsonl"], ["--gpus-per-node"]),
    (["--model", "gpt3-125m", "--world", "8", "--comm", "c.jsonl", "--compute", "k.jsonl", "--gpus-per-node", "8"],
     ["--gpu-memory-gb"]),
    (["--model", "gpt3-125m", "--world", "8", "--system", "thetagpu", "--gpu-memory-gb", "-1"],
     ["--gpu-memory-gb", "-1"]),
    (["--model", "gpt3-125m", "--world", "8", "--system", "thetagpu", "--micro-batches", "1,x"], ["'1,x'"]),
    (["--model", "gpt3-125m", "--world", "12", "--system", "thetagpu"], ["12", "nodes"]),
    # no plan at all is valid: bad input, not an empty answer
    (["--model", "gpt3-125m", "--world", "8", "--system", "thetagpu", "--seq", "4096"],
     ["no valid plan of gpt3-125m on 8 GPUs", "seq 4096 is longer than the 2048 learned positions"]),
    (["--model", "gpt3-125m", "--world", "8", "--system", "thetagpu", "--json", "--seq", "4096"], ["no valid plan"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, words):
    code, out, err = run(capsys, "search", *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for w in words:
        assert w in err, err


def test_bad_input_from_the_real_command_line():
    p = commbench("search", "--model", "gpt3-125m", "--world", "8", "--system", "thetagpu", "--top", "0", timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["commbench: error: --top must be a positive integer, got 0"]
