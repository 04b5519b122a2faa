"""JSON schemas -> the llguidance grammars `SamplingParams.guided` carries, for every client of
the engine (the server's structured outputs, the workflows' JSON tool calls).

JSON is generated without free whitespace between its tokens: a model cannot pad its output
with blanks until max_tokens (strings and arrays are bounded only by the schema).
"""

from __future__ import annotations

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
