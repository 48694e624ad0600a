"""The token ids an engine computes for a request's prompt, computed on the router's side.

Routing by the engines' KV events (``routing.policy = "kv"``) matches a
prompt's blocks against the blocks the engines report: that only works if
Narwhal tokenizes every prompt exactly as the engine does. So this module
follows vLLM's OpenAI server step by step (docs/configure.md, "Tokenizer"):

* ``/v1/completions``: a text prompt is encoded with ``add_special_tokens``
  (default true: the BOS the tokenizer's post-processor adds); a token-id
  prompt is used as given. (vLLM ``vllm/entrypoints/openai/serving_engine.py``,
  ``OpenAIServing._normalize_prompt_text_to_input`` and
  ``_normalize_prompt_tokens_to_input``, commit ``7ded96b3c73f``; the field
  defaults in ``vllm/entrypoints/openai/protocol.py``, ``CompletionRequest``
  and ``ChatCompletionRequest``, commit ``0052bed36509``.)
* ``/v1/chat/completions``: the messages are normalised as vLLM's
  ``parse_chat_messages`` does (``vllm/entrypoints/chat_utils.py``,
  ``_parse_chat_message_content`` and ``_postprocess_messages``, commit
  ``001eadcf295d``), the tools as pydantic dumps them, then the chat template
  is rendered with ``messages``, ``tools``, ``documents``,
  ``add_generation_prompt`` (default true), the ``chat_template_kwargs`` the
  template uses (``resolve_chat_template_kwargs``) and the tokenizer's special
  tokens, in the Jinja environment transformers' ``apply_chat_template``
  builds; ``continue_final_message`` cuts the text after the last message; the
  text is encoded with ``add_special_tokens`` (default false: the template
  writes them). (``OpenAIServing._preprocess_chat``, commit ``7ded96b3c73f``.)

A request this cannot tokenize as the engine would (images, a per-request
template, a batch of prompts, a malformed field) raises
:class:`PromptNotTokenizable`; the policy then routes that request without
the precise index. A tokenizer or template that does not load raises
:class:`TokenizerLoadError` at start: a config error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["EngineTokenizer", "PromptNotTokenizable", "TokenizerLoadError", "load_tokenizer"]


class TokenizerLoadError(ValueError):
    """``model.tokenizer`` or ``model.chat_template`` could not be loaded (a config error at start)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class PromptNotTokenizable(ValueError):
    """This request's prompt cannot be tokenized as the engine would: route it without its token ids."""


#: The special tokens transformers passes to every chat template (``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKENS: Final = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

#: ``apply_chat_template``'s own parameters: vLLM lets ``chat_template_kwargs`` set them even when the
#: template never names them (``_get_hf_base_chat_template_params``). Only these change the text.
_APPLY_PARAMS: Final = frozenset({"tools", "documents", "add_generation_prompt", "continue_final_message"})
#: ``apply_chat_template`` parameters that only matter when it tokenizes (vLLM renders text): dropped.
_IGNORED_PARAMS: Final = frozenset({
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})
#: Keys vLLM refuses in ``chat_template_kwargs`` (or that would replace its own arguments).
_REFUSED_KWARGS: Final = frozenset({"chat_template", "tokenize", "conversation"})

#: Content parts whose text a chat template sees (vLLM's ``MM_PARSER_MAP`` text entries).
_TEXT_PARTS: Final = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                      "thinking": "thinking"}


# -- the Jinja environment ------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers' ``AssistantTracker``): renders its body.

    Transformers uses the tag to mark assistant tokens for training masks;
    rendering a prompt, the body is written as it is.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers replaces Jinja's own tojson, which escapes HTML characters and sorts nothing.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers compiles chat templates in (``_compile_jinja_template``).

    Sandboxed and immutable, ``trim_blocks`` and ``lstrip_blocks``, the
    ``loopcontrols`` and ``generation`` extensions, ``tojson`` without HTML
    escaping or ASCII escaping, and the globals ``raise_exception`` and
    ``strftime_now``. (transformers ``src/transformers/utils/chat_template_utils.py``,
    ``_compile_jinja_template``, v4.56.)
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _names(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads variable ``name`` (``name[key]``/``name.key`` with ``key``), through filters, tests, slices."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _names(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _names(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        inner, ok = node.node, isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    elif isinstance(node, jinja2.nodes.Getattr):
        inner, ok = node.node, node.attr == key
    else:
        return False
    return ok and _names(inner, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable ``{% set %}`` from it (or from one of those), in the order found."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            if isinstance(assign.target, jinja2.nodes.Name) and _names(assign.node, current):
                if assign.target.name not in found:
                    found.append(assign.target.name)
                    queue.append(assign.target.name)
    return found


def content_format(root: jinja2.nodes.Template) -> str:
    """``"openai"`` when the template loops over a message's content parts, else ``"string"``.

    vLLM decides per template whether a message's ``content`` reaches it as
    one string (text parts joined by newlines) or as a list of parts, by
    looking for ``{% for part in message['content'] %}`` inside a loop over
    ``messages`` (``vllm/entrypoints/chat_utils.py``, ``_detect_content_format``,
    vLLM 0.12).
    """
    loops = list(root.find_all(jinja2.nodes.For))
    messages = _aliases(root, "messages")
    items = [loop.target.name for loop in loops if isinstance(loop.target, jinja2.nodes.Name)
             and any(_names(loop.iter, m) for m in messages)]  # fmt: skip
    if any(_names(loop.iter, item, "content") for loop in loops for item in items):
        return "openai"
    return "string"


class ChatTemplate:
    """One compiled chat template, with what vLLM learns from its source once."""

    __slots__ = ("source", "template", "content_format", "variables")

    def __init__(self, source: str) -> None:
        env = chat_environment()
        root = env.parse(source)
        self.source: Final = source
        self.template: Final = env.from_string(root)
        self.content_format: Final = content_format(root)
        #: The variables the template reads without setting: the ``chat_template_kwargs`` it can use.
        self.variables: Final = frozenset(jinja2.meta.find_undeclared_variables(root))


# -- messages and tools as vLLM hands them to the template ------------------------------


def _bad(message: str) -> PromptNotTokenizable:
    return PromptNotTokenizable(message)


def _part_text(part: Any) -> str | None:
    """The text of one content part (None: skipped); anything but text cannot be rendered here."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise _bad("a content part must be a string or an object")
    kind = part.get("type")
    if kind in _TEXT_PARTS and part.get("uuid") is None:
        text = part.get(_TEXT_PARTS[kind])
        if text is None or isinstance(text, str):
            return text
        raise _bad(f"content part {kind}: its text must be a string")
    # Images, audio, video: the engine's template writes model-specific placeholders Narwhal cannot know.
    raise _bad(f"content part {kind!r} is not text")


def _content(content: Any, fmt: str) -> str | list[dict[str, str]]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise _bad("a message's content must be a string, an array or null")
    texts = [t for t in map(_part_text, parts) if t is not None]
    if fmt == "openai":
        # Each part a dict, kept even when its text is empty: vLLM's ``_parse_chat_message_content_parts``
        # keeps every truthy parse result, and a part's dict is truthy whatever its text.
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(t for t in texts if t)  # as plain strings, an empty text is falsy and left out


def conversation(messages: Any, fmt: str) -> list[dict[str, Any]]:
    """The messages as vLLM's ``parse_chat_messages`` passes them to the template (a deep copy)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty array")
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad("each message must be an object with a string role")
        role = message["role"]
        item: dict[str, Any] = {"role": role, "content": _content(message.get("content"), fmt)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                item["tool_calls"] = _tool_calls(message["tool_calls"])
            if message.get("reasoning") is not None:
                item["reasoning"] = item["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                item["tool_call_id"] = message["tool_call_id"]
            if isinstance(item["content"], list):  # tool results reach templates as one string
                item["content"] = "\n".join(p["text"] for p in item["content"])
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        if isinstance(message.get("task"), str):
            item["task"] = message["task"]
        if role == "developer":
            item["tools"] = message.get("tools")  # (the template's sandbox cannot change it)
        if item.get("tool_calls") == []:
            del item["tool_calls"]  # an empty list keeps templates on the plain assistant path
        out.append(item)
    return out


def _tool_calls(calls: Any) -> list[Any]:
    """Tool calls with JSON-string arguments parsed to objects (``_postprocess_messages``)."""
    if not isinstance(calls, list):
        raise _bad("tool_calls must be an array")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _bad("each tool call needs a function object")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {}
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        # New dicts where the arguments change: the request body is forwarded as received. The
        # template renders in an immutable sandbox, so what is shared cannot be changed there.
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM passes them on: each validated and dumped by pydantic (``ChatCompletionToolsParam``).

    Declared fields come first, in their order, with their defaults
    (``type`` ``"function"``; ``function``: ``name``, ``description`` and
    ``parameters``, None when absent), then the fields the client added.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be an array")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad("each tool needs a function with a string name")
        if tool.get("type", "function") != "function":
            raise _bad("a tool's type must be function")
        dumped_function = {"name": function["name"], "description": function.get("description"),
                           "parameters": function.get("parameters")}  # fmt: skip
        dumped_function.update((k, v) for k, v in function.items() if k not in dumped_function)
        dumped = {"type": "function", "function": dumped_function}
        dumped.update((k, v) for k, v in tool.items() if k not in dumped)
        out.append(dumped)
    return out


# -- the tokenizer ------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if type(value) is not bool:
        raise _bad(f"{name} must be a boolean")
    return value


class EngineTokenizer:
    """A Hugging Face ``tokenizer.json`` and its chat template: the ids a vLLM engine computes.

    Implements the core's ``PromptTokenizer`` protocol
    (:meth:`prompt_token_ids`). Build it with :func:`load_tokenizer`.
    """

    def __init__(self, tokenizer: Any, *, template: ChatTemplate | None = None,
                 tool_template: ChatTemplate | None = None, special_tokens: Mapping[str, Any] | None = None,
                 path: str = "") -> None:  # fmt: skip
        self._tok = tokenizer
        self._template = template
        #: A second template for requests with tools (a ``tool_use`` named template), as transformers picks it.
        self._tool_template = tool_template
        self._special: dict[str, Any] = dict(special_tokens or {})
        self._specials_added = int(tokenizer.num_special_tokens_to_add(False))
        self.path = path

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be tokenized (vLLM refuses them too without a template)."""
        return self._template is not None or self._tool_template is not None

    def prompt_token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The token ids the engine computes for ``body``'s prompt (one prompt: a batch's are asked one by one).

        Raises :class:`PromptNotTokenizable` when that cannot be known here.
        """
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        return self.chat_ids(body) if chat else self.completion_ids(body)

    def head_token_ids(self, body: dict[str, Any], chat: bool, chars: int) -> list[int] | None:
        """The ids the engine's prompt starts with: its text cut after ``chars`` characters, encoded.

        For the router's look at a large prompt's head before tokenizing it
        whole (``narwhal_core.kv_policy``, "Tokenizing only what can hit"),
        which uses only the blocks well before the cut. ``None`` when the
        engine's first tokens are not the text's (``truncate_prompt_tokens``
        keeps the last ones). Raises as :meth:`prompt_token_ids` does.
        """
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        if self._truncation(body):
            return None
        if chat:
            return self.encode(self.render_chat(body)[:chars],
                               add_special_tokens=_flag(body, "add_special_tokens", False))  # fmt: skip
        prompt = _completion_prompt(body)
        if isinstance(prompt, list):
            return list(prompt[:chars])  # token ids: their head is itself
        return self.encode(prompt[:chars], add_special_tokens=_flag(body, "add_special_tokens", True))

    def completion_ids(self, body: Mapping[str, Any]) -> list[int]:
        """``/v1/completions``: text encoded with ``add_special_tokens`` (default true), token ids as given."""
        prompt = _completion_prompt(body)
        truncate = self._truncation(body)
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True), truncate=truncate)
        return list(prompt[-truncate:] if truncate else prompt)

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        """``/v1/chat/completions``: the rendered template, encoded with ``add_special_tokens`` (default false)."""
        text = self.render_chat(body)
        return self.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False),
                           truncate=self._truncation(body))  # fmt: skip

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The text vLLM's ``apply_hf_chat_template`` makes of a chat request."""
        if body.get("chat_template") is not None:
            raise _bad("a per-request chat_template: the engine may refuse or use it")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise _bad("chat_template_kwargs must be an object")
        if _REFUSED_KWARGS & extra.keys():
            raise _bad(f"chat_template_kwargs may not set {sorted(_REFUSED_KWARGS & extra.keys())}")
        kwargs: dict[str, Any] = {
            "add_generation_prompt": _flag(body, "add_generation_prompt", True),
            "continue_final_message": _flag(body, "continue_final_message", False),
            "documents": body.get("documents"),
            "tools": tool_dicts(body.get("tools")),
        }
        kwargs.update(extra)
        template = self._template_for(kwargs["tools"])
        accepted = template.variables | _APPLY_PARAMS
        kwargs = {k: v for k, v in kwargs.items() if k in accepted and k not in _IGNORED_PARAMS}
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", False))
        continue_final = bool(kwargs.pop("continue_final_message", False))
        if add_generation_prompt and continue_final:
            raise _bad("continue_final_message and add_generation_prompt are not compatible")
        messages = conversation(body.get("messages"), template.content_format)
        variables = {**self._special, **kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            text = template.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **variables)  # fmt: skip
        except Exception as exc:  # a template error is the request's (the engine answers 400)
            raise _bad(f"the chat template failed: {exc}") from None
        return _continue_final(text, messages) if continue_final else text

    def _template_for(self, tools: Any) -> ChatTemplate:
        """The template transformers picks (``get_chat_template``): ``tool_use`` for a request with tools."""
        if tools is not None and self._tool_template is not None:
            return self._tool_template
        if self._template is None:
            raise _bad("no chat template: set model.chat_template (vLLM refuses chat requests without one)")
        return self._template

    @staticmethod
    def _truncation(body: Mapping[str, Any]) -> int:
        """``truncate_prompt_tokens``: keep the last N tokens (0: keep all)."""
        value = body.get("truncate_prompt_tokens")
        if value is None:
            return 0
        if type(value) is not int or value == 0 or value < -1:
            raise _bad("truncate_prompt_tokens must be a positive integer or -1")
        if value == -1:
            raise _bad("truncate_prompt_tokens -1 truncates to the engine's max_model_len, which Narwhal does not know")
        return value

    def encode(self, text: str, *, add_special_tokens: bool, truncate: int = 0) -> list[int]:
        """``text``'s ids, as transformers' fast tokenizer makes them (``truncate``: the last N, specials kept).

        Through ``encode_batch_fast([text])``, not ``encode``: the same ids,
        but the library lets the GIL go while it works, so a worker thread
        tokenizing a long prompt leaves the event loop running
        (docs/routing.md, "Tokenizing off the event loop"); and, unlike
        ``encode_batch``, it does not track each token's character offsets,
        which nothing here reads: a fifth less time (benchmarks/README.md,
        "Tokenizing like the engine").
        """
        if not truncate:
            return list(self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)
        # Truncation (left, as vLLM sets it) keeps room for the special tokens the post-processor adds.
        encoding = self._tok.encode_batch_fast([text], add_special_tokens=False)[0]
        room = truncate - (self._specials_added if add_special_tokens else 0)
        encoding.truncate(max(room, 0), direction="left")
        return list(self._tok.post_process(encoding, add_special_tokens=add_special_tokens).ids)


def _completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """A completion's one prompt: a string, or a list of token ids (a batch of one unwrapped)."""
    if body.get("prompt_embeds") is not None:
        raise _bad("prompt_embeds: the engine's tokens are not in the request")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    raise _bad("prompt must be one string or one list of token ids")


def _continue_final(text: str, messages: list[dict[str, Any]]) -> str:
    """Cut ``text`` after the final message's content (transformers' ``continue_final_message``)."""
    final = messages[-1]["content"]
    if isinstance(final, list):
        texts = [p["text"] for p in final if "text" in p]
        if not texts:
            raise _bad("continue_final_message: the final message has no text to continue")
        final = texts[-1]
    stripped = final.strip()
    if stripped not in text:
        raise _bad("continue_final_message: the final message does not appear in the rendered chat")
    at = text.rindex(stripped)
    if text[at : at + len(final.lstrip())] == final:
        return text[: at + len(final.lstrip())]  # the template kept the message's trailing spaces
    return text[: at + len(stripped)]


# -- loading ------------------------------------------------------------------------------


def _read_json(path: str, key: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(key, f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(data, dict):
        raise TokenizerLoadError(key, f"{path} must hold a JSON object")
    return data


def _compile(source: str, where: str, key: str) -> ChatTemplate:
    try:
        return ChatTemplate(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerLoadError(key, f"the chat template in {where} does not compile: {exc.message} "
                                      f"(line {exc.lineno})") from None  # fmt: skip


def _templates(value: Any, where: str, key: str) -> tuple[ChatTemplate | None, ChatTemplate | None]:
    """The default template and the ``tool_use`` one, from a string or a list of named templates."""
    if isinstance(value, str):
        return _compile(value, where, key), None
    if isinstance(value, list):
        named: dict[Any, str] = {}
        for entry in value:
            if not isinstance(entry, dict) or not isinstance(entry.get("template"), str):
                raise TokenizerLoadError(key, f"{where}: each named chat template needs a string template")
            named[entry.get("name")] = entry["template"]
        # Without "default", transformers refuses a request without tools (no template for it).
        default = _compile(named["default"], where, key) if "default" in named else None
        tool_use = _compile(named["tool_use"], where, key) if "tool_use" in named else None
        return default, tool_use
    if value is None:
        return None, None
    raise TokenizerLoadError(key, f"{where}: chat_template must be a string or a list of named templates")


def load_tokenizer(path: str, chat_template: str | None = None) -> EngineTokenizer:
    """Load ``model.tokenizer`` (a ``tokenizer.json``, or a directory holding one) and its chat template.

    The template is ``chat_template`` (a Jinja file) if given, else a
    ``chat_template.jinja`` beside the tokenizer (where transformers saves it
    since v4.50), else ``chat_template`` of the ``tokenizer_config.json``
    there; none at all leaves chat requests untokenizable. The special tokens
    a template may name (``bos_token``...) come from ``tokenizer_config.json``,
    then ``special_tokens_map.json``. Raises :class:`TokenizerLoadError`
    naming the config key.
    """
    from tokenizers import Tokenizer  # the runtime loads it only when model.tokenizer is set

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # the library raises its own exception type (an OS error inside)
        reason = "no such file" if not os.path.exists(file) else str(exc).splitlines()[0]
        raise TokenizerLoadError("model.tokenizer", f"cannot load tokenizer {file}: {reason}") from None
    folder = os.path.dirname(file)
    config_file = os.path.join(folder, "tokenizer_config.json")
    settings = _read_json(config_file, "model.tokenizer") if os.path.exists(config_file) else {}
    special: dict[str, Any] = {}
    map_file = os.path.join(folder, "special_tokens_map.json")
    extra = _read_json(map_file, "model.tokenizer") if os.path.exists(map_file) else {}
    for source in (extra, settings):  # tokenizer_config.json wins
        for name in SPECIAL_TOKENS:
            if (text := _token_text(source.get(name))) is not None:
                special[name] = text
        added = source.get("additional_special_tokens")
        if isinstance(added, list):
            special["additional_special_tokens"] = [t for t in map(_token_text, added) if t is not None]
    if chat_template is not None:
        try:
            with open(chat_template, encoding="utf-8") as f:
                source_text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise TokenizerLoadError("model.chat_template", f"cannot read {chat_template}: {reason}") from None
        template: ChatTemplate | None = _compile(source_text, chat_template, "model.chat_template")
        tool_template: ChatTemplate | None = None
    elif os.path.exists(jinja_file := os.path.join(folder, "chat_template.jinja")):
        with open(jinja_file, encoding="utf-8") as f:
            template, tool_template = _compile(f.read(), jinja_file, "model.tokenizer"), None
    else:
        template, tool_template = _templates(settings.get("chat_template"), config_file, "model.tokenizer")
    return EngineTokenizer(tokenizer, template=template, tool_template=tool_template, special_tokens=special,
                           path=file)  # fmt: skip
