"""JSON schemas -> the llguidance grammars `SamplingParams.guided` carries, for every client of
the engine (the server's structured outputs, the workflows' JSON tool calls).

JSON is generated without free whitespace between its tokens: a model cannot pad its output
with blanks until max_tokens (strings and arrays are bounded only by the schema).
"""

from __future__ import annotations

import json

import llguidance as llg

JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema_grammar(schema: dict) -> str:
    """A JSON schema -> its grammar; ValueError with llguidance's message (which names the
    schema keyword or construct it cannot enforce) if it does not compile."""
    grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    return checked_grammar(grammar)


def checked_grammar(grammar: str) -> str:
    """`grammar` if llguidance compiles it, else ValueError with its error."""
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if error:
        raise ValueError(messages[0])
    return grammar


def with_grammars(lark: str, **grammars: str) -> str:
    """A Lark grammar whose rules name other grammars (`@name`) -> one grammar holding them all.
    Each of `grammars` is one as the functions here (or llguidance's `grammar_from*`) return it:
    llguidance's JSON form, or Lark text. The JSON form's first grammar is its start; the others
    keep their names."""
    out = [{"name": "start", "lark_grammar": lark}]
    for name, grammar in grammars.items():
        if grammar.lstrip().startswith("{"):
            parts = json.loads(grammar)["grammars"]
            out += [{**parts[0], "name": name}, *parts[1:]]
        else:
            out.append({"name": name, "lark_grammar": grammar})
    return json.dumps({"grammars": out})
