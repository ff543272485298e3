"""What a collective issued right after compute costs over the same collective
back to back: the after-compute penalty, delta, per call.

commbench, like nccl-tests, times a collective in a back-to-back loop, where the
ranks arrive together and the communication threads are awake. In a training
step a tensor-parallel all_reduce, a pipeline send or a gradient bucket is
issued right after a burst of compute: the ranks arrive with the skew of their
compute, and on a CPU the communication threads may have to be scheduled
first (benchmarks/collective_after_compute.py: a 16 KiB gloo all_reduce after
1 ms of torch.mm takes 925 us on average against 333 us back to back, on 2
ranks of this 2-core machine). The predictor adds delta to each collective
call of a step that follows compute (predict.py).

Two measurements of an all_reduce of NBYTES over all ranks, with the timing
protocol of every collective (per-iteration max over ranks):
  back_to_back   the all_reduce alone, in a loop
  after_compute  each timed all_reduce preceded by an untimed burst of
                 torch.mm lasting about gap_s on the rank's device (on a GPU,
                 the events bracket the all_reduce in stream order, so its
                 time starts when the burst ends)
delta = mean(after_compute) - mean(back_to_back), at least 0 (means: a step
is a sum of calls). delta grows with the burst (the ranks' compute drifts
apart; a CPU's communication threads sleep longer): `validate` measures it at
its plan's own gap between calls (plan_gap_s), `compute --interference` at
--gap (default 1 ms)."""
import numpy as np

from commbench import timing
from commbench.results import Case

NBYTES = 16 << 10          # latency-bound: the penalty is per call, not per byte
OP = "after_compute"


class AfterCompute:
    """timing.measure's backend: runs compute() untimed before each timed call."""

    def __init__(self, backend, compute):
        self.backend, self.compute = backend, compute

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def time_iterations(self, op, iters):
        out = []
        for _ in range(iters):
            self.compute()
            out += self.backend.time_iterations(op, 1)
        return out


def burst(backend, device, gap_s: float, size: int = 128):
    """An untimed compute burst of about gap_s on this rank: k float32 torch.mm
    of size^2 in a row, k from rank 0's timing of one (every rank does the same
    work). Returns (the call, its description)."""
    import time
    torch = backend.torch
    gen = torch.Generator().manual_seed(4321)
    a = torch.rand(size, size, generator=gen).to(device)
    b = torch.rand(size, size, generator=gen).to(device)
    c = torch.empty(size, size, device=device)
    for _ in range(3):
        torch.mm(a, b, out=c)
    backend.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b, out=c)
    backend.synchronize()
    one = (time.perf_counter() - t0) / 20
    k = int(backend.control_bcast(max(1, round(gap_s / max(one, 1e-9)))))

    def call():
        for _ in range(k):
            torch.mm(a, b, out=c)
    return call, f"{k} x torch.mm {size}x{size}x{size} float32 (about {k * one * 1e6:.0f} us)"


def plan_gap_s(workload, compute_rf, device: str) -> float | None:
    """The compute between two collective calls of a plan's step on its first
    stage: its measured forward and backward kernels per step over its calls
    issued from within them (TP, p2p sends, DP/ZeRO of the forward and
    backward); None without such calls."""
    from commbench import predict
    calls = sum(c.count for c in workload.comm_ops
                if c.phase in ("fwd", "bwd") and c.stage == 0 and c.direction != "recv")
    if not calls:
        return None
    times = predict.MeasuredTimes(None, [compute_rf], device=device).bind(workload.compute_ops)
    busy = sum(times.compute(op, "mid") * op.count for op in predict.granularity(workload.compute_ops, times, 0)
               if op.phase in ("fwd", "bwd"))
    return busy / calls


def cases(base: dict, work: str) -> dict:
    """The two Cases (position -> Case) of the penalty's measurements."""
    return {pos: Case(op=OP, **dict(base, nbytes=NBYTES),
                      params={"position": pos, "compute": work if pos == "after_compute" else None})
            for pos in ("back_to_back", "after_compute")}


def measure(backend, coll, compute, settings, on_phase=None) -> dict:
    """position -> timing.Timed of the all_reduce coll (of NBYTES), back to back
    and after compute()."""
    return {"back_to_back": timing.measure(backend, coll, settings, on_phase=on_phase),
            "after_compute": timing.measure(AfterCompute(backend, compute), coll, settings, on_phase=on_phase)}


def penalty_s(measurements) -> float | None:
    """delta from a results file's measurements: mean after compute minus mean
    back to back (>= 0), or None where either is missing."""
    means = {}
    for m in measurements:
        if m.case.op == OP and m.status == "ok" and m.samples_s:
            means[m.case.params.get("position")] = float(np.mean(m.samples_s))
    if "back_to_back" not in means or "after_compute" not in means:
        return None
    return max(0.0, means["after_compute"] - means["back_to_back"])
