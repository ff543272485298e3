"""Bad input to every verb (#7): exit 2, exactly one line on stderr, no
traceback, nothing on stdout, and no file written or overwritten. Run in
process (cli.main) from an empty working directory: these all fail before any
rank starts, and a fresh Python per case would cost this table minutes.
tests/test_cli_errors.py runs a first set as real subprocesses."""
import json
import os

import pytest

from commbench import cli
from commbench.results import Case, Measurement, make_header
from conftest import commbench, mpiexec

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "nccl-tests")
PLAN = ["--model", "tiny-gpt", "--world", "2", "--gpus-per-node", "2", "--global-batch", "4", "--dtype", "fp32"]
SPEC_PLAN = ["--model", "tiny-gpt", "--world", "4", "--global-batch", "4", "--dtype", "fp32"]   # a polaris node


def _results(d, name="r.jsonl"):
    (d / name).write_text(json.dumps(make_header(run_id="x", settings={})) + "\n")


def _file(name, text):
    return lambda d: (d / name).write_text(text)


def _existing(d):
    (d / "existing.jsonl").write_text("precious\n")


def _bad_measurement(field, value, header_field=None):
    """r.jsonl with a good header and one measurement whose `field` (of the case
    with a 'case.' prefix) is value; or, with header_field, a bad header field."""
    def write(d):
        m = Measurement(case=Case("collective", "all_reduce", "torch-gloo", "cpu", "float32", 64, 2, 1, "world",
                                  False), samples_s=[1e-5, 2e-5]).to_dict()
        if field.startswith("case."):
            m["case"][field[5:]] = value
        elif field:
            m[field] = value
        header = make_header(run_id="x", settings={})
        if header_field:
            header[header_field] = value
        (d / "bad.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(m) + "\n")
    return write


def _both(*fs):
    return lambda d: [f(d) for f in fs]


# id: (argv, setup(dir) or None, text the line must contain)
CASES = {
    # timeouts of the other multi-rank verbs
    "compute-timeout-0": (["compute", *PLAN, "--timeout", "0"], None, "--timeout"),
    "compute-timeout-inf": (["compute", *PLAN, "--timeout", "inf"], None, "--timeout"),
    "validate-timeout-negative": (["validate", "--model", "tiny-gpt", "--timeout", "-1"], None, "--timeout"),
    "interference-timeout-0": (["compute", "--interference", "--timeout", "0"], None, "--timeout"),
    # run
    "run-timeout-0": (["run", "--device", "cpu", "--timeout", "0"], None, "--timeout"),
    "run-timeout-negative": (["run", "--device", "cpu", "--timeout", "-5"], None, "--timeout"),
    "run-timeout-text": (["run", "--timeout", "soon"], None, "'soon'"),
    "run-timeout-nan": (["run", "--device", "cpu", "--timeout", "nan"], None, "--timeout"),
    "run-resume-missing": (["run", "--device", "cpu", "--resume", "gone.jsonl"], None, "gone.jsonl"),
    "run-resume-not-results": (["run", "--device", "cpu", "--resume", "n.txt"], _file("n.txt", "hello\n"), "n.txt"),
    "run-resume-and-force": (["run", "--device", "cpu", "--resume", "r.jsonl", "--force"], _results, "--force"),
    "run-resume-other-out": (["run", "--device", "cpu", "--resume", "r.jsonl", "--out", "o.jsonl"], _results,
                             "--out"),
    "run-resume-other-settings": (["run", "--device", "cpu", "--resume", "r.jsonl"], _results, "settings"),
    "run-too-big": (["run", "--device", "cpu", "--nprocs", "2", "-b", "2T", "-e", "4T"], None, "GiB"),
    "run-huge-size": (["run", "--device", "cpu", "-e", "99999999999999999999999T"], None, "memory"),
    "run-root-negative": (["run", "--device", "cpu", "-r", "-1"], None, "root"),
    "run-time-budget-negative": (["run", "--device", "cpu", "--time-budget", "-1"], None, "time-budget"),
    "run-dist-backend": (["run", "--device", "cpu", "--dist-backend", "tcp"], None, "'tcp'"),
    "run-stepbytes-garbage": (["run", "--device", "cpu", "-i", "x1"], None, "'x1'"),
    "run-out-exists": (["run", "--device", "cpu", "--out", "existing.jsonl"], _existing, "existing.jsonl"),
    "run-plan-with-collective": (["run", "--device", "cpu", "--model", "tiny-gpt", "--collective", "all_gather"],
                                 None, "with a plan, run measures the plan's own"),
    "run-plan-missing-file": (["run", "--device", "cpu", "--plan", "nope.yaml"], None, "nope.yaml"),
    "run-plan-world-mismatch": (["run", "--device", "cpu", "--nprocs", "2", "--model", "tiny-gpt", "--world", "4",
                                 "--global-batch", "4"], None, "4"),
    # show
    "show-directory": (["show", "."], None, "."),
    "show-header-not-object": (["show", "a.jsonl"], _file("a.jsonl", "[1, 2]\n"), "header"),
    "show-bad-measurement": (["show", "b.jsonl"],
                             _file("b.jsonl", json.dumps(make_header(run_id="x")) + '\n{"case": 5}\n{}\n'), "line 2"),
    "show-schema-string": (["show", "s.jsonl"],
                           _file("s.jsonl", json.dumps(dict(make_header(run_id="x"), schema_version="1")) + "\n"),
                           "schema"),
    # models / plan
    "models-extra-arg": (["models", "--all"], None, "--all"),
    "plan-no-model": (["plan", "--world", "2"], None, "model"),
    "plan-unknown-model": (["plan", "--model", "gpt5", "--world", "8"], None, "'gpt5'"),
    "plan-tp-not-dividing": (["plan", "--model", "gpt3-1.3b", "--world", "8", "--tp", "3"], None, "3"),
    "plan-negative-world": (["plan", "--model", "gpt3-1.3b", "--world", "-8"], None, "-8"),
    "plan-zero-5": (["plan", "--model", "gpt3-1.3b", "--world", "8", "--zero", "5"], None, "5"),
    "plan-bad-dtype": (["plan", "--model", "gpt3-1.3b", "--world", "8", "--dtype", "fp7"], None, "fp7"),
    "plan-file-not-mapping": (["plan", "--plan", "p.json"], _file("p.json", "[1, 2]"), "p.json"),
    "plan-file-bad-yaml": (["plan", "--plan", "p.yaml"], _file("p.yaml", "a: [1, 2\n"), "p.yaml"),
    "plan-file-unknown-field": (["plan", "--plan", "p.json"], _file("p.json", '{"model": "tiny-gpt", "wrld": 2}'),
                                "wrld"),
    "plan-file-inline-model-bad": (["plan", "--plan", "p.json"],
                                   _file("p.json", '{"model": {"num_layers": 2, "hidden": 30, "heads": 4, "vocab": 8, '
                                                   '"seq": 8}, "world": 2}'),
                                   "model 'plan-model': hidden 30 is not divisible by heads 4"),
    "plan-file-model-number": (["plan", "--plan", "p.json"], _file("p.json", '{"model": 7, "world": 2}'), "model"),
    "plan-model-file-bad-field": (["plan", "--model", "m.json", "--world", "2"],
                                  _file("m.json", '{"arch": "gpt", "layerz": 2}'), "layerz"),
    # compute
    "compute-iters-0": (["compute", *PLAN, "-n", "0", "--device", "cpu"], None, "-n"),
    "compute-device": (["compute", *PLAN, "--device", "tpu"], None, "'tpu'"),
    "compute-out-exists": (["compute", *PLAN, "--device", "cpu", "--nprocs", "2", "--out", "existing.jsonl"],
                           _existing, "existing.jsonl"),
    "compute-nprocs-0": (["compute", *PLAN, "--device", "cpu", "--nprocs", "0"], None, "nprocs"),
    # predict
    "predict-no-times": (["predict", *PLAN], None, "--comm"),
    "predict-unknown-system": (["predict", *PLAN, "--system", "summit9"], None, "summit9"),
    "predict-comm-missing": (["predict", *PLAN, "--comm", "c.jsonl", "--compute", "d.jsonl"], None, "c.jsonl"),
    "predict-bad-scale": (["predict", *SPEC_PLAN, "--system", "polaris", "--scale", "8,x"], None, "x"),
    "predict-peak-negative": (["predict", *SPEC_PLAN, "--system", "polaris", "--peak-tflops", "-1"], None, "-1"),
    "predict-plot-without-scale": (["predict", *SPEC_PLAN, "--system", "polaris", "--plot", "p.png"], None, "--scale"),
    "predict-empty-scale": (["predict", *SPEC_PLAN, "--system", "polaris", "--scale", ""], None, "empty value for scale"),
    "predict-plot-no-such-dir": (["predict", *SPEC_PLAN, "--system", "polaris", "--scale", "2,4", "--plot", "no/p.png"],
                                 None, "no/p.png"),
    "predict-node-contradicts-spec": (["predict", *PLAN, "--system", "polaris"], None,
                                      "--gpus-per-node 2 contradicts SystemSpec polaris (4 GPUs per node)"),
    "search-node-contradicts-spec": (["search", "--model", "tiny-gpt", "--world", "8", "--gpus-per-node", "8",
                                      "--system", "polaris"], None, "--gpus-per-node 8 contradicts"),
    "predict-peak-inf": (["predict", *SPEC_PLAN, "--system", "polaris", "--peak-tflops", "inf"], None, "--peak-tflops"),
    "predict-bucket-inf": (["predict", *SPEC_PLAN, "--system", "polaris", "--bucket-mb", "inf"], None, "bucket-mb"),
    "predict-bucket-nan": (["predict", *SPEC_PLAN, "--system", "polaris", "--bucket-mb", "nan"], None, "bucket-mb"),
    "plan-interleave-without-pp": (["plan", *PLAN, "--interleave", "2"], None, "pipeline parallelism"),
    "search-negative-world": (["search", "--model", "tiny-gpt", "--world", "-8", "--system", "polaris"], None,
                              "world"),
    "predict-system-file-bad": (["predict", *PLAN, "--system", "s.json"], _file("s.json", '{"name": 1}'), "s.json"),
    # validate
    "validate-steps-0": (["validate", *PLAN, "--steps", "0"], None, "--steps"),
    "validate-device": (["validate", *PLAN, "--device", "gpu"], None, "'gpu'"),
    "validate-nprocs-negative": (["validate", *PLAN, "--nprocs", "-2"], None, "nprocs"),
    "validate-rounds-0": (["validate", *PLAN, "--rounds", "0"], None, "--rounds"),
    "validate-rounds-over-steps": (["validate", *PLAN, "--steps", "3", "--rounds", "4"], None, "--rounds"),
    "validate-train-time-negative": (["validate", *PLAN, "--train-time", "-1"], None, "--train-time"),
    "validate-time-budget-negative": (["validate", *PLAN, "--time-budget", "-1"], None, "--time-budget"),
    "validate-max-iters-below-iters": (["validate", *PLAN, "--max-iters", "5"], None, "--max-iters"),
    # search / study
    "search-no-times": (["search", "--model", "gpt3-1.3b", "--world", "8"], None, "--system"),
    "search-top-0": (["search", "--model", "gpt3-1.3b", "--world", "8", "--system", "polaris", "--top", "0"], None,
                     "--top"),
    "search-micro-batches": (["search", "--model", "gpt3-1.3b", "--world", "8", "--system", "polaris",
                              "--micro-batches", "1,a"], None, "1,a"),
    "study-unknown-system": (["study", "--system", "nowhere"], None, "nowhere"),
    # compare / check / baseline / import / report
    "compare-missing-file": (["compare", "a.jsonl", "b.jsonl"], None, "a.jsonl"),
    "compare-factor-text": (["compare", "a.jsonl", "b.jsonl", "--factor", "big"], None, "'big'"),
    "check-missing-baseline": (["check", "--baseline", "base.jsonl", "new.jsonl"], None, "base.jsonl"),
    "check-no-new": (["check", "--baseline", "base.jsonl"], None, "new"),
    "baseline-missing-result": (["baseline", "promote", "gone.jsonl", "name"], None, "gone.jsonl"),
    "import-missing-log": (["import", "nccl-tests", "gone.log"], None, "gone.log"),
    "import-not-a-log": (["import", "nccl-tests", "x.log", "--op", "all_reduce"], _file("x.log", "hello\n"), "x.log"),
    "import-unknown-format": (["import", "osu", "x.log"], None, "'osu'"),
    "report-missing-input": (["report", "gone.jsonl", "--out", "rep"], None, "gone.jsonl"),
    "report-no-out": (["report", "r.jsonl"], _results, "--out"),
    # env / emulate / top level
    "env-device": (["env", "--device", "fpga"], None, "'fpga'"),
    "emulate-no-command": (["emulate", "--nodes", "2", "--inter-bw", "1gbit"], None, "command"),
    "unknown-flag": (["run", "--colective", "all"], None, "--colective"),
    # outputs besides results files are never replaced, and are checked before any work
    "check-summary-exists": (["check", "--baseline", "r.jsonl", "r.jsonl", "--summary", "existing.jsonl"],
                             _both(_results, _existing), "existing.jsonl"),
    "study-out-exists": (["study", "--system", "h200", "--out", "."], _file("study.json", "mine\n"), "study.json"),
    "compare-plot-exists": (["compare", "r.jsonl", "r.jsonl", "--plot", "p.png"], _both(_results, _file("p.png", "x")),
                            "p.png"),
    "compare-plot-no-extension": (["compare", "r.jsonl", "r.jsonl", "--plot", "p"], _results, "--plot"),
    "predict-plot-exists": (["predict", *SPEC_PLAN, "--system", "polaris", "--scale", "2,4", "--plot", "p.png"],
                            _file("p.png", "x"), "p.png"),
    "predict-strong-without-scale": (["predict", *SPEC_PLAN, "--system", "polaris", "--strong"], None, "--scale"),
    # results files of the wrong shape
    "show-params-null": (["show", "bad.jsonl"], _bad_measurement("case.params", None), "line 2"),
    "show-stats-null": (["show", "bad.jsonl"], _bad_measurement("stats", None), "line 2"),
    "compare-samples-text": (["compare", "bad.jsonl", "bad.jsonl"], _bad_measurement("samples_s", "abc"), "line 2"),
    "show-line-not-object": (["show", "r.jsonl"], lambda d: (_results(d), (d / "r.jsonl").open("a").write(
        '"hello"\n')), "line 2"),
    "show-header-cluster-text": (["show", "bad.jsonl"], _bad_measurement("", None, "cluster"), "cluster"),
    "report-validate-time-text": (["report", "v.json", "--out", "rep"],
                                  _file("v.json", json.dumps({"measured_step_time_s": "fast",
                                                              "predicted_step_time_s": 1.0, "error_pct": 0.0,
                                                              "prediction": {}})), "measured_step_time_s"),
    # numbers the protocol cannot run with
    "run-stepfactor-inf": (["run", "--device", "cpu", "-f", "inf"], None, "stepfactor"),
    "run-stepfactor-and-bytes": (["run", "--device", "cpu", "-f", "2", "-i", "8"], None, "not both"),
    "run-time-budget-nan": (["run", "--device", "cpu", "--time-budget", "nan"], None, "time-budget"),
    "run-timeout-inf": (["run", "--device", "cpu", "--timeout", "inf"], None, "--timeout"),
    "compute-target-ci-2": (["compute", *PLAN, "--target-ci", "2"], None, "target-ci"),
    "run-out-empty": (["run", "--device", "cpu", "--out", ""], None, "an empty value for out"),
    "run-plan-field-without-model": (["run", "--device", "cpu", "--tp", "2"], None, "--tp"),
    "run-nccl-on-cpu": (["run", "--device", "cpu", "--dist-backend", "nccl"], None, "nccl"),
    "plan-world-huge": (["plan", "--model", "tiny-gpt", "--world", "99999999999999999999"], None, "world"),
    "run-nprocs-huge": (["run", "--device", "cpu", "--nprocs", "100000", "-b", "8", "-e", "8"], None, "--nprocs"),
    "compute-nprocs-negative": (["compute", "--model", "tiny-gpt", "--nprocs", "-3"], None, "--nprocs"),
    # where the output cannot go
    "run-out-under-a-file": (["run", "--device", "cpu", "--out", "existing.jsonl/x.jsonl", "--force", "-b", "8",
                              "-e", "8", "--nprocs", "1"], _existing, "is a file, not a folder"),
    "import-out-is-a-folder": (["import", "nccl-tests", os.path.join(FIXTURES, "all_gather_perf-v2.0.log"), "--out",
                                "sub", "--force"], lambda d: (d / "sub").mkdir(), "folder"),
    "validate-out-dir-is-a-file": (["validate", "--model", "tiny-gpt", "--nprocs", "2", "--out-dir",
                                    "existing.jsonl"], _existing, "not a folder"),
    "baseline-dir-is-a-file": (["baseline", "promote", "bad.jsonl", "ok", "--dir", "existing.jsonl"],
                               _both(_bad_measurement("", None), _existing), "not a folder"),
    "baseline-target-is-a-folder": (["baseline", "promote", "bad.jsonl", "ok", "--dir", "bl", "--force"],
                                    _both(_bad_measurement("", None),
                                          lambda d: (d / "bl" / "ok.jsonl").mkdir(parents=True)),
                                    "is a folder"),
    # compare: inputs that leave nothing to compare
    "compare-compute-missing": (["compare", "r.jsonl", "r.jsonl", "--compute", "gone1", "gone2"], _results, "gone1"),
    "compare-nothing-common": (["compare", "r.jsonl", "bad.jsonl"], _both(_results, _bad_measurement("", None)),
                               "nothing to compare"),
    "check-factor-inf": (["check", "--baseline", "r.jsonl", "r.jsonl", "--factor", "inf"], _results, "--factor"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, tmp_path, monkeypatch, capsys):
    argv, setup, needle = CASES[name]
    for k in [k for k in os.environ if k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_", "OMPI_", "SLURM_",
                                                     "MASTER_", "PMIX_", "TORCHELASTIC", "COMMBENCH_"))]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    if setup:
        setup(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    dirs_before = sorted(p.name for p in tmp_path.iterdir())
    code = cli.main(argv)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("commbench") and needle in lines[0], lines[0]
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == dirs_before
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_the_table_is_big_enough():
    assert len(CASES) >= 50


def test_bad_flags_under_mpiexec_say_it_once(tmp_path):
    """Every rank of a launched job reads the same bad flag: rank 0 says it,
    every rank exits 2."""
    p = commbench("run", "--backend", "mpi", "--collective", "all_reduce", "-b", "1X", launcher=mpiexec(2),
                  cwd=tmp_path)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and lines == [lines[0]] and "bad size '1X'" in lines[0], p.stderr


def test_a_root_outside_every_group_exits_2_writing_nothing(tmp_path):
    p = commbench("run", "--nprocs", "2", "-r", "5", "--collective", "broadcast", "-b", "8", "-e", "64",
                  "--out", tmp_path / "r.jsonl", cwd=tmp_path)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "-r/--root 5 is outside every group (the largest has 2 ranks)" in lines[0]
    assert not (tmp_path / "r.jsonl").exists()
