"""commbench's command line: one subcommand per verb. Exit statuses: 0 ok; 1 some
result was wrong (check: a regression); 2 bad input (one line on stderr); 3 the
run failed; 124 timeout: a rank hung or died, the job was stopped (one line
naming the collective, size, group and the ranks that did not answer); 130 / 143
interrupted by SIGINT / SIGTERM (finished results stay in the file: `run --resume`)."""
import argparse
import dataclasses
import datetime
import json
import os
import sys

from commbench import planflags
from commbench.timing import check_timeout

EXIT_OK, EXIT_WRONG, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
EXIT_TIMEOUT, EXIT_SIGINT, EXIT_SIGTERM = 124, 130, 143
EXIT_SIGPIPE = 141          # stdout's reader went away (`| head`), as a shell tool killed by SIGPIPE


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: error: {message}")


def _run_args(p):
    g = p.add_argument_group("sizes (nccl-tests flags; K/M/G suffixes are powers of 2)")
    g.add_argument("-b", "--minbytes", default="8", help="smallest message size (default 8)")
    g.add_argument("-e", "--maxbytes", default="32M", help="largest message size (default 32M)")
    g.add_argument("-f", "--stepfactor", type=float, default=None,
                   help="multiply the size by this between steps (default 2 unless -i is given)")
    g.add_argument("-i", "--stepbytes", default=None, help="add this many bytes between steps instead")
    g = p.add_argument_group("what to run")
    g.add_argument("--collective", default=None,
                   help="all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, "
                        "send_recv, send_recv_bidir, barrier; comma-separated, or all (default)")
    g.add_argument("-d", "--dtype", default=None,
                   help="element type(s), comma-separated, or all (default float32; with a plan, its dtype: bf16)")
    g.add_argument("-o", "--op", default="sum", help="reduction op(s): sum, prod, max, min, avg, or all")
    g.add_argument("--in-place", default="no", choices=["no", "yes", "both"],
                   help="out-of-place (default), in-place, or both")
    g.add_argument("-r", "--root", type=int, default=0, help="root rank of broadcast and reduce (default 0)")
    g.add_argument("--backend", default="torch", help="torch (default), mpi or cupy; kernels: GPU memory and "
                                                       "peer-to-peer copy bandwidth (kernels/*.cu)")
    g.add_argument("--dist-backend", default=None, help="torch process group: gloo, nccl or mpi "
                                                         "(default: nccl on cuda, gloo on cpu)")
    g.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when a GPU is visible)")
    g.add_argument("--groups", default="world",
                   help="group layouts, comma-separated: world, intra, inter, 'MOD k', 'DIV k'")
    g = p.add_argument_group("timing")
    g.add_argument("-n", "--iters", type=int, default=20, help="minimum timed iterations per size (default 20)")
    g.add_argument("-w", "--warmup", type=int, default=5, help="untimed warmup iterations (default 5)")
    g.add_argument("-c", "--check", type=int, default=1,
                   help="correctness-checked iterations before timing (default 1; 0 = no check)")
    g.add_argument("--target-ci", type=float, default=0.01,
                   help="stop when the 95%% CI of the median is within this fraction (default 0.01; 0 = exactly -n)")
    g.add_argument("--max-iters", type=int, default=10000, help="iteration cap per size (default 10000)")
    g.add_argument("--time-budget", type=float, default=1.0,
                   help="seconds per size to reach the target CI (default 1)")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds a rank may wait for the others, in the rendezvous and in each collective "
                        "(default: max(60, 10 x the time the size takes at 100 MB/s) per collective, 300 for "
                        "the rendezvous); past it the job ends with status 124")
    g = p.add_argument_group("launch and output")
    g.add_argument("--nprocs", type=int, default=None,
                   help="without a launcher, spawn this many local ranks (default: 2 on cpu, one per GPU)")
    g.add_argument("--out", default=None, help="results file (default results/run-TIMESTAMP.jsonl)")
    g.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    g.add_argument("--resume", default=None, metavar="FILE",
                   help="continue the interrupted sweep in FILE (same flags): its Cases are skipped, the rest appended")
    g.add_argument("--keep-rank-samples", action="store_true", help="store every rank's raw samples too")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    fmt.add_argument("--csv", action="store_true", help="print the results as CSV on stdout")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar or tables")


def _predict_inputs(p):
    g = p.add_argument_group("times (measured results, or a SystemSpec for what-if)")
    g.add_argument("--comm", nargs="+", default=[], metavar="RESULTS", help="results of commbench run")
    g.add_argument("--compute", nargs="+", default=[], metavar="RESULTS", help="results of commbench compute")
    g.add_argument("--system", default=None, help="SystemSpec name (polaris, thetagpu, dgx-h100, h200) or file; "
                                                  "fills in what the results files do not measure")
    g.add_argument("--interference", default=None, metavar="RESULTS",
                   help="results of commbench compute --interference: comm/compute slowdown under overlap")
    g.add_argument("--comm-backend", default=None, help="which backend's measurements to use when the files hold several")
    g.add_argument("--peak-tflops", type=float, default=None, help="peak dense TFLOPS per GPU for MFU "
                                                                   "(default: the SystemSpec's for the dtype)")


def build_parser() -> Parser:
    p = Parser(prog="commbench", description="Collective-communication microbenchmarks for distributed training")
    sub = p.add_subparsers(dest="verb", parser_class=Parser, metavar="VERB")
    sub.required = True
    r = sub.add_parser("run", help="sweep collectives over sizes, dtypes and group layouts, or a plan's collectives")
    _run_args(r)
    planflags.add(r, dtype_flag=False, required=False)
    r.add_argument("--isolated", action="store_true",
                   help="with a plan: one group of each axis alone (default: every group of the axis at once)")
    s = sub.add_parser("show", help="print a saved results file as the live tables (or a saved validate.json or "
                                    "predict --json document as its command prints it)")
    s.add_argument("file")
    fmt = s.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true")
    m = sub.add_parser("models", help="list the model catalogue with parameter counts")
    m.add_argument("--json", action="store_true", help="one JSON document on stdout")
    pl = sub.add_parser("plan", help="the collectives one training step of a plan issues")
    planflags.add(pl)
    pl.add_argument("--json", action="store_true", help="print the Workload as one JSON document")
    c = sub.add_parser("compute", help="time the compute kernels of a plan's training step at its shapes")
    planflags.add(c, required=False)
    g = c.add_argument_group("compute timing")
    g.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when a GPU is visible)")
    g.add_argument("--nprocs", type=int, default=None,
                   help="without a launcher, spawn this many local ranks, all timing at once (default 1 on cpu, "
                        "one per GPU)")
    g.add_argument("-n", "--iters", type=int, default=10, help="minimum timed iterations per kernel (default 10)")
    g.add_argument("-w", "--warmup", type=int, default=3, help="untimed warmup iterations (default 3)")
    g.add_argument("--target-ci", type=float, default=0.02,
                   help="stop when the 95%% CI of the median is within this fraction (default 0.02)")
    g.add_argument("--max-iters", type=int, default=1000, help="iteration cap per kernel (default 1000)")
    g.add_argument("--time-budget", type=float, default=1.0, help="seconds per kernel to reach the target CI")
    g.add_argument("--flush-l2", action="store_true", help="overwrite the last-level cache before each iteration")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds a rank may wait for the others beyond each kernel's own bound (at 1 GFLOP/s and "
                        "100 MB/s; default 60; 300 for the rendezvous); past it the job ends with status 124")
    g.add_argument("--out", default=None, help="results file (default results/compute-TIMESTAMP.jsonl)")
    g.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    g.add_argument("--json", action="store_true", help="print the ops with their times as one JSON document")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar or tables")
    g = c.add_argument_group("interference (--interference: compute and an all_reduce, alone and at once)")
    g.add_argument("--interference", action="store_true",
                   help="measure how much a concurrent all_reduce slows compute and compute the all_reduce")
    g.add_argument("--nbytes", default="4M", help="all_reduce size, K/M/G suffixes (default 4M)")
    g.add_argument("--sms", default=None, help="cuda: SM counts of the spin kernel, comma-separated "
                                               "(default 1/8, 1/4, 1/2 and all of the device's SMs)")
    g.add_argument("--gemm-size", type=int, default=512, help="cpu: square float32 torch.mm size (default 512)")
    pr = sub.add_parser("predict", help="the training step of a plan from measured (or specified) times")
    planflags.add(pr)
    _predict_inputs(pr)
    g = pr.add_argument_group("scaling")
    g.add_argument("--scale", default=None, help="predict at these GPU counts, e.g. 8,16,32,...,512")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--weak", dest="mode", action="store_const", const="weak",
                      help="hold the micro-batch per GPU (default)")
    mode.add_argument("--strong", dest="mode", action="store_const", const="strong", help="hold the global batch")
    g.add_argument("--plot", default=None, help="with --scale: write the scaling curves to this .png/.pdf/.svg")
    g.add_argument("--force", action="store_true", help="replace an existing --plot file")
    pr.add_argument("--json", action="store_true", help="print the StepBreakdown as one JSON document")
    v = sub.add_parser("validate", help="real training steps of a plan against its prediction")
    planflags.add(v, required=False)
    g = v.add_argument_group("validation")
    g.add_argument("--nprocs", type=int, default=None,
                   help="without a launcher, spawn this many local ranks (default 2 on cpu, one per GPU)")
    g.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when a GPU is visible)")
    g.add_argument("--steps", type=int, default=5, help="timed training steps (default 5)")
    g.add_argument("--tp-impl", default="auto",
                   help="tensor parallelism that runs: megatron (plain torch, Megatron's collectives), dtensor "
                        "(torch DTensor), or auto (default: megatron where it can, i.e. without SP or pp)")
    g.add_argument("--warmup-steps", type=int, default=2, help="untimed training steps first (default 2)")
    g.add_argument("--rounds", type=int, default=1,
                   help="alternate measuring and training this many times, the steps shared among the rounds "
                        "(default 1)")
    g.add_argument("--time-budget", type=float, default=0.5,
                   help="seconds per measured collective and kernel, per round, to reach +-2%% on its mean "
                        "(default 0.5)")
    g.add_argument("--train-time", type=float, default=None,
                   help="each half of a round trains at least this many seconds: more steps than --steps where "
                        "steps are short (default: a step op's budget in one window, 2 x --time-budget; "
                        "0: exactly --steps)")
    g.add_argument("--max-iters", type=int, default=2000,
                   help="iteration cap per measured collective and kernel (default 2000)")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds a rank may wait for the others beyond each phase's own bound (default: as run's "
                        "and compute's); past it the job ends with status 124")
    g.add_argument("--out-dir", default=None,
                   help="where comm.jsonl, compute.jsonl and validate.json go (default results/validate-TIMESTAMP)")
    g.add_argument("--force", action="store_true", help="overwrite the files in --out-dir")
    v.add_argument("--json", action="store_true", help="print the report as one JSON document")
    rp = sub.add_parser("report", help="an HTML and markdown report with figures from results, predict and "
                                       "validate outputs")
    rp.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="results files (.jsonl), predict --json documents, validate.json files")
    rp.add_argument("--out", required=True, metavar="DIR", help="folder for report.html, report.md and figures/")
    rp.add_argument("--title", default="commbench report", help="the report's title")
    rp.add_argument("--force", action="store_true", help="replace an existing report in DIR")
    e = sub.add_parser("env", help="print what a run records about the machine")
    e.add_argument("--json", action="store_true", help="one JSON document on stdout")
    e.add_argument("--backend", default="torch", help="backend used to gather the ranks under a launcher")
    e.add_argument("--device", default="auto", help="cpu, cuda or auto")
    e.add_argument("--timeout", type=float, default=300.0)
    from commbench import emulate
    emulate.add_args(sub.add_parser("emulate", help="run a command on an emulated multi-node cluster "
                                                    "(network namespaces, tc-shaped links; root)"))
    from commbench import cli_results
    cli_results.add_parsers(sub)
    from commbench import cli_plans
    cli_plans.add_parsers(sub, _predict_inputs)
    return p


def _device(name: str, backend: str) -> str:
    if name in ("cpu", "cuda"):
        if name == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA device is visible")
        return name
    if name != "auto":
        raise ValueError(f"unknown device {name!r}: choose cpu, cuda or auto")
    if backend == "cupy":
        return "cuda"
    if backend == "mpi":      # host buffers unless asked: device buffers need a CUDA-aware MPI
        return "cpu"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _config(a):
    from commbench.config import RunConfig
    from commbench.sizes import parse_size
    from commbench.timing import TimingSettings
    if a.stepbytes is not None and a.stepfactor is not None:
        raise ValueError("give -f/--stepfactor or -i/--stepbytes, not both")
    stepbytes = parse_size(a.stepbytes) if a.stepbytes is not None else None
    stepfactor = a.stepfactor if a.stepfactor is not None else (None if stepbytes is not None else 2.0)
    config = RunConfig(
        minbytes=parse_size(a.minbytes), maxbytes=parse_size(a.maxbytes), stepfactor=stepfactor,
        stepbytes=stepbytes, collectives=a.collective or "all", dtypes="float32" if a.dtype is None else a.dtype, redops=a.op,
        backend=a.backend,
        dist_backend=a.dist_backend, device=a.device if a.device in ("cpu", "cuda") else "cpu", layouts=a.groups,
        in_place=a.in_place, check_iters=a.check, root=a.root, timeout_s=a.timeout, keep_rank_samples=a.keep_rank_samples,
        timing=TimingSettings(warmup=a.warmup, iters=a.iters, max_iters=a.max_iters,
                              time_budget_s=a.time_budget, target_ci=a.target_ci))
    # resolving the device imports torch (seconds): only once everything else is valid
    config = dataclasses.replace(config, device=_device(a.device, a.backend))
    _check_backend_here(config)
    return config


def _check_backend_here(config):
    """What every rank would find missing, found once here before any rank starts."""
    import importlib.util
    if config.backend == "cupy" and importlib.util.find_spec("cupy") is None:
        raise ValueError("--backend cupy needs cupy (pip install 'commbench[gpu]')")
    if config.backend == "torch" and config.dist_backend == "nccl" and config.device != "cuda":
        raise ValueError("--dist-backend nccl runs on GPUs: it needs --device cuda")
    if config.backend == "torch" and config.dist_backend == "mpi":
        import torch.distributed as dist
        if not dist.is_mpi_available():
            raise ValueError("--dist-backend mpi: this torch is built without MPI (use --backend mpi for mpi4py)")


def _default_out(verb: str = "run") -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("results", f"{verb}-{stamp}-{os.getpid()}.jsonl")


def _check_resume(a, config):
    """--resume FILE: FILE is the output; its settings must be this command's."""
    if a.out is not None and os.path.abspath(a.out) != os.path.abspath(a.resume):
        raise ValueError(f"--resume {a.resume} appends to that file: drop --out {a.out}")
    if a.force:
        raise ValueError("--resume appends to the file and --force would replace it: choose one")
    if planflags.given(a):
        raise ValueError("--resume continues a collective sweep; a plan's collectives are rerun in full")
    from commbench import resume
    resume.load_for_resume(a.resume, config.settings())


def _spawn_self(a, argv, nprocs: int, verb: str, use_mpiexec: bool = False) -> int:
    """Start nprocs local ranks of this same command, each with the same --out."""
    from commbench import launch as launch_mod
    from commbench import outputs
    launch_mod.check_nprocs(nprocs)
    if getattr(a, "resume", None):
        return launch_mod.spawn_local(nprocs, list(argv), use_mpiexec=use_mpiexec)
    out = a.out or _default_out(verb)
    outputs.check_place(out, "--out")
    if os.path.exists(out) and not a.force:
        raise ValueError(f"{out} exists: commbench never overwrites results (use --force or another --out)")
    child = list(argv) if a.out is not None else [*argv, "--out", out]
    return launch_mod.spawn_local(nprocs, child, use_mpiexec=use_mpiexec)


def _run_plan(a, world: int, gpus_per_node: int):
    """(model, Parallelism) of `run --plan/--model ...` on a job of `world` ranks,
    or None without a plan."""
    if not planflags.given(a):
        if a.isolated:
            raise ValueError("--isolated measures a plan's groups one at a time: give --model or --plan with it")
        return None
    if a.collective is not None:
        raise ValueError("--collective chooses a sweep's collectives: with a plan, run measures the plan's own")
    defaults = {"world": world, "gpus_per_node": gpus_per_node}
    if a.dtype:
        from commbench.dtypes import parse_dtypes
        names = parse_dtypes(a.dtype)
        plan_dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(names[0])
        if len(names) != 1 or plan_dtype is None:
            raise ValueError(f"with a plan, -d/--dtype is the plan's dtype: one of bf16, fp16, fp32, got {a.dtype!r}")
        defaults["dtype"] = plan_dtype
    model, par = planflags.from_args(a, defaults)
    if par.world != world:
        raise ValueError(f"the plan is for {par.world} GPUs but this job has {world} ranks: "
                         "run --plan measures the plan's groups on a job of the plan's size")
    return model, par


def cmd_run(a, argv) -> int:
    from commbench import launch as launch_mod
    from commbench.backends import NEEDS_MPIEXEC
    if a.backend == "kernels":     # memory and p2p copy kernels, not a collective backend
        from commbench import kernel_bench
        return kernel_bench.cli(a, list(argv))
    config = _config(a)
    if a.resume is not None:
        _check_resume(a, config)
    info = launch_mod.detect()
    if info.launcher == "none":
        # no launcher: commbench starts the ranks itself
        nprocs = a.nprocs
        if nprocs is None:
            nprocs = 2
            if config.device == "cuda":
                import torch
                nprocs = torch.cuda.device_count()
        launch_mod.check_nprocs(nprocs)
        plan = _run_plan(a, nprocs, nprocs)      # a bad plan fails here, once, before any rank starts
        if plan is None and config.device == "cpu":
            from commbench import sweep
            sweep.check_memory(config, ["localhost"] * nprocs, nprocs)    # a sweep too big fails before it starts
        return _spawn_self(a, argv, nprocs, "run", use_mpiexec=config.backend in NEEDS_MPIEXEC)
    if a.nprocs is not None and a.nprocs != info.world_size:
        raise ValueError(f"--nprocs {a.nprocs} but the launcher started {info.world_size} ranks")
    from commbench import console, sweep
    plan = _run_plan(a, info.world_size, info.local_world_size)
    reporter = console.Reporter(quiet=a.quiet, to_stderr=a.json or a.csv) if info.rank == 0 else None
    result, wrong = sweep.run(config, info, ["commbench", *argv], a.resume or a.out or _default_out(), a.force,
                              reporter, plan=plan, isolated=a.isolated, resume=a.resume is not None)
    if result is not None:
        if a.json:
            print(json.dumps(result.to_json()))
        elif a.csv:
            result.to_dataframe().to_csv(sys.stdout, index=False)
        if wrong:
            print(f"commbench: {wrong} wrong result element(s); see #wrong in {result.path}", file=sys.stderr)
        elif not a.quiet and not (a.json or a.csv):
            print(f"results: {result.path}")
    return EXIT_WRONG if wrong else EXIT_OK


def cmd_compute(a, argv) -> int:
    """Time the plan's ComputeOps on every rank at once; rank 0 writes and prints."""
    if a.interference:
        from commbench import interference
        return interference.cli(a, argv)
    from commbench import launch as launch_mod
    from commbench.timing import TimingSettings
    settings = TimingSettings(warmup=a.warmup, iters=a.iters, max_iters=a.max_iters, time_budget_s=a.time_budget,
                              target_ci=a.target_ci)
    settings.check()
    if a.nprocs is not None:
        launch_mod.check_nprocs(a.nprocs)
    if a.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {a.device!r}: choose cpu, cuda or auto")
    check_timeout(a.timeout)
    info = launch_mod.detect()
    if info.launcher == "none":
        # a bad plan fails once, here, before torch is imported or any rank starts
        planflags.from_args(a, {"world": a.nprocs or 1, "gpus_per_node": a.nprocs or 1})
        device = _device(a.device, "torch")
        nprocs = a.nprocs
        if nprocs is None:
            import torch
            nprocs = torch.cuda.device_count() if device == "cuda" else 1
        return _spawn_self(a, argv, nprocs, "compute")
    device = _device(a.device, "torch")
    from commbench import plan as plan_mod
    from commbench.compute import report, runner
    model, par = planflags.from_args(a, {"world": info.world_size, "gpus_per_node": info.local_world_size})
    launch_mod.setup_cpu_rank(info, device)
    ops = plan_mod.build(model, par).compute_ops
    progress = report.ComputeProgress(a.quiet or a.json) if info.rank == 0 else None
    if progress:
        progress.start(0)
    from commbench import watchdog
    out = a.out or _default_out("compute")
    rf = watchdog.interruptible(info.rank, out, lambda: runner.run(
        ops, info, device, settings, out, a.force, ["commbench", *argv], flush_l2=a.flush_l2, timeout_s=a.timeout,
        reporter=progress, extra_settings={"plan": {"model": model.to_dict(), "parallelism": dataclasses.asdict(par)}}))
    if rf is None:
        return EXIT_OK
    progress.finish()
    matched = runner.match(ops, [rf], device)
    if a.json:
        print(json.dumps(report.json_doc(ops, matched)))
    elif not a.quiet:
        report.print_tables(ops, matched)
        print(f"results: {rf.path}")
    return EXIT_OK


def _launched_rank() -> int:
    """This process's rank under a launcher (mpiexec, torchrun, srun), 0 outside one."""
    from commbench import launch
    try:
        return launch.detect().rank
    except Exception:       # an inconsistent environment is its own error: say everything
        return 0


def cmd_predict(a) -> int:
    from commbench import outputs
    from commbench import plan as plan_mod
    from commbench import predict, ranking, scaling
    from commbench import system as system_mod
    spec = system_mod.load(a.system) if a.system else None
    # a spec's node: its GPUs per node unless the plan says otherwise, and never another count
    model, par = planflags.from_args(a, {"gpus_per_node": spec.gpus_per_node} if spec else None)
    counts = scaling.parse_counts(a.scale) if a.scale is not None else None
    if a.plot is not None and not counts:
        raise ValueError("--plot draws the scaling curves: give --scale too")
    if a.mode and not counts:
        raise ValueError(f"--{a.mode} says how to scale: give --scale too")
    if a.plot is not None:
        outputs.check_plot(a.plot, a.force)
    ranking.peak_tflops(None, par.dtype, a.peak_tflops)          # a bad --peak-tflops before any loading
    if spec:
        system_mod.check_node(spec, par.gpus_per_node, bool(a.comm))
    times = predict.load_times(a.comm, a.compute, a.system, a.interference, a.comm_backend)
    peak = ranking.peak_tflops(times.spec, par.dtype, a.peak_tflops)
    workload = plan_mod.build(model, par)
    sb = predict.predict(workload, par, times.bind(workload.compute_ops), peak)
    doc = sb.to_dict()
    rows = None
    if counts:
        mode = a.mode or "weak"
        rows = scaling.scale(model, par, counts, mode, lambda w: times.bind(w.compute_ops),
                             lambda w, p, t: predict.predict(w, p, t, peak))
        doc["scaling"] = {"mode": mode, "rows": rows}
        if a.plot:
            scaling.plot(rows, mode, model.name, a.plot)
    if a.json:
        print(json.dumps(doc))
        return EXIT_OK
    from rich.console import Console
    from commbench import console
    con = Console(width=200)
    console.print_breakdown(sb, con)
    if rows:
        console.print_scaling(rows, doc["scaling"]["mode"], con)
        if a.plot:
            con.print(f"plot: {a.plot}")
    return EXIT_OK


def _validate_plan(a, world: int, gpus_per_node: int, device: str):
    """The plan of `validate` on a job of `world` ranks: the job's size by
    default, fp32 on a CPU unless --dtype says otherwise (CPU kernels in 16 bits
    are slow emulations, not what a CPU run is for)."""
    defaults = {"world": world, "gpus_per_node": gpus_per_node}
    if device == "cpu":
        defaults["dtype"] = "fp32"
    model, par = planflags.from_args(a, defaults)
    if par.world != world:
        raise ValueError(f"the plan is for {par.world} GPUs but this job has {world} ranks")
    from commbench import training, validate
    training.check_plan(model, par)       # what the torch implementations cannot run, before anything starts
    validate.tp_impl_for(model, par, a.tp_impl)
    return model, par


def _out_dir(path: str, create: bool):
    """--out-dir: a folder (made when create); a file there is a ValueError."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out-dir {path} exists and is not a folder")
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out-dir {path}: cannot create it ({e.strerror or e})") from None


def cmd_validate(a, argv) -> int:
    from commbench import launch as launch_mod
    if a.steps < 1 or a.warmup_steps < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup-steps >= 0, got {a.steps} and {a.warmup_steps}")
    check_timeout(a.timeout)
    from commbench import validate
    timing = validate.timing_settings(a.time_budget, a.max_iters)
    validate.round_steps(a.steps, a.rounds)
    if a.train_time is not None and not a.train_time >= 0:
        raise ValueError(f"--train-time must be >= 0 seconds, got {a.train_time}")
    if a.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {a.device!r}: choose cpu, cuda or auto")
    info = launch_mod.detect()
    if info.launcher == "none":
        if a.nprocs is not None:
            launch_mod.check_nprocs(a.nprocs)
        guess = a.nprocs or 2
        _validate_plan(a, guess, guess, "cpu" if a.device == "auto" else a.device)   # fails fast on a bad plan
        device = _device(a.device, "torch")
        nprocs = a.nprocs
        if nprocs is None:
            import torch
            nprocs = torch.cuda.device_count() if device == "cuda" else 2
        _validate_plan(a, nprocs, nprocs, device)
        out_dir = a.out_dir or os.path.join("results", "validate-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        if os.path.exists(os.path.join(out_dir, "validate.json")) and not a.force:
            raise ValueError(f"{out_dir} holds a validation: commbench never overwrites results "
                             "(use --force or another --out-dir)")
        _out_dir(out_dir, create=True)
        child = list(argv) if a.out_dir else [*argv, "--out-dir", out_dir]
        return launch_mod.spawn_local(nprocs, child, use_mpiexec=False)
    device = _device(a.device, "torch")
    model, par = _validate_plan(a, info.world_size, info.local_world_size, device)
    out_dir = a.out_dir or os.path.join("results", "validate-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    _out_dir(out_dir, create=info.rank == 0)
    launch_mod.setup_cpu_rank(info, device)
    from commbench import watchdog
    doc = watchdog.interruptible(info.rank, out_dir, lambda: validate.run_on_rank(
        model, par, info, device, a.steps, a.warmup_steps, out_dir, ["commbench", *argv], overwrite=a.force,
        timeout_s=a.timeout, timing=timing, tp_impl=validate.tp_impl_for(model, par, a.tp_impl), rounds=a.rounds,
        train_time=a.train_time))
    if doc is None:
        return EXIT_OK
    path = validate.write(doc, out_dir, overwrite=a.force)
    if a.json:
        print(json.dumps(doc))
        return EXIT_OK
    from rich.console import Console
    con = Console(width=200)
    _print_validation(doc, con)
    con.print(f"results: {path}")
    return EXIT_OK


def _print_validation(doc: dict, con):
    """A validation's report (validate.json) as `validate` prints it."""
    from commbench import console
    from commbench.predict import StepBreakdown
    con.print(f"{doc['implementation']}")
    con.print(f"measured {doc['measured_step_time_s'] * 1e3:.2f} ms per step (median of {len(doc['measured_steps_s'])}; "
              f"{doc['measured_min_s'] * 1e3:.2f} - {doc['measured_max_s'] * 1e3:.2f} ms)   "
              f"predicted {doc['predicted_step_time_s'] * 1e3:.2f} ms   error {doc['error_pct']:+.1f} %")
    if len(doc["rounds"]) > 1:
        for r in doc["rounds"]:
            con.print(f"  round {r['round']}: measured {r['measured_step_time_s'] * 1e3:.2f} ms (median of "
                      f"{len(r['measured_steps_s'])})   predicted from its own measurements "
                      f"{r['predicted_step_time_s'] * 1e3:.2f} ms   error {r['error_pct']:+.1f} %")
    console.print_breakdown(StepBreakdown(**doc["prediction"]), con)


def _saved_document(path: str):
    """The kind and contents of a saved validation (validate.json) or
    prediction (`predict --json`): ("validate" | "predict", dict); None where
    the file is not one such JSON document (a results file is JSON lines)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("prediction"), dict) and "measured_step_time_s" in doc:
        return "validate", doc
    if isinstance(doc.get("breakdown"), dict) and "step_time_s" in doc:
        return "predict", doc
    return None


def _show_document(kind: str, doc: dict, a) -> int:
    if a.csv:
        raise ValueError(f"{a.file} is a saved {'validation' if kind == 'validate' else 'prediction'}, "
                         "one JSON document: --csv exports a results file's measurements (use --json)")
    if a.json:
        print(json.dumps(doc))
        return EXIT_OK
    from rich.console import Console

    from commbench import console
    from commbench.predict import StepBreakdown
    con = Console(width=200)
    try:
        if kind == "validate":
            _print_validation(doc, con)
        else:
            console.print_breakdown(StepBreakdown(**{k: v for k, v in doc.items() if k != "scaling"}), con)
            if isinstance(doc.get("scaling"), dict):
                console.print_scaling(doc["scaling"]["rows"], doc["scaling"]["mode"], con)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{a.file}: not a complete saved {kind} document ({type(e).__name__}: {e})") from None
    return EXIT_OK


def cmd_show(a) -> int:
    from commbench import console, results
    saved = _saved_document(a.file)
    if saved is not None:
        return _show_document(*saved, a)
    rf = results.load(a.file)
    if a.json:
        print(json.dumps(rf.to_json()))
    elif a.csv:
        rf.to_dataframe().to_csv(sys.stdout, index=False)
    else:
        from rich.console import Console
        con = Console(width=200)
        h = rf.header
        con.print(f"run {h.get('run_id')}  {h.get('created_at')}  {h.get('cluster', {}).get('num_ranks')} ranks on "
                  f"{h.get('cluster', {}).get('num_hosts')} host(s)  commbench {h.get('commbench_version')}")
        console.print_tables(rf.measurements, con)
    return EXIT_OK


def cmd_env(a) -> int:
    """Under a launcher every rank reports itself and rank 0 prints them all."""
    from commbench import env, launch as launch_mod, watchdog
    info = launch_mod.detect()
    device = _device(a.device, a.backend)
    if info.world_size > 1:
        backend = watchdog.open_backend(a.backend, info, device, a.timeout)
        try:
            ranks = backend.control_allgather(env.rank_info(info, device))
        finally:
            backend.close()
        if info.rank != 0:
            return EXIT_OK
    else:
        ranks = [env.rank_info(info, device)]
    doc = {"launcher": info.launcher, "world_size": info.world_size, "ranks": ranks,
           "cluster": env.cluster(ranks), "versions": env.versions(), "env": env.allowed_env()}
    if a.json:
        print(json.dumps(doc))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table
    con = Console(width=200)
    t = Table(title="commbench env", show_header=False)
    c = doc["cluster"]
    t.add_row("launcher", info.launcher)
    t.add_row("ranks", f"{info.world_size} on {c['num_hosts']} host(s): " +
              ", ".join(f"{h} x {n}" for h, n in c["ranks_per_host"].items()))
    t.add_row("cpu", f"{c['cpu_model']} ({c['cpu_count']} cores)")
    for gpu in c["gpus"] or [{"name": "none visible (NVML absent or no GPU)"}]:
        t.add_row("gpu", json.dumps(gpu) if "index" in gpu else gpu["name"])
    for k, v in doc["versions"].items():
        t.add_row(k, str(v))
    for k, v in doc["env"].items():
        t.add_row(k, v)
    con.print(t)
    r = Table(title="ranks")
    for col in ("rank", "host", "local rank", "pid", "gpu"):
        r.add_column(col)
    for x in ranks:
        r.add_row(str(x["rank"]), x["host"], str(x["local_rank"]), str(x["pid"]), json.dumps(x.get("gpu", "")))
    con.print(r)
    return EXIT_OK


def cmd_report(a) -> int:
    from commbench import report
    paths = report.build(a.inputs, a.out, title=a.title, force=a.force)
    print(f"report: {paths['html']} and {paths['markdown']} ({len(paths['figures'])} figures)")
    return EXIT_OK


def cmd_models(a) -> int:
    from commbench import models
    rows = [m.to_dict() for m in models.CATALOGUE.values()]
    if a.json:
        print(json.dumps({"models": rows}))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table
    t = Table(title="model catalogue (parameter counts computed from the configuration)")
    for col in ("name", "arch", "layers", "hidden", "heads", "kv heads", "ffn", "vocab", "seq", "params"):
        t.add_column(col, justify="left" if col in ("name", "arch") else "right")
    for m in rows:
        n = m["num_params"]
        t.add_row(m["name"], m["arch"], str(m["num_layers"]), str(m["hidden"]), str(m["heads"]), str(m["kv_heads"]),
                  str(m["ffn_hidden"]), str(m["vocab"]), str(m["seq"]),
                  f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M")
    Console(width=200).print(t)
    return EXIT_OK


def cmd_plan(a) -> int:
    from commbench import plan as plan_mod
    model, par = planflags.from_args(a)
    workload = plan_mod.build(model, par)
    if a.json:
        print(json.dumps(workload.to_dict()))
        return EXIT_OK
    from rich.console import Console
    from commbench import console
    con = Console(width=200)
    console.print_plan(workload, par, con)
    return EXIT_OK


def _refuse_empty(a):
    """An empty string is no value: `--out ''` must not mean the default."""
    for name, v in vars(a).items():
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError(f"an empty value for {name.replace('_', '-')}")


def _stdout_gone() -> int:
    """The reader of stdout went away: end quietly (whatever was written to files
    is complete), with nothing more sent to the closed pipe."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_SIGPIPE


def entry():
    """The `commbench` command and `python -m commbench`: main(), then the end of
    the process. Where torch was loaded, the process ends without the
    interpreter's finalization (outputs flushed; every results file is written
    and closed by then): gloo's worker threads can still hold work whose tensors
    need the GIL while the interpreter is torn down, which aborts a rank whose
    run succeeded (SIGABRT, "terminate called without an active exception",
    exit 134; pytorch/pytorch#179291)."""
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = _stdout_gone()
    if "torch" in sys.modules:
        sys.stderr.flush()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()      # what mpi4py's atexit would do: Open MPI's mpirun fails a rank that skips it
        os._exit(code or 0)
    raise SystemExit(code)


def _broken_pipe(console):
    """rich's Console ends the process with status 1 (commbench's "a result was
    wrong") when stdout's reader goes away: raise instead, for main() to end as
    every verb does."""
    console.quiet = True
    raise BrokenPipeError


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import rich.console
    rich.console.Console.on_broken_pipe = _broken_pipe
    try:
        a = build_parser().parse_args(argv)
        _refuse_empty(a)
        if a.verb == "run":
            return cmd_run(a, list(argv))
        if a.verb == "show":
            return cmd_show(a)
        if a.verb == "models":
            return cmd_models(a)
        if a.verb == "plan":
            return cmd_plan(a)
        if a.verb == "compute":
            return cmd_compute(a, list(argv))
        if a.verb == "predict":
            return cmd_predict(a)
        if a.verb == "validate":
            return cmd_validate(a, list(argv))
        if a.verb == "emulate":
            from commbench import emulate
            return emulate.cli(a)
        if a.verb == "report":
            return cmd_report(a)
        if a.verb in ("compare", "check", "baseline", "import"):
            from commbench import cli_results
            return cli_results.dispatch(a)
        if a.verb in ("search", "study"):
            from commbench import cli_plans
            return cli_plans.dispatch(a)
        return cmd_env(a)
    except (UsageError, ValueError) as e:
        # a job-wide refusal, or bad flags every rank of a launched job reads alike: rank 0 says it
        if not getattr(e, "quiet", False) and _launched_rank() == 0:
            print(f"commbench: error: {e}" if not str(e).startswith("commbench") else str(e), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:    # Ctrl-C, or watchdog.Interrupted (SIGINT/SIGTERM, quiet but on rank 0)
        message = getattr(e, "message", "commbench: interrupted")
        if message:
            print(message, file=sys.stderr)
        return getattr(e, "exit_status", EXIT_SIGINT)
    except BrokenPipeError:
        return _stdout_gone()
    except Exception as e:   # a failed run: one line; the traceback with COMMBENCH_DEBUG=1
        if os.environ.get("COMMBENCH_DEBUG"):
            raise
        print(f"commbench: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return EXIT_FAILED
