"""commbench.schedule: the pipeline simulation against closed forms and timelines
written out by hand.
Times are small binary fractions (0.25, 0.5, 1, 2, ...) so sums are exact."""
import random

import pytest

from commbench.schedule import rank_ops, simulate_pipeline


def ops_of(res, rank):
    return [(o.kind, o.microbatch, o.chunk) for o in res.timelines[rank]]


# --- closed forms ------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_pp1_is_m_times_f_plus_b(schedule, m):
    v = 2 if schedule == "interleaved" else 1
    f, b = 1.0, 2.0
    res = simulate_pipeline(1, m, f / v, b / v, p2p_s=5.0, schedule=schedule, interleave=v)
    # one rank: nothing to wait for; consecutive chunks share the rank, so p2p is 0
    assert res.makespan_s == m * (f + b)
    assert res.bubble_s == 0 and res.idle_s == [0.0]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 2), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_uniform_no_p2p(schedule, pp, m):
    f, b = 1.0, 2.0
    res = simulate_pipeline(pp, m, f, b, schedule=schedule)
    # (m + pp - 1)(f + b): pp - 1 slots of fill and of drain around m(f + b)
    assert res.makespan_s == (m + pp - 1) * (f + b)
    assert res.busy_s == [m * (f + b)] * pp
    assert res.bubble_s == (pp - 1) * (f + b)
    assert res.bubble_fraction == pytest.approx((pp - 1) / m)


@pytest.mark.parametrize("pp,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 4, 8), (3, 3, 6), (8, 2, 16)])
def test_interleaved_bubble(pp, v, m):
    f, b = 1.0, 2.0
    n = pp * v
    res = simulate_pipeline(pp, m, [f / v] * n, [b / v] * n, schedule="interleaved", interleave=v)
    # chunk-sized fill and drain: bubble (pp-1)(f+b)/v, fraction (pp-1)/(v m)
    assert res.makespan_s == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / v)
    assert res.bubble_s == pytest.approx((pp - 1) * (f + b) / v)
    assert res.bubble_fraction == pytest.approx((pp - 1) / (v * m))
    assert res.busy_s == pytest.approx([m * (f + b)] * pp)


def test_gpipe_p2p_pp2_by_hand():
    """pp = 2, m = 2, f = 1, b = 2, d = 0.5, torch ScheduleGPipe: a receive is
    posted just before the compute that needs it, a transfer ends d after the
    later of its two posts, and the forward sends are waited for before the
    backward phase.
      r0 F0 [0, 1] sends act 0 at 1 (r1 posted its receive at 0): it ends 1.5
      r0 F1 [1, 2] sends act 1 at 2
      r1 F0 [1.5, 2.5], posts the receive of act 1 at 2.5: it ends 3; F1 [3, 4]
      r0 waits for its sends (3), posts the receive of grad 0 at 3
      r1 B0 [4, 6] sends grad 0 at 6: it ends 6.5; B1 [6, 8] sends grad 1 at 8
      r0 B0 [6.5, 8.5], posts the receive of grad 1 at 8.5: it ends 9; B1 [9, 11]
    makespan 11 = (m + pp - 1)(f + b) + 2(m + pp - 2)d."""
    res = simulate_pipeline(2, 2, 1.0, 2.0, 0.5, schedule="gpipe")
    assert res.timelines[0] == [(0, 1, "F", 0, 0), (1, 2, "F", 1, 0), (6.5, 8.5, "B", 0, 0), (9, 11, "B", 1, 0)]
    assert res.timelines[1] == [(1.5, 2.5, "F", 0, 1), (3, 4, "F", 1, 1), (4, 6, "B", 0, 1), (6, 8, "B", 1, 1)]
    assert res.makespan_s == 11.0


@pytest.mark.parametrize("f,b,d", [(1.0, 2.0, 0.25), (2.0, 1.0, 3.0), (0.5, 3.0, 1.0)])
def test_gpipe_p2p_closed_form(f, b, d):
    """Every transfer into a rank that is still busy waits for it: pp - 1 hops of
    fill and of drain, and m - 1 transfers in series with the last stage's
    forwards and with the first stage's backwards."""
    for pp in range(2, 8):
        for m in range(1, 16):
            res = simulate_pipeline(pp, m, f, b, d, schedule="gpipe")
            assert res.makespan_s == pytest.approx((m + pp - 1) * (f + b) + 2 * (m + pp - 2) * d, abs=1e-12)


def test_1f1b_p2p_pp2_by_hand():
    """pp = 2, f = 1, b = 2, d = 0.5, torch Schedule1F1B. Rank 0 (2 warmup
    forwards) runs F0 F1 B0 F2 B1 B2, rank 1 F0 B0 F1 B1 F2 B2. A transfer ends
    d after the later of its send's and its receive's posts; in the steady state
    a rank posts its send with its next receive and waits for both.
      r1 posts the receive of F0's activation at 0; r0 F0 [0, 1] sends it at 1: it ends 1.5
      r1 F0 [1.5, 2.5] B0 [2.5, 4.5]
      r0 F1 [1, 2], then waits for its first send (1.5) and posts act 1 + grad 0 at 2
      r1 posts grad 0 + act 1 at 4.5: both end 5
      r0 B0 [5, 7] F2 [7, 8], posts act 2 + grad 1 at 8
      r1 F1 [5, 6] (its input had arrived at 2.5 without the exchange)  B1 [6, 8]
      r1 posts grad 1 + act 2 at 8: both end 8.5
      r0 B1 [8.5, 10.5], then posts the receive of grad 2
      r1 F2 [8.5, 9.5] B2 [9.5, 11.5], sends grad 2 at 11.5: it ends 12
      r0 B2 [12, 14]
    makespan 14 = (m + pp - 1)(f + b) + (m + 1)d: the ranks meet once per
    micro-batch, and each meeting costs one transfer."""
    res = simulate_pipeline(2, 3, 1.0, 2.0, 0.5)
    assert res.timelines[0] == [(0, 1, "F", 0, 0), (1, 2, "F", 1, 0), (5, 7, "B", 0, 0), (7, 8, "F", 2, 0),
                                (8.5, 10.5, "B", 1, 0), (12, 14, "B", 2, 0)]
    assert res.timelines[1] == [(1.5, 2.5, "F", 0, 1), (2.5, 4.5, "B", 0, 1), (5, 6, "F", 1, 1),
                                (6, 8, "B", 1, 1), (8.5, 9.5, "F", 2, 1), (9.5, 11.5, "B", 2, 1)]
    assert res.makespan_s == 14.0
    assert res.busy_s == [9.0, 9.0] and res.bubble_s == 5.0
    # m = 1: r0 F0 [0,1] posts act 0 + grad 0 at 1; r1 F0 [1.5,2.5] B0 [2.5,4.5] sends grad 0
    #        at 4.5: it ends 5; r0 B0 [5,7]
    assert simulate_pipeline(2, 1, 1.0, 2.0, 0.5).makespan_s == 7.0
    # m = 2: r0 F0 [0,1] F1 [1,2] posts act 1 + grad 0 at 2; r1 F0 [1.5,2.5] B0 [2.5,4.5]
    #        posts grad 0 + act 1 at 4.5: both end 5; r1 F1 [5,6] B1 [6,8] sends grad 1 at 8;
    #        r0 B0 [5,7] posts the receive of grad 1 at 7: it ends 8.5; r0 B1 [8.5,10.5]
    assert simulate_pipeline(2, 2, 1.0, 2.0, 0.5).makespan_s == 10.5


def test_1f1b_middle_rank_by_hand():
    """pp = 3, m = 2, f = 1, b = 2, d = 0.5: the middle rank meets its two
    neighbours in turn. Warmup forwards (torch's pp - r, the last one's send
    fused with the first exchange): r0 2, r1 2, r2 1.
      r0 F0 [0, 1] sends act 0 at 1 (r1 posted its receive at 0): it ends 1.5
      r0 F1 [1, 2], waits for that send, posts act 1 + grad 0 at 2
      r1 F0 [1.5, 2.5] sends act 0 at 2.5 (r2 posted its receive at 0): it ends 3
      r1 receives act 1 (posted 2.5, sent 2): 3; F1 [3, 4], waits for its send (3),
         posts act 1 + grad 0 at 4
      r2 F0 [3, 4] B0 [4, 6], posts grad 0 + act 1 at 6: with r1's posts at 4, both end 6.5
      r1 B0 [6.5, 8.5] sends grad 0 at 8.5 (r0 posted at 2): it ends 9
      r2 F1 [6.5, 7.5] B1 [7.5, 9.5] sends grad 1 at 9.5 (r1 posted at 8.5): it ends 10
      r1 B1 [10, 12] sends grad 1 at 12; r0 B0 [9, 11], posts the receive at 11: it ends 12.5
      r0 B1 [12.5, 14.5]
    makespan 14.5 = (m + pp - 1)(f + b) + (2 m + 2 pp - 5)d = 12 + 5 x 0.5."""
    res = simulate_pipeline(3, 2, 1.0, 2.0, 0.5)
    assert res.timelines[0] == [(0, 1, "F", 0, 0), (1, 2, "F", 1, 0), (9, 11, "B", 0, 0), (12.5, 14.5, "B", 1, 0)]
    assert res.timelines[1] == [(1.5, 2.5, "F", 0, 1), (3, 4, "F", 1, 1), (6.5, 8.5, "B", 0, 1),
                                (10, 12, "B", 1, 1)]
    assert res.timelines[2] == [(3, 4, "F", 0, 2), (4, 6, "B", 0, 2), (6.5, 7.5, "F", 1, 2),
                                (7.5, 9.5, "B", 1, 2)]
    assert res.makespan_s == 14.5


def one_f_one_b_p2p(pp, m, f, b, d):
    # Derived in commbench/schedule.py's docstring: pp = 2 meets once per micro-batch
    # (plus the first forward's transfer); with pp >= 3 each rank meets each neighbour
    # once per micro-batch; a single micro-batch makes only its round trip.
    if pp == 2:
        hops = m + 1
    elif m == 1:
        hops = 2 * (pp - 1)
    else:
        hops = 2 * m + 2 * pp - 5
    return (m + pp - 1) * (f + b) + hops * d


@pytest.mark.parametrize("f,b,d", [(1.0, 2.0, 0.25), (1.0, 2.0, 3.0), (2.0, 1.0, 0.5), (0.5, 3.0, 4.0)])
def test_1f1b_p2p_closed_form(f, b, d):
    for pp in range(2, 8):
        for m in range(1, 16):
            got = simulate_pipeline(pp, m, f, b, d).makespan_s
            assert got == pytest.approx(one_f_one_b_p2p(pp, m, f, b, d), abs=1e-12), (pp, m)
    assert one_f_one_b_p2p(4, 8, 1.0, 2.0, 1.0) - 11 * 3 == 19


# --- a non-uniform pipeline by hand ------------------------------------------------

def test_non_uniform_pp2_m2_by_hand():
    """Stage 0: f = 1, b = 2; stage 1 (the slow one): f = 3, b = 4. 1F1B, no p2p.
      r0 F0 [0, 1]  F1 [1, 2]                  ... B0 [8, 10]  B1 [15, 17]
      r1 F0 [1, 4]  B0 [4, 8]  F1 [8, 11]  B1 [11, 15]
    makespan 17 = m(f_max + b_max) = 14 plus the fill (stage 0's F0, 1) and the drain
    (stage 0's B1, 2). Stage 1 is the critical rank, busy 14, bubble 3."""
    res = simulate_pipeline(2, 2, [1.0, 3.0], [2.0, 4.0])
    assert res.timelines[0] == [(0, 1, "F", 0, 0), (1, 2, "F", 1, 0), (8, 10, "B", 0, 0), (15, 17, "B", 1, 0)]
    assert res.timelines[1] == [(1, 4, "F", 0, 1), (4, 8, "B", 0, 1), (8, 11, "F", 1, 1), (11, 15, "B", 1, 1)]
    assert res.makespan_s == 17.0 == 2 * (3 + 4) + 1 + 2
    assert res.busy_s == [6.0, 14.0] and res.idle_s == [11.0, 3.0]
    assert res.critical_rank == 1 and res.bubble_s == 3.0
    assert res.last_bwd_end_s == [17.0, 15.0]
    assert res.last_bwd_s == [{0: (15.0, 17.0)}, {1: (11.0, 15.0)}]
    # GPipe: r1 F0 [1,4] F1 [4,7] B0 [7,11] B1 [11,15]; r0 B0 [11,13] B1 [15,17]
    g = simulate_pipeline(2, 2, [1.0, 3.0], [2.0, 4.0], schedule="gpipe")
    assert g.timelines[0][2:] == [(11, 13, "B", 0, 0), (15, 17, "B", 1, 0)]
    assert g.makespan_s == 17.0
    # with p2p 0.5: r1 F0 [1.5,4.5] B0 [4.5,8.5], posts grad 0 + act 1 at 8.5 (r0 at 2):
    #               both end 9; r1 F1 [9,12] B1 [12,16] sends grad 1 at 16 (r0 posted at 11);
    #               r0 B0 [9,11] B1 [16.5,18.5]
    p = simulate_pipeline(2, 2, [1.0, 3.0], [2.0, 4.0], p2p_s=[0.5])
    assert p.timelines[1] == [(1.5, 4.5, "F", 0, 1), (4.5, 8.5, "B", 0, 1), (9, 12, "F", 1, 1),
                              (12, 16, "B", 1, 1)]
    assert p.timelines[0][2:] == [(9, 11, "B", 0, 0), (16.5, 18.5, "B", 1, 0)]
    assert p.makespan_s == 18.5


def test_held_last_backward_pp2_by_hand():
    """The case above with holds 0.25 (stage 0) and 1 (stage 1) on each stage's
    last backward (DDP's finalize under torch pipelining):
      r1 B1 computes [11, 15], holds to 16, and only then sends its gradient;
      r0 B1 [16, 18], holds to 18.25. Earlier backwards are not held."""
    res = simulate_pipeline(2, 2, [1.0, 3.0], [2.0, 4.0], hold_s=[0.25, 1.0])
    assert res.timelines[0] == [(0, 1, "F", 0, 0), (1, 2, "F", 1, 0), (8, 10, "B", 0, 0), (16, 18, "B", 1, 0)]
    assert res.timelines[1] == [(1, 4, "F", 0, 1), (4, 8, "B", 0, 1), (8, 11, "F", 1, 1), (11, 15, "B", 1, 1)]
    assert res.last_bwd_end_s == [18.25, 16.0]
    assert res.last_bwd_s == [{0: (16.0, 18.0)}, {1: (11.0, 15.0)}]
    assert res.makespan_s == 18.25
    assert res.busy_s == [6.0, 14.0]            # a hold is not compute
    assert res.bubble_s == 18.25 - 14.0
    with pytest.raises(ValueError, match=r"hold_s\[1\] must be a finite time >= 0 s"):
        simulate_pipeline(2, 2, 1.0, 2.0, hold_s=[0.0, -1.0])


def test_held_last_backward_interleaved_blocks_the_rank():
    """Interleaved (pp 2, v 2, m 4): a hold on chunk 2's last backward keeps
    rank 0 from its next op (chunk 0's last backward) for that long, and a hold
    on a rank's final op adds to its end one for one."""
    base = simulate_pipeline(2, 4, 1.0, 2.0, schedule="interleaved", interleave=2)
    held = simulate_pipeline(2, 4, 1.0, 2.0, schedule="interleaved", interleave=2, hold_s=[0.0, 0.0, 0.5, 0.0])
    tl = held.timelines[0]
    i = next(k for k, o in enumerate(tl) if (o.kind, o.microbatch, o.chunk) == ("B", 3, 2))
    assert tl[i + 1].start_s >= tl[i].end_s + 0.5
    assert held.last_bwd_end_s[0] == base.last_bwd_end_s[0] + 0.5
    last = simulate_pipeline(2, 4, 1.0, 2.0, schedule="interleaved", interleave=2, hold_s=[0.75, 0.0, 0.0, 0.0])
    assert last.last_bwd_end_s[0] == base.last_bwd_end_s[0] + 0.75
    assert last.busy_s == base.busy_s


# --- schedule order ----------------------------------------------------------------

def test_1f1b_order_megatron():
    # rank i: min(pp - i - 1, m) warmup forwards, then F, B pairs, then the cooldown
    assert rank_ops(4, 6, 0) == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("B", 0, 0), ("F", 4, 0),
                                 ("B", 1, 0), ("F", 5, 0), ("B", 2, 0), ("B", 3, 0), ("B", 4, 0), ("B", 5, 0)]
    assert rank_ops(4, 6, 3)[:4] == [("F", 0, 3), ("B", 0, 3), ("F", 1, 3), ("B", 1, 3)]
    assert rank_ops(4, 2, 0) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]   # warmup capped at m


def test_interleaved_order_megatron():
    """pp = 2, v = 2, m = 4: chunks 0, 2 on rank 0 and 1, 3 on rank 1. Forward k
    runs micro-batch (k // 4) * 2 + k % 2 on local chunk (k % 4) // 2; backward the
    same micro-batch on local chunk 1 - (k % 4) // 2. Warmup: rank 0 (2-0-1)*2 + 1*2 = 4,
    rank 1 0 + 2 = 2."""
    assert rank_ops(2, 4, 0, "interleaved", 2) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2),
        ("F", 2, 0), ("B", 0, 2), ("F", 3, 0), ("B", 1, 2), ("F", 2, 2), ("B", 0, 0), ("F", 3, 2), ("B", 1, 0),
        ("B", 2, 2), ("B", 3, 2), ("B", 2, 0), ("B", 3, 0)]
    assert rank_ops(2, 4, 1, "interleaved", 2) == [
        ("F", 0, 1), ("F", 1, 1),
        ("F", 0, 3), ("B", 0, 3), ("F", 1, 3), ("B", 1, 3), ("F", 2, 1), ("B", 0, 1), ("F", 3, 1), ("B", 1, 1),
        ("F", 2, 3), ("B", 2, 3), ("F", 3, 3), ("B", 3, 3),
        ("B", 2, 1), ("B", 3, 1)]


@pytest.mark.parametrize("pp,v,m,want", [(4, 2, 8, [10, 8, 6, 4]), (4, 2, 4, [8, 8, 6, 4]),
                                         (4, 3, 4, [12, 12, 10, 8]), (2, 3, 2, [6, 4])])
def test_interleaved_warmup_counts(pp, v, m, want):
    # warmup w = (pp - rank - 1) * 2 + (v - 1) * pp, at most m * v; the steady state
    # starts with a forward, so w + 1 forwards precede the first backward unless w = m * v
    def warmup(ops):
        lead = next(i for i, o in enumerate(ops) if o[0] == "B")
        return lead if lead == m * v else lead - 1
    assert [warmup(rank_ops(pp, m, r, "interleaved", v)) for r in range(pp)] == want


# --- invariants on random pipelines ------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_dependencies_and_counts(seed):
    rnd = random.Random(seed)
    for schedule, pp, v, m in (("1f1b", 4, 1, 6), ("gpipe", 3, 1, 5), ("interleaved", 4, 2, 8),
                               ("interleaved", 3, 3, 3), ("1f1b", 5, 1, 2)):
        n = pp * v
        f = [rnd.choice([0.25, 0.5, 1.0, 1.5]) for _ in range(n)]
        b = [rnd.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(n)]
        d = [rnd.choice([0.0, 0.25, 0.5]) for _ in range(n - 1)]
        res = simulate_pipeline(pp, m, f, b, d, schedule=schedule, interleave=v)
        end = {(o.kind, o.chunk, o.microbatch): o.end_s for tl in res.timelines for o in tl}
        for r, tl in enumerate(res.timelines):
            assert sum(o.kind == "F" for o in tl) == m * v == sum(o.kind == "B" for o in tl)
            assert all(o.chunk % pp == r for o in tl)
            for a, z in zip(tl, tl[1:]):
                assert z.start_s >= a.end_s                  # one op at a time, in order
            for o in tl:
                dur = f[o.chunk] if o.kind == "F" else b[o.chunk]
                assert o.end_s - o.start_s == pytest.approx(dur)
                if o.kind == "F" and o.chunk > 0:
                    assert o.start_s >= end[("F", o.chunk - 1, o.microbatch)] + d[o.chunk - 1] - 1e-12
                if o.kind == "B":
                    assert o.start_s >= end[("F", o.chunk, o.microbatch)]
                    if o.chunk < n - 1:
                        assert o.start_s >= end[("B", o.chunk + 1, o.microbatch)] + d[o.chunk] - 1e-12
            # the last backward of each chunk is micro-batch m - 1
            bwd = [o for o in tl if o.kind == "B"]
            assert res.last_bwd_end_s[r] == bwd[-1].end_s
            assert res.last_bwd_s[r] == {c: next((o.start_s, o.end_s) for o in bwd
                                                 if o.chunk == c and o.microbatch == m - 1)
                                         for c in range(r, n, pp)}
        assert res.makespan_s == max(tl[-1].end_s for tl in res.timelines)
        assert res.busy_s[res.critical_rank] == max(res.busy_s)
        assert res.bubble_s == pytest.approx(res.makespan_s - max(res.busy_s))
        # the slowest chunk bounds the makespan from below
        assert res.makespan_s >= m * max(f[c] + b[c] for c in range(n)) - 1e-12


def test_p2p_callable_and_sequence_agree():
    seq = [0.25, 0.5, 0.75]
    a = simulate_pipeline(4, 4, 1.0, 2.0, seq)
    c = simulate_pipeline(4, 4, 1.0, 2.0, lambda k: seq[k])
    assert a.timelines == c.timelines


# --- invalid input -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs,msg", [
    (dict(pp=4, num_microbatches=6, schedule="interleaved", interleave=2), r"micro-batch count \(6\).*multiple of pp \(4\)"),
    (dict(pp=2, num_microbatches=2, fwd_s=-1.0), r"fwd_s must be a finite time >= 0 s, got -1.0"),
    (dict(pp=2, num_microbatches=2, bwd_s=[1.0, -0.5]), r"bwd_s\[1\] must be a finite time"),
    (dict(pp=2, num_microbatches=2, fwd_s=[1.0, 1.0, 1.0]), r"fwd_s has 3 values but there are 2 chunks"),
    (dict(pp=2, num_microbatches=2, p2p_s=[0.1, 0.1]), r"p2p_s has 2 values but there are 1 chunk boundaries"),
    (dict(pp=2, num_microbatches=2, p2p_s=lambda k: -1.0), r"p2p_s\(0\) must be a finite time"),
    (dict(pp=2, num_microbatches=2, schedule="zb"), r"pipeline schedule 'zb': choose from"),
    (dict(pp=2, num_microbatches=2, interleave=2), r"interleave 2 > 1 needs schedule 'interleaved'"),
    (dict(pp=0, num_microbatches=2), r"pp must be an integer >= 1, got 0"),
    (dict(pp=2, num_microbatches=0), r"num_microbatches must be an integer >= 1, got 0"),
])
def test_invalid_pipeline(kwargs, msg):
    kw = dict(fwd_s=1.0, bwd_s=2.0) | kwargs
    with pytest.raises(ValueError, match=msg):
        simulate_pipeline(**kw)


def test_invalid_rank_ops():
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, pp\) = \[0, 2\), got 2"):
        rank_ops(2, 4, 2)
    with pytest.raises(ValueError, match=r"micro-batch count \(3\).*multiple of pp \(2\)"):
        rank_ops(2, 3, 0, "interleaved", 2)
