"""``deepspeed.utils.numa.parse_range_list``: DeepSpeed's core-list syntax (``"0,2-4,6"``), parsed.

zerospeed's launcher does not bind cores (``--bind_core_list`` is refused with its alternative), but
scripts validate core lists with this helper, so the syntax is served: comma-separated numbers or
``a-b`` ranges (both ends included), ascending and not overlapping.
"""

from __future__ import annotations


def _one_range(item: str) -> range:
    lo, dash, hi = item.partition("-")
    if not dash:
        return range(int(item), int(item) + 1)
    if not lo or not hi or "-" in hi:
        raise ValueError(f"bad range {item!r}: a number or two numbers joined by '-'")
    start, end = int(lo), int(hi)
    if start > end:
        raise ValueError(f"bad range {item!r}: the end is below the start")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``; ValueError on a descending or overlapping list."""
    numbers: list[int] = []
    for item in range_str.split(","):
        part = _one_range(item.strip())
        if numbers and part[0] <= numbers[-1]:
            raise ValueError(f"bad range list {range_str!r}: ranges must ascend and not overlap")
        numbers.extend(part)
    return numbers


__all__ = ["parse_range_list"]
