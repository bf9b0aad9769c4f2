"""One SGLang server over HTTP: the session, its retries, client spans, and SGLang's error shapes.

One `requests.Session` per server, with urllib3 `Retry` on its adapter: connection failures are
retried a few times with backoff (the request never reached the server, so this is safe for POSTs);
502/503/504 are retried for GETs only; a read timeout is never retried, since SGLang may have
applied the call. An unreachable URL raises `EngineError` naming it within a few seconds.

A request that failed before the server got it (no connection: refused, unroutable, connect
timeout) raises `EngineError`; one that was sent and got no answer (a read timeout, the connection
dropped after sending) raises its subclass `Unanswered`: the server may have applied it.

Every POST is a client span `sglang POST <path>` with OpenTelemetry's HTTP client attributes,
`server.address` (the host), `server.port`, `url.full`, `http.response.status_code` (GETs are
queries the lifecycle makes around every transition, and have none). While tracing is on, every
request, GETs included, carries the W3C `traceparent` header of the current span (SGLang started
with `--enable-trace` continues the trace); with tracing off there is no context and no header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import requests
from opentelemetry import propagate, trace
from requests.adapters import HTTPAdapter
from urllib3.exceptions import NewConnectionError
from urllib3.util.retry import Retry

from orchestrator.errors import EngineError
from orchestrator.telemetry import semconv


def _session(retries: int) -> requests.Session:
    retry = Retry(
        total=retries,
        connect=retries,
        read=0,  # the server may have applied the call
        status=retries,
        status_forcelist=(502, 503, 504),
        allowed_methods=frozenset({"GET"}),  # statuses: retry reads only
        backoff_factor=0.2,
        raise_on_status=False,
    )
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _message(response: requests.Response) -> str:
    """The error text of any SGLang error shape: {success, message}, {error: {message}}, {message}, text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)


class Unanswered(EngineError):
    """The request was sent and no answer came (read timeout, connection dropped): the server may
    have applied it. Its plain `EngineError` siblings failed before the server got the request."""


def _sent(exc: requests.RequestException) -> bool:
    """Whether the request left this process before it failed: every failure but a connection that
    never opened (urllib3 retries those, then wraps the last `NewConnectionError` or connect timeout)."""
    if isinstance(exc, requests.ConnectTimeout):
        return False
    if isinstance(exc, requests.ConnectionError):
        reason = exc.args[0] if exc.args else None
        cause = getattr(reason, "reason", reason)  # MaxRetryError.reason: the last attempt's error
        return not isinstance(cause, NewConnectionError)
    return True


class SGLangHTTP:
    """Requests to one SGLang server; `name` is its URL.

    Timeouts: `connect_timeout_s` for the TCP connect, `read_timeout_s` for an answer.
    """

    def __init__(
        self, url: str, *, connect_timeout_s: float = 3.0, read_timeout_s: float = 600.0, retries: int = 2
    ) -> None:
        self.name = url.rstrip("/")
        self._timeout = (connect_timeout_s, read_timeout_s)
        self._session = _session(retries)
        parts = urlsplit(self.name)  # OTel HTTP client conventions: the host alone, the port apart
        self._server_attributes: dict[str, str | int] = {
            "server.address": parts.hostname or "",
            "server.port": parts.port or (443 if parts.scheme == "https" else 80),
        }

    def close(self) -> None:
        self._session.close()

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> requests.Response:
        """One request. A POST (an action) is a client span; a GET (a query the lifecycle makes
        around every transition) is not, as it would bury the work."""
        if method == "GET":
            return self._request(method, path, body)
        attributes = {**self._server_attributes, "url.full": self.name + path, "http.request.method": method}
        with trace.get_tracer(semconv.TRACER).start_as_current_span(
            f"sglang {method} {path.split('?', 1)[0]}", kind=trace.SpanKind.CLIENT, attributes=attributes
        ) as span:
            response = self._request(method, path, body)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None) -> requests.Response:
        headers: dict[str, str] = {}
        propagate.inject(headers)
        try:
            return self._session.request(method, self.name + path, json=body, headers=headers, timeout=self._timeout)
        except requests.RequestException as exc:
            error = Unanswered if _sent(exc) else EngineError
            raise error(self.name, f"{method} {path}: {self._unreachable(exc)}") from exc

    def _unreachable(self, exc: requests.RequestException) -> str:
        """Why no answer came, in a few words (urllib3's own text repeats the URL and the retries)."""
        if isinstance(exc, requests.ConnectTimeout):
            return f"unreachable: no connection within {self._timeout[0]:g} s"
        if isinstance(exc, requests.ReadTimeout):
            return f"no answer within {self._timeout[1]:g} s"
        errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(exc))
        return f"unreachable: {errno.group(1).strip()}" if errno else f"{type(exc).__name__}: {exc}"

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """Send; raise EngineError on an HTTP error or `success: false`; return the JSON body (or None)."""
        response = self._send(method, path, body)
        if response.status_code >= 400:
            raise EngineError(
                self.name, f"{path}: HTTP {response.status_code}: {_message(response)}", response.status_code
            )
        try:
            result = response.json() if response.content else None
        except ValueError:
            return response.text
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(self.name, f"{path}: {result.get('message', 'success=false')}")
        return result
