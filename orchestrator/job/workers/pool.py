"""The driver's calls to its workers: typed, bounded, and naming the worker at fault.

    ranks = WorkerPool(actors, label="rank", remote=True)
    freed = ranks.all(TrainerRank.pause, "param_buffer")     # list[int], in worker order
    report = ranks.one(0, TrainerRank.push_weights, ...)     # rank 0 only
    ranks.some([0, 1], TrainerRank.end_payloads)             # ranks 0 and 1 only

The method is a reference to the worker class's own function, so mypy checks its arguments and
result; the wire carries its name to `Traced.call` in the worker's process. Each answer brings
the log lines the worker's process wrote, written here into the run's log (`telemetry.logs`); after
a call that failed, they are asked for on each worker's control thread.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from orchestrator.errors import ConfigError, LifecycleError, RankFailed
from orchestrator.job import interrupt
from orchestrator.job.workers.traced import Answer, Traced
from orchestrator.telemetry.logs import forward

RANK_TIMEOUT_S = 120.0
# Building a worker (imports, the model, the process group) on a loaded host takes far longer than
# a call should: start-up waits at least this long, whatever --rank-timeout says.
START_TIMEOUT_S = 300.0
CONTROL = "control"  # each actor's second thread: probes and span flushes, never blocked by the work
WATCH = "watch"  # each actor's third thread: `Traced.until_exit`, pending for the process's life
PROBE_S = 2.0  # how long a live process's control thread may take to answer, on a loaded machine

W = TypeVar("W", bound=Traced)
P = ParamSpec("P")
R = TypeVar("R")


def remote_class(cls: type[Traced]) -> Any:
    """`cls` as a Ray actor class whose `probe` and `flush_traces` run on a thread of their own,
    and `until_exit` on another; a ConfigError its construction raises is kept for `ready`."""
    import ray

    return ray.remote(concurrency_groups={CONTROL: 1, WATCH: 1})(_keeping_refusals(cls))  # type: ignore[call-overload]


def _keeping_refusals(cls: type[Traced]) -> type[Traced]:
    """`cls`, but a ConfigError raised while it is built (a set-up the worker refuses) is raised
    again by `ready`, the driver's first call. Ray keeps only the text of an error raised in an
    actor's construction, so the driver could not tell a refusal (exit 2) from a crash; an error
    raised in a call arrives whole (`RayTaskError.cause`), and `WorkerPool.start` raises it."""

    def __init__(self: Traced, *args: Any, **kwargs: Any) -> None:
        try:
            cls.__init__(self, *args, **kwargs)
        except ConfigError as exc:
            self.refusal = exc

    def ready(self: Traced) -> int:
        if self.refusal is not None:
            raise self.refusal
        return cls.ready(self)

    return type(cls.__name__, (cls,), {"__init__": __init__, "ready": ready})


def control(actor: Any, method: Callable[[Any], Any]) -> Any:
    """Call `method` (no arguments) on an actor's control thread; returns the ref."""
    return actor.invoke.options(concurrency_group=CONTROL).remote({}, method.__name__)


def _raise_refusal(failed: RankFailed) -> None:
    """Raise the ConfigError a worker raised, if that is why it failed (`_keeping_refusals`)."""
    from ray.exceptions import RayTaskError

    cause = failed.cause.cause if isinstance(failed.cause, RayTaskError) else None
    if isinstance(cause, ConfigError):
        raise cause from None


def _outcome(ref: Any) -> tuple[str, BaseException | None]:
    """Where a remote call stands now: ok, pending, died (its process) or raised."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        ray.get(ref, timeout=0)
    except GetTimeoutError as exc:
        return "pending", exc
    except RayTaskError as exc:  # it ran and raised, if only because an actor it called died
        return "raised", exc
    except RayActorError as exc:
        return "died", exc
    except Exception as exc:
        return "raised", exc
    return "ok", None


class WorkerDied(Exception):
    """A worker's process ended: what colocate knows of it (the Ray error that told is its cause)."""


def ended(pid: int | None, error: BaseException | None) -> WorkerDied:
    """How the process `pid` ended, from the Ray `error` that told: its facts (the exit type and
    detail), not its guesses. A process that vanished without exiting (a signal, a crash) is to
    Ray only a connection that closed, and it lists the OOM killer first among possible causes;
    the exit status goes to Ray's raylet, its parent, and no further."""
    text = " ".join(str(error or "").split())
    process = f"its process (pid {pid})" if pid else "its process"
    kind, detail = re.search(r"Worker exit type: (\w+)", text), re.search(r"Worker exit detail: (.+?\.)( |$)", text)
    if kind is None or detail is None:
        death = WorkerDied(f"{process} died: {text or 'Ray gave no reason'}")
    elif kind[1] == "SYSTEM_ERROR" and "connection" in detail[1]:
        death = WorkerDied(
            f"{process} ended without exiting: killed by a signal or crashed (its exit status is not known)"
        )
    else:
        death = WorkerDied(f"{process} ended ({kind[1]}): {detail[1]}")
    death.__cause__ = error
    return death


class Sentinels:
    """One pending call per worker, `Traced.until_exit`, which fails only when its process dies:
    every wait of the pools that share it wakes then, whichever worker it was waiting on (a rank
    killed while only the engine works, during a rollout, is named at once, not at its next call)."""

    def __init__(self) -> None:
        self._watched: dict[Any, tuple[Any, str, int | None]] = {}  # ref → (actor, its name, its pid)

    def watch(self, actor: Any, name: str, pid: int | None) -> None:
        ref = actor.invoke.options(concurrency_group=WATCH).remote({}, Traced.until_exit.__name__)
        self._watched[ref] = (actor, name, pid)

    @property
    def refs(self) -> list[Any]:
        return list(self._watched)

    def __getitem__(self, ref: Any) -> tuple[Any, str, int | None]:
        return self._watched[ref]


def _settle(pending: dict[Any, int]) -> None:
    """Once a call failed, give its other workers' calls up to `PROBE_S` to end: one blocked in
    a collective with a worker that died fails within moments, so its span (`rank.train`) ends
    before the caller's span of the failed call does. One still working after that is left to
    it. Not after a deadline: a call that hangs would not end within it."""
    import ray

    if pending:
        ray.wait(list(pending), num_returns=len(pending), timeout=PROBE_S)


class WorkerPool(Generic[W]):
    """Calls one method on every worker (or one) and returns the results in worker order.

    Workers are objects in this process (`remote=False`) or Ray actors of their class. When a
    remote call fails, the worker named is the one at fault, not the first still busy: one whose
    process died comes first (the first call to fail, if several died), then one that is stopped
    or answers no probe (a hang), then the first to raise. Workers blocked in a collective, waiting for that one, still answer probes.
    `label` names them in errors: "rank 1 (died)", "engine replica 0". With `sentinels`, a wait
    also ends when a worker they watch dies (this pool's, from `start` on, or another pool's).
    """

    def __init__(
        self,
        workers: Sequence[Any],
        *,
        label: str,
        remote: bool,
        timeout: float = RANK_TIMEOUT_S,
        sentinels: Sentinels | None = None,
    ) -> None:
        self.workers, self.label, self.remote, self.timeout = list(workers), label, remote, timeout
        self.sentinels = sentinels
        self.pids: dict[int, int] = {}  # index → process id, once `start` has seen them ready

    def __getstate__(self) -> dict[str, Any]:
        """A copy sent to a worker (rank 0 gets the engine's pool each push) has no sentinels: a ref
        of a call that never ends, unpickled there, costs both processes an RPC never answered (57 kB
        a step in the driver). The copy's waits end at its timeout; the driver's watch every process."""
        return {**self.__dict__, "sentinels": None}

    def __len__(self) -> int:
        return len(self.workers)

    def _name(self, index: int) -> str:
        return self.label if len(self.workers) == 1 and self.label != "rank" else f"{self.label} {index}"

    def start(self, stop: threading.Event | None = None) -> None:
        """Wait for every worker to be built (within `START_TIMEOUT_S` at least); note its process
        and watch it. Once `stop` is set (Ctrl-C), KeyboardInterrupt within `interrupt.POLL_S`."""
        if not self.remote:
            self.pids = dict(enumerate(self.all(Traced.ready)))
            return
        ready = Traced.ready.__name__
        refs = {i: worker.call.remote({}, ready) for i, worker in enumerate(self.workers)}
        try:
            self.pids = dict(enumerate(self._gather(ready, refs, max(self.timeout, START_TIMEOUT_S), stop)))
        except RankFailed as failed:  # a set-up the worker refused is bad input, as in this process
            _raise_refusal(failed)
            raise
        if self.sentinels is not None:
            for i, worker in enumerate(self.workers):
                self.sentinels.watch(worker, self._name(i), self.pids[i])

    def all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """`method(*args, **kwargs)` on every worker at once; their results in worker order."""
        return self._call(list(range(len(self.workers))), method.__name__, args, kwargs)

    def one(self, index: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`method(*args, **kwargs)` on worker `index` alone."""
        return self._call([index], method.__name__, args, kwargs)[0]

    def some(
        self, indices: Sequence[int], method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """`method(*args, **kwargs)` on the workers `indices` at once; their results in that order."""
        return self._call(list(indices), method.__name__, args, kwargs)

    def _call(self, targets: list[int], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        from orchestrator.telemetry.tracing import carrier

        headers = carrier()
        if not self.remote:
            return [self._local(index, headers, method, args, kwargs) for index in targets]
        refs = {i: self.workers[i].call.remote(headers, method, *args, **kwargs) for i in targets}
        return self._gather(method, refs, self.timeout)

    def _local(
        self, index: int, headers: dict[str, str], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            return self.workers[index].invoke(headers, method, *args, **kwargs)
        except LifecycleError:
            raise
        except Exception as exc:
            raise RankFailed(self._name(index), method, exc) from exc

    def _gather(
        self, method: str, refs: dict[int, Any], timeout: float, stop: threading.Event | None = None
    ) -> list[Any]:
        """The results of `refs`, in worker order; their lines written here as each answers. A
        failure is raised once the lines its workers kept (the failed call's among them) are."""
        try:
            return self._wait(method, refs, timeout, stop)
        except Exception:
            self._take_lines(list(refs))
            raise

    def _take_lines(self, indices: list[int]) -> None:
        """The lines kept by the workers `indices` that are alive and not stopped, within `PROBE_S`."""
        import ray

        refs = [control(self.workers[i], Traced.take_lines) for i in indices if not self._stopped(i)]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_S)
        for ref in answered:
            if _outcome(ref)[0] == "ok":  # a dead process has none to give
                forward(ray.get(ref))

    def _wait(self, method: str, refs: dict[int, Any], timeout: float, stop: threading.Event | None) -> list[Any]:
        import ray

        pending = {ref: index for index, ref in refs.items()}
        watched = self.sentinels.refs if self.sentinels is not None else []
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(
                [*pending, *watched], num_returns=1, timeout=left if stop is None else min(left, interrupt.POLL_S)
            )
            interrupt.check(stop)
            if not ready and time.monotonic() < deadline:
                continue
            if not ready:
                raise self._blame(method, refs, None)
            if ready[0] not in pending:  # a watched process died
                _settle(pending)
                raise self._death(method, refs, ready[0])
            index = pending.pop(ready[0])
            try:
                answer: Answer = ray.get(ready[0])
            except Exception as exc:  # RayActorError, or the worker's own exception
                _settle(pending)
                raise self._blame(method, refs, (index, exc)) from exc
            forward(answer.lines)
            results[index] = answer.result
        return [results[index] for index in refs]

    def _death(self, method: str, refs: dict[int, Any], sentinel: Any) -> RankFailed:
        """The failure of `method` when a watched worker's process died: this call's own, as
        `_blame` names it, or one not in this call (another pool's, say), named apart."""
        assert self.sentinels is not None
        actor, name, pid = self.sentinels[sentinel]
        _, error = _outcome(sentinel)
        mine = [i for i in refs if self.workers[i] is actor]
        if mine:
            return self._blame(method, refs, (mine[0], error or RuntimeError("died")))
        return RankFailed(f"{name} (died)", f"{self.label}.{method}", ended(pid, error), during=True)

    def _blame(self, method: str, refs: dict[int, Any], first: tuple[int, BaseException] | None) -> RankFailed:
        """The failure of `method`, naming the worker at fault (see the class docstring)."""
        import ray

        probes = {i: control(self.workers[i], Traced.probe) for i in refs}
        unanswered, deadline = list(probes.values()), time.monotonic() + PROBE_S
        while unanswered and time.monotonic() < deadline:
            _, unanswered = ray.wait(unanswered, num_returns=len(unanswered), timeout=0.1)
            if all(self._stopped(i) for i, ref in probes.items() if ref in unanswered):
                break  # a stopped process will not answer: no need to wait it out
        died: list[tuple[int, BaseException | None]] = []
        hung: list[int] = []
        for i in refs:
            (call, call_error), (probe, probe_error) = _outcome(refs[i]), _outcome(probes[i])
            if "died" in (call, probe):
                died.append((i, call_error if call == "died" else probe_error))
            elif probe != "ok" or self._stopped(i):
                hung.append(i)
        if died:
            # The first call to fail, if its process died: a peer blocked in a collective with it
            # may be torn down by NCCL a moment later, and died too by the time it is probed.
            i, cause = next(((r, c) for r, c in died if first is not None and r == first[0]), died[0])
            return RankFailed(f"{self._name(i)} (died)", method, ended(self.pids.get(i), cause))
        if hung:
            i = min(hung, key=lambda r: (not self._stopped(r), r))
            how = "its process is stopped" if self._stopped(i) else f"no answer to a probe within {PROBE_S:g} s"
            when = f"no answer within {self.timeout:g} s" if first is None else f"{self._name(first[0])} failed first"
            return RankFailed(f"{self._name(i)} (no answer)", method, TimeoutError(f"{when}; {how}"))
        if first is not None:
            return RankFailed(self._name(first[0]), method, first[1])
        busy = ", ".join(str(i) for i in refs)
        cause = TimeoutError(f"no answer within {self.timeout:g} s, though every one is alive and answers probes")
        return RankFailed(f"{self.label}(s) {busy} (alive, still working)", method, cause)

    def _stopped(self, index: int) -> bool:
        """Whether the worker's process is stopped (SIGSTOP, a debugger) or a zombie."""
        import psutil

        pid = self.pids.get(index)
        if pid is None:
            return False
        try:
            return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False
