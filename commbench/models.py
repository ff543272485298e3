"""ModelSpec: the transformer shapes that communication and compute follow, a
catalogue of published models, and user model files (JSON or YAML).

Parameter counts are computed from the configuration (never typed in):
- GPT (learned positions, LayerNorm with bias, GELU MLP of ffn_hidden, biases
  everywhere, embeddings tied to the logits): per layer
  4h^2 + 4h (QKV + output projection with biases) + 2 h f + f + h (MLP) + 4h (two LayerNorms).
- Llama (RoPE, RMSNorm without bias, SwiGLU MLP, grouped-query attention, no
  biases, untied output layer): per layer 2 h^2 + 2 h (kv_heads * head_dim)
  (Q, O and K, V) + 3 h f (gate, up, down) + 2h (two RMSNorms)."""
import os
from dataclasses import asdict, dataclass, fields, replace

from commbench import mapping_file


# bounds far beyond published models (llama3-405b: 126 layers, hidden 16384, vocab
# 128256): a plan holds one op per layer, so a typo of 10^20 layers must stop here
LIMITS = {"num_layers": 10_000, "hidden": 1 << 20, "heads": 1 << 16, "vocab": 1 << 24, "seq": 1 << 24,
          "kv_heads": 1 << 16, "ffn_hidden": 1 << 22}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int = 0          # 0 = heads (multi-head attention)
    ffn_hidden: int = 0        # 0 = 4 * hidden
    arch: str = "gpt"          # gpt | llama
    tied_embeddings: bool = True
    # Megatron's --make-vocab-size-divisible-by: a plan at tensor-parallel size t
    # runs the vocabulary padded up to a multiple of this x t (at_tp); 1 = as given
    vocab_divisible_by: int = 1

    def __post_init__(self):
        for f in ("num_layers", "hidden", "heads", "vocab", "seq"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer, got {v!r}")
        v = self.vocab_divisible_by
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 16:
            raise ValueError(f"model {self.name!r}: vocab_divisible_by must be an integer from 1 to 65536, "
                             f"got {v!r}")
        for f in ("kv_heads", "ffn_hidden"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"model {self.name!r}: {f} must be a non-negative integer (0 = the default), "
                                 f"got {v!r}")
        for f, most in LIMITS.items():
            if getattr(self, f) > most:
                raise ValueError(f"model {self.name!r}: {f} {getattr(self, f)} is beyond any model this tool "
                                 f"can plan (at most {most})")
        if not isinstance(self.tied_embeddings, bool):
            raise ValueError(f"model {self.name!r}: tied_embeddings must be true or false, got "
                             f"{self.tied_embeddings!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model name must be a non-empty string, got {self.name!r}")
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"model {self.name!r}: arch must be gpt or llama, got {self.arch!r}")
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")

    def at_tp(self, tp: int) -> "ModelSpec":
        """The model as Megatron builds it at tensor-parallel size tp: its
        vocabulary padded up to a multiple of vocab_divisible_by x tp, which
        keeps the logits GEMM on the fast path (on an H200, 2048 x 50257 x 4096
        in bf16 ran at 96.6 TFLOP/s and 2048 x 50304 x 4096 at 809.4:
        jobs/device_check.sh's session). Unchanged where vocab_divisible_by is 1;
        padding a padded model again at the same tp changes nothing."""
        m = self.vocab_divisible_by * tp
        if self.vocab_divisible_by == 1 or self.vocab % m == 0:
            return self
        return replace(self, vocab=-(-self.vocab // m) * m)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def gated_mlp(self) -> bool:
        return self.arch == "llama"

    @property
    def has_bias(self) -> bool:
        return self.arch == "gpt"

    def layer_params(self) -> int:
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_dim
        attn = 2 * h * h + 2 * h * kv
        mlp = (3 if self.gated_mlp else 2) * h * f
        norms = 2 * h
        if self.has_bias:
            attn += 2 * h + 2 * kv            # q, k, v and output biases
            mlp += f + h
            norms += 2 * h                   # LayerNorm has a bias
        return attn + mlp + norms

    def embedding_params(self) -> int:
        """Token embedding (+ learned positions for GPT)."""
        return self.vocab * self.hidden + (self.seq * self.hidden if self.arch == "gpt" else 0)

    def head_params(self) -> int:
        """Final norm, plus the output layer when it is not tied to the embedding."""
        norm = 2 * self.hidden if self.has_bias else self.hidden
        return norm + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + self.head_params()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["num_params"] = self.num_params
        return d


def _gpt(name, layers, hidden, heads, vocab=50257, seq=2048):
    return ModelSpec(name, layers, hidden, heads, vocab, seq, arch="gpt", tied_embeddings=True)


def _llama(name, layers, hidden, heads, kv, ffn, vocab, seq):
    return ModelSpec(name, layers, hidden, heads, vocab, seq, kv_heads=kv, ffn_hidden=ffn,
                     arch="llama", tied_embeddings=False)


CATALOGUE = {m.name: m for m in [
    # GPT-3 (Brown et al. 2020, Table 2.1; 13B with 5120 hidden and 1.3B with 16 heads of 128,
    # as Megatron-LM: the paper lists 5140 and 24 heads, which do not divide the hidden size)
    _gpt("gpt3-125m", 12, 768, 12), _gpt("gpt3-350m", 24, 1024, 16), _gpt("gpt3-760m", 24, 1536, 16),
    _gpt("gpt3-1.3b", 24, 2048, 16), _gpt("gpt3-2.7b", 32, 2560, 32), _gpt("gpt3-6.7b", 32, 4096, 32),
    _gpt("gpt3-13b", 40, 5120, 40), _gpt("gpt3-175b", 96, 12288, 96),
    # GPT sizes of the at-scale study on ALCF machines
    _gpt("gpt-1.5b", 48, 1536, 24), _gpt("gpt-20b", 44, 6144, 64), _gpt("gpt-33b", 80, 6144, 64),
    # Llama 2 (Touvron et al. 2023) and Llama 3 (Meta 2024)
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # tiny models that train on a CPU in seconds (validation)
    ModelSpec("tiny-gpt", 4, 64, 4, 512, 64, arch="gpt"),
    ModelSpec("small-gpt", 8, 128, 8, 1024, 128, arch="gpt"),
    ModelSpec("tiny-llama", 4, 64, 4, 512, 64, kv_heads=2, ffn_hidden=176, arch="llama", tied_embeddings=False),
]}


def load_file(path: str) -> ModelSpec:
    """A user model file: JSON or YAML with ModelSpec's fields."""
    data = mapping_file.load(path, "model")
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(data) - known - {"num_params"})
    if unknown:
        raise ValueError(f"model file {path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    try:
        return ModelSpec(**{k: v for k, v in data.items() if k in known})
    except TypeError as e:
        raise ValueError(f"model file {path}: {e}") from None


def get(name_or_path: str) -> ModelSpec:
    if name_or_path in CATALOGUE:
        return CATALOGUE[name_or_path]
    if os.path.exists(name_or_path):
        return load_file(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: not in the catalogue (commbench models) and no such file")
