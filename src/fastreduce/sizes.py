"""Byte sizes in text: the one parser and the one formatter fastreduce uses."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_UNITS = {"": 1, "K": 1 << 10, "KI": 1 << 10, "M": 1 << 20, "MI": 1 << 20,
          "G": 1 << 30, "GI": 1 << 30}
_SCALES = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def parse_size(text: str) -> int:
    """Bytes from "4096", "64K", "64KiB", "1.5M", "2GiB" (binary units); ValueError if not."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?)?B?\s*", text.upper())
    if not match:
        raise ValueError(f"size {text!r}: give bytes, optionally with K, M or G (KiB, MiB, "
                         f"GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def format_size(nbytes: float, *, exact: bool = True) -> str:
    """A size in binary units. exact: text `parse_size` reads back ("64KiB", "1MiB", or
    "48000" where no unit divides); else for people, 4 significant digits ("1.5 MiB",
    "4 B")."""
    if exact:
        for unit, scale in _SCALES:
            if nbytes and nbytes % scale == 0:
                return f"{int(nbytes) // scale}{unit}"
        return str(int(nbytes))
    for unit, scale in _SCALES:
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.4g} B"
