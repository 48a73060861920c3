"""Chat templates on `/v1/chat/completions` (issue 17 section 2; serve/chat_template.py).

- Parity: a checkpoint folder's template renders exactly as transformers' tokenizer renders it
  (`AutoTokenizer.from_pretrained(folder).apply_chat_template(..., tokenize=False,
  add_generation_prompt=True)`): ChatML with a default system prompt, a Llama-3-style template
  using `bos_token`, `namespace`, `loop` controls, `tojson`, `strftime_now`, `{% generation %}` and
  blocks whose whitespace only trim_blocks / lstrip_blocks remove;
  `chat_template.jinja` wins over `tokenizer_config.json`; named templates use "default".
- Which walks: the test family's chat walk (its prompt node asks for a template) gets its
  bundled one, or the checkpoint's; Qwen3-Omni's chat / speech and BAGEL's chat / understand
  (their prompt nodes format the prompt themselves) get none, even beside a checkpoint template.
- Errors: a template that raises is a 400 `chat_template_error` naming it (over HTTP too); one
  that does not compile stops the server's start with a message naming the file.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mstar_runtime.serve.chat_template import ChatTemplateError, compile_template, read_folder, template_for
from mstar_runtime.serve.common import ApiError

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "models/mstar_models/qwen3_omni/tokenizer_tiny.json"

CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_LIKE = """{{- bos_token }}
{%- set ns = namespace(turns=0, last=none) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "Today is " + strftime_now("%Y") + "." %}
{%- endif %}
<|start_header_id|>system<|end_header_id|>

{{ system }}<|eot_id|>
{%- for message in messages %}
    {%- if message['role'] == ns.last %}
        {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- set ns.last = message['role'] %}
    {%- if message['role'] == 'tool' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] | trim }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim }}
    {%- endif %}
    {%- if message.name is defined %}{{ ' (' + message.name + ')' }}{% endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{% for message in messages %}
    {% if message.name is defined %}
  named: {{ message.name }}
    {% endif %}
{% endfor %}
{{- '\\nmeta ' + {'turns': ns.turns, 'note': '<b>&"é"</b>'} | tojson }}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "  be brief "}, {"role": "user", "content": "hi", "name": "ann"},
     {"role": "assistant", "content": " hello! "}, {"role": "user", "content": "und jetzt? 你好 🎉"}],
]


def checkpoint(folder: Path, template: str | list[dict[str, str]] | None, jinja: str | None = None) -> Path:
    """A tokenizer folder as a checkpoint ships it: tokenizer.json, tokenizer_config.json, maybe chat_template.jinja."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                              "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return folder


def ours(folder: Path, messages: list[dict[str, str]]) -> str:
    found = read_folder(folder)
    assert found is not None
    found.compiled = compile_template(found.source, found.path)
    return found.render(messages)


def theirs(folder: Path, messages: list[dict[str, str]]) -> str:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("template", [CHATML, LLAMA_LIKE], ids=["chatml", "llama-like"])
def test_renders_as_transformers(tmp_path: Path, template: str) -> None:
    folder = checkpoint(tmp_path / "ckpt", template)
    for messages in CONVERSATIONS:
        want = theirs(folder, messages)
        assert ours(folder, messages) == want
    assert "<|endoftext|>" in ours(folder, CONVERSATIONS[0]) or template is CHATML  # bos_token reached it


def test_file_precedence_as_transformers(tmp_path: Path) -> None:
    both = checkpoint(tmp_path / "both", CHATML, jinja=LLAMA_LIKE)  # chat_template.jinja wins
    assert ours(both, CONVERSATIONS[1]) == theirs(both, CONVERSATIONS[1])
    assert ours(both, CONVERSATIONS[1]).startswith("<|endoftext|>")
    named = checkpoint(tmp_path / "named", [{"name": "tool_use", "template": LLAMA_LIKE},
                                            {"name": "default", "template": CHATML}])
    assert ours(named, CONVERSATIONS[0]) == theirs(named, CONVERSATIONS[0])
    assert read_folder(checkpoint(tmp_path / "none", None)) is None


# ----------------------------------------------------------------------------- errors
def test_a_template_that_raises_is_a_400_naming_it(tmp_path: Path) -> None:
    alternating = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    folder = checkpoint(tmp_path / "ckpt", LLAMA_LIKE)
    with pytest.raises(ApiError) as e:
        ours(folder, alternating)
    assert e.value.status == 400 and e.value.code == "chat_template_error" and e.value.param == "messages"
    assert "tokenizer_config.json" in e.value.message and "roles must alternate" in e.value.message
    for bad in ("{{ namespace(_x=1) }}", "{{ 1 + 'a' }}", "{{ messages.__class__.__mro__[1].__subclasses__() }}"):
        sandbox = checkpoint(tmp_path / "sandbox", None, jinja=bad)
        with pytest.raises(ApiError) as e:
            ours(sandbox, CONVERSATIONS[0])
        assert e.value.status == 400 and "chat_template.jinja" in e.value.message


def test_a_template_that_does_not_compile_names_its_file(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "ckpt", "{% for m in messages %}{{ m.content }")
    found = read_folder(folder)
    assert found is not None
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json.*does not compile"):
        compile_template(found.source, found.path)
    (folder / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="cannot read"):
        read_folder(folder)


# ----------------------------------------------------------------------------- which walks
def _compile(walk: Path, out: Path) -> Any:
    from mstar_runtime.plan.loader import load_plan
    from mstarc.cli import main as mstarc

    plan = out / f"{walk.stem}.plan"
    assert mstarc(["compile", str(walk), "--variant", "tiny", "-p", str(ROOT / "placements/cpu.yaml"),
                   "-o", str(plan)]) == 0
    return load_plan(plan)


def test_which_walks_get_a_template(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "ckpt", CHATML)
    family = _compile(ROOT / "models/testfamily/testfamily.walk", tmp_path)
    bundled = template_for(family, "chat", "prompt", "init")
    assert bundled is not None and bundled.path.name == "chat_template_tiny.json"
    assert bundled.render(CONVERSATIONS[0]) == "<|user|>hello\n<|assistant|>"
    own = template_for(family, "chat", "prompt", ckpt)  # a checkpoint's template comes first
    assert own is not None and own.render(CONVERSATIONS[0]) == theirs(ckpt, CONVERSATIONS[0])
    # their prompt nodes build the prompt themselves: plain text, even beside a checkpoint template
    for walk, names in ((ROOT / "models/qwen3_omni/qwen3_omni.walk", (("chat", "prompt"), ("speech", "prompt"))),
                        (ROOT / "models/bagel/bagel.walk", (("chat", "prompt"), ("understand", "question")))):
        plan = _compile(walk, tmp_path)
        for name, text_input in names:
            assert template_for(plan, name, text_input, ckpt) is None, (walk.stem, name)


# ----------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def family_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_server_support import compile_plan

    return compile_plan(tmp_path_factory.mktemp("chat_template"))


def _app(plan: Path, weights: str | Path) -> Iterator[Any]:
    from mstar_runtime.api import MStar
    from mstar_runtime.serve.server import ServeConfig, create_app

    m = MStar.load(plan, weights="init")
    try:
        yield create_app(m, ServeConfig(weights=str(weights)))
    finally:
        done = threading.Event()
        threading.Thread(target=lambda: (m.close(), done.set()), daemon=True).start()
        assert done.wait(30)


def _chat(app: Any, messages: list[dict[str, str]]) -> Any:
    httpx = pytest.importorskip("httpx")

    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await c.post("/v1/chat/completions", json={"model": "testfamily", "messages": messages,
                                                                "max_tokens": 3})
    return asyncio.run(go())


def test_chat_route_renders_the_bundled_template(family_plan: Path) -> None:
    pytest.importorskip("fastapi")
    for app in _app(family_plan, "init"):
        r = _chat(app, [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "é?"}])
        assert r.status_code == 200, r.text
        prompt = "<|system|>be brief\n<|user|>hi\n<|assistant|>yo\n<|user|>é?\n<|assistant|>"  # developer: system
        assert r.json()["usage"]["prompt_tokens"] == 1 + len(prompt.encode())  # the byte-level node: [bos] + bytes


def test_chat_route_answers_a_refusing_template_with_a_400(family_plan: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    strict = ("{% for m in messages %}{% if not loop.first and m.role == messages[loop.index0 - 1].role %}"
              "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}")
    folder = checkpoint(tmp_path / "ckpt", strict)
    for app in _app(family_plan, folder):
        r = _chat(app, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "chat_template_error" and err["param"] == "messages"
        assert "the checkpoint's tokenizer_config.json" in err["message"] and str(tmp_path) not in err["message"]
        assert _chat(app, CONVERSATIONS[0]).status_code == 200
