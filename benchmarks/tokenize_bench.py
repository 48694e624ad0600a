"""What tokenizing a prompt as the engine does costs the router (``narwhal_runtime/tokenizer.py``).

    python benchmarks/tokenize_bench.py [--vocab 32000] [--train-mb 8] [--runs 400] [--cpu 0] [--json]

``routing.policy = "kv"`` tokenizes every prompt before it routes it
(docs/configure.md, "Tokenizer"): on the router's event loop up to
``routing.tokenize_inline_max_bytes``, in a worker thread past it
(``tokenize_stall.py`` measures the loop's stall either way). This measures
how long tokenizing takes per prompt, for a 1 KB and a 48 KB prompt, as a ``/v1/completions``
text prompt and as a ``/v1/chat/completions`` request (messages and tools
rendered by a chat template, then encoded), through
``EngineTokenizer.prompt_token_ids`` as the router calls it; the chat row is
also split into rendering and encoding.

Two tokenizers, both built here (there is no network to the Hugging Face hub):

* ``bpe``: a byte-level BPE with a ~32k vocabulary (Llama 3 has 128k, Qwen 2.5
  151k; GPT-2 50k), trained with the ``tokenizers`` library on the sources of
  Python's standard library (English comments and docstrings, and code), with
  a BOS its post-processor adds and a chat template in the style of Llama 3's
  (header tokens, tools as JSON) written for this benchmark;
* ``word``: the small word-level one the tests build (a few sentences: most
  words are unknown).

The prompts are this repository's docs (held out of the BPE's training text),
cut to 1 KB and 48 KB. Timings are wall-clock per call on one thread
(``time.perf_counter_ns``), after a warm-up; the machine's other work shows as
noise in the high percentiles, and the minimum is the closest to a quiet
machine's figure. The verdict line says whether a 48 KB prompt
keeps the event loop past 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from narwhal_runtime.tokenizer import EngineTokenizer, load_tokenizer  # noqa: E402

#: A Llama-3-like template written for this benchmark: a system block with the tools as JSON, one
#: header-delimited block per message, the assistant header last.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou may call these tools:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city today.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},  # fmt: skip
    {"type": "function", "function": {"name": "search_docs", "description": "Search the operator's manual.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]  # fmt: skip
WORDS = ["the narwhal lives in the arctic sea", "a tusk is a long tooth of the narwhal",
         "user assistant system tool call weather city", "what is the weather in the city today"]  # fmt: skip


def training_text(megabytes: float) -> Iterator[str]:
    """The standard library's sources, file by file, up to ``megabytes``."""
    budget = int(megabytes * 1_000_000)
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or budget <= 0:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        budget -= len(text)
        yield text


def build_bpe(folder: Path, vocab: int, megabytes: float) -> float:
    """Train and save the byte-level BPE with its config and template; the seconds training took."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    started = time.perf_counter()
    tok.train_from_iterator(training_text(megabytes), trainer)
    took = time.perf_counter() - started
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return took


def build_word(folder: Path) -> None:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(WORDS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def held_out_text(size: int) -> str:
    """This repository's docs, repeated if need be, cut to ``size`` characters (ASCII-heavy: about bytes)."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    while len(text) < size:
        text += "\n\n" + text
    return text[:size]


def chat_body(size: int) -> dict[str, Any]:
    """Messages (a system prompt, then user and assistant turns) of ``size`` characters in all, and two tools."""
    text = held_out_text(size)
    turn = max(size // 9, 1)
    pieces = [text[i : i + turn] for i in range(0, len(text), turn)]
    messages = [{"role": "system", "content": pieces[0]}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": p} for i, p in enumerate(pieces[1:])]
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "And then?"})
    return {"model": "m", "messages": messages, "tools": TOOLS}


def summary(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    n = len(samples)
    return {"min_us": samples[0], "median_us": statistics.median(samples), "p90_us": samples[int(0.9 * (n - 1))],
            "p99_us": samples[int(0.99 * (n - 1))], "max_us": samples[-1]}  # fmt: skip


def timed(cases: list[tuple[str, Callable[[], object]]], runs: int, rounds: int = 10) -> dict[str, dict[str, float]]:
    """Microseconds per call of each case, the cases taking turns in ``rounds`` rounds after a warm-up.

    Taking turns spreads the machine's other work over every case instead of
    letting it land on whichever ran first.
    """
    samples: dict[str, list[float]] = {name: [] for name, _ in cases}
    clock = time.perf_counter_ns
    for _, call in cases:
        for _ in range(3):
            call()
    per_round = max(runs // rounds, 1)
    for _ in range(rounds):
        for name, call in cases:
            for _ in range(per_round):
                started = clock()
                call()
                samples[name].append((clock() - started) / 1000)
    return {name: summary(values) for name, values in samples.items()}


def measure(name: str, tok: EngineTokenizer, runs: int) -> list[dict[str, Any]]:
    rows = []
    raw = tok._tok  # the tokenizers.Tokenizer inside (private: a benchmark's look behind the API)
    for label, size in (("1 KB", 1024), ("48 KB", 48 * 1024)):
        completion = {"model": "m", "prompt": held_out_text(size)}
        chat = chat_body(size)
        rendered = tok.render_chat(chat)
        text = completion["prompt"]
        assert raw.encode_batch([text])[0].ids == raw.encode(text).ids  # the same ids, either call
        cases: list[tuple[str, Callable[[], object]]] = [
            ("completion", lambda: tok.prompt_token_ids(completion, False)),
            ("chat", lambda: tok.prompt_token_ids(chat, True)),
            ("  chat: render", lambda: tok.render_chat(chat)),
            ("  chat: encode", lambda: tok.encode(rendered, add_special_tokens=False)),
            ("  completion: encode_batch([text])", lambda: raw.encode_batch([text])),
        ]
        tokens = {"completion": len(tok.prompt_token_ids(completion, False)),
                  "chat": len(tok.prompt_token_ids(chat, True))}  # fmt: skip
        count = runs if size <= 1024 else max(runs // 4, 20)
        for kind, figures in timed(cases, count).items():
            rows.append({"tokenizer": name, "prompt": label, "request": kind, "tokens": tokens.get(kind, ""),
                         "bytes": len(text.encode()) if kind == "completion" else "", **figures})  # fmt: skip
    return rows


def longest_stall(tok: EngineTokenizer, text: str, batch: bool, seconds: float = 1.0) -> float:
    """The longest pause, in ms, of a loop on the main thread while another thread tokenizes ``text`` again and again.

    ``Tokenizer.encode`` keeps the GIL for the whole call, so the main thread
    (the event loop, were it the router) stops for as long; ``encode_batch``
    lets it go. (A few ms remain on a busy 2-core machine: the OS's scheduling.)
    """
    raw = tok._tok
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            raw.encode_batch([text]) if batch else raw.encode(text)

    worker = threading.Thread(target=work)
    worker.start()
    time.sleep(0.05)
    longest, last = 0.0, time.perf_counter()
    end = last + seconds
    while (now := time.perf_counter()) < end:
        longest, last = max(longest, now - last), now
    stop.set()
    worker.join()
    return longest * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000, help="the BPE's vocabulary size")
    parser.add_argument("--train-mb", type=float, default=8.0, help="megabytes of training text")
    parser.add_argument("--runs", type=int, default=400, help="calls per 1 KB case (a quarter for 48 KB)")
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    with tempfile.TemporaryDirectory() as tmp:
        took = build_bpe(Path(tmp) / "bpe", args.vocab, args.train_mb)
        build_word(Path(tmp) / "word")
        bpe = load_tokenizer(str(Path(tmp) / "bpe"))
        word = load_tokenizer(str(Path(tmp) / "word"))
        vocab = Tokenizer.from_file(str(Path(tmp) / "bpe" / "tokenizer.json")).get_vocab_size()
        rows = measure("bpe", bpe, args.runs) + measure("word", word, args.runs)
        big = held_out_text(48 * 1024)
        stalls = {"encode": longest_stall(bpe, big, batch=False), "encode_batch": longest_stall(bpe, big, batch=True)}
    if args.json:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps({"longest_stall_ms": stalls}))
        return 0
    print(f"byte-level BPE: vocabulary {vocab}, trained on {args.train_mb:g} MB of the standard library in "
          f"{took:.1f} s; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")  # fmt: skip
    print("| tokenizer | prompt | request | tokens | min µs | median µs | p90 µs | p99 µs | max µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['prompt']} | {r['request'].strip()} | {r['tokens']} | {r['min_us']:,.0f} | "
              f"{r['median_us']:,.0f} | {r['p90_us']:,.0f} | {r['p99_us']:,.0f} | {r['max_us']:,.0f} |")
    worst = max(r["median_us"] for r in rows if r["prompt"] == "48 KB" and not r["request"].startswith(" "))
    verdict = "blocks" if worst > 1000 else "does not block"
    print(f"\nA 48 KB prompt {verdict} the event loop past 1 ms: {worst:,.0f} µs at the median, the slowest case.")
    print(f"Longest pause of the main thread while another thread tokenizes 48 KB (bpe): "
          f"encode {stalls['encode']:.1f} ms, encode_batch {stalls['encode_batch']:.1f} ms.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
