"""Element types: canonical names, nccl-tests aliases, sizes, check tolerances."""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str           # canonical name, stored in every Case
    itemsize: int       # bytes per element
    is_float: bool
    eps: float          # machine epsilon (0 for integers: exact)
    numpy: str | None   # numpy dtype name where numpy has one


DTYPES = {d.name: d for d in [
    DType("float32", 4, True, 2.0 ** -23, "float32"),
    DType("float16", 2, True, 2.0 ** -10, "float16"),
    DType("bfloat16", 2, True, 2.0 ** -7, None),
    DType("float64", 8, True, 2.0 ** -52, "float64"),
    DType("int8", 1, False, 0.0, "int8"),
    DType("uint8", 1, False, 0.0, "uint8"),
    DType("int32", 4, False, 0.0, "int32"),
    DType("uint32", 4, False, 0.0, "uint32"),
    DType("int64", 8, False, 0.0, "int64"),
    DType("uint64", 8, False, 0.0, "uint64"),
]}

# nccl-tests' -d names and the usual short forms
ALIASES = {
    "float": "float32", "fp32": "float32", "f32": "float32",
    "half": "float16", "fp16": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "double": "float64", "fp64": "float64", "f64": "float64",
    "int": "int32",
}

REDOPS = ("sum", "prod", "max", "min", "avg")


def parse_dtypes(text: str) -> list[str]:
    """'float32,bf16' or 'all' -> canonical names, in order, without repeats."""
    if text.strip().lower() == "all":
        return list(DTYPES)
    out = []
    for word in text.split(","):
        word = word.strip().lower()
        name = ALIASES.get(word, word)
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {word!r}: choose from {', '.join(DTYPES)} or all")
        if name not in out:
            out.append(name)
    return out


def parse_redops(text: str) -> list[str]:
    if text.strip().lower() == "all":
        return list(REDOPS)
    out = []
    for word in text.split(","):
        word = word.strip().lower()
        if word not in REDOPS:
            raise ValueError(f"unknown reduction op {word!r}: choose from {', '.join(REDOPS)} or all")
        if word not in out:
            out.append(word)
    return out


def wrap_to(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Expected values as the dtype stores them: integers wrap around, floats are
    rounded to the nearest representable value (via float32 for the 16-bit ones)."""
    if not dtype.is_float:
        return values.astype(np.int64).astype(dtype.numpy).astype(np.float64)
    if dtype.name == "float16":
        return values.astype(np.float16).astype(np.float64)
    return values.astype(np.float64)
