"""Chat templates for `/v1/chat/completions`: the conversation rendered as the checkpoint's
tokenizer would render it (transformers' `apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)`).

Which walks. Only a walk whose prompt node (the node whose phase first takes the walk's text
input, as `serve.text` finds it) declares `server_chat_template = True` on its class gets a
rendered conversation. Other prompt nodes build the model's prompt themselves from plain text
(Qwen3-Omni's processor renders the checkpoint's template around `prompt` / `system`; BAGEL's
tokenizer wraps the text in its own `<|im_start|> ... <|im_end|>` segment), so rendering a
template first would format the prompt twice: those walks keep the plain-text rule of
`serve.chat.render_prompt`.

Which template, for such a walk: in the weights folder (the server's `--weights`), its
`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates: the one named "default"); without one (random or `init` weights, a folder
without a template) the file the node's class names as `bundled_chat_template` (the same
JSON shape as `tokenizer_config.json`); else none, and the plain-text rule applies. Special
tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
`mask_token`) are read from the same JSON file and passed to the template by name.

Environment, as transformers sets it up (the same facts, written here): a sandboxed,
immutable jinja2 environment with `trim_blocks`, `lstrip_blocks` and loop controls; a
`tojson` filter that does not escape HTML; globals `raise_exception(message)` (the template
refusing a conversation), `strftime_now(format)`, a `dict` that only builds dicts, and a
`namespace` that refuses underscore-prefixed names; `{% generation %}` blocks render their
body. jinja2 3.1.6 or later (older ones have sandbox escapes). jinja2 is imported only when a
template is found, so the runtime's modules import without it.

Messages. Each message is `{"role", "content"}` with `name` when the client gave one: the
content is its text parts joined (media parts go to the walk's own inputs, as without a
template); `developer` is passed as `system` (templates predate that role); system messages
stay in the conversation. The template renders with `add_generation_prompt=True`,
`tools=None`, `documents=None` and the special tokens. A template that raises (its own
`raise_exception`, a sandbox violation, any error) answers the request with a 400
`chat_template_error` naming the template; one that cannot be read or compiled fails the
server's start (`ChatTemplateError`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from os import PathLike
from pathlib import Path
from typing import Any

from mstar_runtime.plan.loader import Plan
from mstar_runtime.serve.common import bad_request

log = logging.getLogger("mstar_runtime.serve.server")

OPT_IN = "server_chat_template"  # a prompt-node class attribute: True to get a rendered conversation
BUNDLED = "bundled_chat_template"  # a prompt-node class attribute: a JSON file with `chat_template`
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MIN_JINJA = (3, 1, 6)


class ChatTemplateError(Exception):
    """A chat template that cannot be read or compiled (the message names the file)."""


@dataclass
class ChatTemplate:
    """One compiled chat template and what it renders with."""

    name: str  # how errors name it: "the checkpoint's chat_template.jinja", ...
    path: Path
    source: str
    tokens: dict[str, str] = field(default_factory=dict)
    compiled: Any = None

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The conversation as the model's prompt; a 400 naming the template if it refuses."""
        try:
            text = self.compiled.render(messages=[dict(m) for m in messages], add_generation_prompt=True,
                                        tools=None, documents=None, **self.tokens)
        except Exception as e:  # the template is code: whatever it raises is its refusal of these messages
            raise bad_request(f"the chat template ({self.name}) refused these messages: {type(e).__name__}: {e}",
                              "messages", "chat_template_error") from None
        return str(text)


# ------------------------------------------------------------------------------ finding one
def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ChatTemplateError(f"cannot read '{path}': {e}") from None
    if not isinstance(value, dict):
        raise ChatTemplateError(f"'{path}' is not a JSON object")
    return value


def _template_of(config: Mapping[str, Any], path: Path) -> str | None:
    """`chat_template` of a tokenizer config: a string, or the "default" of a list of named ones."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]  # type: ignore[no-any-return]
        raise ChatTemplateError(f"'{path}' has named chat templates ({', '.join(map(str, named))}) but none "
                                "named 'default'")
    raise ChatTemplateError(f"'{path}': chat_template is a {type(value).__name__}, not a string")


def _tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens (a string, or an added token's `content`)."""
    out: dict[str, str] = {}
    for key in SPECIAL_TOKENS:
        v = config.get(key)
        if isinstance(v, Mapping):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


def read_folder(folder: Path) -> ChatTemplate | None:
    """A checkpoint folder's template (`chat_template.jinja`, else `tokenizer_config.json`'s), or None."""
    config_path = folder / CONFIG_FILE
    config = _json(config_path) if config_path.is_file() else {}
    jinja_path = folder / TEMPLATE_FILE
    if jinja_path.is_file():
        try:
            source = jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read '{jinja_path}': {e}") from None
        return ChatTemplate(f"the checkpoint's {TEMPLATE_FILE}", jinja_path, source, _tokens(config))
    source = _template_of(config, config_path)
    if source is None:
        return None
    return ChatTemplate(f"the checkpoint's {CONFIG_FILE}", config_path, source, _tokens(config))


def read_bundled(path: Path) -> ChatTemplate:
    config = _json(path)
    source = _template_of(config, path)
    if source is None:
        raise ChatTemplateError(f"'{path}' has no chat_template")
    return ChatTemplate(f"the bundled {path.name}", path, source, _tokens(config))


def prompt_node_class(plan: Plan, walk: str, text_input: str) -> type | None:
    """The class of the node whose phase first takes `text_input` in `walk`, or None."""
    from mstar_runtime.media import first_call_on
    from mstar_runtime.plan.loader import PlanError
    from mstar_runtime.weights import _import_impl

    call = first_call_on(plan.walk(walk), text_input)
    if call is None:
        return None
    try:
        return _import_impl(plan, plan.node(call["node"]))
    except PlanError:  # the engine loaded this plan, so this does not happen; without it: no template
        return None


def template_for(plan: Plan, walk: str, text_input: str, weights: str | PathLike[str]) -> ChatTemplate | None:
    """The compiled template the chat route renders `walk`'s conversations with, or None for the
    plain-text rule (module docstring). ChatTemplateError for one that cannot be used."""
    cls = prompt_node_class(plan, walk, text_input)
    if cls is None or getattr(cls, OPT_IN, False) is not True:
        return None
    folder = Path(weights)
    found = read_folder(folder) if folder.is_dir() else None
    if found is None and getattr(cls, BUNDLED, None) is not None:
        found = read_bundled(Path(getattr(cls, BUNDLED)))
    if found is None:
        log.info("chat walk '%s': no chat template (weights '%s'); prompts follow the role: text rule", walk, weights)
        return None
    found.compiled = compile_template(found.source, found.path)
    log.info("chat walk '%s': conversations rendered with %s ('%s')", walk, found.name, found.path)
    return found


# ------------------------------------------------------------------------------ the environment
def compile_template(source: str, path: Path | str) -> Any:
    """`source` compiled in the environment of the module docstring; ChatTemplateError naming `path`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    have = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if have < MIN_JINJA:
        raise ChatTemplateError(f"chat templates need jinja2 >= {'.'.join(map(str, MIN_JINJA))} (older versions "
                                f"have sandbox escapes); this is {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it; rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        """jinja2's `namespace`, refusing names that reach for Python internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's own signature trick: `namespace(self=1)` works
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} on a namespace")

    class DictMaker:
        """`dict(...)` and `dict.fromkeys(...)`, nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=DictMaker(),
                       namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template in '{path}' does not compile: {e}") from None


__all__ = ["BUNDLED", "OPT_IN", "ChatTemplate", "ChatTemplateError", "compile_template", "prompt_node_class",
           "read_bundled", "read_folder", "template_for"]
