"""`commbench validate`: the prediction checked against real training. On the
same ranks, in one job and one process group: measure the plan's collectives
(`run --plan`), time its kernels (`compute`), run real training steps with the
torch implementation of the plan (training.py), predict the step from the two
measurements, and report predicted against measured.

Each round trains half its steps before measuring and the rest after, so the
steps sample the machine on both sides of the measurements, each half for at
least --train-time seconds (more steps where they are short). With --rounds R
the job does that R times: the prediction is the median of the rounds'
predictions, each from its own round's measurements, the measured step the
median of every round's steps, so a machine whose speed drifts during the job
weighs on both sides alike and a slow spell during one round's measurements
no more moves the prediction than one during some steps moves the measured
step; each round's own pair is reported too.

error_pct = 100 (predicted - measured) / measured, measured = the median of the
timed steps (each the slowest rank's)."""
import json
import os
import statistics
from dataclasses import dataclass, replace

from commbench import plan as plan_mod
from commbench.config import RunConfig
from commbench.timing import TimingSettings

# quick but honest settings: adaptive to +-2 % of the mean (the statistic the
# predictor sums) within a budget per case (--time-budget, --max-iters)
TIME_BUDGET_S, MAX_ITERS = 0.5, 2000


def timing_settings(time_budget_s: float = TIME_BUDGET_S, max_iters: int = MAX_ITERS) -> TimingSettings:
    """The timing of validate's collectives and kernels; ValueError naming the flag of a bad value."""
    t = TimingSettings(warmup=3, iters=10, max_iters=max_iters, time_budget_s=time_budget_s, target_ci=0.02,
                       ci_of="mean")
    t.check()
    return t


# what a step's prediction is made of wherever it was measured: a stage's whole
# micro-batch (as a module, or with its TP, FSDP or pipeline in place), the
# data-parallel framework's work and the optimizer step. Each is timed
# STEP_OP_BUDGET_FACTOR times the budget of a kernel: a kernel stands in only
# where its module was not measured, and a micro-batch of tens of ms gets only
# a dozen calls in the kernels' budget, which a slow phase of the machine
# lasting a second can fill. And each is timed for at least the kernels'
# budget (min_time_s) even where its CI is met sooner: on this project's VM
# ten calls of a DDP micro-batch (about 85 ms in all, CI met) measured 8.4-8.8 ms in two
# rounds of one validation and 5.1 ms over 320 calls in the third
STEP_SCOPES = ("stage_module", "tp_stage", "dp_in_place", "pp_stage", "pp_optimizer", "pp_p2p", "framework",
               "optimizer")
STEP_OP_BUDGET_FACTOR = 4


# the step ops are timed in two windows of a round, each next to one half of
# its training (the first right after the first half, the second right before
# the second half), each with half of their budget and of their minimum time:
# the machine's speed moves in phases of seconds, and one window sampled one
# phase, which the training beside it need not share (small-gpt ZeRO-2's FSDP
# micro-batch measured 82.6, 104.6 and 113.4 ms in one window in each of
# three rounds, while the first two rounds' steps, 372 and 375 ms, ran at one
# speed)
STEP_WINDOW_FILES = ("compute-steps-before.jsonl", "compute-steps-after.jsonl")


def window_settings_for(timing: TimingSettings):
    """op -> its timing in one of the two windows: half of settings_for's
    budget and minimum time (every op of a window is a step op)."""
    half = replace(timing, time_budget_s=timing.time_budget_s * STEP_OP_BUDGET_FACTOR / len(STEP_WINDOW_FILES),
                   min_time_s=timing.time_budget_s / len(STEP_WINDOW_FILES))
    return lambda op: half


def train_time_s(timing: TimingSettings) -> float:
    """validate's default --train-time: each half of a round's training lasts
    at least one step op's budget in a window, so that both sides of the
    comparison sample the machine for as long (on this project's VM tiny-gpt's
    steps of 20-40 ms gave a half of 7 steps 0.14-0.28 s, against a
    second per step op in the window beside it, while the VM's speed moved by
    half between the two halves of one round)."""
    return timing.time_budget_s * STEP_OP_BUDGET_FACTOR / len(STEP_WINDOW_FILES)


def step_op_timing(timing: TimingSettings) -> TimingSettings:
    """The timing of what is a whole part of a step: STEP_OP_BUDGET_FACTOR x
    the budget and at least the budget's time. Besides the step ops, ZeRO-1's
    parameter-broadcast burst gets it: the optimizer side's whole exchange,
    tens of ms on this VM, it got 18-24 calls in the collectives' budget,
    their mean 21-28 ms and their minimum 6-11 ms (tiny-gpt, 2 ranks)."""
    return replace(timing, time_budget_s=timing.time_budget_s * STEP_OP_BUDGET_FACTOR,
                   min_time_s=timing.time_budget_s)


def settings_for(timing: TimingSettings):
    """op -> its timing in validate: step_op_timing for the ops of STEP_SCOPES."""
    step = step_op_timing(timing)
    return lambda op: step if op.scope in STEP_SCOPES else timing



def tp_impl_for(model, par, asked: str = "auto") -> str:
    """The tensor-parallel implementation validate runs: Megatron-style
    (megatron_tp.py) wherever it can (no SP, no pipeline), else DTensor; asked
    'megatron' where it cannot is a ValueError naming why."""
    from commbench.strategies import tp
    if asked not in ("auto", "megatron", "dtensor"):
        raise ValueError(f"--tp-impl {asked!r}: choose auto, megatron or dtensor")
    why = tp.implementation_limit(model, par, "megatron") if par.tp > 1 else None
    if asked == "megatron" and why:
        raise ValueError(f"--tp-impl megatron does not support {why}: use dtensor")
    if asked == "auto":
        return "dtensor" if why else "megatron"
    return asked


@dataclass
class Round:
    """One round of a validation on the same ranks: training steps timed, the
    plan's kernels, collectives and their interference measured, training
    steps timed again (measured: both slices' steps)."""
    compute: object            # ResultFile
    comm: object | None
    interference: object | None
    measured: object           # training.StepTimes
    steps_before: int = 0      # how many of measured's steps were trained before the measurements


def round_steps(steps: int, rounds: int) -> list:
    """The timed steps of each round: steps shared as evenly as can be, the
    first rounds taking one more; ValueError where a round would get none."""
    if rounds < 1 or steps < rounds:
        raise ValueError(f"--rounds must be between 1 and --steps ({steps}), got {rounds}")
    return [steps // rounds + (r < steps % rounds) for r in range(rounds)]


def run_on_rank(model, par, info, device, steps, warmup, out_dir, argv, overwrite=False, timeout_s=None,
                timing: TimingSettings | None = None, tp_impl="megatron", rounds: int = 1,
                train_time: float | None = None) -> dict | None:
    """Every rank calls this; rank 0 returns the report, the others None. tp_impl:
    the tensor-parallel implementation that runs (and whose collectives are predicted);
    timing: of the collectives and kernels measured (default timing_settings()).
    rounds > 1 alternates measuring and training that many times (each round's
    files in out_dir/round-K, the steps shared among them), so that a machine
    whose speed drifts during the job weighs on both sides alike. train_time:
    each half of a round trains at least that many seconds (more steps than
    its share of steps where they are short; default train_time_s(timing))."""
    from commbench import watchdog
    timing = timing or timing_settings()
    train_time = train_time_s(timing) if train_time is None else train_time
    per_round = round_steps(steps, rounds)
    # the collectives of what training.py runs
    workload = plan_mod.build(model, par, tp_flavour=tp_impl)
    largest = max((c.nbytes for c in workload.comm_ops), default=0)
    backend = watchdog.open_backend("torch", info, device, watchdog.rendezvous_timeout_s(timeout_s, largest))
    try:
        done = []
        for k, n in enumerate(per_round):
            where = out_dir if rounds == 1 else os.path.join(out_dir, f"round-{k + 1}")
            done.append(run_round(backend, info, workload, model, par, device, n, warmup, where, argv, overwrite,
                                  timeout_s, timing, tp_impl, train_time))
    finally:
        backend.close()
    if info.rank != 0:
        return None
    return report(workload, par, done, device, timing, train_time)


def run_round(backend, info, workload, model, par, device, steps, warmup, out_dir, argv, overwrite, timeout_s,
              timing, tp_impl, train_time=0.0) -> Round:
    """Train, time the step ops (first window), the kernels, the collectives
    and their interference, the step ops again (second window), train again;
    compute.jsonl joins the kernels and both windows. Each phase's process
    groups are destroyed at its end
    (process_groups.scope), so that rounds do not pile up groups."""
    from commbench import process_groups, results, sweep
    from commbench.compute import runner
    from commbench.compute import windows as windows_mod
    comm_path, compute_path = os.path.join(out_dir, "comm.jsonl"), os.path.join(out_dir, "compute.jsonl")
    inter_path = os.path.join(out_dir, "interference.jsonl")
    before, after = bracket(steps)
    first = None
    if before:
        with process_groups.scope():
            first = train_guarded(backend, info, workload, model, par, before, warmup, device, tp_impl, out_dir,
                                  timeout_s, train_time)
    extra = {"plan": {"model": model.to_dict(), "parallelism": workload.parallelism},
             "step_op_time_budget_s": timing.time_budget_s * STEP_OP_BUDGET_FACTOR,
             "step_op_min_time_s": timing.time_budget_s}
    step_ops = [op for op in workload.compute_ops if op.scope in STEP_SCOPES]
    kernel_ops = [op for op in workload.compute_ops if op.scope not in STEP_SCOPES]

    def time_ops(ops, name, settings_for, window=None):
        with process_groups.scope():
            return runner.run(ops, info, device, timing, os.path.join(out_dir, name), overwrite, argv,
                              timeout_s=timeout_s, backend=backend, settings_for=settings_for,
                              extra_settings=dict(extra, step_op_window=window) if window else extra)
    windows = [time_ops(step_ops, STEP_WINDOW_FILES[0], window_settings_for(timing), 1)] if step_ops else []
    kernels_rf = time_ops(kernel_ops, "compute-kernels.jsonl", None)
    comm_rf = None
    if workload.comm_ops:
        config = RunConfig(device=device, timing=timing, timeout_s=timeout_s, burst_timing=step_op_timing(timing))
        with process_groups.scope():
            comm_rf, wrong = sweep.run(config, info, argv, comm_path, overwrite, plan=(model, par), backend=backend)
        if wrong:
            raise RuntimeError(f"{wrong} wrong result element(s) in the plan's collectives: see {comm_path}")
    inter_rf = None
    if par.world > 1:
        from commbench import interference
        with process_groups.scope():
            inter_rf = interference.run(interference.InterferenceConfig(device=device, timing=timing,
                                                                        timeout_s=timeout_s),
                                        info, argv, inter_path, overwrite, backend=backend)
    if step_ops:
        windows.append(time_ops(step_ops, STEP_WINDOW_FILES[1], window_settings_for(timing), 2))
    # compute.jsonl: the kernels and each step op's two windows joined
    compute_rf = windows_mod.join_files(kernels_rf, windows, compute_path, timing.ci_of) if info.rank == 0 else None
    writer = results.open_on_rank0(info.rank, backend.control_bcast, compute_path,
                                   compute_rf and compute_rf.header, overwrite)
    if writer:
        for m in compute_rf.measurements:
            writer.append(m)
        writer.close()
    with process_groups.scope():
        measured = train_guarded(backend, info, workload, model, par, after, warmup, device, tp_impl, out_dir,
                                 timeout_s, train_time)
    if first is not None:
        measured = replace(measured, step_s=first.step_s + measured.step_s,
                           rank_step_s=first.rank_step_s + measured.rank_step_s, losses=first.losses + measured.losses)
    return Round(compute_rf, comm_rf, inter_rf, measured, len(first.step_s) if first is not None else 0)


def bracket(steps: int) -> tuple:
    """(steps trained before a round's measurements, steps after): the round's
    steps halved around them (the later half one more), so the training
    samples the machine on both sides of the time the measurements take;
    one step goes after."""
    return steps // 2, steps - steps // 2


def train_guarded(backend, info, workload, model, par, steps, warmup, device, tp_impl, out_dir, timeout_s,
                  train_time=0.0):
    """training.train_steps under a watchdog.Guard: the model's set-up and each
    step must end within T + a bound (before the first step: the workload's
    FLOPs at 1 GFLOP/s and bytes at 100 MB/s; after it: 10 x the longest step
    so far), else EXIT_TIMEOUT and one line naming the step and the ranks."""
    import uuid

    from commbench import env, search, training, watchdog
    hosts = [r["host"] for r in backend.control_allgather(env.rank_info(info, device))]
    run_id = backend.control_bcast(uuid.uuid4().hex[:12])
    first = watchdog.call_bound_s(sum(c.nbytes * c.count for c in workload.comm_ops),
                                  sum(o.flops * o.count for o in workload.compute_ops))
    plan = f"{model.name} {search.describe(par)}"
    count = f"{warmup} warmup, then {steps} timed" + (f" or more to fill {train_time:g} s" if train_time > 0 else "")
    with watchdog.Guard("training", backend, hosts, run_id, out_dir, timeout_s) as guard, guard.watching():
        guard.begin(f"setting up the model for training ({plan})", first)

        def on_step(i, durations):
            what = f"training step {i + 1} ({count}) ({plan})" if i is not None else \
                f"exchange of the step times ({plan})"
            guard.begin(what, 10 * max(durations) if durations else first)
        return training.train_steps(model, par, steps, warmup=warmup, device=device, tp_impl=tp_impl,
                                    on_step=on_step, min_time_s=train_time)


def _predict(workload, par, comm_rf, compute_rf, inter_rf, device):
    """The StepBreakdown from one set of measurements, and the interference factors used."""
    from commbench import predict
    from commbench.commmodel import CommModel
    comm_model = CommModel.from_results([comm_rf], statistic=predict.STATISTIC) if comm_rf is not None else None
    slow = predict.interference_factors(inter_rf) if inter_rf is not None else None
    times = predict.MeasuredTimes(comm_model, [compute_rf], device=device, interference=slow)
    times.bind(workload.compute_ops)
    return predict.predict(workload, par, times), slow


def report(workload, par, rounds: list, device, timing, train_time: float = 0.0) -> dict:
    """Each round's prediction from its own measurements against the median of
    its own steps; overall, the median of the rounds' predictions
    (predict.median_breakdown: each round weighs the same, as each gives the
    same number of steps; predicting from samples pooled over rounds instead
    would move estimators such as the slowest rank's mean with the number of
    samples) against the median of every round's steps. The median, not the
    mean: on the emulated cluster one round of small-gpt pp+dp measured its
    collectives during a slow spell of the VM (the pp all-reduce 105.8 ms
    against 49.6 and 52.1 in the other rounds, the dp ones 2-5 x slower) and
    predicted 479.7 ms against 266.2 and 242.9, while its training steps
    (262-340 ms) were as the other rounds'."""
    from commbench import launch, predict
    kinds = ("comm", "compute", "interference")
    each, sbs, slows = [], [], []
    for k, r in enumerate(rounds):
        sb, slow = _predict(workload, par, r.comm, r.compute, r.interference, device)
        sbs.append(sb)
        slows.append(slow)
        m_k = statistics.median(r.measured.step_s)
        each.append({"round": k + 1, "measured_step_time_s": m_k, "predicted_step_time_s": sb.step_time_s,
                     "error_pct": 100.0 * (sb.step_time_s - m_k) / m_k, "measured_steps_s": r.measured.step_s,
                     "steps_before": r.steps_before,
                     "interference": slow,
                     "results": {kind: None if getattr(r, kind) is None else getattr(r, kind).path
                                 for kind in kinds}})
    sb = predict.median_breakdown(sbs)
    steps = [t for r in rounds for t in r.measured.step_s]
    meas = statistics.median(steps)
    return {
        "measured_step_time_s": meas,
        "predicted_step_time_s": sb.step_time_s,
        "error_pct": 100.0 * (sb.step_time_s - meas) / meas,
        "predicted_band_s": [sb.step_time_low_s, sb.step_time_high_s],
        "measured_steps_s": steps,
        "measured_min_s": min(steps), "measured_max_s": max(steps),
        "losses": [x for r in rounds for x in r.measured.losses],
        "implementation": rounds[0].measured.implementation,
        "prediction": sb.to_dict(),
        "plan": {"model": workload.model["name"], "world": par.world, "dp": par.dp, "tp": par.tp, "pp": par.pp,
                 "zero": par.zero, "sp": par.sp, "micro_batch": par.micro_batch, "global_batch": par.global_batch,
                 "num_microbatches": par.num_microbatches, "seq": par.seq or workload.model["seq"], "dtype": par.dtype,
                 "schedule": par.schedule, "interleave": par.interleave, "recompute": par.recompute},
        "device": device,
        "timing": {"time_budget_s": timing.time_budget_s,
                   "step_op_time_budget_s": timing.time_budget_s * STEP_OP_BUDGET_FACTOR,
                   "step_op_min_time_s": timing.time_budget_s, "max_iters": timing.max_iters,
                   "target_ci": timing.target_ci, "ci_of": timing.ci_of, "train_time_s": train_time},
        "interference": None if slows[0] is None else {k: statistics.mean(s[k] for s in slows) for k in slows[0]},
        "malloc_mmap_threshold_b": launch.ALLOCATOR_MMAP_THRESHOLD_B,
        "flush_denormal": launch.FLUSH_DENORMAL,
        "rounds": each,
        "results": {kind: None if getattr(rounds[0], kind) is None else [getattr(r, kind).path for r in rounds]
                    for kind in kinds},
    }


def write(doc: dict, out_dir: str, overwrite: bool = False):
    path = os.path.join(out_dir, "validate.json")
    with open(path, "w" if overwrite else "x", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    return path
