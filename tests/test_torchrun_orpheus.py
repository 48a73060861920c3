"""Orpheus (tiny) over two torchrun agents on 127.0.0.1: the same codes and audio as one rank.

The 2-rank plan (tests/placements/cpu2_hosts2.yaml) splits it by stage across the hosts:
the backbone on rank 0, SNAC on rank 1 (host 1), so every released window of codes crosses
hosts and its PCM comes back. The 3-rank plan (cpu3_hosts2.yaml) puts the backbone at tp 2
on host 0's two ranks (a Gloo TP group inside the host) and SNAC on host 1. Each job serves
one sampled and one greedy request over HTTP, compared with the same requests on one rank
in this process; then a SIGTERM to rank 0 ends every process with 0. Helpers:
tests/test_torchrun.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_torchrun import Job, compile_plan, free_port, serve_and_compare

pytestmark = pytest.mark.usefixtures("one_thread")

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("tts", {"text": "Hello there, this is M star.", "voice": "tara", "max_tokens": 60, "seed": 1}),
    ("tts", {"text": "A greedy one.", "voice": "leo", "max_tokens": 45, "temperature": 0.0, "seed": 2}),
]


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Path]]:
    out = tmp_path_factory.mktemp("plans")
    yield {n: compile_plan(out, "orpheus", p) for n, p in
           ((1, "placements/cpu.yaml"), (2, "tests/placements/cpu2_hosts2.yaml"),
            (3, "tests/placements/cpu3_hosts2.yaml"))}


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    made: list[Job] = []
    yield made
    for job in made:
        job.kill_all()


@pytest.mark.parametrize("world,nprocs", [
    (2, (1, 1)),  # the backbone on rank 0: its decode loop is a cohort, as on one rank
    (3, (2, 1)),  # at tensor parallelism every rank of the group runs the cohort step
])
def test_orpheus_on_two_hosts_speaks_as_one_rank(plans: dict[int, Path], tmp_path: Path, jobs: list[Job],
                                                 world: int, nprocs: tuple[int, int]) -> None:
    port = free_port()
    job = Job(tmp_path, plans[world], nprocs, ["--serve", "--port", str(port)])
    jobs.append(job)
    served = serve_and_compare(job, port, plans[1], REQUESTS)
    # at least one SNAC window each, so the cross-host stream and its audio were compared too
    assert all(len(o["codes"]) >= 28 and o["audio"]["samples"] > 0 for o in served)
