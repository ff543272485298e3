"""The optimizer step: torch's Adam (foreach, or fused on GPU) over one flat
fp32 parameter of the rank's shard; with 16-bit training the updated master
weights are then copied into the 16-bit parameters, as mixed-precision
training does.

A shard larger than MAX_NUMEL elements is timed on MAX_NUMEL and scaled
linearly (Adam is memory-bound: its time is proportional to the elements); the
measured count is stored in the Case (params.timed_numel) and the scale noted."""
import torch

MAX_NUMEL = {"cpu": 1 << 24, "cuda": 1 << 28}


def timed_numel(op, device) -> int:
    return min(op.m, MAX_NUMEL["cuda" if device.startswith("cuda") else "cpu"])


def prepare(op, device, dtype):
    n = timed_numel(op, device)
    master = torch.zeros(n, device=device, dtype=torch.float32, requires_grad=True)
    master.grad = torch.full((n,), 1e-3, device=device, dtype=torch.float32)
    opt = torch.optim.Adam([master], lr=1e-4, fused=device.startswith("cuda") or None,
                           foreach=None if device.startswith("cuda") else True)
    if dtype == torch.float32:
        return opt.step
    low = torch.empty(n, device=device, dtype=dtype)

    def step():
        opt.step()
        with torch.no_grad():
            low.copy_(master)
    return step


PREPARE = {"adam": prepare}
