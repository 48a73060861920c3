"""`mstar-run` end to end (subprocesses, as a user runs it) and `write_outputs` file formats."""

from __future__ import annotations

import io
import json
import os
import random
import stat
import subprocess
import sys
import threading
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from support import as_run

from mstar_runtime import cli
from mstar_runtime.api import MStar
from mstar_runtime.cli import main
from mstar_runtime.cli_inputs import parse_text
from mstar_runtime.ops.node import RequestError
from mstar_runtime.outputs import safe_name, write_outputs
from mstar_runtime.plan.loader import load_plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def m(testfamily_plan: Path) -> Iterator[MStar]:
    """The same plan in-process: dummy weights are seeded by name, so its outputs are the CLI's."""
    with MStar.load(testfamily_plan) as engine:
        yield engine


def mstar_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("mstar-run")  # the console script, where installed
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "mstar_runtime.cli"]
    # one intra-op thread: tiny steps, and a 2-core CI box running pytest beside it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def no_traceback(p: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr


def read_wav(path: Path) -> tuple[wave._wave_params, torch.Tensor]:
    with wave.open(str(path), "rb") as w:
        params = w.getparams()
        frames = w.readframes(params.nframes)
    return params, torch.frombuffer(bytearray(frames), dtype=torch.int16)


# ----------------------------------------------------------------------------- one-shot
def test_one_shot_writes_the_expected_files(testfamily_plan: Path, m: MStar, tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = mstar_run(str(testfamily_plan), "--walk", "generate", "--input", "prompt=hello there", "--input", "max_new=14",
                  "--out", str(out), "--stream")
    no_traceback(p)
    assert p.returncode == 0, p.stderr
    expected = m.submit("generate", {"prompt": "hello there", "max_new": 14}).result(timeout=30)

    # a line per streamed chunk, before the files
    lines = p.stdout.splitlines()
    assert 2 <= sum(line.startswith("stream tokens #") for line in lines) <= 14  # the cohort flushes in groups
    assert any(line.startswith("stream audio #") for line in lines)
    assert f"audio -> {out / 'generate.audio.wav'}" in lines
    assert sorted(f.name for f in out.iterdir()) == [
        "generate.audio.wav", "generate.hidden.safetensors", "generate.json", "generate.tokens.json"]

    params, pcm = read_wav(out / "generate.audio.wav")
    assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, 24000)
    assert params.nframes == expected["audio"].numel() > 0
    want = (expected["audio"].clamp(-1, 1) * 32767).round().to(torch.int16)
    assert (pcm.int() - want.int()).abs().max() <= 1

    assert json.loads((out / "generate.tokens.json").read_text()) == expected["tokens"].tolist()
    hidden = load_file(str(out / "generate.hidden.safetensors"))
    assert list(hidden) == ["hidden"] and torch.allclose(hidden["hidden"], expected["hidden"], atol=1e-5)

    record = json.loads((out / "generate.json").read_text())
    assert record["state"] == "finished" and record["walk"] == "generate" and record["finish_reason"] == "stop"
    assert record["steps"] > 0 and record["timings"]["total_s"] > 0 and "preemptions" in record
    assert record["files"] == ["generate.tokens.json", "generate.hidden.safetensors", "generate.audio.wav"]  # declared order


def test_bad_input_names_the_field_and_exits_1(testfamily_plan: Path, tmp_path: Path) -> None:
    p = mstar_run(str(testfamily_plan), "--walk", "generate", "--input", "prompt=x", "--input", "max_new=lots",
                  "--out", str(tmp_path))
    no_traceback(p)
    assert p.returncode == 1
    assert p.stderr.startswith("mstar-run: error:") and "'max_new'" in p.stderr and "lots" in p.stderr
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_corrupt_plan_is_a_clear_error(testfamily_plan: Path, tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.plan"
    data = bytearray(testfamily_plan.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the checksum catches it
    bad.write_bytes(bytes(data))
    p = mstar_run(str(bad), "--walk", "generate", "--input", "prompt=x")
    no_traceback(p)
    assert p.returncode == 1
    assert p.stderr.startswith(f"mstar-run: error: {bad}") and len(p.stderr.strip().splitlines()) == 1


def test_serve_on_a_busy_port_is_one_clear_error(testfamily_plan: Path) -> None:
    import socket

    with socket.socket() as busy:  # the server binds its port before loading the plan
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = mstar_run(str(testfamily_plan), "--serve", "--port", str(port))
    no_traceback(p)
    assert p.returncode == 1 and "mstar-run: error:" in p.stderr and str(port) in p.stderr


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no mode
        ["--walk", "generate", "--serve"],  # two modes
        ["--requests", "x.jsonl"],  # batch without --out
        ["--walk", "generate", "--input", "novalue"],
        ["--requests", "x.jsonl", "--out", "d", "--input", "a=1"],
        ["--walk", "generate", "--step-path", "generic"],  # no such option (the step-path switch is gone)
    ],
)
def test_bad_usage_exits_2(testfamily_plan: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([str(testfamily_plan), *argv])
    assert e.value.code == 2
    assert "mstar-run: error:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- batch
WALKS = ["generate", "generate_fixed", "generate_left", "chat", "flow"]


def random_request(rng: random.Random, i: int) -> dict[str, Any]:
    walk = rng.choice(WALKS)
    inputs: dict[str, Any] = {"prompt": "".join(rng.choice("abcdefghij klmno") for _ in range(rng.randint(1, 24)))}
    if walk == "flow":
        inputs["steps"] = rng.randint(1, 3)
    else:
        inputs["max_new"] = rng.randint(1, 6)  # short: 200 requests on 2 cores
    return {"id": f"r{i:03d}", "walk": walk, "inputs": inputs}


def test_batch_of_200_loses_none_and_bad_lines_fail_alone(testfamily_plan: Path, m: MStar, tmp_path: Path) -> None:
    rng = random.Random(7)
    good = [random_request(rng, i) for i in range(200)]
    lines = [json.dumps(r) for r in good]
    bad = {
        37: "{this is not json",
        90: json.dumps({"id": "bad-walk", "walk": "sing", "inputs": {"prompt": "x"}}),
        150: json.dumps({"id": "bad-type", "walk": "generate", "inputs": {"prompt": "x", "max_new": "five"}}),
    }
    for at in sorted(bad):  # inserted in order, so line number = index + 1
        lines.insert(at - 1, bad[at])
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"

    p = mstar_run(str(testfamily_plan), "--requests", str(requests), "--out", str(out))
    no_traceback(p)
    assert p.returncode == 1  # three requests failed
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["requests"], summary["finished"], summary["failed"]) == (203, 200, 3)
    assert summary["requests_per_s"] > 0 and summary["steps"] > 0 and summary["mean_batch"] > 1
    assert {"wall_s", "wasted_steps", "preemptions"} <= set(summary)
    assert "requests/s" in p.stdout and "mean batch size" in p.stdout
    assert "requests:" in p.stderr  # the progress bar

    failures = {f["line"]: f for f in summary["failures"]}
    assert sorted(failures) == [37, 90, 150]
    assert "malformed JSON" in failures[37]["error"]
    assert failures[90]["field"] == "walk" and "unknown walk 'sing'" in failures[90]["error"]
    assert failures[150]["field"] == "max_new"
    for line in (37, 90, 150):
        assert f"line {line} " in p.stderr
    assert json.loads((out / "line-37.json").read_text())["state"] == "failed"
    assert json.loads((out / "bad-type.json").read_text())["field"] == "max_new"

    # every good request finished and wrote its files
    for r in good:
        record = json.loads((out / f"{r['id']}.json").read_text())
        assert record["state"] == "finished", record
        for name in record["files"]:
            assert (out / name).stat().st_size > 0
    # spot checks against the in-process API (same seeded dummy weights)
    flow = next(r for r in good if r["walk"] == "flow")
    latent = load_file(str(out / f"{flow['id']}.latent.safetensors"))["latent"]
    assert torch.allclose(latent, m.submit("flow", flow["inputs"]).result(timeout=30)["latent"], atol=1e-5)
    gen = next(r for r in good if r["walk"] == "generate_left")
    tokens = json.loads((out / f"{gen['id']}.tokens.json").read_text())
    assert tokens == m.submit("generate_left", gen["inputs"]).result(timeout=30)["tokens"].tolist()


def test_all_good_batch_exits_0(testfamily_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = tmp_path / "ok.jsonl"
    requests.write_text("\n".join(json.dumps({"walk": "chat", "inputs": {"prompt": f"hi {i}", "max_new": 2}})
                                  for i in range(5)) + "\n\n")
    argv = [str(testfamily_plan), "--requests", str(requests), "--out", str(tmp_path / "o"), "--preempt-every", "4"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert (summary["requests"], summary["finished"], summary["failed"]) == (5, 5, 0)
    assert summary["preemptions"] > 0  # the hidden debug flag reached the conductor
    assert "finished: 5" in capsys.readouterr().out


@pytest.mark.parametrize("ok", [True, False], ids=["finished", "failed"])
def test_a_request_named_summary_keeps_its_record(testfamily_plan: Path, tmp_path: Path, ok: bool) -> None:
    """The batch's summary.json was written over the record of a request whose id is 'summary'
    (or the other way round): such a request's files get a hashed stem, as an id that does not
    make a file name does."""
    requests = tmp_path / "r.jsonl"
    inputs = {"prompt": "hi", "max_new": 2 if ok else "two"}
    requests.write_text(json.dumps({"id": "summary", "walk": "chat", "inputs": inputs}) + "\n")
    out = tmp_path / "o"
    assert main([str(testfamily_plan), "--requests", str(requests), "--out", str(out)]) == (0 if ok else 1)
    assert json.loads((out / "summary.json").read_text())["requests"] == 1
    (record,) = [json.loads(p.read_text()) for p in out.glob("summary-????????.json")]
    assert record["id"] == "summary" and record["state"] == ("finished" if ok else "failed")
    assert all((out / name).is_file() and name.startswith("summary-") for name in record["files"])


def test_an_id_with_a_dot_does_not_name_another_requests_file(testfamily_plan: Path, tmp_path: Path) -> None:
    """'x.tokens' wrote its record as x.tokens.json: the tokens file of request 'x'."""
    requests = tmp_path / "r.jsonl"
    requests.write_text("".join(json.dumps({"id": rid, "walk": "chat", "inputs": {"prompt": "hi", "max_new": n}})
                                + "\n" for rid, n in (("x", 3), ("x.tokens", 2))))
    out = tmp_path / "o"
    assert main([str(testfamily_plan), "--requests", str(requests), "--out", str(out)]) == 0
    assert isinstance(json.loads((out / "x.tokens.json").read_text()), list)  # x's tokens, not a record
    (record,) = [json.loads(p.read_text()) for p in out.glob("x_tokens-????????.json")]
    assert record["id"] == "x.tokens" and record["state"] == "finished"


def test_a_batch_runs_marked_loops_as_cohorts_with_the_generic_paths_tokens(testfamily_plan: Path,
                                                                            tmp_path: Path) -> None:
    inputs = [{"prompt": f"hi {i}", "max_new": 5} for i in range(4)]
    requests = tmp_path / "chat.jsonl"
    requests.write_text("\n".join(json.dumps({"id": f"c{i}", "walk": "chat", "inputs": x})
                                  for i, x in enumerate(inputs)) + "\n")
    out = tmp_path / "out"
    assert main([str(testfamily_plan), "--requests", str(requests), "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["cohort_steps"] > 0
    tokens = [json.loads((out / f"c{i}.tokens.json").read_text()) for i in range(4)]
    # the reference: the same requests in process, on the plan without its cohort marks
    with MStar.from_plan(as_run(load_plan(testfamily_plan, device="cpu"), "generic")) as m:
        want = [m.submit("chat", x).result(timeout=60) for x in inputs]
        assert m.stats()["cohort_steps"] == 0
    assert tokens == [w["tokens"].tolist() for w in want]


def test_missing_requests_file_exits_1(testfamily_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(testfamily_plan), "--requests", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 1
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --input parsing
def test_input_values_are_parsed_by_declared_type(tmp_path: Path) -> None:
    assert parse_text("w", "n", {"kind": "int"}, "12") == 12
    assert parse_text("w", "x", {"kind": "float"}, "0.5") == 0.5
    assert parse_text("w", "b", {"kind": "bool"}, "true") is True
    assert parse_text("w", "b", {"kind": "bool"}, "False") is False
    assert parse_text("w", "s", {"kind": "str"}, "a=b c") == "a=b c"
    t = {"kind": "tensor", "dtype": "i32", "dims": ["N"]}
    assert torch.equal(parse_text("w", "ids", t, "[1, 2, 3]"), torch.tensor([1, 2, 3], dtype=torch.int32))
    save_file({"ids": torch.arange(4, dtype=torch.int32)}, str(tmp_path / "ids.safetensors"))
    assert torch.equal(parse_text("w", "ids", t, f"@{tmp_path / 'ids.safetensors'}"), torch.arange(4))
    pixels = torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(tmp_path / "in.png")
    image = parse_text("w", "img", {"kind": "image"}, f"@{tmp_path / 'in.png'}")
    assert image.dtype == torch.uint8 and torch.equal(image, pixels)

    for kind, text, words in [({"kind": "bool"}, "maybe", "true or false"), (t, "[1, 2", "JSON list"),
                              ({"kind": "image"}, "@/nonexistent.png", "does not exist"),
                              (t, "@/nonexistent.safetensors", "does not exist")]:
        with pytest.raises(RequestError) as e:
            parse_text("w", "field_x", kind, text)
        assert e.value.field == "field_x" and "'field_x'" in str(e.value) and words in str(e.value)


# ----------------------------------------------------------------------------- write_outputs
def test_write_outputs_formats(tmp_path: Path) -> None:
    program = {
        "walk": "paint",
        "outputs": [
            {"name": "image", "mode": "set", "type": {"kind": "image"}},
            {"name": "speech_pcm", "mode": "append", "type": {"kind": "tensor", "dtype": "f32", "dims": ["S"]}},
        ],
    }
    image = torch.randint(0, 256, (6, 9, 3), dtype=torch.uint8)
    pcm = torch.tensor([0.0, 0.5, -0.5, 2.0, -3.0])  # out of range is clamped
    outputs = {"image": image, "speech_pcm": pcm, "caption": "a cat", "done": True, "count": 3,
               "codes": torch.tensor([[1, 2], [3, 4]]), "latents": torch.randn(2, 4, dtype=torch.bfloat16)}
    paths = write_outputs(tmp_path, "user/42 ../x", program, outputs, {"sample_rate": 16000},
                          summary={"state": "finished", "steps": 3})
    stem = safe_name("user/42 ../x")
    assert "/" not in stem and not stem.startswith(".") and stem != safe_name("user_42 .._x")
    # declared outputs in the walk's order, then the others by name
    assert [p.name for p in paths] == [f"{stem}.{n}" for n in (
        "image.png", "speech_pcm.wav", "caption.txt", "codes.json", "count.json", "done.json", "latents.safetensors")
    ] + [f"{stem}.json"]
    assert all(p.parent == tmp_path for p in paths)

    with Image.open(paths[0]) as img:
        assert img.mode == "RGB" and img.size == (9, 6)
        assert torch.equal(torch.from_numpy(np.array(img)), image)
    params, frames = read_wav(paths[1])
    assert (params.nchannels, params.sampwidth, params.framerate, params.nframes) == (1, 2, 16000, 5)
    assert frames.tolist() == [0, 16384, -16384, 32767, -32767]
    assert paths[2].read_text() == "a cat"
    assert json.loads(paths[3].read_text()) == [[1, 2], [3, 4]]
    assert json.loads(paths[4].read_text()) == 3 and json.loads(paths[5].read_text()) is True
    back = load_file(str(paths[6]))
    assert list(back) == ["latents"] and torch.equal(back["latents"], outputs["latents"])
    record = json.loads(paths[-1].read_text())
    assert record["walk"] == "paint" and record["steps"] == 3 and record["files"] == [p.name for p in paths[:-1]]


def test_a_3d_uint8_tensor_is_a_png_and_1d_float_audio_defaults_to_24k(tmp_path: Path) -> None:
    program = {"walk": "w", "outputs": []}
    paths = write_outputs(tmp_path, "r", program, {"frame": torch.zeros(4, 4, 3, dtype=torch.uint8),
                                                   "audio": torch.zeros(10), "x": torch.zeros(10)}, {})
    assert [p.name for p in paths] == ["r.audio.wav", "r.frame.png", "r.x.safetensors", "r.json"]
    assert read_wav(paths[0])[0].framerate == 24000


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_output_file_has_the_same_mode_under_the_umask(tmp_path: Path, umask: int) -> None:
    """A `.safetensors` output is not private while the WAV, PNG and JSON beside it are not."""
    program = {"walk": "w", "outputs": []}
    values = {"audio": torch.zeros(10), "frame": torch.zeros(4, 4, 3, dtype=torch.uint8), "x": torch.zeros(3),
              "text": "hi", "ids": torch.arange(3)}
    old = os.umask(umask)
    try:
        paths = write_outputs(tmp_path, "r", program, values, {})
    finally:
        os.umask(old)
    assert {p.suffix for p in paths} == {".wav", ".png", ".safetensors", ".txt", ".json"}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths} == {p.name: 0o666 & ~umask for p in paths}


# ----------------------------------------------------------------------------- click: what operators expect
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    assert main(["--version"]) == 0
    assert re.fullmatch(r"mstar-run \S+ \(plan schema \d+\.\d+\)\n", capsys.readouterr().out)


def test_an_input_given_twice_is_refused(testfamily_plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The second value used to win, the first dropped without a word."""
    with pytest.raises(SystemExit) as e:
        main([str(testfamily_plan), "--walk", "generate", "--input", "prompt=a", "-i", "prompt=b"])
    assert e.value.code == 2
    assert "mstar-run: error: Invalid value for '--input' / '-i': gives 'prompt' twice ('prompt=a' and " \
           "'prompt=b')" in capsys.readouterr().err


def test_a_stdout_reader_that_goes_away_ends_the_run_quietly(testfamily_plan: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`mstar-run ... --stream | head -1`: the next line's write is a BrokenPipeError, which was
    reported as 'cannot access the output files: Broken pipe'."""
    import io

    class HeadOne(io.StringIO):
        def write(self, text: str) -> int:
            if "\n" in self.getvalue():
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    head = HeadOne()
    monkeypatch.setattr(sys, "stdout", head)
    code = main([str(testfamily_plan), "--walk", "generate", "--input", "prompt=hi", "--input", "max_new=4",
                 "--stream", "--out", str(tmp_path)])
    assert code == 1 and head.getvalue().startswith("stream ")
    assert capsys.readouterr().err == ""


def test_usage_errors_name_the_environment_variable(testfamily_plan: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MSTAR_PORT", "70000")
    with pytest.raises(SystemExit) as e:
        main([str(testfamily_plan), "--serve"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("Usage: mstar-run [OPTIONS] PLAN\n")
    assert "mstar-run: error: Invalid value for '--port' (env var: 'MSTAR_PORT'): 70000" in err


def test_a_prefix_chunk_without_prefix_caching_is_refused(testfamily_plan: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """It would be ignored: a usage error naming the flag, or the variable when the environment
    set it; a bad value names the flag (and the variable) whether caching is on or not."""
    walk = [str(testfamily_plan), "--walk", "chat", "--input", "prompt=hi", "--input", "max_new=2",
            "--out", str(tmp_path)]

    def usage(*argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            main([*walk, *argv])
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "mstar-run: error: --prefix-chunk goes with --prefix-caching" in usage("--prefix-chunk", "64")
    assert "Invalid value for '--prefix-chunk' (env var: 'MSTAR_PREFIX_CHUNK'): 0" in usage("--prefix-chunk", "0")
    monkeypatch.setenv("MSTAR_PREFIX_CHUNK", "64")
    assert "mstar-run: error: MSTAR_PREFIX_CHUNK goes with --prefix-caching (MSTAR_PREFIX_CACHING=1)" in usage()
    assert main([*walk, "--no-prefix-caching"]) == 0  # caching turned off for this run: the variable waits
    assert main([*walk, "--prefix-caching"]) == 0
    assert main([*walk, "--prefix-caching", "--prefix-chunk", "3"]) == 1  # not a multiple of the pages
    assert "must be a positive multiple of the KV page size" in capsys.readouterr().err


def test_server_options_from_the_environment_do_not_block_other_modes(
        testfamily_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # set for a server in the same shell; a one-shot run ignores them (on the command line: usage error)
    monkeypatch.setenv("MSTAR_SHUTDOWN_TIMEOUT", "5")
    monkeypatch.setenv("MSTAR_API_KEY", "k")
    assert main([str(testfamily_plan), "--walk", "chat", "--input", "prompt=hi", "--input", "max_new=2",
                 "--out", str(tmp_path)]) == 0
    with pytest.raises(SystemExit) as e:
        main([str(testfamily_plan), "--walk", "chat", "--api-key", "k"])
    assert e.value.code == 2


def test_environment_sets_engine_options(testfamily_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MSTAR_WEIGHTS", str(tmp_path / "no-such-folder"))
    assert main([str(testfamily_plan), "--walk", "chat", "--input", "prompt=hi", "--out", str(tmp_path)]) == 1
    assert "no-such-folder" in capsys.readouterr().err  # MSTAR_WEIGHTS reached the weight loader
    assert main([str(testfamily_plan), "--walk", "chat", "--input", "prompt=hi", "--weights", "dummy",
                 "--out", str(tmp_path)]) == 0  # the command line wins


def test_shell_completion() -> None:
    env = {**os.environ, "COMP_WORDS": "mstar-run x.plan --ser", "COMP_CWORD": "2",
           "_MSTAR_RUN_COMPLETE": "bash_complete"}
    p = subprocess.run([sys.executable, "-m", "mstar_runtime.cli"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["plain,--serve", "plain,--served-model-name"]


def test_internal_error_exits_3(testfamily_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    import mstar_runtime.cli as cli

    def broken(*args: Any, **kw: Any) -> int:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(cli, "one_shot", broken)
    assert main([str(testfamily_plan), "--walk", "chat", "--input", "prompt=hi", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "mstar-run: internal error: ZeroDivisionError: boom (this is a bug" in err


def test_modes_are_plain_functions(testfamily_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mstar_runtime.cli import EngineOptions, run_requests, run_walk

    one = EngineOptions(threads=1)
    assert run_walk(testfamily_plan, "chat", {"prompt": "hi", "max_new": "3"}, out=tmp_path / "w", options=one) == 0
    assert len(json.loads((tmp_path / "w" / "chat.tokens.json").read_text())) == 3
    assert run_walk(testfamily_plan, "chat", {"max_new": "x"}, out=tmp_path / "bad") == 1
    assert "mstar-run: error: walk 'chat', input 'max_new'" in capsys.readouterr().err
    assert run_requests(testfamily_plan, ROOT / "examples/requests.jsonl", tmp_path / "b", options=one) == 0


# ----------------------------------------------------------------------------- examples/
def test_example_requests_file(testfamily_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/requests.jsonl, as the README runs it on the test family's tiny plan."""
    lines = (ROOT / "examples/requests.jsonl").read_text().splitlines()
    assert main([str(testfamily_plan), "--requests", str(ROOT / "examples/requests.jsonl"), "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["requests"], summary["finished"]) == (len(lines), len(lines)) and summary["mean_batch"] > 1
    walks = {json.loads(line)["walk"] for line in lines}
    assert walks == {"generate", "generate_fixed", "generate_left", "chat", "flow", "continue"}  # one of each
    assert (tmp_path / "square.latent.safetensors").exists() and (tmp_path / "hello.audio.wav").stat().st_size > 44


def test_example_orpheus_requests_file(tmp_path: Path) -> None:
    """examples/orpheus-requests.jsonl on Orpheus' tiny plan (random weights: noise shaped like speech)."""
    from mstarc.cli import main as mstarc

    plan = tmp_path / "orpheus.plan"
    assert mstarc(["compile", str(ROOT / "models/orpheus/orpheus.walk"), "--variant", "tiny",
                   "-p", str(ROOT / "placements/cpu.yaml"), "-o", str(plan)]) == 0
    before = torch.get_num_threads()
    try:
        assert main([str(plan), "--requests", str(ROOT / "examples/orpheus-requests.jsonl"), "--out", str(tmp_path),
                     "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    for rid in ("tara", "leo", "mia"):
        params, pcm = read_wav(tmp_path / f"{rid}.audio.wav")
        assert params.framerate == 24000 and pcm.numel() > 0


def test_example_pi05_requests_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/pi05-requests.jsonl on π0.5's tiny plan: 1, 2 and 3 cameras as PNG files (paths
    relative to the repository root), batched; each chunk is the padded [6, 8] with dims 7."""
    from safetensors.torch import load_file

    from mstarc.cli import main as mstarc

    monkeypatch.chdir(ROOT)
    plan = tmp_path / "pi05.plan"
    assert mstarc(["compile", "models/pi05/pi05.walk", "--variant", "tiny", "-p", "placements/cpu.yaml",
                   "-o", str(plan)]) == 0
    before = torch.get_num_threads()
    try:
        assert main([str(plan), "--requests", "examples/pi05-requests.jsonl", "--out", str(tmp_path),
                     "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] == 3 and summary["mean_batch"] > 1
    chunks = [load_file(tmp_path / f"{rid}.actions.safetensors")["actions"]
              for rid in ("one-camera", "two-cameras", "three-cameras")]
    assert all(c.shape == (6, 8) for c in chunks) and not torch.allclose(chunks[0], chunks[1])
    assert json.loads((tmp_path / "one-camera.dims.json").read_text()) == 7


# ----------------------------------------------------------------------------- batch file reading
class _Recording(io.BytesIO):
    """A file that remembers the longest piece any one read returned."""

    longest = 0

    def readline(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        got = super().readline(size)
        self.longest = max(self.longest, len(got))
        return got

    def read(self, size: int | None = -1) -> bytes:
        got = super().read(size)
        self.longest = max(self.longest, len(got))
        return got


def test_request_lines_reads_one_bounded_line_at_a_time() -> None:
    good = b'{"walk": "chat", "inputs": {"prompt": "a\\u2028b"}}'
    raw = b"\n".join([good, b"", b"x" * 5_000, b"   ", b"\xff\xfe", good.replace(b"\\u2028", "\u2028".encode()),
                      b"y" * 100]) + b"\r\n"
    f = _Recording(raw)
    got = list(cli.request_lines(f, max_bytes=100))
    assert f.longest <= 102  # never the whole file, nor the long line
    numbers = [n for n, _ in got]
    assert numbers == [1, 3, 5, 6, 7]  # blank lines are skipped, but counted
    assert got[0][1] == good.decode()
    assert isinstance(got[1][1], RequestError) and "longer than 100 bytes, the limit for one" in str(got[1][1])
    assert isinstance(got[2][1], RequestError) and "not UTF-8 (byte 1)" in str(got[2][1])
    assert got[3][1] == good.decode().replace("\\u2028", "\u2028")  # a U+2028 does not end a line
    assert got[4][1] == "y" * 100  # exactly at the limit, before its "\r\n"


def test_a_long_or_undecodable_batch_line_fails_alone(testfamily_plan: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ok = [json.dumps({"id": f"c{i}", "walk": "chat", "inputs": {"prompt": f"hi {i}", "max_new": 2}}).encode()
          for i in range(2)]
    long = json.dumps({"id": "long", "walk": "chat", "inputs": {"prompt": "z" * 400, "max_new": 2}}).encode()
    requests = tmp_path / "r.jsonl"
    requests.write_bytes(b"\n".join([ok[0], long, b"\xc3(", ok[1]]) + b"\n")
    monkeypatch.setattr(cli, "MAX_BATCH_LINE_BYTES", 200)
    assert main([str(testfamily_plan), "--requests", str(requests), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert (summary["requests"], summary["finished"], summary["failed"]) == (4, 2, 2)
    failures = {f["line"]: f["error"] for f in summary["failures"]}
    assert len(long) > 200
    assert failures == {2: "the line is longer than 200 bytes, the limit for one request",
                        3: "the line is not UTF-8 (byte 1)"}
    assert "line 2 (id 'line-2'): the line is" in err and "Traceback" not in err
    assert json.loads((tmp_path / "o" / "line-2.json").read_text())["state"] == "failed"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_batch_from_a_pipe(testfamily_plan: Path, tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    lines = "".join(json.dumps({"walk": "chat", "inputs": {"prompt": f"hi {i}", "max_new": 2}}) + "\n" for i in range(3))
    writer = threading.Thread(target=pipe.write_text, args=(lines,), daemon=True)
    writer.start()
    assert main([str(testfamily_plan), "--requests", str(pipe), "--out", str(tmp_path / "o")]) == 0
    writer.join(30)
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["finished"] == 3


def test_open_requests_refuses_what_has_no_lines_to_end(tmp_path: Path) -> None:
    with pytest.raises(cli.UserError, match="cannot read requests file .*: Is a directory"):
        cli.open_requests(str(tmp_path))
    if Path("/dev/zero").exists():  # endless: each line would be read past forever
        with pytest.raises(cli.UserError, match="'/dev/zero': not a regular file or a pipe"):
            cli.open_requests("/dev/zero")
