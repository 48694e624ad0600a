"""narwhal bench's extra headers and its ``openai`` client (docs/bench.md), against a simulated engine's own records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.completion import Completion

from narwhal_bench.cli import main as bench_main, parse_header
from narwhal_bench.sdk import api_base, has_output
from narwhal_bench.stats import read_results
from narwhal_sim.testing import SimThread

pytestmark = pytest.mark.timeout(60)


def write_chats(path: Path, n: int = 4, tokens: int = 60, output: int = 16) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 5 * i, "input_length": tokens, "output_length": output,
                                        "hash_ids": [i]}) + "\n" for i in range(n)))  # fmt: skip
    return path


def test_a_header_is_name_colon_value() -> None:
    assert parse_header("x-narwhal-client: tenant-a") == ("x-narwhal-client", "tenant-a")
    assert parse_header("X-A:b:c") == ("X-A", "b:c")
    for bad in ("no-colon", ": value", "bad name:v", "x-a:caf\u00e9", "x-a:line\nbreak"):
        with pytest.raises(ValueError, match="--header"):
            parse_header(bad)


def test_the_sdk_base_url_is_the_endpoint_without_its_route() -> None:
    assert api_base("http://h:1", "/v1/chat/completions") == "http://h:1/v1"
    assert api_base("http://h:1/", "v1/completions") == "http://h:1/v1"
    assert api_base("http://h:1/proxy", "/v1/completions") == "http://h:1/proxy/v1"
    with pytest.raises(ValueError, match="--client openai"):
        api_base("http://h:1", "/v1/embeddings")


def _chunk(delta: dict) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                               "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def test_output_is_text_content_reasoning_or_tool_arguments() -> None:
    assert has_output(_chunk({"content": "hi"}))
    assert has_output(_chunk({"reasoning_content": "hm"}))
    assert has_output(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}))
    assert not has_output(_chunk({"role": "assistant", "content": ""}))
    assert not has_output(_chunk({"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f"}}]}))
    usage_only = ChatCompletionChunk.model_validate({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                                     "model": "m", "choices": []})  # fmt: skip
    assert not has_output(usage_only)
    text = Completion.model_validate({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                      "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})  # fmt: skip
    assert has_output(text)


def test_bad_header_and_client_combinations_exit_2(tmp_path: Path, capsys) -> None:
    trace = write_chats(tmp_path / "t.jsonl", n=1)
    base = ["--trace", str(trace), "--no-progress"]
    assert bench_main([*base, "--base-url", "http://127.0.0.1:9", "--header", "nocolon"]) == 2
    assert "--header wants NAME:VALUE" in capsys.readouterr().err
    assert bench_main([*base, "--virtual", "--client", "openai"]) == 2
    assert "--client openai sends over sockets" in capsys.readouterr().err
    assert bench_main([*base, "--base-url", "http://127.0.0.1:9", "--client", "openai",
                       "--endpoint", "/v1/embeddings"]) == 2  # fmt: skip
    assert "--client openai sends /v1/completions or /v1/chat/completions" in capsys.readouterr().err


def test_openai_client_streams_chats_with_the_header(tmp_path: Path) -> None:
    trace = write_chats(tmp_path / "t.jsonl")
    out = tmp_path / "out.jsonl"
    with SimThread("mixed", speed=20) as engine:
        rc = bench_main(["--trace", str(trace), "--base-url", engine.url, "--endpoint", "/v1/chat/completions",
                         "--client", "openai", "--header", "x-narwhal-client:short", "--api-key", "k-1",
                         "--output", str(out), "--no-progress"])  # fmt: skip
        records = engine.requests("/v1/chat/completions")
    assert rc == 0
    results = read_results(out.read_bytes().splitlines())
    assert len(results) == 4
    for r in results:
        assert r.ok and r.status == 200 and r.error is None, r
        assert r.output_tokens == 16 and len(r.itl_s) == 15  # every streamed token counted
        assert 0 < r.ttft_s <= r.e2e_s  # type: ignore[operator]
        assert r.cached_tokens == 0  # from the usage chunk stream_options asked for
    assert len(records) == 4
    for record in records:
        headers = {k.lower(): v for k, v in record["headers"]}
        assert headers["x-narwhal-client"] == "short"
        assert headers["authorization"] == "Bearer k-1"
        assert headers["user-agent"].startswith("AsyncOpenAI/Python")  # sent by the SDK, not the raw client
        assert headers["x-stainless-retry-count"] == "0"
        body = json.loads(record["body"])
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == body["min_tokens"] == 16 and body["ignore_eos"] is True
        assert body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"]) == 240


def test_openai_client_reports_an_error_status_with_its_message(tmp_path: Path) -> None:
    trace = write_chats(tmp_path / "t.jsonl", n=2)
    out = tmp_path / "out.jsonl"
    with SimThread("mixed", speed=20, api_key="right") as engine:
        rc = bench_main(["--trace", str(trace), "--base-url", engine.url, "--client", "openai", "--api-key", "wrong",
                         "--output", str(out), "--no-progress"])  # fmt: skip
        assert engine.stats()["auth_failures"] == 2
    assert rc == 0
    for r in read_results(out.read_bytes().splitlines()):
        assert not r.ok and r.status == 401 and r.error.startswith("HTTP 401"), r


def test_raw_client_sends_the_header(tmp_path: Path) -> None:
    trace = write_chats(tmp_path / "t.jsonl", n=2)
    with SimThread("mixed", speed=20) as engine:
        assert bench_main(["--trace", str(trace), "--base-url", engine.url, "--no-progress",
                           "--header", "x-narwhal-client:flood", "--header", "x-other: two"]) == 0  # fmt: skip
        records = engine.requests("/v1/completions")
    assert len(records) == 2
    for record in records:
        names = [k.lower() for k, _ in record["headers"]]
        headers = {k.lower(): v for k, v in record["headers"]}
        assert headers["x-narwhal-client"] == "flood" and headers["x-other"] == "two"
        assert names.index("x-narwhal-client") < names.index("x-other")  # in the order given
