"""`commbench validate`: the prediction checked against real training. On the
same ranks, in one job and one process group: measure the plan's collectives
(`run --plan`), time its kernels (`compute`), run real training steps with the
torch implementation of the plan (training.py), predict the step from the two
measurements, and report predicted against measured.

error_pct = 100 (predicted - measured) / measured, measured = the median of the
timed steps (each the slowest rank's)."""
import json
import os
import statistics

from commbench import plan as plan_mod
from commbench.config import RunConfig
from commbench.timing import TimingSettings

# quick but honest settings: adaptive to +-2 % within a small budget per case
COMM_TIMING = TimingSettings(warmup=3, iters=10, max_iters=2000, time_budget_s=0.5, target_ci=0.02)
COMPUTE_TIMING = TimingSettings(warmup=3, iters=10, max_iters=2000, time_budget_s=0.5, target_ci=0.02)


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


def run_on_rank(model, par, info, device, steps, warmup, out_dir, argv, overwrite=False, timeout_s=None,
                comm_timing=COMM_TIMING, compute_timing=COMPUTE_TIMING, tp_impl="megatron") -> dict | None:
    """Every rank calls this; rank 0 returns the report, the others None. tp_impl:
    the tensor-parallel implementation that runs (and whose collectives are predicted)."""
    from commbench import sweep, watchdog
    from commbench.compute import runner
    # the collectives of what training.py runs
    workload = plan_mod.build(model, par, tp_flavour=tp_impl)
    largest = max((c.nbytes for c in workload.comm_ops), default=0)
    backend = watchdog.open_backend("torch", info, device, watchdog.rendezvous_timeout_s(timeout_s, largest))
    try:
        comm_path, compute_path = os.path.join(out_dir, "comm.jsonl"), os.path.join(out_dir, "compute.jsonl")
        inter_path = os.path.join(out_dir, "interference.jsonl")
        compute_rf = runner.run(workload.compute_ops, info, device, compute_timing, compute_path, overwrite, argv,
                                timeout_s=timeout_s, backend=backend,
                                extra_settings={"plan": {"model": model.to_dict(), "parallelism": workload.parallelism}})
        comm_rf = None
        if workload.comm_ops:
            config = RunConfig(device=device, timing=comm_timing, timeout_s=timeout_s)
            comm_rf, wrong = sweep.run(config, info, argv, comm_path, overwrite, plan=(model, par), backend=backend)
            if wrong:
                raise RuntimeError(f"{wrong} wrong result element(s) in the plan's collectives: see {comm_path}")
        inter_rf = None
        if par.world > 1:
            from commbench import interference
            inter_rf = interference.run(interference.InterferenceConfig(device=device, timing=compute_timing,
                                                                        timeout_s=timeout_s),
                                        info, argv, inter_path, overwrite, backend=backend)
        measured = train_guarded(backend, info, workload, model, par, steps, warmup, device, tp_impl, out_dir,
                                 timeout_s)
    finally:
        backend.close()
    if info.rank != 0:
        return None
    return report(workload, par, comm_rf, compute_rf, inter_rf, measured, device, out_dir)


def train_guarded(backend, info, workload, model, par, steps, warmup, device, tp_impl, out_dir, timeout_s):
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
    total = warmup + steps
    with watchdog.Guard("training", backend, hosts, run_id, out_dir, timeout_s) as guard, guard.watching():
        guard.begin(f"setting up the model for training ({plan})", first)

        def on_step(i, durations):
            what = f"training step {i + 1} of {total} ({plan})" if i < total else \
                f"exchange of the step times ({plan})"
            guard.begin(what, 10 * max(durations) if durations else first)
        return training.train_steps(model, par, steps, warmup=warmup, device=device, tp_impl=tp_impl,
                                    on_step=on_step)


def report(workload, par, comm_rf, compute_rf, inter_rf, measured, device, out_dir) -> dict:
    from commbench import predict
    from commbench.commmodel import CommModel
    comm_model = CommModel.from_results([comm_rf], statistic=predict.STATISTIC) if comm_rf is not None else None
    slow = predict.interference_factors(inter_rf) if inter_rf is not None else None
    times = predict.MeasuredTimes(comm_model, [compute_rf], device=device, interference=slow)
    times.bind(workload.compute_ops)
    sb = predict.predict(workload, par, times)
    meas = statistics.median(measured.step_s)
    return {
        "measured_step_time_s": meas,
        "predicted_step_time_s": sb.step_time_s,
        "error_pct": 100.0 * (sb.step_time_s - meas) / meas,
        "predicted_band_s": [sb.step_time_low_s, sb.step_time_high_s],
        "measured_steps_s": measured.step_s,
        "measured_min_s": min(measured.step_s), "measured_max_s": max(measured.step_s),
        "losses": measured.losses,
        "implementation": measured.implementation,
        "prediction": sb.to_dict(),
        "plan": {"model": workload.model["name"], "world": par.world, "dp": par.dp, "tp": par.tp, "pp": par.pp,
                 "zero": par.zero, "sp": par.sp, "micro_batch": par.micro_batch, "global_batch": par.global_batch,
                 "num_microbatches": par.num_microbatches, "seq": par.seq or workload.model["seq"], "dtype": par.dtype,
                 "schedule": par.schedule, "interleave": par.interleave, "recompute": par.recompute},
        "device": device,
        "interference": slow,
        "results": {"comm": comm_rf.path if comm_rf is not None else None, "compute": compute_rf.path,
                    "interference": inter_rf.path if inter_rf is not None else None},
    }


def write(doc: dict, out_dir: str, overwrite: bool = False):
    path = os.path.join(out_dir, "validate.json")
    with open(path, "w" if overwrite else "x", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    return path
