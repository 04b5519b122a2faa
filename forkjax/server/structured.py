"""A request's output constraint -> the llguidance grammar the engine enforces
(`SamplingParams.guided`; engine/guided.py applies it), or a 400 naming the field at fault.

Sources, at most one a request: OpenAI's `response_format` (json_object, json_schema), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and `structured_outputs`.
They constrain a final message: beside a chat request's tools, tool_calls.py combines the two as
OpenAI defines it. A schema is compiled here, before anything is queued, so that a feature
llguidance cannot enforce is refused with its name instead of being generated unconstrained.
"""

from __future__ import annotations

import json

import llguidance as llg

from forkjax.server.protocol import APIError
from forkjax.structured_output import checked_grammar, json_schema_grammar

def _param(field: str) -> str:
    return field.split(".")[0]


def json_grammar(schema, field: str) -> str:
    """A JSON schema (a dict, or its text) -> grammar, or 400 naming `field`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{field}: not valid JSON: {e}", param=_param(field)) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{field}: a JSON schema must be an object", param=_param(field))
    try:
        return json_schema_grammar(schema)
    except ValueError as e:
        raise APIError(400, f"{field}: cannot be enforced: {e}", param=_param(field)) from None


def checked(grammar: str, field: str) -> str:
    """`grammar` if llguidance compiles it, else 400 with its error."""
    try:
        return checked_grammar(grammar)
    except ValueError as e:
        raise APIError(400, f"{field}: cannot be enforced: {e}", param=_param(field)) from None


def choice_grammar(choices: list[str], field: str) -> str:
    return checked(llg.grammar_from("choice", choices), field)


def regex_grammar(regex: str, field: str) -> str:
    return checked(llg.LLMatcher.grammar_from_regex(regex), field)


def lark_grammar(text: str, field: str) -> str:
    """A Lark grammar, or a GBNF one (llama.cpp's, converted by llguidance)."""
    try:
        grammar = llg.grammar_from("grammar", text)
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=_param(field)) from None
    return checked(grammar, field)


def request_grammar(req) -> str | None:
    """The grammar of `req`'s output constraint (None: unconstrained)."""
    if req.guided_whitespace_pattern is not None:
        raise APIError(400, "guided_whitespace_pattern is not supported: JSON is generated without free "
                            "whitespace", param="guided_whitespace_pattern")
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(lambda: json_grammar({"type": "object"}, "response_format"))
        elif fmt.json_schema is None:
            raise APIError(400, "response_format: type json_schema needs json_schema",
                           param="response_format")
        else:
            found.append(lambda: json_grammar(fmt.json_schema.json_schema,
                                              "response_format.json_schema.schema"))
    if req.guided_json is not None:
        found.append(lambda: json_grammar(req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        found.append(lambda: regex_grammar(req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(lambda: choice_grammar(req.guided_choice, "guided_choice"))
    if req.guided_grammar is not None:
        found.append(lambda: lark_grammar(req.guided_grammar, "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if v is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, "
                                "grammar, json_object", param="structured_outputs")
        kind, value = given[0]
        build = {"json": json_grammar, "regex": regex_grammar, "choice": choice_grammar,
                 "grammar": lark_grammar,
                 "json_object": lambda _, f: json_grammar({"type": "object"}, f)}[kind]
        found.append(lambda: build(value, f"structured_outputs.{kind}"))
    if len(found) > 1:
        raise APIError(400, "at most one output constraint per request: response_format, guided_* "
                            "and structured_outputs exclude each other",
                       param="response_format" if fmt is not None else None)
    return found[0]() if found else None
