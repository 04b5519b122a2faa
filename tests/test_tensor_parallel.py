"""The tensor-parallel cases (tensor_parallel_cases.py) under pytest in a process of their own: in a
suite worker that had compiled hundreds of one-device programs, XLA's CPU compiler crashed
(SIGSEGV) compiling the first 2-device program, and serializing one into the persistent cache
crashed another; the same cases pass in a fresh process, whatever the cache holds."""

import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_tensor_parallel_cases_in_a_process_of_their_own():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(HERE / "tensor_parallel_cases.py")],
                         cwd=HERE.parent, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
    assert " passed" in run.stdout.splitlines()[-1] and "failed" not in run.stdout.splitlines()[-1]
