"""Helpers of the agent framework tests (test_agents_*.py): what a framework sends to the server,
recorded, and the small bounded types their agents answer with.

tiny-llama's weights are random, so the tests check the protocol, not the answers: the turns are
constrained (a named or required tool choice, a JSON schema) and bounded (enums, numbers with a
range), so they end where their JSON does rather than at max_tokens, whatever the model prefers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Literal

import httpx
import jsonschema
from pydantic import BaseModel, Field

from serve_utils import KEY, REPO

AGES = {"Ana": 34, "Ben": 52}


class Entry(BaseModel):
    """A staff entry: short enough for any max_tokens here, whatever the model picks."""
    name: Literal["Ana", "Ben"]
    age: int = Field(ge=0, le=99)


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]


def lookup_age(name: Literal["Ana", "Ben"]) -> int:
    """The age of a person in the staff directory."""
    return AGES[name]


class Recorder:
    """What a framework's client sends and gets, through httpx event hooks: the JSON body of each
    POST in order, and the `model` of each whole JSON answer (a stream's events are left to the
    client: reading them here would end its streaming)."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.answered: list[str] = []

    def _request(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))

    def _answer(self, response: httpx.Response) -> None:  # its body already read
        self.answered.append(response.json().get("model"))

    @staticmethod
    def _whole(response: httpx.Response) -> bool:
        return response.headers.get("content-type", "").startswith("application/json")

    def client(self) -> httpx.Client:
        def answer(response):
            if self._whole(response):
                response.read()
                self._answer(response)
        return httpx.Client(event_hooks={"request": [self._request], "response": [answer]}, timeout=120)

    def async_client(self) -> httpx.AsyncClient:
        async def request(r):
            self._request(r)

        async def answer(response):
            if self._whole(response):
                await response.aread()
                self._answer(response)
        return httpx.AsyncClient(event_hooks={"request": [request], "response": [answer]}, timeout=120)

    @property
    def models(self) -> list[str]:
        return [b["model"] for b in self.bodies]

    def check_call(self, name: str, arguments: dict | str) -> dict:
        """A call of tool `name` -> its arguments (a dict or JSON text) as a dict, checked against
        the parameters schema the framework sent for it (chat's `function` or Responses' flat
        tool)."""
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        for body in self.bodies:
            for tool in body.get("tools", ()):
                spec = tool.get("function", tool)
                if spec.get("name") == name:
                    jsonschema.validate(args, spec["parameters"])
                    return args
        raise AssertionError(f"no tool {name!r} was sent")


def run_example(script: str, server, *args: str) -> str:
    """examples/`script` against `server` as its docstring prints it -> its stdout (it must exit 0)."""
    run = subprocess.run([sys.executable, str(REPO / "examples" / script), "--base-url",
                          f"{server.url}/v1", "--api-key", KEY, *args],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout
