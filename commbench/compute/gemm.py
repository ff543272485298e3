"""GEMMs as a Linear layer runs them (weights stored [out, in], as torch and
Megatron keep them): C[m,n] = A[m,k] B[k,n] in three layouts.
gemm_nt: y = x W^T (forward); gemm_nn: dx = dy W (input gradient);
gemm_tn: dW = dy^T x (weight gradient)."""
import torch


def prepare(op, device, dtype):
    m, n, k = op.m, op.n, op.k
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    if op.impl == "gemm_nt":
        a, b = rand(m, k), rand(n, k).t()          # x [m,k], W [n,k] read transposed
    elif op.impl == "gemm_nn":
        a, b = rand(m, k), rand(k, n)              # dy [m,k], W [k,n]
    else:
        a, b = rand(k, m).t(), rand(k, n)          # dy [k,m] read transposed, x [k,n]
    return lambda: torch.mm(a, b, out=out)


PREPARE = {"gemm_nt": prepare, "gemm_nn": prepare, "gemm_tn": prepare}
