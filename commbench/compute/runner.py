"""`commbench compute`: time every distinct ComputeOp of a plan on every rank at
once (a node's shared power, clocks and memory bandwidth are part of what is
measured), with the timing protocol of the collectives (warmup, adaptive
repetitions, per-iteration max over ranks; CUDA events on GPUs), and write one
compute Measurement per distinct kernel and shape as it completes.

Case of a compute measurement: kind "compute", op = the kernel (gemm_nt,
sdpa_bwd, layernorm_fwd, adam, ...), dtype, device, nbytes = bytes the kernel
moves, axis "compute", concurrent_groups = ranks timing at once, params = the
shape (m, n, k, batch, and the op's own shape facts) and its FLOPs."""
import datetime
import uuid

import numpy as np

from commbench import env, results, stats, timing
from commbench import launch as launch_mod
from commbench.compute import Staged
from commbench.parallel import DTYPE_BYTES
from commbench.results import Case, Measurement, ResultFile

TORCH_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                "fp32": "float32", "float32": "float32"}


def case_of(op, device: str, backend_name: str, concurrent: int) -> Case:
    from commbench.compute import optimizer
    params = {"m": op.m, "n": op.n, "k": op.k, "batch": op.batch, "flops": op.flops, **dict(op.params)}
    if op.impl == "adam":
        params["timed_numel"] = optimizer.timed_numel(op, device)
    return Case(kind="compute", op=op.impl, backend=backend_name, device=device, dtype=TORCH_DTYPES[op.dtype],
                nbytes=int(op.nbytes), group_size=1, num_nodes=1, axis="compute", in_place=False,
                concurrent_groups=concurrent, params=params)


def distinct_cases(ops, device, backend_name, concurrent) -> list:
    """(Case, the first op of that Case) for each distinct kernel and shape, in op order."""
    seen = {}
    for op in ops:
        c = case_of(op, device, backend_name, concurrent)
        seen.setdefault(c.key(), (c, op))
    return list(seen.values())


def scale(m: Measurement) -> float:
    """Factor from a measurement's timed call to the op it stands for: an Adam
    shard timed on fewer elements than it has is scaled by the element ratio
    (memory-bound, linear); everything else is timed at its full shape."""
    p = m.case.params
    return p["m"] / p["timed_numel"] if m.case.op == "adam" and p.get("timed_numel") else 1.0


def op_time_s(m: Measurement, field: str = "time_p50_s") -> float:
    return m.stats[field] * scale(m)


def cache_flush_bytes(torch, device: str) -> int:
    """Twice the last-level cache: the GPU's L2, or 64 MiB on a CPU."""
    if str(device).startswith("cuda"):
        return 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return 2 * (64 << 20)


def flush_buffer(torch, device: str):
    """A buffer whose overwriting (fill_) evicts the last-level cache."""
    return torch.empty(max(cache_flush_bytes(torch, device) // 4, 1), dtype=torch.float32, device=device)


class PerCallTimer:
    """Times each iteration on its own, between untimed steps of its own: a
    Staged op's `before` and `after`, and with flush, overwriting a buffer twice the size of the
    last-level cache (GPU L2, or 64 MiB on a CPU) so every call starts with cold
    caches. Everything else is the backend's."""

    def __init__(self, backend, torch, device, flush: bool):
        self.backend, self.torch, self.device = backend, torch, device
        self.buf = flush_buffer(torch, device) if flush else None

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def flush_bytes(self) -> int:
        return 0 if self.buf is None else 4 * self.buf.numel()

    def time_iterations(self, op, iters):
        if self.buf is None and not isinstance(op, Staged):
            return self.backend.time_iterations(op, iters)
        torch, out = self.torch, []
        call = op.timed if isinstance(op, Staged) else op
        for _ in range(iters):
            if self.buf is not None:
                self.buf.fill_(1.0)
            if isinstance(op, Staged) and op.before:
                op.before()
            if self.device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) * 1e-3)
            else:
                out += timing.host_timer(call, 1)
            if isinstance(op, Staged) and op.after:
                op.after()
        return out


def free_bytes(device: str, ranks_on_host: int) -> int | None:
    """Memory this rank may use (memcheck's reading): its GPU's free memory, or
    the host's available memory shared by its ranks; None where unknown."""
    from commbench import memcheck
    if device == "cuda":
        return memcheck.device_available()
    host = memcheck.host_available()
    return None if host is None else host // max(1, ranks_on_host)


MODULE_IMPLS = ("layer_fwd", "layer_bwd", "head_fwd", "head_bwd", "stage_fwd", "stage_bwd")


def needed_bytes(op, device: str) -> int:
    """A generous bound on what timing op allocates: for a kernel, its inputs
    and outputs (the bytes it moves) twice over; for a module, what its forward
    and backward hold at once (module_bytes); for Adam, per element timed, the
    fp32 master, gradient, m and v and a 16-bit copy (18 B)."""
    if op.impl == "adam":
        import torch

        from commbench.compute import optimizer
        return 18 * optimizer.timed_numel(op, device) + cache_flush_bytes(torch, device)
    if op.impl in MODULE_IMPLS:
        return module_bytes(dict(op.params), op.impl, DTYPE_BYTES[op.dtype])
    return 2 * int(op.nbytes)


def module_bytes(p: dict, impl: str, d: int) -> int:
    """A bound on what a module op (a layer, the head or a whole stage, one
    micro-batch, its forward followed by its backward: compute.modules) holds
    at once, with d bytes per element, T tokens, h hidden, q = heads x
    head_dim, k = kv_heads x head_dim and f ffn (all at the rank's TP shard).
    Per layer: the weights h (q + 2k) + q h + (2 or 3) h f and as many
    gradients, and the activations its backward keeps, bounded by
    T (12 h + 4 q + 4 k + 3 f) d (for a GPT, 32 T h d: about twice
    Korthikanti et al.'s 34 s b h bytes at d = 2); one layer's attention scores,
    b heads s^2 in fp32, six times (a CPU's attention without a fused kernel
    materialises them, their softmax and their gradients). On the embedding or
    the head: V x h weights and gradients (twice where untied) and the fp32
    logits, six times T V x 4 B (logits, softmax, their gradients). All of it
    twice over; tests/test_compute_cli.py holds it above the resident memory
    real layers, heads and stages take on a CPU. The bytes the kernels move
    (op.nbytes) are no bound: they count every weight and activation once per
    kernel that reads it (a gpt3-6.7b stage: about 35 GB per forward)."""
    h, tokens = p["hidden"], p["tokens"]
    q, k = p["heads"] * p["head_dim"], p["kv_heads"] * p["head_dim"]
    f = p["ffn"] * (3 if p["arch"] == "llama" else 2)
    layers = {"layer": 1, "head": 0}.get(impl.split("_")[0], p.get("layers", 0))
    has_embed = impl.startswith("stage") and p.get("first")
    has_head = impl.startswith("head") or (impl.startswith("stage") and p.get("last"))
    weights = layers * (h * (q + 2 * k) + q * h + f * h)
    weights += p.get("vocab", 0) * h * ((1 if has_embed else 0) + (1 if has_head and not p.get("tied") else 0))
    acts = layers * tokens * (12 * h + 4 * q + 4 * k + 3 * p["ffn"]) * d
    scores = 6 * p["micro_batch"] * p["heads"] * p["seq"] ** 2 * 4 if layers else 0
    logits = 6 * tokens * p.get("vocab", 0) * 4 if has_head else 0
    return 2 * (2 * weights * d + acts + scores + logits)


def host_build_bytes(op) -> int:
    """Host memory that setting op up takes besides its device tensors: the TP
    in-place op builds the whole model in fp32 on the host and cuts its shard
    from it (4 B per parameter); nothing for the others."""
    if op.impl != "tp_microbatch":
        return 0
    import json

    from commbench.models import ModelSpec
    return 4 * ModelSpec(**json.loads(dict(op.params)["model"])).num_params


def describe(case: Case, world_size: int) -> str:
    """The kernel and shape of a case, as the watchdog's line names it."""
    p = case.params
    shape = "x".join(str(p[k]) for k in ("batch", "m", "n", "k") if p.get(k) not in (None, 0, 1) or k == "m")
    return f"compute {case.op} {shape} {case.dtype} ({case.nbytes} B) on ranks 0-{world_size - 1} at once"


def call_s(op, timer) -> float:
    """The watchdog's bound on one timed call of op (with the cache flush, if any)."""
    from commbench import watchdog
    return watchdog.call_bound_s(op.nbytes + timer.flush_bytes(), op.flops)


def measure(backend, timer, case: Case, op, settings, hosts, torch, device, ranks_on_host=1,
            on_phase=None) -> Measurement:
    from commbench import memcheck
    from commbench.compute import kernels
    from commbench.sweep import one_hot
    need, free = needed_bytes(op, device), free_bytes(device, ranks_on_host)
    build, host = host_build_bytes(op), memcheck.host_available()
    host = None if host is None else host // max(1, ranks_on_host)
    error = None
    if free is not None and need > 0.8 * free:   # said before allocating: a host out of memory kills, it does not raise
        error = f"needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free for this rank"
    elif build and host is not None and build > 0.5 * host:
        error = (f"building the whole model on the host for its shard needs about {build / 1e9:.1f} GB, "
                 f"{host / 1e9:.1f} GB available for this rank")
    try:
        if error is None:
            call = kernels()[op.impl](op, backend.torch_device if device == "cuda" else device,
                                      getattr(torch, case.dtype))
    except (RuntimeError, MemoryError) as e:     # e.g. out of memory at this shape
        call, error = (lambda: None), f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    errors = [e for e in backend.control_allgather(error) if e]
    if errors:
        return Measurement(case=case, status="skipped", skip_reason=f"could not set up: {errors[0]}")
    timed = timing.measure(timer, call, settings, on_phase=on_phase)
    own_p50 = float(np.median(timed.own_samples_s))
    rank_p50 = backend.control_reduce(one_hot(backend, own_p50), "sum").tolist()
    # every rank's own samples: the predictor takes the slowest rank's own mean
    # (predict.central_time), as a step sums each rank's calls and waits for
    # the slowest rank, not for the slowest rank of every single call
    rank_samples = backend.control_allgather(timed.own_samples_s)
    summary = stats.summarize(timed.samples_s)
    slowest = int(np.argmax([np.mean(s) for s in rank_samples]))
    m = Measurement(case=case, samples_s=timed.samples_s, warmup=settings.warmup, target_ci=settings.target_ci,
                    stats=summary, rank_time_p50_s=rank_p50, rank_samples_s=rank_samples, slowest_rank=slowest,
                    slowest_host=hosts[slowest],
                    warnings=stats.warnings_for(summary, len(timed.samples_s), settings.target_ci, settings.ci_of))
    t = op_time_s(m)
    m.algbw_gbps = case.nbytes / t / 1e9 if t > 0 else None     # achieved memory bandwidth, GB/s
    from commbench.compute import framework
    note = framework.group_note(op)
    if note:
        m.warnings.append(note)
    if scale(m) != 1.0:
        m.warnings.append(f"timed on {case.params['timed_numel']} of {case.params['m']} elements, scaled linearly")
    note = alignment_note(case)
    if note:
        m.warnings.append(note)
    return m


def alignment_note(case: Case) -> str | None:
    """A GEMM on a GPU with a dimension that is not a multiple of 8 (16 bytes
    of a 16-bit type): cuBLAS falls off its fastest kernels. On an H200 the
    2048 x 50257 x 4096 bf16 logits GEMM ran at 96.6 TFLOP/s and at 809.4 with
    50304 words (jobs/device_check.sh's session). None elsewhere."""
    p = case.params
    if case.device != "cuda" or not case.op.startswith("gemm"):
        return None
    odd = [f"{k} = {p[k]}" for k in ("m", "n", "k") if p.get(k) and p[k] % 8]
    if not odd:
        return None
    return (f"{', '.join(odd)} not a multiple of 8: off cuBLAS's fastest kernels "
            "(a vocabulary: pad it, --vocab-divisible-by 128)")


def run(workload_ops, launch, device, settings, out_path, overwrite, argv, flush_l2=False, timeout_s=None,
        reporter=None, extra_settings=None, backend=None, settings_for=None):
    """Time the distinct ops on this rank (all ranks at once). Returns the
    ResultFile on rank 0, None elsewhere. settings_for(op), if given, is the
    timing of that op (settings, the header's, for the others). A torch backend passed in is used and
    left open. Each kernel's setup and timing run under a watchdog.Guard:
    a hung or dead rank ends the job with EXIT_TIMEOUT and one line naming the
    kernel and the rank (timeout_s: its T, as `run --timeout`)."""
    from commbench import watchdog
    own = backend is None
    if own:
        backend = watchdog.open_backend("torch", launch, device, watchdog.rendezvous_timeout_s(timeout_s))
    try:
        import torch
        ranks = backend.control_allgather(env.rank_info(launch, device))
        hosts = [r["host"] for r in ranks]
        run_id, created = backend.control_bcast(
            (uuid.uuid4().hex[:12], datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")))
        header = env.header(launch, ranks, argv, run_id, created,
                            dict(extra_settings or {}, device=device, flush_l2=flush_l2,
                                 threads_per_rank=torch.get_num_threads(), warmup=settings.warmup,
                                 iters=settings.iters, max_iters=settings.max_iters,
                                 time_budget_s=settings.time_budget_s, target_ci=settings.target_ci,
                                 ci_of=settings.ci_of, malloc_mmap_threshold_b=launch_mod.ALLOCATOR_MMAP_THRESHOLD_B,
                                 flush_denormal=launch_mod.FLUSH_DENORMAL))
        from commbench import rankcheck
        rankcheck.check_same(backend, {k: v for k, v in header["settings"].items() if k != "threads_per_rank"})
        writer = results.open_on_rank0(backend.rank, backend.control_bcast, out_path, header, overwrite)
        timer = PerCallTimer(backend, torch, device, flush_l2)
        todo = distinct_cases(workload_ops, device, "torch", backend.world_size)
        from commbench.compute import framework, fsdp_stage, pipeline_stage, tp_stage
        pipelines = pipeline_stage.plans([(c, op) for c, op in todo if op.impl in pipeline_stage.IMPLS])
        todo = [(c, op) for c, op in todo if op.impl not in pipeline_stage.IMPLS]
        framework.prepare_groups([op for _, op in todo], backend.world_size)   # collective: every rank
        for tp in tp_stage.group_sizes([op for _, op in todo], backend.world_size):
            tp_stage.tp_group(tp)       # collective too
        fsdp_stage.make_groups([op for _, op in todo], backend.world_size)     # collective too
        result = ResultFile(header=header, measurements=[], path=out_path)
        if reporter and backend.rank == 0:
            reporter.start(len(todo) + sum(map(len, pipelines)))
        on_host = hosts.count(hosts[backend.rank])

        def keep(m):
            if backend.rank == 0:
                writer.append(m)
                result.measurements.append(m)
                if reporter:
                    reporter.advance(m)
        try:
            with watchdog.Guard("compute", backend, hosts, run_id, out_path, timeout_s) as guard:
                for case, op in todo:
                    bound = call_s(op, timer)
                    with guard.step(describe(case, backend.world_size), 2 * bound):
                        m = measure(backend, timer, case, op, settings_for(op) if settings_for else settings,
                                    hosts, torch, device, on_host, on_phase=guard.on_phase(bound))
                    keep(m)
                for items in pipelines:
                    mine = settings_for(items[0][1]) if settings_for else settings
                    # whole steps of the plan's pipeline: at most max_iters calls of a chunk after
                    # (warmup + 3) steps of m calls, plus the set-up
                    bound = sum(call_s(op, timer) * (mine.max_iters + (mine.warmup + 3) * op.count)
                                for _, op in items)
                    chunks = sum(op.scope == "pp_stage" for _, op in items) // 2
                    with guard.step(f"compute pipeline_fwd/bwd of {chunks} virtual stages and the optimizer steps "
                                    f"in the plan's schedule on ranks 0-{backend.world_size - 1}",
                                    2 * bound + 60.0):
                        for m in pipeline_stage.measure(backend, items, mine, device, hosts):
                            keep(m)
        finally:
            if writer:
                writer.close()
        return result if backend.rank == 0 else None
    finally:
        if own:
            backend.close()


def shape_key(case: Case) -> tuple:
    """What makes two compute measurements interchangeable: kernel, dtype, device,
    shape (not the backend label or how many ranks ran at once)."""
    import json
    params = {k: v for k, v in case.params.items() if k != "timed_numel"}
    return case.op, case.dtype, case.device, case.nbytes, json.dumps(params, sort_keys=True)


def match(ops, result_files, device: str | None = None) -> dict:
    """op -> the ok compute Measurement of its kernel and shape (the last one
    found across the files); ops without one are missing from the dict."""
    found = {}
    for rf in result_files:
        for m in rf.measurements:
            if m.case.kind == "compute" and m.status == "ok":
                found[shape_key(m.case)] = m
    out = {}
    for op in ops:
        for dev in ([device] if device else ["cuda", "cpu"]):
            m = found.get(shape_key(case_of(op, dev, "", 1)))
            if m is not None:
                out[op] = m
                break
    return out
