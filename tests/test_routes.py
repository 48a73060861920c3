"""Route declarations (`serves` on a walk): what every model serves, how the plan carries it,
and the rule (`mstar_runtime.plan.routes`) the compiler and the server share.

The compiler's diagnostics for bad declarations are the cases of tests/negative/routes.walk.txt;
the server's refusal of a plan whose walk does not fit is in tests/test_server.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import compile_model

from mstar_runtime.plan import planfile
from mstar_runtime.plan.loader import load_plan
from mstar_runtime.plan.routes import ROUTES, RouteMisfit, resolve, served_routes
from mstarc.parser import parse
from mstarc.printer import format_model

ROOT = Path(__file__).resolve().parent.parent

# what each model's walks serve: (walk, route) -> the resolved slots
SERVED = {
    "orpheus": {("tts", "speech"): {"input": "text", "audio": "audio", "voice": "voice"}},
    "bagel": {("chat", "chat"): {"prompt": "prompt", "text": "text"},
              ("understand", "chat"): {"prompt": "question", "text": "text", "image": "image"},
              ("t2i", "image_generations"): {"prompt": "prompt", "image": "image"},
              ("edit", "image_edits"): {"prompt": "prompt", "image": "source", "output": "image"}},
    "qwen3_omni": {
        ("chat", "chat"): {"prompt": "prompt", "text": "text", "system": "system", "image": "image",
                           "input_audio": "audio", "history": "history"},
        ("speech", "speech"): {"input": "prompt", "audio": "audio_out", "voice": "speaker", "instructions": "system",
                               "preamble": "Read the user's message aloud exactly as it is written, word for word. "
                                           "Do not answer it, comment on it, translate it or add anything to it.",
                               "transcript": "text"},
        ("speech", "chat"): {"prompt": "prompt", "text": "text", "system": "system", "image": "image",
                             "input_audio": "audio", "audio": "audio_out", "voice": "speaker", "history": "history"}},
    "whisper": {(w, r): {"file": "audio", "text": "text", "tokens": "tokens", "language": "language",
                         "prompt": "prompt", "temperature": "temperature", "timestamps": "timestamps",
                         "segments": "segments", "detected_language": "language"}
                for w, r in (("transcribe", "transcriptions"), ("translate", "translations"))},
    "testfamily": {("chat", "chat"): {"prompt": "prompt", "text": "tokens"}},
    "pi05": {},
    "vjepa2": {},
}


@pytest.mark.parametrize("model", sorted(SERVED))
def test_every_model_declares_what_it_serves(model: str, tmp_path: Path) -> None:
    plan = load_plan(compile_model(tmp_path / "m.plan", model, "placements/cpu.yaml", variant="tiny"))
    got = {(s.walk, s.route): dict(s.slots) for s in served_routes(plan.walks)}
    assert got == SERVED[model]
    assert all(isinstance(plan.walk(w)["routes"], list) for w in plan.walks)  # every walk has the key


def test_plan_carries_the_declared_slots_only(tmp_path: Path) -> None:
    body = planfile.read(compile_model(tmp_path / "q.plan", "qwen3_omni", "placements/cpu.yaml", variant="tiny"))
    assert body["schema"]["minor"] >= 3
    assert body["walks"]["chat"]["routes"] == [{"route": "chat", "bind": {"input_audio": "audio"}}]
    assert [r["route"] for r in body["walks"]["speech"]["routes"]] == ["speech", "chat"]


def test_a_plan_before_routes_loads_with_none(tmp_path: Path) -> None:
    src = compile_model(tmp_path / "tf.plan", "testfamily", "placements/cpu.yaml", variant="tiny")
    body = planfile.read(src)
    body["schema"]["minor"] = 2
    for w in body["walks"].values():
        del w["routes"]
    planfile.write(tmp_path / "old.plan", body)
    plan = load_plan(tmp_path / "old.plan")
    assert all(plan.walk(w)["routes"] == [] for w in plan.walks) and served_routes(plan.walks) == []


def test_serves_prints_and_parses_back() -> None:
    for model in ("qwen3_omni", "bagel", "whisper"):
        m = parse((ROOT / f"models/{model}/{model}.walk").read_text(encoding="utf-8"), f"{model}.walk")
        text = format_model(m)
        assert "serves " in text and format_model(parse(text, "again.walk")) == text


def test_serves_is_not_a_reserved_name(tmp_path: Path) -> None:
    """`serves` is a keyword only after a walk's outputs: a node, port or input may be named so."""
    from mstarc.cli import main

    (tmp_path / "m.walk").write_text("""model m {
  variant real { }
  node serves : stateless = t.A { in serves : str out y : f32[2] phase serves(serves) -> (y) }
  walk serves(serves: str) -> (y: f32[2]) { y = serves.serves(serves = serves) emit y += y }
}
""")
    assert main(["check", str(tmp_path / "m.walk")]) == 0


# ------------------------------------------------------------------------------ the rule
def _walk(inputs: dict[str, dict], outputs: dict[str, tuple[dict, str]]) -> dict:
    return {"inputs": [{"name": n, "type": t, "default": None} for n, t in inputs.items()],
            "outputs": [{"name": n, "type": t, "mode": m} for n, (t, m) in outputs.items()]}


STR = {"kind": "str"}
AUDIO = {"kind": "tensor", "dtype": "f32", "dims": ["S"]}


def test_slots_bind_by_name_unless_bound() -> None:
    w = _walk({"text": STR, "voice": STR}, {"audio": (AUDIO, "append")})
    s, problems = resolve("tts", w, {"route": "speech", "bind": {"input": "text"}})
    assert problems == [] and s is not None and dict(s.slots) == {"input": "text", "audio": "audio", "voice": "voice"}


def test_misfits_name_the_slot_and_what_it_wants() -> None:
    w = _walk({"text": STR, "voice": {"kind": "int"}}, {"audio": (AUDIO, "set")})
    s, problems = resolve("tts", w, {"route": "speech", "bind": {"input": "text", "voice": "voice", "preamble": "x"}})
    assert s is None
    assert [(slot, kind) for slot, kind, _ in problems] == [("audio", "type"), ("voice", "type"), ("preamble", "bind")]
    assert "appended output (emit +=)" in problems[0][2] and "input 'voice' is int" in problems[1][2]
    assert problems[2][2] == "slot 'preamble' needs slot 'instructions' bound too"
    # unbound, an optional slot does not take a same-named input that does not fit it
    w = _walk({"text": STR, "voice": {"kind": "int"}}, {"audio": (AUDIO, "append")})
    s, problems = resolve("tts", w, {"route": "speech", "bind": {"input": "text"}})
    assert problems == [] and s is not None and "voice" not in s.slots


def test_served_routes_refuses_with_the_walk_and_route() -> None:
    w = _walk({"text": STR}, {"audio": (AUDIO, "append")})
    walks = {"a": {**w, "routes": [{"route": "speech", "bind": {"input": "text"}}]},
             "b": {**w, "routes": [{"route": "speech", "bind": {"input": "text"}}]}}
    with pytest.raises(RouteMisfit, match=r"walk 'b' cannot serve route 'speech' \(/v1/audio/speech\): .*walk 'a'"):
        served_routes(walks)
    with pytest.raises(RouteMisfit, match=r"walk 'a' cannot serve route 'tts': unknown route 'tts'"):
        served_routes({"a": {**w, "routes": [{"route": "tts", "bind": {}}]}})
    with pytest.raises(RouteMisfit, match=r"walk 'a' cannot serve route 'chat' .*slot 'prompt'"):
        served_routes({"a": {**w, "routes": [{"route": "chat", "bind": {}}]}})


def test_every_route_has_a_path_and_required_slots() -> None:
    for route in ROUTES.values():
        assert route.paths and all(p.startswith("/v1/") for p in route.paths)
        assert any(s.required and s.side == "input" for s in route.slots)
        assert any(s.required and s.side == "output" for s in route.slots)
        for s in route.slots:
            assert s.needs is None or route.slot(s.needs) is not None


def test_the_server_mounts_what_the_walks_declare(tmp_path: Path) -> None:
    """`serve.state.served_walks`: which walk each route (and each kind of chat request) goes to."""
    from mstar_runtime.serve.state import served_walks

    qwen = served_walks(load_plan(compile_model(tmp_path / "q.plan", "qwen3_omni", "placements/cpu.yaml")))
    assert (qwen.chat.walk, qwen.understand, qwen.t2i, qwen.transcriptions) == ("chat", None, None, None)
    assert (qwen.spoken.role.walk, qwen.spoken.role.output, qwen.spoken.transcript, qwen.spoken.voice) == (
        "speech", "audio_out", "text", "speaker")  # a spoken reply reads the audio; its text is the transcript
    assert (qwen.speech.role.text_input, qwen.speech.instructions) == ("prompt", "system")
    assert qwen.speech.preamble is not None and qwen.speech.preamble.startswith("Read the user's message aloud")
    bagel = served_walks(load_plan(compile_model(tmp_path / "b.plan", "bagel", "placements/cpu.yaml")))
    assert (bagel.chat.walk, bagel.understand.walk, bagel.understand.text_input) == ("chat", "understand", "question")
    assert (bagel.t2i.walk, bagel.edit.walk, bagel.edit.slots["image"], bagel.speech) == ("t2i", "edit", "source", None)
    whisper = served_walks(load_plan(compile_model(tmp_path / "w.plan", "whisper", "placements/cpu.yaml")))
    assert (whisper.transcriptions.walk, whisper.translations.walk, whisper.chat) == ("transcribe", "translate", None)
