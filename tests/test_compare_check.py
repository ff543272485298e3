"""compare, check and baseline promote: verdicts on synthetic results files with
known raw samples (same, 2x slower, a significant 3 % that the factor calls the
same, one-sample untested), the exit codes 0/1/2, the environment differences
and the CI summary, then check on two real quick sweeps of this machine and a
crafted 3x-slower copy."""
import json

import numpy as np
import pytest

from commbench import compare, results, stats, verdicts
from commbench.results import Case, Measurement, ResultWriter, make_header
from commbench.cli import main
from conftest import commbench

SIZES = (1024, 4096, 65536)


def meas(op, nbytes, samples, redop="sum", backend="torch-gloo"):
    case = Case(kind="collective", op=op, backend=backend, device="cpu", dtype="float32", nbytes=nbytes,
                group_size=2, num_nodes=1, axis="world", in_place=op == "all_reduce",
                params={"redop": redop, "count": nbytes // 4, "world_size": 2} if redop else {"count": nbytes // 8})
    s = stats.summarize(samples)
    return Measurement(case=case, samples_s=list(map(float, samples)), stats=s,
                       algbw_gbps=nbytes / s["time_p50_s"] / 1e9, busbw_gbps=nbytes / s["time_p50_s"] / 1e9)


def write(path, measurements, host="nodeA", **header):
    fields = dict(run_id=str(path), commbench_version="0.1.0", cluster={"hosts": [host], "num_ranks": 2},
                  versions={"torch": "2.13.0"}, env={"NCCL_ALGO": "Ring"}, command_line=["commbench", "run"])
    h = make_header(**{**fields, **header})
    w = ResultWriter(str(path), h)
    for m in measurements:
        w.append(m)
    w.close()
    return str(path)


def system(path, scale=1.0, seed=0, n=200, spread=0.05, host="nodeA", **header):
    """all_reduce and all_gather at SIZES; times lognormal around 1e-4 * scale."""
    rng = np.random.default_rng(seed)
    ms = []
    for op in ("all_reduce", "all_gather"):
        for nb in SIZES:
            base = 1e-4 * (1 + nb / 65536)
            ms.append(meas(op, nb, base * scale * rng.lognormal(0, spread, n), redop="sum" if op == "all_reduce"
                           else None))
    return write(path, ms, host=host, **header)


class Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cb(capsys):
    """commbench's CLI in this process (the synthetic tests need no subprocess)."""
    def call(*args):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out = capsys.readouterr()
        return Run(rc, out.out, out.err)
    return call


def verdict_set(a, b, factor=1.05):
    pair = verdicts.compare_pair(results.load(a), results.load(b), factor)
    return pair, {r.verdict for r in pair.rows}


def test_equal_distributions_are_the_same(tmp_path):
    pair, v = verdict_set(system(tmp_path / "a.jsonl", seed=1), system(tmp_path / "b.jsonl", seed=2))
    assert len(pair.rows) == 6 and v == {"same"}
    assert all(abs(r.ratio - 1) < 0.05 for r in pair.rows)


def test_twice_slower_is_slower_with_ratio_2(tmp_path):
    pair, v = verdict_set(system(tmp_path / "a.jsonl", seed=1), system(tmp_path / "b.jsonl", 2.0, seed=2))
    assert v == {"slower"}
    assert all(abs(r.ratio - 2) < 0.05 and r.p_adjusted < 1e-10 for r in pair.rows)
    gm = verdicts.geomean_by_op(pair.rows)
    assert set(gm) == {"all_reduce", "all_gather"} and all(abs(g - 2) < 0.05 and n == 3 for g, n in gm.values())
    # and the other way round: faster
    _, v = verdict_set(system(tmp_path / "c.jsonl", 2.0, seed=3), system(tmp_path / "d.jsonl", seed=4))
    assert v == {"faster"}


def test_the_ratio_comes_from_the_raw_samples_not_the_stored_stats(tmp_path):
    # a file whose samples are twice as slow but whose stored statistics were left as
    # they were: the verdict follows the samples (the statistics are derived from them)
    a = system(tmp_path / "a.jsonl", seed=1)
    rf = results.load(system(tmp_path / "b.jsonl", seed=2))
    for m in rf.measurements:
        m.samples_s = [2 * x for x in m.samples_s]
    b = write(tmp_path / "stale.jsonl", rf.measurements)
    pair, v = verdict_set(a, b)
    assert v == {"slower"} and all(abs(r.ratio - 2) < 0.1 for r in pair.rows)


def test_significant_3_percent_is_the_same_because_of_the_factor(tmp_path):
    a = system(tmp_path / "a.jsonl", seed=1, n=400, spread=0.005)
    b = system(tmp_path / "b.jsonl", 1.03, seed=2, n=400, spread=0.005)
    pair, v = verdict_set(a, b)
    assert all(r.p_adjusted < 1e-6 and 1.02 < r.ratio < 1.04 for r in pair.rows)   # significant...
    assert v == {"same"}                                                           # ...but within 5 %
    _, v = verdict_set(a, b, factor=1.01)
    assert v == {"slower"}


def test_holm_adjustment():
    assert verdicts.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert verdicts.holm([]) == []


def test_one_sample_is_untested_and_join_ignores_backend(cb, tmp_path):
    a = write(tmp_path / "a.jsonl", [meas("all_reduce", 1024, [1e-4] * 30)])
    b = write(tmp_path / "b.jsonl", [meas("all_reduce", 1024, [5e-4], backend="nccl-tests")])
    pair, v = verdict_set(a, b)
    assert v == {"untested"} and pair.rows[0].ratio == pytest.approx(5) and not pair.with_backend
    # one sample cannot be tested: the factor alone fails it (an imported nccl-tests baseline must gate)
    r = cb("check", "--baseline", a, b)
    assert r.returncode == 1 and "untested 1 (of which beyond the factor 1)" in r.stdout
    assert r.stdout.startswith("## commbench check: REGRESSION") and "backend/device" in r.stdout
    close = write(tmp_path / "c.jsonl", [meas("all_reduce", 1024, [1.02e-4], backend="nccl-tests")])
    r = cb("check", "--baseline", a, close)
    assert r.returncode == 0 and "untested 1 (of which beyond the factor 0)" in r.stdout


def test_wrong_results_in_the_new_file_fail_the_gate(cb, tmp_path):
    a = write(tmp_path / "a.jsonl", [meas("all_reduce", 1024, [1e-4] * 30)])
    bad = meas("all_reduce", 1024, [1e-4] * 30)
    bad.num_wrong, bad.wrong_ranks = 3, [1]
    b = write(tmp_path / "b.jsonl", [bad])
    r = cb("check", "--baseline", a, b)
    assert r.returncode == 1 and "### Wrong results in the new file" in r.stdout
    assert "all_reduce 1024 B float32 on world: 3 wrong element(s)" in r.stdout
    assert json.loads(cb("check", "--baseline", a, b, "--json").stdout)["regression"] is True


def test_check_exit_codes_summary_and_environment(cb, tmp_path, monkeypatch):
    base = system(tmp_path / "base.jsonl", seed=1)
    same = system(tmp_path / "same.jsonl", seed=2)
    slow = system(tmp_path / "slow.jsonl", 2.0, seed=3, host="nodeB", versions={"torch": "2.14.0"})
    r = cb("check", "--baseline", base, same)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("## commbench check: OK")
    summary = tmp_path / "summary.md"
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    r = cb("check", "--baseline", base, slow, "--summary", summary)
    assert r.returncode == 1
    md = summary.read_text()
    assert md == r.stdout and "REGRESSION" in md and "### Slower (regressions)" in md
    assert "| hosts | nodeA | nodeB |" in md and "| version: torch | 2.13.0 | 2.14.0 |" in md
    doc = json.loads(cb("check", "--baseline", base, slow, "--json").stdout)
    assert doc["regression"] and doc["counts"]["slower"] == 6 and doc["correction"] == "holm"
    # $GITHUB_STEP_SUMMARY is appended to
    gh = tmp_path / "gh.md"
    gh.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(gh))
    r = cb("check", "--baseline", base, same)
    assert r.returncode == 0 and gh.read_text().startswith("earlier step\n## commbench check: OK")
    # bad input: exit 2, one line
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("this is not a results file\n")
    other = write(tmp_path / "other.jsonl", [meas("broadcast", 8, [1e-5] * 10, redop=None)])
    for args in ((base, garbage), (base, tmp_path / "missing.jsonl"), (base, other)):
        r = cb("check", "--baseline", *args)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no Case in common" in r.stderr
    r = cb("check", "--baseline", base, same, "--factor", "0.5")
    assert r.returncode == 2 and "--factor" in r.stderr


def test_compare_three_systems_json_plot_and_plan_note(cb, tmp_path):
    plan = {"model": {"name": "tiny-gpt"}, "parallelism": {"world": 2, "dp": 2, "tp": 1, "pp": 1, "zero": 0}}
    a = system(tmp_path / "a.jsonl", seed=1, settings={"plan": plan})
    b = system(tmp_path / "b.jsonl", 2.0, seed=2)
    c = system(tmp_path / "c.jsonl", seed=3)
    png = tmp_path / "busbw.png"
    r = cb("compare", a, b, c, "--labels", "dgx,polaris,dgx2", "--plot", png, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [s["label"] for s in doc["systems"]] == ["dgx", "polaris", "dgx2"] and len(doc["cases"]) == 6
    case = doc["cases"][0]
    assert case["vs_reference"]["polaris"]["verdict"] == "slower"
    assert case["vs_reference"]["dgx2"]["verdict"] == "same"
    assert case["systems"]["polaris"]["p50_s"] == pytest.approx(2 * case["systems"]["dgx"]["p50_s"], rel=0.05)
    gm = {(s["system"], s["op"]): s["geomean_ratio"] for s in doc["summary"]}
    assert gm[("polaris", "all_reduce")] == pytest.approx(2, rel=0.05)
    assert gm[("dgx2", "all_gather")] == pytest.approx(1, rel=0.05)
    assert png.stat().st_size > 10000
    assert any("tiny-gpt" in n and "--compute" in n for n in doc["notes"])
    r = cb("compare", a, b)         # the rich tables; default labels from hosts + file names
    assert r.returncode == 0 and "nodeA (a.jsonl)" in r.stdout and "slower" in r.stdout
    for bad in ((a,), (a, b, "--labels", "x"), (a, b, "--compute", a)):
        r = cb("compare", *bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_labels_default_to_hosts():
    files = [results.ResultFile({"cluster": {"hosts": ["x1", "x2"]}}, [], "p/a.jsonl"),
             results.ResultFile({"cluster": {"hosts": ["y1"]}}, [], "p/b.jsonl")]
    assert compare.labels_for(files, None) == ["x1+1", "y1"]


def test_baseline_promote_keeps_header_adds_provenance_refuses_overwrite(cb, tmp_path):
    src = system(tmp_path / "run.jsonl", seed=1)
    d = tmp_path / "baselines"
    r = cb("baseline", "promote", src, "gloo-2rank", "--dir", d)
    assert r.returncode == 0, r.stderr
    out = d / "gloo-2rank.jsonl"
    rf, orig = results.load(str(out)), results.load(src)
    prov = rf.header.pop("provenance")
    assert rf.header == orig.header and rf.measurements == orig.measurements
    assert prov["source"] == src and len(prov["source_sha256"]) == 64 and prov["promoted_by"] and prov["promoted_at"]
    before = out.read_text()
    r = cb("baseline", "promote", src, "gloo-2rank", "--dir", d)
    assert r.returncode == 2 and "--force" in r.stderr and out.read_text() == before
    assert cb("baseline", "promote", src, "gloo-2rank", "--dir", d, "--force").returncode == 0
    assert "previous" not in results.load(str(out)).header["provenance"]
    for bad in (("../evil",), ("ok",)):
        what = src if bad != ("ok",) else tmp_path / "missing.jsonl"
        r = cb("baseline", "promote", what, bad[0], "--dir", d)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def two_real_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    paths = []
    for name in ("r1.jsonl", "r2.jsonl"):
        p = d / name
        r = commbench("run", "--nprocs", 2, "-b", "1K", "-e", "64K", "-f", 4, "-n", 20, "--target-ci", 0,
                      "--collective", "all_reduce", "-q", "--out", p)
        assert r.returncode == 0, r.stderr
        paths.append(p)
    return paths


def test_check_on_real_runs(cb, two_real_runs, tmp_path):
    r1, r2 = two_real_runs
    # the same machine twice: a case fails only beyond the factor, and the exit status follows the cases.
    # No verdict is asserted: this test shares two CPU cores with other jobs, and 1 KiB all_reduce's
    # p50 over 20 samples has moved 5x and (in a fresh-clone CI run) 12x between two such runs
    r = cb("check", "--baseline", r1, r2, "--factor", 10, "--json")
    doc = json.loads(r.stdout)
    assert doc["common_cases"] == 4
    flagged = [c for c in doc["cases"] if c["verdict"] == "slower"]
    assert all(c["ratio"] > 10 for c in flagged), flagged
    assert r.returncode == (1 if flagged else 0), r.stdout + r.stderr
    # a crafted copy with every raw sample 3x slower is flagged, for every case
    rf = results.load(str(r1))
    slow = []
    for m in rf.measurements:
        samples = [3 * x for x in m.samples_s]
        slow.append(Measurement(case=m.case, samples_s=samples, stats=stats.summarize(samples),
                                algbw_gbps=m.algbw_gbps / 3, busbw_gbps=m.busbw_gbps / 3))
    crafted = write(tmp_path / "slow.jsonl", slow)
    r = cb("check", "--baseline", r1, crafted, "--factor", 1.5, "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["counts"]["slower"] == doc["common_cases"] == 4
    assert all(c["ratio"] == pytest.approx(3) for c in doc["cases"])
    assert any(d["what"] == "hosts" for d in doc["environment_differences"])
