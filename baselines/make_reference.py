"""Write baselines/reference/*.jsonl: published NCCL bus-bandwidth figures as
commbench results files, so that `commbench compare` and `commbench check`
(which read results files) can set a run beside them.

These are REFERENCE POINTS, NOT MEASUREMENTS BY COMMBENCH: every figure below is
a number NVIDIA's NCCL team stated in public, with its source. A reference file
says so in its header (`reference: true`, `source`, `url`, `stated_at`,
`notes`) and in every measurement's warnings. A statement gives a bandwidth,
not samples: each measurement holds ONE sample, the time that bandwidth
implies, t = S / algbw with algbw = busbw / factor (nccl-tests' factors:
2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter), so
compare/check show the ratio and mark the case `untested` (no significance
test on one sample).

Usage: python baselines/make_reference.py [--force]   (from the repository root)"""
import argparse
import datetime
import json
import os
import sys

from commbench import __version__, results, stats

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference")
GIB8 = 8 << 30     # the size at which the figures are stated as peaks (see notes)
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n}

A100_SOURCE = ("Sylvain Jeaugey (NVIDIA, NCCL), comment of 2023-07-05 in NVIDIA/nccl-tests issue #149 "
               "'Expected bandwidth results? A100 GPUs over NVLink' (8x A100-SXM4-80GB on NVLink/NVSwitch)")
H100_SOURCE = ("Sylvain Jeaugey (NVIDIA, NCCL), comment of 2024-05-06 in NVIDIA/nccl-tests issue #212 "
               "'H100 all reduce performance is poor' (8x H100 SXM on NVLink4/NVSwitch)")
REFERENCES = {
    "dgx-a100-nvlink-nccl": {
        "system": "8x A100 SXM4 on NVLink3/NVSwitch, one node (DGX A100 / HGX A100 topology)",
        "gpu": "NVIDIA A100-SXM4", "env": {},
        "source": A100_SOURCE, "url": "https://github.com/NVIDIA/nccl-tests/issues/149", "stated_at": "2023-07-05",
        "notes": "Stated (paraphrased): 12 NVLinks at 25 GB/s line rate per direction give about 20 GB/s "
                 "effective each (128 B payloads from the SMs), 240 GB/s in total, which other bottlenecks on the "
                 "GPU limit to about 230 GB/s; all_reduce_perf should reach 230 GB/s busbw when run up to 8G "
                 "(-e 8G; at 512M it is still rising). Recorded: all_reduce busbw 230 GB/s at 8 GiB.",
        "points": [("all_reduce", 230.0)]},
    "dgx-h100-nvlink-nccl": {
        "system": "8x H100 SXM on NVLink4/NVSwitch, one node (DGX H100 / HGX H100 topology), NCCL defaults "
                  "(all_reduce uses NVLink SHARP, NVLS)",
        "gpu": "NVIDIA H100-SXM", "env": {},
        "source": H100_SOURCE, "url": "https://github.com/NVIDIA/nccl-tests/issues/212", "stated_at": "2024-05-06",
        "notes": "Stated (paraphrased): 450 GB/s is the NVLink line rate; after about 20 % protocol overhead "
                 "NCCL gets an effective 370 GB/s, seen as busbw of the operations other than all_reduce; "
                 "all_reduce uses NVLink SHARP by default and on 8 GPUs peaks at about 480 GB/s busbw (algbw "
                 "about 275 GB/s), at sizes larger than 256M. Recorded: all_reduce 480, all_gather and reduce_scatter "
                 "370 GB/s busbw at 8 GiB (the source names no size beyond 'larger than 256M'; 8 GiB is a size on "
                 "the plateau, where nccl-tests sweeps end with -e 8G).",
        "points": [("all_reduce", 480.0), ("all_gather", 370.0), ("reduce_scatter", 370.0)]},
    "dgx-h100-nvlink-nccl-ring": {
        "system": "8x H100 SXM on NVLink4/NVSwitch, one node, NCCL_ALGO=RING (no NVLink SHARP)",
        "gpu": "NVIDIA H100-SXM", "env": {"NCCL_ALGO": "RING"},
        "source": H100_SOURCE, "url": "https://github.com/NVIDIA/nccl-tests/issues/212", "stated_at": "2024-05-06",
        "notes": "Stated (paraphrased): the effective NVLink bandwidth of 370 GB/s is also what all_reduce "
                 "shows as busbw when run with NCCL_ALGO=RING. Recorded: all_reduce busbw 370 GB/s at 8 GiB, for a run with NCCL_ALGO=RING.",
        "points": [("all_reduce", 370.0)]},
}
N = 8


def measurement(op: str, busbw: float, in_place: bool, name: str) -> results.Measurement:
    algbw = busbw / FACTOR[op](N)
    t = GIB8 / (algbw * 1e9)
    params = {"count": GIB8 // 4 // (N if op == "reduce_scatter" else 1), "world_size": N}   # output elements
    if op != "all_gather":
        params["redop"] = "sum"
    case = results.Case(kind="collective", op=op, backend="nccl", device="cuda", dtype="float32", nbytes=GIB8,
                        group_size=N, num_nodes=1, axis="world", in_place=in_place, concurrent_groups=1,
                        params=params)
    return results.Measurement(
        case=case, samples_s=[t], stats=stats.summarize([t]), algbw_gbps=algbw, busbw_gbps=busbw,
        warnings=[f"reference point ({name}): a published figure, not a commbench measurement; one sample derived "
                  "from the stated busbw (t = S / (busbw / factor)); source in the header"])


def write(name: str, ref: dict, force: bool) -> str:
    path = os.path.join(HERE, name + ".jsonl")
    if os.path.exists(path) and not force:
        raise ValueError(f"{path} exists: give --force to rewrite it")
    host = f"{name} (reference)"
    header = results.make_header(
        commbench_version=__version__, run_id=f"reference-{name}",
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command_line=["python", "baselines/make_reference.py"], launcher="reference",
        reference=True, system=ref["system"], source=ref["source"], url=ref["url"], stated_at=ref["stated_at"],
        notes=ref["notes"],
        cluster={"num_ranks": N, "num_hosts": 1, "hosts": [host], "ranks_per_host": {host: N},
                 "gpus": [{"host": host, "index": i, "name": ref["gpu"]} for i in range(N)]},
        versions={}, env=ref["env"],
        settings={"reference": {"in_place": "the statement does not distinguish: nccl-tests reports out-of-place "
                                            "and in-place columns; the figure is recorded for both"}})
    ms = [measurement(op, bw, ip, name) for op, bw in ref["points"] for ip in (False, True)]
    os.makedirs(HERE, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(x, allow_nan=False) for x in [header] + [m.to_dict() for m in ms]) + "\n")
    results.load(path)      # what it wrote is a valid results file
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--force", action="store_true", help="rewrite existing reference files")
    a = p.parse_args(argv)
    try:
        for name, ref in REFERENCES.items():
            print(write(name, ref, a.force))
    except ValueError as e:
        print(f"make_reference: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
