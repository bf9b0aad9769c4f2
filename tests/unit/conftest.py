"""Controller unit tests run on the in-memory adapters (orchestrator/testing.py) and nothing else."""

from __future__ import annotations

import pytest

from tests.support.rig import Rig, make_rig


@pytest.fixture
def rig() -> Rig:
    return make_rig()
