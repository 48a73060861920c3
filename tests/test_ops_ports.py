"""mstar_runtime.ops.ports: config values, the max_seq_len setting, scalar ports and their errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from mstar_runtime.ops.node import NodeError, NodeSpec, RequestError
from mstar_runtime.ops.ports import DEFAULT_MAX_SEQ_LEN, config_value, max_seq_len, scalar


def _spec(arch: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
          settings: dict[str, Any] | None = None) -> NodeSpec:
    return NodeSpec("lm", "kv", config or {}, arch or {}, settings or {}, torch.float32, torch.device("cpu"))


def test_config_value_prefers_the_arch_argument_then_keys_then_the_name() -> None:
    spec = _spec(arch={"hidden": 8}, config={"hidden": 16, "talker_k": 2, "k": 3})
    assert config_value(spec, "hidden") == 8
    assert config_value(spec, "k", keys=("talker_k",)) == 2
    assert config_value(spec, "k") == 3
    assert config_value(spec, "absent", 5) == 5
    assert config_value(spec, "absent", None) is None  # None is a real default, not "required"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "node 'lm': config value 'layers' is missing"),
        ({"owner": "LlamaBackbone"}, "node 'lm' (LlamaBackbone): config value 'layers' is missing"),
        ({"note": " (neither an arch argument nor config)"},
         "node 'lm': config value 'layers' is missing (neither an arch argument nor config)"),
    ],
)
def test_config_value_names_the_node_when_missing(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(NodeError) as e:
        config_value(_spec(), "layers", **kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize(("value", "want"), [(None, DEFAULT_MAX_SEQ_LEN), (128, 128), (0, DEFAULT_MAX_SEQ_LEN),
                                             (True, DEFAULT_MAX_SEQ_LEN), (64.0, DEFAULT_MAX_SEQ_LEN)])
def test_max_seq_len_reads_a_positive_int_else_the_default(value: Any, want: int) -> None:
    settings = {} if value is None else {"max_seq_len": value}
    assert max_seq_len(_spec(settings=settings)) == want


def test_scalar_reads_numbers_and_one_element_tensors() -> None:
    entry = {"n": torch.tensor([3]), "t": 0.5, "i": 2, "flag": torch.tensor(True)}
    assert scalar(entry, "n", int) == 3 and isinstance(scalar(entry, "n", int), int)
    assert scalar(entry, "i", float) == 2.0 and isinstance(scalar(entry, "i", float), float)
    assert scalar(entry, "t", float, finite=True) == 0.5
    assert scalar(entry, "flag", bool) is True
    assert scalar(entry, "absent", int, 7, required=True) == 7


@pytest.mark.parametrize(
    ("entry", "kind", "kwargs", "message"),
    [
        ({"x": True}, int, {}, "input 'x' must be an integer, got True"),
        ({"x": 1.5}, int, {}, "input 'x' must be an integer, got 1.5"),
        ({"x": "1"}, float, {}, "input 'x' must be a number, got '1'"),
        ({}, int, {}, "input 'x' must be an integer, got None"),
        ({}, int, {"required": True}, "input 'x' is missing"),
        ({"x": math.inf}, float, {"finite": True}, "input 'x' must be a finite number, got inf"),
        ({"x": "no"}, bool, {}, "input 'x' must be a bool, got 'no'"),
    ],
)
def test_scalar_refuses_bad_values_naming_the_port(entry: dict[str, Any], kind: type, kwargs: dict[str, bool],
                                                   message: str) -> None:
    with pytest.raises(RequestError) as e:
        scalar(entry, "x", kind, **kwargs)
    assert str(e.value) == message and e.value.field == "x"


def test_an_infinite_float_passes_without_finite() -> None:
    assert scalar({"x": math.inf}, "x", float) == math.inf
