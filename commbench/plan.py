"""ModelSpec + Parallelism -> Workload: the CommOps that one optimizer step of
the plan issues (strategies/) and its ComputeOps (compute/ops.py), per rank of
each pipeline stage."""
import os
from dataclasses import asdict, fields, replace

from commbench import mapping_file, models
from commbench.compute import ops as compute_ops
from commbench.parallel import Parallelism
from commbench.workload import Workload

# plan fields a plan file or the PLAN-FLAGS may set (besides model)
PLAN_FIELDS = [f.name for f in fields(Parallelism)]


def data_parallel_strategy(par: Parallelism):
    from commbench.strategies import ddp, fsdp, zero
    return {0: ddp, 1: zero, 2: zero, 3: fsdp}[par.zero]


def comm_ops(model, par: Parallelism, tp_flavour: str = "megatron") -> list:
    from commbench.strategies import pp, tp
    ops = []
    if par.dp > 1:
        ops += data_parallel_strategy(par).comm_ops(model, par)
    if par.tp > 1:
        ops += tp.comm_ops(model, par, flavour=tp_flavour)
    if par.pp > 1:
        ops += pp.comm_ops(model, par)
    return ops


def build(model, par: Parallelism, tp_flavour: str = "megatron") -> Workload:
    """tp_flavour: megatron (default) or dtensor, the collectives of torch's
    DTensor tensor parallelism (what `validate` runs)."""
    model = model.at_tp(par.tp)
    par.check_model(model)
    return Workload(model=model.to_dict(), parallelism=dict(asdict(par), seq=par.seq_for(model), num_microbatches=par.num_microbatches,
                                                            num_nodes=par.num_nodes),
                    comm_ops=comm_ops(model, par, tp_flavour),
                    compute_ops=compute_ops.compute_ops(model, par, tp_flavour))


def load_plan_file(path: str) -> dict:
    """A plan file: JSON or YAML mapping with 'model' (a catalogue name or a model
    file) and Parallelism fields."""
    data = mapping_file.load(path, "plan")
    if "model" not in data:
        raise ValueError(f"plan file {path}: expected a mapping with 'model' and plan fields")
    unknown = sorted(set(data) - set(PLAN_FIELDS) - {"model", "vocab_divisible_by"})
    if unknown:
        raise ValueError(f"plan file {path}: unknown field(s) {', '.join(unknown)}")
    if isinstance(data["model"], str) and not os.path.isabs(data["model"]) and data["model"] not in models.CATALOGUE:
        data["model"] = os.path.join(os.path.dirname(path), data["model"])
    return data


def from_mapping(data: dict):
    """(ModelSpec, Parallelism) from a plan mapping; ValueError names what is wrong."""
    m = data["model"]
    if isinstance(m, str):
        model = models.get(m)
    elif isinstance(m, dict):
        try:
            model = models.ModelSpec(**{"name": "plan-model", **m})
        except TypeError as e:
            raise ValueError(f"bad plan: model: {e}") from None
    else:
        raise ValueError(f"bad plan: model must be a catalogue name, a model file or a mapping, got {m!r:.40}")
    kwargs = {k: v for k, v in data.items() if k not in ("model", "vocab_divisible_by") and v is not None}
    try:
        par = Parallelism(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad plan: {e}") from None
    if data.get("vocab_divisible_by") is not None:
        model = replace(model, vocab_divisible_by=data["vocab_divisible_by"])
    model = model.at_tp(par.tp)
    par.check_model(model)
    return model, par
