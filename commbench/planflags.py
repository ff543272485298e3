"""PLAN-FLAGS (DESIGN.md, "Interfaces"), shared by the verbs that take a plan:
--model --world --gpus-per-node --dp --tp --pp --zero --sp --micro-batch
--global-batch --seq --dtype ..., or --plan FILE."""
import argparse

from commbench import plan as plan_mod


def add(p, dtype_flag: bool = True, required: bool = True):
    g = p.add_argument_group("plan (a model and its parallelism)")
    g.add_argument("--plan", dest="plan_file", default=None, help="plan file (JSON/YAML): model + the fields below")
    g.add_argument("--model", default=None, help="catalogue name (commbench models) or a model JSON/YAML file")
    g.add_argument("--world", type=int, default=None, help="GPUs in the job")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node")
    g.add_argument("--dp", type=int, default=None, help="data-parallel size (default: derived)")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    g.add_argument("--pp", type=int, default=None, help="pipeline stages")
    g.add_argument("--zero", type=int, default=None, help="0 DDP, 1/2 ZeRO, 3 FSDP full shard")
    g.add_argument("--zero-flavour", default=None, help="torch (ZeroRedundancyOptimizer, FSDP2) or deepspeed")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="Megatron sequence parallelism (--no-sp turns off a plan file's)")
    g.add_argument("--micro-batch", type=int, default=None)
    g.add_argument("--global-batch", type=int, default=None)
    g.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    if dtype_flag:
        g.add_argument("--dtype", default=None, help="parameter/activation dtype: bf16 (default), fp16, fp32")
    g.add_argument("--grad-dtype", default=None, help="gradient-reduction dtype (default: --dtype)")
    g.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket size in MB (default 25)")
    g.add_argument("--schedule", default=None, help="pipeline schedule: 1f1b (default), interleaved, gpipe")
    g.add_argument("--interleave", type=int, default=None, help="virtual stages per pipeline rank")
    g.add_argument("--recompute", default=None, help="activation recompute: none, selective, full")
    g.add_argument("--allow-tp-across-nodes", action="store_true", default=None)
    g.add_argument("--vocab-divisible-by", type=int, default=None, metavar="N",
                   help="pad the vocabulary to a multiple of N x tp, as Megatron's --make-vocab-size-divisible-by "
                        "(default: the model's, 1 = as given)")
    p.set_defaults(_plan_required=required)


_FLAG_TO_FIELD = {"world": "world", "gpus_per_node": "gpus_per_node", "dp": "dp", "tp": "tp", "pp": "pp",
                  "zero": "zero", "zero_flavour": "zero_flavour", "sp": "sp", "micro_batch": "micro_batch",
                  "global_batch": "global_batch", "seq": "seq", "dtype": "dtype", "grad_dtype": "grad_dtype",
                  "bucket_mb": "bucket_mb", "schedule": "schedule", "interleave": "interleave",
                  "recompute": "recompute", "allow_tp_across_nodes": "allow_tp_across_nodes",
                  "vocab_divisible_by": "vocab_divisible_by"}


def given(a) -> bool:
    """Whether the command line asks for a plan at all; plan fields without
    --model or --plan are a ValueError (they would be ignored)."""
    if a.plan_file is not None or a.model is not None:
        return True
    loose = [f for f in [*plan_mod.PLAN_FIELDS, "vocab_divisible_by"] if getattr(a, f, None) is not None and f != "dtype"]
    if loose:
        raise ValueError(f"--{loose[0].replace('_', '-')} is a plan field: give --model or --plan with it")
    return False


def mapping(a, defaults: dict | None = None) -> dict:
    """The plan mapping: the file (if any), then the flags over it, then defaults
    for what neither gave."""
    data = plan_mod.load_plan_file(a.plan_file) if a.plan_file else {}
    if a.model is not None:
        data["model"] = a.model
    for flag, field in _FLAG_TO_FIELD.items():
        v = getattr(a, flag, None)
        if v is not None:
            data[field] = v
    for k, v in (defaults or {}).items():
        data.setdefault(k, v)
    if "model" not in data:
        raise ValueError("a plan needs --model NAME|FILE (or --plan FILE)")
    if "world" not in data:
        raise ValueError("a plan needs --world N")
    return data


def from_args(a, defaults: dict | None = None):
    """(ModelSpec, Parallelism) from the flags; ValueError names the rule that failed."""
    return plan_mod.from_mapping(mapping(a, defaults))
