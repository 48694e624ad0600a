"""Token ids a router can reproduce: stable block hashes, pseudo token ids, a Hugging Face tokenizer.

Pure functions plus :class:`Tokenizer`, a thin wrapper of the ``tokenizers``
library with the chat template, rendered as vLLM renders it
(:mod:`narwhal_sim.chat`). See docs/simulator.md, "Tokens and block hashes".

* :func:`pseudo_token_ids` — without ``--tokenizer``: one token per 4
  characters (code points) of text, the last one shorter; its id is
  ``crc32(utf-8 bytes of those characters) mod 128256``.
* :func:`block_hashes` — the chained hash of full blocks:
  ``hash_i = first 8 bytes, big-endian, of sha256(hash_{i-1} as 8 bytes big-endian
  ‖ each token id of block i as 4 bytes big-endian)``, with ``hash_{-1} = 0``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from narwhal_sim.chat import SPECIAL_TOKEN_NAMES, ChatError, ChatTemplate, render_chat

__all__ = [
    "CHARS_PER_TOKEN",
    "PSEUDO_VOCAB",
    "pseudo_token_ids",
    "pseudo_token_text",
    "block_hashes",
    "Tokenizer",
    "DEFAULT_CHAT_TEMPLATE",
]

#: Without a tokenizer, one token per this many characters (code points).
CHARS_PER_TOKEN = 4
#: Pseudo token ids fall in ``[0, PSEUDO_VOCAB)`` (Llama 3's vocabulary size).
PSEUDO_VOCAB = 128_256


def pseudo_token_ids(text: str, limit: int | None = None) -> list[int]:
    """Deterministic, process-independent token ids of ``text`` (the first ``limit`` tokens if given)."""
    data = text
    count = -(-len(data) // CHARS_PER_TOKEN)
    if limit is not None and limit < count:
        count = limit
    crc = zlib.crc32
    step = CHARS_PER_TOKEN
    vocab = PSEUDO_VOCAB
    if data.isascii():
        # One character is one byte: slice the bytes (the same ids, cheaper).
        raw = data[: count * step].encode("ascii")
        return [crc(raw[i : i + step]) % vocab for i in range(0, count * step, step)]
    return [crc(data[i : i + step].encode("utf-8", "surrogatepass")) % vocab for i in range(0, count * step, step)]


def pseudo_token_text(token_ids: Sequence[int]) -> str:
    """Text for pseudo ids (``/detokenize`` without a tokenizer): ``<id>`` per token (not invertible)."""
    return "".join(f"<{t}>" for t in token_ids)


_BE8 = struct.Struct(">Q")


def block_hashes(token_ids: Sequence[int], block_size: int, *, parent: int = 0) -> list[int]:
    """Chained 64-bit hashes of the full ``block_size``-token blocks of ``token_ids``."""
    out: list[int] = []
    full = len(token_ids) // block_size
    if not full:
        return out
    width = 4 * block_size
    packed = struct.pack(f">{full * block_size}I", *token_ids[: full * block_size])
    sha = hashlib.sha256
    prev = _BE8.pack(parent)
    for start in range(0, full * width, width):
        prev = sha(prev + packed[start : start + width]).digest()[:8]
        out.append(int.from_bytes(prev, "big"))
    return out


#: Without a tokenizer (pseudo tokens), chat is rendered this way: ``<|role|>\ncontent\n`` per message, tools
#: first, ``<|assistant|>\n`` last (docs/simulator.md). With ``--tokenizer`` there is no default: as vLLM,
#: a tokenizer without a chat template refuses chat requests.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an ``AddedToken`` object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_tokens(folder: str) -> dict[str, Any]:
    """The special tokens a template sees: ``tokenizer_config.json``'s over ``special_tokens_map.json``'s."""
    found: dict[str, Any] = {}
    for source in (_read_json(os.path.join(folder, "special_tokens_map.json")),
                   _read_json(os.path.join(folder, "tokenizer_config.json"))):  # fmt: skip
        for name in SPECIAL_TOKEN_NAMES:
            if (text := _token_text(source.get(name))) is not None:
                found[name] = text
        added = source.get("additional_special_tokens")
        if isinstance(added, list):
            found["additional_special_tokens"] = [t for t in map(_token_text, added) if t is not None]
    return found


def _compile(source: str, where: str) -> ChatTemplate:
    try:
        return ChatTemplate(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template in {where} does not compile: {exc.message} (line {exc.lineno})") from None


def _templates(file: str, chat_template: str | None) -> tuple[ChatTemplate | None, ChatTemplate | None]:
    """(default, ``tool_use``) templates, found where vLLM and transformers find them.

    ``--chat-template`` (vLLM's flag), else ``chat_template.jinja`` beside the
    tokenizer (transformers' file since v4.50), else ``chat_template`` of
    ``tokenizer_config.json``: one string, or a list of named templates
    (``default``, ``tool_use``). None at all: chat is refused.
    """
    folder = os.path.dirname(file)
    if chat_template is not None:
        with open(chat_template, encoding="utf-8") as f:
            return _compile(f.read(), chat_template), None
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return _compile(f.read(), jinja_file), None
    config_file = os.path.join(folder, "tokenizer_config.json")
    value = _read_json(config_file).get("chat_template")
    if isinstance(value, str):
        return _compile(value, config_file), None
    if isinstance(value, list):
        named = {e.get("name"): e.get("template") for e in value if isinstance(e, dict)}
        if not all(isinstance(t, str) for t in named.values()):
            raise ValueError(f"{config_file}: each named chat template needs a string template")
        default, tool_use = named.get("default"), named.get("tool_use")
        return (_compile(default, config_file) if default is not None else None,
                _compile(tool_use, config_file) if tool_use is not None else None)  # fmt: skip
    return None, None


class Tokenizer:
    """A Hugging Face ``tokenizer.json``, its chat template and special tokens: the ids vLLM computes.

    Chat requests are rendered by :func:`narwhal_sim.chat.render_chat`
    (vLLM's rendering) and encoded by the ``tokenizers`` library, as vLLM's
    fast tokenizer encodes them.
    """

    def __init__(self, path: str, *, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as HfTokenizer  # optional at import time of the package

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = HfTokenizer.from_file(file)
        except Exception as exc:  # the library raises its own exception type
            raise ValueError(f"cannot load tokenizer {file}: {exc}") from None
        self.path = file
        self._templates = _templates(file, chat_template)
        self._special = _special_tokens(os.path.dirname(file))
        self._specials_added = int(self._tok.num_special_tokens_to_add(False))

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be rendered (vLLM refuses them without a template)."""
        return self._templates != (None, None)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True, truncate: int = 0) -> list[int]:
        """Token ids of ``text``; ``truncate`` > 0 keeps the last that many, the added special tokens among them.

        vLLM truncates on the left and leaves room for the special tokens the
        post-processor adds (``truncation_side="left"``, ``max_length``).
        """
        # encode_batch, not encode: it releases the GIL, so a tokenizing thread runs beside the serving loop.
        if not truncate:
            return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        encoding = self._tok.encode_batch([text], add_special_tokens=False)[0]
        encoding.truncate(max(truncate - (self._specials_added if add_special_tokens else 0), 0), direction="left")
        return list(self._tok.post_process(encoding, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (``ValueError`` for unknown ids)."""
        size = self.vocab_size
        for t in token_ids:
            if not 0 <= t < size:
                raise ValueError(f"token id {t} is out of vocabulary (size {size})")
        return str(self._tok.decode(list(token_ids), skip_special_tokens=False))

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The prompt text vLLM renders for chat request ``body`` (:class:`~narwhal_sim.chat.ChatError` if refused)."""
        return render_chat(body, self._templates, self._special)

    def chat_prompt(self, body: Mapping[str, Any], *, truncate: int = 0) -> tuple[str, list[int]]:
        """Chat request ``body``'s text and ids: the text encoded with ``add_special_tokens`` (default false).

        vLLM encodes the rendered chat without adding special tokens unless
        the request asks (``ChatCompletionRequest.add_special_tokens``): the
        template writes them.
        """
        value = body.get("add_special_tokens")
        if value is not None and type(value) is not bool:
            raise ChatError("add_special_tokens must be a boolean", "add_special_tokens")
        text = self.render_chat(body)
        return text, self.encode(text, add_special_tokens=value is True, truncate=truncate)
