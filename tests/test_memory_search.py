"""memory.py against hand-computed numbers (Korthikanti et al. 2022 activations,
ZeRO paper model states) and search.py's enumeration, memory filter and ranking."""
import time
from collections import Counter
from dataclasses import asdict, replace

import pytest

from commbench import memory, models, search
from commbench.memory import fits, layer_activation_bytes, memory_per_gpu, model_state_bytes, stage_memory
from commbench.parallel import RECOMPUTE, Parallelism
from commbench.strategies.common import layer_params, rank_params

GPT175 = models.get("gpt3-175b")
GB = 1e9


# --- activations: Korthikanti et al. 2022, Table 2 / eqs. 1-3, 16-bit, b = 1, s = 2048 ---------
@pytest.mark.parametrize("b", [1, 4])
def test_gpt_layer_reproduces_korthikanti_constants(b):
    m, s = GPT175, 2048
    h, a = m.hidden, m.heads
    sbh = s * b * h
    scores = 5 * a * s * s * b                     # 5as/h x sbh
    act = lambda t, sp, rc: layer_activation_bytes(m, s, b, t, sp, rc, 2, flash=False)   # noqa: E731
    assert act(1, False, "none") == 34 * sbh + scores                              # sbh(34 + 5as/h)
    assert act(8, False, "none") == 10 * sbh + 24 * sbh // 8 + scores // 8         # sbh(10 + 24/t + 5as/(ht))
    assert act(8, True, "none") == (34 * sbh + scores) // 8                        # sbh/t (34 + 5as/h)
    assert act(1, False, "selective") == 34 * sbh
    assert act(8, False, "selective") == 10 * sbh + 24 * sbh // 8
    assert act(8, True, "selective") == 34 * sbh // 8
    assert act(8, False, "full") == 2 * sbh                                        # the layer input
    assert act(8, True, "full") == 2 * sbh // 8
    # the published 175B figure: with tp = 8 + sp + selective, 34 sbh / t per layer
    assert act(8, True, "selective") == 34 * 2048 * b * 12288 // 8


def test_gpt_with_4h_in_another_shape_and_fp32():
    m = models.get("gpt3-13b")      # h 5120, a 40, 4h MLP
    s, b, t, h, a = 2048, 2, 4, m.hidden, m.heads
    sbh = s * b * h
    assert layer_activation_bytes(m, s, b, t, False, "none", 2, flash=False) == (
        10 * sbh + 24 * sbh // t + 5 * a * s * s * b // t)
    # fp32 activations: every 2-byte tensor doubles, the 1-byte masks do not: replicated
    # 2 norm inputs 8 + qkv input 4 + mlp input 4 + 2 masks = 18 sbh; split 24 -> 48 sbh/t;
    # scores softmax 4 + mask 1 + dropout output 4 = 9 a s^2 b / t
    assert layer_activation_bytes(m, s, b, t, False, "none", 4, flash=False) == (
        18 * sbh + 48 * sbh // t + 9 * a * s * s * b // t)
    # attention as one fused kernel (the default, as the compute model times it): no s^2 terms
    assert layer_activation_bytes(m, s, b, t, False, "none", 4) == 18 * sbh + 48 * sbh // t


def test_llama_layer_is_derived_from_its_shapes():
    m = models.get("llama2-70b")    # h 8192, 64 heads, 8 kv heads (kv dim 1024), SwiGLU f 28672, no dropout
    s, b, t = 4096, 1, 8
    h, kv, f, a = m.hidden, m.kv_dim, m.ffn_hidden, m.heads
    tok = s * b
    by_hand = (tok * h * 2 * 4                       # 2 norm inputs, qkv input, mlp input (replicated)
               + tok * (h // t + kv // t) * 2 * 2    # Q, K and V, output-projection input
               + tok * 3 * (f // t) * 2              # gate + up outputs, down input
               + (a // t) * s * s * b * 2)           # softmax output (no dropout)
    assert layer_activation_bytes(m, s, b, t, False, "none", 2, flash=False) == by_hand
    assert layer_activation_bytes(m, s, b, t, False, "none", 2) == by_hand - (a // t) * s * s * b * 2
    # GQA with tp = kv heads: each rank keeps one kv head
    tiny = models.get("tiny-llama")                  # 4 heads, 2 kv heads, head dim 16
    one = layer_activation_bytes(tiny, 64, 1, 2, False, "selective", 2)
    assert one == 64 * 64 * 2 * 4 + 64 * (32 + 16) * 2 * 2 + 64 * 3 * (176 // 2) * 2


def test_stage_activations_follow_the_schedule():
    m, s = GPT175, 2048
    sbh = s * 12288
    per = layer_activation_bytes(m, s, 1, 8, True, "selective", 2)
    base = dict(world=1024, gpus_per_node=8, tp=8, sp=True, recompute="selective", seq=s)
    # 1F1B, pp = 16, m = 192: stage 0 keeps 16 micro-batches x 6 layers = all 96 layers' worth,
    # plus 16 embedding dropout masks sbh/t
    par = Parallelism(pp=16, global_batch=1536, **base)
    assert memory.stage_activation_bytes(m, par, 0) == 96 * per + 16 * sbh // 8
    # last stage: one micro-batch of 6 layers + final norm / output inputs 4sbh/t + fp32 logits 4 s v / t
    head = 4 * sbh // 8 + 4 * s * -(-m.vocab // 8)
    assert memory.stage_activation_bytes(m, par, 15) == 6 * per + head
    # fewer micro-batches than stages: stage 0 keeps m of them
    few = Parallelism(pp=16, global_batch=32, **base)          # dp 8, m = 4
    assert memory.stage_activation_bytes(m, few, 0) == 4 * 6 * per + 4 * sbh // 8
    # interleaved, pp = 4, v = 2, m = 8: Korthikanti's factor 1 + (p-1)/(p v) on L layers
    inter = Parallelism(pp=4, interleave=2, global_batch=512, **base)   # dp 32, m 16
    assert memory.stage_activation_bytes(m, inter, 0) == 96 * (1 + 3 / 8) * per + 4 * sbh // 8
    # GPipe keeps all m
    gp = Parallelism(pp=16, global_batch=32, schedule="gpipe", **base)
    assert memory.stage_activation_bytes(m, gp, 0) == 4 * 6 * per + 4 * sbh // 8
    # full recompute: 2sbh/t per layer in flight + one layer's full activations
    full = replace(par, recompute="full")
    one_full = layer_activation_bytes(m, s, 1, 8, True, "none", 2)
    assert memory.stage_activation_bytes(m, full, 0) == 96 * 2 * sbh // 8 + one_full + 16 * sbh // 8
    # the attention core is a fused kernel: no recompute keeps what selective keeps (no s^2 scores)
    assert memory.stage_activation_bytes(m, replace(par, recompute="none"), 0) == 96 * per + 16 * sbh // 8


# --- model states: ZeRO paper, mixed-precision Adam 2 + 2 + 12 B/param --------------------------
def test_adam_state_for_each_zero_stage():
    m = models.get("gpt3-1.3b")
    P = m.num_params                                    # pp = tp = 1: the rank holds all of it
    kw = dict(world=8, gpus_per_node=8)
    shard = -(-P // 8)
    assert model_state_bytes(m, Parallelism(zero=0, **kw), 0) == (2 * P, 2 * P, 12 * P)        # 16 P, ~21 GB
    assert model_state_bytes(m, Parallelism(zero=1, zero_flavour="deepspeed", **kw), 0) == (2 * P, 2 * P, 12 * shard)
    # torch's ZeroRedundancyOptimizer gives whole parameters: its busiest rank holds at least the equal share
    w, g, opt = model_state_bytes(m, Parallelism(zero=1, **kw), 0)
    assert (w, g) == (2 * P, 2 * P) and 12 * shard <= opt < 12 * (shard + 4 * m.hidden ** 2)
    block = sum(p.numel for p in layer_params(m, 1, 0))
    root = P - 24 * block
    # ZeRO-2: FSDP2 holds one unit's unsharded gradient until its reduce-scatter;
    # DeepSpeed its contiguous reduce bucket of 5e8 elements (P is 1.3e9 here)
    assert model_state_bytes(m, Parallelism(zero=2, **kw), 0) == (2 * P, 2 * shard + 2 * max(root, block),
                                                                   12 * shard)
    assert model_state_bytes(m, Parallelism(zero=2, zero_flavour="deepspeed", **kw), 0) == (
        2 * P, 2 * shard + 2 * 500_000_000, 12 * shard)
    # ZeRO-3: everything / 8, plus FSDP2's root (embedding, positions, final norm) and two
    # blocks gathered, and one unit's unsharded gradient
    assert model_state_bytes(m, Parallelism(zero=3, **kw), 0) == (
        2 * shard + 2 * (root + 2 * block), 2 * shard + 2 * max(root, block), 12 * shard)
    # fp32 training: 4 + 4 + 8
    assert model_state_bytes(m, Parallelism(dtype="fp32", **kw), 0) == (4 * P, 4 * P, 8 * P)
    assert sum(model_state_bytes(m, Parallelism(**kw), 0)) / GB == pytest.approx(16 * 1.3, rel=0.03)
    with pytest.raises(ValueError, match="lion"):
        model_state_bytes(m, Parallelism(**kw), 0, optimizer="lion")


def test_torch_zero1_optimizer_state_is_the_busiest_ranks_whole_parameters():
    """llama3-8b over dp 64: its untied embedding and output layer (128256 x 4096
    = 525M elements each) are each larger than 1/64 of the 8.03B parameters, so
    two ranks own one of them alone and hold 12 B x 525M = 6.3 GB of Adam
    state, where an equal split would give 1.5 GB."""
    m = models.get("llama3-8b")
    par = Parallelism(world=64, gpus_per_node=8, zero=1, global_batch=64)
    assert model_state_bytes(m, par, 0)[2] == 12 * 128256 * 4096
    even = Parallelism(world=64, gpus_per_node=8, zero=1, zero_flavour="deepspeed", global_batch=64)
    assert model_state_bytes(m, even, 0)[2] == 12 * -(-m.num_params // 64)


def test_tp_and_pp_split_the_parameters_as_the_strategies_do():
    m = GPT175
    par = Parallelism(world=1024, gpus_per_node=8, tp=8, pp=16)
    for stage in (0, 7, 15):
        psi = sum(p.numel for p in rank_params(m, par, stage))
        assert model_state_bytes(m, par, stage)[0] == 2 * psi
    first, middle, last = (sum(p.numel for p in rank_params(m, par, s)) for s in (0, 7, 15))
    rows = -(-m.vocab // 8)              # 50257 split 8 ways unevenly: at most 6283 rows
    assert first - middle == rows * m.hidden + m.seq * m.hidden      # embedding + positions
    assert last - middle == rows * m.hidden + 2 * m.hidden           # tied copy + final norm


def test_the_worst_stage_is_the_first_or_last():
    for m, kw in ((GPT175, dict(tp=8, pp=16, recompute="selective", sp=True)),
                  (models.get("llama3-8b"), dict(tp=2, pp=4, recompute="none"))):
        par = Parallelism(world=1024, gpus_per_node=8, global_batch=1024, seq=2048, **kw)
        est = memory_per_gpu(m, par)
        assert est.total == max(stage_memory(m, par, s).total for s in range(par.pp))
        assert est.total == est.weights + est.gradients + est.optimizer_state + est.activations


# --- fits and the filter ------------------------------------------------------------------
def test_fits_keeps_the_reserve():
    e = memory.MemoryEstimate(1, 2, 3, 4, 90, 0)
    assert fits(e, 100) and not fits(e, 99.9) and fits(e, 90, reserve_fraction=0)
    for bad in (-1, 1.0):
        with pytest.raises(ValueError, match="reserve"):
            fits(e, 100, reserve_fraction=bad)
    with pytest.raises(ValueError, match="gpu memory"):
        fits(e, 0)


def test_gpt3_175b_on_80gb_gpus():
    base = dict(world=1024, gpus_per_node=8, seq=2048)
    pure_dp = Parallelism(global_batch=2048, **base)
    assert not fits(memory_per_gpu(GPT175, pure_dp), 80 * GB)          # 16 B x 175e9 = 2.8 TB
    megatron = Parallelism(tp=8, pp=16, sp=True, recompute="selective", global_batch=1536, **base)
    est = memory_per_gpu(GPT175, megatron)
    assert fits(est, 80 * GB) and est.stage == 0
    # ~1.46e9 params x 16 B = 23.4 GB + 96 layers x 34 sbh/8 = 10.3 GB
    assert est.total / GB == pytest.approx(33.7, abs=0.1)
    # without sp and recompute: 96 layers x (10 + 24/8) sbh (the fused attention keeps no
    # s x s scores) + 16 embedding dropout masks sbh = 31.8 GB of activations: it fits, and
    # four sequences per micro-batch do not
    no_recompute = replace(megatron, sp=False, recompute="none")
    sbh = 2048 * 12288
    assert memory_per_gpu(GPT175, no_recompute).activations == 96 * 13 * sbh + 16 * sbh
    assert fits(memory_per_gpu(GPT175, no_recompute), 80 * GB)
    assert not fits(memory_per_gpu(GPT175, replace(no_recompute, micro_batch=4)), 80 * GB)


def test_search_filters_by_memory():
    res = search.search(GPT175, 1024, 8, 1536, 80 * GB, lambda m, p: 1.0 + p.pp / 100, top=2000, seq=2048)
    ranked = {search.describe(r.parallelism) for r in res.plans}
    dropped = {search.describe(d.parallelism) for d in res.too_big}
    assert "tp=8 pp=16 dp=8 zero=1 sp=1 mb=1 m=192 recompute=selective" in ranked
    assert "tp=8 pp=16 dp=8 zero=0 sp=0 mb=4 m=48 recompute=none" in dropped
    assert all(not fits(d.memory, 80 * GB) and "usable" in d.reason for d in res.too_big)
    assert all(fits(r.memory, 80 * GB) for r in res.plans)
    assert res.num_too_big == len(res.too_big) > 0 and res.num_ranked == len(res.plans) > 0
    # pure DP: global batch 2048 over 1024 GPUs
    dp = search.search(GPT175, 1024, 8, 2048, 80 * GB, lambda m, p: 1.0, micro_batches=(1, 2), zero=(0,),
                       sp=(False,), interleave=(1,), recompute=("none",), seq=2048, top=1000)
    pure = [d for d in dp.too_big if d.parallelism.tp == d.parallelism.pp == 1]
    assert len(pure) == 2 and not any(r.parallelism.tp == r.parallelism.pp == 1 for r in dp.plans)


# --- enumeration ----------------------------------------------------------------------------
def test_every_enumerated_plan_is_valid_and_known_plans_appear():
    t0 = time.perf_counter()
    rejected = Counter()
    plans = list(search.enumerate_plans(GPT175, 1024, 8, 1536, seq=2048, rejected=rejected))
    assert time.perf_counter() - t0 < 5
    seen = set()
    for p in plans:
        again = Parallelism(**asdict(p))
        again.check_model(GPT175)
        assert again == p and p.tp * p.pp * p.dp == 1024 and 8 % p.tp == 0
        assert not (p.zero >= 2 and p.pp > 1) and not (p.zero and p.dp == 1)
        seen.add(search.describe(p))
    assert len(seen) == len(plans)
    for known in ("tp=8 pp=16 dp=8 zero=1 sp=1 mb=1 m=192 recompute=selective",
                  "tp=8 pp=8 dp=16 zero=0 sp=1 mb=1 m=96 v=2 recompute=selective",
                  "tp=8 pp=1 dp=128 zero=3 sp=0 mb=4 m=3 recompute=full",
                  "tp=1 pp=2 dp=512 zero=1 sp=0 mb=1 m=3 recompute=none"):
        assert known in seen, known
    assert any("zero 3 with pp > 1" in r for r in rejected)
    assert any("not divisible by pp x interleave" in r for r in rejected)


def test_probe_shortcut_matches_building_every_candidate():
    """enumerate_plans skips a whole (tp, pp, micro-batch) block when its global batch split
    fails; building every candidate one by one must give the same plans and reasons."""
    m, world, gpn, gb = models.get("gpt3-13b"), 64, 8, 96
    rejected = Counter()
    fast = [asdict(p) for p in search.enumerate_plans(m, world, gpn, gb, rejected=rejected)]
    slow, slow_rej = [], Counter()
    for tp in (1, 2, 4, 8):
        for pp in [d for d in range(1, world // tp + 1) if world // tp % d == 0]:
            dp = world // (tp * pp)
            for mb in search.DEFAULT_MICRO_BATCHES:
                for z in [z for z in (0, 1, 2, 3) if not (z and dp == 1)]:
                    for sp in [s for s in (False, True) if not (s and tp == 1)]:
                        for v in [v for v in search.DEFAULT_INTERLEAVE if not (v > 1 and pp == 1)]:
                            for rc in RECOMPUTE:
                                try:
                                    p = Parallelism(world=world, gpus_per_node=gpn, tp=tp, pp=pp, dp=dp, zero=z,
                                                    sp=sp, micro_batch=mb, global_batch=gb, interleave=v,
                                                    recompute=rc)
                                    p.check_model(m)
                                except ValueError as e:
                                    slow_rej[str(e)] += 1
                                    continue
                                if z >= 2 and pp > 1:
                                    slow_rej[search.EXCLUDED_ZERO_PP.format(z=z)] += 1
                                else:
                                    slow.append(asdict(p))
    assert fast == slow and rejected == slow_rej


def test_enumeration_errors_name_the_bad_value():
    for kw, word in ((dict(zero=(4,)), "4"), (dict(recompute=("some",)), "some"), (dict(micro_batches=(0,)), "0"),
                     (dict(micro_batches=()), "micro-batches")):
        with pytest.raises(ValueError, match=word):
            list(search.enumerate_plans(GPT175, 1024, 8, 1536, **kw))
    with pytest.raises(ValueError, match="whole number of nodes"):
        list(search.enumerate_plans(GPT175, 1020, 8, 1536))
    with pytest.raises(ValueError, match="global batch"):
        list(search.enumerate_plans(GPT175, 1024, 8, 0))


# --- ranking ---------------------------------------------------------------------------------
def test_search_ranks_by_the_estimate():
    m = models.get("gpt3-1.3b")
    est = lambda model, p: 1.0 + ((p.tp * 31 + p.pp * 17 + p.micro_batch * 7 + p.zero * 3   # noqa: E731
                                   + p.interleave + RECOMPUTE.index(p.recompute)) % 23) / 10
    res = search.search(m, 16, 8, 64, 40 * GB, est, top=7, seq=2048)
    fitting = [p for p in search.enumerate_plans(m, 16, 8, 64, seq=2048) if fits(memory_per_gpu(m, p), 40 * GB)]
    expected = sorted(fitting, key=lambda p: est(m, p))[:7]           # stable: ties in enumeration order
    assert [r.parallelism for r in res.plans] == expected
    assert [r.step_time_s for r in res.plans] == sorted(r.step_time_s for r in res.plans)
    r0 = res.plans[0]
    assert r0.samples_per_s == pytest.approx(64 / r0.step_time_s) and r0.tokens_per_s == r0.samples_per_s * 2048
    assert res.num_ranked == len(fitting)
    assert res.num_enumerated == res.num_invalid + res.num_too_big + res.num_ranked + res.num_unestimated


def test_search_counts_plans_the_estimate_cannot_handle():
    m = models.get("gpt3-1.3b")

    def est(model, p):
        if p.interleave > 1:
            raise NotImplementedError("interleaved not modelled")
        return 1.0
    res = search.search(m, 16, 8, 64, 40 * GB, est, seq=2048)
    assert res.num_unestimated > 0 and all("interleaved" in k for k in res.unestimated_reasons)
    assert all(r.parallelism.interleave == 1 for r in res.plans)
    with pytest.raises(ValueError, match="positive, finite"):
        search.search(m, 16, 8, 64, 40 * GB, lambda model, p: 0.0, seq=2048)
    with pytest.raises(ValueError, match="top"):
        search.search(m, 16, 8, 64, 40 * GB, est, top=0)
