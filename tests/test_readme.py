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
