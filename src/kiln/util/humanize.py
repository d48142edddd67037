"""Numbers as people read them: thousands separators, and singular for one."""

from __future__ import annotations

import math


def count(n: int | float) -> str:
    """An integer count with thousands separators: 1234567 -> '1,234,567' (nan, inf as such)."""
    return f"{round(n):,}" if math.isfinite(n) else str(n)


def gigabytes(n: int | float) -> str:
    """Bytes in decimal gigabytes, as memory is sold: 2.5e9 -> '2.50 GB'."""
    return f"{n / 1e9:,.2f} GB"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 device', '8 devices', '12,000 tokens' ('many' for irregular plurals)."""
    return f"{count(n)} {word if n == 1 else (many or word + 's')}"


def duration(seconds: float) -> str:
    """A duration for a reader: '4.2 s', '3 min 5 s', '2 h 05 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"
