"""A large prompt is tokenized off the event loop, on both runtimes (docs/routing.md, "Tokenizing off the event loop").

Real sockets: simulated engines with ``--tokenizer`` and a KV-event
endpoint, Narwhal with ``routing.policy = "kv"`` and the same tokenizer.
A large prompt whose head no engine holds is routed without being
tokenized whole (docs/routing.md, "Tokenizing only what can hit"); once the
engine's events say it holds it, the same prompt goes to the worker
thread, whose tokenizer is wrapped in a gate the test holds shut: while
the 48 KB prompt is inside it, the router's loop must go on serving
(``/health``, a small completion tokenized inline), and the large request
must start no leg; once the gate opens it is answered, routed by the ids the
thread computed (the engine's own count of the prompt's tokens).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from narwhal_sim.testing import SimThread

from ..harness import RouterThread, make_config
from ..helpers import MODEL, journal_terminal
from ..runtime.test_tokenizer import CORPUS, save_tokenizer

#: About 48 KB of words the test tokenizer knows.
BIG = " ".join(CORPUS * 400)[: 48 * 1024]
SMALL = "the narwhal lives in the arctic sea"


class GatedTokenizer:
    """The runtime's tokenizer, held at a gate until the test opens it (the worker thread waits there)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.calls = 0
        self.threads: set[str] = set()

    def prompt_token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        self.entered.set()
        if not self.gate.wait(15):
            raise TimeoutError("the test never opened the gate")
        return list(self.inner.prompt_token_ids(body, chat))


def test_a_large_prompt_is_tokenized_while_the_loop_serves(
    tmp_path: Path, runtime: str, sims: Callable[..., SimThread]
) -> None:
    tokenizer = str(save_tokenizer(tmp_path / "tok"))
    prefill = sims("prefill", tokenizer=tokenizer, kv_events_endpoint="tcp://127.0.0.1:0")
    decode = sims("decode", tokenizer=tokenizer)
    assert prefill.engine.publisher is not None
    port = prefill.engine.publisher.endpoint.rpartition(":")[2]
    journal = tmp_path / "journal.jsonl"
    config = make_config(journal, prefill=(prefill.url,), decode=(decode.url,), model={"tokenizer": tokenizer},
                         engine={"kv_events": f"tcp://{{host}}:{port}"}, routing={"policy": "kv"})
    with RouterThread(config, runtime) as router, httpx.Client(timeout=20) as http, \
            ThreadPoolExecutor(1) as pool:  # fmt: skip
        worker = router.server.serving.tokenize_worker
        assert worker is not None and worker.alive
        policy = router.server.serving.router.fleet.policy
        url = router.url + "/v1/completions"
        # No engine holds it yet: routed at once from its head, never tokenized whole. Sent again until the
        # engine's events (the first may be published before the subscription reaches it) say it is held.
        deadline = time.monotonic() + 15
        while not router.call(lambda: bool(policy.index.blocks(prefill.url))):
            assert time.monotonic() < deadline, "the engine's KV events never reached the index"
            first = http.post(url, json={"model": MODEL, "prompt": BIG, "max_tokens": 2})
            assert first.status_code == 200, first.text
            assert worker.done == 0
        gated = GatedTokenizer(worker.tokenizer)
        router.call(lambda: setattr(worker, "tokenizer", gated))
        big = pool.submit(http.post, url, json={"model": MODEL, "prompt": BIG, "max_tokens": 2})
        assert gated.entered.wait(10), "the large prompt never reached the tokenizer thread"
        # The loop goes on while the thread tokenizes: the large request waits, with no leg.
        assert http.get(router.url + "/health").status_code == 200
        stats = router.statistics()
        assert (stats.requests, stats.legs) == (1, 0)
        small = http.post(url, json={"model": MODEL, "prompt": SMALL, "max_tokens": 2})
        assert small.status_code == 200 and gated.calls == 1  # tokenized inline, not by the thread
        assert not big.done()
        gated.gate.set()
        answer = big.result(20)
        assert answer.status_code == 200, answer.text
        assert gated.threads == {"narwhal-tokenizer"}
        record = journal_terminal(journal, answer.headers["x-request-id"])
        assert record["terminal"] == "completed"
        # Routed by the thread's ids: the prompt's tokens are the engine's own count of them.
        engine_count = http.post(prefill.url + "/tokenize", json={"prompt": BIG}).json()["count"]
        (candidate,) = record["routing"]["candidates"]
        assert record["routing"]["policy"] == "kv"
        assert candidate["uncached_tokens"] + candidate["matched_tokens"] == engine_count
    assert not worker.alive  # stopped with the server
