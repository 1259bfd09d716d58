"""Human-readable numbers: bytes, FLOPs and seconds with their units."""

from __future__ import annotations

__all__ = ["fmt_bandwidth", "fmt_bytes", "fmt_count", "fmt_seconds"]


def _scaled(value: float, steps: list[tuple[float, str]], digits: int = 3) -> str:
    for scale, suffix in steps:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {suffix}".rstrip()
    return f"{value:.{digits}g}"


def fmt_bytes(n: float) -> str:
    """Bytes in binary units (1 GiB = 2^30 B), the unit of the GPU catalog, of `torch.cuda.max_memory_allocated`
    as users read it and of the emitted script's report: one unit for every memory figure pyplan prints."""
    steps = [(2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1, "B")]
    return _scaled(n, steps) if n else "0 B"


def fmt_bandwidth(n: float) -> str:
    """Bytes per second in decimal units (1 GB/s = 10^9 B/s), as vendors and NCCL's tests quote links and memory."""
    return f"{_scaled(n, [(1e12, 'TB'), (1e9, 'GB'), (1e6, 'MB'), (1e3, 'kB'), (1, 'B')])}/s" if n else "0 B/s"


def fmt_count(n: float) -> str:
    """A count such as parameters or FLOPs: 1.23 G, 45.6 M."""
    return _scaled(n, [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]) if n else "0"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return _scaled(s, [(1, "s"), (1e-3, "ms"), (1e-6, "µs")]) if s > 0 else "0 s"
