"""`commbench study`: the experiments of the at-scale study (DESIGN.md, first
section) predicted from shipped SystemSpecs, one system or several side by side.

Each experiment is data: a name, a title, why its model and sizes were chosen,
and its points (series, label, model, plan fields). The system supplies
gpus_per_node (the layouts) and gpu_memory_gb (which plans fit); every point is
predicted with the same Times `commbench predict --system` uses. A point whose
memory does not fit is kept and marked (fits = false, with the bytes it needs),
never dropped. Adding an experiment is one more entry in EXPERIMENTS.

  dp-weak-scaling  pure DDP of gpt-1.5b (the study's own 1.5B GPT, the size it
                   scaled with data parallelism: a full replica with Adam states,
                   23 GB, fits one 40 GB A100) from 8 to 512 GPUs, micro-batch 2
                   per GPU, no accumulation, selective recompute (flash-attention
                   style: without it one replica's activations exceed 40 GB);
                   scaling efficiency = samples/s per GPU relative to 8 GPUs, as
                   scaling.scale defines it
  zero-stages      DDP and ZeRO-1/2/3 at 64 GPUs over six consecutive GPT-3 sizes
                   (125M to 6.7B): on 40 GB GPUs the small ones fit with DDP, the
                   largest only with ZeRO-2/3, so the table shows both the memory
                   wall and what each stage costs in communication
  model-parallel   TP, PP and TP+PP, each of degree 4 with DP 16 and ZeRO-1
                   (Megatron's distributed optimizer), for gpt-20b (the study's
                   20B GPT) on 64 GPUs, global batch 256 (16 micro-batches of 1),
                   full recompute (all three fit in 40 GB). Degree 4 is the largest
                   TP that stays inside a 4-GPU Polaris node, so every plan exists
                   on every system; where TP's per-layer all-reduces, PP's bubble
                   and DP's gradient traffic land depends on the system's NVLink
                   and network bandwidth, which is the study's point."""
import dataclasses
import json
import os
from dataclasses import dataclass

from commbench import memory, models, predict, ranking
from commbench import plan as plan_mod
from commbench import system as system_mod
from commbench.parallel import Parallelism

RESERVE = 0.1           # of GPU memory kept free, as `commbench search` keeps by default


@dataclass(frozen=True)
class Point:
    series: str         # a line or a group of bars (the model, or the strategy)
    label: str          # the x value's name
    model: str
    plan: dict          # Parallelism fields; gpus_per_node comes from the system


@dataclass(frozen=True)
class Experiment:
    name: str
    title: str
    why: str
    points: tuple
    scaling: bool = False      # points of one series differ in GPU count: report scaling efficiency


def weak_scaling(model: str, counts, **plan) -> tuple:
    """One series: the plan at each GPU count with the micro-batch per GPU held
    and no accumulation, so the global batch is micro-batch x GPUs."""
    mb = plan.get("micro_batch", 1)
    return tuple(Point(model, str(n), model, dict(plan, world=n, global_batch=mb * n)) for n in counts)


def grid(model_names, variants, **plan) -> tuple:
    """Every model with every (label, fields) variant over a common plan."""
    return tuple(Point(label, m, m, dict(plan, **fields)) for m in model_names for label, fields in variants)


DP_COUNTS = (8, 16, 32, 64, 128, 256, 512)
ZERO_MODELS = ("gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b")
ZERO_VARIANTS = (("DDP", {"zero": 0}), ("ZeRO-1", {"zero": 1}), ("ZeRO-2", {"zero": 2}), ("ZeRO-3", {"zero": 3}))
MP_VARIANTS = (("TP4 x DP16", {"tp": 4}), ("PP4 x DP16", {"pp": 4}), ("TP2 x PP2 x DP16", {"tp": 2, "pp": 2}))

EXPERIMENTS = (
    Experiment("dp-weak-scaling", "Data-parallel weak scaling (DDP), 8 to 512 GPUs",
               "gpt-1.5b: the study's data-parallel model; one replica with its Adam states fits a 40 GB GPU",
               weak_scaling("gpt-1.5b", DP_COUNTS, micro_batch=2, recompute="selective"), scaling=True),
    Experiment("zero-stages", "DDP and ZeRO-1/2/3 over six model sizes at 64 GPUs",
               "GPT-3 125M to 6.7B: DDP fits the small ones, only ZeRO-2/3 the largest on 40 GB GPUs",
               grid(ZERO_MODELS, ZERO_VARIANTS, world=64, micro_batch=2, recompute="selective")),
    Experiment("model-parallel", "TP, PP and TP+PP (each with DP 16, ZeRO-1) for a 20B GPT at 64 GPUs",
               "gpt-20b: the study's model-parallel model; degree 4 keeps TP inside a 4-GPU node on every system",
               grid(("gpt-20b",), MP_VARIANTS, world=64, zero=1, micro_batch=1, global_batch=256,
                    recompute="full")),
)


def comm_bytes_per_rank(workload) -> dict:
    """axis -> bytes a rank sends per step on it (S x count x busbw factor, the
    plan's volume), on its busiest stage."""
    out = {}
    per_stage = {}
    for (stage, axis, _where), v in workload.volume_per_axis().items():
        per_stage[(stage, axis)] = per_stage.get((stage, axis), 0.0) + v
    for (stage, axis), v in per_stage.items():
        out[axis] = max(out.get(axis, 0.0), v)
    return out


def evaluate(point: Point, spec, times) -> dict:
    """One point on one system: its memory, whether it fits, and its prediction."""
    row = {"system": spec.name, "series": point.series, "label": point.label, "model": point.model}
    try:
        model = models.get(point.model)
        par = Parallelism(**dict(point.plan, gpus_per_node=spec.gpus_per_node))
        par.check_model(model)
    except ValueError as e:
        return dict(row, error=str(e))
    mem = memory.memory_per_gpu(model, par)
    usable = spec.gpu_memory_bytes * (1 - RESERVE)
    workload = plan_mod.build(model, par)
    sb = predict.predict(workload, par, times.bind(workload.compute_ops),
                         ranking.peak_tflops(spec, par.dtype))
    return dict(row, gpus=par.world, parallelism=dict(dataclasses.asdict(par), seq=par.seq_for(model), num_microbatches=par.num_microbatches),
                fits=memory.fits(mem, spec.gpu_memory_bytes, RESERVE), memory_bytes=mem.to_dict(), usable_bytes=usable,
                step_time_s=sb.step_time_s, samples_per_s=sb.samples_per_s, tokens_per_s=sb.tokens_per_s,
                tflops_per_gpu=sb.tflops_per_gpu, mfu=sb.mfu, breakdown=sb.breakdown,
                comm_bytes_per_rank=comm_bytes_per_rank(workload))


def add_efficiency(rows: list):
    """Scaling efficiency per (system, series), as scaling.scale: samples/s per GPU
    relative to the smallest GPU count's."""
    groups = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["system"], r["series"]), []).append(r)
    for group in groups.values():
        base = min(group, key=lambda r: r["gpus"])
        per_gpu = base["samples_per_s"] / base["gpus"]
        for r in group:
            r["scaling_efficiency"] = (r["samples_per_s"] / r["gpus"]) / per_gpu


def run(system_names, experiments=EXPERIMENTS) -> dict:
    """The study document: every experiment's points on every system."""
    if not system_names:
        raise ValueError("study needs at least one system (--system NAME[,NAME])")
    specs = [system_mod.load(n) for n in system_names]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--system lists a system twice: {', '.join(names)}")
    times = {s.name: ranking.CachedTimes(predict.load_times((), (), n)) for s, n in zip(specs, system_names)}
    doc = {"systems": [{"name": s.name, "gpu": s.gpu, "gpus_per_node": s.gpus_per_node,
                        "gpu_memory_gb": s.gpu_memory_gb, "intra_bw_gbps": s.intra_bw_gbps,
                        "inter_bw_gbps": s.inter_bw_gbps} for s in specs],
           "experiments": []}
    for exp in experiments:
        rows = [evaluate(p, s, times[s.name]) for s in specs for p in exp.points]
        if exp.scaling:
            add_efficiency(rows)
        doc["experiments"].append({"name": exp.name, "title": exp.title, "why": exp.why,
                                   "scaling": exp.scaling, "rows": rows})
    doc["notes"] = sorted({n for t in times.values() for n in t.notes.values()})
    return doc


def out_paths(out_dir: str) -> list:
    """study.json and one PNG per experiment, in out_dir."""
    return [os.path.join(out_dir, "study.json")] + [os.path.join(out_dir, f"{e.name}.png") for e in EXPERIMENTS]


def check_out(out_dir: str, force: bool):
    """ValueError unless the study may be written to out_dir (nothing is replaced without force)."""
    from commbench import outputs
    if not out_dir:
        raise ValueError("--out: give a folder, not an empty string")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out {out_dir} exists and is not a folder")
    for path in out_paths(out_dir):
        outputs.check_new(path, force, "--out")


def write(doc: dict, out_dir: str) -> list:
    """study.json and one PNG per experiment in out_dir (check_out first);
    returns the paths."""
    from commbench import study_report
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out_dir}: cannot create it ({e.strerror})") from None
    paths = []
    for exp in doc["experiments"]:
        path = os.path.join(out_dir, f"{exp['name']}.png")
        study_report.figure(exp, path)
        paths.append(path)
    path = os.path.join(out_dir, "study.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    return [path] + paths


__all__ = ["Point", "Experiment", "EXPERIMENTS", "weak_scaling", "grid", "run", "write", "evaluate"]
