"""/tokenize, /detokenize and ``--tokenizer`` (docs/simulator.md, "Tokens and block hashes").

The tokenizer is built and saved by the test itself: a word-level
``tokenizers`` model trained on a few sentences, with a chat template in
``tokenizer_config.json`` that renders tools.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from narwhal_sim.testing import SimThread
from narwhal_sim.tokens import pseudo_token_ids

from ..helpers import MODEL

CORPUS = [
    "the narwhal lives in the arctic sea",
    "a tusk is a long tooth of the narwhal",
    "user assistant system tool call weather city",
    "what is the weather in the city today",
]
TEMPLATE = (
    "{% if tools %}<s> tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>"]))
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


def test_tokenize_and_detokenize_with_a_tokenizer(tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = "the narwhal lives in the arctic sea " * 6  # 42 words: 42 tokens, 2 full blocks
    ids = tok.encode(text).ids
    with SimThread("mixed", speed=0, tokenizer=str(tokenizer_dir / "tokenizer.json")) as sim, \
            httpx.Client(timeout=10) as client:  # fmt: skip
        answer = client.post(sim.url + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
        assert answer.status_code == 200
        assert answer.json() == {"count": len(ids), "max_model_len": 131_072, "tokens": ids,
                                 "token_strs": [tok.decode([i]) for i in ids]}  # fmt: skip
        back = client.post(sim.url + "/detokenize", json={"tokens": ids[:3]}).json()
        assert back == {"prompt": "the narwhal lives"}
        bad = client.post(sim.url + "/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert client.post(sim.url + "/detokenize", json={"tokens": "x"}).status_code == 400
        assert client.post(sim.url + "/tokenize", json={"prompt": 3}).json()["error"]["param"] == "prompt"
        assert client.post(sim.url + "/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404

        # Completions count by the tokenizer's ids, and hit the prefix cache by their blocks.
        first = client.post(sim.url + "/v1/completions", json={"prompt": text, "max_tokens": 2}).json()
        second = client.post(sim.url + "/v1/completions", json={"prompt": text, "max_tokens": 2}).json()
        assert first["usage"]["prompt_tokens"] == len(ids) == 42
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        # The same words in another spacing are the same ids: the same blocks.
        third = client.post(sim.url + "/v1/completions", json={"prompt": text.replace(" ", "  "), "max_tokens": 2})
        assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_chat_is_rendered_by_the_template_with_tools(tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is the weather in the city today"}]}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    rendered = "<s> tools weather <s> user what is the weather in the city today <s> assistant"
    with SimThread("mixed", speed=0, tokenizer=str(tokenizer_dir)) as sim, httpx.Client(timeout=10) as client:
        chat = client.post(sim.url + "/v1/chat/completions", json={"messages": messages, "tools": tools,
                                                                   "max_tokens": 1}).json()  # fmt: skip
        assert chat["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False).ids)
        plain = client.post(sim.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
        assert plain["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"] - 3  # "<s> tools weather"
        counted = client.post(sim.url + "/tokenize", json={"messages": messages, "tools": tools}).json()
        assert counted["tokens"] == tok.encode(rendered, add_special_tokens=False).ids


def test_without_a_tokenizer_ids_are_the_documented_pseudo_ids() -> None:
    with SimThread("mixed", speed=0) as sim, httpx.Client(timeout=10) as client:
        text = "four chars per token, the last one shorter"
        answer = client.post(sim.url + "/tokenize", json={"prompt": text}).json()
        assert answer["tokens"] == pseudo_token_ids(text) and answer["count"] == 11
        assert client.post(sim.url + "/detokenize", json={"tokens": [5, 7]}).json() == {"prompt": "<5><7>"}
        chat = client.post(sim.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        usage = client.post(sim.url + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).json()["usage"]  # fmt: skip
        assert chat["count"] == usage["prompt_tokens"]


def test_a_bad_tokenizer_path_stops_start_up(tmp_path: Path) -> None:
    from narwhal_sim.cli import main

    missing = tmp_path / "nothing.json"
    assert main(["--tokenizer", str(missing), "--log", "none"]) == 2
