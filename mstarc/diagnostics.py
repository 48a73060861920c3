"""Diagnostics: coded, positioned user errors, collected per phase and printed with a caret.

Every user error of the toolchain is a `Diagnostic` with a stable code (the catalogue is
docs/diagnostics.md, and `CODES` below), a message, a `Span` and an optional hint. A phase
collects all of its diagnostics in a `DiagnosticSink` and raises `CompileError` once at its
end, so the user sees every problem of the phase in one run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mstar_runtime import untrusted

# code -> short title. Stable: never renumber; retire a code rather than reuse it.
CODES: dict[str, str] = {
    # syntax (E00x)
    "E001": "syntax error: unexpected token",
    "E002": "syntax error: unexpected character",
    "E003": "syntax error: unexpected end of file",
    "E004": "file cannot be read",
    "E005": "nesting too deep",
    "E006": "input too large",
    # names and structure (E01x)
    "E010": "duplicate definition",
    "E011": "unknown name",
    "E012": "unknown node",
    "E013": "unknown port",
    "E014": "unknown phase",
    "E015": "unknown variant",
    "E016": "unknown KV tag",
    "E017": "unknown architecture",
    "E018": "unknown walk",
    "E019": "node not used by any walk (warning)",
    # config evaluation (E02x)
    "E020": "config value cannot be evaluated",
    "E021": "cyclic config reference",
    "E022": "checkpoint config reference fails",
    "E023": "bad architecture arguments",
    "E024": "bad engine kind",
    "E025": "value out of range",
    "E026": "bad node setting",
    # types (E03x)
    "E030": "port type mismatch",
    "E031": "bad type",
    "E032": "wrong number of results",
    "E033": "missing input",
    "E034": "value used before it is bound",
    "E035": "value flows between nodes without an edge",
    "E036": "walk output never produced",
    "E037": "value never used (warning)",
    "E039": "bad KV context read",
    # control structure (E04x)
    "E040": "loop without a bound",
    "E041": "dynamic loop without a stop flag",
    "E042": "bad loop clause",
    "E043": "assignment to an outer value without carry",
    "E044": "bad chunk policy",
    "E045": "conflicting bindings in parallel branches",
    "E046": "tag on a stateless node",
    "E047": "bad stream block",
    "E048": "bad transition",
    "E049": "acc outside a loop",
    # placement (E05x)
    "E050": "placement file is malformed",
    "E051": "rank out of range",
    "E052": "tensor parallel degree does not divide the model",
    "E053": "placement names an unknown node",
    "E054": "placement names an unknown walk or branch",
    "E055": "bad device",
    "E056": "KV context read on other ranks",
    "E057": "bad host layout",
    "E058": "tensor-parallel group spans hosts",
    "E059": "weights format the node cannot hold",
    # memory (E06x)
    "E060": "model does not fit the device",
    "E061": "KV pool too small",
    "E062": "weights do not match the checkpoint",
    # plan file (E07x)
    "E070": "plan file is corrupt",
    "E071": "unsupported plan version",
    "E072": "plan file too large",
    # routes (E08x)
    "E080": "unknown route",
    "E081": "bad route binding",
    "E082": "walk does not fit its route",
    "E083": "route served twice",
    # internal (E09x)
    "E090": "internal compiler error",
}


@dataclass(frozen=True, order=True)
class Span:
    """A region of a source file: 1-based line and column, end exclusive."""

    file: str
    line: int
    col: int
    end_line: int = 0
    end_col: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    @staticmethod
    def unknown(file: str = "<unknown>") -> Span:
        return Span(file, 0, 0, 0, 0)


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    span: Span
    hint: str | None = None
    severity: str = "error"

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"diagnostic code {self.code} is not in the catalogue")

    def header(self) -> str:
        return f"{self.span}: {self.severity}[{self.code}]: {self.message}"


class CompileError(Exception):
    """Raised at the end of a phase that found user errors; carries all of them, sorted."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.span, d.code, d.message))
        super().__init__("\n".join(d.header() for d in self.diagnostics))


class InternalError(Exception):
    """A compiler bug, not a user error: names the pass that failed."""

    def __init__(self, pass_name: str, message: str):
        self.pass_name = pass_name
        super().__init__(f"internal error in pass '{pass_name}': {message}")


@dataclass
class DiagnosticSink:
    """Collects the diagnostics of one phase; `check()` raises them together."""

    diagnostics: list[Diagnostic] = field(default_factory=list)

    def error(self, code: str, message: str, span: Span, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(code, message, span, hint))

    def warning(self, code: str, message: str, span: Span, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(code, message, span, hint, severity="warning"))

    def extend(self, other: Iterable[Diagnostic]) -> None:
        self.diagnostics.extend(other)

    @property
    def has_errors(self) -> bool:
        return any(d.severity == "error" for d in self.diagnostics)

    def check(self) -> None:
        if self.has_errors:
            raise CompileError(self.diagnostics)


def source_lines(text: str) -> list[str]:
    """The lines of a source as the parser counts them: split at newlines only (`splitlines`
    would also split at U+2028, a form feed or a vertical tab, which a comment may hold, and
    so shift every later line a diagnostic shows)."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


class SourceCache:
    """Source text by file name, so a diagnostic can echo its line; reads files lazily."""

    MAX_BYTES = 2 << 20

    def __init__(self) -> None:
        self._text: dict[str, list[str]] = {}

    def add(self, file: str, text: str) -> None:
        self._text[file] = source_lines(text)

    def line(self, file: str, line: int) -> str | None:
        if file not in self._text:
            try:  # at most what a source may hold (mstarc/limits.py), a regular file only
                data = untrusted.read_file(file, self.MAX_BYTES)
            except (OSError, untrusted.FileTooLarge):
                return None
            text = data.decode("utf-8", errors="replace").removeprefix("\ufeff")
            self.add(file, text.replace("\r\n", "\n").replace("\r", "\n"))
        lines = self._text[file]
        return lines[line - 1] if 1 <= line <= len(lines) else None


def spell_cycle(names: list[str]) -> str:
    """A cycle in a message, `a -> b -> a`; a long one shows its first and last names."""
    if len(names) <= 12:
        return " -> ".join(names)
    return " -> ".join(names[:5]) + f" -> ... ({len(names) - 9} more) -> " + " -> ".join(names[-4:])


MAX_SHOWN_LINE = 200  # longer source lines are shown as a window around the span


def render(diag: Diagnostic, sources: SourceCache) -> str:
    """`file:line:col: error[CODE]: message`, the source line, a caret under the span, the hint.
    Everything from the input is printed through `untrusted.printable`: a control character
    in a comment or a string shows as `\\x1b`, and the caret stays under its span."""
    out = [untrusted.printable(diag.header())]
    text = sources.line(diag.span.file, diag.span.line) if diag.span.line > 0 else None
    if text is not None:
        gutter = f"{diag.span.line:>4} | "
        start = max(diag.span.col, 1)
        width = 1
        if diag.span.end_line == diag.span.line and diag.span.end_col > diag.span.col:
            width = diag.span.end_col - diag.span.col
        if len(text) > MAX_SHOWN_LINE:  # a window of a very long line around the span
            first = max(0, min(start - 1 - MAX_SHOWN_LINE // 4, len(text) - MAX_SHOWN_LINE))
            cut = text[first:first + MAX_SHOWN_LINE]
            lead = "..." if first > 0 else ""
            text = lead + cut + ("..." if first + MAX_SHOWN_LINE < len(text) else "")
            start = start - first + len(lead)
            width = min(width, MAX_SHOWN_LINE)
        width = max(1, min(width, len(text) - start + 1))
        # columns count characters of the source; the caret is placed in the printed text
        shown = [untrusted.printable(part.expandtabs(4)) for part in
                 (text[:start - 1], text[start - 1:start - 1 + width], text[start - 1 + width:])]
        out.append(gutter + "".join(shown))
        out.append(" " * (len(gutter) - 2) + "| " + " " * len(shown[0]) + "^" * max(1, len(shown[1])))
    if diag.hint:
        out.append(untrusted.printable(f"  = hint: {diag.hint}"))
    return "\n".join(out)


def render_all(diags: Iterable[Diagnostic], sources: SourceCache) -> str:
    items = list(diags)
    body = "\n".join(render(d, sources) for d in items)
    n = sum(1 for d in items if d.severity == "error")
    return f"{body}\n{n} error{'s' if n != 1 else ''}"
