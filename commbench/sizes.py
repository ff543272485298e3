"""Message sizes as nccl-tests takes them: bytes with K/M/G/T suffixes (powers of 2)."""
import math
import re

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8' -> 8, '1K' -> 1024, '32M' -> 33554432, '1GiB' -> 1073741824."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r}: expected a non-negative integer of bytes "
                         "with an optional K, M, G or T suffix (powers of 2), e.g. 8, 1K, 32M")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def sweep(minbytes: int, maxbytes: int, stepfactor: float | None, stepbytes: int | None) -> list[int]:
    """The sizes of a sweep from minbytes to maxbytes inclusive: multiplied by
    stepfactor, or (without one) incremented by stepbytes, as nccl-tests does."""
    if minbytes < 0 or maxbytes < 0:
        raise ValueError("sizes must be non-negative")
    if maxbytes < minbytes:
        raise ValueError(f"maxbytes ({maxbytes}) is smaller than minbytes ({minbytes})")
    sizes = []
    size = minbytes
    if stepfactor is not None:
        if not (stepfactor > 1 and math.isfinite(stepfactor)):
            raise ValueError(f"-f/--stepfactor must be a finite number greater than 1, got {stepfactor}")
        if minbytes == 0 and maxbytes > 0:
            raise ValueError("a multiplicative sweep needs minbytes > 0")
        while size <= maxbytes:
            _add(sizes, size)
            if size == 0:
                break
            nxt = int(size * stepfactor)
            size = nxt if nxt > size else size + 1
    else:
        if not stepbytes or stepbytes <= 0:
            raise ValueError(f"stepbytes must be positive, got {stepbytes}")
        while size <= maxbytes:
            _add(sizes, size)
            size += stepbytes
    return sizes


MAX_SIZES = 10_000


def _add(sizes: list, size: int):
    if len(sizes) == MAX_SIZES:
        raise ValueError(f"the sweep would have more than {MAX_SIZES} sizes: choose a larger -f/--stepfactor or "
                         "-i/--stepbytes")
    sizes.append(size)
