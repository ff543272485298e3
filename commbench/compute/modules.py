"""A transformer layer, the head and a whole pipeline stage as torch modules at
one rank's tensor-parallel shard, timed forward and backward as a framework runs them
(one module call, autograd included). The layer is torch_model.Block with the
rank's share of heads, kv heads and MLP width (at tp = 1 it is that Block,
parameter for parameter); the head is the final norm, the rank's V/t logits and
the cross-entropy over them. Tensor-parallel collectives are not in them: they
are CommOps."""
import torch
import torch.nn.functional as F
from torch import nn

from commbench import torch_model


def _params(op) -> dict:
    return dict(op.params)


def local_layer(p) -> nn.Module:
    return torch_model.Block(p["arch"], p["hidden"], p["heads"], p["kv_heads"], p["head_dim"], p["ffn"])


class LocalHead(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.norm = torch_model.norm(p["arch"], p["hidden"])
        self.logits = nn.Linear(p["hidden"], p["vocab"], bias=False)

    def forward(self, x, target):
        out = self.logits(self.norm(x))
        return F.cross_entropy(out.view(-1, out.shape[-1]), target.view(-1))


class LocalStage(nn.Module):
    """A pipeline stage at the rank's shard: the (vocabulary-parallel) embedding
    and learned positions on the first stage, its layers, and the head with the
    loss on the last (its logits on the embedding's weight where tied), called
    as the training step calls the model."""

    def __init__(self, p):
        super().__init__()
        self.first, self.last = p["first"], p["last"]
        if self.first:
            self.embed = nn.Embedding(p["vocab"], p["hidden"])
            self.pos = nn.Embedding(p["seq"], p["hidden"]) if p["arch"] == "gpt" else None
        self.layers = nn.ModuleList(local_layer(p) for _ in range(p["layers"]))
        if self.last:
            self.head = LocalHead(p)
        if p.get("tied"):
            self.head.logits.weight = self.embed.weight

    def forward(self, x, target):
        if self.first:
            tokens = x
            x = self.embed(tokens)
            if self.pos is not None:
                x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(x, target) if self.last else x


def build(op, device, dtype):
    """The module an op times, at dtype, and its inputs (seeded)."""
    p = _params(op)
    torch.manual_seed(0)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(p["micro_batch"], p["seq"], p["hidden"], generator=g).to(device=device, dtype=dtype)
    x.requires_grad_(True)
    target = None
    if "vocab" in p:
        target = torch.randint(0, p["vocab"], (p["micro_batch"], p["seq"]), generator=g).to(device)
    if op.impl.startswith("layer"):
        return local_layer(p).to(device=device, dtype=dtype), (x,)
    if op.impl.startswith("head"):
        return LocalHead(p).to(device=device, dtype=dtype), (x, target)
    module = LocalStage(p).to(device=device, dtype=dtype)
    if p.get("recompute") == "full":       # as training checkpoints its layers
        from commbench.training import checkpoint_each
        checkpoint_each(module.layers)
    if p["first"]:
        x = torch.randint(0, p["vocab"], (p["micro_batch"], p["seq"]), generator=g).to(device)
    return module, (x, target)


def prepare(op, device, dtype):
    """Timed as a training step runs them, each call between untimed steps of its
    own (compute.Staged): a backward is loss.backward() after a fresh forward (the
    graph it frees and the parameter gradients it accumulates are in its time);
    a forward is one module call followed by that backward (a step never runs two
    forwards of a module back to back: timed so, tiny-gpt's stage forward ran
    0.97 ms against 1.09 followed by its backward, on this project's CPU machine)."""
    from commbench.compute import Staged
    module, inputs = build(op, device, dtype)
    x, graph = inputs[0], {}

    def forward():
        x.grad = None       # a stage's input gradient is a fresh tensor, not an accumulation
        graph["out"] = module(*inputs)

    def backward():
        graph.pop("out").backward(grad)
    forward()
    out = graph["out"]
    grad = None if out.dim() == 0 else torch.randn_like(out)
    if op.impl.endswith("fwd"):
        backward()
        return Staged(None, forward, after=backward)
    return Staged(forward, backward)


PREPARE = {f"{what}_{d}": prepare for what in ("layer", "head", "stage") for d in ("fwd", "bwd")}
