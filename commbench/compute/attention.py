"""Core attention through torch's scaled_dot_product_attention (causal), which
picks the flash or memory-efficient kernel on GPUs: forward, and backward as
autograd's gradient of q, k and v for a fixed output gradient (no forward in
the timed call: the graph is built once and kept)."""
import torch
import torch.nn.functional as F


def _inputs(op, device, dtype, grad):
    p = dict(op.params)
    b, heads, kv_heads, s, d = p["micro_batch"], p["heads"], p["kv_heads"], op.m, op.k
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
    return rand(b, heads, s, d), rand(b, kv_heads, op.n, d), rand(b, kv_heads, op.n, d), p.get("causal", True)


def _sdpa(q, k, v, causal):
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    try:        # grouped-query attention: kv heads shared by groups of q heads (torch >= 2.5)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def prepare_fwd(op, device, dtype):
    """As in training: inputs that require gradients, so the kernel also saves
    what its backward needs (e.g. flash attention's log-sum-exp)."""
    q, k, v, causal = _inputs(op, device, dtype, grad=True)
    return lambda: _sdpa(q, k, v, causal)


def prepare_bwd(op, device, dtype):
    q, k, v, causal = _inputs(op, device, dtype, grad=True)
    out = _sdpa(q, k, v, causal)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


PREPARE = {"sdpa_fwd": prepare_fwd, "sdpa_bwd": prepare_bwd}
