"""`python -m forkjax.serve` refuses out-of-range numbers before it loads anything: exit status 2
and one line on stderr that names the flag and says what it expects."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from serve_utils import REPO

from forkjax.serve import NUMBER_FLAGS, CoreClient, engine_kwargs, main, parse_args

PROG = "python -m forkjax.serve: error: "

# (argv, what the error line says after PROG)
BAD = [
    (["--port", "99999"], "--port 99999: expected a TCP port, 0 to 65535"),
    (["--port", "-1"], "--port -1: expected a TCP port"),
    (["--max-model-len", "-5"], "--max-model-len -5: expected a context length >= 1"),
    (["--max-model-len", "0"], "--max-model-len 0: expected a context length >= 1"),
    (["--max-batch-size", "0"], "--max-batch-size 0: expected an int >= 1"),
    (["--max-prefill-tokens", "-2048"], "--max-prefill-tokens -2048: expected an int >= 1"),
    (["--page-size", "0"], "--page-size 0: expected an int >= 1"),
    (["--max-loras", "0"], "--max-loras 0: expected an int >= 1"),
    (["--max-lora-rank", "0"], "--max-lora-rank 0: expected an int >= 1"),
    (["--max-cpu-loras", "0"], "--max-cpu-loras 0: expected an int >= 1"),
    (["-tp", "0"], "--tensor-parallel-size 0: expected a number of devices >= 1"),
    (["--kv-cache-bytes", "0"], "--kv-cache-bytes 0: expected a size > 0"),
    (["--kv-cache-bytes", "0.4"], "--kv-cache-bytes 0: expected a size > 0"),  # rounds to 0 bytes
    (["--max-request-bytes", "0M"], "--max-request-bytes 0: expected a size > 0"),
    (["--seed", "-1"], "--seed -1: expected an int in [0, 2**63)"),
    (["--seed", str(2**64)], f"--seed {2**64}: expected an int in [0, 2**63)"),
    (["--residual-fraction", "1"], "--residual-fraction 1.0: expected a fraction strictly between 0 and 1"),
    (["--residual-fraction", "0"], "--residual-fraction 0.0: expected a fraction"),
    (["--residual-fraction", "nan"], "--residual-fraction nan: expected a fraction"),
    (["--residual-copies", "0"], "--residual-copies 0: expected an int >= 1"),
    (["--max-fanout-adapters", "-1"], "--max-fanout-adapters -1: expected an int >= 0"),
    (["--session-ttl", "inf"], "--session-ttl inf: expected finite seconds >= 0"),
    (["--body-timeout", "0"], "--body-timeout 0.0: expected finite seconds > 0"),
    (["--body-timeout", "nan"], "--body-timeout nan: expected finite seconds > 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout -1.0: expected finite seconds >= 0"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout inf: expected finite seconds >= 0"),
]


def test_every_numeric_flag_is_checked():
    checked = {"--tensor-parallel-size" if argv[0] == "-tp" else argv[0] for argv, _ in BAD}
    assert checked == {f"--{name.replace('_', '-')}" for name in NUMBER_FLAGS}


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(argv) for argv, _ in BAD])
def test_bad_number_is_refused_in_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(CoreClient, "spawn", lambda *a, **kw: pytest.fail("started the engine"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == ""
    assert out.err.startswith(PROG + message) and out.err.count("\n") == 1, out.err


@pytest.mark.parametrize("argv", [["--port", "0"], ["--port", "65535"], ["--shutdown-timeout", "0"],
                                  ["--residual-fraction", "0.5"], ["--seed", "7"], ["--max-model-len", "1"],
                                  ["--kv-cache-bytes", "1"], ["--session-ttl", "0"], ["--host-kv-bytes", "0"]])
def test_edge_values_pass_the_check(argv, monkeypatch):
    def spawn(model, kwargs, **spec):
        raise ValueError("checked")
    monkeypatch.setattr(CoreClient, "spawn", spawn)
    with pytest.raises(SystemExit, match="forkjax.serve: error: checked"):
        main([*argv, "--compilation-cache-dir", ""])


def test_adapter_and_parallelism_flags_reach_the_engine():
    seen = engine_kwargs(parse_args(["--max-loras", "4", "--max-cpu-loras", "64", "--pinned-lora", "a",
                                     "--pinned-lora", "b", "-tp", "2"]))
    assert (seen["max_loras"], seen["max_cpu_loras"], seen["pinned_adapters"]) == (4, 64, ["a", "b"])
    assert seen["tensor_parallel_size"] == 2


def test_the_command_refuses_bad_numbers_before_loading():
    """The real command line, one process per case (side by side: each spends seconds importing
    JAX before it parses its flags); main() above runs the same checks for every flag."""
    cases = BAD[:4]  # --port 99999, --port -1, --max-model-len -5, --max-model-len 0
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-m", "forkjax.serve", *argv], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv, _ in cases]
    for (argv, message), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == "", (argv, out, err)
        assert err.splitlines() == [err.strip()] and err.startswith(PROG + message), (argv, err)
