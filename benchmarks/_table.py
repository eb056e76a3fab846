"""How the benchmarks print a table and write it as CSV."""

from __future__ import annotations

import csv
from collections.abc import Sequence


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """``header`` and ``rows`` as right-aligned columns, each as wide as its widest cell."""
    widths = [max(len(str(v)) for v in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)))


def write_csv(path: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """``header`` then ``rows`` into the CSV file ``path``."""
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows([header, *rows])
