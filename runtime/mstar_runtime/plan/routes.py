"""The OpenAI routes a walk can serve, and the rule that says whether a walk fits one.

A walk declares the routes it serves in its `.walk` file (`serves speech(input = text)`,
docs/walk-language.md "Routes"); the plan carries each declaration as `walks[w].routes`
(`[{"route", "bind"}]`, docs/plan-format.md). A route has named *slots*: the walk input a
request field goes to (speech's `input`, the text to speak), the walk output the response
is made of (speech's `audio`), or a string the route sends (speech's `preamble`). `bind`
names, per slot, the walk's input or output (or the string); a slot left out of `bind` takes
the walk's input (output) of the slot's own name when the walk has one, a required slot
always, an optional one only when that input (output) fits it (`resolve`).

One rule for both sides: the compiler reports a declaration that does not fit as a
diagnostic at its slot (mstarc/routes.py), and the server refuses, at load, a plan whose
walk does not fit a route it declares (`serve/state.py`), naming the walk and the route.
No model is named here: which walk serves what is the walk's declaration. Torch-free (the
compiler imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FLOATS = ("f32", "f16", "bf16")
INTS = ("i32", "i64")


def _tensor(t: Mapping[str, Any], dtypes: tuple[str, ...], rank: int | None = None) -> bool:
    return t.get("kind") == "tensor" and t.get("dtype") in dtypes and (rank is None or len(t.get("dims") or ()) == rank)


# what a slot accepts: (test of a declared input or output, the words an error uses)
Accepts = tuple[Callable[[Mapping[str, Any]], bool], str]
_STR: Accepts = (lambda p: p["type"]["kind"] == "str", "a str input")
_FLOAT: Accepts = (lambda p: p["type"]["kind"] == "float", "a float input")
_BOOL: Accepts = (lambda p: p["type"]["kind"] == "bool", "a bool input")
_SAMPLES: Accepts = (lambda p: _tensor(p["type"], FLOATS, 1), "a float tensor input of rank 1 (audio samples)")
_PICTURE: Accepts = (lambda p: p["type"]["kind"] == "image" or (
    _tensor(p["type"], ("u8",), 3) and p["type"]["dims"][2] == 3), "an image input, or a u8[H, W, 3] tensor")
_IMAGE_IN: Accepts = (lambda p: p["type"]["kind"] == "image", "an image input")
_TEXT_STREAM: Accepts = (lambda p: p.get("mode") == "append" and (p["type"]["kind"] == "str" or _tensor(
    p["type"], INTS)), "an appended output (emit +=) of str or an int tensor (token ids)")
_AUDIO_STREAM: Accepts = (lambda p: p.get("mode") == "append" and _tensor(p["type"], FLOATS),
                          "an appended output (emit +=) of a float tensor (audio samples)")
_IMAGE_OUT: Accepts = (lambda p: p["type"]["kind"] == "image" or (
    p["type"]["kind"] == "tensor" and len(p["type"].get("dims") or ()) in (2, 3)),
    "an image output, or a tensor of rank 2 or 3")
_STR_OUT: Accepts = (lambda p: p["type"]["kind"] == "str", "a str output")
_TOKENS_OUT: Accepts = (lambda p: p.get("mode") == "append" and _tensor(p["type"], INTS),
                        "an appended output (emit +=) of an int tensor (token ids)")


@dataclass(frozen=True)
class Slot:
    name: str
    side: str  # "input", "output" or "string" (a string the route sends)
    accepts: Accepts | None  # None for a string
    required: bool = False
    needs: str | None = None  # another slot that must be bound with this one
    doc: str = ""


@dataclass(frozen=True)
class Route:
    name: str
    paths: tuple[str, ...]
    slots: tuple[Slot, ...]

    def slot(self, name: str) -> Slot | None:
        return next((s for s in self.slots if s.name == name), None)


def _in(name: str, accepts: Accepts, doc: str, required: bool = False, needs: str | None = None) -> Slot:
    return Slot(name, "input", accepts, required, needs, doc)


def _out(name: str, accepts: Accepts, doc: str, required: bool = False) -> Slot:
    return Slot(name, "output", accepts, required, None, doc)


ROUTES: dict[str, Route] = {r.name: r for r in (
    Route("speech", ("/v1/audio/speech",), (
        _in("input", _STR, "the text to speak", required=True),
        _out("audio", _AUDIO_STREAM, "the speech", required=True),
        _in("voice", _STR, "the request's `voice`"),
        _in("instructions", _STR, "the request's `instructions` (after the preamble)"),
        Slot("preamble", "string", None, needs="instructions",
             doc="a text sent to `instructions` before the request's own"),
        _out("transcript", _TEXT_STREAM, "the text the walk says it spoke (a spoken chat reply's transcript)"),
    )),
    Route("chat", ("/v1/chat/completions",), (
        _in("prompt", _STR, "the conversation, rendered", required=True),
        _out("text", _TEXT_STREAM, "the reply", required=True),
        _in("system", _STR, "system and developer messages, when no chat template renders them"),
        _in("image", _PICTURE, "an `image_url` part"),
        _in("input_audio", _SAMPLES, "an `input_audio` part, resampled to the rate the walk reads"),
        _out("audio", _AUDIO_STREAM, "the spoken reply (`modalities: [\"text\", \"audio\"]`)"),
        _in("voice", _STR, "`audio.voice` of a spoken reply", needs="audio"),
        _in("history", _STR, "the conversation's earlier turns as JSON, for a walk that renders them itself "
                             "(their clips at the front of `input_audio`: Qwen3-Omni's; /v1/realtime)"),
    )),
    Route("image_generations", ("/v1/images/generations",), (
        _in("prompt", _STR, "the request's `prompt`", required=True),
        _out("image", _IMAGE_OUT, "the image", required=True),
    )),
    Route("image_edits", ("/v1/images/edits",), (
        _in("prompt", _STR, "the form's `prompt`", required=True),
        _in("image", _IMAGE_IN, "the form's `image`", required=True),
        _out("output", _IMAGE_OUT, "the edited image", required=True),
    )),
    *(Route(name, (f"/v1/audio/{name}",), (
        _in("file", _SAMPLES, "the form's `file`, as 16 kHz samples", required=True),
        _out("tokens", _TOKENS_OUT, "the transcript's token ids, streamed (`stream=true`)", required=True),
        _out("text", _STR_OUT, "the transcript (without it: its ids, detokenized)"),
        _in("language", _STR, "the form's `language`"),
        _in("prompt", _STR, "the form's `prompt`"),
        _in("temperature", _FLOAT, "the form's `temperature`"),
        _in("timestamps", _BOOL, "true for the segment formats (srt, vtt, verbose_json)"),
        _out("segments", _STR_OUT, "the timed segments, as a JSON list"),
        _out("detected_language", _STR_OUT, "`language` of verbose_json"),
    )) for name in ("transcriptions", "translations")),
)}


@dataclass(frozen=True)
class Served:
    """One route a walk serves, its slots resolved to the walk's names (or strings)."""

    walk: str
    route: str
    slots: Mapping[str, str]


class RouteMisfit(Exception):
    """A walk does not fit a route it declares; the message names both."""


Problem = tuple[str, str, str]  # (slot or "", kind: "route" | "bind" | "type", message)


def resolve(walk: str, program: Mapping[str, Any], decl: Mapping[str, Any]) -> tuple[Served | None, list[Problem]]:
    """`decl` ({"route", "bind"}) against the walk's typed `inputs`/`outputs` (as in a plan):
    the resolved slots, or None, and the problems: (slot or "", kind, message), kind "route"
    (no such route), "bind" (a slot unknown, unbound or bound to no such name) or "type"."""
    route = ROUTES.get(decl.get("route", ""))
    if route is None:
        return None, [("", "route", f"unknown route '{decl.get('route')}'; routes: {', '.join(ROUTES)}")]
    bind: Mapping[str, str] = decl.get("bind") or {}
    sides = {"input": {p["name"]: p for p in program["inputs"]}, "output": {p["name"]: p for p in program["outputs"]}}
    problems: list[tuple[str, str]] = []
    slots: dict[str, str] = {}
    for name in bind:
        if route.slot(name) is None:
            problems.append((name, "bind", f"route '{route.name}' has no slot '{name}'; its slots: "
                                   f"{', '.join(s.name for s in route.slots)}"))
    for s in route.slots:
        given = bind.get(s.name)
        if s.side == "string":
            if given is not None:
                slots[s.name] = given
            continue
        params = sides[s.side]
        target = given if given is not None else (s.name if s.name in params else None)
        if target is None:
            if s.required:
                problems.append((s.name, "bind", f"slot '{s.name}' ({s.doc}) is not bound and the walk has no {s.side} "
                                         f"'{s.name}'; bind it: {s.name} = <{s.side}>"))
            continue
        param = params.get(target)
        if param is None:
            problems.append((s.name, "bind", f"slot '{s.name}' names '{target}', which is not an {s.side} of walk '{walk}' "
                                     f"({', '.join(params) or 'none'})"))
            continue
        assert s.accepts is not None
        test, words = s.accepts
        if not test(param) and given is None and not s.required:
            continue  # an optional slot is not bound to a same-named input or output that does not fit it
        if not test(param):
            how = "" if given is not None else f" (bound by its name: bind {s.name} = <{s.side}> to choose another)"
            problems.append((s.name, "type", f"slot '{s.name}' ({s.doc}) wants {words}; {s.side} '{target}' is "
                                     f"{describe(param)}{how}"))
            continue
        slots[s.name] = target
    for s in route.slots:
        if s.name in slots and s.needs is not None and s.needs not in slots:
            problems.append((s.name, "bind", f"slot '{s.name}' needs slot '{s.needs}' bound too"))
    return (Served(walk, route.name, slots) if not problems else None), problems


def describe(p: Mapping[str, Any]) -> str:
    """An input or output's type (and mode) in the words of the language: `f32[S]`, appended."""
    t = p["type"]
    text = f"{t['dtype']}[{', '.join(str(d) for d in t.get('dims') or ())}]" if t["kind"] == "tensor" else t["kind"]
    return text + (f" ({'appended' if p['mode'] == 'append' else 'set'})" if "mode" in p else "")


def conflicts(served: Iterable[Served], takes_image: Callable[[Served], bool]) -> list[tuple[Served, str]]:
    """Routes served twice where a request could not tell which walk it is for: every route
    but chat by one walk; chat by at most one walk with `audio` (spoken replies), and of the
    others at most one with an `image` slot and one without. `takes_image(s)`: whether `s`'s
    walk takes an image (its `image` slot is bound). Each problem names the later walk."""
    seen: dict[tuple[str, str], Served] = {}
    out: list[tuple[Served, str]] = []
    for s in served:
        if s.route != "chat":
            key, what = (s.route, ""), ""
        elif "audio" in s.slots:
            key, what = ("chat", "audio"), " with spoken replies (slot audio)"
        elif takes_image(s):
            key, what = ("chat", "image"), " with an image (slot image)"
        else:
            key, what = ("chat", "text"), " for text only (no image slot)"
        first = seen.setdefault(key, s)
        if first is not s:
            out.append((s, f"route '{s.route}'{what} is served by walk '{first.walk}' already; a request could not "
                           f"tell which of '{first.walk}' and '{s.walk}' answers it"))
    return out


def served_routes(walks: Mapping[str, Mapping[str, Any]]) -> list[Served]:
    """Every route the plan's walks declare, resolved, in walk-name order; `RouteMisfit` for
    the first declaration that does not fit (or a route served twice), naming walk and route."""
    served: list[Served] = []
    for walk in sorted(walks):
        for decl in walks[walk].get("routes") or ():
            s, problems = resolve(walk, walks[walk], decl)
            if s is None:
                _, _, message = problems[0]
                raise RouteMisfit(f"walk '{walk}' cannot serve route '{decl.get('route')}'"
                                  f"{_paths(decl.get('route'))}: {message}")
            served.append(s)
    clash = conflicts(served, lambda s: "image" in s.slots)
    if clash:
        s, message = clash[0]
        raise RouteMisfit(f"walk '{s.walk}' cannot serve route '{s.route}'{_paths(s.route)}: {message}")
    return served


def _paths(route: Any) -> str:
    r = ROUTES.get(route) if isinstance(route, str) else None
    return f" ({', '.join(r.paths)})" if r is not None else ""


__all__ = ["ROUTES", "Route", "RouteMisfit", "Served", "Slot", "conflicts", "describe", "resolve", "served_routes"]
