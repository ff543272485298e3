"""Will the largest case of a sweep fit? Per-rank bytes of a case, before any
buffer is allocated, against the memory free for this rank.

A case holds (collectives/*.py prepare): its send and receive buffers in the
dtype ((send + recv) x itemsize; in place they share, so this is an upper
bound), and on the host the float64 input values (8 send, plus the index
array they are computed from, 8 send) and, when checking, the zeroed output
and its float64 download (8 recv each). On a CPU all of it is host memory; on
a GPU the buffers are device memory and the rest host memory. The memory free
for a rank is the host's MemAvailable divided by the ranks on the host, and on
a GPU torch.cuda.mem_get_info()'s free bytes of its device."""
import os

from commbench.dtypes import DTYPES


def format_size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def case_bytes(send: int, recv: int, dtype: str, device: str, checking: bool) -> tuple[int, int]:
    """(host bytes, device bytes) one rank needs for a case."""
    buffers = (send + recv) * DTYPES[dtype].itemsize
    host = 16 * send + (16 * recv if checking else 0)
    return (host + buffers, 0) if device == "cpu" else (host, buffers)


def host_available() -> int | None:
    """MemAvailable of /proc/meminfo, else available pages x page size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_available() -> int | None:
    try:
        import torch
        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
    except Exception:        # no usable CUDA runtime: nothing to compare against
        return None
    return None


def largest(todo, device: str, checking: bool):
    """(host bytes, device bytes, description) of the most demanding case of
    todo, an iterable of (coll, dtype, send, recv)."""
    best = (0, 0, "")
    for coll, dtype, send, recv in todo:
        h, d = case_bytes(send, recv, dtype, device, checking)
        if (d, h) > (best[1], best[0]):
            best = (h, d, f"{coll} of {send + recv} elements ({dtype})")
    return best


def check(todo, device: str, checking: bool, ranks_on_host: int, host_free=None, device_free=None) -> str | None:
    """None if the largest case fits; else the reason, with the numbers."""
    host_need, dev_need, what = largest(todo, device, checking)
    host_free = host_available() if host_free is None else host_free
    if host_free is not None:
        share = host_free // max(1, ranks_on_host)
        if host_need > share:
            return (f"the largest case ({what}) needs {format_size(host_need)} of host memory per rank, but "
                    f"{format_size(share)} is available per rank ({format_size(host_free)} available / "
                    f"{ranks_on_host} rank(s) on this host): lower -e/--maxbytes")
    if device == "cuda":
        device_free = device_available() if device_free is None else device_free
        if device_free is not None and dev_need > device_free:
            return (f"the largest case ({what}) needs {format_size(dev_need)} of GPU memory per rank, but "
                    f"{format_size(device_free)} is free on this rank's GPU: lower -e/--maxbytes")
    return None
