"""Helpers of the forkjax_* lm_eval tasks (loaded by lm_eval through `!function utils.NAME`).

The data are small hand-written JSONL files in data/, found relative to this file, so the
tasks work from any working directory (a `dataset_path: json` + `data_files` task would resolve
the path against the cwd).

Every prompt starts with the same few-shot PREAMBLE (69 SmolLM2 tokens; prompts are 80-85
tokens, about 5 full KV pages of 16 tokens): requests of one agent share it, and a second agent
scoring the same task reads the first agent's cached pages of it (and of every whole prompt),
which is where the cache policies differ.
"""

import json
import os

import datasets

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

PREAMBLE = (
    "Answer with one word or number.\n\n"
    "Question: What color is a banana?\nAnswer: yellow\n\n"
    "Question: What is 2 plus 3?\nAnswer: 5\n\n"
    "Question: What is the opposite of hot?\nAnswer: cold\n\n"
    "Question: What is the capital of Italy?\nAnswer: Rome\n\n"
)


def _load(name: str, **_ignored) -> datasets.DatasetDict:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mc(**kwargs) -> datasets.DatasetDict:
    """lm_eval calls custom_dataset with the task's metadata and dataset_kwargs as keywords."""
    return _load("mc.jsonl")


def load_gen(**kwargs) -> datasets.DatasetDict:
    return _load("gen.jsonl")


def doc_to_text(doc: dict) -> str:
    return f"{PREAMBLE}Question: {doc['question']}\nAnswer:"
