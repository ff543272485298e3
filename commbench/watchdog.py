"""Deadlines for a run's collectives, and what a rank does when one passes or a
peer disappears.

Every rank runs a daemon thread that knows the case in progress and a deadline.
The sweep re-arms it at each point of progress (a case's start, the end of its
check, of its warmup, of each timed batch): a phase must end within

    T + (its collective calls) x nbytes / 100 MB/s

where T is `--timeout` when given, else max(60 s, 10 x nbytes / 100 MB/s)
(`collective_timeout_s`), plus `--time-budget` for timed batches (their size is
chosen to fill it). When the deadline passes, or a collective fails because a
peer went away, the rank finds which ranks did not answer, the lowest rank
that did prints ONE line on stderr and every rank ends with EXIT_TIMEOUT (124)
through os._exit (the results file holds whole, fsynced lines only).

Which ranks did not answer: every rank writes its position (case index, phase
number) and pid to a small file in a directory of the host's temp dir named
after the run id. A rank on this host whose process is gone, or whose position
is behind the most advanced one, did not answer. Ranks on other hosts cannot
be seen from here and are named "unknown" (then the lowest answering rank of
each host prints its line).

Interruptions: SIGINT and SIGTERM raise Interrupted in the main thread; the
rank marks itself interrupted, so a peer whose collective fails because of it
ends with the same status (130 / 143) instead of reporting a timeout."""
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time

EXIT_TIMEOUT = 124
RATE_BPS = 100e6            # the slow-but-alive rate the default timeout assumes: 100 MB/s
FLOP_RATE = 1e9             # and of compute: 1 GFLOP/s (a slow CPU core in emulated bf16 does more)
MIN_TIMEOUT_S = 60.0
MIN_RENDEZVOUS_S = 300.0


def collective_timeout_s(nbytes: int, given: float | None = None) -> float:
    """T of a collective of nbytes: --timeout when given, else max(60 s, 10 x
    the time nbytes take at 100 MB/s)."""
    if given is not None:
        return float(given)
    return max(MIN_TIMEOUT_S, 10.0 * nbytes / RATE_BPS)


def rendezvous_timeout_s(given: float | None = None, largest_nbytes: int = 0) -> float:
    """Of the rendezvous and of the backend's own operation timeout (above every
    phase deadline, so the watchdog speaks first): --timeout when given, else
    300 s or twice the largest collective's deadline."""
    if given is not None:
        return float(given)
    return max(MIN_RENDEZVOUS_S, 2 * collective_timeout_s(largest_nbytes))


def call_bound_s(nbytes: float = 0.0, flops: float = 0.0) -> float:
    """The longest a live rank may take for one call moving nbytes and doing
    flops: at 100 MB/s and 1 GFLOP/s."""
    return max(nbytes / RATE_BPS, flops / FLOP_RATE)


def phase_deadline_s(nbytes: int, calls: int, given: float | None = None, budget_s: float = 0.0) -> float:
    return collective_timeout_s(nbytes, given) + calls * nbytes / RATE_BPS + budget_s


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; exit status 128 + signum. message is the one
    line to print (None on the ranks that stay quiet)."""

    def __init__(self, signum: int, message: str | None = None):
        super().__init__(signum)
        self.signum, self.message = signum, message

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")       # a zombie is dead, only not reaped yet
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Progress:
    """This rank's position in a small file other ranks of the host can read."""

    def __init__(self, run_id: str, rank: int, world_size: int, hosts: list, host: str):
        self.rank, self.world_size, self.hosts, self.host = rank, world_size, hosts, host
        if rank == min(r for r in range(world_size) if hosts[r] == host):
            remove_stale(tempfile.gettempdir())
        self.dir = os.path.join(tempfile.gettempdir(), f"commbench-{run_id}")
        os.makedirs(self.dir, exist_ok=True)
        self.pos, self.state = (-1, 0), "running"
        self.watchdog = None        # the Watchdog watching this rank, while there is one
        self.write()

    def _path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.json")

    def write(self):
        tmp = self._path(self.rank) + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"pid": os.getpid(), "pos": list(self.pos), "state": self.state}, f)
            os.replace(tmp, self._path(self.rank))
        except OSError:
            pass            # progress is a diagnosis aid: a full /tmp must not stop the run

    def read_all(self) -> dict:
        """rank -> {"pid", "pos", "state"} for the ranks of this host whose file is readable."""
        out = {}
        for r in range(self.world_size):
            try:
                with open(self._path(r)) as f:
                    out[r] = json.load(f)
            except (OSError, ValueError):
                pass
        return out

    def missing(self) -> tuple[list, list, list]:
        """(ranks that did not answer, with reasons; ranks that answered; ranks
        that cannot be seen from this host). A rank that ended because of the
        timeout itself (state "timeout") answered: its position still counts."""
        seen = self.read_all()
        seen[self.rank] = {"pid": os.getpid(), "pos": list(self.pos), "state": self.state}
        gone = {r for r, d in seen.items()
                if r != self.rank and d.get("state") != "timeout" and not _alive(int(d.get("pid", -1)))}
        front = max((tuple(d["pos"]) for r, d in seen.items() if r not in gone), default=(0, 0))
        silent, answered, unknown = [], [], []
        for r in range(self.world_size):
            if self.hosts[r] != self.host:
                unknown.append(r)
            elif r not in seen:
                silent.append((r, "never registered"))
            elif r in gone:
                silent.append((r, "process gone"))
            elif tuple(seen[r]["pos"]) < front:
                silent.append((r, "still in an earlier step"))
            else:
                answered.append(r)
        return silent, answered, unknown

    def interrupted_peer(self) -> bool:
        return any(d.get("state") == "interrupted" for r, d in self.read_all().items() if r != self.rank)

    def remove(self):
        for p in (self._path(self.rank), self._path(self.rank) + ".tmp"):
            try:
                os.unlink(p)
            except OSError:
                pass
        try:
            os.rmdir(self.dir)      # the last rank out removes the directory
        except OSError:
            pass


def remove_stale(tmp: str, min_age_s: float = 60.0):
    """Remove the progress directories of runs that ended without removing
    their own (a rank that timed out or was killed exits at once): older than
    min_age_s, and every rank's process in them gone."""
    now = time.time()
    try:
        names = [n for n in os.listdir(tmp) if re.fullmatch(r"commbench-[0-9a-f]{12}", n)]
    except OSError:
        return
    for name in names:
        d = os.path.join(tmp, name)
        try:
            if now - os.stat(d).st_mtime < min_age_s:
                continue
            files = os.listdir(d)
            pids = []
            for f in files:
                if f.endswith(".json"):
                    with open(os.path.join(d, f)) as fh:
                        pids.append(int(json.load(fh).get("pid", -1)))
            if any(_alive(p) for p in pids):
                continue
            for f in files:
                os.unlink(os.path.join(d, f))
            os.rmdir(d)
        except (OSError, ValueError, AttributeError):
            continue            # another rank removed it first, or not ours to judge


def _ranks(rs) -> str:
    return ", ".join(map(str, rs))


class Watchdog:
    """A daemon thread ending this process when the armed deadline passes."""

    def __init__(self, progress: Progress, out_path: str | None = None, stream=None):
        self.progress, self.out_path = progress, out_path
        self.stream = stream or sys.stderr
        progress.watchdog = self
        self._lock = threading.Lock()
        # held by the first report(): the watchdog thread's deadline and the main
        # thread's failed collective can both find the same stall at once
        self._reporting = threading.Lock()
        self._deadline, self._what, self._limit = None, "", 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="commbench-watchdog", daemon=True)
        self._thread.start()

    def arm(self, case_index: int, phase: int, what: str, limit_s: float):
        """Position (case_index, phase) reached; what follows must end within limit_s."""
        with self._lock:
            self.progress.pos = (case_index, phase)
            self._what, self._limit = what, limit_s
            self._deadline = time.monotonic() + limit_s
        self.progress.write()

    def disarm(self):
        with self._lock:
            self._deadline = None

    @property
    def armed(self) -> bool:
        return self._deadline is not None

    @property
    def what(self) -> str:
        return self._what

    def close(self):
        self._stop.set()
        self.disarm()
        self.progress.watchdog = None

    def _watch(self):
        while not self._stop.wait(0.2):
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what, limit = self._what, self._limit
            if late:
                self.report(what, f"within {limit:.0f} s")

    def report(self, what: str, how: str, cause: str | None = None):
        """Print the one line (if this rank is the lowest that answered) and end
        the process with EXIT_TIMEOUT; never returns. A second call while the
        first runs waits for it to end the process (one line per rank)."""
        if not self._reporting.acquire(blocking=False):
            while True:
                time.sleep(1)
        try:
            silent, answered, unknown = self.progress.missing()
            self.progress.state = "timeout"
            self.progress.write()
            mine = [r for r, _ in silent]
            if self.progress.rank not in mine and answered and self.progress.rank == min(answered):
                if silent:
                    who = "; ".join(f"rank {r} ({why})" for r, why in silent)
                    if unknown:
                        who += f"; ranks {_ranks(unknown)} on other hosts: unknown"
                elif unknown:
                    who = f"unknown (ranks {_ranks(unknown)} are on other hosts)"
                else:
                    who = "unknown (every rank of this host reached it)"
                line = f"commbench: timeout: {what}: did not complete {how}; ranks that did not answer: {who}"
                if cause:
                    line += f" [{cause}]"
                if self.out_path:
                    line += f"; finished results are in {self.out_path}"
                self.stream.write(line + "\n")
                self.stream.flush()
        finally:
            os._exit(EXIT_TIMEOUT)

    def peer_failed(self, what: str, exc: BaseException):
        """A collective raised: if a peer went away (or was interrupted), end as
        report() does (or with the interrupt's status); else return, and the
        caller re-raises its error."""
        text = re.sub(r"\[[^\]]*\.(cc|cpp|c|h|hpp):\d+\] ?", "", str(exc).splitlines()[0] if str(exc) else "")
        cause = f"{type(exc).__name__}: {text}"[:200]
        end = time.monotonic() + 3.0        # the launcher may take a moment to reap a dead peer
        while True:
            if self.progress.interrupted_peer():
                raise Interrupted(signal.SIGTERM)
            silent, _, _ = self.progress.missing()
            if silent:
                self.report(what, "because a peer stopped answering", cause)
            if time.monotonic() > end:
                return
            time.sleep(0.1)


class InterruptHandlers:
    """SIGINT/SIGTERM raise Interrupted in the main thread while installed.

    A launcher that stops the job because one rank died (torchrun does, with
    SIGTERM) is not an interruption: when a watchdog is armed and a peer's
    process is gone, the signal ends this rank as that peer's death does
    (EXIT_TIMEOUT and the one line naming it)."""

    def __init__(self, progress: Progress | None = None):
        self.progress = progress
        self._old = {}

    def _handle(self, signum, _frame):
        wd = self.progress.watchdog if self.progress is not None else None
        if wd is not None and wd.armed:
            silent, _, _ = self.progress.missing()
            if any(why == "process gone" for _, why in silent):
                wd.report(wd.what, "because a peer stopped answering",
                          f"{signal.Signals(signum).name} from the launcher")
        if self.progress is not None:
            self.progress.state = "interrupted"
            self.progress.write()
        raise Interrupted(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False


class Guard:
    """The sweep's protection for work outside a sweep (compute, interference,
    validate's training steps): every rank passes the same steps in the same
    order; step(what, limit_s) opens one with a deadline of T + limit_s (T as
    collective_timeout_s: --timeout, else 60 s), phase(limit_s) re-arms it
    within the step. A RuntimeError or OSError inside a step (a collective
    failed) ends the rank as the sweep does when a peer is gone or interrupted,
    and is re-raised otherwise. SIGINT/SIGTERM raise Interrupted."""

    def __init__(self, name: str, backend, hosts: list, run_id: str, out_path: str | None,
                 timeout_s: float | None = None):
        self.name, self.timeout_s = name, timeout_s
        self.progress = Progress(run_id, backend.rank, backend.world_size, hosts, hosts[backend.rank])
        self.handlers = InterruptHandlers(self.progress)
        self.watchdog = Watchdog(self.progress, out_path)
        self._index, self._phase = 0, 0

    def __enter__(self):
        self.handlers.__enter__()
        return self

    def __exit__(self, *exc):
        self.watchdog.close()
        self.handlers.__exit__(*exc)
        self.progress.remove()
        return False

    def phase(self, limit_s: float):
        self._phase += 1
        self.watchdog.arm(self._index, self._phase, self.watchdog.what,
                          collective_timeout_s(0, self.timeout_s) + limit_s)

    def on_phase(self, call_s: float):
        """timing.measure's on_phase for an op of call_s per call (call_bound_s)."""
        return lambda calls, budget_s=0.0: self.phase(calls * call_s + budget_s)

    def begin(self, what: str, limit_s: float):
        """The next step starts: it must end within T + limit_s."""
        hang_injection(self.progress.rank, self._index + 1, self.name)     # steps count from 1
        self._index, self._phase = self._index + 1, 0
        self.watchdog.arm(self._index, 0, what, collective_timeout_s(0, self.timeout_s) + limit_s)

    @contextlib.contextmanager
    def watching(self):
        """A failed collective inside: a gone or interrupted peer ends the rank
        (naming the step in progress); other errors are re-raised."""
        try:
            yield self
        except (RuntimeError, OSError) as e:
            self.watchdog.peer_failed(self.watchdog.what, e)
            raise
        finally:
            self.watchdog.disarm()

    @contextlib.contextmanager
    def step(self, what: str, limit_s: float):
        self.begin(what, limit_s)
        with self.watching():
            yield self


def open_backend(name: str, launch, device: str, limit_s: float, **options):
    """backends.create under a RendezvousGuard of limit_s (also the backend's
    own operation timeout)."""
    from commbench import backends
    with RendezvousGuard(f"{name} on {launch.world_size} ranks", limit_s, launch.rank):
        return backends.create(name, launch, device, limit_s, **options)


def interruptible(rank: int, where: str, work):
    """work() with SIGINT/SIGTERM ending it as a sweep ends: one line from rank 0
    naming where the finished results are, exit status 128 + the signal."""
    try:
        with InterruptHandlers():
            return work()
    except Interrupted as e:
        if rank == 0:
            e.message = f"commbench: interrupted by {signal.Signals(e.signum).name}: finished results are in {where}"
        raise


class RendezvousGuard:
    """A deadline for backend creation (the rendezvous), before any run id or
    progress file exists: past limit_s + 5 s, EXIT_TIMEOUT and one line from
    rank 0; when the backend itself gives up with a timeout error, every rank
    that got it says so (rank 0, holding the store, may be the one missing)."""

    def __init__(self, what: str, limit_s: float, rank: int):
        self.what, self.limit_s, self.rank = what, limit_s, rank
        self._timer = threading.Timer(limit_s + 5.0, self._expire)
        self._timer.daemon = True

    def line(self, cause: str | None = None) -> str:
        s = (f"commbench: timeout: rendezvous of {self.what}: did not complete within {self.limit_s:.0f} s; "
             f"ranks that did not answer: unknown (rank {self.rank} waited)")
        return s + (f" [{cause}]" if cause else "")

    def _expire(self):
        if self.rank == 0:
            sys.stderr.write(self.line() + "\n")
            sys.stderr.flush()
        os._exit(EXIT_TIMEOUT)

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, typ, exc, tb):
        self._timer.cancel()
        if exc is not None and isinstance(exc, Exception) and "time" in str(exc).lower() \
                and "out" in str(exc).lower():
            sys.stderr.write(self.line(f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:240]) + "\n")
            sys.stderr.flush()
            os._exit(EXIT_TIMEOUT)
        return False


def hang_injection(rank: int, index: int, where: str = "run"):
    """Fault injection for the reliability tests: COMMBENCH_INJECT_HANG=R:I[:WHERE]
    makes rank R stop answering before case I of a sweep (WHERE "run", the
    default) or step I of a Guard named WHERE (compute, interference, training);
    it sleeps, and its own watchdog ends it."""
    r, _, rest = os.environ.get("COMMBENCH_INJECT_HANG", "").partition(":")
    i, _, w = rest.partition(":")
    if r.isdigit() and i.isdigit() and int(r) == rank and int(i) == index and (w or "run") == where:
        while True:
            time.sleep(1)
