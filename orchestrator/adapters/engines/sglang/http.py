"""One SGLang server over HTTP: the session, its retries, client spans, and SGLang's error shapes.

One `requests.Session` per server, with urllib3 `Retry` on its adapter: connection failures are
retried a few times with backoff (the request never reached the server, so this is safe for POSTs);
502/503/504 are retried for GETs only; a read timeout is never retried, since SGLang may have
applied the call. An unreachable URL raises `EngineError` naming it within a few seconds.

A request that failed before the server got it (no connection: refused, unroutable, connect
timeout) raises `EngineError`; one that was sent and got no answer (a read timeout, the connection
dropped after sending) raises its subclass `Unanswered`: the server may have applied it.

Every POST is a client span `POST <path>`, as OpenTelemetry's HTTP client conventions name it
(`{method} {url.template}`), with their attributes: `server.address` (the host), `server.port`,
`url.full`, `url.template`, `http.request.method` and `http.response.status_code`. A call that
failed is an ERROR span with `error.type`: the status code of an HTTP error, else the qualified
name of the exception (a refused connection, a timeout, SGLang's `success: false`). GETs are
queries the lifecycle makes around every transition, and have no span. While tracing is on, every
request, GETs included, carries the W3C `traceparent` header of the current span (SGLang started
with `--enable-trace` continues the trace); with tracing off there is no context and no header.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import requests
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, Status, StatusCode
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

    @contextmanager
    def _client_span(self, method: str, path: str) -> Iterator[Span]:
        """A POST's client span (a GET, a query the lifecycle makes around every transition, has
        none: it would bury the work). A call that raised ends it as an ERROR with `error.type`."""
        if method == "GET":
            yield trace.INVALID_SPAN
            return
        template = path.split("?", 1)[0]
        attributes = {
            **self._server_attributes,
            "url.full": self.name + path,
            "url.template": template,
            "http.request.method": method,
        }
        with trace.get_tracer(semconv.TRACER).start_as_current_span(
            f"{method} {template}",
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except Exception as exc:
                if not (isinstance(exc, EngineError) and exc.status is not None):  # else: the status, set already
                    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
                    span.set_attribute("error.type", f"{type(cause).__module__}.{type(cause).__qualname__}")
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                raise

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> requests.Response:
        """One request, in its client span; an HTTP error status marks the span, not raised."""
        with self._client_span(method, path) as span:
            return self._request(method, path, body, span)

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None, span: Span) -> requests.Response:
        headers: dict[str, str] = {}
        propagate.inject(headers)
        try:
            response = self._session.request(
                method, self.name + path, json=body, headers=headers, timeout=self._timeout
            )
        except requests.RequestException as exc:
            error = Unanswered if _sent(exc) else EngineError
            raise error(self.name, f"{method} {path}: {self._unreachable(exc)}") from exc
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 400:  # the HTTP conventions: a 4xx or 5xx answer is a failed call
            span.set_attribute("error.type", str(response.status_code))
            span.set_status(Status(StatusCode.ERROR))
        return response

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
        with self._client_span(method, path) as span:
            return self._answer(path, self._request(method, path, body, span))

    def _answer(self, path: str, response: requests.Response) -> Any:
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
