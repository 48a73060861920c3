"""Control messages round-trip through msgpack, and every malformed input is a MessageError."""

import dataclasses
import random

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_runtime.engine.engines import KVSlots, ReadSlots
from mstar_runtime.worker import codec as wire_codec
from mstar_runtime.worker import messages as codec
from mstar_runtime.worker.messages import (
    MAX_INLINE_TENSOR_BYTES,
    MESSAGE_TYPES,
    CopySlots,
    DropTag,
    ForkKV,
    FreeRequest,
    Heartbeat,
    Hello,
    Message,
    MessageError,
    ResultEntry,
    Shutdown,
    SlotCopy,
    StepEntry,
    StepRejected,
    StepRequest,
    StepResult,
    TensorMeta,
    WorkerError,
    WorkerReady,
    decode,
    encode,
)


def samples() -> list[Message]:
    return [
        StepRequest(
            step_id=7,
            node="llm",
            phase="decode",
            entries=[
                StepEntry(
                    "req-1",
                    "main",
                    [TensorMeta("hidden", "bfloat16", [1, 4096])],
                    {"ids": torch.tensor([[1, 2, 3]], dtype=torch.int32)},
                    {"max_new": 16, "scale": 2.5, "final": True, "text": "hi", "none": None},
                    KVSlots(start=3, q_len=2, slots=[3, 4], page_table=[0], mask="full", keep=False,
                            reads=(ReadSlots("vlm", "main", 17, [2, 5]), ReadSlots("vlm", "cross", 0, []))),
                ),
                StepEntry("req-2", "cfg_text", [], {}),
                StepEntry("req-3", None, [], kv=KVSlots(0, 1, [16], [1, 7], "block_causal", 4)),
                # a prefix-cache hit's rest, to be computed in chunks of 32 (engine/chunked.py)
                StepEntry("req-4", None, [], kv=KVSlots(48, 9, list(range(48, 57)), [0, 1, 2, 3], cached=48, chunk=32)),
            ],
        ),
        StepResult(
            step_id=7,
            rank=1,
            entries=[
                ResultEntry(
                    "req-1",
                    "main",
                    [TensorMeta("hidden", "float32", [1, 32]), TensorMeta("v", "float16", [])],
                    {"done": torch.tensor([True]), "logp": torch.tensor([-0.5], dtype=torch.bfloat16)},
                    {"done": False, "count": -(2**63), "big": 2**64 - 1},
                ),
                ResultEntry("req-2", None, []),
            ],
            elapsed_s=0.0125,
        ),
        StepRejected(step_id=7, rank=1, message="prompt too long", field="tokens", request_ids=["a", "b"]),
        StepRejected(step_id=8, rank=2, message="bad", field=None, request_ids=[]),
        ForkKV(node="llm", request_id="r", src_tag="uncond", dst_tag="cond", copy=SlotCopy(32, 48, 5)),
        ForkKV(node="llm", request_id="r", src_tag="main", dst_tag="cont"),
        CopySlots(node="llm", copy=SlotCopy(src_start=0, dst_start=16, count=16)),
        DropTag(node="llm", request_id="r", tag="main"),
        codec.ImportKV(node="llm", request_id="r", tag="cfg_img", pages=[3, 0, 7],
                       values=[TensorMeta("kv", "bfloat16", [2, 3, 2, 16, 2, 16])],
                       inline={"state:cache": torch.tensor([1.5, -2.0])},
                       scalars={"has_state": True, "state:rope_offset": -3, "state:gen/params/seed": None}),
        codec.ImportKV(node="llm", request_id="r", tag="t", pages=[], values=[], scalars={"has_state": False}),
        codec.ExportKV(node="llm", request_id="r", tag="cfg_text", pages=[4, 5]),
        codec.KVExported(rank=2, values=[TensorMeta("kv", "float32", [2, 2, 2, 16, 2, 16])],
                         scalars={"has_state": True, "state:gen/params/temperature": 0.3}),
        WorkerReady(rank=1, pid=4242, nodes=["lm", "codec"], plan_digest="ab" * 32),
        StepRequest(step_id=0, node="vae", phase="decode", entries=[]),
        FreeRequest(request_id="r"),
        Shutdown(),
        Shutdown(reason="SIGTERM"),
        WorkerError(rank=3, message="CUDA error: out of memory", step_id=12),
        WorkerError(rank=0, message="ünïcode ok"),
        Heartbeat(rank=2, seq=2**40),
        Hello(rank=3, pid=4242, host="node-b", node=1, token="0f" * 16),
        # decode cohorts in a worker process (mstar_runtime.worker.remote_cohort)
        codec.CohortOpen(step_id=3, cohort=1, node="llm", phase="decode", fed=[["token", "token"]],
                         invariant=["speaker"], outputs=["token", "code", "done"], rows=64, max_pages=129),
        codec.CohortJoin(step_id=4, cohort=1, first=5, rows=[
            codec.CohortJoinRow(request_id="r", tag="main", pages=[3, 9], length=17,
                                values=[TensorMeta("inv:speaker", "bfloat16", [256])],
                                inline={"fed:token": torch.tensor([[42]], dtype=torch.int32)},
                                scalars={"inv:voice": "tara"}),
            codec.CohortJoinRow(request_id="s", tag="main", pages=[], length=0, values=[], refs={"fed:token": "token"},
                                steps=4, tokens=2, read_pages=[[1]], read_lens=[3])]),
        codec.CohortReply(step_id=3, rank=1, ok=False),
        codec.CohortLeave(cohort=1, row=5, request_id="r", tag="main", steps=12),
        codec.CohortMove(cohort=1, src=7, dst=5),
        codec.CohortShrink(cohort=1, n=7),
        codec.CohortAddPages(cohort=1, rows=[0, 5], cols=[2, 1], pages=[11, 12]),
        codec.CohortStep(step_id=9, cohort=1, n=8, send_outputs=False),
        codec.CohortStepped(step_id=9, rank=1, layout=[codec.PackedPort("token", False, 1),
                                                      codec.PackedPort("code:count", False, 1),
                                                      codec.PackedPort("hidden", True, 4096)],
                            values=[TensorMeta("floats", "float32", [8, 4096])],
                            inline={"ints": torch.arange(16).reshape(8, 2)}, elapsed_s=0.004, waited_s=0.25),
        codec.CohortStepped(step_id=10, rank=2, layout=[], values=[]),
        # chained cohorts: the links open in one message, each a CohortOpen
        codec.ChainOpen(step_id=11, cohort=3, links=[
            codec.CohortOpen(step_id=0, cohort=4, node="thinker", phase="decode_speech", fed=[["token", "token"]],
                             invariant=[], outputs=["token", "item", "done"], rows=32, max_pages=65),
            codec.CohortOpen(step_id=0, cohort=5, node="talker", phase="frame", fed=[], invariant=["speaker"],
                             outputs=["codes"], rows=32, max_pages=65)],
            imports=[codec.ChainImport(link=1, port="text", source=0, output="item")], flag_link=0, flag_port="done"),
        codec.ChainOpen(step_id=12, cohort=6, links=[], imports=[]),
        codec.ChainJoin(cohort=3, first=2, stops=[False, True]),
        codec.ChainMove(cohort=3, src=4, dst=1),
        codec.ChainStep(step_id=13, cohort=3, n=5, send_outputs=False),
        # the API process <-> the engine process (mstar_runtime.engine_process)
        codec.EngineSubmit("r1", "tts", {"text": codec.Value(scalar="hi"),
                                         "x": codec.Value(tensor=torch.arange(3, dtype=torch.int32))}, 30.0),
        codec.EngineOutput("r1", 4, "audio", codec.Value(shm=codec.ShmRef("mstar-1", "float32", [48000]))),
        codec.EngineFinish("r1", "finished", {"text": codec.Value(scalar="ok")}, None, None, "stop",
                           {"steps": 12, "ttft_s": 0.25}, ["chat", "t2i"]),
        codec.EngineCancel("r1"),
        codec.EngineAck("r1", 64),
        codec.EngineStatsRequest(seq=3),
        codec.EngineStatsReply(seq=3, stats={"steps": 5}, requests={"running": 1}, fault="engine lost",
                               fault_detail="pid 12 exited"),
        codec.EngineReady(pid=12),
        codec.EngineReady(pid=13, error="plan does not load"),
    ]


def same(a: object, b: object) -> bool:
    """Structural equality that compares tensors by dtype, shape and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    back = decode(data)
    assert same(msg, back)
    assert encode(back) == data  # canonical: field order is the dataclass order
    assert same(decode(bytearray(data)), msg) and same(decode(memoryview(data)), msg)


def test_the_wire_carries_the_engines_own_slot_records() -> None:
    """One declaration: a decoded entry's `kv` is `engines.KVSlots` itself, reads a tuple as
    the engine declares them, and a fixed-length tuple annotation is refused, not guessed."""
    msg = samples()[0]
    kv = decode(encode(msg)).entries[0].kv  # type: ignore[union-attr]
    assert type(kv) is KVSlots and kv == msg.entries[0].kv  # type: ignore[union-attr]
    assert type(kv.reads) is tuple and type(kv.reads[0]) is ReadSlots
    assert codec.KVSlots is KVSlots and codec.ReadSlots is ReadSlots
    with pytest.raises(MessageError, match=r"only tuple\[X, \.\.\.\]"):
        wire_codec._convert((1, 2), tuple[int, int], "x", to_wire=True)


def test_allowlist_is_explicit_and_complete() -> None:
    assert set(MESSAGE_TYPES) == {
        "step_request",
        "step_result",
        "step_rejected",
        "fork_kv",
        "copy_slots",
        "drop_tag",
        "import_kv",
        "export_kv",
        "kv_exported",
        "free_request",
        "shutdown",
        "worker_ready",
        "worker_error",
        "heartbeat",
        "hello",
        "cohort_open",
        "cohort_join",
        "cohort_reply",
        "cohort_leave",
        "cohort_move",
        "cohort_shrink",
        "cohort_add_pages",
        "cohort_step",
        "cohort_stepped",
        "chain_open",
        "chain_join",
        "chain_move",
        "chain_step",
        "engine_submit",
        "engine_output",
        "engine_finish",
        "engine_cancel",
        "engine_ack",
        "engine_stats_request",
        "engine_stats_reply",
        "engine_ready",
    }
    assert {type(m) for m in samples()} == set(MESSAGE_TYPES.values())


def test_inline_tensors_all_dtypes_and_shapes() -> None:
    for dtype in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    ):
        for shape in ((), (0,), (3,), (2, 0, 4), (2, 3)):
            t = (torch.rand(shape) * 100).to(dtype)
            msg = StepRequest(1, "n", "p", [StepEntry("r", "t", [], {"x": t})])
            back = decode(encode(msg))
            assert same(back.entries[0].inline["x"], t)  # type: ignore[union-attr]
    # Non-contiguous tensors and views travel by value.
    t = torch.arange(12).reshape(3, 4).t()[1:]
    back = decode(encode(StepRequest(1, "n", "p", [StepEntry("r", "t", [], {"x": t})])))
    assert torch.equal(back.entries[0].inline["x"], t)  # type: ignore[union-attr]


def wire(msg: Message) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def first(cls: type) -> dict:
    """The wire map of the first sample of a message class."""
    return wire(next(m for m in samples() if type(m) is cls))


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def bad_wires() -> list[tuple[object, str]]:
    hb = wire(Heartbeat(1, 2))
    step = wire(samples()[0])
    cases: list[tuple[object, str]] = [
        ({**hb, "type": "exec_python"}, "unknown message type 'exec_python'"),
        ({k: v for k, v in hb.items() if k != "type"}, "unknown message type None"),
        ({**hb, "type": 5}, "unknown message type 5"),
        ({"type": "heartbeat", "rank": 1}, "missing seq"),
        ({**hb, "extra": 1}, "unexpected extra"),
        ({**hb, "rank": "1"}, "heartbeat.rank: expected int, got str"),
        ({**hb, "rank": True}, "expected int, got bool"),
        ({**hb, "rank": 1.0}, "expected int, got float"),
        ({**hb, "rank": None}, "expected int, got NoneType"),
        ([hb], "a message must be a map"),
        ("heartbeat", "a message must be a map"),
        ({**wire(WorkerError(0, "x")), "step_id": "3"}, "worker_error.step_id"),
        ({**wire(Shutdown()), "reason": b"bytes"}, "expected str, got bytes"),
        ({**first(ForkKV), "copy": {"src_start": 0, "dst_start": 1}}, "SlotCopy is missing count"),
        ({**first(StepRejected), "request_ids": ["a", 1]}, "request_ids[1]: expected str"),
        ({**first(WorkerReady), "nodes": "lm"}, "worker_ready.nodes: expected list"),
    ]
    e = step["entries"][0]
    mutations = [
        ({**e, "inputs": "llm.token"}, "inputs: expected list"),
        ({**e, "inputs": [1]}, "inputs[0]: expected TensorMeta, got int"),
        (
            {**e, "inputs": [{"name": "x", "dtype": "float32", "shape": ["3"]}]},
            "inputs[0].shape[0]: expected int",
        ),
        ({**e, "scalars": {"x": [1]}}, "scalars.x: expected bool | int | float | str, got list"),
        ({**e, "scalars": {"x": b"raw"}}, "expected bool | int | float | str, got bytes"),
        ({**e, "kv": {**e["kv"], "slots": "0"}}, "kv.slots: expected list"),
        ({**e, "kv": {**e["kv"], "block_size": 1.5}}, "kv.block_size: expected int"),
        ({**e, "tag": 3}, "tag: expected str, got int"),
        ({**e, "bogus": 1}, "unexpected bogus"),
        ({k: v for k, v in e.items() if k != "tag"}, "missing tag"),
        (
            {**e, "inline": {"ids": {**e["inline"]["ids"], "dtype": "object"}}},
            "unsupported tensor dtype 'object'",
        ),
        ({**e, "inline": {"ids": {**e["inline"]["ids"], "shape": [2, 3]}}}, "do not match shape"),
        ({**e, "inline": {"ids": {**e["inline"]["ids"], "shape": [-1]}}}, "bad tensor shape"),
        ({**e, "inline": {"ids": {**e["inline"]["ids"], "shape": [2**62, 2**62]}}}, "do not match shape"),
        ({**e, "inline": {"ids": {**e["inline"]["ids"], "data": "abc"}}}, "tensor data must be bytes"),
        ({**e, "inline": {"ids": [1, 2, 3]}}, "a tensor must be a map"),
        ({**e, "inline": {"ids": {**e["inline"]["ids"], "extra": 1}}}, "exactly dtype, shape, data"),
        ({**e, "inline": [1]}, "expected dict"),
        ("entry", "expected StepEntry, got str"),
    ]
    cases += [({**step, "entries": [m]}, msg) for m, msg in mutations]
    return cases


@pytest.mark.parametrize("obj,message", bad_wires())
def test_bad_messages_raise_message_error(obj: object, message: str) -> None:
    with pytest.raises(MessageError) as err:
        decode(pack(obj))
    assert message in str(err.value)


def test_non_string_map_keys_and_ext_types() -> None:
    step = wire(samples()[0])
    step["entries"][0]["inline"] = {b"ids": step["entries"][0]["inline"]["ids"]}
    with pytest.raises(MessageError, match="map keys must be strings"):
        decode(pack(step))
    with pytest.raises(MessageError):
        decode(msgpack.packb({1: 2}))
    with pytest.raises(MessageError):
        decode(pack({"type": "shutdown", "reason": msgpack.ExtType(1, b"x")}))
    with pytest.raises(MessageError):
        decode(pack({"type": "shutdown", "reason": msgpack.Timestamp(1, 0)}))


def test_encode_rejects_what_decode_would() -> None:
    with pytest.raises(MessageError, match="not an allowlisted"):
        encode(StepEntry("r", "t", []))  # type: ignore[arg-type]
    with pytest.raises(MessageError, match="expected int"):
        encode(Heartbeat(rank="0", seq=1))  # type: ignore[arg-type]
    with pytest.raises(MessageError, match="cannot encode"):
        encode(Heartbeat(rank=0, seq=2**70))
    big = torch.zeros(MAX_INLINE_TENSOR_BYTES // 4 + 1, dtype=torch.float32)
    with pytest.raises(MessageError, match="torch.distributed"):
        encode(StepRequest(1, "n", "p", [StepEntry("r", "t", [], {"x": big})]))
    with pytest.raises(MessageError, match="cannot travel"):
        encode(
            StepRequest(1, "n", "p", [StepEntry("r", "t", [], {"x": torch.zeros(2, dtype=torch.complex64)})])
        )
    with pytest.raises(MessageError):
        decode("not bytes")  # type: ignore[arg-type]


def _decode_or_error(data: bytes) -> None:
    """Corrupt input must decode to an allowlisted message or raise MessageError, nothing else."""
    try:
        msg = decode(data)
    except MessageError:
        return
    assert type(msg) in MESSAGE_TYPES.values()
    encode(msg)  # whatever decoded is itself a valid message


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).__name__)
def test_truncated_bytes_raise_message_error(msg: Message) -> None:
    data = encode(msg)
    for cut in range(len(data)):
        with pytest.raises(MessageError):
            decode(data[:cut])
    with pytest.raises(MessageError, match="corrupt"):
        decode(data + b"\x00")


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).__name__)
def test_every_single_bit_flip(msg: Message) -> None:
    data = encode(msg)
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        _decode_or_error(bytes(flipped))


def test_random_multi_byte_corruption() -> None:
    rng = random.Random(0)
    encoded = [encode(m) for m in samples()]
    for _ in range(3000):
        data = bytearray(rng.choice(encoded))
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        _decode_or_error(bytes(data))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(data: bytes) -> None:
    _decode_or_error(data)


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    tag=st.sampled_from([*MESSAGE_TYPES, "nope"]),
    fields=st.dictionaries(
        st.sampled_from(
            [
                "step_id",
                "node",
                "phase",
                "entries",
                "rank",
                "elapsed_s",
                "request_id",
                "tag",
                "n_tokens",
                "fork_from",
                "reason",
                "message",
                "seq",
                "inputs",
                "inline",
                "scalars",
                "kv",
                "field",
                "request_ids",
                "src_tag",
                "dst_tag",
                "copy",
                "pid",
                "nodes",
                "plan_digest",
            ]
        ),
        json_like,
        max_size=6,
    ),
)
def test_well_formed_msgpack_with_wrong_shapes(tag: str, fields: dict) -> None:
    _decode_or_error(pack({"type": tag, **fields}))


def test_the_compiled_fast_path_and_the_walk_agree() -> None:
    """`encode`/`decode` try a compiled converter per message type first and fall back to the
    annotation walk when it declines; both give the same message, and a value only the walk
    takes (a str subclass, an int where a float goes) still goes through."""
    for msg in samples():
        fields = wire_codec._fast(type(msg), True)(msg)
        assert fields == wire_codec._fields_to_wire(msg, msg.type)
        assert encode(decode(encode(msg))) == encode(msg)

    class Name(str):
        pass

    with pytest.raises(wire_codec._Decline):
        wire_codec._fast(DropTag, True)(DropTag(Name("llm"), "r", "t"))
    assert decode(encode(DropTag(Name("llm"), "r", "t"))) == DropTag("llm", "r", "t")
    result = decode(pack({"type": "step_result", "step_id": 1, "rank": 1, "entries": [], "elapsed_s": 2,
                          "waited_s": 0.5}))
    assert result.elapsed_s == 2.0 and type(result.elapsed_s) is float
