"""The body rules of a completion request (docs/contract.md, "Request rules").

:func:`check_request` runs the seven checks in order; the first failure
raises a :class:`~narwhal_core.errors.ContractError` carrying the status,
``param``, ``code`` and message of the OpenAI error envelope. Nothing here
reserves capacity. A request that passes is returned as
:class:`AcceptedRequest`: the body with router-owned fields removed
(docs/contract.md, "The engine request") and ``model`` set to the configured
model, every other key kept in its place with its value.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Final, Literal

import attrs

from . import wire
from .errors import ContractError

__all__ = [
    "Route",
    "COMPLETIONS",
    "CHAT",
    "ROUTER_OWNED_FIELDS",
    "AcceptedRequest",
    "check_request",
    "is_router_owned",
]

Route = Literal["/v1/completions", "/v1/chat/completions"]
COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"

#: Body fields that engines treat as internal routing state: a client may not
#: set them (docs/contract.md, "The engine request"; sglang's
#: ``bootstrap_*`` are matched by prefix).
ROUTER_OWNED_FIELDS: Final = frozenset({"kv_transfer_params", "request_id"})
_ROUTER_OWNED_PREFIXES: Final = ("bootstrap_",)  # the pre-check in check_request knows it

# Check 3 checks these in this order (docs/contract.md, "Request rules").
_INTEGER_FIELDS: Final = ("n", "best_of", "max_tokens", "max_completion_tokens")
# The output lengths: router-interpreted (the prefill leg sets them to 1), so
# a value below 1 is refused here, before it costs a prefill leg.
_LENGTH_FIELDS: Final = ("max_tokens", "max_completion_tokens")
_MAX_MODEL_ECHO: Final = 256


def is_router_owned(key: str) -> bool:
    """Whether a body field is router-owned and must be stripped (docs/contract.md, "The engine request")."""
    return key in ROUTER_OWNED_FIELDS or key.startswith(_ROUTER_OWNED_PREFIXES)


@attrs.define(kw_only=True)
class AcceptedRequest:
    """A completion request that passed the contract.

    Made once per request on the hot path: a plain slotted class, not a
    frozen one (see :mod:`narwhal_core.events`); treat it as a value.
    """

    #: The route it came in on.
    route: Route
    #: The body as engines should see it: router-owned fields gone, ``model`` set.
    body: dict[str, Any]
    #: Whether the client asked for Server-Sent Events.
    stream: bool
    #: Router-owned fields the client sent and Narwhal removed, in body order.
    stripped: tuple[str, ...]
    #: The model name the client used (``None`` when absent).
    requested_model: str | None
    #: A ``/v1/completions`` batch: its prompts in order (two or more), each
    #: served by a PD pair of its own (docs/operate.md, "Batch prompts");
    #: ``None`` for one prompt.
    prompts: list[Any] | None = None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(message: str, param: str | None, *, status: int = 400, code: str | None = None) -> ContractError:
    return ContractError(message, status=status, param=param, code=code)


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _prompts(prompt: object, max_prompts: int) -> list[Any] | None:
    """The prompts of a ``/v1/completions`` request: ``None`` for one, else the list.

    A string or one list of token IDs is one prompt; a list of strings or a
    list of token-ID lists is one prompt per item. Anything else, an empty
    list, or more than ``max_prompts`` prompts, is refused.
    """
    if isinstance(prompt, str) or _token_ids(prompt):
        return None
    assert isinstance(prompt, list)
    if not prompt:
        raise _fail("prompt must not be empty", "prompt")
    if not (all(isinstance(p, str) for p in prompt) or all(_token_ids(p) for p in prompt)):
        raise _fail(
            "prompt must be a string, an array of strings, an array of token IDs or an array of "
            "non-empty token ID arrays",
            "prompt",
        )
    count = len(prompt)
    if count == 1:
        return None  # one prompt: the engines take the one-item list as it is
    if count > max_prompts:
        if max_prompts <= 1:
            raise _fail(
                f"prompt holds {count} prompts; this router serves one prompt per request "
                "(batch prompts are off: ingress.max_batch_prompts = 1)",
                "prompt",
            )
        raise _fail(f"prompt holds {count} prompts; at most {max_prompts} are allowed per request", "prompt")
    return prompt


def check_request(
    route: Route, body: bytes, model_names: Collection[str], model: str, *, max_prompts: int = 1
) -> AcceptedRequest:
    """Apply the body rules (docs/contract.md, "Request rules") to a raw body posted to ``route``.

    ``model_names`` are the names clients may use (the configured model and
    its aliases); ``model`` is the configured name written into the body.
    ``max_prompts`` bounds a ``/v1/completions`` batch (``ingress.max_batch_prompts``;
    1: batches are refused with ``param: "prompt"``).
    """
    # 1. JSON (and UTF-8).
    try:
        data = wire.loads(body)
    except wire.JsonError as exc:
        raise _fail(f"We could not parse the JSON body of your request: {exc}", None) from None
    # 2. A JSON object.
    if not isinstance(data, dict):
        raise _fail("The request body must be a JSON object.", None)
    get = data.get
    # 3. Field types, in the documented order; absent or null passes.
    requested = get("model")
    if requested is not None and not isinstance(requested, str):
        raise _fail("model must be a string", "model")
    stream = get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _fail("stream must be a boolean", "stream")
    for name in _INTEGER_FIELDS:
        value = get(name)
        if value is not None and not _is_int(value):
            raise _fail(f"{name} must be an integer", name)
    prompt = get("prompt")
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise _fail("prompt must be a string or an array", "prompt")
    messages = get("messages")
    if messages is not None and not (
        isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
    ):
        raise _fail("messages must be an array of objects", "messages")
    # 4. Something to prefill: a prompt, or a batch of at most max_prompts.
    prompts = None
    if route == CHAT:
        if messages is None:
            raise _fail("messages is required", "messages")
    elif prompt is None:
        raise _fail("prompt is required", "prompt")
    else:
        prompts = _prompts(prompt, max_prompts)
    # 5. The model.
    if requested is not None and requested not in model_names:
        shown = requested if len(requested) <= _MAX_MODEL_ECHO else requested[:_MAX_MODEL_ECHO] + "..."
        raise _fail(
            f"The model `{shown}` does not exist.", "model", status=404, code="model_not_found"
        )
    # 6. Sampling width: both legs must sample the same number of sequences...
    for name in ("n", "best_of"):
        value = get(name)
        if value is not None and value > 1:
            raise _fail(
                f"{name} must be 1: the prefill and decode legs must use the same sampling width",
                name,
            )
    # ...and the output length: at least one token.
    for name in _LENGTH_FIELDS:
        value = get(name)
        if value is not None and value < 1:
            raise _fail(f"{name} must be at least 1", name)
    # 7. Output and tool restrictions.
    if get("audio") is not None:
        raise _fail("audio output is not supported", "audio")
    modalities = get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _fail('modalities must be ["text"]: only text output is supported', "modalities")
    tools = get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise _fail("tools must be an array of objects", "tools")
        for i, tool in enumerate(tools):
            if tool.get("type") != "function":
                raise _fail('only tools of type "function" are supported', f"tools[{i}].type")
    # Strip router-owned fields and install the configured model, in place so
    # that every other key keeps its position.
    stripped: tuple[str, ...] = ()
    # (A cheap pre-check first: most bodies carry no router-owned field.)
    if not ROUTER_OWNED_FIELDS.isdisjoint(data) or "bootstrap_" in "\0".join(data):
        stripped = tuple(k for k in data if k in ROUTER_OWNED_FIELDS or k.startswith(_ROUTER_OWNED_PREFIXES))
        for key in stripped:
            del data[key]
    data["model"] = model
    return AcceptedRequest(
        route=route,
        body=data,
        stream=stream is True,
        stripped=stripped,
        requested_model=requested,
        prompts=prompts,
    )
