"""Byte sizes in text: the one parser and the one formatter fastreduce uses, and the size
table (`SizeTable`) that the all-reduce algorithm and the GPU path are chosen by."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, TypeVar

__all__ = ["SizeTable", "format_size", "parse_size"]

_Table = TypeVar("_Table", bound="SizeTable")

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


@dataclass(frozen=True)
class SizeTable:
    """A choice per message size: steps of (from this many bytes, choice), the first from 0.

    A subclass names what it chooses among and how its messages and setting read
    (`fastreduce.gpupaths.PathTable`, `fastreduce.algorithms.AlgorithmTable`)."""

    steps: tuple[tuple[int, str], ...]
    source: str = ""

    # what the table chooses among, its name in messages, its setting and an example
    CHOICES: ClassVar[tuple[str, ...]] = ()
    WHAT: ClassVar[str] = "size table"
    SETTING: ClassVar[str] = ""
    EXAMPLE: ClassVar[str] = ""
    STEP: ClassVar[str] = "SIZE:CHOICE"

    def __post_init__(self):
        starts = [start for start, _ in self.steps]
        if not self.steps or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"fastreduce: {self.WHAT} {self.spec()!r}: its sizes must "
                             f"start at 0 and increase")
        if any(choice not in self.CHOICES for _, choice in self.steps):
            raise ValueError(f"fastreduce: {self.WHAT} {self.spec()!r}: the choices are "
                             f"{', '.join(self.CHOICES)}")

    @classmethod
    def parse(cls: type[_Table], text: str, source: str = "") -> _Table:
        """From one choice ("staged"), or steps "0:direct,64KiB:staged,16MiB:direct"; lines
        of a file (comments after #, the setting's name before = allowed) are joined."""
        what = f"{source}={text!r}" if source else repr(text)
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        body = ",".join(line.removeprefix(f"{cls.SETTING}=") for line in lines
                        if line).strip(",")
        if body in cls.CHOICES:
            return cls(((0, body),), source)
        steps = []
        for item in [item for item in body.split(",") if item.strip()] or [""]:
            size, sep, choice = item.strip().partition(":")
            try:
                if not sep or choice.strip() not in cls.CHOICES:
                    raise ValueError
                steps.append((parse_size(size), choice.strip()))
            except ValueError:
                raise ValueError(
                    f"fastreduce: {cls.WHAT} {what}: write one of "
                    f"{', '.join(map(repr, cls.CHOICES))}, or steps {cls.STEP} from 0 up, "
                    f"e.g. {cls.EXAMPLE!r}") from None
        try:
            return cls(tuple(steps), source)
        except ValueError as exc:
            raise ValueError(f"{exc} ({what})") from None

    def spec(self) -> str:
        """The table in the form its setting takes."""
        if len(self.steps) == 1:
            return self.steps[0][1]
        return ",".join(f"{format_size(start)}:{choice}" for start, choice in self.steps)

    def choice_for(self, nbytes: int) -> str:
        """The choice for an nbytes call."""
        chosen = self.steps[0][1]
        for start, choice in self.steps:
            if nbytes >= start:
                chosen = choice
        return chosen
