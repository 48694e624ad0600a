"""Discovery's lookups and what they feed the router (narwhal_runtime/discovery.py; docs/configure.md, ``[discovery]``).

(Against a real DNS server and a real file, with a router serving:
tests/e2e/test_discovery.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal_core import EnginesChanged
from narwhal_core.config import config_from_dict, parse_engine_url
from narwhal_runtime.discovery import Discovery, DiscoveryFailed, dns_lookup, file_lookup, parse_engine_file

from ..harness import LogCapture

A = parse_engine_url("http://10.0.0.1:8000", key="t")
B = parse_engine_url("http://10.0.0.2:8000", key="t")


def test_a_failed_lookup_keeps_the_set_and_is_logged_once() -> None:
    d = Discovery("dns", lambda: None, 1.0)
    with LogCapture() as log:
        assert d.take({"decode": (A, B)}) == [EnginesChanged("decode", (A, B), "dns")]
        assert d.take({"decode": (A, B)}) == []  # unchanged: nothing fed
        assert d.take(DiscoveryFailed("timeout")) == []
        assert d.take(DiscoveryFailed("timeout")) == []
        assert d.take({"decode": (A, B)}) == []  # recovered, and the set never changed
        assert d.take({"decode": (B,), "prefill": ()}) == [
            EnginesChanged("prefill", (), "dns"), EnginesChanged("decode", (B,), "dns"),
        ]
    events = [e["event"] for e in log.events()]
    assert events == ["discovery_failed", "discovery_recovered"]
    assert log.events()[0]["error"] == "timeout"


@pytest.mark.parametrize(("text", "json_file", "problem"), [
    ('decode = ["http://10.0.0.1:8000"]\nprefill = []\n', False, None),
    ('{"decode": ["http://10.0.0.1:8000"]}', True, None),
    ('decode = "http://10.0.0.1:8000"', False, "decode must be a list"),
    ('{"decode": ["https://10.0.0.1:8000"]}', True, "https:// is not supported"),
    ('{"decoder": []}', True, "unknown key 'decoder'"),
    ("[1]", True, "must hold an object"),
    ("decode = [", False, "not valid TOML"),
])
def test_the_file_lists_urls_per_phase(text: str, json_file: bool, problem: str | None) -> None:
    if problem is None:
        assert parse_engine_file(text, json_file=json_file)["decode"] == (A,)
    else:
        with pytest.raises(DiscoveryFailed, match=problem):
            parse_engine_file(text, json_file=json_file)


def test_the_file_is_read_again_only_when_it_changed(tmp_path: Path) -> None:
    path = tmp_path / "engines.toml"
    path.write_text('decode = ["http://10.0.0.1:8000"]\n')
    config = config_from_dict({"model": {"name": "m"}, "engine": {"discovery": "file", "decode": []},
                               "discovery": {"file": str(path)}}, env={})
    lookup = file_lookup(config)
    assert lookup() == {"prefill": (), "decode": (A,)}
    assert lookup() is None
    path.write_text('decode = ["http://10.0.0.2:8000", "http://10.0.0.1:8000"]\n')
    assert lookup() == {"prefill": (), "decode": (A, B)}
    path.write_text("decode = [")  # a bad file fails at every look until it is fixed
    for _ in range(2):
        with pytest.raises(DiscoveryFailed, match="not valid TOML"):
            lookup()
    path.unlink()
    with pytest.raises(DiscoveryFailed, match="engines.toml"):
        lookup()


def test_the_system_resolver_finds_localhost() -> None:
    config = config_from_dict({"model": {"name": "m"}, "engine": {"discovery": "dns", "decode": []},
                               "discovery": {"decode": "localhost", "port": 8100}}, env={})
    found = dns_lookup(config)()
    assert "prefill" not in found
    assert "http://127.0.0.1:8100" in [a.url for a in found["decode"]]
