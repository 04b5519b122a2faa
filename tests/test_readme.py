"""README.md's Python examples run as printed and print what their comments say.

Every ```python block of README.md runs as a script in a fresh interpreter (cwd the repository
root, the root on PYTHONPATH, JAX_PLATFORMS=cpu) and must exit 0. A comment that states the
output is checked against the script's stdout:

    print(x)            # -> TEXT           (a `# -> TEXT` comment on a line that calls print)
    ...                 # prints TEXT
    # prints:                               (each following full-line comment is a printed line)
    # TEXT

TEXT must occur in stdout, within one line; `...` in it stands for any text.

The examples that talk to a server with the `openai` client, and every ```bash block that calls
`curl`, run against a real `python -m forkjax.serve`, started as the README's quick start starts
it: `make serve`'s flags (from the Makefile) and the ARGS of the README's first `make serve` line
(none), with two substitutions: `--port 0` (a free port) instead of the port the reader's server
listens on (its --port, else the server's default), and `--warmup none` (the request compiles
only the programs it needs instead of competing with a background warm-up for two cores; warm-up
changes when programs compile, not what they compute). The examples' address,
`http://127.0.0.1:<that port>`, is replaced by the server's. A curl block runs in bash (-e, -o
pipefail); its full-line comments `# prints TEXT` (or `# prints:` and the lines below) state its
output as above.

The compile cache is the repository's .cache/jax, as for the other tests
($JAX_COMPILATION_CACHE_DIR wins). XLA_FLAGS loses the optimisation level that conftest.py lowers
for the suite's compiles: the examples run their steps as a user runs them.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tokenize
from pathlib import Path

import httpx
import pytest

from forkjax.serve import build_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SNIPPET_TIMEOUT_S = 600
STARTUP_S = 300


def snippets(language: str = "python") -> list[tuple[str, str]]:
    """[(id: the section's heading as an anchor, code)] of README's ```LANGUAGE blocks."""
    out, heading = [], "top"
    for m in re.finditer(r"^(#+ [^\n]*)$|^```(\w*)\n(.*?)^```$", README, re.M | re.S):
        if m[1]:
            heading = re.sub(r"[^a-z0-9]+", "-", m[1].lstrip("#").strip().lower()).strip("-")
        elif m[2] == language:
            out.append((heading, m[3]))
    return out


def stated_outputs(code: str, shell: bool = False) -> list[str]:
    """The printed lines the snippet's comments state (module docstring: the forms); `shell`:
    a bash block, whose full-line comments count."""
    lines = code.splitlines()
    comments: dict[int, str] = {}
    printing: set[int] = set()
    if shell:
        comments = {n: line.strip()[1:].strip() for n, line in enumerate(lines, 1)
                    if line.lstrip().startswith("#")}
    else:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string[1:].strip()
            elif tok.type == tokenize.NAME and tok.string == "print":
                printing.add(tok.start[0])
    out, block = [], False
    for n in range(1, len(lines) + 1):
        text = comments.get(n)
        full_line = text is not None and lines[n - 1].lstrip().startswith("#")
        if block and full_line:
            out.append(text)
            continue
        block = False
        if text is None:
            continue
        if text == "prints:" and full_line:
            block = True
        elif m := re.match(r"prints\s+(.+)", text):
            out.append(m[1])
        elif n in printing and (m := re.match(r"->\s*(.+)", text)):
            out.append(m[1])
    return out


def _pattern(text: str) -> re.Pattern:
    return re.compile(".*?".join(re.escape(part) for part in text.split("...")))


def _env() -> dict[str, str]:
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
               PYTHONPATH=os.pathsep.join(path))
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".cache" / "jax"))
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_backend_optimization_level")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


def run_snippet(code: str, shell: bool = False) -> str:
    """Run `code` as a script (`shell`: a bash one); assert it exits 0 and prints what its
    comments say; -> stdout."""
    t0 = time.time()
    argv = ["bash", "-euo", "pipefail", "-c", code] if shell else [sys.executable, "-c", code]
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=SNIPPET_TIMEOUT_S)
    print(f"ran in {time.time() - t0:.1f} s:\n{proc.stdout}")
    assert proc.returncode == 0, (f"exit status {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    for text in stated_outputs(code, shell):
        assert any(_pattern(text).search(line) for line in proc.stdout.splitlines()), (
            f"the README says it prints {text!r}; it printed:\n{proc.stdout}")
    return proc.stdout


SNIPPETS = snippets()
SERVING = [code for _, code in SNIPPETS if re.search(r"openai\.(Async)?OpenAI\(", code)]
CURL = [code for _, code in snippets("bash") if re.search(r"^curl ", code, re.M)]


def test_readme_has_examples():
    ids = [i for i, _ in SNIPPETS]
    assert len(SNIPPETS) >= 3 and SERVING and CURL, ids
    assert all(stated_outputs(code) for code in SERVING), "the serving example states no output"
    assert all(stated_outputs(code, shell=True) for code in CURL), "a curl example states no output"


@pytest.mark.parametrize("code", [c for _, c in SNIPPETS if c not in SERVING],
                         ids=[i for i, c in SNIPPETS if c not in SERVING])
def test_example_runs_as_printed(code):
    run_snippet(code)


def server_args() -> tuple[list[str], str]:
    """(`python -m forkjax.serve` arguments of the README's first `make serve` line, the port
    that its server listens on)."""
    make = re.search(r"-m forkjax\.serve (.*?)\s*\$\(ARGS\)", (REPO / "Makefile").read_text())
    assert make, "Makefile: no `forkjax.serve ... $(ARGS)` line"
    readme = re.search(r'^make serve(?: ARGS="([^"]*)")?(?:\s|$)', README, re.M)
    assert readme, "README: no `make serve` line"
    args = shlex.split(make[1]) + shlex.split(readme[1] or "")
    if "--port" not in args:
        args += ["--port", str(build_parser().get_default("port"))]
    port = args[args.index("--port") + 1]
    args[args.index("--port") + 1] = "0"
    return args + ["--warmup", "none"], port


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The server of the README's first `make serve` line: yields its base URL (…/v1)."""
    args, _ = server_args()
    log = tmp_path_factory.mktemp("readme_serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "forkjax.serve", *args], cwd=REPO,
                                env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + STARTUP_S
        while (m := re.search(r"forkjax: ready: .* at (http://\S+/v1)", log.read_text())) is None:
            tail = log.read_text()[-4000:]
            assert proc.poll() is None, f"server exited {proc.returncode}:\n{tail}"
            assert time.time() < deadline, f"server not ready in {STARTUP_S} s:\n{tail}"
            time.sleep(0.2)
        url = m[1]
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=30).status_code == 200
        yield url
        assert proc.poll() is None, f"the server died:\n{log.read_text()[-4000:]}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("code", SERVING, ids=[i for i, c in SNIPPETS if c in SERVING])
def test_serving_example(readme_server, code):
    """An `openai` example against the quick start's server, at that server's real address."""
    _, port = server_args()
    readme_url = f"http://127.0.0.1:{port}/v1"
    assert readme_url in code, f"the serving example does not use the server at {readme_url}"
    run_snippet(code.replace(readme_url, readme_server))


@pytest.mark.parametrize("code", CURL)
def test_curl_example(readme_server, code):
    """A curl example against the quick start's server, at that server's real address."""
    _, port = server_args()
    readme_base = f"http://127.0.0.1:{port}/"
    assert readme_base in code, f"the curl example does not use the server at {readme_base}"
    run_snippet(code.replace(readme_base, readme_server.removesuffix("v1")), shell=True)
