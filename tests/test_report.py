"""commbench report: from a real small results file and a synthetic predict
document with scaling rows, an HTML page with embedded figures and no network
resources, and a markdown report; the page opened in headless chromium.

Chromium: Debian's `chromium` package. Where it is missing and the tests run as
root on a machine with apt-get, the suite installs it once (`apt-get install -y
chromium`, after `apt-get update` if the first try fails); COMMBENCH_NO_APT=1
turns that off. Without it the browser test is skipped with the reason."""
import functools
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import FAST, commbench

BREAKDOWN = {"compute_s": 0.080, "tp_exposed_s": 0.010, "pp_exposed_s": 0.004, "dp_exposed_s": 0.012,
             "bubble_s": 0.006, "optimizer_s": 0.003, "hidden_comm_s": 0.020}


def _row(gpus, sps, dp_exposed):
    b = dict(BREAKDOWN, dp_exposed_s=dp_exposed)
    step = sum(v for k, v in b.items() if k != "hidden_comm_s")
    return {"gpus": gpus, "dp": gpus // 4, "global_batch": 8 * gpus // 4, "step_time_s": step, "samples_per_s": sps,
            "tokens_per_s": sps * 2048, "tflops_per_gpu": 50.0, "mfu": None, "breakdown": b,
            "extrapolated": gpus > 16, "from_spec": False, "notes": [], "scaling_efficiency": sps / gpus / (70.0 / 8)}


def predict_doc():
    """The shape `commbench predict --scale ... --json` prints (made up numbers)."""
    step = sum(v for k, v in BREAKDOWN.items() if k != "hidden_comm_s")
    rows = [_row(8, 70.0, 0.012), _row(16, 136.0, 0.015), _row(32, 260.0, 0.020)]
    return {"step_time_s": step, "samples_per_s": 8 / step, "tokens_per_s": 8 * 2048 / step, "tflops_per_gpu": 50.0,
            "mfu": 0.2, "breakdown": BREAKDOWN, "step_time_low_s": step * 0.95, "step_time_high_s": step * 1.05,
            "critical_stage": 0, "stages": [], "notes": ["synthetic document for a test"],
            "scaling": {"mode": "weak", "rows": rows}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("report-in")
    res = d / "run.jsonl"
    r = commbench("run", "--nprocs", "2", "-b", "1K", "-e", "64K", "-f", "4", *FAST, "--out", res)
    assert r.returncode == 0, r.stderr
    pred = d / "pred.json"
    pred.write_text(json.dumps(predict_doc()))
    return res, pred


def _collectives_with_busbw(res):
    from commbench import results
    return {(m.case.op, m.case.axis) for m in results.load(str(res)).measurements if m.busbw_gbps}


@pytest.fixture(scope="module")
def report(inputs, tmp_path_factory):
    res, pred = inputs
    out = tmp_path_factory.mktemp("report-out") / "rep"
    r = commbench("report", res, pred, "--out", out, "--title", "test <report>")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("report: ")
    return out, 1 + 1 + len(_collectives_with_busbw(res))     # breakdown + scaling + one per collective


def test_files_and_embedded_figures(report):
    out, nfig = report
    page = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    imgs = re.findall(r"<img [^>]*src=\"([^\"]*)\"", page)
    assert len(imgs) == nfig
    assert all(src.startswith("data:image/png;base64,") for src in imgs)
    # self-contained: nothing fetched from anywhere
    assert not re.search(r"https?://|\bsrc=\"(?!data:)|<link|<script|@import|url\(", page, re.I)
    assert "test &lt;report&gt;" in page and "<report>" not in page
    for word in ("Bus bandwidth against size", "Training step", "all_reduce", "p50 (us)", "busbw (GB/s)",
                 "torch", "ranks", "command", "variant", "in-place sum"):
        assert word in page
    links = re.findall(r"!\[[^\]]*\]\((figures/[^)]+\.png)\)", md)
    assert len(links) == nfig and all((out / p).stat().st_size > 1000 for p in links)
    assert "| op | axis | group |" in md


def test_never_overwrites_and_bad_input(report, inputs, tmp_path):
    out, _ = report
    res, pred = inputs
    before = (out / "report.html").read_bytes()
    r = commbench("report", res, "--out", out)
    assert r.returncode == 2 and "exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert (out / "report.html").read_bytes() == before
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    notjson = tmp_path / "x.txt"
    notjson.write_text("not json\n")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(dict(predict_doc(), breakdown={"compute_s": 1.0})))
    for args in ([tmp_path / "missing.jsonl"], [bad], [notjson], [broken], []):
        r = commbench("report", *args, "--out", tmp_path / "o")
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o" / "report.html").exists()
    r = commbench("report", res, "--out", tmp_path / "f")
    assert r.returncode == 0
    assert commbench("report", res, pred, "--out", tmp_path / "f", "--force").returncode == 0


def test_validate_document_detected(tmp_path):
    from commbench import report
    doc = {"measured_step_time_s": 0.1, "predicted_step_time_s": 0.11, "error_pct": 10.0, "prediction": predict_doc(),
           "implementation": "DDP", "plan": {"model": "tiny-gpt", "world": 2}}
    p = tmp_path / "validate.json"
    p.write_text(json.dumps(doc, indent=1))
    assert report.load_input(str(p)).kind == "validate"
    paths = report.build([str(p)], str(tmp_path / "r"))
    assert len(paths["figures"]) == 1          # the breakdown with the measured step
    assert "error" in (tmp_path / "r" / "report.md").read_text()


@functools.lru_cache(maxsize=None)
def chromium() -> tuple:
    """(path, None) or (None, why it is missing)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found, None
    if os.environ.get("COMMBENCH_NO_APT"):
        return None, "chromium is not installed (COMMBENCH_NO_APT set: not installing it)"
    if not shutil.which("apt-get") or os.geteuid() != 0:
        return None, "chromium is not installed and cannot be (needs root and apt-get: apt-get install chromium)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmds in ([["apt-get", "install", "-y", "-q", "chromium"]],
                 [["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]]):
        try:
            if all(subprocess.run(c, capture_output=True, env=env, timeout=900).returncode == 0 for c in cmds):
                break
        except subprocess.TimeoutExpired:
            pass
    found = shutil.which("chromium")
    return (found, None) if found else (None, "chromium is not installed and apt-get install chromium failed")


PROBE = ("<script>window.addEventListener('load',function(){var i=Array.prototype.slice.call(document.images);"
         "var p=document.createElement('div');p.id='cb-probe';p.textContent='images='+i.length+' loaded='+"
         "i.filter(function(x){return x.complete&&x.naturalWidth>0;}).length;document.body.appendChild(p);});"
         "</script></body>")


def test_report_in_headless_chromium(report, tmp_path):
    """The page loads in a real browser and every figure decodes (naturalWidth > 0):
    a probe script, added to a copy of the page (the report has no scripts), writes
    the counts into the DOM; and a screenshot of the page is not blank."""
    exe, why = chromium()
    if exe is None:
        pytest.skip(why)
    out, nfig = report
    probe = out / "probe.html"
    probe.write_text((out / "report.html").read_text().replace("</body>", PROBE))
    flags = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--run-all-compositor-stages-before-draw",
             "--virtual-time-budget=10000"]
    r = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"id=\"cb-probe\">images=(\d+) loaded=(\d+)<", r.stdout)
    assert m, r.stdout[-2000:]
    assert (int(m.group(1)), int(m.group(2))) == (nfig, nfig)
    shot = tmp_path / "shot.png"
    r = subprocess.run([*flags, "--window-size=1200,1400", f"--screenshot={shot}", (out / "report.html").as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    from PIL import Image
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1400)
    assert len(img.getcolors(maxcolors=1 << 20) or range(1 << 20)) > 50    # text and plotted lines, not blank
