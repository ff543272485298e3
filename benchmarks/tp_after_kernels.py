"""Where in the compute phase the in-place TP micro-batch is timed: a plan's
tp_microbatch op timed by the compute runner (as validate does: its timing,
its step-op budget) straight after real training steps, after the plan's
other compute ops in one run, and in a run of its own after a run of those ops,
each next to the real steps' micro-batch (step time / m, the optimizer step included).
validate times it after the kernels; this says by how much where it is timed moves it.

    sudo .venv/bin/python benchmarks/tp_after_kernels.py [--model tiny-gpt] [--emulate 200mbit] [--reps 7]

--emulate RATE runs the two ranks on an emulated 2-node cluster (`commbench
emulate`, root), the link shaped to RATE; without it, 2 local ranks.
"""
import os
import statistics
import sys


def rank_main(model_name: str, reps: int):
    import two_ranks

    from commbench import training, validate
    from commbench.compute import runner
    info, model, par, ops, backend, timing = two_ranks.tp_rank(model_name)
    tp_op = [op for op in ops if op.scope == "tp_stage"]
    others = [op for op in ops if op.scope != "tp_stage"]
    out = f"/tmp/tp_after_kernels.{os.getpid()}.jsonl"
    res = {}

    def timed(ops, tag):
        # the runner times the ops in the order given
        rf = runner.run(ops, info, "cpu", timing, out, True, ["tp_after_kernels"], backend=backend,
                        settings_for=validate.settings_for(timing))
        if info.rank == 0 and tag:
            m = [m for m in rf.measurements if m.case.op == "tp_microbatch"][0]
            res.setdefault(tag, []).append(max(statistics.mean(s) for s in m.rank_samples_s))

    def steps():
        st = training.train_steps(model, par, 8, 1, "cpu", tp_impl="megatron")
        if info.rank == 0:
            res.setdefault("real step / m", []).append(statistics.mean(st.step_s) / par.num_microbatches)

    for _ in range(reps):
        steps()
        timed(tp_op, "op straight after the steps")
        steps()
        timed(others + tp_op, "op after the kernels, one run")    # validate's order
        steps()
        timed(others, None)
        timed(tp_op, "op in its own run after the kernels'")
    if info.rank == 0:
        os.unlink(out)
        print(f"{model_name}, Megatron TP x 2, micro-batch 1, {par.num_microbatches} micro-batches; "
              f"ms per micro-batch (slowest rank's mean), {reps} repetitions in turn")
        for tag, v in res.items():
            print(f"  {tag:38s} median {statistics.median(v) * 1e3:6.1f}  "
                  f"({' '.join(f'{x * 1e3:.1f}' for x in v)})")
    backend.close()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import two_ranks
    sys.exit(two_ranks.main(__file__, __doc__.splitlines()[0], rank_main, reps=7))
