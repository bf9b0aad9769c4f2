"""Bit-exactness: digests taken when params are dropped must match those after the restore."""

from __future__ import annotations

from collections.abc import Mapping

from guards.verdict import Verdict, names


def restore_bit_identical(before: Mapping[str, str], after: Mapping[str, str]) -> Verdict:
    """Compare per-tensor digests. Names missing on either side count as mismatches."""
    differing = [n for n in before.keys() & after.keys() if before[n] != after[n]]
    missing = before.keys() ^ after.keys()
    if differing or missing:
        parts = []
        if differing:
            parts.append(f"{len(differing)} tensor(s) differ: {names(differing)}")
        if missing:
            parts.append(f"{len(missing)} tensor(s) digested on one side only: {names(missing)}")
        return Verdict("restore_bit_identical", False, "; ".join(parts))
    return Verdict("restore_bit_identical", True, f"{len(before)} tensors bit-identical")
