"""The README's two set-up lines: CI runs exactly the test one; the demo one answers its curl.

CI itself runs the test line on a fresh machine (``.ci/run``); here the demo
runs as the README says (``narwhal demo``, in a subprocess) and the
ready-to-paste ``curl`` line it prints is replayed as written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .helpers import REPO



def _setup_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_readme_has_exactly_two_setup_lines_and_ci_runs_the_test_one() -> None:
    lines = _setup_lines()
    assert len(lines) == 2, lines
    demo, tests = lines
    assert demo.startswith("python3.11 -m venv .venv") and demo.endswith("narwhal demo"), demo
    assert tests.startswith("python3.11 -m venv .venv") and tests.endswith("pytest"), tests
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert tests in ci, (tests, ci)
    # Nothing but the README's line runs tests in CI.
    assert [line for line in ci if "pytest" in line] == [tests]


def test_demo_answers_the_curl_it_prints(tmp_path: Path) -> None:
    narwhal = shutil.which("narwhal", path=os.path.dirname(sys.executable)) or shutil.which("narwhal")
    command = [narwhal] if narwhal else [sys.executable, "-m", "narwhal.cli"]
    demo = subprocess.Popen(
        [*command, "demo", "--port", "0", "--journal", str(tmp_path / "journal.jsonl")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        curl = None
        assert demo.stdout is not None
        while curl is None and time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            if line.startswith("curl "):
                curl = line.strip()
        assert curl, "the demo printed no curl line"
        words = shlex.split(curl)
        url = next(w for w in words if w.startswith("http://"))
        body = words[words.index("-d") + 1]
        headers = dict(
            h.split(": ", 1) for h in (words[i + 1] for i, w in enumerate(words) if w == "-H")
        )
        answer = httpx.post(url, content=body.encode(), headers=headers, timeout=10)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        assert data["object"] == "text_completion" and data["choices"][0]["text"]
        assert re.fullmatch(r"[A-Za-z0-9-]+", answer.headers["x-request-id"])
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=20) == 0
        records = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
        assert any(r["rid"] == answer.headers["x-request-id"] and r["terminal"] == "completed" for r in records)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(5)


def test_the_demo_shows_prefix_routing_and_where_to_read_it(tmp_path: Path) -> None:
    """Its second curl, sent twice, is routed by ``prefix`` (the default) and the second prefill hits the cache;
    the ``narwhal journal`` line it prints shows that request's routing record."""
    narwhal = shutil.which("narwhal", path=os.path.dirname(sys.executable)) or shutil.which("narwhal")
    command = [narwhal] if narwhal else [sys.executable, "-m", "narwhal.cli"]
    journal = tmp_path / "journal.jsonl"
    demo = subprocess.Popen([*command, "demo", "--port", "0", "--speed", "0", "--journal", str(journal)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 30
        assert demo.stdout is not None
        while not any(line.startswith("narwhal journal ") for line in lines) and time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
        curls = [shlex.split(line) for line in lines if line.startswith("curl ")]
        assert len(curls) == 2, lines
        long_curl = curls[1]
        prefill = re.search(r"prefill engine (http://\S+),", "\n".join(lines))
        assert prefill, lines
        url = next(w for w in long_curl if w.startswith("http://"))
        body = Path(long_curl[long_curl.index("-d") + 1].removeprefix("@")).read_bytes()
        assert len(body) > 4096, len(body)  # more than two blocks of the prefix index
        answers = [httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=10)
                   for _ in range(2)]  # fmt: skip
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        # The engine's own counters: the second prefill found the first one's blocks.
        stats = httpx.get(prefill.group(1) + "/sim/stats", timeout=5).json()
        assert stats["completions"] == 2 and stats["prefix_cache_hits"] > 0, stats
        rid = answers[1].headers["x-request-id"]
        shown = [w.replace("ID", rid) if w == "ID" else w for w in shlex.split(lines[-1])]
        assert shown[:2] == ["narwhal", "journal"] and Path(shown[2]) == journal, shown
        printed = subprocess.run([*command, *shown[1:]], capture_output=True, text=True, timeout=20, cwd=tmp_path)
        assert printed.returncode == 0, printed
        (record,) = [json.loads(x) for x in printed.stdout.splitlines() if '"terminal":"completed"' in x.replace(" ", "")]
        routing = record["routing"]
        assert (record["rid"], routing["policy"], routing["mode"]) == (rid, "prefix", "pd"), routing
        (candidate,) = routing["candidates"]
        assert candidate["uncached_tokens"] < len(body) // 4 // 2, routing  # most of the prompt was held there
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=20) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(5)
