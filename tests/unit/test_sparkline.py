"""The one sparkline: `colocate run`'s reward curve and `colocate trace summarize`'s phase times."""

from __future__ import annotations

import pytest

from orchestrator.telemetry.sparkline import sparkline


def test_values_scale_from_the_lowest_bar_to_the_highest() -> None:
    assert sparkline([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == "▁▂▃▄▅▆▇█"
    assert sparkline([10.0, 80.0, 45.0]) == "▁█▅"


def test_a_flat_series_and_an_empty_one() -> None:
    assert sparkline([3.0, 3.0, 3.0]) == "▁▁▁"
    assert sparkline([]) == ""


def test_a_missing_value_is_blank_or_a_cross_where_it_was_refused() -> None:
    assert sparkline([1.0, None, None, 2.0], missed=[0, 0, 2, 1]) == "▁ ×█"
    assert sparkline([None, None]) == "  "


def test_refusal_counts_must_match_the_values() -> None:
    with pytest.raises(ValueError, match="3 values but 2 counts of missed attempts"):
        sparkline([1.0, 2.0, 3.0], missed=[0, 0])
