"""The OpenAI-compatible HTTP server behind `python -m forkjax.serve`.

protocol.py      request/response bodies and OpenAI-shaped errors
validation.py    what every request body must be: strict types, bounds, neutral unsupported fields
engine_loop.py   the engine thread: the only code that touches the Engine
detokenizer.py   incremental token -> text with stop strings
chat_template.py messages -> prompt ids
serving.py       /v1/completions and /v1/chat/completions over the engine loop
streaming.py     one request's choices to the client: whole, or as server-sent events
middleware.py    API key and request body size limit
metrics.py       /metrics in Prometheus text format
app.py           the FastAPI app: routes and error handlers
"""
