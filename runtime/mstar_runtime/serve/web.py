"""FastAPI's names that route signatures use, or stand-ins where the `serve` extra is absent.

FastAPI resolves a route's annotations from the globals of the module that defines it, so a
route module imports these at its top (`from mstar_runtime.serve.web import Request`), not
inside its `register` function. Without FastAPI the stand-ins let every route module import
(the CLI and the tests that start no server import them); no route is registered then, so no
stand-in is ever called as FastAPI's own would be, except `Query`, which returns its default.
"""

from __future__ import annotations

from typing import Any

try:
    from fastapi import File, Form, Query, Request, UploadFile, WebSocket
    from fastapi.responses import StreamingResponse
except ImportError:  # pragma: no cover - without the `serve` extra the modules only have to import
    Request = UploadFile = WebSocket = StreamingResponse = object  # type: ignore[assignment,misc]
    File = Form = None  # type: ignore[assignment]

    def Query(default: Any = None, **_: Any) -> Any:  # type: ignore[no-redef]  # noqa: N802 - stands in for FastAPI's
        return default

__all__ = ["File", "Form", "Query", "Request", "StreamingResponse", "UploadFile", "WebSocket"]
