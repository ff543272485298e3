"""The optimizer step: torch's Adam as training.py runs it (training.adam_kwargs:
fused on a GPU, foreach on a CPU) over the rank's
shard as as many fp32 tensors as it has parameters (op.n, the elements split
evenly: the per-tensor cost is part of a real step); with 16-bit training the
updated master weights are then copied into the 16-bit parameters, as
mixed-precision training does.

A shard larger than MAX_NUMEL elements is timed on MAX_NUMEL and scaled
linearly (Adam is memory-bound: its time is proportional to the elements); the
measured count is stored in the Case (params.timed_numel) and the scale noted.

Each call follows an overwrite of twice the last-level cache (untimed), as a
step's optimizer follows the backward that evicted its states: back to back,
its states stay in the cache, which no step gives it (benchmarks/adam_cache.py:
small-gpt's op 29 % under Adam in a step back to back, 5 % under after the
overwrite; tiny-gpt's, whose states the step leaves partly in the cache,
18 % under and 35 % over)."""
import torch

MAX_NUMEL = {"cpu": 1 << 24, "cuda": 1 << 28}


def timed_numel(op, device) -> int:
    return min(op.m, MAX_NUMEL["cuda" if str(device).startswith("cuda") else "cpu"])


def prepare(op, device, dtype):
    n = timed_numel(op, device)
    tensors = max(1, min(op.n or 1, n))
    sizes = [n // tensors + (1 if i < n % tensors else 0) for i in range(tensors)]
    masters = []
    for size in sizes:
        p = torch.zeros(size, device=device, dtype=torch.float32, requires_grad=True)
        p.grad = torch.full((size,), 1e-3, device=device, dtype=torch.float32)
        masters.append(p)
    from commbench.training import adam_kwargs
    opt = torch.optim.Adam(masters, **adam_kwargs(device))
    from commbench.compute import Staged
    from commbench.compute.runner import flush_buffer
    flush = flush_buffer(torch, device)

    def evict():
        flush.fill_(1.0)
    if dtype == torch.float32:
        return Staged(evict, opt.step)
    low = [torch.empty_like(p, dtype=dtype) for p in masters]

    def step():
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(low, masters)
    return Staged(evict, step)


PREPARE = {"adam": prepare}
