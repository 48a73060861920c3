"""The two errors of the node contract, apart so that every module of `ops/` can raise them.

`ops/node.py` re-exports both: nodes import them from there.
"""

from __future__ import annotations


class NodeError(Exception):
    """A node cannot build, load or run; the message names the node and the cause."""


class RequestError(Exception):
    """A request's input is unacceptable to a node (e.g. a prompt longer than the model allows).

    Fails that request only, with this message; never the batch or the worker.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


__all__ = ["NodeError", "RequestError"]
