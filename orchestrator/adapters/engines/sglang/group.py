"""Every SGLang server of a job as one `RolloutEngine`.

`SGLangGroup` is what `colocate run --engine sglang` drives: every server of the job (one per
`--engine-url`) behind one `RolloutEngine`, and the job's rollout over all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

import torch

from orchestrator.adapters.engines.sglang.client import SGLangEngine, version_problem
from orchestrator.adapters.engines.sglang.weights import _close_quietly, _destroy_group_quietly
from orchestrator.core.config import EnginePause
from orchestrator.errors import ConfigError, EngineError
from orchestrator.protocols import EngineDefaults, EngineFeatures, Named
from orchestrator.telemetry.logs import note_leftover
from orchestrator.telemetry.tracing import carried
from states import EngineMemory


def url_problems(
    urls: Sequence[str], *, label: str = "server URL", missing: str = "no SGLang server URL given"
) -> list[str]:
    """What is wrong with a list of server URLs: none (`missing`), not http(s), or one given twice;
    each URL named after `label` (the job names its flag)."""
    if not urls:
        return [missing]
    problems = [
        f"{label} {url!r}: not an http:// or https:// URL"
        for url in urls
        if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1].strip("/")
    ]
    names = [url.rstrip("/") for url in urls]
    return problems + [f"{label} {url} given twice" for url in sorted({u for u in names if names.count(u) > 1})]


class SGLangGroup(EngineDefaults):
    """Several SGLang servers (data-parallel replicas, one URL each) as one `RolloutEngine`.

    Memory calls, flushes and weight buckets go to every server, concurrently (each server sends
    only the memory calls that change something, see memory.py). Generation is held around each
    update by `pause` (`SGLangEngine.pause_generation`: SGLang's mode, or "none"). The version is
    the one they all serve (servers that disagree are an `EngineError` naming each one's). The
    rollout splits the prompts into contiguous shares, one per server.

    It implements the job's engine (`orchestrator.protocols.RolloutEngine`) too: `generate` takes and
    returns tensors, and `digests()` is None, since SGLang's HTTP API has no way to read every
    weight back.
    """

    features = EngineFeatures(sessions=True)  # and no digests: `engine_matches_trainer` is not checked

    def __init__(
        self, urls: Sequence[str], *, pause: EnginePause | str = EnginePause.RETRACT, **engine_options: Any
    ) -> None:
        problems = url_problems(urls)
        if pause not in EnginePause.__members__.values():
            problems.append(f"engine pause {pause!r}: not one of {', '.join(EnginePause)}")
        if problems:
            raise ConfigError(problems)
        self.pause = EnginePause(pause)
        self._weight_groups: set[str] = set()
        names = [url.rstrip("/") for url in urls]
        self.engines = [SGLangEngine(url, **engine_options) for url in urls]
        self.name = self.engines[0].name if len(self.engines) == 1 else f"sglang[{', '.join(names)}]"

    def _each(self, call: Callable[[SGLangEngine], Any]) -> list[Any]:
        """`call` on every server at once; results in URL order; the first failure, re-raised."""
        if len(self.engines) == 1:
            return [call(self.engines[0])]
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="sglang") as pool:
            return list(pool.map(carried(call), self.engines))

    def connect(self, timeout_s: float = 0.0) -> None:
        """Check every server answers and can serve colocated; take each one's TP size.

        Waits up to `timeout_s` for a server that is starting. An unreachable server is an
        `EngineError` naming its URL: a refused connection fails within a second, an unroutable
        host after the connect timeout and its retries. A server started without
        `--enable-memory-saver` is refused: it could not give its memory to the trainer. So is an
        SGLang outside `SUPPORTED_SGLANG` (its `version`, from /server_info): the error names the range.
        """

        def check(engine: SGLangEngine) -> None:
            if timeout_s > 0:
                engine.wait_until_ready(timeout_s)
            try:
                info = engine.server_info()
            except EngineError as exc:
                if exc.status != HTTPStatus.NOT_FOUND:
                    raise
                raise EngineError(engine.name, f"{exc.reason}: is this an SGLang 0.5 server?", exc.status) from exc
            problem = version_problem(info.get("version"))
            if problem:
                raise EngineError(engine.name, problem)
            if not info.get("enable_memory_saver"):
                raise EngineError(
                    engine.name, "started without --enable-memory-saver: it cannot release memory for the trainer"
                )
            engine.tp_size = int(info.get("tp_size") or 1)

        self._each(check)
        self.weight_version()

    def destroy_at_close(self, group_name: str) -> None:
        """Destroy the weight-update group `group_name` on every server at `close`: the trainer's
        end (`WeightBroadcaster`) may be in a process that is gone by then (a Ray actor the job
        killed), and a group left on a server makes the next run's join fail."""
        self._weight_groups.add(group_name)

    def close(self) -> None:
        """Hand the servers back as a new client expects to find them: no weight-update group of
        this job's (`destroy_at_close`), and every memory tag resident. SGLang reports no released
        memory, so a new client (the next run's) must believe it all resident, and its first
        release of memory this run left released would end the server (client.py). A server that
        cannot take a call is a `leftover` warning line. Generation stays paused where the last
        update failed: its weights are part-updated.

        Not covered: a driver killed with SIGKILL closes nothing, and leaves its servers released;
        restart them before the next run."""
        for group_name in sorted(self._weight_groups):
            _destroy_group_quietly(self.engines, group_name)
        for engine in self.engines:
            try:
                engine.resume(engine.released())
            except EngineError as exc:
                note_leftover(engine.name, "memory this run released", f"not resumed: {exc.reason}")
            engine.close()

    # ---- the RolloutEngine Protocol --------------------------------------------------------

    def release(self, tags: frozenset[EngineMemory]) -> None:
        self._each(lambda e: e.release(tags))

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        self._each(lambda e: e.resume(tags))

    def released(self) -> frozenset[EngineMemory]:
        """The tags every server released: a tag any server still holds counts as resident, so
        recover releases it again, and each server sends only what it holds."""
        return frozenset.intersection(*self._each(SGLangEngine.released))

    def flush_cache(self) -> None:
        self._each(SGLangEngine.flush_cache)

    def weight_version(self) -> int | None:
        versions = dict(zip((e.name for e in self.engines), self._each(SGLangEngine.weight_version), strict=True))
        if len(set(versions.values())) > 1:
            raise EngineError(self.name, f"the servers serve different weight versions: {versions}")
        return next(iter(versions.values()))

    def is_idle(self) -> bool:
        return all(self._each(SGLangEngine.is_idle))

    @contextmanager
    def weight_update_session(self, version: int | None = None) -> Iterator[None]:
        """Generation held on every server (`pause`), then every server's weight-update session
        around the body.

        - The body returned: every session is closed, then every server serves `version`
          (`set_weight_version`, once per update: no bucket carries a version), then generation
          goes on.
        - The body raised: the sessions are closed (the body's error is the one raised), the
          version served stays the old one, and generation stays held: no server serves a
          part-updated model. The next update that succeeds lets it go on.
        - A server that refuses to open its session closes the sessions the others opened.
        """
        self._each(lambda e: e.pause_generation(self.pause))
        opened: list[SGLangEngine] = []

        def begin(engine: SGLangEngine) -> None:
            engine.begin_weight_update()
            opened.append(engine)

        try:
            self._each(begin)
        except BaseException as exc:
            _close_quietly(opened, exc)
            raise
        try:
            yield
        except BaseException as exc:
            _close_quietly(opened, exc)
            raise
        self._each(SGLangEngine.end_weight_update)
        if version is not None:
            self._each(lambda e: e.set_weight_version(version))
        self._each(lambda e: e.continue_generation(self.pause))

    # ---- the job's engine ------------------------------------------------------------------

    def update_weights(self, named: Sequence[Named], version: int) -> int:
        """One bucket to every server; returns the bytes sent to all of them."""
        return sum(self._each(lambda e: e.update_weights(named, version)))

    def generate(
        self, prompts: torch.Tensor, *, max_new_tokens: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exactly `max_new_tokens` sampled tokens per prompt row, and their log-probabilities.

        `ignore_eos` keeps every completion at full length, as the trainer's batch needs; no
        `min_new_tokens`, which SGLang refuses under `--skip-tokenizer-init` (it needs the tokenizer's
        eos_token_id) and which `ignore_eos` makes redundant. Each row
        gets its own `sampling_seed` (seed + row): SGLang honours it only under
        `--enable-deterministic-inference`, and a seed shared by a group's identical prompts would
        make their samples identical there.
        """
        rows = prompts.tolist()
        params = [
            {
                "max_new_tokens": max_new_tokens,
                "ignore_eos": True,
                "temperature": temperature,
                "sampling_seed": seed + row,
            }
            for row in range(len(rows))
        ]
        share = dict(zip(self.engines, _shares(len(rows), len(self.engines)), strict=True))
        per_server = self._each(lambda e: e.generate(rows[share[e]], params[share[e]]) if rows[share[e]] else [])
        generations = [g for answers in per_server for g in answers]
        short = [(i, len(g.token_ids)) for i, g in enumerate(generations) if len(g.token_ids) != max_new_tokens]
        if short:
            raise EngineError(
                self.name, f"{len(short)} completions are not {max_new_tokens} tokens long (row, length): {short[:4]}"
            )
        completions = torch.tensor([g.token_ids for g in generations], dtype=torch.int64).reshape(len(rows), -1)
        logprobs = torch.tensor([g.logprobs for g in generations], dtype=torch.float32).reshape(len(rows), -1)
        return completions, logprobs

    def flush_traces(self) -> None:
        """The servers export their own spans, if started with `--enable-trace`."""


def _shares(rows: int, servers: int) -> list[slice]:
    """Contiguous, near-equal shares of `rows`, one per server (the first ones take the remainder)."""
    size, extra = divmod(rows, servers)
    starts = [i * size + min(i, extra) for i in range(servers + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(starts)]
