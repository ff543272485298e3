"""Megatron-style tensor parallelism in plain torch (no DTensor): the rank's
shard of torch_model's transformer with Megatron's communication, for
`validate` (training.py, tp_impl 'megatron'). Without sequence parallelism:

- f (copy into the tp region): identity forward, all-reduce of the gradient
  backward, before the column-parallel QKV, MLP up (gate) and output layer;
- g (reduce from the tp region): all-reduce forward, identity backward, after
  the row-parallel attention output and MLP down (their biases added after it);
- vocabulary-parallel embedding: each rank looks up its V/t rows, others' tokens
  give zeros, g sums them;
- vocabulary-parallel cross-entropy: three all-reduces of b*s values forward
  (max logit, sum of exponentials, target logit), a local backward.

These are the collectives of strategies/tp.py's 'megatron' flavour (fused QKV
and gate/up inputs: one f each). Weights are sliced from the full torch_model
built with the same seed, so the model computes what the unsharded one does."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from commbench import torch_model
from commbench.models import ModelSpec
from commbench.torch_model import _rope


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _VocabParallelCE(torch.autograd.Function):
    """Megatron's vocab_parallel_cross_entropy on logits [N, V/t] of this rank's
    vocabulary slice [start, start + V/t)."""

    @staticmethod
    def forward(ctx, logits, target, group, start):
        logits = logits.float()
        vl = logits.shape[-1]
        top = logits.max(dim=-1)[0]
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        logits = logits - top.unsqueeze(-1)
        outside = (target < start) | (target >= start + vl)
        local = (target - start).masked_fill(outside, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        picked = logits[rows, local].masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = logits.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        softmax = exp / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, outside, local)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local] -= (~outside).to(g.dtype)
        return g * (grad / g.shape[0]), None, None, None


def _rows(w, i, t):
    n = w.shape[0] // t
    return w[i * n:(i + 1) * n]


def _cols(w, i, t):
    n = w.shape[1] // t
    return w[:, i * n:(i + 1) * n]


def _param(x):
    return nn.Parameter(x.detach().clone())


class Layer(nn.Module):
    def __init__(self, block, spec: ModelSpec, rank: int, t: int, group):
        super().__init__()
        self.group, self.spec = group, spec
        self.norm1, self.norm2 = block.norm1, block.norm2
        a = block.attn
        self.head_dim, self.rope, self.heads = spec.head_dim, spec.arch == "llama", spec.heads // t
        self.kv_heads = spec.kv_heads // t
        self.qkv_w = _param(torch.cat([_rows(a.q.weight, rank, t), _rows(a.k.weight, rank, t),
                                       _rows(a.v.weight, rank, t)]))
        self.qkv_b = _param(torch.cat([_rows(a.q.bias, rank, t), _rows(a.k.bias, rank, t),
                                       _rows(a.v.bias, rank, t)])) if a.q.bias is not None else None
        self.o_w = _param(_cols(a.o.weight, rank, t))
        self.o_b = a.o.bias                                   # replicated, added after the all-reduce
        mlp = block.mlp
        self.gated = spec.gated_mlp
        self.gate_w = _param(_rows(mlp.gate.weight, rank, t)) if self.gated else None
        self.up_w = _param(_rows(mlp.up.weight, rank, t))
        self.up_b = _param(_rows(mlp.up.bias, rank, t)) if mlp.up.bias is not None else None
        self.down_w = _param(_cols(mlp.down.weight, rank, t))
        self.down_b = mlp.down.bias

    def _attention(self, x):
        b, s, _ = x.shape
        x = _CopyToTP.apply(x, self.group)
        qkv = F.linear(x, self.qkv_w, self.qkv_b)
        d, hq, hk = self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[..., :hq].reshape(b, s, -1, d)
        k = qkv[..., hq:hq + hk].reshape(b, s, -1, d)
        v = qkv[..., hq + hk:].reshape(b, s, -1, d)
        if self.rope:
            q, k = _rope(q), _rope(k)
        if self.heads != self.kv_heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=2)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out = _ReduceFromTP.apply(F.linear(y.transpose(1, 2).reshape(b, s, -1), self.o_w), self.group)
        return out + self.o_b if self.o_b is not None else out

    def _mlp(self, x):
        x = _CopyToTP.apply(x, self.group)
        up = F.linear(x, self.up_w, self.up_b)
        h = F.silu(F.linear(x, self.gate_w)) * up if self.gated else F.gelu(up)
        out = _ReduceFromTP.apply(F.linear(h, self.down_w), self.group)
        return out + self.down_b if self.down_b is not None else out

    def forward(self, x):
        x = x + self._attention(self.norm1(x))
        return x + self._mlp(self.norm2(x))


class Transformer(nn.Module):
    """forward(tokens, targets) -> the mean cross-entropy (vocabulary-parallel)."""

    def __init__(self, spec: ModelSpec, rank: int, t: int, group, seed: int = 0):
        super().__init__()
        full = torch_model.build(spec, seed)
        self.group, self.t = group, t
        self.vocab_local = spec.vocab // t
        self.start = rank * self.vocab_local
        self.embed_w = _param(_rows(full.embed.weight, rank, t))
        self.pos = full.pos
        self.layers = nn.ModuleList(Layer(full.layers[str(i)], spec, rank, t, group) for i in range(spec.num_layers))
        self.norm = full.norm
        self.head_w = self.embed_w if spec.tied_embeddings else _param(_rows(full.head.weight, rank, t))

    def forward(self, tokens, targets):
        outside = (tokens < self.start) | (tokens >= self.start + self.vocab_local)
        x = F.embedding((tokens - self.start).masked_fill(outside, 0), self.embed_w)
        x = _ReduceFromTP.apply(x.masked_fill(outside.unsqueeze(-1), 0.0), self.group)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        x = _CopyToTP.apply(self.norm(x), self.group)
        logits = F.linear(x, self.head_w)
        return _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), self.group,
                                      self.start)
