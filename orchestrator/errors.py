"""Every error colocate raises. Each builds its message from the context it carries."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from guards.verdict import Verdict
from states import Event, Phase


class LifecycleError(Exception):
    """Base of colocate's errors.

    Each subclass builds its message from what it carries; `_fields` names those constructor
    arguments, so a copy or a pickle (a Ray actor's error crossing processes) rebuilds it whole,
    notes included.
    """

    _fields: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), tuple(getattr(self, f) for f in self._fields), self.__dict__)


class IllegalTransition(LifecycleError):
    """The table has no row for this event in this phase."""

    _fields = ("state", "event", "legal")

    def __init__(self, state: Phase, event: Event, legal: Sequence[Event] = ()) -> None:
        self.state, self.event, self.legal = state, event, tuple(legal)
        allowed = ", ".join(e.value for e in self.legal) or "nothing"
        super().__init__(f"{event.value} is not legal in {state.value} (legal there: {allowed})")


class GuardRejected(LifecycleError):
    """One or more guards refused the event. `verdicts` holds every refusal."""

    _fields = ("state", "event", "verdicts")

    def __init__(self, state: Phase, event: Event, verdicts: Sequence[Verdict]) -> None:
        self.state, self.event, self.verdicts = state, event, tuple(verdicts)
        reasons = "\n".join(f"  - {v}" for v in self.verdicts)
        super().__init__(f"{event.value} refused in {state.value}:\n{reasons}")


class ActionFailed(LifecycleError):
    """The action of an admitted event raised; the lifecycle is FAULTED and `cause` kept."""

    _fields = ("state", "event", "cause")

    def __init__(self, state: Phase, event: Event, cause: BaseException) -> None:
        self.state, self.event, self.cause = state, event, cause
        super().__init__(f"{event.value} failed in {state.value}: {type(cause).__name__}: {cause}")


class EventInFlight(LifecycleError):
    """An event was fired while another was in flight (from another thread): one writer at a time."""

    _fields = ("event", "running")

    def __init__(self, event: Event, running: Event) -> None:
        self.event, self.running = event, running
        super().__init__(f"{event.value} fired while {running.value} is in flight: fire events from one thread")


class FaultWithoutCause(LifecycleError):
    """`fault` was fired with nothing to say why: a fault needs a cause (`Lifecycle.fault(cause)`)."""

    def __init__(self) -> None:
        super().__init__("a fault needs a cause: call fault(cause) with the exception or a sentence")


class RecoveryRefused(LifecycleError):
    """recover could not establish what TRAIN promises; the lifecycle stays FAULTED.

    `problems` names each invariant that does not hold (a busy engine, params that differ from
    the digests taken at the drop, ...).
    """

    _fields = ("problems",)

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"recover cannot bring the trainer back to TRAIN:\n{lines}")


class StashMismatch(LifecycleError):
    """An extra's backup no longer has the dtype or shape of the live tensor: copying into it
    would round or fail, and every later restore would bring back the wrong values."""

    _fields = ("name", "stashed", "live")

    def __init__(self, name: str, stashed: str, live: str) -> None:
        self.name, self.stashed, self.live = name, stashed, live
        super().__init__(f"extra {name}: its backup is {stashed}, the live tensor {live}")


class ConfigError(LifecycleError):
    """The configuration cannot work. `violations` names every problem at once."""

    _fields = ("violations",)

    def __init__(self, violations: Sequence[Verdict | str]) -> None:
        self.violations = tuple(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} configuration problem(s):\n{lines}")


class RegionRefused(LifecycleError):
    """A memory-region call the ledger refused before the adapter was asked."""

    _fields = ("tag", "reason")

    def __init__(self, tag: str, reason: str) -> None:
        self.tag, self.reason = tag, reason
        super().__init__(f"region {tag!r}: {reason}")


class EngineError(LifecycleError):
    """A rollout engine reported a failed call or a state colocate did not ask for.

    `status` is the HTTP status the engine answered with (compare with `http.HTTPStatus`), None where it
    gave none (no answer, or a refusal in its body or in this process): callers switch on it,
    never on the wording of `reason`.
    """

    _fields = ("engine", "reason", "status")

    def __init__(self, engine: str, reason: str, status: int | None = None) -> None:
        self.engine, self.reason, self.status = engine, reason, status
        super().__init__(f"engine {engine}: {reason}")


class RankFailed(LifecycleError):
    """A trainer rank or the engine actor died, hung past its timeout, or raised: in its call of
    `method`, or (`during`) while the driver waited on another worker's `method`."""

    _fields = ("who", "method", "cause", "during")

    def __init__(self, who: str, method: str, cause: BaseException, during: bool = False) -> None:
        self.who, self.method, self.cause, self.during = who, method, cause, during
        where = f"during {method}, not in a call of its own" if during else f"failed in {method}"
        super().__init__(f"{who} {where}: {type(cause).__name__}: {cause}")


class RayUnreachable(LifecycleError):
    """No Ray cluster could be joined at `address` (nothing listens there, it refused this driver's
    token, or it is not Ray)."""

    _fields = ("address", "cause", "hint")

    def __init__(self, address: str, cause: BaseException, hint: str = "") -> None:
        self.address, self.cause, self.hint = address, cause, hint
        why = f"{type(cause).__name__}: {cause}" + (f" ({hint})" if hint else "")
        super().__init__(f"cannot join the Ray cluster at {address}: {why}")


class RestoreMismatch(LifecycleError):
    """Params restored after a drop are not bit-identical to those dropped."""

    _fields = ("cycle", "verdict")

    def __init__(self, cycle: int, verdict: Verdict) -> None:
        self.cycle, self.verdict = cycle, verdict
        super().__init__(f"restore of cycle {cycle} is not bit-identical: {verdict.reason}")


# Trace files are read after the fact, outside any lifecycle.
class TraceError(Exception):
    """The traces cannot answer the question asked (no such step, no driver spans, a bad output path)."""


class TraceFileError(TraceError):
    """A file that is not OTLP-JSON trace data; `line` is 1-based, 0 for the file as a whole."""

    def __init__(self, path: Path, line: int, problem: str) -> None:
        self.path, self.line, self.problem = path, line, problem
        super().__init__(f"{path}:{line}: {problem}" if line else f"{path}: {problem}")
