"""`colocate check`'s set-up rows: the config guards of the mode (`guards.config`), run on the
trainer's set-up the options describe: a row per guard that refuses it, with the guard's own
reason, and one for those that admit it.

The set-up is `states.TrainingSetup`, the facts `colocate_megatron` reads off Megatron's DDP and
optimizer configs (`adapters/megatron/trainer.py`'s `megatron_setup`) and the trainer's own
flags; `colocate check` takes each as an option named as Megatron-LM names the config field
(docs/check.md). Whether the optimizer is distributed is the plan's `--distributed-optimizer`,
one fact read from one place.
"""

from __future__ import annotations

from dataclasses import replace

from guards.config import CHECKS
from orchestrator.job.check.rows import Outcome, Row, SetUp

GROUP = "set-up"

# The fix of each guard's refusal, in the options of `colocate check` (and of the trainer).
# Every mode but train-only keeps a pinned copy of the weights instead: backup accepts them all
# but the last.
FIXES: dict[str, str] = {
    "colocated": "run the engine on the trainer's GPUs (drop --no-colocate), or --mode backup",
    "trainer_offloads": "let the trainer release its memory for the rollout (drop --no-offload-train), or --mode backup",
    "distributed_optimizer": "use Megatron's distributed optimizer (--distributed-optimizer), or --mode backup",
    "advantages_computed": "compute advantages every step (drop --no-compute-advantages), or --mode backup",
    "no_lora": "train without LoRA under rematerialize (drop --lora), or --mode backup",
    "optimizer_enabled": "give the run an optimizer (drop --no-optimizer), or --mode backup",
    "no_old_actor_copy": "drop --keep-old-actor, or --mode backup",
    "no_overlap_param_gather": "drop --overlap-param-gather (Megatron's DDP config), or --mode backup",
    "optimizer_casts_mains": "drop --precision-aware-optimizer, or add --optimizer-cpu-offload, or --mode backup",
    "not_debug_train_only": "drop --debug-train-only: a run that never updates weights is train-only, not colocated",
}


def rows(setup: SetUp) -> list[Row]:
    """A row per guard of the plan's mode that refuses the set-up, with the guard's reason and its
    fix; the guards that admit it share one row, naming each."""
    mode = setup.plan.mode
    training = replace(setup.training, distributed_optimizer=setup.plan.optimizer.distributed)
    verdicts = [check(training) for check in CHECKS[mode]]
    out = [
        Row(group=GROUP, check=v.guard, outcome=Outcome.FAIL, read=f"{mode.value}: {v.reason}", fix=FIXES[v.guard])
        for v in verdicts
        if not v.ok
    ]
    admitted = [v.guard for v in verdicts if v.ok]
    if admitted:
        check = "the mode's refusals" if not out else "the mode's other refusals"
        read = f"{mode.value}'s {len(admitted)} guard(s) admit it: {', '.join(admitted)}"
        out.append(Row(group=GROUP, check=check, outcome=Outcome.OK, read=read))
    return out
