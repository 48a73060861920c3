"""A `fork` inside a speculative `dynamic_loop` iteration that is thrown away is undone.

The interpreter keeps the fork's destination under a backup tag before it forks (only while
some enclosing iteration is speculative), logs a `ForkUndo` with the iteration's KV writes,
and frees the backup once the iteration stands; the conductor's undo, last change first,
renames the backup back onto the destination (`KVContexts.restore`, `BlockManager.rename`:
no page allocated). Whisper's temperature fallback relies on it: each attempt empties the
text context with a fork, and the speculative attempt after the accepted one is thrown away.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from test_interpreter import DONE, FakeRequest, call, loop, send, seq, start, walk

from mstar_runtime.control.interpreter import ForkKV, ForkUndo, Interpreter, StepCall
from mstar_runtime.control.kv_contexts import NO_CONTEXT, KVContexts
from mstar_runtime.kv.block_manager import BlockManager


def fork(y: Any) -> tuple[str, str, str]:
    assert isinstance(y, ForkKV), y
    return y.node, y.src, y.dst


class Owner(FakeRequest):
    def release_context(self, node: str, tag: str) -> None:
        self.log.append(("release", node, tag))


def _attempts() -> dict[str, Any]:
    """dynamic_loop until ok { fork lm @blank -> @text; ok = lm.prefill() @text }"""
    body = seq({"op": "fork", "node": "lm", "src": "blank", "dst": "text"},
               call("w.p", "lm", "prefill", {}, [["ok", "ok"]], tag="text"))
    return walk(loop("w.l", body, max=4, until="ok", carry=["ok"]))


def test_a_speculative_fork_keeps_a_backup_and_a_discarded_iteration_undoes_it() -> None:
    req = Owner()
    task = Interpreter(req, _attempts(), {}).main_task({"ok": False})  # type: ignore[arg-type]
    y = send(task)
    # attempt 0 is speculative on the flag bound before the loop: backup first, then the fork
    assert fork(y) == ("lm", "text", "text~undo1")
    assert fork(send(task)) == ("lm", "blank", "text")
    y = send(task)
    assert isinstance(y, StepCall)
    y.frame.log_kv("lm", (req.id, "text"), 0)
    y = send(task, {"ok": True})  # the flag before the loop said go on: attempt 0 stands
    assert ("release", "lm", "text~undo1") in req.log
    # attempt 1, speculative on attempt 0's ok = True: forked, prefilled, then thrown away
    assert fork(y) == ("lm", "text", "text~undo2")
    assert fork(send(task)) == ("lm", "blank", "text")
    y = send(task)
    assert isinstance(y, StepCall)
    y.frame.log_kv("lm", (req.id, "text"), 0)
    assert send(task, {"ok": False}) is DONE
    wasted = [e for e in req.log if e[0] == "wasted"]
    assert wasted == [("wasted", [ForkUndo("lm", ("r1", "text"), "text~undo2"), ("lm", ("r1", "text"), 0)])]
    assert ("release", "lm", "text~undo2") not in req.log  # the undo takes the backup back


def test_a_fork_outside_speculation_keeps_no_backup() -> None:
    program = walk(seq({"op": "fork", "node": "lm", "src": "a", "dst": "b"}))
    _, task, y, _ = start(program, {})
    assert fork(y) == ("lm", "a", "b")
    assert send(task) is DONE


class _Worker:
    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []

    def fork(self, node: str, request_id: str, src_tag: str, dst_tag: str, copy: Any) -> None:
        self.log.append((src_tag, dst_tag, "copy" if copy is not None else ""))

    def copy_slots(self, node: str, copy: Any) -> None:
        self.log.append(("slots",))


def test_restore_gives_the_destination_its_backup_without_a_page() -> None:
    plan = SimpleNamespace(kv_pools=lambda: [("lm", 0)], kv_pages=lambda name, rank: 8, page_size=4, body={})
    worker = _Worker()
    contexts = KVContexts(plan, {0: worker})  # type: ignore[arg-type]
    req = SimpleNamespace(id="r", homes={("lm", "text"): 0})
    bm = contexts.pages.managers[("lm", 0)]
    bm.append(("r", "text"), 6)  # attempt 0's text context: 2 pages
    before = (bm.page_table(("r", "text")), bm.seq_len(("r", "text")), bm.version(("r", "text")))
    contexts.fork(req, ForkKV("lm", "text", "text~undo1"))  # the backup (its partial page copied)
    contexts.fork(req, ForkKV("lm", "blank", "text"))  # the fork: text is empty
    bm.append(("r", "text"), 5)  # the speculative attempt's prefill
    contexts.truncate("lm", ("r", "text"), 0)
    free = bm.free_pages
    contexts.restore(req, "lm", "text~undo1", "text")  # type: ignore[arg-type]
    assert ("r", "text~undo1") not in bm and bm.free_pages == free  # renamed, nothing allocated
    assert bm.seq_len(("r", "text")) == 6 and bm.version(("r", "text")) == before[2]
    assert worker.log[-2:] == [("text~undo1", "text", ""), (NO_CONTEXT, "text~undo1", "")]
    assert req.homes == {("lm", "text"): 0}
    contexts.free(req, "lm", "text")  # type: ignore[arg-type]
    assert bm.free_pages == 8


def test_rename_moves_a_sequence_and_frees_what_the_destination_held() -> None:
    bm = BlockManager(4, 2)
    bm.append(("r", "a"), 3)
    bm.append(("r", "b"), 1)
    table = bm.page_table(("r", "a"))
    bm.rename(("r", "a"), ("r", "b"))
    assert ("r", "a") not in bm and bm.page_table(("r", "b")) == table and bm.seq_len(("r", "b")) == 3
    assert bm.free_pages == 2 and bm.tags("r") == ["b"]
    bm.rename(("r", "none"), ("r", "b"))  # an unknown source leaves the destination empty
    assert ("r", "b") not in bm and bm.free_pages == 4


def test_whisper_fallback_attempts_leave_the_text_context_as_the_kept_attempt_left_it(tmp_path: Any) -> None:
    """End to end through the conductor: each window's attempt after the accepted one is
    speculative, forks `text` empty and prefills, then is thrown away; after the undo the
    text context is the accepted attempt's again (its length as the backup found it), and
    when the request ends no page is held."""
    from pathlib import Path

    import torch

    from mstar_runtime.control.conductor import FINISHED, Conductor
    from mstar_runtime.plan.loader import load_plan
    from mstar_runtime.worker.worker import Worker
    from mstarc.cli import main as mstarc

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "w.plan"
    assert mstarc(["compile", str(root / "models/whisper/whisper.walk"), "--variant", "tiny", "-p",
                   str(root / "placements/cpu.yaml"), "-o", str(out)]) == 0
    plan = load_plan(out, device="cpu")
    conductor = Conductor(plan, {0: Worker(plan, 0, "cpu", "init")}, prefix_caching=False)
    contexts = conductor.contexts
    bm = contexts.pages.managers[("decoder", 0)]
    kept: dict[str, int] = {}  # backup tag -> the text context's length when it was kept
    restored: list[tuple[int, int]] = []  # (kept, after the undo)
    fork, restore = contexts.fork, contexts.restore

    def spy_fork(req: Any, f: ForkKV) -> None:
        if "~undo" in f.dst:
            kept[f.dst] = bm.seq_len((req.id, f.src)) if (req.id, f.src) in bm else 0
        fork(req, f)

    def spy_restore(req: Any, node: str, backup: str, dst: str) -> None:
        restore(req, node, backup, dst)
        restored.append((kept[backup], bm.seq_len((req.id, dst)) if (req.id, dst) in bm else 0))

    contexts.fork, contexts.restore = spy_fork, spy_restore  # type: ignore[method-assign]
    audio = torch.sin(torch.arange(40 * 16000) / 16000 * 2 * torch.pi * 300) * 0.3
    h = conductor.submit("transcribe", {"audio": audio, "timestamps": True, "max_tokens": 12})
    conductor.run_until_idle()
    assert h.state == FINISHED, h.error
    windows = len({s["seek"] for s in json.loads(h.outputs["segments"])})
    assert len(restored) >= windows >= 2  # one thrown-away attempt per window at least
    # each undo gave back a context of the length the backup kept (the accepted attempt's)
    assert all(before == after > 0 for before, after in restored), restored
    assert bm.used_pages == 0
