"""Model catalogue (parameter counts against published ones and a real torch
module), Parallelism validation rules, and the Megatron rank mesh against
hand-written layouts."""
import json

import pytest

from commbench import models, torch_model
from commbench.parallel import Parallelism

PUBLISHED = {   # parameter counts as published (GPT-3 paper Table 2.1; Llama 2 / 3 model cards)
    "gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9,
    "llama2-7b": 6.74e9, "llama2-13b": 13.02e9, "llama2-70b": 68.98e9,
    "llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "llama3-405b": 405.85e9,
}


@pytest.mark.parametrize("name, count", sorted(PUBLISHED.items()))
def test_parameter_counts_match_the_published_ones(name, count):
    assert models.get(name).num_params == pytest.approx(count, rel=0.02)


@pytest.mark.parametrize("name", ["gpt-1.5b", "gpt-20b", "gpt-33b", "gpt3-13b"])
def test_gpt_counts_follow_the_textbook_formula(name):
    # 12 L h^2 + 13 L h (blocks with 4h MLP and biases) + V h + s h (embeddings) + 2 h (final LayerNorm)
    m = models.get(name)
    L, h = m.num_layers, m.hidden
    assert m.num_params == 12 * L * h * h + 13 * L * h + m.vocab * h + m.seq * h + 2 * h


def test_the_study_sizes_have_the_stated_shapes():
    for name, (layers, hidden, heads) in {"gpt-1.5b": (48, 1536, 24), "gpt-20b": (44, 6144, 64),
                                          "gpt-33b": (80, 6144, 64)}.items():
        m = models.get(name)
        assert (m.num_layers, m.hidden, m.heads) == (layers, hidden, heads)


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama", "small-gpt"])
def test_a_real_torch_module_has_exactly_the_computed_count(name):
    m = models.get(name)
    net = torch_model.build(m)
    assert sum(p.numel() for p in net.parameters()) == m.num_params


def test_llama_shapes():
    m = models.get("llama3-70b")
    assert (m.kv_heads, m.head_dim, m.kv_dim, m.ffn_hidden, m.vocab) == (8, 128, 1024, 28672, 128256)
    assert m.gated_mlp and not m.has_bias and not m.tied_embeddings


def test_user_model_files(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text('{"num_layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq": 16}')
    m = models.get(str(p))
    assert m.name == "mine" and m.ffn_hidden == 128 and m.kv_heads == 4
    y = tmp_path / "mine.yaml"
    y.write_text("name: y\nnum_layers: 2\nhidden: 32\nheads: 4\nkv_heads: 2\nvocab: 100\nseq: 16\narch: llama\n")
    assert models.get(str(y)).kv_heads == 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_layers": 2, "hidden": 30, "heads": 4, "vocab": 100, "seq": 16}')
    with pytest.raises(ValueError, match="not divisible by heads"):
        models.get(str(bad))
    bad.write_text('{"num_layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq": 16, "layers": 3}')
    with pytest.raises(ValueError, match="unknown field"):
        models.get(str(bad))
    with pytest.raises(ValueError, match="unknown model"):
        models.get("gpt5-1t")


@pytest.mark.parametrize("extra, rule", [
    ('"ffn_hidden": -1', "ffn_hidden must be a non-negative integer"),
    ('"ffn_hidden": 3.5', "ffn_hidden must be a non-negative integer"),
    ('"kv_heads": "x"', "kv_heads must be a non-negative integer"),
    ('"tied_embeddings": "no"', "tied_embeddings must be true or false"),
    ('"num_layers": 100000000000000000000000', "num_layers 100000000000000000000000 is beyond any model"),
    ('"vocab": 16777217', "vocab 16777217 is beyond any model"),
])
def test_model_file_field_types(tmp_path, extra, rule):
    bad = tmp_path / "bad.json"
    doc = json.loads('{"num_layers": 2, "hidden": 32, "heads": 4, "vocab": 100, "seq": 16, ' + extra + "}")
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=rule):
        models.get(str(bad))


@pytest.mark.parametrize("kwargs, rule", [
    (dict(world=16, tp=3), "does not divide world size 16"),
    (dict(world=16, tp=2, pp=2, dp=3), r"tp\*pp\*dp = 12 but world size is 16"),
    (dict(world=8, gpus_per_node=4, tp=8), "spans nodes"),
    (dict(world=12, gpus_per_node=4, tp=3), "does not divide gpus-per-node"),
    (dict(world=8, micro_batch=2, global_batch=12), "not a multiple of micro-batch x dp"),
    (dict(world=8, zero=4), "zero stage must be"),
    (dict(world=8, sp=True), "needs tp > 1"),
    (dict(world=8, dtype="fp8"), "dtype 'fp8'"),
    (dict(world=8, schedule="zigzag"), "pipeline schedule"),
    (dict(world=8, recompute="some"), "recompute"),
    (dict(world=0), "world must be a positive integer"),
    (dict(world=10, gpus_per_node=4), "whole number of nodes"),
    (dict(world=8, pp=2, interleave=2, global_batch=12), "multiple of pp"),
    (dict(world=8, interleave=2), "needs pipeline parallelism"),
    (dict(world=8, schedule="interleaved"), "needs pipeline parallelism"),
    (dict(world=8, pp=2, interleave=2, schedule="gpipe", global_batch=16), "not gpipe"),
    (dict(world=8, sp="false", tp=2), "sp must be true or false"),
    (dict(world=8, allow_tp_across_nodes="no"), "allow-tp-across-nodes must be true or false"),
    (dict(world=8, bucket_mb=float("inf")), "bucket-mb must be a positive finite"),
    (dict(world=8, bucket_mb=float("nan")), "bucket-mb must be a positive finite"),
    (dict(world=8, bucket_mb=True), "bucket-mb must be a positive finite"),
    (dict(world=8, bucket_mb="x"), "bucket-mb must be a positive finite"),
    (dict(world=8, zero=3, zero_flavour="deepspeed"), "ZeRO-3 is modelled as FSDP2"),
    (dict(world=8, pp=2, zero=2, zero_flavour="deepspeed"), "refuses ZeRO-2"),
    (dict(world=8, gpus_per_node=4, tp=8), "--allow-tp-across-nodes models it anyway"),
    (dict(world=1, global_batch=100_001), "100001 micro-batches per step .* beyond what this tool simulates"),
])
def test_every_validation_rule_names_itself(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        Parallelism(**kwargs)


@pytest.mark.parametrize("model, kwargs, rule", [
    ("gpt3-13b", dict(world=24, gpus_per_node=8, tp=8, pp=3), "layers 40 .* not divisible by pp"),
    ("gpt3-125m", dict(world=16, gpus_per_node=8, tp=8), "heads 12 .* not divisible by tp 8"),
    (models.ModelSpec("gqa6", 4, 768, 12, 100, 16, kv_heads=6), dict(world=4, gpus_per_node=4, tp=4),
     "kv heads 6 of gqa6 are not divisible by tp 4"),
    # Megatron-core divides the query groups over tp: 8 kv heads cannot go 16 ways
    ("llama2-70b", dict(world=16, gpus_per_node=16, tp=16), "kv heads 8 of llama2-70b are not divisible by tp 16"),
    ("gpt3-175b", dict(world=8, gpus_per_node=8, seq=4096), "seq 4096 is longer than the 2048 learned positions"),
    ("tiny-gpt", dict(world=4, gpus_per_node=4, tp=2, sp=True, seq=63), "seq 63 is not divisible by tp 2"),
])
def test_model_rules(model, kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        Parallelism(**kwargs).check_model(models.get(model) if isinstance(model, str) else model)


def test_mesh_tp2_pp2_dp2_on_two_nodes_of_four():
    p = Parallelism(world=8, gpus_per_node=4, tp=2, pp=2)
    assert p.dp == 2
    assert p.groups["tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert p.groups["dp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert p.groups["pp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert (p.axis_nodes("tp"), p.axis_nodes("dp"), p.axis_nodes("pp")) == (1, 1, 2)
    assert p.coords(6) == (1, 1, 0) and p.rank_of(1, 1, 0) == 6


def test_mesh_pure_dp_and_tp4_on_polaris_like_nodes():
    p = Parallelism(world=8, gpus_per_node=4)
    assert p.groups["dp"] == [tuple(range(8))] and p.axis_nodes("dp") == 2
    q = Parallelism(world=16, gpus_per_node=4, tp=4, pp=1)
    assert q.groups["tp"] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert q.groups["dp"] == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert q.axis_nodes("tp") == 1 and q.axis_nodes("dp") == 4


def test_mesh_pp4_dp1_and_accumulation():
    p = Parallelism(world=4, gpus_per_node=2, pp=4, micro_batch=2, global_batch=16)
    assert p.groups["pp"] == [(0, 1, 2, 3)] and p.groups["dp"] == [(0,), (1,), (2,), (3,)]
    assert p.num_microbatches == 8 and p.axis_nodes("pp") == 2
    assert all(len(g) == 1 for g in p.groups["tp"])


def test_vocab_padding_as_megatron():
    """--make-vocab-size-divisible-by d: the vocabulary padded up to a multiple of
    d x tp (Megatron's _vocab_size_with_padding), by hand."""
    m = models.get("gpt3-1.3b")                       # V = 50257
    assert m.at_tp(4) is m                            # vocab_divisible_by 1: as given
    p = models.ModelSpec(**{**{k: v for k, v in m.to_dict().items() if k != "num_params"},
                            "vocab_divisible_by": 128})
    assert [p.at_tp(t).vocab for t in (1, 2, 8)] == [50304, 50432, 51200]   # 393 x 128, 197 x 256, 50 x 1024
    assert p.at_tp(2).at_tp(2) == p.at_tp(2)
    assert p.at_tp(1).num_params - m.num_params == (50304 - 50257) * 2048
    llama = models.get("llama2-7b")                   # 32000 = 250 x 128: nothing to pad
    assert models.ModelSpec(**{**{k: v for k, v in llama.to_dict().items() if k != "num_params"},
                               "vocab_divisible_by": 128}).at_tp(2).vocab == 32000
    # a real torch module of the padded model holds exactly the computed count
    tiny = models.ModelSpec("t", 2, 32, 4, 500, 16, vocab_divisible_by=64).at_tp(1)
    assert tiny.vocab == 512
    assert sum(x.numel() for x in torch_model.build(tiny).parameters()) == tiny.num_params


def test_vocab_padding_reaches_the_plan():
    """--vocab-divisible-by on the command line: the logits GEMM, the tied embedding's
    DP gradient and the parameter count all follow the padded vocabulary."""
    from commbench import plan
    from commbench.planflags import add, from_args
    import argparse
    ap = argparse.ArgumentParser()
    add(ap)
    flags = ["--model", "gpt3-1.3b", "--world", "4", "--gpus-per-node", "4", "--tp", "2", "--global-batch", "8"]
    base_model, base = from_args(ap.parse_args(flags))
    model, par = from_args(ap.parse_args(flags + ["--vocab-divisible-by", "128"]))
    assert model.vocab == 50432 and base_model.vocab == 50257
    w0, w = plan.build(base_model, base), plan.build(model, par)
    logits = lambda wl: next(op for op in wl.compute_ops if op.name == "logits fwd")     # noqa: E731
    assert (logits(w0).n, logits(w).n) == (25129, 25216)          # ceil(50257 / 2), 50432 / 2
    dp = lambda wl: sum(c.nbytes * c.count for c in wl.comm_ops if c.axis == "dp")   # noqa: E731
    assert dp(w) - dp(w0) == (25216 - 25129) * 2048 * 2           # bf16 gradient of the extra rows
    assert w.model["vocab_divisible_by"] == 128 and w.model["num_params"] - w0.model["num_params"] == 175 * 2048


def test_vocab_padding_reaches_the_memory_estimate():
    """memory_per_gpu prices the padded vocabulary of a model that asks for it
    (search and study call it with the model as given)."""
    from commbench import memory
    m = models.get("gpt3-1.3b")
    p = models.ModelSpec(**{**{k: v for k, v in m.to_dict().items() if k != "num_params"},
                            "vocab_divisible_by": 128})
    par = Parallelism(world=2, gpus_per_node=2, tp=2, micro_batch=1, global_batch=8)
    assert memory.memory_per_gpu(p, par) == memory.memory_per_gpu(p.at_tp(2), par)
    assert memory.memory_per_gpu(p, par).total > memory.memory_per_gpu(m, par).total
