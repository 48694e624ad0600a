"""Token ids a router can reproduce: stable block hashes, pseudo token ids, a Hugging Face tokenizer.

Pure functions plus :class:`Tokenizer`, a thin wrapper of the ``tokenizers``
library with a ``jinja2`` chat template. See docs/simulator.md, "Tokens and
block hashes".

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
from collections.abc import Sequence
from typing import Any

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


#: The simulator's own chat rendering, as a jinja2 template: ``<|role|>\ncontent\n`` per message,
#: tools first, ``<|assistant|>\n`` last (docs/simulator.md).
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    """A Hugging Face ``tokenizer.json`` and, if found, its chat template.

    The template comes from ``chat_template`` (a path to a ``.jinja`` file),
    else from ``tokenizer_config.json``'s ``chat_template`` next to the
    tokenizer file, else :data:`DEFAULT_CHAT_TEMPLATE`.
    """

    def __init__(self, path: str, *, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as HfTokenizer  # optional at import time of the package

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = HfTokenizer.from_file(file)
        except Exception as exc:  # the library raises its own exception type
            raise ValueError(f"cannot load tokenizer {file}: {exc}") from None
        self.path = file
        template = None
        if chat_template is not None:
            with open(chat_template, encoding="utf-8") as f:
                template = f.read()
        else:
            config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
            if os.path.exists(config_file):
                with open(config_file, encoding="utf-8") as f:
                    value = json.load(f).get("chat_template")
                if isinstance(value, str):
                    template = value
        self.chat_template_source = template or DEFAULT_CHAT_TEMPLATE
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.policies["json.dumps_kwargs"] = {"sort_keys": False}

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(self.chat_template_source)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (``ValueError`` for unknown ids)."""
        size = self.vocab_size
        for t in token_ids:
            if not 0 <= t < size:
                raise ValueError(f"token id {t} is out of vocabulary (size {size})")
        return str(self._tok.decode(list(token_ids), skip_special_tokens=False))

    def render_chat(self, messages: list[dict[str, Any]], tools: Any = None, *, add_generation_prompt: bool = True) -> str:
        """``messages`` (and ``tools``) rendered by the chat template."""
        return str(
            self._template.render(messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt)
        )
