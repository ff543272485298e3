"""SystemSpec: the shipped specs load and cite a source for every figure; the
collective and compute times match arithmetic done by hand; bad files are
ValueErrors that name the field."""
import json
import os

import pytest

from commbench import system
from commbench.workload import ComputeOp

SHIPPED = ("polaris", "thetagpu", "dgx-h100", "h200")


@pytest.mark.parametrize("name", sorted(set(SHIPPED) | set(system.available())))
def test_shipped_specs_load_with_a_source_for_every_figure(name):
    spec = system.load(name)
    assert spec.name == name
    assert spec.missing_sources() == []
    assert all(v.strip() for v in spec.sources.values())
    assert "assumption" in spec.sources["gemm_efficiency"]
    assert "assumption" in spec.sources["inter_efficiency"]


def test_the_four_specs_are_shipped():
    assert set(SHIPPED) <= set(system.available())


@pytest.mark.parametrize("name, gb", [("polaris", 40), ("thetagpu", 40), ("dgx-h100", 80), ("h200", 141)])
def test_gpu_memory_is_the_datasheet_capacity_in_1e9_bytes(name, gb):
    spec = system.load(name)
    assert spec.gpu_memory_gb == gb                     # A100 40GB, H100 SXM 80GB, H200 141GB
    assert spec.gpu_memory_bytes == gb * 1e9            # the project's GB: 1e9 B
    assert "marketed" in spec.sources["gpu_memory_gb"].lower()


def test_polaris_all_reduce_1gib_on_64_gpus_by_hand():
    spec = system.load("polaris")
    # the figures used below, as the ALCF docs, the A100 datasheet and NCCL give them
    assert (spec.gpus_per_node, spec.nics_per_node, spec.nic_gbit_s) == (4, 2, 200)
    assert (spec.inter_efficiency, spec.inter_latency_us, spec.intra_bw_gbps) == (0.8, 2.7, 300)
    # 64 GPUs = 16 nodes x 4. NIC share per GPU: 2 NICs x 200 Gb/s / 8 bit/B / 4 GPUs = 12.5 GB/s;
    # 4 ranks of the group per node -> 4 shares = 50 GB/s, x 0.8 efficiency = 40 GB/s
    # (below NVLink's 300 x 0.8 = 240 GB/s, so the network is the bottleneck)
    bw = 40e9
    # ring all-reduce: 2 (n-1) = 126 steps of 2.7 us
    latency = 126 * 2.7e-6
    # each rank sends 2 (n-1)/n of the 1 GiB buffer: 2^30 x 126/64 = 2113929216 B
    moved = 2113929216
    want = latency + moved / bw          # 0.0003402 + 0.0528482304 = 0.0531884304 s
    assert want == pytest.approx(0.0531884304, rel=1e-12)
    assert spec.collective_time_s("all_reduce", 1 << 30, 64, 16) == pytest.approx(want, rel=1e-12)


def test_dgx_h100_all_gather_inside_a_node_by_hand():
    spec = system.load("dgx-h100")
    # NVLink 450 GB/s one way x 0.8 = 360 GB/s; ring all-gather: 7 steps of 0.6 us and
    # 7/8 of S over each link
    want = 7 * 0.6e-6 + (1 << 28) * 7 / 8 / 360e9
    assert spec.collective_time_s("all_gather", 1 << 28, 8, 1) == pytest.approx(want, rel=1e-12)
    assert spec.collective_time_s("all_gather", 1 << 28, 1, 1) == 0.0
    with pytest.raises(ValueError, match="puts 16 ranks on a node of 8"):
        spec.collective_time_s("all_gather", 1 << 28, 16, 1)


def test_gemm_time_by_hand():
    spec = system.load("polaris")
    # 4096^3 GEMM: 2 m n k = 137438953472 FLOPs, beyond the curve's 1e11 point -> 0.8 of 312 TFLOPS
    big = ComputeOp(name="mlp", kind="gemm", m=4096, n=4096, k=4096, flops=2 * 4096 ** 3,
                    nbytes=3 * 4096 * 4096 * 2, dtype="bf16")
    assert spec.compute_time_s(big) == pytest.approx(137438953472 / (312e12 * 0.8), rel=1e-12)
    # 10^9.5 FLOPs sits halfway (in log10) between the 1e9 (0.35) and 1e10 (0.70) points
    mid = ComputeOp(name="qkv", kind="gemm", flops=10 ** 9.5, nbytes=1000, dtype="bfloat16")
    assert spec.compute_time_s(mid) == pytest.approx(10 ** 9.5 / (312e12 * 0.525), rel=1e-12)
    # fp32 uses the fp32 peak
    f32 = ComputeOp(name="x", kind="gemm", flops=1e12, nbytes=0, dtype="fp32")
    assert spec.compute_time_s(f32) == pytest.approx(1e12 / (19.5e12 * 0.8), rel=1e-12)


def test_elementwise_time_by_hand():
    spec = system.load("polaris")
    # memory-bound: 1e9 B / (1555 GB/s x 0.85); its 1e8 FLOPs at 19.5 TFLOPS take far less
    op = ComputeOp(name="gelu", kind="elementwise", m=250_000_000, flops=1e8, nbytes=1_000_000_000)
    assert spec.compute_time_s(op) == pytest.approx(1e9 / (1555e9 * 0.85), rel=1e-12)
    with pytest.raises(ValueError, match="kind 'conv'"):
        spec.compute_time_s(ComputeOp(name="c", kind="conv"))
    with pytest.raises(ValueError, match="dtype 'int8' has no peak"):
        spec.compute_time_s(ComputeOp(name="g", kind="gemm", flops=1e9, dtype="int8"))


def _write(tmp_path, change):
    with open(os.path.join(system.SYSTEMS_DIR, "polaris.json"), encoding="utf-8") as f:
        d = json.load(f)
    change(d)
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(d))
    return str(p)


@pytest.mark.parametrize("change, field", [
    (lambda d: d.pop("hbm_gbps"), "hbm_gbps"),
    (lambda d: d.pop("gpu_memory_gb"), "gpu_memory_gb"),
    (lambda d: d.update(gpu_memory_gb=0), "gpu_memory_gb"),
    (lambda d: d.update(intra_bw_gbps=-300), "intra_bw_gbps"),
    (lambda d: d.update(nics_per_node="2"), "nics_per_node"),
    (lambda d: d.update(inter_efficiency=1.5), "inter_efficiency"),
    (lambda d: d["peak_tflops"].pop("bf16"), "peak_tflops.bf16"),
    (lambda d: d.update(gemm_efficiency=[[1e9, 0.5], [1e8, 0.6]]), "gemm_efficiency[1]"),
    (lambda d: d.update(intra_bw=300), "intra_bw"),
])
def test_bad_files_name_the_field(tmp_path, change, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        system.load(_write(tmp_path, change))


def test_unknown_name_and_bad_json(tmp_path):
    with pytest.raises(ValueError, match="unknown system 'frontier'.*polaris"):
        system.load("frontier")
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON system spec"):
        system.load(str(p))
    with pytest.raises(ValueError, match="cannot read"):
        system.load(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("dtype, peak", [("bf16", 312), ("bfloat16", 312), ("fp16", 312), ("float16", 312),
                                         ("fp32", 19.5), ("float32", 19.5)])
def test_predict_mfu_is_against_the_peak_gemms_are_timed_at(capsys, dtype, peak):
    # every spelling of a dtype gets its peak, and fp32 is the fp32 peak its GEMMs run at
    from commbench import cli
    code = cli.main(["predict", "--model", "gpt3-125m", "--world", "8", "--gpus-per-node", "4", "--global-batch", "16",
                     "--dtype", dtype, "--system", "polaris", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["mfu"] == pytest.approx(doc["tflops_per_gpu"] / peak, rel=1e-12)
    assert system.peak_key(dtype) == ("fp32" if peak == 19.5 else "bf16" if "b" in dtype else "fp16")


def test_predict_on_a_spec_takes_its_nodes(capsys):
    """Without --gpus-per-node a spec's plan has the spec's nodes (8 GPUs on a
    DGX H100: data parallelism over 64 GPUs crosses 8 nodes, not 64)."""
    from commbench import cli

    def predict(*extra):
        code = cli.main(["predict", "--model", "gpt3-1.3b", "--world", "64", "--global-batch", "64",
                         "--system", "dgx-h100", "--json", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)
    implied, given = predict(), predict("--gpus-per-node", "8")
    assert implied == given
    code = cli.main(["predict", "--model", "gpt3-1.3b", "--world", "64", "--global-batch", "64", "--tp", "8",
                     "--system", "dgx-h100", "--json"])
    assert code == 0, capsys.readouterr().err
