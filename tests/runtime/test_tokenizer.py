"""The router tokenizes prompts as the engine does (docs/configure.md, "Tokenizer").

The tokenizer is built and saved by the test itself (no network): a
word-level ``tokenizers`` model trained on a few sentences, with a BOS the
post-processor adds, and chat templates beside it. The engine is the
simulator over loopback sockets, loading the very same files; its
``/tokenize`` answer (and its prefix cache) is what the router's ids must
equal. The renderings vLLM makes that the simulator does not (content parts
joined by newlines, tools as pydantic dumps them, special tokens, and the
rest) are checked against the text vLLM renders, written out in each test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from narwhal.check_config import check_config
from narwhal_core.config import config_from_dict
from narwhal_core.errors import ConfigError
from narwhal_runtime.app import load_prompt_tokenizer
from narwhal_runtime.tokenizer import EngineTokenizer, PromptNotTokenizable, TokenizerLoadError, load_tokenizer
from narwhal_sim.testing import SimThread

from ..helpers import MODEL

CORPUS = [
    "the narwhal lives in the arctic sea",
    "a tusk is a long tooth of the narwhal",
    "user assistant system tool tools call weather city",
    "what is the weather in the city today",
    "it is cold and the ice is blue",
]
#: Renders tool names, every message, and the generation prompt; no variable the simulator lacks.
TEMPLATE = (
    "{% if tools %}<s> tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "it is cold"},
    {"role": "user", "content": "what is the weather in the city today"},
    {"role": "assistant", "content": "the ice is blue"},
    {"role": "user", "content": [{"type": "text", "text": "a tusk is a long tooth"}]},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def save_tokenizer(folder: Path, config: dict[str, Any] | None = None) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config if config is not None else
                                                             {"chat_template": TEMPLATE}))  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> EngineTokenizer:
    return load_tokenizer(str(tokenizer_dir))


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Any:
    with SimThread("mixed", speed=0, tokenizer=str(tokenizer_dir)) as sim:
        yield sim


def engine_ids(sim: Any, body: dict[str, Any]) -> list[int]:
    with httpx.Client(timeout=10) as client:
        answer = client.post(sim.url + "/tokenize", json={"model": MODEL, **body})
    assert answer.status_code == 200, answer.text
    tokens = answer.json()["tokens"]
    assert isinstance(tokens, list)
    return tokens


# -- the same ids as the engine, over real sockets ---------------------------------------


def test_completion_text_is_the_engines_ids_with_its_bos(tok: EngineTokenizer, engine: Any) -> None:
    text = "the narwhal lives in the arctic sea " * 5
    ids = tok.prompt_token_ids({"model": MODEL, "prompt": text}, chat=False)
    assert ids == engine_ids(engine, {"prompt": text})
    assert ids[0] == 1 and len(ids) == 36  # the BOS, then one id a word
    assert tok.prompt_token_ids({"prompt": [text]}, chat=False) == ids  # a batch of one
    plain = tok.prompt_token_ids({"prompt": text, "add_special_tokens": False}, chat=False)
    assert plain == ids[1:] == engine_ids(engine, {"prompt": text, "add_special_tokens": False})


def test_a_token_id_prompt_is_used_as_given_and_hits_the_engines_cache(tok: EngineTokenizer, engine: Any) -> None:
    text = "a tusk is a long tooth of the narwhal " * 4  # 37 ids with the BOS: two full 16-token blocks
    ids = tok.prompt_token_ids({"prompt": text}, chat=False)
    assert tok.prompt_token_ids({"prompt": ids}, chat=False) == ids
    assert tok.prompt_token_ids({"prompt": [ids]}, chat=False) == ids
    with httpx.Client(timeout=10) as client:
        client.post(engine.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}).raise_for_status()
        again = client.post(engine.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()
    # The engine cached the text's blocks under its own ids: the router's ids name the same blocks.
    assert again["usage"]["prompt_tokens"] == len(ids) == 37
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_chat_with_several_messages_and_tools_is_the_engines_ids(tok: EngineTokenizer, engine: Any) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
    ids = tok.prompt_token_ids(body, chat=True)
    assert ids == engine_ids(engine, {"messages": MESSAGES, "tools": TOOLS})
    rendered = tok.render_chat(body)
    assert rendered.startswith("<s> tools weather <s> system it is cold <s> user what is")
    assert rendered.endswith("<s> user a tusk is a long tooth <s> assistant")
    assert ids[0] == 1 and 0 not in ids  # the template wrote the <s>; no word is unknown
    without_tools = tok.prompt_token_ids({"messages": MESSAGES}, chat=True)
    assert without_tools == engine_ids(engine, {"messages": MESSAGES}) == ids[3:]


def test_chat_without_the_generation_prompt_is_the_engines_ids(tok: EngineTokenizer, engine: Any) -> None:
    body = {"messages": MESSAGES, "add_generation_prompt": False}
    ids = tok.prompt_token_ids(body, chat=True)
    assert ids == engine_ids(engine, body)
    assert ids == tok.prompt_token_ids({"messages": MESSAGES}, chat=True)[:-2]  # no "<s> assistant"
    with_bos = tok.prompt_token_ids({**body, "add_special_tokens": True}, chat=True)
    assert with_bos == [1, *ids] == engine_ids(engine, {**body, "add_special_tokens": True})


# -- what vLLM renders that the simulator's tests do not reach ------------------------------


def vllm_like(tmp_path: Path, template: str, **config: Any) -> EngineTokenizer:
    return load_tokenizer(str(save_tokenizer(tmp_path / "t", {"chat_template": template, **config})))


def test_text_parts_are_joined_by_newlines_unless_the_template_loops_over_them(tmp_path: Path) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a tusk"}, "the sea", {"type": "text", "text": ""}]}]
    string = vllm_like(tmp_path / "s", "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert string.render_chat({"messages": parts}) == "[a tusk\nthe sea]"
    looping = vllm_like(tmp_path / "o", "{% for m in messages %}{% for p in m.content %}({{ p.text }}){% endfor %}"
                                        "{% endfor %}")  # fmt: skip
    assert looping.render_chat({"messages": parts}) == "(a tusk)(the sea)()"  # an empty part stays a part
    assert looping.render_chat({"messages": [{"role": "user", "content": "ice"}]}) == "(ice)"


def test_tools_tool_calls_and_special_tokens_reach_the_template_as_in_vllm(tmp_path: Path) -> None:
    template = ("{{ bos_token }}{{ tools | tojson }}{% for m in messages %}{% if m.tool_calls %}"
                "{{ m.tool_calls[0].function.arguments.city }}{% endif %}{% endfor %}")  # fmt: skip
    tok = vllm_like(tmp_path, template, bos_token={"content": "<s>", "__type": "AddedToken"})
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Tromsø"}'}}
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}],
            "tools": [{"function": {"name": "weather", "strict": True}}]}  # fmt: skip
    assert tok.render_chat(body) == (
        '<s>[{"type": "function", "function": {"name": "weather", "description": null, "parameters": null, '
        '"strict": true}}]Tromsø'
    )
    assert call["function"]["arguments"] == '{"city": "Tromsø"}'  # the request body is left as it came


def test_template_kwargs_continue_final_message_and_truncation(tmp_path: Path) -> None:
    tok = vllm_like(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                              "{% if add_generation_prompt %}<assistant>{% endif %}{{ flavour }}")  # fmt: skip
    messages = [{"role": "user", "content": "the sea"}, {"role": "assistant", "content": "it is "}]
    kwargs = {"flavour": "!", "unknown": "dropped", "add_generation_prompt": False}
    assert tok.render_chat({"messages": messages, "chat_template_kwargs": kwargs}) == (
        "<user>the sea</user><assistant>it is </assistant>!"
    )
    continued = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert tok.render_chat(continued) == "<user>the sea</user><assistant>it is "
    with pytest.raises(PromptNotTokenizable, match="not compatible"):
        tok.render_chat({"messages": messages, "continue_final_message": True})
    # truncate_prompt_tokens keeps the last N tokens, the BOS the post-processor adds among them.
    text = "the narwhal lives in the arctic sea"
    full = tok.prompt_token_ids({"prompt": text}, chat=False)
    reference = Tokenizer.from_file(str(tmp_path / "t" / "tokenizer.json"))
    reference.enable_truncation(4, direction="left")
    assert tok.prompt_token_ids({"prompt": text, "truncate_prompt_tokens": 4}, chat=False) == \
        reference.encode(text).ids == [1, *full[-3:]]  # fmt: skip
    assert tok.prompt_token_ids({"prompt": full, "truncate_prompt_tokens": 4}, chat=False) == full[-4:]


def test_named_templates_and_a_template_file(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    tok = vllm_like(tmp_path / "n", named)  # type: ignore[arg-type]
    assert tok.render_chat({"messages": MESSAGES}) == "plain"
    assert tok.render_chat({"messages": MESSAGES, "tools": TOOLS}) == "tools"
    folder = save_tokenizer(tmp_path / "f", {})
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert load_tokenizer(str(folder)).render_chat({"messages": MESSAGES}) == "it is cold"
    (tmp_path / "mine.jinja").write_text("{{ messages | length }}")
    mine = load_tokenizer(str(folder / "tokenizer.json"), str(tmp_path / "mine.jinja"))
    assert mine.render_chat({"messages": MESSAGES}) == "4"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": MESSAGES, "chat_template": "{{ 1 }}"},
    {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
    {"messages": "hi"},
    {"messages": MESSAGES, "add_generation_prompt": "yes"},
    {"messages": [{"role": "user", "content": "x {{"}], "tools": [{"function": {}}]},
    {"messages": [{"role": "user", "content": "boom"}], "chat_template_kwargs": {}, "truncate_prompt_tokens": -1},
])  # fmt: skip
def test_what_cannot_be_tokenized_like_the_engine_says_so(tok: EngineTokenizer, body: dict[str, Any]) -> None:
    with pytest.raises(PromptNotTokenizable):
        tok.prompt_token_ids(body, chat=True)


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]], [], 5, None, [1, "a"]])
def test_a_batch_or_a_malformed_prompt_is_not_tokenizable(tok: EngineTokenizer, prompt: Any) -> None:
    with pytest.raises(PromptNotTokenizable):
        tok.prompt_token_ids({"prompt": prompt}, chat=False)


def test_without_a_chat_template_chat_is_refused_completions_are_not(tmp_path: Path) -> None:
    tok = load_tokenizer(str(save_tokenizer(tmp_path, {})))
    assert not tok.has_chat_template
    words = tok.encode("the sea", add_special_tokens=False)
    assert tok.prompt_token_ids({"prompt": "the sea"}, chat=False) == [1, *words]
    with pytest.raises(PromptNotTokenizable, match="model.chat_template"):
        tok.prompt_token_ids({"messages": MESSAGES}, chat=True)


# -- a tokenizer that does not load is a config error ----------------------------------------


def test_a_bad_path_or_template_is_a_clear_load_error(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"cannot load tokenizer .*nothing\.json: no such file") as info:
        load_tokenizer(str(tmp_path / "nothing.json"))
    assert info.value.key == "model.tokenizer"
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "garbage.json"))
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m }}")
    with pytest.raises(TokenizerLoadError, match=r"bad\.jinja does not compile: .*endfor.* \(line 1\)") as info:
        load_tokenizer(str(tokenizer_dir), str(tmp_path / "bad.jinja"))
    assert info.value.key == "model.chat_template"
    with pytest.raises(TokenizerLoadError, match=r"cannot read .*absent\.jinja: No such file"):
        load_tokenizer(str(tokenizer_dir), str(tmp_path / "absent.jinja"))
    broken = save_tokenizer(tmp_path / "broken", {"chat_template": "{% if %}"})
    with pytest.raises(TokenizerLoadError, match=r"tokenizer_config\.json does not compile"):
        load_tokenizer(str(broken))


def config(tmp_path: Path, **model: str) -> Path:
    path = tmp_path / "narwhal.toml"
    lines = "".join(f'{key} = "{value}"\n' for key, value in model.items())
    path.write_text(f'[model]\nname = "m"\n{lines}[engine]\ndecode = ["http://127.0.0.1:8200"]\n'
                    f'[journal]\npath = "{tmp_path / "j.jsonl"}"\n')  # fmt: skip
    return path


def test_check_config_loads_the_tokenizer(tmp_path: Path, tokenizer_dir: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert check_config(str(config(tmp_path, tokenizer=str(tokenizer_dir)))) == 0
    assert check_config(str(config(tmp_path, tokenizer=str(tmp_path / "missing")))) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("narwhal: bad config: model.tokenizer: cannot load tokenizer ") and "no such file" in line
    (tmp_path / "bad.jinja").write_text("{{ }")
    bad = config(tmp_path, tokenizer=str(tokenizer_dir), chat_template=str(tmp_path / "bad.jinja"))
    assert check_config(str(bad)) == 2
    assert "model.chat_template: the chat template in" in capsys.readouterr().err


def test_the_runtime_loads_the_configured_tokenizer(tokenizer_dir: Path) -> None:
    data = {"model": {"name": "m", "tokenizer": str(tokenizer_dir)}, "engine": {"decode": ["http://127.0.0.1:8200"]}}
    loaded = load_prompt_tokenizer(config_from_dict(data, env={}))
    assert loaded is not None and loaded.prompt_token_ids({"prompt": "the sea"}, chat=False)[0] == 1
    assert load_prompt_tokenizer(config_from_dict({**data, "model": {"name": "m"}}, env={})) is None
    with pytest.raises(ConfigError) as info:
        load_prompt_tokenizer(config_from_dict({**data, "model": {"name": "m", "tokenizer": "/nonexistent"}}, env={}))
    assert info.value.key == "model.tokenizer"


def test_a_prompts_head_is_the_start_of_its_ids(tok: EngineTokenizer) -> None:
    # What the router's look at a large prompt's head relies on (narwhal_core/kv_policy.py, "Tokenizing only
    # what can hit"): the head's ids, but for the last few near the cut, are the whole prompt's first ones.
    text = "the narwhal lives in the arctic sea " * 40
    cases: list[tuple[dict[str, Any], bool]] = [
        ({"prompt": text}, False),
        ({"prompt": text, "add_special_tokens": False}, False),
        ({"messages": MESSAGES + [{"role": "user", "content": text}], "tools": TOOLS}, True),
    ]
    for body, chat in cases:
        whole = tok.prompt_token_ids(body, chat)
        head = tok.head_token_ids(body, chat, 200)
        assert head is not None and 16 < len(head) < len(whole)
        assert head[:-2] == whole[: len(head) - 2]
    ids = tok.prompt_token_ids({"prompt": text}, chat=False)
    assert tok.head_token_ids({"prompt": ids}, False, 50) == ids[:50]  # token ids: their own head
    # The engine keeps a truncated prompt's LAST tokens: its head says nothing.
    assert tok.head_token_ids({"prompt": text, "truncate_prompt_tokens": 10}, False, 200) is None
    with pytest.raises(PromptNotTokenizable):
        tok.head_token_ids({"prompt": 7}, False, 200)
