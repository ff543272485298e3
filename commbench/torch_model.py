"""A real torch transformer built from a ModelSpec (GPT: LayerNorm, GELU MLP,
learned positions, tied embeddings, biases; Llama: RMSNorm, SwiGLU, RoPE, GQA,
no biases, untied output), for the traffic tests and `validate`. Its parameter
count equals ModelSpec.num_params. Attention projections are separate q/k/v/o
Linears and reshape with -1 heads, so DTensor tensor parallelism (colwise q/k/v,
rowwise o) shards them without changes."""
import torch
import torch.nn.functional as F
from torch import nn

from commbench.models import ModelSpec


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (b, s, heads, head_dim)."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :].to(x.dtype), ang.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal self-attention with heads (and kv_heads <= heads, GQA) of head_dim:
    a whole layer's or, at a tensor-parallel shard, one rank's heads."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, rope: bool):
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self.group = heads // kv_heads
        self.q = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim)
        k = self.k(x).view(b, s, -1, self.head_dim)
        v = self.v(x).view(b, s, -1, self.head_dim)
        if self.rope:
            q, k = _rope(q), _rope(k)
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=2)
            v = v.repeat_interleave(self.group, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """GELU MLP (GPT) or SwiGLU (gated, Llama) of width ffn."""

    def __init__(self, hidden: int, ffn: int, gated: bool, bias: bool):
        super().__init__()
        self.gated = gated
        if gated:
            self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        if self.gated:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


def norm(arch: str, hidden: int):
    return nn.LayerNorm(hidden) if arch == "gpt" else nn.RMSNorm(hidden)


class Block(nn.Module):
    """A transformer layer; heads, kv_heads and ffn are the layer's, or one
    tensor-parallel rank's share of them (compute/modules.py)."""

    def __init__(self, arch: str, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int):
        super().__init__()
        gpt = arch == "gpt"         # registration order = parameter order (DDP buckets, strategies' lists)
        self.norm1 = norm(arch, hidden)
        self.attn = Attention(hidden, heads, kv_heads, head_dim, bias=gpt, rope=not gpt)
        self.norm2 = norm(arch, hidden)
        self.mlp = MLP(hidden, ffn, gated=not gpt, bias=gpt)

    @classmethod
    def of(cls, m: ModelSpec) -> "Block":
        return cls(m.arch, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn_hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Embedding -> blocks -> final norm -> logits. Layers live in a ModuleDict
    keyed by their index, so a pipeline stage can delete the ones it does not own."""

    def __init__(self, m: ModelSpec):
        super().__init__()
        self.spec = m
        self.embed = nn.Embedding(m.vocab, m.hidden)
        self.pos = nn.Embedding(m.seq, m.hidden) if m.arch == "gpt" else None
        self.layers = nn.ModuleDict({str(i): Block.of(m) for i in range(m.num_layers)})
        self.norm = norm(m.arch, m.hidden)
        self.head = nn.Linear(m.hidden, m.vocab, bias=False)
        if m.tied_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens) if self.embed is not None else tokens
        if self.pos is not None and self.embed is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


def build(m: ModelSpec, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(m)
