"""Command-line value types shared by the benchmarks' options."""

from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer no smaller than ``low`` (argparse names the option on error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "integer"  # what argparse calls a value it cannot convert
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
