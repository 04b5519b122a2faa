"""The protocol between the HTTP front end and the engine-core process: every message either
side sends, as msgspec structs carried as msgpack over ZeroMQ (vLLM's EngineCoreRequest /
EngineCoreOutputs in spirit).

Sockets: the core binds one PULL socket that every front end's PUSH connects to (`Request`
messages, each naming its front end's `client` id); each front end binds a PULL socket of its
own that the core's PUSH connects to (`Ready`, `Reply`, `Outputs`). The front end that spawns
the core gives it its output address at start; another front end introduces itself with
`Hello` and gets `Ready` back. Calls (`call` > 0) are answered by one `Reply` with the same
`call`; generation outputs arrive batched, one `Outputs` a step per front end, whatever the
number of its requests that made progress.

This module imports msgspec and the plain sampling parameters only: the front end reaches the
engine through nothing else.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Union

import msgspec

from forkjax.sampling_params import SamplingParams

# Why a request or call failed, as the front end answers it: "invalid" (the request's own
# fault: 400), "not_found" (an unknown adapter: 404), "shutdown" (the server is stopping: 503),
# "error" (the engine failed: 500).
ErrorKind = Literal["invalid", "not_found", "shutdown", "error"]


class _Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """array_like: fields go by position, not by name (smaller, faster messages)."""


# ---- front end -> core ----------------------------------------------------------------------

class Choice(msgspec.Struct, array_like=True):
    """One sequence of a submitted request: its prompt and sampling (`n` copies of a prompt
    are `n` choices)."""
    prompt: list[int]
    params: SamplingParams


class Submit(_Message):
    """Queue every choice of one HTTP request at once, or (a bad one) none: answered by a
    `Reply` to `call` (None, or the refusal)."""
    client: int
    call: int
    rid: int  # the request's id among its front end's
    choices: list[Choice]
    adapter: str | None = None
    session_id: str | None = None
    session_end: bool = False
    session_tokens: int | None = None
    session_next_s: float | None = None
    cache_salt: str | None = None
    fanout_adapters: list[str] | None = None  # None: the engine's residual_fanout setting


class Abort(_Message):
    """End choices of a request (None: all of them), or the `Score` call `rid` (its client left),
    and free their pages; `stop`: the front end found a stop string, so they end "stop"."""
    client: int
    rid: int
    indices: list[int] | None = None
    stop: bool = False


class Score(_Message):
    """The logprob entries of every prompt token after the first (the `k` most likely
    alternatives each): `Reply.result` is a list of [logprob, top ids, top logprobs, rank]."""
    client: int
    call: int
    prompt: list[int]
    k: int
    adapter: str | None = None
    cache_salt: str | None = None


class LoadAdapter(_Message):
    """Load a PEFT directory as adapter `name` once no request runs on the one it replaces:
    `Reply.result` is the new adapter list (`Ready.adapters`' shape)."""
    client: int
    call: int
    name: str
    path: str
    pinned: bool = False
    replace: bool = False


class UnloadAdapter(_Message):
    """Remove adapter `name` once the requests on it finish: `Reply.result` as LoadAdapter's."""
    client: int
    call: int
    name: str


class GetStats(_Message):
    """`Reply.result`: the engine's stats() with the core's own counts (`waiting` includes the
    requests held for an adapter change)."""
    client: int
    call: int


class FlushCache(_Message):
    """Evict every KV page no running request holds: `Reply.result` is the pages freed."""
    client: int
    call: int


class StopRequests(_Message):
    """The front end is stopping: its running and queued requests end "shutdown", and its
    later submits are refused."""
    client: int


class Hello(_Message):
    """A front end attaching to a running core: the core connects to `address` and sends
    `Ready` there."""
    client: int
    address: str


class Shutdown(_Message):
    """Stop the core process once the front end that spawned it is done."""
    client: int


Request = Union[Submit, Abort, Score, LoadAdapter, UnloadAdapter, GetStats, FlushCache,
                StopRequests, Hello, Shutdown]


# ---- core -> front end ----------------------------------------------------------------------

class EngineInfo(msgspec.Struct, array_like=True):
    """What the front end needs of the engine, read once at start."""
    model: str  # the model as given (--model)
    cache_policy: str
    max_model_len: int
    vocab_size: int
    max_lora_rank: int
    pool_tokens: int  # tokens the smaller KV pool holds (a request longer can never fit)
    residual_fanout: bool
    # how the front end builds the model's tokenizer: ("byte", ""), ("dir", path), ("gguf",
    # path), or None: the model has none
    tokenizer: tuple[str, str] | None
    adapters: dict[str, str]  # name -> its source, as shown by /v1/models


class Ready(_Message):
    """The engine is loaded (`info`) or could not be (`error`, said as the command line says
    it: the front end exits with it)."""
    info: EngineInfo | None = None
    error: str | None = None


class Reply(_Message):
    """The answer to call `call`: `result`, or `error` of `kind` (with `param`, the request's
    field at fault where the engine named it: its argument's name in `add_request`)."""
    call: int
    result: Any = None
    error: str | None = None
    kind: ErrorKind | None = None
    param: str | None = None


class Output(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one choice since its last Output; `finish_reason` set on its last."""
    rid: int
    index: int
    token_ids: list[int]
    # with params.logprobs: per new token [its logprob, top ids, top logprobs]
    logprobs: list | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "shutdown"
    error: str | None = None
    kind: ErrorKind | None = None
    queued_s: float | None = None  # on the last: arrival to first admission, in the core
    # on the first: prompt tokens whose K/V came from the cache (Sequence.num_cached)
    cached_tokens: int | None = None


class Outputs(_Message):
    """One step's outputs for one front end."""
    outputs: list[Output]


Response = Union[Ready, Reply, Outputs]

class CoreSpec(msgspec.Struct, kw_only=True):
    """What the front end starts the core process with (on its stdin)."""
    model: str
    engine_kwargs: dict[str, Any]  # Engine.from_pretrained's keywords
    input_address: str  # the core binds it (PULL)
    output_address: str  # the spawning front end's (the core's PUSH connects to it)
    parent_pid: int  # the core stops when this process is gone
    client: int = 0
    log_level: str = "info"
    compilation_cache_dir: str = ""


def display_path(path: str) -> str:
    """A path as valid Unicode: file names that are not UTF-8 come from the OS as lone
    surrogates, which no JSON response can carry."""
    return os.fsencode(path).decode("utf-8", errors="replace")


_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_responses = msgspec.msgpack.Decoder(Response)


def encode(message: Request | Response) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    return _requests.decode(data)


def decode_response(data: bytes) -> Response:
    return _responses.decode(data)
