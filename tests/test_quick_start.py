"""The default server gives a second agent a full hit: `examples/shared_context.py`, as the
README's quick start runs it, against a server with the default cache policy and fan-out (only
sized for the CPU). The first agent computes the shared directory; the second reads all of its
whole pages from the cache, although its adapter differs, and says so in `usage`."""

from __future__ import annotations

import re

import pytest
from framework_utils import run_example
from serve_utils import KEY, serve

ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-bytes", "8M", "--warmup", "none",
        "--api-key", KEY, "--host", "127.0.0.1", "--port", "0"]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    yield from serve(tmp_path_factory, ARGS)


def test_a_second_agent_reads_the_first_agents_context_from_the_cache(default_server):
    out = run_example("shared_context.py", default_server, "--agents", "planner,coder", "--entries", "4",
                      "--max-tokens", "4")
    usage = {agent: (int(n), int(cached)) for agent, n, cached in
             re.findall(r"^(\w+): [\d.]+ s, (\d+) prompt tokens, (\d+) cached", out, re.M)}
    (n1, cached1), (n2, cached2) = usage["planner"], usage["coder"]
    assert cached1 <= 1, out  # its BOS at most: nothing else of the directory was cached
    context = len("Staff directory:\n") + 4 * 40  # bytes: 4 entries of 40 or more
    assert cached2 >= context // 16 * 16 - 16 and cached2 < n2, out  # the directory's whole pages
    assert "coder read" in out
