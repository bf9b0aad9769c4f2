"""Phases, events and the transition table: pure data, importing nothing of the project."""

from states.phases import EngineMemory, Event, Mode, Offload, Phase, Region, Source
from states.setup import TrainingSetup
from states.snapshot import MemoryBudget, Snapshot, TrainerLayout
from states.table import CYCLE, INITIAL, TABLE, Transition

__all__ = [
    "CYCLE",
    "INITIAL",
    "TABLE",
    "EngineMemory",
    "Event",
    "MemoryBudget",
    "Mode",
    "Offload",
    "Phase",
    "Region",
    "Snapshot",
    "Source",
    "TrainerLayout",
    "TrainingSetup",
    "Transition",
]
