"""The GPU side of `compute --interference`: sm_spin_kernel on k SMs (cupy, its
own non-blocking stream) against the NCCL all_reduce of the torch backend. The
partner of a measurement is GPU work queued to outlast it: for the compute, a
background thread queues a fixed number of all_reduces (the same count on every
rank); for the collective, one long sm_spin launch. Where the partner ended
before the measurement, the measurement says so in its warnings."""
import math
import threading

SPIN_PROBE_ITERS = 1 << 16
SPREAD_LIMIT = 1.25     # k blocks slower than this x one block: not one block per SM


def default_sms(num_sms: int, fractions) -> tuple:
    return tuple(sorted({max(1, round(num_sms * f)) for f in fractions}))


def _launch_time_s(cupy, ks, out, blocks, iters, stream) -> float:
    """One launch timed with CUDA events, after an untimed one."""
    with cupy.cuda.Device(ks.device):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        ks.sm_spin(out, blocks, iters, stream)
        a.record(stream)
        ks.sm_spin(out, blocks, iters, stream)
        b.record(stream)
        b.synchronize()
        return cupy.cuda.get_elapsed_time(a, b) * 1e-3


class QueuedCollectives:
    """`count` async all_reduces queued from a thread while the compute is timed."""

    def __init__(self, torch, dist, buf, group, device, count):
        self.torch, self.dist, self.buf, self.group, self.device, self.count = torch, dist, buf, group, device, count
        self.started, self.last, self.error, self.warnings = threading.Event(), None, None, []
        self.thread = threading.Thread(target=self._queue, daemon=True)

    def _queue(self):
        try:
            self.torch.cuda.set_device(self.device)
            for _ in range(self.count):
                self.last = self.dist.all_reduce(self.buf, group=self.group, async_op=True)
                self.started.set()
        except BaseException as e:
            self.error = e
        finally:
            self.started.set()

    def __enter__(self):
        self.thread.start()
        self.started.wait()
        return self

    def __exit__(self, *exc):
        if not self.thread.is_alive() and self.last is not None and self.last.is_completed():
            self.warnings.append(f"the {self.count} partner all_reduces ended before the measurement did")
        self.thread.join()
        if self.last is not None:
            self.last.wait()
        self.torch.cuda.synchronize(self.device)
        if self.error is not None and exc[0] is None:
            raise self.error


class LongSpin:
    """One sm_spin launch of `iters` steps on k blocks while the collective is timed."""

    def __init__(self, cupy, ks, out, blocks, iters, stream):
        self.cupy, self.ks, self.out, self.blocks, self.iters, self.stream = cupy, ks, out, blocks, iters, stream
        self.warnings = []

    def __enter__(self):
        with self.cupy.cuda.Device(self.ks.device):
            self.ks.sm_spin(self.out, self.blocks, self.iters, self.stream)
            self.end = self.cupy.cuda.Event(disable_timing=True)
            self.end.record(self.stream)
        return self

    def __exit__(self, *exc):
        if self.end.done:
            self.warnings.append(f"the partner sm_spin ({self.iters} iters) ended before the measurement did")
        self.stream.synchronize()


def gpu_parts(config, backend, buf, group, t_coll, fractions):
    """For each SM count: (num_sms, work, compute op, its timer, #wrong, warnings,
    collective partner factory, compute partner factory); see interference.run."""
    from commbench import kernels
    from commbench.kernel_bench import StreamTimer
    cupy = kernels.import_cupy("compute --interference on cuda")
    torch, dist = backend.torch, backend.dist
    dev = backend.torch_device.index
    ks = kernels.Kernels(dev)
    sms = config.sms or default_sms(ks.num_sms, fractions)
    if max(sms) > ks.num_sms:
        raise ValueError(f"--sms {max(sms)}: GPU {dev} has {ks.num_sms} SMs")
    with cupy.cuda.Device(dev):
        stream = cupy.cuda.Stream(non_blocking=True)
        out = cupy.zeros(max(sms) * kernels.SPIN_BLOCK, dtype=cupy.float32)
    timer = StreamTimer(cupy, dev, [stream], control=backend)
    # iterations for about SPIN_TIME_S per launch: rank 0 measures, all use its count
    probe = _launch_time_s(cupy, ks, out, 1, SPIN_PROBE_ITERS, stream)
    from commbench.interference import SPIN_TIME_S
    iters = backend.control_bcast(max(1, int(SPIN_PROBE_ITERS * SPIN_TIME_S / probe)))
    one_block = _launch_time_s(cupy, ks, out, 1, iters, stream)
    for k in sms:
        t_k = _launch_time_s(cupy, ks, out, k, iters, stream)
        warnings = []
        if t_k > SPREAD_LIMIT * one_block:
            warnings.append(f"{k} blocks took {t_k / one_block:.2f}x one block: not one block per SM")
        out.fill(0)
        ks.sm_spin(out, k, iters, stream)
        stream.synchronize()
        wrong = ks.check_sm_spin(out, k, iters)

        def compute(k=k):
            ks.sm_spin(out, k, iters, stream)

        # the same partner sizes on every rank: derived from rank 0's broadcast times
        t_k = backend.control_bcast(t_k)

        def with_coll(window_s):
            return QueuedCollectives(torch, dist, buf, group.handle, dev, math.ceil(window_s / t_coll))

        def with_compute(window_s, k=k, t_k=t_k):
            return LongSpin(cupy, ks, out, k, iters * math.ceil(window_s / t_k), stream)

        yield (k, f"sm_spin {k} SMs x {kernels.SPIN_BLOCK} threads, {iters} iters", compute, timer, wrong,
               warnings, with_coll, with_compute)
