"""Group layouts: the world, one group per node (intra), one group per local
index across nodes (inter), and nccl-tests' NCCL_TESTS_SPLIT forms "MOD k" and
"DIV k". All groups of a layout run their collectives at the same time."""
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    axis: str                  # name stored in Case.axis: world, intra, inter, mod2, div4
    groups: tuple              # tuple of tuples of global ranks, each sorted
    num_nodes: int             # nodes spanned by one group (the most any group spans)

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    def group_of(self, rank: int) -> tuple | None:
        for g in self.groups:
            if rank in g:
                return g
        return None


def parse_layouts(text: str) -> list[str]:
    """'world,intra,MOD 2' -> ['world', 'intra', 'mod 2'] (validated forms)."""
    out = []
    for word in text.split(","):
        w = " ".join(word.strip().lower().split())
        if w in ("world", "intra", "inter") or re.fullmatch(r"(mod|div) [1-9]\d*", w):
            if w not in out:
                out.append(w)
        else:
            raise ValueError(f"unknown group layout {word.strip()!r}: use world, intra, inter, "
                             "'MOD k' or 'DIV k' (k > 0), comma-separated")
    return out


def build(spec: str, hosts: list[str]) -> Layout:
    """The groups of a layout, from the host name of every rank (index = rank)."""
    names = parse_layouts(spec)          # validated, normalized: 'MOD 2' -> 'mod 2'
    if len(names) != 1:
        raise ValueError(f"build one layout at a time, got {spec!r}")
    spec = names[0]
    world = len(hosts)
    node_of = {}
    for h in hosts:
        node_of.setdefault(h, len(node_of))
    by_node = {}
    for r, h in enumerate(hosts):
        by_node.setdefault(node_of[h], []).append(r)
    if spec == "world":
        colors = [0] * world
        axis = "world"
    elif spec == "intra":
        colors = [node_of[h] for h in hosts]
        axis = "intra"
    elif spec == "inter":
        local_index = {r: ranks.index(r) for ranks in by_node.values() for r in ranks}
        colors = [local_index[r] for r in range(world)]
        axis = "inter"
    else:
        kind, k = spec.split()
        k = int(k)
        colors = [r % k if kind == "mod" else r // k for r in range(world)]
        axis = f"{kind}{k}"
    groups = {}
    for r, c in enumerate(colors):
        groups.setdefault(c, []).append(r)
    groups = tuple(tuple(g) for _, g in sorted(groups.items()))
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        raise ValueError(f"group layout {spec!r} on {world} ranks ({len(by_node)} nodes) gives groups of "
                         f"unequal sizes {sizes}: choose a layout that divides the ranks evenly")
    spanned = max(len({node_of[hosts[r]] for r in g}) for g in groups)
    return Layout(axis=axis, groups=groups, num_nodes=spanned)
