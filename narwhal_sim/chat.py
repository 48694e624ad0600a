"""A chat request rendered to prompt text the way vLLM renders it (docs/simulator.md, "Tokens and block hashes").

With ``--tokenizer``, the engine's prefix cache and its KV events name the
prompt by the ids vLLM would compute, so the text those ids come from must be
vLLM's, byte for byte. vLLM's OpenAI server does four things to a chat
request before it encodes it; this module does each the same way:

1. **Messages.** Each message becomes the dict the template sees
   (``vllm/entrypoints/chat_utils.py``, ``_parse_chat_message_content`` and
   ``_parse_chat_message_content_parts``, vLLM commit ``001eadcf295d``): the
   text parts of ``content`` joined by ``"\\n"`` — or, when the template loops
   over a message's content parts, kept as a list of ``{"type": "text", ...}``
   parts (:func:`content_format`, vLLM's ``_detect_content_format``) — plus
   ``tool_calls``/``reasoning`` (assistant), ``tool_call_id`` (tool),
   ``name``, ``task``, and ``tools`` (developer). Then
   ``_postprocess_messages`` parses each tool call's JSON ``arguments`` into
   an object (``{}`` when it is not JSON) and drops an empty ``tool_calls``.
2. **Tools** as pydantic dumps ``ChatCompletionToolsParam``: declared fields
   first, with their defaults, then the fields the client added.
3. **Template variables.** ``add_generation_prompt`` (default true),
   ``continue_final_message``, ``documents``, ``tools``, then
   ``chat_template_kwargs`` over them, kept only when the template names them
   or ``apply_chat_template`` takes them (vLLM's
   ``resolve_chat_template_kwargs``), and the tokenizer's special tokens
   (``bos_token``...), as transformers' ``apply_chat_template`` passes them.
4. **The Jinja environment transformers builds** (``_compile_jinja_template``,
   ``src/transformers/utils/chat_template_utils.py``, commit ``5e43e2e8924``):
   sandboxed, ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` and
   ``generation`` extensions, a ``tojson`` that neither escapes HTML nor
   non-ASCII characters, ``raise_exception`` and ``strftime_now``.
   ``continue_final_message`` cuts the text just after the last message.

Every refusal raises :class:`ChatError` (the server answers 400, as vLLM does).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatError",
    "ChatTemplate",
    "NO_TEMPLATE",
    "UNTRUSTED_TEMPLATE",
    "SPECIAL_TOKEN_NAMES",
    "content_format",
    "conversation",
    "normalised_tools",
    "render_chat",
]

#: vLLM's answer to a chat request when the tokenizer has no template (``apply_hf_chat_template``, 400).
NO_TEMPLATE: Final = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
    "template if the tokenizer does not define one."
)

#: vLLM's answer to a request that brings its own chat template (400; the simulator never trusts one).
UNTRUSTED_TEMPLATE: Final = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request "
    "with untrusted chat template."
)

#: The special tokens transformers hands every template, when the tokenizer defines them.
SPECIAL_TOKEN_NAMES: Final = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                              "mask_token")  # fmt: skip

#: ``apply_chat_template``'s own parameters that shape the text: ``chat_template_kwargs`` may set them always.
_TEXT_PARAMS: Final = frozenset({"tools", "documents", "add_generation_prompt", "continue_final_message"})
#: Its parameters that only matter when it tokenizes (vLLM asks for text): accepted, never rendered.
_OTHER_PARAMS: Final = frozenset({"conversation", "chat_template", "tokenize", "padding", "truncation",
                                  "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                  "tokenizer_kwargs"})  # fmt: skip
#: ``chat_template_kwargs`` keys vLLM refuses (``resolve_chat_template_kwargs``; ``conversation`` would
#: reach ``apply_chat_template`` twice).
_REFUSED_KWARGS: Final = frozenset({"chat_template", "tokenize", "conversation"})

#: Content part type -> the field holding its text (vLLM's ``MM_PARSER_MAP``, text entries).
_TEXT_FIELDS: Final = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                       "thinking": "thinking"}  # fmt: skip
#: Media part types -> their modality; vLLM's generic placeholder stands for each in a string content.
_MEDIA: Final = {"image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "image",
                 "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio", "video_url": "video"}
_PLACEHOLDERS: Final = {"image": "<##IMAGE##>", "audio": "<##AUDIO##>", "video": "<##VIDEO##>"}


class ChatError(ValueError):
    """The request cannot be rendered: vLLM answers 400 (``param`` names the field)."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


# -- the environment -----------------------------------------------------------------------


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: transformers marks assistant text with it; the body renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:  # noqa: A002 - the keyword templates use
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# -- content format: does the template loop over a message's parts? ---------------------------


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name[key]``/``name.key``), possibly under filters, tests or a slice."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key and _reads(node.node, name)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _reads(node.node, name)
    return False


def _names_for(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable ``{% set %}`` from it, directly or through another such variable."""
    names, pending = [name], [name]
    while pending:
        current = pending.pop()
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in names and _reads(assign.node, current):
                names.append(target.name)
                pending.append(target.name)
    return names


def content_format(root: jinja2.nodes.Template) -> str:
    """``"openai"`` if some loop over ``messages`` has an inner loop over its item's ``content``, else ``"string"``.

    vLLM's ``_detect_content_format`` (``vllm/entrypoints/chat_utils.py``,
    vLLM 0.12): with ``"openai"`` a message's content reaches the template as
    a list of parts, with ``"string"`` as one string.
    """
    loops = list(root.find_all(jinja2.nodes.For))
    aliases = _names_for(root, "messages")
    items = {loop.target.name for loop in loops
             if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, a) for a in aliases)}  # fmt: skip
    return "openai" if any(_reads(loop.iter, item, "content") for loop in loops for item in items) else "string"


class ChatTemplate:
    """A compiled chat template with what vLLM reads from its source: content format and variables."""

    __slots__ = ("template", "content_format", "variables")

    def __init__(self, source: str) -> None:
        env = _environment()
        root = env.parse(source)  # jinja2.TemplateSyntaxError: the loader reports it
        self.template: Final = env.from_string(root)
        self.content_format: Final = content_format(root)
        #: What ``chat_template_kwargs`` can reach (``jinja2.meta.find_undeclared_variables``).
        self.variables: Final = frozenset(jinja2.meta.find_undeclared_variables(root))


# -- messages and tools ------------------------------------------------------------------------


def _part(part: Any, wrap: bool) -> tuple[Any, str | None]:
    """(text or wrapped part, modality of a media part); ``(None, None)`` for a part vLLM skips."""
    if isinstance(part, str):
        return ({"type": "text", "text": part} if wrap else part), None
    if not isinstance(part, dict):
        raise ChatError("a content part must be a string or an object")
    kind = part.get("type")
    if kind in _TEXT_FIELDS and part.get("uuid") is None:
        text = part.get(_TEXT_FIELDS[kind])
        if text is None:
            return None, None  # vLLM logs and skips a text part without text
        if not isinstance(text, str):
            raise ChatError(f"content part {kind}: its text must be a string")
        return ({"type": "text", "text": text} if wrap else text), None
    if kind == "tool_reference" and isinstance(part.get("name"), str):
        return ({"type": "tool_reference", "name": part["name"]} if wrap else part["name"]), None
    modality = _MEDIA.get(kind) if isinstance(kind, str) else None
    if modality is None:
        raise ChatError(f"Unsupported chat content part type: {kind!r}.", "type")
    return ({"type": modality} if wrap else None), modality


def _content(content: Any, fmt: str) -> str | list[dict[str, Any]]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise ChatError("a message's content must be a string, an array or null")
    wrap = fmt == "openai"
    kept, media = [], []
    for piece in parts:
        value, modality = _part(piece, wrap)
        if value:  # vLLM keeps what is truthy: an empty string is dropped, a wrapped part never
            kept.append(value)
        if modality is not None:
            media.append(_PLACEHOLDERS[modality])
    if wrap:
        return kept
    text = "\n".join(kept)
    # vLLM puts the placeholders of media the text does not name in front (_get_full_multimodal_text_prompt).
    return "\n".join([*media, text] if text else media) if media else text


def conversation(messages: Any, fmt: str) -> list[dict[str, Any]]:
    """The messages as vLLM's ``parse_chat_messages`` hands them to the template (the request is not changed)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatError("messages must be an array of objects")
    out = []
    for message in messages:
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatError("each message needs a string role")
        item: dict[str, Any] = {"role": role, "content": _content(message.get("content"), fmt)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                item["tool_calls"] = _tool_calls(message["tool_calls"])
            if message.get("reasoning") is not None:
                item["reasoning"] = item["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                item["tool_call_id"] = message["tool_call_id"]
            content = item["content"]
            if isinstance(content, list) and all(p.get("type") == "text" for p in content):
                item["content"] = "\n".join(p["text"] for p in content)  # tool results as one string
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                item[key] = message[key]
        if role == "developer":
            item["tools"] = copy.deepcopy(message.get("tools"))
        if item.get("tool_calls") == []:
            del item["tool_calls"]  # keeps templates on the plain assistant path
        out.append(item)
    return out


def _tool_calls(calls: Any) -> list[Any]:
    if not isinstance(calls, list):
        raise ChatError("tool_calls must be an array")
    copied: list[Any] = copy.deepcopy(calls)  # the request body is left as it came
    for call in copied:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ChatError("each tool call needs a function object")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                function["arguments"] = {}
        elif not isinstance(arguments, (dict, list)):
            function["arguments"] = {}
    return copied


def normalised_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as pydantic dumps vLLM's ``ChatCompletionToolsParam`` (declared fields first, then extras)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("tools must be an array", "tools")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatError("each tool needs a function with a string name", "tools")
        if tool.get("type", "function") != "function":
            raise ChatError("a tool's type must be function", "tools")
        dumped = {"name": function["name"], "description": function.get("description"),
                  "parameters": function.get("parameters")}  # fmt: skip
        dumped.update((k, v) for k, v in function.items() if k not in dumped)
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        entry.update((k, v) for k, v in tool.items() if k not in entry)
        out.append(copy.deepcopy(entry))
    return out


# -- rendering ---------------------------------------------------------------------------------


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise ChatError(f"{name} must be a boolean", name)
    return value


def _requested(body: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments vLLM's ``_preprocess_chat`` passes on: its own, then ``chat_template_kwargs`` over them."""
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ChatError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if refused := sorted(_REFUSED_KWARGS & extra.keys()):
        raise ChatError(f"Found unexpected chat template kwargs from request: {refused}", "chat_template_kwargs")
    return {
        "add_generation_prompt": _flag(body, "add_generation_prompt", True),
        "continue_final_message": _flag(body, "continue_final_message", False),
        "tools": normalised_tools(body.get("tools")),
        "documents": body.get("documents"),
        **extra,
    }


def render_chat(body: Mapping[str, Any], templates: tuple[ChatTemplate | None, ChatTemplate | None],
                special_tokens: Mapping[str, Any]) -> str:  # fmt: skip
    """The prompt text of chat request ``body``; ``templates`` is (default, ``tool_use``)."""
    kwargs_given = body.get("chat_template_kwargs")
    if body.get("chat_template") is not None or (
        isinstance(kwargs_given, dict) and kwargs_given.get("chat_template") is not None
    ):
        # vLLM's default, without --trust-request-chat-template (OpenAIServing._validate_chat_template).
        raise ChatError(UNTRUSTED_TEMPLATE, None)
    if _flag(body, "continue_final_message", False) and _flag(body, "add_generation_prompt", True):
        # vLLM's request validator (ChatCompletionRequest.check_generation_prompt), before any kwargs.
        raise ChatError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None)
    requested = _requested(body)
    default, tool_use = templates
    # transformers' get_chat_template: the "tool_use" template for a request with tools, if there is one.
    template = tool_use if requested["tools"] is not None and tool_use is not None else default
    if template is None:
        raise ChatError(NO_TEMPLATE, None)
    # vLLM's resolve_chat_template_kwargs keeps what the template reads or apply_chat_template takes.
    kwargs = {k: v for k, v in requested.items()
              if k in template.variables or k in _TEXT_PARAMS or k in _OTHER_PARAMS}  # fmt: skip
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", False))
    continue_final = bool(kwargs.pop("continue_final_message", False))
    if add_generation_prompt and continue_final:
        raise ChatError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None)
    for name in _OTHER_PARAMS:
        kwargs.pop(name, None)  # apply_chat_template consumes them
    messages = conversation(body.get("messages"), template.content_format)
    variables = {**special_tokens, "tools": None, "documents": None, **kwargs}
    try:
        text = template.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **variables)  # fmt: skip
    except Exception as exc:  # the template's own refusal, or a template bug: the request's 400
        raise ChatError(f"chat template failed: {exc}") from None
    return _cut_after_final(text, messages) if continue_final else text


def _cut_after_final(text: str, messages: list[dict[str, Any]]) -> str:
    """transformers' ``continue_final_message``: end the text right after the final message's content."""
    final = messages[-1]["content"] if messages else ""
    if isinstance(final, list):
        texts = [p["text"] for p in final if "text" in p]
        if not texts:
            raise ChatError("continue_final_message is set but we could not find any text to continue "
                            "in the final message!")  # fmt: skip
        final = texts[-1]
    stripped = final.strip()
    if stripped not in text:
        raise ChatError("continue_final_message is set but the final message does not appear in the chat "
                        "after applying the chat template!")  # fmt: skip
    at = text.rindex(stripped)
    kept = len(final.lstrip())
    if text[at : at + kept] == final:
        return text[: at + kept]
    return text[: at + len(stripped)]
