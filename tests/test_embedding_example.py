"""The embedding example: narwhal_core driven by a plain-threads server, no adapter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from narwhal_core import Config
from narwhal_core.config import EngineConfig, IngressConfig, JournalConfig, ModelConfig
from narwhal_sim.testing import SimThread

from .helpers import MODEL, terminals_by_rid, wait_for_terminals

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "threaded_server.py"
sys.path.insert(0, str(EXAMPLE.parent))
import threaded_server  # noqa: E402


def test_example_imports_no_adapter() -> None:
    tree = ast.parse(EXAMPLE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert {"narwhal_trio", "narwhal_asyncio", "trio", "asyncio"}.isdisjoint(imported), imported
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(EXAMPLE.parent)!r}); import threaded_server;"
         " print(sorted(m for m in sys.modules if m.split('.')[0] in"
         " ('narwhal_trio', 'narwhal_asyncio', 'trio', 'asyncio')))"],
        capture_output=True, text=True, check=True,
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_example_serves_completions_against_the_simulator(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode:
        config = Config(
            model=ModelConfig(name=MODEL),
            ingress=IngressConfig(listen="127.0.0.1:0"),
            engine=EngineConfig(prefill=[prefill.url], decode=[decode.url]),
            journal=JournalConfig(path=str(journal)),
        )
        server = threaded_server.serve(config)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            host, port = server.server_address[:2]
            url = f"http://{host}:{port}"
            with httpx.Client(base_url=url, timeout=10) as client:
                plain = client.post("/v1/completions", json={"prompt": "The narwhal", "max_tokens": 5})
                assert plain.status_code == 200, plain.text
                assert plain.json()["object"] == "text_completion"
                chat = client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                })
                assert chat.status_code == 200
                assert chat.text.rstrip().endswith("data: [DONE]")
                bad = client.post("/v1/completions", json={"prompt": "x", "n": 2})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
            records = wait_for_terminals(journal, 3)
            terminals = terminals_by_rid(records)
            assert terminals[plain.headers["x-request-id"]]["terminal"] == "completed"
            assert terminals[chat.headers["x-request-id"]]["terminal"] == "completed"
            assert terminals[bad.headers["x-request-id"]]["terminal"] == "invalid"
            legs = terminals[plain.headers["x-request-id"]]["legs"]
            assert [leg["phase"] for leg in legs] == ["prefill", "decode"]
            assert legs[0]["kv"]["outcome"] == "pulled"
            assert prefill.stats()["kv_pulled"] == 2
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)
    assert json.loads(journal.read_text().splitlines()[0])["rid"]
