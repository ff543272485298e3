"""The `search` and `study` verbs: their flags and the step from flags to
ranking.run / study.run. Bad input is a ValueError naming the value (cli.main
turns it into one line on stderr and exit 2)."""
import json

VERBS = ("search", "study")


def add_parsers(sub, predict_inputs):
    """predict_inputs(parser): the --comm/--compute/--system/... group `predict` has."""
    from commbench.search import DEFAULT_MICRO_BATCHES
    s = sub.add_parser("search", help="rank every valid plan of a model that fits in GPU memory by predicted "
                                      "step time")
    g = s.add_argument_group("the job")
    g.add_argument("--model", required=True, help="catalogue name (commbench models) or a model JSON/YAML file")
    g.add_argument("--world", type=int, required=True, help="GPUs in the job")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: the --system spec's; required without one)")
    g.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: --world, one sequence per GPU)")
    g.add_argument("--seq", type=int, default=0, help="sequence length (default: the model's)")
    g.add_argument("--dtype", default="bf16", help="parameter/activation dtype: bf16 (default), fp16, fp32")
    g.add_argument("--micro-batches", default=",".join(map(str, DEFAULT_MICRO_BATCHES)),
                   help="micro-batch sizes to try, comma-separated (default %(default)s)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory of one GPU, 1 GB = 1e9 B (default: the --system spec's gpu_memory_gb)")
    g.add_argument("--memory-reserve", type=float, default=0.1,
                   help="fraction of GPU memory kept free for what memory.py does not count (default 0.1)")
    predict_inputs(s)
    s.add_argument("--top", type=int, default=10, help="how many of the best plans to show (default 10)")
    s.add_argument("--json", action="store_true", help="print the ranking as one JSON document")

    st = sub.add_parser("study", help="the at-scale study's experiments (DP scaling, ZeRO stages, model "
                                      "parallelism) predicted from SystemSpecs")
    st.add_argument("--system", required=True, help="SystemSpec name(s) or file(s), comma-separated, "
                                                    "e.g. thetagpu,dgx-h100")
    st.add_argument("--out", default=None, metavar="DIR", help="write study.json and one PNG per experiment here")
    st.add_argument("--force", action="store_true", help="replace study.json and the PNGs in --out")
    st.add_argument("--json", action="store_true", help="print the study as one JSON document")


def _micro_batches(text: str) -> tuple:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--micro-batches {text!r}: a comma-separated list of positive integers") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--micro-batches {text!r}: a comma-separated list of positive integers")
    return values


def cmd_search(a) -> int:
    from commbench import models, predict, ranking
    from commbench import system as system_mod
    if a.top < 1:
        raise ValueError(f"--top must be a positive integer, got {a.top}")
    if not a.system and not (a.comm and a.compute):
        raise ValueError("search needs times: --system SPEC, or --comm RESULTS... and --compute RESULTS... "
                         "(with --gpus-per-node and --gpu-memory-gb)")
    if a.gpu_memory_gb is not None and not a.gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {a.gpu_memory_gb}")
    micro = _micro_batches(a.micro_batches)
    model = models.get(a.model)
    spec = system_mod.load(a.system) if a.system else None
    gpus_per_node = a.gpus_per_node if a.gpus_per_node is not None else (spec.gpus_per_node if spec else None)
    if gpus_per_node is None:
        raise ValueError("search needs --gpus-per-node without --system (a spec gives its own)")
    if spec:
        system_mod.check_node(spec, gpus_per_node, bool(a.comm))
    memory_gb = a.gpu_memory_gb if a.gpu_memory_gb is not None else (spec.gpu_memory_gb if spec else None)
    if memory_gb is None:
        raise ValueError("search needs the GPU memory: --gpu-memory-gb X (1 GB = 1e9 B), or --system SPEC "
                         "(its gpu_memory_gb)")
    global_batch = a.global_batch if a.global_batch is not None else a.world
    times = predict.load_times(a.comm, a.compute, a.system, a.interference, a.comm_backend)
    peak = ranking.peak_tflops(times.spec, a.dtype, a.peak_tflops)
    rep = ranking.run(model, a.world, gpus_per_node, global_batch, times, memory_gb * 1e9, seq=a.seq,
                      dtype=a.dtype, top=a.top, peak=peak, reserve_fraction=a.memory_reserve, micro_batches=micro)
    c = rep.counts()
    if c["valid"] == 0:         # no plan at all is a question that cannot be asked, not an empty answer
        reason, n = max(rep.result.invalid_reasons.items(), key=lambda kv: kv[1], default=("none enumerated", 0))
        raise ValueError(f"no valid plan of {model.name} on {a.world} GPUs: {reason} "
                         f"({n} of {c['enumerated']} candidates)")
    if a.json:
        doc = rep.to_dict()
        doc["system"] = spec.name if spec else None
        print(json.dumps(doc))
        return 0
    from rich.console import Console
    from commbench import search_report
    search_report.print_report(rep, Console(width=200), spec.name if spec else None)
    return 0


def cmd_study(a) -> int:
    from commbench import study
    names = [x.strip() for x in a.system.split(",") if x.strip()]
    if not names:
        raise ValueError(f"--system {a.system!r}: give one or more SystemSpec names or files, comma-separated")
    if a.out is not None:
        study.check_out(a.out, a.force)
    doc = study.run(names)
    paths = study.write(doc, a.out) if a.out is not None else []
    if a.json:
        print(json.dumps(doc))
        return 0
    from rich.console import Console
    from commbench import study_report
    con = Console(width=220)
    study_report.print_study(doc, con)
    for p in paths:
        con.print(f"wrote {p}")
    return 0


def dispatch(a) -> int:
    return cmd_search(a) if a.verb == "search" else cmd_study(a)
