"""A running server (serve_utils.py) under schema-driven fuzzing, and the ReAct agents example
against it."""

from __future__ import annotations

import subprocess
import sys

import httpx

from serve_utils import AUTH, CONTEXT, DEMO, KEY, REPO


def test_fuzz_openapi_schema_finds_no_5xx(server):
    """Schemathesis generates requests from the server's own OpenAPI schema, inside it (positive)
    and outside it (negative); none may get a 5xx. Budgets are capped so a case is milliseconds."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    seen: dict[int, int] = {}

    def tame(case):
        body = case.body
        if isinstance(body, dict):
            for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if type(body.get(field)) is int and 8 < body[field] <= CONTEXT:
                    body[field] = 8
            if "messages" in body and not body.get("max_tokens") and not body.get("max_completion_tokens"):
                body["max_completion_tokens"] = 8
            if "input" in body and not body.get("max_output_tokens"):  # /v1/responses
                body["max_output_tokens"] = 8
            if type(body.get("n")) is int and 2 < body["n"] <= 64:
                body["n"] = 2
            if body.get("lora_name") in DEMO:  # keep the other tests' adapters
                body["lora_name"] = f"fuzz-{body['lora_name']}"

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @settings(max_examples=120, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(generation_mode=mode))
        def fuzz(case):
            tame(case)
            r = case.call(base_url=server.url, headers=AUTH, timeout=60)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (case.method, case.path, case.body, r.text)
        fuzz()
    assert sum(seen.values()) >= 200, seen
    assert any(s < 300 for s in seen) and any(400 <= s < 500 for s in seen), seen
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_react_agents_example_runs(server):
    run = subprocess.run([sys.executable, str(REPO / "examples" / "react_agents.py"), "--base-url",
                          f"{server.url}/v1", "--api-key", KEY, "--tiny-llama", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for turn, agent in enumerate(DEMO, 1):
        assert f"--- turn {turn}: {agent}" in run.stdout
    assert "=== prefix cache hit rate: base" in run.stdout
