"""What every benchmark result records about the run that made it (scripts/ is on sys.path when a
script runs, so they `import provenance`): when, on what device, with which versions, at which
commit, by which command. BENCHMARKS.md's sections cite these.
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from importlib import metadata

import jax


def git_commit() -> str | None:
    """HEAD (`-dirty` when tracked files differ from it), or $FORKJAX_COMMIT (a copy of the tree
    whose .git is not this commit's, as on a device machine)."""
    if os.environ.get("FORKJAX_COMMIT"):
        return os.environ["FORKJAX_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=here).stdout.strip()
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=here).returncode == 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head if clean else head + "-dirty"  # tracked files differ from HEAD


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run_info(script: str, argv: list[str] | None = None, device: dict | None = None) -> dict:
    """{date, device_kind, backend, jax_version, jaxlib_version, flax_version, git_commit,
    command} of this process: `script` the benchmark's __file__, `argv` its arguments (default:
    sys.argv[1:]); `device`: {device_kind, backend} when another process runs the model (a
    server), which this one then asks nothing (asking would start a JAX backend here)."""
    if device is None:
        device = dict(device_kind=jax.devices()[0].device_kind, backend=jax.default_backend())
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                device_kind=device["device_kind"], backend=device["backend"],
                jax_version=jax.__version__, jaxlib_version=_version("jaxlib"), flax_version=_version("flax"),
                git_commit=git_commit(),
                command=shlex.join([f"scripts/{os.path.basename(script)}",
                                    *(sys.argv[1:] if argv is None else argv)]))
