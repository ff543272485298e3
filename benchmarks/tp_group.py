"""Which process group the in-place TP micro-batch is timed over: a plan's
tp_microbatch op (Megatron TP over both ranks) timed by the compute runner, as
validate times it, over the job's default group and over a new gloo group of
the same two ranks, each right after real training steps of the plan (whose
DeviceMesh takes the default group for a TP dimension that spans the job).
The two cases alternate in order from one repetition to the next.

    .venv/bin/python benchmarks/tp_group.py [--model tiny-gpt] [--reps 12]
    sudo .venv/bin/python benchmarks/tp_group.py --emulate 200mbit

--emulate RATE runs the two ranks on an emulated 2-node cluster (`commbench
emulate`, root), the link shaped to RATE; without it, 2 local ranks.
Prints per case the median over repetitions of the op's time per micro-batch
(slowest rank's mean), each repetition's value, and in how many repetitions
the new group was the slower one.
"""
import os
import statistics
import sys

STEPS = "real step / m (median)"
WORLD = "op over the default group"
NEW = "op over a new group, same ranks"


def rank_main(model_name: str, reps: int):
    import torch.distributed as dist

    import two_ranks

    from commbench import process_groups, training, validate
    from commbench.compute import runner
    info, model, par, ops, backend, timing = two_ranks.tp_rank(model_name)
    tp_op = [op for op in ops if op.scope == "tp_stage"]
    new_group, _ = dist.new_subgroups(group_size=2)
    out = f"/tmp/tp_group.{os.getpid()}.jsonl"
    res = {STEPS: [], WORLD: [], NEW: []}

    def timed(group, tag):
        with process_groups.scope():
            process_groups.cached(("tp", 2), lambda: group)     # the group the op's module is built over
            rf = runner.run(tp_op, info, "cpu", timing, out, True, ["tp_group"], backend=backend,
                            settings_for=validate.settings_for(timing))
        if info.rank == 0:
            res[tag].append(max(statistics.mean(s) for s in rf.measurements[0].rank_samples_s))

    def steps():
        st = training.train_steps(model, par, 14, 2, "cpu", tp_impl="megatron")
        if info.rank == 0:
            res[STEPS].append(statistics.median(st.step_s) / par.num_microbatches)

    for i in range(reps):
        cases = [(dist.group.WORLD, WORLD), (new_group, NEW)]
        for group, tag in (cases if i % 2 else cases[::-1]):
            steps()
            timed(group, tag)
    if info.rank == 0:
        os.unlink(out)
        print(f"{model_name}, Megatron TP x 2, micro-batch 1, {par.num_microbatches} micro-batches; "
              f"ms per micro-batch, {reps} repetitions")
        for tag, v in res.items():
            print(f"  {tag:32s} median {statistics.median(v) * 1e3:6.1f}  ({' '.join(f'{x * 1e3:.1f}' for x in v)})")
        slower = sum(n > w for n, w in zip(res[NEW], res[WORLD]))
        print(f"  the new group slower in {slower} of {reps} repetitions")
    backend.close()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import two_ranks
    sys.exit(two_ranks.main(__file__, __doc__.splitlines()[0], rank_main, reps=12))
