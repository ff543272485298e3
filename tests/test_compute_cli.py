"""`commbench compute` on the CPU end to end: real torch kernels timed on one and
on two ranks at once, written to a ResultFile, printed as --json."""
import json

import pytest

from commbench import results
from commbench.compute.runner import op_time_s
from conftest import commbench

QUICK = ["-n", "3", "-w", "1", "--target-ci", "0", "--device", "cpu"]


def test_compute_one_rank_json_and_results(tmp_path):
    out = tmp_path / "c.jsonl"
    p = commbench("compute", "--model", "tiny-llama", "--micro-batch", "2", "--dtype", "fp32", *QUICK,
                  "--out", out, "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    rf = results.load(str(out))
    cases = [m for m in rf.measurements]
    assert cases and all(m.case.kind == "compute" and m.status == "ok" for m in cases)
    # one measurement per distinct kernel and shape
    keys = [m.case.key() for m in cases]
    assert len(keys) == len(set(keys))
    assert all(m.iters == 3 and m.case.concurrent_groups == 1 and len(m.rank_time_p50_s) == 1 for m in cases)
    by_kernel = {}
    for m in cases:
        by_kernel.setdefault((m.case.op, m.case.params["m"], m.case.params["n"], m.case.params["k"]), m)
    ops = doc["ops"]
    names = {o["name"] for o in ops}
    assert {"qkv fwd", "qkv dgrad", "qkv wgrad", "attention fwd", "attention bwd", "swiglu bwd", "rope fwd",
            "embedding bwd", "logits wgrad", "cross entropy fwd", "adam step"} <= names
    for o in ops:
        assert set(o) >= {"name", "kind", "m", "n", "k", "flops", "bytes", "count", "time_p50_s"}
        m = by_kernel[(o["impl"], o["m"], o["n"], o["k"])]
        # the op's time is its kernel's stored p50 (from the raw samples)
        assert o["time_p50_s"] == pytest.approx(sorted(m.samples_s)[1]) and o["time_p50_s"] > 0
        assert o["time_p50_s"] == pytest.approx(op_time_s(m))
    # tiny-llama: GEMM FLOPs 2 m n k, stored in the Case as well
    gemm = next(o for o in ops if o["name"] == "mlp up fwd")
    assert gemm["flops"] == 2 * gemm["m"] * gemm["n"] * gemm["k"] == 2 * 128 * 176 * 64
    assert rf.header["settings"]["plan"]["model"]["name"] == "tiny-llama"


def test_compute_two_ranks_at_once_and_no_overwrite(tmp_path):
    out = tmp_path / "c2.jsonl"
    p = commbench("compute", "--model", "tiny-gpt", "--nprocs", "2", "--dtype", "fp32", *QUICK, "-q",
                  "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rf = results.load(str(out))
    for m in rf.measurements:
        assert m.case.concurrent_groups == 2 and len(m.rank_time_p50_s) == 2
        # each stored sample is the max over the ranks of that iteration, so its
        # median is at least every rank's own median
        assert m.stats["time_p50_s"] >= max(m.rank_time_p50_s)
    before = out.read_bytes()
    p = commbench("compute", "--model", "tiny-gpt", "--dtype", "fp32", *QUICK, "-q", "--out", out, cwd=tmp_path)
    assert p.returncode == 2 and "exists" in p.stderr and "Traceback" not in p.stderr
    assert out.read_bytes() == before


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny-gpt", "--tp", "3"], "tp"),
    (["--model", "tiny-gpt", "-n", "0"], "-n"),
    (["--model", "tiny-gpt", "--device", "tpu"], "device"),
])
def test_compute_bad_input(tmp_path, args, needle):
    p = commbench("compute", *args, "--out", tmp_path / "x.jsonl", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists()


class _OneRank:
    """The two control calls measure() makes, for one rank."""
    torch_device = "cpu"

    def control_allgather(self, x):
        return [x]


def test_compute_refuses_an_op_larger_than_memory_before_allocating():
    import torch
    from commbench.compute import runner
    from commbench.compute.ops import _gemm
    free = runner.free_bytes("cpu", 1)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert 0 < free <= avail * 1.05 and runner.free_bytes("cpu", 4) == pytest.approx(free / 4, rel=0.05)
    side = int((free / 2) ** 0.5) + 1              # three side x side bf16 matrices: 3x the free memory
    op = _gemm("huge fwd", side, side, side, 1, "fwd", "bf16", 2, "gemm_nt")
    assert runner.needed_bytes(op, "cpu") == 2 * 2 * 3 * side * side
    case = runner.case_of(op, "cpu", "torch", 1)
    m = runner.measure(_OneRank(), None, case, op, None, ["h"], torch, "cpu")
    assert m.status == "skipped" and "needs about" in m.skip_reason and "GB free for this rank" in m.skip_reason


# One module op on the CPU in a fresh process: the growth of its resident memory
# (peak after two forward+backward calls, less the resident size once torch's
# kernels were warmed up) against the runner's bound for it.
_PEAK = r"""
import sys, torch
from commbench import models
from commbench.compute import kernels, ops, runner
from commbench.parallel import Parallelism
torch.set_num_threads(2)
def kb(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
x = torch.randn(2, 4, 64, 16, requires_grad=True)
torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).sum().backward()
lin, ln = torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)
torch.nn.functional.cross_entropy(lin(ln(torch.randn(8, 64))), torch.zeros(8, dtype=torch.long)).backward()
torch.nn.functional.gelu(torch.randn(8, 64, requires_grad=True)).sum().backward()
before = kb("VmRSS:")
par = Parallelism(world=1, micro_batch=int(sys.argv[2]), global_batch=int(sys.argv[2]), dtype="fp32")
op = next(o for o in ops.module_ops(models.get(sys.argv[1]), par, 1, 1) if o.impl == sys.argv[3])
call = kernels()[op.impl](op, "cpu", torch.float32)
call(); call()
print(kb("VmHWM:") - before, runner.needed_bytes(op, "cpu"), op.nbytes)
"""


@pytest.mark.parametrize("model,mb,impl", [("small-gpt", 32, "layer_fwd"), ("small-gpt", 32, "head_bwd"),
                                           ("tiny-llama", 32, "stage_bwd"), ("small-gpt", 16, "stage_fwd")])
def test_module_memory_bound_holds_what_the_module_takes(model, mb, impl):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", _PEAK, model, str(mb), impl], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    grew, bound, moved = map(int, p.stdout.split())
    assert 50e6 < grew <= bound, (grew, bound)       # a real allocation, under the bound
    assert bound < 6 * moved                          # below the old bound (6 x the bytes moved)


def test_module_memory_bound_by_hand():
    """The bound's terms for one layer, computed here from its definition, and a
    gpt3-6.7b stage that the old bound (6 x bytes moved: 210 GB) kept off a 141 GB GPU."""
    from commbench import models
    from commbench.compute import ops, runner
    from commbench.parallel import Parallelism
    m = models.get("tiny-llama")                     # h 64, 4 heads of 16, 2 kv heads, f 176, V 512
    par = Parallelism(world=1, micro_batch=2, global_batch=2, dtype="bf16")
    layer = next(o for o in ops.module_ops(m, par, 1, 1) if o.impl == "layer_bwd")
    T, s, h, q, k, f = 2 * 64, 64, 64, 64, 32, 176
    weights = h * (q + 2 * k) + q * h + 3 * h * f
    acts = T * (12 * h + 4 * q + 4 * k + 3 * f) * 2
    scores = 6 * 2 * 4 * s * s * 4
    assert runner.needed_bytes(layer, "cpu") == 2 * (2 * weights * 2 + acts + scores)
    big = models.get("gpt3-6.7b")
    par = Parallelism(world=1, micro_batch=1, global_batch=1, dtype="bf16")
    stage = next(o for o in ops.module_ops(big, par, 1, 1) if o.impl == "stage_fwd")
    need = runner.needed_bytes(stage, "cuda")
    assert 2 * 2 * big.num_params < need < 0.8 * 142.4e9 < 6 * stage.nbytes


def test_unaligned_gemm_on_a_gpu_carries_a_note():
    """A logits GEMM of 50257 words on a GPU is flagged; the padded one, the CPU
    and non-GEMM kernels are not."""
    from commbench.compute import ops, runner
    from commbench import models
    from commbench.parallel import Parallelism
    model = models.get("gpt3-125m")
    par = Parallelism(world=1, micro_batch=1, global_batch=1, dtype="bf16")
    logits = next(op for op in ops.head_ops(model, par, 1) if op.name == "logits fwd")
    gpu, cpu = runner.case_of(logits, "cuda", "torch", 1), runner.case_of(logits, "cpu", "torch", 1)
    assert runner.alignment_note(gpu) == ("n = 50257 not a multiple of 8: off cuBLAS's fastest kernels "
                                          "(a vocabulary: pad it, --vocab-divisible-by 128)")
    assert runner.alignment_note(cpu) is None
    padded = models.ModelSpec(**{**{k: v for k, v in model.to_dict().items() if k != "num_params"},
                                 "vocab_divisible_by": 128}).at_tp(1)
    logits = next(op for op in ops.head_ops(padded, par, 1) if op.name == "logits fwd")
    assert runner.alignment_note(runner.case_of(logits, "cuda", "torch", 1)) is None
    ce = next(op for op in ops.head_ops(model, par, 1) if op.impl == "cross_entropy_fwd")
    assert runner.alignment_note(runner.case_of(ce, "cuda", "torch", 1)) is None
