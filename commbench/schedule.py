"""Event simulation for the predictor: the pipeline schedules (GPipe, 1F1B,
interleaved 1F1B) as compute ops on each pp rank (the DP collectives are placed
on the resulting timelines by predict.dp_calls / place_dp).

Pure Python, no torch: the predictor feeds it measured per-chunk compute times
and modelled p2p / collective times.

Pipeline model (simulate_pipeline)
----------------------------------
Chunk c (a virtual stage, c = 0 .. pp*v - 1) lives on rank c % pp (Megatron's
interleaved assignment; with v = 1 chunk c is stage c). F(c, j) is the forward of
micro-batch j through chunk c, B(c, j) its backward. Each rank runs its op list
strictly in order; an op starts when its rank is free and its input has arrived:
  F(c, j) needs F(c-1, j) + p2p(c-1)            (activation from the chunk before)
  B(c, j) needs B(c+1, j) + p2p(c) and F(c, j)  (gradient from the chunk after)
p2p(k) is the transfer over boundary k (chunk k -> k+1 forward, k+1 -> k backward)
and costs 0 when both chunks sit on one rank (only when pp == 1). In GPipe and
1F1B an input can arrive later than that, when its receive is posted late, and
the sender can wait too (Transfers, below).

Transfers. A transfer ends p2p after the later of its two posts, the send's and
the receive's: gloo moves nothing before the receiver has posted (its tcp
Pair::send writes only to a remote pending receive; otherwise it notifies the
peer and waits for the receive's notice), and NCCL moves a message larger than
its buffers only as the receiver drains them. GPipe and 1F1B (v = 1) are
therefore simulated post by post, each rank running torch's schedule as its
program (_torch_programs):
  GPipe (ScheduleGPipe): each forward posts its receive just before it, waits,
    computes and posts its send; the forward sends are waited for before the
    backward phase, which does the same with gradients, and the backward sends
    at the end. A transfer into a rank still busy with its previous micro-batch
    starts when that rank is free.
  1F1B (Schedule1F1B): a rank's warmup forwards (pp - r) each receive and wait,
    compute, wait for the previous forward's send and post their own; in the
    steady state the rank posts its pending send together with the next
    receive from the same neighbour (one batched isend/irecv: the activation of
    its last forward with the gradient of the next backward, then the gradient
    of that backward with the activation of the next forward) and waits for
    both, as Megatron's send_forward_recv_backward and
    send_backward_recv_forward do; the cooldown receives, computes, waits for
    the previous send and posts its own; the rank finally waits for its last
    send. So neighbours meet: an exchange ends d after the later of the two
    ranks arrives, and both go on from there.
Interleaved 1F1B keeps the simpler model, sends asynchronous and receives
waited for: torch's runtime posts a rank's receive where its sender's compute
sits in the lock-step order, usually well before the compute that needs it, so
a transfer delays its consumer only, from the send's post. Megatron's optional
overlap of p2p with compute in the interleaved schedule is not modelled: a
receive sits on the critical path of the op that needs it. Transfers use no
compute time and do not slow compute.

Makespan of uniform stages (f, b per stage and micro-batch, v = 1):
  p2p = 0, 1F1B and GPipe: (m + pp - 1)(f + b). The last stage starts its first
    forward after pp-1 forwards upstream and then never idles (its F and B
    alternate, each input arriving in time); the first stage ends with the drain
    of pp-1 backwards downstream. The ideal is m(f + b), so the bubble is
    (pp-1)(f + b), fraction (pp-1)/m of the ideal.
  interleaved with chunk times f/v, b/v: m(f + b) + (pp-1)(f + b)/v: the fill and
    drain are pp-1 chunk-sized slots each way (Narayanan et al. 2021, sec. 2.2),
    bubble fraction (pp-1)/(v m).
  p2p = d > 0, GPipe: (m + pp - 1)(f + b) + 2(m + pp - 2)d: every stage of the
    fill and of the drain adds one transfer (pp-1 hops forward, pp-1 back), and
    each further micro-batch one more on the last stage's forwards and on the
    first stage's backwards: a rank posts the receive of F(j) only once F(j-1)
    is done, and waits d for it.
  p2p = d > 0, 1F1B: (m + pp - 1)(f + b) + h d, with h transfers on the
    critical path:
      pp = 2: h = m + 1. The two ranks meet once per micro-batch (rank 0 before
        B(k), rank 1 after it) and each meeting costs d; add the first
        activation's transfer.
      pp >= 3: h = 2(pp - 1) for m = 1 (micro-batch 0's round trip, as in
        GPipe) and 2m + 2pp - 5 for m >= 2. A middle rank meets its downstream
        neighbour before each backward and its upstream one before each
        forward, 2d per micro-batch, which its neighbours wait for in turn.
    Both for every f, b, d >= 0 (tests/test_schedule.py checks pp 2 - 7, m 1 - 15,
    and small cases by hand). As in Megatron's non-interleaved schedule, the p2p of
    1F1B is not overlapped: about d (pp = 2) or 2d per micro-batch is exposed.

Held last backward (hold_s): a chunk's last backward, B(c, m-1), may hold its
rank for hold_s[c] after its compute, before its gradient goes upstream and
before the rank's next op. That is DDP under torch.distributed.pipelining: the
schedule runs each chunk's last backward with DDP's reducer armed, and DDP's
finalize, inside that backward, waits for every bucket all-reduce (on a GPU the
stream waits, on a CPU the host), so the stage sends its gradient upstream only
once its data-parallel reduction is done. The hold is not compute: the
timelines and busy_s leave it out, so it shows up as idle time.

Bubble: bubble_s is the idle time of the critical rank, the busiest one:
makespan_s - max(busy_s) (first such rank on ties). With uniform stages every
rank is equally busy and this is the fill + drain time above.
"""
from dataclasses import dataclass, field
from functools import lru_cache
from numbers import Real
from typing import Callable, NamedTuple, Sequence, Union

SCHEDULES = ("gpipe", "1f1b", "interleaved")

TimeSpec = Union[float, Sequence[float]]
P2PSpec = Union[float, Sequence[float], Callable[[int], float]]


class Op(NamedTuple):
    """One compute op in a rank's timeline (a tuple: compares equal to
    (start_s, end_s, kind, microbatch, chunk))."""
    start_s: float
    end_s: float
    kind: str          # "F" or "B"
    microbatch: int
    chunk: int         # global chunk (virtual stage) index, on rank chunk % pp


@dataclass
class PipelineResult:
    pp: int
    num_microbatches: int
    interleave: int
    schedule: str
    makespan_s: float
    busy_s: list            # per rank: sum of its compute
    idle_s: list            # per rank: makespan_s - busy_s
    timelines: list         # per rank: list of Op in execution order
    critical_rank: int      # the busiest rank (lowest index on ties)
    bubble_s: float         # idle time of the critical rank: makespan_s - busy_s[critical_rank]
    last_bwd_end_s: list    # per rank: end of its last backward op, its hold included
    last_bwd_s: list = field(default_factory=list)
    # per rank: {chunk: (start_s, end_s)} of the last backward executed for that
    # chunk (micro-batch m-1), its compute (without a hold): that chunk's
    # gradients are final at end_s, its DP buckets become ready inside this interval.
    record: str = "all"     # the ops timelines hold: all, or (last) those of micro-batch m-1

    @property
    def bubble_fraction(self) -> float:
        """bubble_s as a fraction of the critical rank's compute (the ideal time)."""
        busy = self.busy_s[self.critical_rank]
        return self.bubble_s / busy if busy > 0 else 0.0


def _check_int(name: str, v, minimum: int = 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


def _check_time(name: str, v) -> float:
    if not isinstance(v, Real) or isinstance(v, bool) or not (v >= 0) or v == float("inf"):
        raise ValueError(f"{name} must be a finite time >= 0 s, got {v!r}")
    return float(v)


def _per_chunk(name: str, v: TimeSpec, n: int) -> list:
    if isinstance(v, Real) and not isinstance(v, bool):
        return [_check_time(name, v)] * n
    try:
        vals = list(v)
    except TypeError:
        raise ValueError(f"{name} must be a time in s or a sequence of {n} (one per chunk), got {v!r}") from None
    if len(vals) != n:
        raise ValueError(f"{name} has {len(vals)} values but there are {n} chunks (pp x interleave): "
                         "give one per chunk, or a scalar")
    return [_check_time(f"{name}[{i}]", x) for i, x in enumerate(vals)]


def _p2p_times(p2p_s: P2PSpec, pp: int, n: int) -> list:
    """Transfer time over each boundary k (chunk k <-> k+1), 0 on one rank."""
    nb = n - 1
    if callable(p2p_s):
        vals = [_check_time(f"p2p_s({k})", p2p_s(k)) for k in range(nb)]
    elif isinstance(p2p_s, Real) and not isinstance(p2p_s, bool):
        vals = [_check_time("p2p_s", p2p_s)] * nb
    else:
        try:
            vals = list(p2p_s)
        except TypeError:
            raise ValueError(f"p2p_s must be a time in s, a sequence or a callable, got {p2p_s!r}") from None
        if len(vals) != nb:
            raise ValueError(f"p2p_s has {len(vals)} values but there are {nb} chunk boundaries "
                             "(pp x interleave - 1): give one per boundary, or a scalar")
        vals = [_check_time(f"p2p_s[{k}]", x) for k, x in enumerate(vals)]
    return [0.0 if k % pp == (k + 1) % pp else t for k, t in enumerate(vals)]


def _check_plan(pp, num_microbatches, schedule, interleave) -> tuple:
    pp = _check_int("pp", pp)
    m = _check_int("num_microbatches", num_microbatches)
    v = _check_int("interleave", interleave)
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}: choose from {', '.join(SCHEDULES)}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"interleave {v} > 1 needs schedule 'interleaved', got {schedule!r}")
    if schedule == "interleaved" and m % pp:
        # Megatron's groups of pp micro-batches per chunk (and its assert)
        raise ValueError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of pp ({pp})")
    return pp, m, v


def rank_ops(pp: int, num_microbatches: int, rank: int, schedule: str = "1f1b", interleave: int = 1) -> list:
    """The compute ops of one rank in execution order: ("F"|"B", microbatch, chunk)."""
    pp, m, v = _check_plan(pp, num_microbatches, schedule, interleave)
    r = rank
    if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < pp:
        raise ValueError(f"rank must be an integer in [0, pp) = [0, {pp}), got {r!r}")
    if schedule == "gpipe":
        # torch ScheduleGPipe: every forward, then every backward in micro-batch order.
        return [("F", j, r) for j in range(m)] + [("B", j, r) for j in range(m)]
    if schedule == "1f1b":
        # Megatron forward_backward_pipelining_without_interleaving: pp - r - 1
        # warmup forwards, then steady F(w + i), B(i), then the cooldown backwards.
        # torch Schedule1F1B warms up with pp - r forwards and then runs B, F
        # pairs: the same sequence of ops.
        w = min(pp - r - 1, m)
        ops = [("F", j, r) for j in range(w)]
        for i in range(m - w):
            ops += [("F", w + i, r), ("B", i, r)]
        return ops + [("B", j, r) for j in range(m - w, m)]
    # Megatron forward_backward_pipelining_with_interleaving (the group size per
    # virtual stage is pp, the default microbatch_group_size_per_vp_stage), which
    # torch ScheduleInterleaved1F1B reproduces for m % pp == 0. Virtual micro-batch
    # k of the rank runs micro-batch (k // (pp v)) pp + k % pp on local chunk
    # (k % (pp v)) // pp in forward, v - 1 - that in backward: pp micro-batches
    # through local chunk 0, the same pp through chunk 1, ..., then the next pp.
    total = m * v
    group = pp * v

    def mb(k):
        return (k // group) * pp + k % pp

    def fwd(k):
        return ("F", mb(k), ((k % group) // pp) * pp + r)

    def bwd(k):
        return ("B", mb(k), (v - 1 - (k % group) // pp) * pp + r)

    # Warmup: (pp - r - 1) * 2 + (v - 1) * pp forwards, at most all of them. The
    # (v - 1) pp let the last rank fill its first v - 1 chunks with one group each
    # before its first backward (of chunk v-1) can start; each rank upstream needs
    # two more, one for the extra hop forward and one for the gradient's hop back.
    w = min((pp - r - 1) * 2 + (v - 1) * pp, total)
    ops = [fwd(k) for k in range(w)]
    for i in range(total - w):
        ops += [fwd(w + i), bwd(i)]
    return ops + [bwd(k) for k in range(total - w, total)]


@lru_cache(maxsize=256)
def _checked_rank_ops(pp: int, m: int, schedule: str, v: int) -> tuple:
    """Every rank's op list (rank_ops), checked to hold each (micro-batch, chunk)
    once per kind: a wrong order would deadlock the simulation; say which rule
    broke. Kept per plan shape: a search simulates the same shape many times."""
    n = pp * v
    ops = tuple(tuple(rank_ops(pp, m, r, schedule, v)) for r in range(pp))
    for r, lst in enumerate(ops):
        for kind in "FB":
            got = sorted((j, c) for k, j, c in lst if k == kind)
            want = sorted((j, c) for c in range(r, n, pp) for j in range(m))
            if got != want:
                raise AssertionError(f"rank {r}: {kind} ops {got} are not each (micro-batch, chunk) once")
    return ops


def _result(pp, m, v, schedule, free, busy, timelines, last_end, last_bwd, record) -> PipelineResult:
    """The PipelineResult of a finished simulation (free: each rank's end)."""
    makespan = max(free)
    crit = max(range(pp), key=lambda r: (busy[r], -r))
    return PipelineResult(
        pp=pp, num_microbatches=m, interleave=v, schedule=schedule, makespan_s=makespan, busy_s=busy,
        idle_s=[makespan - x for x in busy], timelines=timelines, critical_rank=crit,
        bubble_s=makespan - busy[crit], last_bwd_end_s=last_end, last_bwd_s=last_bwd, record=record)


# The actions of a rank's GPipe or 1F1B program, (opcode, x, y), in the order
# of torch's schedule. Transfers are keys: the activation of micro-batch j over
# boundary k is 2 (k m + j), its gradient 2 (k m + j) + 1 (-1: none).
_FWD = 0        # forward of micro-batch x
_BWD = 1        # backward of micro-batch x
_POST = 2       # post send x (if x >= 0) and receive y, and wait for both
_SEND = 3       # post send x, not waited for here
_WAIT = 4       # wait for send x (posted earlier), then post send y if y >= 0


@lru_cache(maxsize=256)
def _torch_programs(pp: int, m: int, schedule: str) -> tuple:
    """Every rank's program in torch's GPipe or 1F1B, checked to run rank_ops'
    compute order (for 1F1B Megatron's: torch's and Megatron's are one schedule)."""
    build = _torch_gpipe_program if schedule == "gpipe" else _torch_1f1b_program
    progs = tuple(build(pp, m, r) for r in range(pp))
    for r, (prog, want) in enumerate(zip(progs, _checked_rank_ops(pp, m, schedule, 1))):
        got = [("F" if op == _FWD else "B", j, r) for op, j, _ in prog if op in (_FWD, _BWD)]
        if got != list(want):
            raise AssertionError(f"rank {r}: torch's {schedule} runs {got}, rank_ops says {list(want)}")
    return progs


def _transfer_keys(m: int) -> tuple:
    """(act, grad): the keys of the activation and of the gradient of micro-batch
    j over boundary k."""
    return (lambda k, j: 2 * (k * m + j)), (lambda k, j: 2 * (k * m + j) + 1)


def _torch_gpipe_program(pp: int, m: int, r: int) -> tuple:
    """Rank r's actions in torch's ScheduleGPipe: each forward receives (posted
    and waited for just before it) and sends; the forward sends are waited for
    before the backward phase, which does the same with gradients."""
    up, down = r > 0, r < pp - 1
    act, grad = _transfer_keys(m)
    prog = []
    for j in range(m):
        if up:
            prog.append((_POST, -1, act(r - 1, j)))
        prog.append((_FWD, j, 0))
        if down:
            prog.append((_SEND, act(r, j), 0))
    prog += [(_WAIT, act(r, j), -1) for j in range(m) if down]
    for j in range(m):
        if down:
            prog.append((_POST, -1, grad(r, j)))
        prog.append((_BWD, j, 0))
        if up:
            prog.append((_SEND, grad(r - 1, j), 0))
    prog += [(_WAIT, grad(r - 1, j), -1) for j in range(m) if up]
    return tuple(prog)


def _torch_1f1b_program(pp: int, m: int, r: int) -> tuple:
    """Rank r's actions in torch's Schedule1F1B (see "Transfers" above)."""
    up, down = r > 0, r < pp - 1
    act, grad = _transfer_keys(m)
    prog = []
    w = min(m, pp - r)
    for j in range(w):                  # warmup: receive, forward, wait for the last send, send
        if up:
            prog.append((_POST, -1, act(r - 1, j)))
        prog.append((_FWD, j, 0))
        if down and 0 < j < w - 1:
            prog.append((_WAIT, act(r, j - 1), act(r, j)))
        elif down and j == 0 < w - 1:
            prog.append((_SEND, act(r, j), 0))
        elif down and j > 0:            # the last warmup send waits for the exchange below
            prog.append((_WAIT, act(r, j - 1), -1))
    fwd, k = w, 0
    while True:                         # steady: exchange, backward, exchange, forward
        if down:
            prog.append((_POST, act(r, fwd - 1), grad(r, k)))
        prog.append((_BWD, k, 0))
        k += 1
        if fwd == m:
            break
        if up:
            prog.append((_POST, grad(r - 1, k - 1), act(r - 1, fwd)))
        prog.append((_FWD, fwd, 0))
        fwd += 1
    if up:
        prog.append((_SEND, grad(r - 1, k - 1), 0))
    for k in range(k, m):               # cooldown: receive, backward, wait for the last send, send
        if down:
            prog.append((_POST, -1, grad(r, k)))
        prog.append((_BWD, k, 0))
        if up:
            prog.append((_WAIT, grad(r - 1, k - 1), grad(r - 1, k)))
    if up:
        prog.append((_WAIT, grad(r - 1, m - 1), -1))
    return tuple(prog)


def _simulate_programs(pp, m, schedule, f, b, d, hold, record) -> PipelineResult:
    """simulate_pipeline for GPipe and 1F1B: each rank runs its program
    (_torch_programs); a transfer ends p2p after the later of its two posts."""
    progs = _torch_programs(pp, m, schedule)
    lag = [d[key // (2 * m)] for key in range(2 * (pp - 1) * m)]     # per transfer: its p2p time
    sent = [-1.0] * len(lag)            # per transfer: when its send / receive was posted (-1: not yet)
    recv = [-1.0] * len(lag)
    timelines = [[] for _ in range(pp)]
    busy = [0.0] * pp
    last_bwd = [{} for _ in range(pp)]
    last_end = [0.0] * pp
    nxt = [0] * pp
    free = [0.0] * pp
    keep_from = 0 if record == "all" else m - 1
    new_op = tuple.__new__
    sweeps = (range(pp), range(pp - 1, -1, -1))
    remaining = sum(len(p) for p in progs)
    rnd = 0
    while remaining:
        progressed = False
        for r in sweeps[rnd % 2]:
            prog, i, t, fr, br, tl, bsy = progs[r], nxt[r], free[r], f[r], b[r], timelines[r], busy[r]
            n_prog = len(prog)
            i0 = i
            while i < n_prog:
                op, x, y = prog[i]
                if op == _POST:             # posting again after a blocked try is the same post
                    if x >= 0:
                        sent[x] = t
                    recv[y] = t
                    s = sent[y]
                    if s < 0:
                        break
                    end = (s if s > t else t) + lag[y]
                    if x >= 0:
                        q = recv[x]
                        if q < 0:
                            break
                        e = (q if q > t else t) + lag[x]
                        if e > end:
                            end = e
                    t = end
                elif op == _FWD:
                    if x >= keep_from:
                        tl.append(new_op(Op, (t, t + fr, "F", x, r)))
                    t += fr
                    bsy += fr
                elif op == _BWD:
                    if x >= keep_from:
                        tl.append(new_op(Op, (t, t + br, "B", x, r)))
                    if x == m - 1:
                        last_bwd[r][r] = (t, t + br)
                        t += br + hold[r]
                        last_end[r] = t
                    else:
                        t += br
                    bsy += br
                elif op == _SEND:
                    sent[x] = t
                else:
                    q = recv[x]
                    if q < 0:
                        break
                    e = (q if q > sent[x] else sent[x]) + lag[x]
                    if e > t:
                        t = e
                    if y >= 0:
                        sent[y] = t
                i += 1
            if i > i0:
                remaining -= i - i0
                progressed = True
                nxt[r], free[r], busy[r] = i, t, bsy
        rnd += 1
        if not progressed:
            stuck = {r: progs[r][nxt[r]] for r in range(pp) if nxt[r] < len(progs[r])}
            raise AssertionError(f"schedule {schedule} deadlocks; next actions per rank: {stuck}")
    return _result(pp, m, 1, schedule, free, busy, timelines, last_end, last_bwd, record)


def simulate_pipeline(pp: int, num_microbatches: int, fwd_s: TimeSpec, bwd_s: TimeSpec, p2p_s: P2PSpec = 0.0,
                      schedule: str = "1f1b", interleave: int = 1, record: str = "all",
                      hold_s: TimeSpec = 0.0) -> PipelineResult:
    """Simulate one step of a pipeline schedule; see the module docstring for the model.

    fwd_s / bwd_s: time of one micro-batch's forward / backward through each chunk
    (a sequence of pp * interleave values, chunk c on rank c % pp) or one scalar for
    all. p2p_s: one transfer over a chunk boundary: a scalar, a sequence of
    pp * interleave - 1 values, or a callable boundary k -> seconds (boundary k
    is between chunk k and k+1, used for the activation and for its gradient).
    record: "all" keeps every op in the timelines; "last" only those of the last
    micro-batch (what the DP collectives issued once per step are placed on),
    which saves building the others; every other field is complete either way.
    hold_s: per chunk (or one scalar), how long its last backward B(c, m-1)
    holds the rank after its compute (see "Held last backward" above): the
    gradient it sends, the rank's next op and last_bwd_end_s wait for it; the
    timelines, last_bwd_s and busy_s hold compute only."""
    pp, m, v = _check_plan(pp, num_microbatches, schedule, interleave)
    if record not in ("all", "last"):
        raise ValueError(f"record {record!r}: choose all or last")
    n = pp * v
    f = _per_chunk("fwd_s", fwd_s, n)
    b = _per_chunk("bwd_s", bwd_s, n)
    d = _p2p_times(p2p_s, pp, n)
    hold = _per_chunk("hold_s", hold_s, n)

    if schedule in ("gpipe", "1f1b") and pp > 1:
        return _simulate_programs(pp, m, schedule, f, b, d, hold, record)
    ops = _checked_rank_ops(pp, m, schedule, v)

    # end times of F(c, j) and B(c, j), indexed [c][j]; None until it has run
    end_f = [[None] * m for _ in range(n)]
    end_b = [[None] * m for _ in range(n)]
    timelines = [[] for _ in range(pp)]
    busy = [0] * pp                 # per rank: its ops' durations summed in execution order
    last_bwd = [{} for _ in range(pp)]  # per rank: chunk -> (start, end) of its last backward
    new_op = tuple.__new__          # Op(...) without NamedTuple's slower __new__
    nxt = [0] * pp
    free = [0.0] * pp
    remaining = sum(len(lst) for lst in ops)
    # Sweep the ranks down and up in turn: activations flow to higher ranks and
    # gradients to lower ones, so each sweep direction carries one of them along.
    # (Any order gives the same times: an op's start depends only on its inputs.)
    sweeps = (range(pp), range(pp - 1, -1, -1))
    rnd = 0
    keep_from = 0 if record == "all" else m - 1      # the first micro-batch whose ops the timelines keep
    while remaining:
        progressed = False
        for r in sweeps[rnd % 2]:
            lst, i, t_free, tl, bsy, lb = ops[r], nxt[r], free[r], timelines[r], busy[r], last_bwd[r]
            i0 = i
            while i < len(lst):
                kind, j, c = lst[i]
                # the op starts at the latest of: its rank free, each input's end + its lag
                # (written out as comparisons: max() of the same values, without its call)
                start = t_free
                if kind == "F":
                    if c:
                        e = end_f[c - 1][j]
                        if e is None:
                            break
                        e += d[c - 1]
                        if e > start:
                            start = e
                    stop = start + f[c]
                    bsy += f[c]
                    end_f[c][j] = stop
                else:
                    e = end_f[c][j]
                    if e is None:
                        break
                    if c == n - 1:
                        if e > start:
                            start = e
                    else:
                        e2 = end_b[c + 1][j]
                        if e2 is None:
                            break
                        if e > start:
                            start = e
                        e2 += d[c]
                        if e2 > start:
                            start = e2
                    stop = start + b[c]
                    bsy += b[c]
                    lb[c] = (start, stop)       # the later one wins: the last executed
                    if j == m - 1:
                        stop += hold[c]         # the rank and the gradient wait; not compute
                    end_b[c][j] = stop
                if j >= keep_from:
                    tl.append(new_op(Op, (start, start + (f[c] if kind == "F" else b[c]), kind, j, c)))
                t_free = stop
                i += 1
            if i > i0:
                remaining -= i - i0
                progressed = True
                nxt[r], free[r], busy[r] = i, t_free, bsy
        rnd += 1
        if not progressed:
            stuck = {r: ops[r][nxt[r]] for r in range(pp) if nxt[r] < len(ops[r])}
            raise AssertionError(f"schedule {schedule} deadlocks; next ops per rank: {stuck}")
    return _result(pp, m, v, schedule, free, busy, timelines,
                   [max(end_b[c][m - 1] for c in lb) for lb in last_bwd], last_bwd, record)
