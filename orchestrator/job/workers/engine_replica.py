"""One rollout-engine replica in its process: an engine the job runs itself (the registry builds
it: `TransformersEngine`), whose calls are spans."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from orchestrator.adapters.registry import ENGINES, EngineSpec
from orchestrator.job.workers.staging import Slot, attach
from orchestrator.job.workers.traced import Traced
from orchestrator.protocols import EngineState, Named
from orchestrator.telemetry import semconv
from states import EngineMemory


class EngineReplica(Traced):
    """Replica `index` of `replicas`: serves its share of each rollout and loads the weights its
    colocated rank pushes. The engine's library is imported here, only in a process that serves rollouts.
    """

    role = semconv.ROLE_ENGINE

    def __init__(
        self,
        kind: str,
        spec: EngineSpec,
        *,
        index: int = 0,
        replicas: int = 1,
        own_process: bool = False,
        trace_file: str | None = None,
    ) -> None:
        # Replicas' spans carry the rank of their GPU; a lone engine's carry none.
        self.rank = index if replicas > 1 else None
        if own_process:
            self.start_tracing(trace_file, rank=self.rank)
            self.start_logging("engine" if replicas == 1 else f"engine {index}")
        self.index, self.replicas = index, replicas
        name = kind if replicas == 1 else f"{kind}[{index}]"
        self._closing = contextlib.ExitStack()
        self.engine = self._closing.enter_context(ENGINES[kind].build(dataclasses.replace(spec, name=name)))
        self._staging: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"EngineReplica(index={self.index})"

    def close(self) -> None:
        """Close the engine (in the driver's process; an actor's ends with its process)."""
        self._closing.close()

    # The RolloutEngine Protocol, for this replica.
    def release(self, tags: frozenset[EngineMemory]) -> None:
        self.engine.release(tags)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self.engine.resume(tags)

    def state(self) -> EngineState:
        return self.engine.state()

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def footprint(self) -> dict[EngineMemory, int] | None:
        """Bytes each engine tag takes on this GPU while resident; None where the engine cannot say."""
        footprint = self.engine.footprint()
        return dict(footprint) if footprint is not None else None

    def digests(self) -> dict[str, str] | None:
        return self.engine.digests()

    # Weights.
    def update_weights(self, named: Sequence[Named], version: int) -> int:
        return self.engine.update_weights(named, version)

    def attach_staging(self, handle: Any) -> int:
        """Open the staging buffer of the rank on this GPU (`TrainerRank.share_staging`)."""
        self._staging = attach(handle)
        return self._staging.numel()

    def load_staged(self, slots: Sequence[Slot], version: int) -> int:
        """Load the tensors the rank packed into the staging buffer; returns the bytes written."""
        if self._staging is None:
            raise RuntimeError(f"engine replica {self.index}: load_staged before attach_staging")
        written = self.engine.update_weights([(s.name, s.view(self._staging)) for s in slots], version)
        torch.cuda.synchronize()  # the rank refills the buffer as soon as this returns
        return written

    # Serving.
    def generate(
        self, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's contiguous share of the rows (replica i of n: the i-th n-th), sampled
        with `seed + index`; on the host, for the driver to concatenate."""
        rows = prompts.shape[0] // self.replicas
        share = prompts[self.index * rows : (self.index + 1) * rows]
        completions, logprobs = self.engine.generate(
            share, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + self.index
        )
        return completions.cpu(), logprobs.cpu()
