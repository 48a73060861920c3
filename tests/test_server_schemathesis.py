"""Schemathesis over `/openapi.json`: generated requests (valid and invalid) never get a 5xx.

The server serves the test family plus `tts`, `t2i` and `edit` (every OpenAI route exists);
the `slow` walk is left out because a generated `steps` would make it run for minutes.
Examples per operation are bounded (`MAX_EXAMPLES`), and so is every request (`--request-timeout`
is not used: a timeout is a 504, which this test would rightly count as a server error).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi", reason="the server needs the `serve` extra: pip install 'mstar[serve]'")
schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from test_server_support import Server, compile_plan, serving  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("MSTAR_FUZZ_EXAMPLES", "25"))  # bounded; raise it to dig deeper


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    plan = compile_plan(tmp_path_factory.mktemp("fuzz"), extra=("tts", "t2i", "edit"))
    with serving(plan) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Server):  # noqa: ANN201 - schemathesis' schema type
    return schemathesis.openapi.from_url(fuzz_server.base + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_server: Server) -> None:  # noqa: ANN001
    response = case.call(timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:  # every error has the OpenAI body, naming a field where there is one
        body = response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        if response.status_code == 400 and body["error"]["code"] not in ("invalid_json", "invalid_body"):
            assert body["error"]["param"] is not None, body  # a 400 for a bad field names it
