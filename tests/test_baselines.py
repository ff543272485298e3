"""baselines/: every file loads as a results file; the published reference points
are flagged as such, cite a source, and their one sample gives back the stated
busbw; the emulated-cluster pair shows its inter-node bandwidth where it was
set; baselines/README.md gives the provenance of every file."""
import math
import subprocess

from conftest import ROOT

from commbench import results

BASE = ROOT / "baselines"
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n}


def test_reference_points():
    files = sorted((BASE / "reference").glob("*.jsonl"))
    assert len(files) >= 2
    for f in files:
        rf = results.load(str(f))
        h = rf.header
        assert h["reference"] is True and h["launcher"] == "reference"
        assert h["url"].startswith("https://github.com/NVIDIA/") and h["source"] and h["stated_at"]
        assert rf.measurements
        for m in rf.measurements:
            c = m.case
            assert len(m.samples_s) == 1 and any("not a commbench measurement" in w for w in m.warnings)
            busbw = c.nbytes / m.samples_s[0] / 1e9 * FACTOR[c.op](c.group_size)
            assert math.isclose(busbw, m.busbw_gbps, rel_tol=1e-9)
            assert math.isclose(m.stats["time_p50_s"], m.samples_s[0])
    h100 = {(m.case.op, m.case.in_place): m.busbw_gbps
            for m in results.load(str(BASE / "reference" / "dgx-h100-nvlink-nccl.jsonl")).measurements}
    assert h100[("all_reduce", False)] == 480.0 and h100[("all_gather", False)] == 370.0
    a100 = results.load(str(BASE / "reference" / "dgx-a100-nvlink-nccl.jsonl")).measurements
    assert {m.busbw_gbps for m in a100} == {230.0}


def test_reference_files_are_what_the_script_writes(tmp_path, monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_reference", BASE / "make_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "HERE", str(tmp_path))
    assert mod.main([]) == 0
    assert mod.main([]) == 2          # never overwrites without --force
    for f in tmp_path.glob("*.jsonl"):
        new, shipped = results.load(str(f)), results.load(str(BASE / "reference" / f.name))
        assert [m.to_dict() for m in new.measurements] == [m.to_dict() for m in shipped.measurements]
        assert {k: v for k, v in new.header.items() if k != "created_at"} == \
               {k: v for k, v in shipped.header.items() if k != "created_at"}


def _busbw(rf, op, axis):
    big = max(m.case.nbytes for m in rf.measurements if m.case.op == op and m.case.axis == axis)
    return next(m.busbw_gbps for m in rf.measurements if (m.case.op, m.case.axis, m.case.nbytes) == (op, axis, big))


def test_emulated_pair():
    assert subprocess.run(["bash", "-n", str(BASE / "make_emulated.sh")]).returncode == 0
    low = results.load(str(BASE / "emulated" / "emulated-2x2-100mbit.jsonl"))
    high = results.load(str(BASE / "emulated" / "emulated-2x2-1gbit.jsonl"))
    for rf, bits in ((low, 100e6), (high, 1e9)):
        assert rf.header["launcher"] == "emulate" and rf.header["cluster"]["num_hosts"] == 2
        assert all(m.num_wrong == 0 for m in rf.measurements)
        # two inter groups share each node's link: each gets half of it, less TCP/IP overhead
        bc = _busbw(rf, "broadcast", "inter")
        assert 0.6 * bits / 8 / 2 / 1e9 < bc <= 1.02 * bits / 8 / 2 / 1e9, bc
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        assert _busbw(high, op, "inter") > 3 * _busbw(low, op, "inter")


def test_readme_gives_every_file_its_provenance():
    text = (BASE / "README.md").read_text()
    for f in list((BASE / "reference").glob("*.jsonl")) + list((BASE / "emulated").glob("*.jsonl")):
        assert f.name in text, f.name
    for url in ("https://github.com/NVIDIA/nccl-tests/issues/149", "https://github.com/NVIDIA/nccl-tests/issues/212"):
        assert url in text


def test_measured_h200_files():
    """The H200 results of the GPU check: real CUDA measurements with their
    provenance, every check passed, and the README naming each."""
    text = (BASE / "README.md").read_text()
    files = sorted((BASE / "measured").glob("*.jsonl"))
    assert [f.name for f in files] == ["h200-1gpu-compute-gpt3-6.7b.jsonl", "h200-1gpu-kernels.jsonl"]
    for f in files:
        assert f.name in text
        rf = results.load(str(f))
        assert rf.header["provenance"]["source_sha256"] and rf.header["cluster"]["gpus"][0]["name"] == "NVIDIA H200"
        assert all(m.case.device == "cuda" and m.num_wrong in (0, None) for m in rf.measurements)
        assert all(len(m.samples_s) >= 5 for m in rf.measurements if m.status == "ok")
    kernels = results.load(str(BASE / "measured" / "h200-1gpu-kernels.jsonl"))
    assert {m.case.op for m in kernels.measurements} == {"copy", "triad"}
    assert all(3000 < m.algbw_gbps < 4800 for m in kernels.measurements)     # under the data sheet's 4.8 TB/s
