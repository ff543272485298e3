"""`commbench plan` and `commbench run --plan`: the plan's collectives measured
on the plan's real groups, every group of an axis at once."""
import json

from commbench import models, plan as plan_mod, results
from commbench.parallel import Parallelism
from conftest import FAST, clean_env, commbench, mpiexec


def test_plan_json_is_the_workload():
    p = commbench("plan", "--model", "gpt3-13b", "--world", "512", "--gpus-per-node", "4", "--tp", "4",
                  "--pp", "2", "--zero", "1", "--micro-batch", "1", "--global-batch", "1024", "--seq", "2048",
                  "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["model"]["name"] == "gpt3-13b" and doc["parallelism"]["dp"] == 64
    assert doc["parallelism"]["num_microbatches"] == 16
    for op in doc["comm_ops"]:
        assert set(op) >= {"collective", "axis", "group_size", "num_nodes", "nbytes", "count", "phase"}
        assert op["group_size"] == {"dp": 64, "tp": 4, "pp": 2}[op["axis"]] or op["collective"] == "send_recv"
    assert {op["axis"] for op in doc["comm_ops"]} == {"dp", "tp", "pp"}
    # tp stays inside a node of 4, dp spans 64 nodes x ... (ranks tp-strided), pp crosses nodes
    spans = {op["axis"]: op["num_nodes"] for op in doc["comm_ops"] if op["collective"] != "send_recv"}
    assert spans["tp"] == 1 and spans["dp"] == 64
    table = commbench("plan", "--model", "gpt3-13b", "--world", "512", "--gpus-per-node", "4", "--tp", "4",
                      "--pp", "2", "--zero", "1", "--global-batch", "1024")
    assert table.returncode == 0 and "inter-node" in table.stdout and "dp" in table.stdout
    default_seq = commbench("plan", "--model", "gpt3-13b", "--world", "8", "--json")
    assert default_seq.returncode == 0, default_seq.stderr
    assert json.loads(default_seq.stdout)["parallelism"]["seq"] == models.get("gpt3-13b").seq    # not 0


def test_flags_override_a_plan_file_both_ways(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("model: gpt3-1.3b\nworld: 8\ngpus_per_node: 8\ntp: 2\nsp: true\n")
    p = commbench("plan", "--plan", f, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["parallelism"]["sp"] is True
    p = commbench("plan", "--plan", f, "--tp", "1", "--no-sp", "--json")
    assert p.returncode == 0, p.stderr
    par = json.loads(p.stdout)["parallelism"]
    assert (par["tp"], par["sp"]) == (1, False)
    p = commbench("plan", "--plan", f, "--tp", "1")
    assert p.returncode == 2 and "needs tp > 1" in p.stderr


def test_a_bad_plan_exits_2_naming_the_rule():
    p = commbench("plan", "--model", "gpt3-13b", "--world", "16", "--tp", "2", "--pp", "2", "--dp", "3")
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "tp*pp*dp = 12 but world size is 16" in p.stderr
    p = commbench("plan", "--model", "nosuch", "--world", "8")
    assert p.returncode == 2 and "unknown model 'nosuch'" in p.stderr


def test_run_plan_tp2_dp2_on_4_ranks_carries_axes_and_sizes(tmp_path):
    out = tmp_path / "plan.jsonl"
    args = ["run", "--backend", "mpi", "--model", "tiny-gpt", "--tp", "2", "--micro-batch", "2",
            "--global-batch", "4", "-d", "fp32", *FAST, "--out", out]
    p = commbench(*args, launcher=mpiexec(4), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    model, par = models.get("tiny-gpt"), Parallelism(world=4, gpus_per_node=4, tp=2, micro_batch=2, global_batch=4,
                                                       dtype="fp32")
    workload = plan_mod.build(model, par)
    want = {(c.axis, c.collective, c.nbytes) for c in workload.comm_ops}
    got = {(m.case.axis, m.case.op, m.case.nbytes) for m in rf.measurements}
    assert got == want
    for m in rf.measurements:
        assert m.status == "ok" and m.num_wrong == 0
        assert m.case.group_size == 2 and m.case.concurrent_groups == 2   # both groups of the axis at once
        assert m.case.dtype == "float32"
    assert rf.header["settings"]["plan"]["parallelism"]["tp"] == 2


def test_run_plan_refuses_a_plan_of_another_size(tmp_path):
    p = commbench("run", "--nprocs", "2", "--model", "tiny-gpt", "--world", "8", *FAST,
                  "--out", tmp_path / "x.jsonl", cwd=tmp_path)
    assert p.returncode == 2 and "plan is for 8 GPUs but this job has 2 ranks" in p.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_run_plan_isolated_runs_one_group_of_each_axis(tmp_path):
    out = tmp_path / "iso.jsonl"
    p = commbench("run", "--backend", "mpi", "--model", "tiny-gpt", "--dp", "2", "--tp", "2", "-d", "fp32",
                  "--isolated", *FAST, "--out", out, launcher=mpiexec(4), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    assert rf.measurements and all(m.case.concurrent_groups == 1 and m.num_wrong == 0 for m in rf.measurements)
    assert {m.case.axis for m in rf.measurements} == {"dp", "tp"}
    assert rf.header["settings"]["isolated"] is True


def _burst(rf):
    (m,) = [m for m in rf.measurements if m.case.op == "broadcast_burst"]
    return m


def test_run_plan_zero1_measures_its_broadcasts_as_one_burst(tmp_path):
    """ZeroRedundancyOptimizer publishes every parameter with its own async
    broadcast from its owner and waits for all: run --plan times them issued
    together, one piece of one buffer each, checked element by element, and
    predict takes that time for the step's broadcasts."""
    from commbench.commmodel import CommModel
    from commbench.strategies.zero import zero_broadcasts
    out = tmp_path / "z1.jsonl"
    p = commbench("run", "--nprocs", "2", "--model", "tiny-gpt", "--zero", "1", "--global-batch", "4",
                  "-d", "fp32", *FAST, "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    m = _burst(rf)
    model, par = models.get("tiny-gpt"), Parallelism(world=2, gpus_per_node=2, zero=1, global_batch=4, dtype="fp32")
    pieces = zero_broadcasts(model, par)
    assert m.status == "ok" and m.num_wrong == 0 and m.case.backend == "torch-gloo"
    assert m.case.nbytes == sum(b for _, b in pieces) == 4 * model.num_params
    assert m.case.params["broadcasts"] == len(pieces) == 68 and m.case.params["roots"] == [0, 1]
    assert m.case.axis == "dp" and m.case.group_size == 2 and len(m.samples_s) == 5
    est = CommModel.from_results(rf).burst(m.case.nbytes, len(pieces), 2, 1, "fp32")
    assert est.time_s == m.stats["time_p50_s"] and est.source == "measured"
    # one wrong element on the rank that owns the first piece is seen on both ranks
    bad = commbench("run", "--nprocs", "2", "--model", "tiny-gpt", "--zero", "1", "--global-batch", "4",
                    "-d", "fp32", *FAST, "--out", tmp_path / "bad.jsonl", cwd=tmp_path,
                    env=clean_env(COMMBENCH_INJECT_CORRUPTION=str(pieces[0][0])))
    assert bad.returncode != 0
    assert _burst(results.load(str(tmp_path / "bad.jsonl"))).wrong_ranks == [0, 1]


def test_run_plan_bursts_per_pipeline_stage_over_mpi(tmp_path):
    """With pp = 2 each stage's dp groups run their own stage's burst (MPI Ibcast + Waitall)."""
    from commbench.strategies.zero import zero_broadcasts
    out = tmp_path / "z1pp.jsonl"
    p = commbench("run", "--backend", "mpi", "--model", "tiny-gpt", "--zero", "1", "--pp", "2", "--dp", "2",
                  "--global-batch", "8", "-d", "fp32", *FAST, "--out", out, launcher=mpiexec(4), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    model = models.get("tiny-gpt")
    par = Parallelism(world=4, gpus_per_node=4, zero=1, pp=2, dp=2, global_batch=8, dtype="fp32")
    want = sorted((sum(b for _, b in zero_broadcasts(model, par, s)), len(zero_broadcasts(model, par, s)))
                  for s in range(2))
    bursts = [m for m in rf.measurements if m.case.op == "broadcast_burst"]
    assert sorted((m.case.nbytes, m.case.params["broadcasts"]) for m in bursts) == want
    assert all(m.num_wrong == 0 and m.case.concurrent_groups == 1 and m.case.backend == "mpi" for m in bursts)


def test_run_plan_tied_embedding_allreduce_on_first_and_last_stage(tmp_path):
    """With pp = 4 the tied embedding's gradient is all-reduced by the first and
    the last stage only (Megatron's embedding group, as validate trains it): run
    --plan measures it on that pair, and predict finds it measured, where
    before it was timed over the whole pipeline group of 4 and predict could
    not place it."""
    from commbench.commmodel import CommModel
    out = tmp_path / "pp4.jsonl"
    p = commbench("run", "--nprocs", "4", "--model", "tiny-gpt", "--pp", "4", "--global-batch", "8",
                  "-d", "fp32", *FAST, "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    model = models.get("tiny-gpt")
    (m,) = [m for m in rf.measurements if m.case.op == "all_reduce"]
    assert m.status == "ok" and m.num_wrong == 0
    assert (m.case.axis, m.case.group_size, m.case.concurrent_groups) == ("pp", 2, 1)
    assert m.case.nbytes == model.vocab * model.hidden * 4
    est = CommModel.from_results(rf).estimate("all_reduce", m.case.nbytes, 2, 1, dtype="fp32")
    assert est.source == "measured" and est.time_s == m.stats["time_p50_s"]
    # the adjacent stages' p2p still runs on pairs (0, 1) and (2, 3)
    (s,) = {m.case.concurrent_groups for m in rf.measurements if m.case.op.startswith("send_recv")}
    assert s == 2
