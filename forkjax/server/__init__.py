"""The OpenAI-compatible HTTP server behind `python -m forkjax.serve`: a front end (this
package but core_proc.py) and the engine-core process it spawns, which alone touches the Engine.

messages.py      the protocol between them: msgspec structs, msgpack over ZeroMQ
core_proc.py     the engine-core process: the step loop, answering messages between steps
core_client.py   the front end's side: spawns the core, routes its outputs, notices its death
protocol.py      request bodies and OpenAI-shaped errors
responses.py     response bodies
protocol_tools.py  the bodies of structured outputs and tool calls
validation.py    what every request body must be: strict types, bounds, neutral unsupported fields
detokenizer.py   incremental token -> text with stop strings
chat_template.py messages (and tools) -> prompt ids
structured.py    response_format, guided_* -> the llguidance grammar the engine enforces
tool_calls.py    tool_choice's constraint; tool calls read back from the output, whole or streamed
serving.py       /v1/completions over the core client, and what both endpoints share
serving_chat.py  /v1/chat/completions
streaming.py     one request's choices to the client: whole, or as server-sent events
middleware.py    API key and request body size limit
metrics.py       /metrics through prometheus_client: the core's counters, the front end's latencies
app.py           the FastAPI app: routes and error handlers
"""
