#!/bin/bash
# The input must be sorted first, a contained interval must not shrink the merged one, and intervals
# that touch (end + 1 == start) are joined.
cat > /app/intervals.py <<'PY'
"""Merging closed integer intervals."""


def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of `intervals` as sorted, non-overlapping intervals; touching ones are joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
PY
