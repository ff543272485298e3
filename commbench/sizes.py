"""Message sizes as nccl-tests takes them: bytes with K/M/G/T suffixes (powers of 2)."""
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
        if stepfactor <= 1:
            raise ValueError(f"stepfactor must be greater than 1, got {stepfactor}")
        if minbytes == 0 and maxbytes > 0:
            raise ValueError("a multiplicative sweep needs minbytes > 0")
        while size <= maxbytes:
            sizes.append(size)
            if size == 0:
                break
            nxt = int(size * stepfactor)
            size = nxt if nxt > size else size + 1
    else:
        if not stepbytes or stepbytes <= 0:
            raise ValueError(f"stepbytes must be positive, got {stepbytes}")
        while size <= maxbytes:
            sizes.append(size)
            size += stepbytes
    return sizes
