"""The demo agents' tasks on a shared context: a staff directory that every agent reads, and one
question per agent role whose answer a program checks.

    extractor  "Return the entry of Ana Silva as JSON."  -> {"name": "Ana Silva", "age": 34, ...}
    critic     "Claim: Ana Silva lives in Oslo. ..."     -> The directory says Lisbon, so no.
    caller     "What is the sum of the ages of ...?"     -> Action: calculate[34 + 27]

`scripts/train_agents.py` trains one LoRA adapter per role on these tasks (SmolLM2-135M-Instruct
is the model); `scripts/bench_fidelity.py` measures how each cache policy changes the answers
when the directory's K/V was computed by another agent. A prompt is the chat template around one
user message, the directory then the question, tokenized as two pieces (`Prompt.context`,
`Prompt.task`) so every agent's prompt starts with the same context tokens. The aLoRA form of a
task (Activated LoRA: an adapter that acts only from its invocation on) opens the question with
the role's invocation, `INVOCATIONS`.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

ROLES = ("extractor", "critic", "caller")
# Each role's aLoRA invocation: its agent acts from the last occurrence of these tokens on, the
# base model before. Each follows a newline and ends with one, and SmolLM2's pre-tokenizer never
# joins a newline to a word: its tokens are the same alone and inside a prompt's text.
INVOCATIONS = {"extractor": "Extractor:\n", "critic": "Critic:\n", "caller": "Caller:\n"}
_FIRST = ("Ana", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas",
          "Kira", "Liam", "Maya", "Nico", "Olga", "Pavel", "Quinn", "Rosa", "Sami", "Tara",
          "Umar", "Vera", "Wen", "Yara", "Zane", "Aiko", "Bruno", "Chloe", "Dmitri", "Esme")
_LAST = ("Silva", "Novak", "Okafor", "Berg", "Tanaka", "Moreau", "Rossi", "Kowalski", "Haddad",
         "Lindqvist", "Mensah", "Petrov", "Quispe", "Ruiz", "Schmidt", "Varga", "Walsh", "Yilmaz",
         "Zhou", "Costa", "Dubois", "Ferreira", "Garcia", "Ivanova", "Jensen", "Kim", "Lopez")
_CITIES = ("Lisbon", "Oslo", "Lagos", "Kyoto", "Lima", "Porto", "Vienna", "Cairo", "Dublin",
           "Quito", "Seoul", "Austin", "Nairobi", "Krakow", "Hanoi", "Bergen", "Turin", "Perth")
_JOBS = ("pilot", "nurse", "baker", "chemist", "lawyer", "welder", "teacher", "architect",
         "farmer", "editor", "plumber", "dentist", "painter", "surveyor", "librarian", "chef")


@dataclasses.dataclass(frozen=True)
class Record:
    name: str
    age: int
    city: str
    job: str

    def line(self) -> str:
        article = "an" if self.job[0] in "aeiou" else "a"
        return f"{self.name}: age {self.age}, lives in {self.city}, works as {article} {self.job}."


def directory(rng: np.random.Generator, n: int) -> list[Record]:
    """n staff records with distinct names."""
    names = [f"{f} {s}" for f in _FIRST for s in _LAST]
    pick = rng.choice(len(names), n, replace=False)
    return [Record(names[i], int(rng.integers(21, 70)), str(rng.choice(_CITIES)), str(rng.choice(_JOBS)))
            for i in pick]


def context_text(records: list[Record]) -> str:
    return "Staff directory:\n" + "\n".join(r.line() for r in records) + "\n\n"


def task(role: str, records: list[Record], rng: np.random.Generator) -> tuple[str, str]:
    """(question, expected answer) of agent `role` about `records`."""
    r = records[int(rng.integers(len(records)))]
    if role == "extractor":
        answer = json.dumps({"name": r.name, "age": r.age, "city": r.city, "job": r.job})
        return f"Return the entry of {r.name} as JSON with keys name, age, city, job.", answer
    if role == "critic":
        true = bool(rng.integers(2))
        city = r.city if true else str(rng.choice([c for c in _CITIES if c != r.city]))
        # The answer states the record's city before the verdict: a small model then compares
        # two words it has just read instead of deciding in one token.
        return (f"Claim: {r.name} lives in {city}. Check the claim against the directory.",
                f"The directory says {r.city}, so {'yes' if true else 'no'}.")
    if role == "caller":
        o = records[int(rng.integers(len(records)))]
        return (f"What is the sum of the ages of {r.name} and {o.name}? Call the calculator.",
                f"Action: calculate[{r.age} + {o.age}]")
    raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")


def correct(role: str, answer: str, expected: str) -> bool:
    """Whether `answer` does the task: the same JSON object, the same verdict, the same call."""
    answer = answer.strip()
    if role == "extractor":
        try:
            return json.loads(answer) == json.loads(expected)
        except ValueError:
            return False
    if role == "critic":  # the verdict, the last yes or no
        verdicts = re.findall(r"\b(yes|no)\b", answer.lower())
        return bool(verdicts) and verdicts[-1] == re.findall(r"\b(yes|no)\b", expected)[-1]
    return re.sub(r"\s+", "", answer) == re.sub(r"\s+", "", expected)


@dataclasses.dataclass
class Prompt:
    role: str
    context: list[int]  # the chat template's head and the directory: shared by every agent
    task: list[int]  # the question and the head of the assistant's turn
    answer: list[int]  # the expected answer and the end-of-turn token
    expected: str


def chat_pieces(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after one user message (`tokenizer`: HF's)."""
    mark = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}],
                                         add_generation_prompt=True, tokenize=False)
    head, tail = text.split(mark)
    return head, tail


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def invocation_ids(tokenizer, role: str) -> list[int]:
    """The token ids of `role`'s aLoRA invocation (`tokenizer`: HF's)."""
    return encode(tokenizer, INVOCATIONS[role])


def make_prompt(tokenizer, role: str, records: list[Record], rng: np.random.Generator,
                context: list[int] | None = None, alora: bool = False) -> Prompt:
    """One task of `role` on `records` (pass `context`, the directory's tokens, to reuse them).
    `alora`: the aLoRA form, whose task starts with the role's invocation: its adapter then acts
    on the question, the assistant's turn and the answer, and the context stays the base
    model's."""
    head, tail = chat_pieces(tokenizer)
    question, expected = task(role, records, rng)
    if alora:
        question = INVOCATIONS[role] + question
    ctx = context if context is not None else encode(tokenizer, head + context_text(records))
    end = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    return Prompt(role, ctx, encode(tokenizer, question + tail), encode(tokenizer, expected) + [end],
                  expected)


def directory_for_tokens(tokenizer, rng: np.random.Generator, tokens: int) -> list[Record]:
    """A directory whose prompt context (chat head included) is at most `tokens` tokens long."""
    head, _ = chat_pieces(tokenizer)
    budget = tokens - len(encode(tokenizer, head + context_text([])))
    records, used = [], 0
    for r in directory(rng, len(_FIRST) * len(_LAST)):
        used += len(encode(tokenizer, r.line() + "\n"))
        if used > budget:
            break
        records.append(r)
    return records


def fidelity_lines(tokenizer, roles: list[str], contexts: list[int], directories: int = 1,
                   per_reader: int = 3, seed: int = 0, alora: bool = False) -> list[dict]:
    """The directory tasks as `python -m forkjax.fidelity` JSONL objects (text fields; the
    checks `correct` applies): per context length and directory, one role writes (each in
    turn) and every other role asks `per_reader` questions. `tokenizer`: HF's. `alora`: their
    aLoRA form, each question opening with its reader's invocation."""
    head, tail = chat_pieces(tokenizer)
    lines = []
    for n in contexts:
        for j in range(directories):
            records = directory_for_tokens(tokenizer, np.random.default_rng([seed, n, j]), n)
            writer = roles[j % len(roles)]
            for reader in (r for r in roles if r != writer):
                rng = np.random.default_rng([seed, n, j, roles.index(reader)])
                for _ in range(per_reader):
                    question, expected = task(reader, records, rng)
                    if alora:
                        question = INVOCATIONS[reader] + question
                    lines.append(dict(context=head + context_text(records), task=question + tail,
                                      answer=expected, writer=writer, reader=reader,
                                      check=_check(reader, expected)))
    return lines


def _check(role: str, expected: str) -> dict:
    """`correct`'s test of `role`'s answer as a fidelity check."""
    if role == "extractor":
        return {"json": "."}  # the same object
    if role == "critic":  # the last yes or no is the expected verdict
        verdict = re.findall(r"\b(yes|no)\b", expected)[-1]
        return {"regex": rf"(?is)\b{verdict}\b(?!.*\b(?:yes|no)\b)"}
    return {"regex": r"^\s*" + r"\s*".join(re.escape(c) for c in expected if not c.isspace()) + r"\s*$"}

