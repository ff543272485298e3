"""Every file parser, fed arbitrary bytes, text and near-valid documents, returns
a valid object or raises ValueError: never another exception (#7)."""
import json
import os
import tempfile

from hypothesis import HealthCheck, given, settings, strategies as st

from commbench import import_nccl, mapping_file, models, plan as plan_mod, results, system
from commbench.results import make_header

FUZZ = settings(max_examples=int(os.environ.get("COMMBENCH_FUZZ_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=12)


def _write(data: bytes, suffix: str) -> str:
    fd, path = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _only_value_error(fn, data: bytes, suffix: str):
    path = _write(data, suffix)
    try:
        fn(path)
    except ValueError:
        pass
    finally:
        os.unlink(path)


VALID_CASE = {"kind": "collective", "op": "all_reduce", "backend": "mpi", "device": "cpu", "dtype": "float32",
              "nbytes": 8, "group_size": 2, "num_nodes": 1, "axis": "world", "in_place": False}


@FUZZ
@given(st.binary(max_size=300))
def test_results_load_bytes(data):
    _only_value_error(results.load, data, ".jsonl")


@FUZZ
@given(st.lists(json_values, min_size=0, max_size=4), st.booleans())
def test_results_load_near_valid(lines, truncate):
    """A valid header, then arbitrary JSON documents, some shaped like measurements."""
    docs = [json.dumps(make_header(run_id="f"))]
    for v in lines:
        if isinstance(v, dict):
            v = dict(v, case=dict(VALID_CASE, **{k: x for k, x in v.items() if k in VALID_CASE}))
        docs.append(json.dumps(v))
    text = "\n".join(docs) + "\n"
    if truncate:
        text = text[: len(text) * 2 // 3]
    path = _write(text.encode(), ".jsonl")
    try:
        rf = results.load(path)
        rf.to_dataframe()
    except ValueError:
        pass
    finally:
        os.unlink(path)


@FUZZ
@given(st.binary(max_size=200), st.sampled_from([".json", ".yaml"]))
def test_mapping_file_bytes(data, suffix):
    _only_value_error(lambda p: mapping_file.load(p, "plan"), data, suffix)


@FUZZ
@given(json_values)
def test_model_files(doc):
    fields = {"arch": "gpt", "num_layers": 2, "hidden": 64, "heads": 4, "vocab": 100, "seq": 32}
    if isinstance(doc, dict):
        doc = dict(fields, **doc) if len(doc) % 2 else doc
    _only_value_error(models.load_file, json.dumps(doc).encode(), ".json")


@FUZZ
@given(st.one_of(json_values, st.dictionaries(st.sampled_from(
    ["model", "world", "gpus_per_node", "dp", "tp", "pp", "zero", "sp", "micro_batch", "global_batch", "seq",
     "dtype", "interleave", "recompute"]), st.one_of(st.integers(-3, 70), st.sampled_from(["tiny-gpt", "bf16", "x"]),
                                                     json_values), max_size=10)))
def test_plan_files(doc):
    def load(path):
        model, par = plan_mod.from_mapping(plan_mod.load_plan_file(path))
        plan_mod.build(model, par)
    _only_value_error(load, json.dumps(doc).encode(), ".json")


@FUZZ
@given(st.one_of(json_values, st.dictionaries(st.sampled_from(
    ["name", "gpus_per_node", "gpu_memory_gb", "peak_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps",
     "intra_latency_us", "inter_latency_us", "efficiency", "sources"]), json_values, max_size=11)))
def test_system_spec_files(doc):
    _only_value_error(system.load, json.dumps(doc).encode(), ".json")


@FUZZ
@given(st.binary(max_size=200))
def test_system_spec_bytes(data):
    _only_value_error(system.load, data, ".json")


NCCL_LINES = ["# nThread 1 nGpus 1 minBytes 8 maxBytes 128 step: 2(factor) warmup iters: 5 iters: 20",
              "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw"
              "   busbw #wrong",
              "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)"
              "  (GB/s)",
              "           8             2     float     sum      -1    10.50    0.00    0.00      0    10.20"
              "    0.00    0.00      0",
              "# Avg bus bandwidth    : 0.0012"]


@FUZZ
@given(st.lists(st.one_of(st.sampled_from(NCCL_LINES), st.text(max_size=40)), max_size=8))
def test_nccl_tests_logs(lines):
    _only_value_error(lambda p: import_nccl.convert(p, "all_reduce"), "\n".join(lines).encode(), ".log")


@FUZZ
@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_nccl_tests_json_and_bytes(data):
    _only_value_error(lambda p: import_nccl.convert(p, "all_reduce"), data, ".json")
