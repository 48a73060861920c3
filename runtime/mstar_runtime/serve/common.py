"""What every HTTP route shares: OpenAI-style errors (a request in flight is serve/flight.py's `Flight`).

Every failure a client can cause or see is an `ApiError`: an HTTP status and the
OpenAI body `{"error": {"message", "type", "param", "code"}}`, where `param` names the
request field at fault in the route's own vocabulary (`messages`, `input`, `inputs.prompt`),
not the walk's port names. `submit_error` maps what `MStar.submit` raises and
`failure_error` what a request that already ran ended with (`RequestFailed`). What is not
the client's business stays in the server log: a dead engine or a lost worker reaches
clients as one stable message (`ENGINE_STOPPED`, `ENGINE_PROCESS_STOPPED`, `WORKER_LOST`), never with the worker's
pid, exit status and stderr or the transport's source paths, peer addresses and ports; an
internal error (a node bug) as a message naming only the request id.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

from mstar_runtime.api import EngineClosed, RequestFailed
from mstar_runtime.ops.node import RequestError
from mstar_runtime.plan.loader import UnknownWalk

INVALID = "invalid_request_error"
SERVER = "server_error"
NOT_FOUND = "not_found_error"

# what clients are told about a dead engine or worker (`ServerState.engine_problem`)
ENGINE_STOPPED = "the engine thread stopped"
ENGINE_PROCESS_STOPPED = "the engine process stopped"  # --engine-process: the child process died
WORKER_LOST = "a worker process was lost"

log = logging.getLogger("mstar_runtime.serve.server")


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The OpenAI error body; text the client sent that is not valid Unicode (a lone
        surrogate in an unknown key it echoes) is escaped, so the body can always be encoded."""
        return {"error": {"message": _printable(self.message), "type": self.type,
                          "param": None if self.param is None else _printable(self.param), "code": self.code}}


def _printable(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


class ClientGone(Exception):
    """The client closed its connection before the request ended."""


def api_key_digest(key: str) -> bytes:
    """What a presented API key is compared with: its SHA-256, so the constant-time comparison
    (`secrets.compare_digest`) does not depend on the key's length either."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def engine_unavailable(message: str) -> ApiError:
    """503 `engine_unavailable`: `message` holds only the stable words of `engine_problem`."""
    return ApiError(503, f"{message}; restart the server (the details are in its log)", type=SERVER,
                    code="engine_unavailable")


def submit_error(e: Exception, fields: Mapping[str, str], engine_problem: str | None = None) -> ApiError:
    """What `MStar.submit` raised, as the route's error. `fields` maps walk inputs to request fields."""
    if isinstance(e, UnknownWalk):
        return ApiError(404, str(e), type=NOT_FOUND, param="walk", code="walk_not_found")
    if isinstance(e, RequestError):
        return bad_request(str(e), fields.get(e.field or "", e.field))
    if isinstance(e, EngineClosed):  # its text is the engine's own (a traceback's last line): log only
        log.warning("a request was refused: the engine is closed (%s)", e)
        return engine_unavailable(f"the engine is not serving: {engine_problem or 'it is closed'}")
    raise e


def failure_error(e: RequestFailed, fields: Mapping[str, str], primary: str | None,
                  engine_problem: str | None, client_timeout: bool = False) -> ApiError:
    """A request that ended without its outputs, as an HTTP error.

    A node's `RequestError` (field set) is the client's fault: 400, naming the request field
    (a node port the client never named, such as the token list built from a prompt, is
    blamed on the route's `primary` field). The conductor's "can never fit" and a KV context
    that would outgrow its tag's `max_len` (an input longer than the walk allows, e.g. audio
    past a cross context's frames; no field: the API has no structured kind for them, so
    their wording is matched) are 413. Timeouts,
    shutdowns and a dead engine are 504/503 (a timeout the client chose itself is its 408);
    anything else is the server's fault, 500. Neither a 503 for a dead engine nor a 500
    carries the engine's message (see the module docstring): `Flight.error_for` logs it.
    """
    if e.finish_reason == "timeout":
        if client_timeout:
            return ApiError(408, f"{e.message} (the request's own timeout)", param="timeout", code="timeout")
        return ApiError(504, e.message, type=SERVER, code="timeout")
    if e.finish_reason == "shutdown":
        return ApiError(503, "the server shut down before the request finished", type=SERVER, code="shutdown")
    if e.finish_reason == "cancelled":
        return ApiError(499, e.message, type=SERVER, code="cancelled")
    if e.field is not None:
        return bad_request(e.message, fields.get(e.field, primary))
    if "can never fit" in e.message or "more than the max_len" in e.message:
        return ApiError(413, e.message, param=primary, code="request_too_large")
    if engine_problem is not None:
        return engine_unavailable(f"the engine failed while running the request: {engine_problem}")
    return ApiError(500, f"request {e.request_id} failed inside the engine (an internal error; the server "
                    "log has the details)", type=SERVER, code="internal_error")


__all__ = ["ENGINE_PROCESS_STOPPED", "ENGINE_STOPPED", "WORKER_LOST", "ApiError", "ClientGone", "api_key_digest",
           "bad_request", "engine_unavailable", "failure_error", "submit_error"]
