"""Parsing and printing quantities with units: sizes, counts, dtypes.

Library code works in bytes, seconds and FLOPs; this module is what the CLI and reports use
to read `13.5GB`, `2GiB`, `16M-tokens`, `15T` and to print `30.1 GB` / `68.0 GiB`.
`GB` = 10^9 bytes, `GiB` = 2^30 bytes, always.
"""

from __future__ import annotations

import math
import re

from shardwise.errors import ShardwiseError

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "tf32": 4,
    "fp16": 2,
    "bf16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
    "fp64": 8,
}

_DECIMAL = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name (`bf16` → 2)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ShardwiseError(
            f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}"
        ) from None


def parse_size(text: str | float | int) -> float:
    """Bytes from `13.5GB`, `2GiB`, `512MB`, `4000`, `4000B` (GB decimal, GiB binary): a
    finite number ≥ 0."""
    from shardwise.validate import finite

    if isinstance(text, int | float) and not isinstance(text, bool):
        return finite(text, "size", low=0)
    if not isinstance(text, str):
        raise ShardwiseError(f"size must be a number or a text such as 13.5GB, got {text!r}"
                             [:200])
    match = _NUMBER.match(text)
    if match:
        value, unit = float(match.group(1)), match.group(2).upper()
        unit = unit.removesuffix("B")
        scale = _BINARY.get(unit, _DECIMAL.get(unit))
        if scale is not None:
            return finite(value * scale, f"size {text!r}", low=0)
    raise ShardwiseError(
        f"cannot read size {text!r}; write e.g. 13.5GB, 2GiB, 512MB or a byte count"
    )


def parse_count(text: str | float | int, *, what: str = "count") -> float:
    """A count with an optional decimal suffix: `15T`, `16M`, `2.5B` (billion), `1e6`."""
    from shardwise.validate import finite

    if isinstance(text, int | float) and not isinstance(text, bool):
        return finite(text, what, low=0)
    if not isinstance(text, str):
        raise ShardwiseError(f"{what} must be a number or a text such as 15T, got {text!r}"
                             [:200])
    cleaned = text.strip().upper()
    for word in ("-TOKENS", "TOKENS", "-SEQS", "SEQS"):
        cleaned = cleaned.removesuffix(word)
    match = _NUMBER.match(cleaned)
    if match:
        value, unit = float(match.group(1)), match.group(2)
        scale = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(unit)
        if scale is not None:
            return finite(value * scale, f"{what} {text!r}", low=0)
    raise ShardwiseError(f"cannot read {what} {text!r}; write e.g. 16M, 15T, 2.5B or 4096")


def parse_batch(text: str | int, seq_len: int) -> int:
    """Global batch in sequences from `1024` (sequences) or `16M-tokens` (tokens ÷ seq_len).

    A token count must be a whole number of sequences. Read in decimal units first
    (`16M` = 16·10^6); when that is not whole but the binary reading is (`16M` = 16·2^20, as
    batch sizes are usually quoted: Llama 3's "16M tokens" = 2048 × 8192), the binary one is
    used. Callers print the resulting sequence count, so the reading is always visible.
    """
    from shardwise.validate import MAX_SEQUENCES, integer, positive_int

    positive_int(seq_len, "seq_len")
    if not isinstance(text, str):
        return integer(text, "global batch", low=1, high=MAX_SEQUENCES)
    if "token" in text.lower():
        tokens = parse_count(text, what="global batch")
        match = _NUMBER.match(text.upper().split("-TOKEN")[0].split("TOKEN")[0])
        readings = [tokens]
        if match and match.group(2) in ("K", "M", "G", "B", "T"):
            binary = {"K": 2**10, "M": 2**20, "G": 2**30, "B": 2**30, "T": 2**40}
            readings.append(float(match.group(1)) * binary[match.group(2)])
        for value in readings:
            if value >= seq_len and value % seq_len == 0:
                return integer(int(value // seq_len), f"global batch {text!r} (sequences)",
                               low=1, high=MAX_SEQUENCES)
        raise ShardwiseError(
            f"global batch {text!r} is not a whole number of sequences of {seq_len} tokens "
            f"({tokens:,.0f} / {seq_len} = {tokens / seq_len:,.2f}); give sequences instead"
        )
    value = parse_count(text, what="global batch")
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise ShardwiseError(f"global batch {text!r} must be a whole number of sequences ≥ 1")
    return integer(int(value), f"global batch {text!r}", low=1, high=MAX_SEQUENCES)


def gb(n_bytes: float) -> str:
    """`30.1 GB` (decimal)."""
    return f"{n_bytes / 1e9:,.2f} GB"


def gib(n_bytes: float) -> str:
    """`68.0 GiB` (binary)."""
    return f"{n_bytes / 2**30:,.2f} GiB"


def human_count(n: float) -> str:
    """`6.74B`, `125M`, `1.2K`."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def human_time(seconds: float) -> str:
    """`52.5 ms`, `3.2 s`, `4.1 h`, `12.3 days`."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def human_rate(per_day: float, noun: str = "") -> str:
    """How often an event recurs, in the unit that reads: `7.8 interruptions a day`, `2.3
    interruptions a week` (below one a day), `one interruption every 33 days` (below one a
    week); `noun` is the event's singular name ("": no noun)."""
    plural = f" {noun}s" if noun else ""
    if not per_day > 0:
        return f"no{plural or ' events'}"
    if per_day >= 1:
        return f"{per_day:,.1f}{plural} a day"
    if per_day >= 1 / 7:
        return f"{per_day * 7:.1f}{plural} a week"
    return f"one{' ' + noun if noun else ''} every {1 / per_day:,.0f} days"
