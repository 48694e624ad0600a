"""/tokenize, /detokenize and ``--tokenizer`` (docs/simulator.md, "Tokens and block hashes").

The tokenizer is built and saved by the test itself: a word-level
``tokenizers`` model trained on a few sentences, with a chat template in
``tokenizer_config.json`` that renders tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from narwhal_sim.testing import SimThread
from narwhal_sim.tokens import Tokenizer as SimTokenizer
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


# -- vLLM's rendering, text by text (narwhal_sim/chat.py) --------------------------------------


def with_template(folder: Path, template: Any, *, load: bool = True, **config: Any) -> SimTokenizer | None:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>"]))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"chat_template": template, **config} if template is not None else config
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return SimTokenizer(str(folder)) if load else None


def loaded(folder: Path, template: Any, **config: Any) -> SimTokenizer:
    tok = with_template(folder, template, **config)
    assert tok is not None
    return tok


def test_content_parts_are_joined_by_newlines_or_kept_when_the_template_loops_over_them(tmp_path: Path) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a tusk"}, "the sea", {"type": "text", "text": ""},
                                          {"type": "text", "text": None}]}]  # fmt: skip
    string = loaded(tmp_path / "s", "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert string.render_chat({"messages": parts}) == "[a tusk\nthe sea]"  # empty and null texts dropped
    looping = loaded(tmp_path / "o", "{% set turns = messages %}{% for m in turns %}{% if m.content is string %}"
                                     "<{{ m.content }}>{% else %}{% for p in m.content %}({{ p.text }}){% endfor %}"
                                     "{% endif %}{% endfor %}")  # fmt: skip
    # vLLM wraps every text part it keeps; an empty text is a part too (only a null text is skipped).
    assert looping.render_chat({"messages": parts}) == "(a tusk)(the sea)()"
    assert looping.render_chat({"messages": [{"role": "user", "content": "ice"}]}) == "(ice)"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, "the sea"]}]
    assert string.render_chat({"messages": image}) == "[<##IMAGE##>\nthe sea]"  # vLLM's placeholder in front
    assert looping.render_chat({"messages": image}) == "()(the sea)"  # {"type": "image"} has no text
    tool = [{"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "cold"}, "blue"]}]
    assert looping.render_chat({"messages": tool}) == "<cold\nblue>"  # a tool result: one string, as vLLM makes it


def test_tools_tool_calls_special_tokens_and_tojson_are_vllms(tmp_path: Path) -> None:
    template = ("{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{% for m in messages %}{% if m.tool_calls %}"
                "{{ m.tool_calls[0].function.arguments.city }} {{ m.tool_calls[0].function.arguments | tojson }}"
                "{% endif %}{% endfor %}")  # fmt: skip
    tok = loaded(tmp_path, template, bos_token={"content": "<s>", "__type": "AddedToken"}, eos_token="</s>")
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Tromsø <N>"}'}}
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "assistant", "content": "x", "tool_calls": []}],
            "tools": [{"function": {"name": "weather", "strict": True}}]}  # fmt: skip
    assert tok.render_chat(body) == (
        '<s>|</s>|[{"type": "function", "function": {"name": "weather", "description": null, "parameters": null, '
        '"strict": true}}]|Tromsø <N> {"city": "Tromsø <N>"}'
    )
    assert call["function"]["arguments"] == '{"city": "Tromsø <N>"}'  # the request body is left as it came
    bad = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{no"}}]}]}
    assert tok.render_chat(bad) == "<s>|</s>|null| {}"  # no tools: null; arguments that are not JSON: {}


def test_generation_prompt_continuation_kwargs_and_named_templates(tmp_path: Path) -> None:
    tok = loaded(tmp_path / "k", "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
                                        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
                                        "{{ flavour }}{{ unknown is defined }}")  # fmt: skip
    messages = [{"role": "user", "content": "the sea"}, {"role": "assistant", "content": "it is "}]
    kwargs = {"flavour": "!", "add_generation_prompt": False}
    assert tok.render_chat({"messages": messages, "chat_template_kwargs": {**kwargs, "stray": 1}}) == (
        "<user>the sea</user><assistant>it is </assistant>!False"
    )
    continued = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert tok.render_chat(continued) == "<user>the sea</user><assistant>it is "
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    both = loaded(tmp_path / "n", named)
    assert both.render_chat({"messages": messages}) == "plain"
    assert both.render_chat({"messages": messages, "tools": [{"function": {"name": "f"}}]}) == "tools"
    folder = tmp_path / "n"
    (folder / "chat_template.jinja").write_text("{{ messages | length }}")  # transformers' file wins
    assert SimTokenizer(str(folder)).render_chat({"messages": messages}) == "2"


def test_transformers_environment_loop_controls_generation_documents_and_strftime(tmp_path: Path) -> None:
    tok = loaded(tmp_path, "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                           "{% if m.role == 'system' %}{% continue %}{% endif %}{% generation %}{{ m.content }}"
                           "{% endgeneration %}{% endfor %}|{{ documents | tojson(indent=None, sort_keys=True) }}"
                           "|{{ strftime_now('%Y') | length }}")  # fmt: skip
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "user", "content": "x"}]
    body = {"messages": messages, "documents": [{"title": "ice", "a": "<b>"}]}
    assert tok.render_chat(body) == 'u|[{"a": "<b>", "title": "ice"}]|4'


def test_what_vllm_refuses_is_a_400(tmp_path: Path) -> None:
    folder = tmp_path / "t"
    with_template(folder, "{% for m in messages %}{{ m.content }}{% endfor %}{{ raise_exception('no') if boom }}")
    messages = [{"role": "user", "content": "the sea"}]
    with SimThread("mixed", speed=0, tokenizer=str(folder)) as sim, httpx.Client(timeout=10) as client:
        for body, param in [
            ({"messages": messages, "continue_final_message": True}, None),
            ({"messages": messages, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
            ({"messages": messages, "add_generation_prompt": "yes"}, "add_generation_prompt"),
            ({"messages": messages, "chat_template_kwargs": {"boom": True}}, "messages"),
            ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "type"),
            ({"messages": messages, "chat_template": "{{ 1 }}"}, None),
        ]:
            for path in ("/v1/chat/completions", "/tokenize"):
                answer = client.post(sim.url + path, json={**body, "max_tokens": 1})
                assert answer.status_code == 400, (path, body)
                assert answer.json()["error"]["param"] == param
        assert client.post(sim.url + "/v1/completions", json={"prompt": "the sea", "add_special_tokens": 1}).json()[
            "error"]["param"] == "add_special_tokens"  # fmt: skip


def test_with_a_tokenizer_but_no_template_chat_is_refused_as_vllm_refuses_it(tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    assert not loaded(folder, None).has_chat_template
    with SimThread("mixed", speed=0, tokenizer=str(folder)) as sim, httpx.Client(timeout=10) as client:
        for path in ("/v1/chat/completions", "/tokenize"):
            answer = client.post(sim.url + path, json={"messages": [{"role": "user", "content": "the sea"}]})
            assert answer.status_code == 400
            assert answer.json()["error"]["message"] == (
                "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
                "template if the tokenizer does not define one."
            )
        completion = client.post(sim.url + "/v1/completions", json={"prompt": "the sea", "max_tokens": 1})
        assert completion.status_code == 200 and completion.json()["usage"]["prompt_tokens"] == 2


def test_truncate_prompt_tokens_keeps_the_last_tokens(tokenizer_dir: Path) -> None:
    text = "the narwhal lives in the arctic sea " * 6  # 42 tokens
    with SimThread("mixed", speed=0, tokenizer=str(tokenizer_dir)) as sim, httpx.Client(timeout=10) as client:
        def usage(body: dict[str, Any]) -> Any:
            return client.post(sim.url + "/v1/completions", json={"max_tokens": 1, **body}).json()["usage"]

        assert usage({"prompt": text, "truncate_prompt_tokens": 20})["prompt_tokens"] == 20
        assert usage({"prompt": text, "truncate_prompt_tokens": -1})["prompt_tokens"] == 42
        assert usage({"prompt": list(range(30)), "truncate_prompt_tokens": 5})["prompt_tokens"] == 5
        chat = {"messages": [{"role": "user", "content": text}], "truncate_prompt_tokens": 16}
        assert client.post(sim.url + "/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == 16
        too_long = client.post(sim.url + "/v1/completions", json={"prompt": text, "truncate_prompt_tokens": 10**7})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "truncate_prompt_tokens"


def test_a_template_that_does_not_compile_stops_start_up(tmp_path: Path) -> None:
    from narwhal_sim.cli import main

    folder = tmp_path / "broken"
    with_template(folder, "{% for m in messages %}", load=False)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json does not compile: .*endfor"):
        SimTokenizer(str(folder))
    assert main(["--tokenizer", str(folder), "--log", "none"]) == 2
