"""SGLang's memory routes for one server, made idempotent on the client (see client.py for what
sglang 0.5.23 does with each request, and why none may repeat or probe).

SGLang reports no released tags, and a release of a released tag or a resume of a resident one
ends its server. So the client keeps the server's released tags itself, from the calls that
succeeded, and sends only what closes the difference. A call that was sent and got no answer
(`Unanswered`) leaves its tags unsettled; `released()` settles them from SGLang's own ordering.
"""

from __future__ import annotations

from typing import Any

from orchestrator.adapters.engines.sglang.http import SGLangHTTP, Unanswered
from orchestrator.errors import EngineError
from orchestrator.telemetry.logs import note_noop
from states import EngineMemory


class SGLangMemory(SGLangHTTP):
    """/release_memory_occupation and /resume_memory_occupation of one server, and what it released."""

    def __init__(self, url: str, **http_options: Any) -> None:
        super().__init__(url, **http_options)
        self._released: set[EngineMemory] = set()
        # Tags of a call sent without an answer, and whether that call released them.
        self._unsettled: dict[EngineMemory, bool] = {}

    def release(self, tags: frozenset[EngineMemory]) -> None:
        """Release the tags that are resident; the others are a no-op with a note."""
        self._settle()
        if tags & self._released:
            note_noop(self.name, "release", f"{', '.join(sorted(tags & self._released))} already released")
        self._memory_call("/release_memory_occupation", tags - self._released, releases=True)

    def resume(self, tags: frozenset[EngineMemory]) -> None:
        """Resume the tags that are released; the others are a no-op with a note."""
        self._settle()
        if tags - self._released:
            note_noop(self.name, "resume", f"{', '.join(sorted(tags - self._released))} not released")
        self._memory_call("/resume_memory_occupation", tags & self._released, releases=False)

    def released(self) -> frozenset[EngineMemory]:
        """What the server released, from the calls that succeeded; an unanswered call is settled first."""
        self._settle()
        return frozenset(self._released)

    def _memory_call(self, path: str, tags: frozenset[EngineMemory], *, releases: bool) -> None:
        if not tags:
            return  # never an empty `tags`: SGLang reads it as every tag
        try:
            self._call("POST", path, {"tags": sorted(tags)})
        except Unanswered:
            self._unsettled.update(dict.fromkeys(tags, releases))
            raise
        self._record(tags, releases=releases)

    def _record(self, tags: frozenset[EngineMemory] | set[EngineMemory], *, releases: bool) -> None:
        if releases:
            self._released |= tags
        else:
            self._released -= tags

    def _settle(self) -> None:
        """Settle an unanswered call: once the server answers a /flush_cache, its scheduler has
        handled every request it received before (one at a time, in order), and a memory call it
        handled was applied whole, or the server would be gone (client.py). Any answer will do,
        a 400 while requests run included. No answer: `EngineError`, and the tags stay unsettled."""
        if not self._unsettled:
            return
        try:
            self._send("POST", "/flush_cache")
        except EngineError as exc:
            tags = ", ".join(sorted(self._unsettled))
            raise EngineError(self.name, f"cannot settle the unanswered call on {tags}: {exc.reason}") from exc
        for releases in (True, False):
            self._record({tag for tag, r in self._unsettled.items() if r is releases}, releases=releases)
        self._unsettled.clear()
