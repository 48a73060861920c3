"""`read_sampling`: the one reader of a node's sampling ports (mstar_runtime/sampling/params.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from mstar_runtime.ops.node import RequestError
from mstar_runtime.sampling import REQUIRED, SamplingParams, SamplingPorts, derive_seed, read_sampling

FULL = SamplingPorts(temperature=REQUIRED, top_k=0, top_p=1.0, repetition_penalty=REQUIRED)
ENTRY = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 4, "seed": 3}


def test_reads_every_declared_port() -> None:
    assert read_sampling(ENTRY, FULL) == SamplingParams(0.7, 5, 0.9, 1.1, 3, 4)
    # one-element tensors read as their value; undeclared ports stay off; defaults fill absent ones
    entry = {"temperature": torch.tensor([0.5]), "max_tokens": torch.tensor(2), "seed": 1}
    assert read_sampling(entry, SamplingPorts()) == SamplingParams(0.5, seed=1, max_tokens=2)
    ports = SamplingPorts(top_k=0, top_p=1.0, limit="max_frames")
    assert read_sampling({"temperature": 1.0, "max_frames": 9, "seed": 2}, ports) == SamplingParams(
        1.0, 0, 1.0, seed=2, max_tokens=9)


def test_a_request_without_a_seed_gets_one_once() -> None:
    params = read_sampling({"temperature": 1.0, "max_tokens": 1}, SamplingPorts())
    assert isinstance(params.seed, int)


def test_do_sample_false_is_greedy() -> None:
    ports = SamplingPorts(do_sample="do_sample")
    assert read_sampling({"temperature": 0.9, "max_tokens": 1, "seed": 0, "do_sample": False}, ports).greedy
    assert not read_sampling({"temperature": 0.9, "max_tokens": 1, "seed": 0}, ports).greedy


def test_fixed_top_k_applies_to_sampled_requests_only() -> None:
    ports = SamplingPorts(fixed_top_k=50)
    assert read_sampling({"temperature": 0.4, "max_tokens": 1, "seed": 0}, ports).top_k == 50
    assert read_sampling({"temperature": 0.0, "max_tokens": 1, "seed": 0}, ports).top_k == 0
    with pytest.raises(ValueError, match="no top_k port"):
        SamplingPorts(top_k=0, fixed_top_k=50)


def test_stream_derives_the_seed() -> None:
    params = read_sampling(ENTRY, FULL)
    assert params.stream(1).seed == derive_seed(3, 1)
    assert params.stream(1).seed != params.stream(2).seed
    assert dataclasses.replace(params.stream(1), seed=3) == params  # only the seed changes


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
        ({"max_tokens": None}, "max_tokens", "input 'max_tokens' is missing"),
        ({"temperature": None}, "temperature", "input 'temperature' is missing"),
        ({"temperature": -1.0}, "temperature", "temperature must be a finite number >= 0"),
        ({"top_k": None}, "top_k", "input 'top_k' is missing"),
        ({"top_k": 1.5}, "top_k", "must be an integer"),
        ({"top_p": 0.0}, "top_p", "top_p must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "repetition_penalty must be"),
        ({"seed": 1.5}, "seed", "must be an integer"),
    ],
)
def test_bad_settings_name_the_field(change: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        read_sampling({**ENTRY, **change}, FULL)
    assert err.value.field == field


def test_finite_refuses_an_infinite_temperature_as_a_malformed_port() -> None:
    with pytest.raises(RequestError, match="input 'temperature' must be a finite number") as err:
        read_sampling({**ENTRY, "temperature": float("inf")}, SamplingPorts(finite=True))
    assert err.value.field == "temperature"
