"""The built-in agents' fidelity tasks as JSONL for `python -m forkjax.fidelity`: questions about
staff directories (forkjax/workflows/tasks.py) for SmolLM2-135M-Instruct's trained agents.

    python scripts/fidelity_tasks.py --contexts 1024 --tasks 3 --out /tmp/tasks.jsonl
    R=forkjax/models/adapters/smollm2-135m
    python -m forkjax.fidelity --model smollm2-135m --lora caller=$R/caller --lora critic=$R/critic \\
        --lora extractor=$R/extractor --prompts /tmp/tasks.jsonl --out /tmp/fidelity
"""

from __future__ import annotations

import argparse
import json

from forkjax.models.builtin import trained_adapters
from forkjax.models.gguf import GGUFCheckpoint, packaged_path
from forkjax.workflows.tasks import fidelity_lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024", help="directory lengths in tokens, comma-separated")
    ap.add_argument("--directories", type=int, default=1, help="directories per length")
    ap.add_argument("--tasks", type=int, default=3, help="questions per reader and directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="tasks.jsonl")
    args = ap.parse_args(argv)
    tokenizer = GGUFCheckpoint(packaged_path("smollm2-135m")).tokenizer().tok
    roles = list(trained_adapters("smollm2-135m"))
    lines = fidelity_lines(tokenizer, roles, [int(c) for c in args.contexts.split(",")],
                           args.directories, args.tasks, args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    print(f"{len(lines)} tasks for {', '.join(roles)} -> {args.out}")


if __name__ == "__main__":
    main()
