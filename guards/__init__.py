"""Pure precondition checks. Each returns a `Verdict` naming itself and saying why.

`GUARDS` maps the names used in `states.TABLE` to the snapshot guards; `READS` says which
components' reports each reads (beside what the controller decided and its config), so that an
event asks only those: `regions` (`paused`), `trainer` (`params_valid`), `engine`
(`engine_resident`, `engine_idle`, `engine_version`) and `memory` (`memory`).
"""

from collections.abc import Callable

from guards import cycle, engine, memory, trainer
from guards.verdict import Verdict, evaluate, refusals
from states import Snapshot

SnapshotGuard = Callable[[Snapshot], Verdict]

GUARDS: dict[str, SnapshotGuard] = {
    check.__name__: check
    for check in (
        trainer.trainer_resident,
        trainer.params_valid,
        trainer.sync_source_resident,
        trainer.restore_coverage,
        trainer.params_dropped,
        engine.engine_attached,
        engine.engine_idle,
        engine.engine_synced,
        engine.engine_version_known,
        engine.cache_flushed,
        engine.version_increasing,
        engine.engine_kv_released,
        engine.engine_weights_resident,
        cycle.weights_changed,
        cycle.weights_unchanged,
        memory.memory_fits,
    )
}

READS: dict[str, frozenset[str]] = {
    name: frozenset(components)
    for name, components in {
        "trainer_resident": ("regions",),
        "params_valid": ("trainer",),
        "sync_source_resident": ("regions",),
        "restore_coverage": (),
        "params_dropped": ("regions",),
        "engine_attached": (),
        "engine_idle": ("engine",),
        "engine_synced": ("engine",),
        "engine_version_known": ("engine",),
        "cache_flushed": (),
        "version_increasing": ("engine",),
        "engine_kv_released": ("engine",),
        "engine_weights_resident": ("engine",),
        "weights_changed": (),
        "weights_unchanged": (),
        "memory_fits": ("memory", "regions", "engine"),
    }.items()
}

__all__ = ["GUARDS", "READS", "SnapshotGuard", "Verdict", "evaluate", "refusals"]
