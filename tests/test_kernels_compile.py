"""Every kernels/*.cu compiles to PTX for sm_80 and sm_90 and documents itself."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
CU_FILES = sorted(KERNELS.glob("*.cu"))
ARCHS = ["sm_80", "sm_90"]


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    if os.access("/usr/local/bin/nvcc", os.X_OK):
        return "/usr/local/bin/nvcc"
    return None


NVCC = _nvcc()

# extern "C" __global__ void [__launch_bounds__(...)] name(
KERNEL_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


def kernel_names(src: str):
    return KERNEL_RE.findall(src)


def header_comment(src: str) -> str:
    """The comment block the file starts with ('//' lines or one '/* */' block)."""
    text = src.lstrip()
    if text.startswith("/*"):
        end = text.find("*/")
        return text[: end + 2] if end >= 0 else ""
    lines = []
    for line in text.splitlines():
        if line.lstrip().startswith("//"):
            lines.append(line)
        else:
            break
    return "\n".join(lines)


def test_kernels_exist():
    assert CU_FILES, f"no .cu files in {KERNELS}"


@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_header_comment(cu):
    head = header_comment(cu.read_text()).lower()
    assert head, f"{cu.name} does not start with a header comment"
    assert "measures" in head, f"{cu.name}: header does not say what it measures"
    assert "check" in head, f"{cu.name}: header does not say how it checks itself"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (not on PATH, no /usr/local/bin/nvcc)")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_compiles_to_ptx(cu, arch, tmp_path):
    names = kernel_names(cu.read_text())
    assert names, f'{cu.name}: no extern "C" __global__ kernels found'
    ptx = tmp_path / f"{cu.stem}_{arch}.ptx"
    res = subprocess.run([NVCC, "-ptx", f"-arch={arch}", "-o", str(ptx), str(cu)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, f"nvcc failed on {cu.name} ({arch}):\n{res.stderr}"
    assert "warning" not in (res.stdout + res.stderr).lower(), \
        f"nvcc warned on {cu.name} ({arch}):\n{res.stdout}{res.stderr}"
    text = ptx.read_text()
    assert re.search(rf"^\.target\s+{arch}\b", text, re.M), f"{ptx.name}: no .target {arch}"
    for name in names:
        assert re.search(rf"\.entry\s+{name}\s*\(", text), f"{ptx.name}: no .entry {name}"
