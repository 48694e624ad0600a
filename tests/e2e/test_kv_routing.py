"""Routing from the engines' own KV events, end to end (docs/routing.md, "KV events"; docs/operate.md, "KV events").

Real sockets on both runtimes: two simulated prefill engines that load the
test's tokenizer and publish vLLM's KV events (ZMQ PUB, with the replay
socket), one decode engine, and Narwhal with the same tokenizer and
``routing.policy = "kv"``. What Narwhal decided is read from its journal
(``routing.index``, each candidate's ``matched_tokens``); what it knows is
read from its index (on its loop) and its ``/metrics``; what the engines
did, from the simulators. Completions and chat alike: the engines and
Narwhal render a conversation with the same chat template and tokenizer.

Prompts that make an engine hold something are sent to that engine
DIRECTLY, not through Narwhal: Narwhal's approximate index never hears of
them, and speculative entries are off (``kv_speculative_ttl_s = 0``), so
only the events can tell Narwhal where they are.

Every engine has a loopback address of its own (Linux routes all of
127/8) and the same KV-event port P, so one template, ``tcp://{host}:P``,
names every engine's stream, as on a real fleet of one engine per host.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

import narwhal_sim.server
from narwhal_core.kv_index import token_block_hashes
from narwhal_runtime.group_metrics import aggregate
from narwhal_runtime.tokenizer import EngineTokenizer, load_tokenizer
from narwhal_sim.kv_events import KvEventPublisher
from narwhal_sim.testing import SimError, SimThread

from ..harness import LogCapture, RouterThread, make_config
from ..helpers import MODEL, completion_records, journal_terminal, poll, save_word_tokenizer
from .support import ServeProcess, serve_config

#: The prefill engines' addresses, and the decode engine's.
PREFILL_HOSTS = ("127.0.0.21", "127.0.0.22")
DECODE_HOST = "127.0.0.23"
#: vLLM's default block size, the engines' and ``routing.kv_block_size``'s.
BLOCK = 16
#: A prefill engine's KV pool, in blocks: six prompts of six blocks fill it past its size.
GPU_BLOCKS = 32
#: Tokens of a prompt: the BOS, then words: six full blocks.
PROMPT_TOKENS = 6 * BLOCK
WORDS = [f"w{i}" for i in range(4000)]


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> str:
    """A prompt of ``tokens`` token ids (its BOS included) that no other seed's shares a first block with."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens - 1))


# ------------------------------------------------------------------ engines


class BoundPublisher(KvEventPublisher):
    """The simulator's publisher, binding its PUB socket to the engine's own address.

    vLLM (and the simulator) bind the PUB socket only for a wildcard host
    (docs/simulator.md, "KV events"): on a real fleet each engine is alone
    on its host with ``tcp://*:5557``. Here several engines share one
    machine, each on its own loopback address, so each binds ``tcp://ITS
    ADDRESS:P``.
    """

    def _open(self, sock: Any, endpoint: str, *, bind: bool | None) -> str:
        return super()._open(sock, endpoint, bind=True)


def shared_port(hosts: tuple[str, ...]) -> int:
    """A port P such that P (events) and P + 1 (replay) are free on every one of ``hosts``."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        if port >= 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for host in hosts:
                    for candidate in (port, port + 1):
                        sock = stack.enter_context(socket.socket())
                        sock.bind((host, candidate))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on every one of {hosts}")


@attrs.frozen
class KvFleet:
    prefill: tuple[SimThread, ...]
    decode: SimThread
    #: Every engine's KV-event port (its replay port: the next one).
    port: int
    tokenizer: Path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_word_tokenizer(tmp_path_factory.mktemp("tok"), WORDS)


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> EngineTokenizer:
    return load_tokenizer(str(tokenizer_dir))


def start_prefills(tokenizer: Path, monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[int, list[SimThread]]:
    """The prefill engines, on their addresses, all publishing on one port (another one if it was taken meanwhile)."""
    for _ in range(5):
        port = shared_port(PREFILL_HOSTS)
        started: list[SimThread] = []
        try:
            with monkeypatch.context() as patch:
                patch.setattr(narwhal_sim.server, "KvEventPublisher", BoundPublisher)
                for host in PREFILL_HOSTS:
                    started.append(SimThread(
                        "prefill", speed=0, host=host, tokenizer=str(tokenizer), num_gpu_blocks=GPU_BLOCKS,
                        block_size=BLOCK, kv_events_endpoint=f"tcp://{host}:{port}", **options,
                    ).start())  # fmt: skip
            return port, started
        except SimError:  # (the port went to someone else between the probe and the bind)
            for sim in started:
                sim.stop()
    raise RuntimeError("could not bind the KV-event port on every prefill address")


@pytest.fixture
def kv_fleet(tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KvFleet]:
    port, prefills = start_prefills(tokenizer_dir, monkeypatch)
    try:
        with SimThread("decode", speed=0, host=DECODE_HOST, tokenizer=str(tokenizer_dir)) as decode:
            yield KvFleet(tuple(prefills), decode, port, tokenizer_dir)
    finally:
        for sim in prefills:
            sim.stop()


@pytest.fixture
def kv_router(runtime: str, kv_fleet: KvFleet, tmp_path: Path) -> Iterator[Callable[..., RouterThread]]:
    """``kv_router(**routing)``: Narwhal with policy ``kv`` in front of ``kv_fleet``, stopped after the test."""
    started: list[RouterThread] = []

    def start(**routing: Any) -> RouterThread:
        config = make_config(
            tmp_path / "journal.jsonl",
            prefill=tuple(p.url for p in kv_fleet.prefill), decode=(kv_fleet.decode.url,),
            model={"tokenizer": str(kv_fleet.tokenizer)},
            engine={"kv_events": f"tcp://{{host}}:{kv_fleet.port}",
                    "kv_events_replay": f"tcp://{{host}}:{kv_fleet.port + 1}"},
            routing={"policy": "kv", "kv_block_size": BLOCK, "kv_speculative_ttl_s": 0.0, **routing},
        )  # fmt: skip
        router = RouterThread(config, runtime).start()
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()


# ------------------------------------------------------------------ helpers


def held(router: RouterThread, url: str) -> frozenset[int]:
    """Narwhal's hashes of the blocks its index says ``url`` holds (read on the router's loop)."""
    return router.call(lambda: router.server.serving.router.fleet.policy.index.blocks(url))  # type: ignore[no-any-return]


def hashes_of(tok: EngineTokenizer, text: str) -> list[int]:
    ids = tok.prompt_token_ids({"prompt": text}, chat=False)
    assert len(ids) == PROMPT_TOKENS or len(ids) == BLOCK, len(ids)
    return token_block_hashes(ids, BLOCK)


def straight_to(engine: SimThread, text: str) -> dict[str, Any]:
    """A completion sent to ``engine`` itself, Narwhal bypassed: the engine caches its blocks."""
    answer = httpx.post(engine.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1},
                        timeout=10)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def through(router: RouterThread, text: str) -> dict[str, Any]:
    """A completion through Narwhal; its journal's ``routing`` record."""
    answer = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 2},
                        timeout=10)  # fmt: skip
    assert answer.status_code == 200, answer.text
    record = journal_terminal(router.config.journal.path, answer.headers["x-request-id"])
    assert record["terminal"] == "completed", record
    return record["routing"]  # type: ignore[no-any-return]


def candidate(routing: dict[str, Any], url: str) -> dict[str, Any]:
    (found,) = [c for c in routing["candidates"] if c["engine"] == url]
    return found  # type: ignore[no-any-return]


def indexed(router: RouterThread, engine: SimThread, hashes: list[int], timeout: float = 5.0) -> None:
    """Wait until Narwhal's index holds every one of ``hashes`` on ``engine`` (its events arrived)."""
    poll(lambda: set(hashes) <= held(router, engine.url), timeout=timeout, what=f"{engine.url}'s events indexed")


def streams_up(router: RouterThread, tok: EngineTokenizer, prefills: tuple[SimThread, ...]) -> None:
    """Every prefill engine's stream is connected and delivers: one small prompt each, indexed.

    A batch published before the subscription reached the engine's PUB
    socket is lost to it; the subscriber asks the replay socket for it at
    the next batch. So a prompt is sent again (another one) until Narwhal
    has indexed one.
    """
    poll(lambda: router.statistics().kv_events_live == {p.url: True for p in prefills}, what="every stream live")
    for n, engine in enumerate(prefills):
        sent: list[int] = []

        def seen(engine: SimThread = engine, sent: list[int] = sent, n: int = n) -> bool:
            blocks = held(router, engine.url)
            if sent and any(h in blocks for h in sent):
                return True
            text = prompt(10_000 + 100 * n + len(sent), tokens=BLOCK)
            straight_to(engine, text)
            sent.extend(hashes_of(tok, text))
            return False

        poll(seen, interval=0.1, what=f"{engine.url}'s first batch indexed")


def group_metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus exposition, or ``None``."""
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels else " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def metric(router: RouterThread, name: str, **labels: str) -> float | None:
    return group_metric(httpx.get(router.url + "/metrics", timeout=10).text, name, **labels)


# -------------------------------------------------------------------- tests


def test_a_prefix_goes_where_the_events_say_and_follows_its_eviction(
    kv_router: Callable[..., RouterThread], kv_fleet: KvFleet, tok: EngineTokenizer
) -> None:
    # (Engines' /metrics not read: Narwhal's bound on each engine's entries stays far above the pool's
    # size, so only the engine's BlockRemoved events can make it forget a block.)
    router = kv_router(metrics_interval_s=0)
    first, second = kv_fleet.prefill
    streams_up(router, tok, kv_fleet.prefill)
    a, b = prompt(1), prompt(2)
    a_hashes, b_hashes = hashes_of(tok, a), hashes_of(tok, b)
    straight_to(second, a)
    straight_to(first, b)
    indexed(router, second, a_hashes)
    indexed(router, first, b_hashes)

    # Each prompt goes to the engine that holds it, weighed from its events; the other one holds nothing of it.
    for text, holder, other in ((a, second, first), (b, first, second)):
        hits = holder.stats()["prefix_cache_hits"]
        routing = through(router, text)
        assert routing["prefill"] == holder.url and routing["index"] == "kv", routing
        assert candidate(routing, holder.url) == {
            "engine": holder.url, "index": "kv", "matched_tokens": PROMPT_TOKENS, "uncached_tokens": 0,
            "queued_tokens": 0,
        }
        assert (candidate(routing, other.url)["matched_tokens"], candidate(routing, other.url)["index"]) == (0, "kv")
        assert holder.stats()["prefix_cache_hits"] > hits  # the engine did reuse its cache
    legs = [json.loads(r["body"]) for r in completion_records([second]) if "kv_transfer_params" in r["body"]]
    assert [leg["prompt"] for leg in legs] == [a]  # Narwhal's one prefill leg there

    # The second engine evicts the first prompt: other prompts, sent to it alone, fill its pool past its size.
    fillers = [prompt(100 + n) for n in range(GPU_BLOCKS // 6 + 1)]
    for text in fillers:
        straight_to(second, text)
    indexed(router, second, hashes_of(tok, fillers[-1]))
    poll(lambda: held(router, second.url).isdisjoint(a_hashes), what="the first prompt's removal indexed")
    # And the first engine now holds it too. Narwhal sent it to the second (its approximate index says
    # so, as `prefix` would weigh it): the events say the first engine is where it is.
    straight_to(first, a)
    indexed(router, first, a_hashes)
    routing = through(router, a)
    assert routing["prefill"] == first.url and routing["index"] == "kv", routing
    assert (candidate(routing, second.url)["matched_tokens"], candidate(routing, second.url)["index"]) == (0, "kv")
    assert candidate(routing, first.url)["matched_tokens"] == PROMPT_TOKENS
    assert router.statistics().kv_events_live == {first.url: True, second.url: True}


def test_a_chat_goes_where_its_rendered_prefix_is_held(
    kv_router: Callable[..., RouterThread], kv_fleet: KvFleet, tok: EngineTokenizer
) -> None:
    """Chat messages rendered by the chat template beside the tokenizer, by the engine and by Narwhal alike."""
    router = kv_router()
    first, second = kv_fleet.prefill
    streams_up(router, tok, kv_fleet.prefill)
    history = [{"role": "system", "content": prompt(3)}, {"role": "user", "content": prompt(4, tokens=40)}]
    body = {"model": MODEL, "messages": history, "max_tokens": 1}
    ids = tok.prompt_token_ids(body, chat=True)
    assert len(ids) > 6 * BLOCK
    answer = httpx.post(second.url + "/v1/chat/completions", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(ids)  # the engine's ids are Narwhal's
    indexed(router, second, token_block_hashes(ids, BLOCK))
    # The conversation goes on: the next turn's prompt begins with the one the second engine holds.
    turn = {**body, "messages": [*history, {"role": "assistant", "content": "w1 w2"},
                                 {"role": "user", "content": "w3"}]}  # fmt: skip
    answer = httpx.post(router.url + "/v1/chat/completions", json=turn, timeout=10)
    assert answer.status_code == 200, answer.text
    record = journal_terminal(router.config.journal.path, answer.headers["x-request-id"])
    routing = record["routing"]
    assert routing["prefill"] == second.url and routing["index"] == "kv", routing
    assert candidate(routing, second.url)["matched_tokens"] == len(ids) // BLOCK * BLOCK
    assert candidate(routing, first.url)["matched_tokens"] == 0


def test_an_engine_whose_events_are_lost_falls_back_and_says_so(
    kv_router: Callable[..., RouterThread], kv_fleet: KvFleet, tok: EngineTokenizer
) -> None:
    first, second = kv_fleet.prefill
    with LogCapture() as log:
        router = kv_router(kv_events_stale_s=0.3)
        streams_up(router, tok, kv_fleet.prefill)
        a = prompt(1)
        straight_to(second, a)
        indexed(router, second, hashes_of(tok, a))
        assert metric(router, "narwhal_engine_kv_events_live", engine=first.url) == 1
        assert metric(router, "narwhal_engine_kv_events_live", engine=second.url) == 1
        assert metric(router, "narwhal_engine_kv_events_live", engine=kv_fleet.decode.url) is None  # (prefill only)
        # Only the prefill engines' streams are read: decode legs go by load (docs/operate.md, "KV events").
        assert router.server.serving.kv_subscriber.subscribed == {first.url, second.url}
        subscribed = {e["engine"] for e in log.events() if e["event"] == "kv_events_subscribed"}
        assert subscribed == {first.url, second.url}

        publisher = second.engine.publisher
        assert publisher is not None
        publisher.close()  # the engine's event stream dies; the engine serves on

        def lost() -> list[dict[str, Any]]:
            return [e for e in log.events() if e["event"] == "kv_events_lost" and e["engine"] == second.url]

        (line,) = poll(lost, what="kv_events_lost")
        assert line["level"] == "warning" and line["fallback_after_s"] == 0.3, line

        def stale() -> list[dict[str, Any]]:
            return [e for e in log.events() if e["event"] == "kv_events_stale" and e["engine"] == second.url]

        # kv_events_stale_s later, with no request and no scrape meanwhile, the fallback is logged.
        (line,) = poll(stale, what="kv_events_stale")
        assert (line["level"], line["reason"], line["index"], line["stale_s"]) == \
            ("warning", "lost", "approximate", 0.3)
        poll(lambda: metric(router, "narwhal_engine_kv_events_live", engine=second.url) == 0,
             what="the second engine's gauge at 0")  # fmt: skip
        assert metric(router, "narwhal_engine_kv_events_live", engine=first.url) == 1
        assert router.statistics().kv_events_live == {first.url: True, second.url: False}

        # It is weighed from the approximate index now, which never heard of the prompt it holds.
        routing = through(router, a)
        assert candidate(routing, second.url)["index"] == "approximate", routing
        assert candidate(routing, second.url)["matched_tokens"] == 0
        assert candidate(routing, first.url)["index"] == "kv"
        assert len(stale()) == 1  # (said once)
    assert held(router, second.url) == frozenset()  # what its events said is dropped


def test_two_workers_each_follow_the_streams_and_their_metrics_say_so_as_a_group(
    kv_fleet: KvFleet, tmp_path: Path, runtime: str
) -> None:
    """``narwhal serve --workers 2``: each worker subscribes on its own; the group's gauge is their minimum."""
    first, second = kv_fleet.prefill
    config = tmp_path / "narwhal.toml"
    config.write_text(serve_config(
        tmp_path / "journal.jsonl", prefill=[p.url for p in kv_fleet.prefill], decode=[kv_fleet.decode.url],
        model={"tokenizer": str(kv_fleet.tokenizer)},
        engine={"kv_events": f"tcp://{{host}}:{kv_fleet.port}",
                "kv_events_replay": f"tcp://{{host}}:{kv_fleet.port + 1}"},
        routing={"policy": "kv", "kv_events_stale_s": 0.3},
    ))  # fmt: skip
    process = ServeProcess(config, runtime)
    process.args += ["--workers", "2"]
    try:
        process.start(listening_timeout=30.0)

        def gauges() -> tuple[float | None, ...]:
            text = httpx.get(process.url + "/metrics", timeout=10).text
            return tuple(group_metric(text, "narwhal_engine_kv_events_live", engine=p.url) for p in kv_fleet.prefill)

        poll(lambda: group_metric(httpx.get(process.url + "/metrics", timeout=10).text,
                                  "narwhal_workers_reporting") == 2 and gauges() == (1, 1),
             timeout=20, what="both workers live on both streams")  # fmt: skip
        publisher = second.engine.publisher
        assert publisher is not None
        publisher.close()
        poll(lambda: gauges() == (1, 0), timeout=10, what="the second engine's fallback, the first still live")
        lost = {e.get("worker") for e in process.events()
                if e.get("event") == "kv_events_lost" and e.get("engine") == second.url}  # fmt: skip
        assert lost, "a worker logs the stream lost"
    finally:
        process.stop()


def test_a_group_of_workers_says_live_only_when_every_worker_does() -> None:
    snapshot = (
        "# HELP narwhal_engine_kv_events_live 1 while weighed from its KV events.\n"
        "# TYPE narwhal_engine_kv_events_live gauge\n"
        'narwhal_engine_kv_events_live{{engine="http://p1"}} {p1}\n'
        'narwhal_engine_kv_events_live{{engine="http://p2"}} 1\n'
    )
    text = aggregate([snapshot.format(p1=1), snapshot.format(p1=0), snapshot.format(p1=1)]).decode()
    assert 'narwhal_engine_kv_events_live{engine="http://p1"} 0.0' in text
    assert 'narwhal_engine_kv_events_live{engine="http://p2"} 1.0' in text
