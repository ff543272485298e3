"""Memory-bound kernels of a layer at their real shapes (rows x cols): norms,
activations, dropout-add, residual add, rotary embedding, embedding lookup,
cross-entropy. A forward runs as in training (inputs that require gradients);
a backward is autograd's gradient for a fixed output gradient over a graph
built once (the forward is not in the timed call)."""
import torch
import torch.nn.functional as F


def _rand(g, shape, device, dtype, grad=True):
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)


def _rope(x):
    """Rotary embedding of (rows, width) pairs, as torch_model applies it."""
    half = x.shape[-1] // 2
    ang = torch.arange(x.shape[0], device=x.device, dtype=torch.float32)[:, None] * \
        torch.ones(half, device=x.device)[None, :] * 1e-3
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _forward(impl, op, device, dtype):
    """(function of the inputs, the inputs) of one elementwise op."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, cols = op.m, op.n
    x = _rand(g, (rows, cols), device, dtype)
    if impl == "layernorm":
        w, b = _rand(g, (cols,), device, dtype), _rand(g, (cols,), device, dtype)
        return (lambda x, w, b: F.layer_norm(x, (cols,), w, b)), (x, w, b)
    if impl == "rmsnorm":
        w = _rand(g, (cols,), device, dtype)
        return (lambda x, w: F.rms_norm(x, (cols,), w)), (x, w)
    if impl == "gelu":
        return (lambda x: F.gelu(x, approximate="tanh")), (x,)
    if impl == "swiglu":
        u = _rand(g, (rows, cols), device, dtype)
        return (lambda x, u: F.silu(x) * u), (x, u)
    if impl == "dropout_add":
        res = _rand(g, (rows, cols), device, dtype)
        return (lambda x, res: res + F.dropout(x, p=0.1, training=True)), (x, res)
    if impl == "add":
        res = _rand(g, (rows, cols), device, dtype)
        return (lambda x, res: res + x), (x, res)
    if impl == "rope":
        return _rope, (x,)
    if impl == "embedding":
        table = _rand(g, (op.k, cols), device, dtype)
        tokens = torch.randint(0, op.k, (rows,), generator=g).to(device)
        return (lambda table: F.embedding(tokens, table)), (table,)
    if impl == "cross_entropy":
        target = torch.randint(0, cols, (rows,), generator=g).to(device)
        return (lambda x: F.cross_entropy(x, target)), (x,)
    raise ValueError(f"unknown elementwise kernel {impl!r}")


def prepare(op, device, dtype):
    impl, direction = op.impl.rsplit("_", 1)
    fn, inputs = _forward(impl, op, device, dtype)
    if direction == "fwd":
        return lambda: fn(*inputs)
    out = fn(*inputs)
    dout = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


PREPARE = {f"{k}_{d}": prepare for k in ("layernorm", "rmsnorm", "gelu", "swiglu", "dropout_add", "add", "rope",
                                          "embedding", "cross_entropy") for d in ("fwd", "bwd")}
