"""The tokenizer thread (narwhal_runtime/tokenize_worker.py): answers in order, problems as answers, a clean stop."""

from __future__ import annotations

import queue
import threading
from typing import Any

from narwhal_core import PromptTokenized, TokenizePrompt
from narwhal_runtime.tokenize_worker import TokenizeWorker


class Words:
    """One id per word; raises on a prompt that is not a string."""

    def prompt_token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ValueError("not text")
        return [len(w) for w in prompt.split()]


def asked(key: str, prompt: Any) -> TokenizePrompt:
    return TokenizePrompt(key, {"prompt": prompt}, False)


def test_answers_come_back_in_order_from_the_thread_and_a_problem_is_an_answer() -> None:
    answers: queue.SimpleQueue[tuple[PromptTokenized, str]] = queue.SimpleQueue()
    worker = TokenizeWorker(Words())
    worker.start(lambda answer: answers.put((answer, threading.current_thread().name)))
    try:
        worker.submit(asked("r1:0", "a bb ccc"))
        worker.submit(asked("r2:0", [1, 2]))
        worker.submit(asked("r1:1", "dddd"))
        got = [answers.get(timeout=5) for _ in range(3)]
    finally:
        assert worker.close()
    assert [a for a, _ in got] == [
        PromptTokenized("r1:0", (1, 2, 3), None),
        PromptTokenized("r2:0", None, "ValueError: not text"),
        PromptTokenized("r1:1", (4,), None),
    ]
    assert {thread for _, thread in got} == {"narwhal-tokenizer"}
    assert not worker.alive and worker.done == 3


def test_close_finishes_the_prompt_in_hand_and_drops_the_queued_ones() -> None:
    entered, gate = threading.Event(), threading.Event()
    delivered: list[PromptTokenized] = []

    class Slow(Words):
        def prompt_token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
            entered.set()
            gate.wait(5)
            return super().prompt_token_ids(body, chat)

    worker = TokenizeWorker(Slow())
    worker.start(delivered.append)
    worker.submit(asked("a:0", "one"))
    worker.submit(asked("b:0", "two"))
    assert entered.wait(5)
    closer = threading.Thread(target=lambda: worker.close(5))
    closer.start()
    gate.set()
    closer.join(5)
    assert not worker.alive
    assert [a.key for a in delivered] == ["a:0"]


def test_a_loop_that_has_ended_stops_the_thread() -> None:
    def gone(answer: PromptTokenized) -> None:
        raise RuntimeError("Event loop is closed")

    worker = TokenizeWorker(Words())
    worker.start(gone)
    worker.submit(asked("a:0", "one"))
    worker._thread.join(5)  # type: ignore[union-attr]
    assert not worker.alive and worker.close()
