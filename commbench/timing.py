"""Timers and the adaptive timing protocol (DESIGN.md, "Timing protocol").

Each rank times every iteration of a back-to-back loop on its own clock; after a
batch (never inside it) the per-iteration times are reduced to their max over
all ranks that run at once, rank 0 decides whether the CI of the median (or,
where the consumer sums means, of the mean) reached the target, and all ranks follow its decision."""
import math
import time
from dataclasses import dataclass

import numpy as np

from commbench import stats


def host_timer(op, iters: int) -> list:
    """perf_counter_ns around each call; one clock read per iteration, as the
    end of one iteration is the start of the next."""
    pc = time.perf_counter_ns
    ts = [0] * (iters + 1)
    ts[0] = pc()
    for i in range(1, iters + 1):
        op()
        ts[i] = pc()
    return [(b - a) * 1e-9 for a, b in zip(ts, ts[1:])]


def event_timer(op, iters: int, new_event, elapsed_ms, synchronize, record=None) -> list:
    """CUDA events recorded on the communication stream between iterations."""
    record = record or (lambda e: e.record())
    events = [new_event() for _ in range(iters + 1)]
    record(events[0])
    for i in range(1, iters + 1):
        op()
        record(events[i])
    synchronize()
    return [elapsed_ms(a, b) * 1e-3 for a, b in zip(events, events[1:])]


@dataclass(frozen=True)
class TimingSettings:
    warmup: int = 5
    iters: int = 20           # minimum timed iterations (exactly this with target_ci = 0)
    max_iters: int = 10000
    time_budget_s: float = 1.0   # per case, after the minimum iterations
    target_ci: float = 0.01
    ci_of: str = "median"     # the statistic whose CI the target is on: the median, or the mean (predict's)
    # timed calls go on, whatever their precision, until they have taken this
    # long (within the budget): the CI of back-to-back calls takes them as
    # independent, and a dozen calls on a machine whose speed drifts over
    # seconds see one of its phases, not its average
    min_time_s: float = 0.0

    def check(self):
        """ValueError naming the flag of a value the protocol cannot run with."""
        if self.iters < 1:
            raise ValueError(f"-n/--iters must be at least 1, got {self.iters}")
        if self.warmup < 0:
            raise ValueError(f"-w/--warmup must be >= 0, got {self.warmup}")
        if self.max_iters < self.iters:
            raise ValueError(f"--max-iters ({self.max_iters}) is below -n/--iters ({self.iters})")
        if self.ci_of not in ("median", "mean"):
            raise ValueError(f"ci_of {self.ci_of!r}: choose median or mean")
        if not 0 <= self.target_ci < 1:
            raise ValueError(f"--target-ci must be in [0, 1), got {self.target_ci}")
        if not (math.isfinite(self.time_budget_s) and self.time_budget_s >= 0):
            raise ValueError(f"--time-budget must be a finite number of seconds >= 0, got {self.time_budget_s}")
        if not (math.isfinite(self.min_time_s) and self.min_time_s >= 0):
            raise ValueError(f"min_time_s must be a finite number of seconds >= 0, got {self.min_time_s}")


def check_timeout(timeout_s):
    """--timeout: None (the default deadlines) or a positive finite number of seconds."""
    if timeout_s is not None and not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"--timeout must be a positive finite number of seconds, got {timeout_s}")


@dataclass
class Timed:
    samples_s: list            # per iteration, max over all ranks running at once
    own_samples_s: list        # this rank's own per-iteration times


def measure(backend, op, settings: TimingSettings, on_phase=None) -> Timed:
    """on_phase(calls, budget_s), if given, is told before the warmup and before
    each timed batch how many calls follow (the watchdog's deadline), and, with
    no calls, when this rank's own calls are done and it waits for the others
    (so a rank still computing is seen to be behind)."""
    if on_phase:
        on_phase(settings.warmup, 0.0)
    for _ in range(settings.warmup):
        op()
    backend.synchronize()
    if on_phase:
        on_phase(0, 0.0)
    backend.control_barrier()
    own, maxed = [], []
    batch = settings.iters
    start = time.monotonic()
    while True:
        if on_phase:
            on_phase(batch, settings.time_budget_s)
        s = backend.time_iterations(op, batch)
        if on_phase:
            on_phase(0, 0.0)
        own += s
        maxed += backend.control_reduce(np.asarray(s, dtype=np.float64), "max").tolist()
        stop = True
        if backend.rank == 0:
            done, spent = len(maxed), time.monotonic() - start
            stop = (settings.target_ci <= 0
                    or done >= settings.max_iters
                    or spent >= settings.time_budget_s
                    or (done >= stats.MIN_CI_SAMPLES and spent >= settings.min_time_s
                        and stats.precision(maxed, settings.ci_of) <= settings.target_ci))
            # the next batch doubles the count, within the iteration cap and
            # (estimated from the median so far) the time left
            left = settings.time_budget_s - (time.monotonic() - start)
            per_iter = max(float(np.median(maxed)), 1e-9)
            batch = int(max(1, min(done, settings.max_iters - done, left / per_iter)))
        stop, batch = backend.control_bcast((stop, batch))
        if stop:
            return Timed(samples_s=maxed, own_samples_s=own)
