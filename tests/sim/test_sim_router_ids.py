"""The simulator caches a prompt under the very ids the router computes (docs/simulator.md, "Tokens and block hashes").

The router's ``narwhal_runtime.tokenizer`` and the simulator's
``--tokenizer`` both follow vLLM's rendering and encoding; here they load the
same files (a byte-level BPE trained by the test, with a BOS the
post-processor adds, ``bos_token`` for the template) and, for each request,
three things must be one list: the router's ids, the simulator's
``/tokenize`` answer, and the token ids of the blocks the simulator caches
for the request (read from its KV events, through the replay socket) — with
``usage.prompt_tokens`` their count.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from narwhal_runtime.tokenizer import EngineTokenizer, load_tokenizer
from narwhal_sim.testing import SimThread

BLOCK = 16
CORPUS = [
    "the narwhal lives in the arctic sea and its tusk is a long tooth",
    "what is the weather in the city of Tromsø today? it is cold and the ice is blue",
    '{"type": "function", "function": {"name": "weather", "arguments": {"city": "Tromsø"}}}',
    "<user> <assistant> <system> <tool> <tools> <call> [ ] </user> </assistant>",
]
#: String content; tools and tool-call arguments through tojson; bos_token; one chat_template_kwargs variable.
STRING_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
    "{% endfor %}"
    "{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if flavour %}{{ flavour }}{% endif %}"
)
#: Loops over a message's content parts: vLLM hands it lists of parts ("openai" content format).
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}"
    "{% endif %}"
    "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)

SEA = "the narwhal lives in the arctic sea and its tusk is a long tooth. "
MESSAGES = [
    {"role": "system", "content": "it is cold and the ice is blue. " * 3},
    {"role": "user", "content": "what is the weather in the city of Tromsø today? " * 2},
    {"role": "assistant", "content": SEA},
    {"role": "user", "content": [{"type": "text", "text": "a tusk"}, "is a long tooth", {"type": "text", "text": SEA}]},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "strict": True}},
         {"function": {"name": "tide", "description": "<sea> & ice"}}]  # fmt: skip
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Tromsø <N>"}'}}
TOOL_TURNS = [
    {"role": "user", "content": "what is the weather in the city of Tromsø today?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1",
     "content": [{"type": "text", "text": "cold"}, {"type": "text", "text": "blue"}]},
]

STRING_CASES: dict[str, tuple[bool, dict[str, Any]]] = {
    "completion text": (False, {"prompt": SEA * 3}),
    "completion text without special tokens": (False, {"prompt": SEA * 3, "add_special_tokens": False}),
    "chat, several messages": (True, {"messages": MESSAGES}),
    "chat, content parts joined by newlines": (True, {"messages": MESSAGES[3:]}),
    "chat, tools and tool calls": (True, {"messages": TOOL_TURNS, "tools": TOOLS}),
    "chat without the generation prompt": (True, {"messages": MESSAGES, "add_generation_prompt": False}),
    "chat continuing the final message": (True, {"messages": MESSAGES[:3], "add_generation_prompt": False,
                                                 "continue_final_message": True}),
    "chat with template kwargs": (True, {"messages": MESSAGES, "chat_template_kwargs": {"flavour": " and a tusk",
                                                                                         "unused": 1}}),
    "chat with special tokens added": (True, {"messages": MESSAGES[:2], "add_special_tokens": True}),
}  # fmt: skip
PARTS_CASES: dict[str, tuple[bool, dict[str, Any]]] = {
    "chat, content parts kept as a list": (True, {"messages": MESSAGES}),
    "chat, parts without the generation prompt": (True, {"messages": MESSAGES, "add_generation_prompt": False}),
    "chat, an empty text part stays a part": (True, {"messages": [
        *MESSAGES[:3], {"role": "user", "content": [*MESSAGES[3]["content"], {"type": "text", "text": ""}, "ice"]},
    ]}),
}


def save(folder: Path, template: str) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


class Engine:
    """A simulator with KV events, and the token ids of the blocks it stored since its last cache reset."""

    def __init__(self, sim: SimThread, ctx: zmq.Context[Any]) -> None:
        self.sim, self.ctx = sim, ctx
        self.events: list[list[Any]] = []
        self.next_seq = 0

    def _replay(self) -> None:
        publisher = self.sim.engine.publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        try:
            dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000), "no replay answer"
                _, seq, payload = dealer.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return
                assert int.from_bytes(seq, "big") == self.next_seq
                self.next_seq += 1
                for event in msgpack.unpackb(payload, raw=False)[1]:  # map events from 0.24.0 on (vLLM PR #42892)
                    self.events.append(event if isinstance(event, list) else
                                       [event["type"], event.get("block_hashes"), None, event.get("token_ids")])
        finally:
            dealer.close()

    def cached_ids(self, count: int) -> list[int]:
        """The token ids of the first ``count`` stored tokens after the last ``AllBlocksCleared``."""
        deadline = time.monotonic() + 5
        while True:
            self._replay()
            tags = [e[0] for e in self.events]
            cleared = len(tags) - tags[::-1].index("AllBlocksCleared") if "AllBlocksCleared" in tags else None
            stored = [t for e in self.events[cleared or 0:] if e[0] == "BlockStored" for t in e[3]]
            if cleared is not None and len(stored) >= count:
                return stored[:count]
            assert time.monotonic() < deadline, f"the engine stored {len(stored)} of {count} tokens"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def ctx() -> Any:
    context = zmq.Context()
    yield context
    context.term()


def _engine(folder: Path, ctx: zmq.Context[Any]) -> Any:
    with SimThread("mixed", speed=0, tokenizer=str(folder), kv_events_endpoint="tcp://127.0.0.1:0",
                   kv_events_replay_endpoint="tcp://127.0.0.1:0") as sim:  # fmt: skip
        yield Engine(sim, ctx), load_tokenizer(str(folder))


@pytest.fixture(scope="module")
def string_engine(tmp_path_factory: pytest.TempPathFactory, ctx: zmq.Context[Any]) -> Any:
    yield from _engine(save(tmp_path_factory.mktemp("s") / "tok", STRING_TEMPLATE), ctx)


@pytest.fixture(scope="module")
def parts_engine(tmp_path_factory: pytest.TempPathFactory, ctx: zmq.Context[Any]) -> Any:
    yield from _engine(save(tmp_path_factory.mktemp("p") / "tok", PARTS_TEMPLATE), ctx)


def check(engine: Engine, router: EngineTokenizer, chat: bool, body: dict[str, Any]) -> list[int]:
    ids = router.prompt_token_ids(body, chat=chat)
    full = len(ids) // BLOCK * BLOCK
    assert full >= 2 * BLOCK, "a case needs full blocks to be cached"
    url = engine.sim.url
    with httpx.Client(timeout=10) as client:
        tokenized = client.post(url + "/tokenize", json=body)
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == ids
        assert client.post(url + "/reset_prefix_cache").status_code == 200
        answer = client.post(url + ("/v1/chat/completions" if chat else "/v1/completions"),
                             json={**body, "max_tokens": 1})  # fmt: skip
        assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(ids)
    assert engine.cached_ids(full) == ids[:full]
    return ids


@pytest.mark.parametrize("case", list(STRING_CASES))
def test_the_engine_caches_the_routers_ids(string_engine: tuple[Engine, EngineTokenizer], case: str) -> None:
    engine, router = string_engine
    chat, body = STRING_CASES[case]
    ids = check(engine, router, chat, body)
    if case == "completion text":
        # A token-id prompt is the same prompt: the engine caches it under the same ids.
        assert ids[0] == 0  # the BOS the post-processor adds
        with httpx.Client(timeout=10) as client:
            client.post(engine.sim.url + "/reset_prefix_cache").raise_for_status()
            usage = client.post(engine.sim.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()
        assert usage["usage"]["prompt_tokens"] == len(ids)
        assert engine.cached_ids(len(ids) // BLOCK * BLOCK) == ids[: len(ids) // BLOCK * BLOCK]


@pytest.mark.parametrize("case", list(PARTS_CASES))
def test_a_template_over_content_parts_caches_the_routers_ids(parts_engine: tuple[Engine, EngineTokenizer],
                                                               case: str) -> None:  # fmt: skip
    engine, router = parts_engine
    chat, body = PARTS_CASES[case]
    ids = check(engine, router, chat, body)
    assert "[a tusk][is a long tooth][" in router.render_chat(body)  # the parts reached the template as a list
    assert ids
