"""Ingress authentication (docs/security.md): the three modes, the keys file, sanitisation."""

from __future__ import annotations

import hashlib
import hmac
import re

import attrs
import pytest

from narwhal_core.auth import ANONYMOUS, ApiKeys, Authenticator, api_key_digest, parse_api_keys
from narwhal_core.config import IngressConfig
from narwhal_core.errors import AuthError, ConfigError

from ..helpers import REPO, keys_file_text

DOCS = REPO / "docs" / "configure.md"

KEYS = {"alice": "sk-alice-0001", "bob": "sk-bob-0002", "carol": "sk-carol-0003"}


def bearer(key: str, scheme: str = "Bearer") -> list[tuple[bytes, bytes]]:
    return [(b"host", b"narwhal"), (b"authorization", f"{scheme} {key}".encode())]


@pytest.fixture
def api_keys_auth() -> Authenticator:
    ingress = IngressConfig(listen="0.0.0.0:8000", auth="api_keys", api_keys_file="keys.toml")
    return Authenticator.from_config(ingress, parse_api_keys(keys_file_text(KEYS)))


def trusted_auth(*proxies: str, header: str = "x-narwhal-client") -> Authenticator:
    ingress = IngressConfig(
        listen="0.0.0.0:8000", auth="trusted_header", trusted_proxies=list(proxies), client_header=header
    )
    return Authenticator.from_config(ingress, None)


def denied(auth: Authenticator, headers: list[tuple[bytes, bytes]], peer: str = "10.0.0.1") -> AuthError:
    with pytest.raises(AuthError) as info:
        auth.authenticate(headers, peer)
    error = info.value
    assert error.status == 401
    assert error.type == "authentication_error"
    return error


# -- none ---------------------------------------------------------------------------


def test_none_mode_is_anonymous() -> None:
    auth = Authenticator.from_config(IngressConfig(), None)
    assert auth.authenticate([], "127.0.0.1") == ANONYMOUS == "anonymous"
    assert auth.authenticate(bearer("anything"), "127.0.0.1") == "anonymous"


# -- api_keys -----------------------------------------------------------------------


@pytest.mark.parametrize("client", list(KEYS))
def test_api_key_names_its_client(api_keys_auth: Authenticator, client: str) -> None:
    assert api_keys_auth.authenticate(bearer(KEYS[client]), "203.0.113.9") == client


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr"])
def test_bearer_scheme_is_case_insensitive(api_keys_auth: Authenticator, scheme: str) -> None:
    assert api_keys_auth.authenticate(bearer(KEYS["bob"], scheme), "10.0.0.1") == "bob"


def test_surrounding_whitespace_is_ignored(api_keys_auth: Authenticator) -> None:
    headers = [(b"authorization", b"  Bearer   " + KEYS["bob"].encode() + b" \t")]
    assert api_keys_auth.authenticate(headers, "10.0.0.1") == "bob"


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"x-api-key", KEYS["alice"].encode())],
        bearer("sk-wrong"),
        bearer(KEYS["alice"] + "x"),
        bearer(KEYS["alice"], "Basic"),
        bearer(KEYS["alice"], "Token"),
        [(b"authorization", KEYS["alice"].encode())],
        [(b"authorization", b"Bearer")],
        [(b"authorization", b"Bearer ")],
        [(b"authorization", b"Bearer " + KEYS["alice"].encode() + b" extra")],
        [(b"authorization", b"Bearer\t" + KEYS["alice"].encode())],
        # Two Authorization headers are ambiguous, even when one is right.
        bearer(KEYS["alice"]) + bearer("sk-wrong"),
        [(b"authorization", b"Bearer \xff\xfe")],
    ],
)
def test_api_key_denied(api_keys_auth: Authenticator, headers: list[tuple[bytes, bytes]]) -> None:
    error = denied(api_keys_auth, headers)
    assert error.message == "Missing or invalid API key."
    assert error.code == "invalid_api_key"


def test_denial_never_echoes_the_presented_key(api_keys_auth: Authenticator) -> None:
    error = denied(api_keys_auth, bearer("sk-guess-123456"))
    for text in (error.message, repr(error), error.body().decode()):
        assert "sk-guess-123456" not in text


@pytest.mark.parametrize("client", list(KEYS))
def test_every_digest_is_compared_even_after_a_match(
    api_keys_auth: Authenticator, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert api_keys_auth.authenticate(bearer(KEYS[client]), "10.0.0.1") == client
    assert len(calls) == len(KEYS)
    # Each stored digest, compared with the presented key's digest.
    assert api_keys_auth.keys is not None
    assert [a for a, _ in calls] == list(api_keys_auth.keys.digests)
    assert {b for _, b in calls} == {hashlib.sha256(KEYS[client].encode()).digest()}


def test_a_wrong_key_is_compared_with_every_digest(
    api_keys_auth: Authenticator, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bytes] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(a)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    denied(api_keys_auth, bearer("sk-wrong"))
    assert len(calls) == len(KEYS)


def test_with_keys_swaps_the_key_set(api_keys_auth: Authenticator) -> None:
    reloaded = api_keys_auth.with_keys(parse_api_keys(keys_file_text({"dave": "sk-dave"})))
    assert reloaded.authenticate(bearer("sk-dave"), "10.0.0.1") == "dave"
    denied(reloaded, bearer(KEYS["alice"]))
    # The original is unchanged (frozen values).
    assert api_keys_auth.authenticate(bearer(KEYS["alice"]), "10.0.0.1") == "alice"


def test_an_empty_keys_file_lets_nobody_in(api_keys_auth: Authenticator) -> None:
    empty = api_keys_auth.with_keys(parse_api_keys(""))
    denied(empty, bearer(KEYS["alice"]))


def test_api_keys_mode_needs_keys() -> None:
    ingress = IngressConfig(listen="0.0.0.0:8000", auth="api_keys", api_keys_file="keys.toml")
    with pytest.raises(ConfigError) as info:
        Authenticator.from_config(ingress, None)
    assert info.value.key == "ingress.api_keys_file"


# -- the keys file ------------------------------------------------------------------


def test_parse_api_keys_holds_digests_only() -> None:
    keys = parse_api_keys(keys_file_text(KEYS))
    assert keys.clients == ("alice", "bob", "carol")
    assert keys.digests == tuple(hashlib.sha256(k.encode()).digest() for k in KEYS.values())
    assert len(keys) == 3
    assert repr(keys) == "ApiKeys(keys=3, clients=3)"
    for digest in keys.digests:
        assert digest.hex() not in repr(keys)
    assert "keys=" in repr(Authenticator(mode="api_keys", keys=keys))
    assert keys.digests[0].hex() not in repr(Authenticator(mode="api_keys", keys=keys))


def test_one_client_may_have_several_keys() -> None:
    keys = parse_api_keys(keys_file_text({"a": "k1"}) + keys_file_text({"a": "k2"}))
    assert repr(keys) == "ApiKeys(keys=2, clients=1)"


def test_uppercase_hex_is_accepted() -> None:
    text = f'[[keys]]\nclient = "a"\nsha256 = "{api_key_digest("k").upper()}"\n'
    assert parse_api_keys(text).digests == (hashlib.sha256(b"k").digest(),)


def test_api_key_digest_is_sha256_hex_of_utf8() -> None:
    assert api_key_digest("test") == "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    assert api_key_digest("ключ") == hashlib.sha256("ключ".encode()).hexdigest()


GOOD = api_key_digest("k0")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f'[[keys]]\nclient = "a"\nsha256 = "{GOOD}"\nkey = "sk-plain"\n', "keys[0].key: unknown field"),
        (keys_file_text({"a": "k1", "b": "k2"}) + f'[[keys]]\nclient = "c"\nsha256 = "{GOOD}"\napi_key = "x"\n',
         "keys[2].api_key: unknown field"),
        (keys_file_text({"a": "k1", "b": "k2"}) + '[[keys]]\nclient = "c"\nsha256 = "xyz"\n',
         "keys[2].sha256: must be 64 hex digits"),
        (f'[[keys]]\nclient = "a"\nsha256 = "{GOOD[:-1]}"\n', "keys[0].sha256: must be 64 hex digits"),
        (f'[[keys]]\nclient = "a"\nsha256 = "{GOOD[:-1]}g"\n', "keys[0].sha256: must be 64 hex digits"),
        (f'[[keys]]\nclient = "a"\nsha256 = " {GOOD[1:]}"\n', "keys[0].sha256: must be 64 hex digits"),
        ('[[keys]]\nclient = "a"\nsha256 = 5\n', "keys[0].sha256: must be a string"),
        (f'[[keys]]\nsha256 = "{GOOD}"\n', "keys[0].client: missing"),
        ('[[keys]]\nclient = "a"\n', "keys[0].sha256: missing"),
        (f'[[keys]]\nclient = ""\nsha256 = "{GOOD}"\n', "keys[0].client: must not be empty"),
        (f'[[keys]]\nclient = 7\nsha256 = "{GOOD}"\n', "keys[0].client: must be a string"),
        (f'[[keys]]\nclient = "{"c" * 129}"\nsha256 = "{GOOD}"\n', "keys[0].client: must be at most 128"),
        (f'[[keys]]\nclient = "a\\u0007"\nsha256 = "{GOOD}"\n', "keys[0].client: must be printable ASCII"),
        (f'[[keys]]\nclient = "a"\nsha256 = "{GOOD}"\n[[keys]]\nclient = "b"\nsha256 = "{GOOD.upper()}"\n',
         "keys[1].sha256: repeats keys[0].sha256"),
        ('keys = 5\n', "keys: must be an array"),
        ('keys = [5]\n', "keys[0]: must be a [[keys]] table"),
        ('[[key]]\nclient = "a"\n', "key: unknown key"),
        ('[[keys]\n', "not valid TOML"),
    ],
)
def test_keys_file_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_api_keys(text)
    assert info.value.key == "ingress.api_keys_file"
    assert info.value.message.startswith(f"ingress.api_keys_file: {message}")
    assert "\n" not in info.value.line()


def test_keys_file_error_never_repeats_a_plaintext_key() -> None:
    with pytest.raises(ConfigError) as info:
        parse_api_keys(f'[[keys]]\nclient = "a"\nsha256 = "{GOOD}"\nkey = "sk-plaintext-secret"\n')
    assert "sk-plaintext-secret" not in info.value.line()
    with pytest.raises(ConfigError) as info:
        parse_api_keys('[[keys]]\nclient = "a"\nsha256 = "sk-pasted-the-key-here"\n')
    assert "sk-pasted-the-key-here" not in info.value.line()


def test_api_keys_value_checks_its_parts() -> None:
    digest = hashlib.sha256(b"k").digest()
    with pytest.raises(ConfigError):
        ApiKeys(digests=[digest], clients=[])
    with pytest.raises(ConfigError):
        ApiKeys(digests=[digest[:31]], clients=["a"])
    with pytest.raises(ConfigError):
        ApiKeys(digests=[digest, digest], clients=["a", "b"])
    keys = ApiKeys(digests=[digest], clients=["a"])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        keys.clients = ()  # type: ignore[misc]


def test_docs_keys_file_example_parses() -> None:
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(r"### The API keys file\n.*?```toml\n(.*?)```", text, re.S)
    assert match
    assert repr(parse_api_keys(match.group(1))) == "ApiKeys(keys=2, clients=1)"


# -- trusted_header -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("proxies", "peer"),
    [
        (["10.0.0.0/8"], "10.1.2.3"),
        (["192.0.2.7"], "192.0.2.7"),
        (["10.0.0.0/8"], "::ffff:10.1.2.3"),  # IPv4 peer seen by a dual-stack socket
        (["fd00::/8"], "fd12::1"),
        (["fd00::/8"], "[fd12::1]"),
        (["fd00::/8"], "fd12::1%eth0"),
        (["2001:db8::/32", "10.0.0.0/8"], "2001:db8:1::5"),
        (["::1"], "::1"),
    ],
)
def test_trusted_peer_names_the_client(proxies: list[str], peer: str) -> None:
    auth = trusted_auth(*proxies)
    assert auth.authenticate([(b"x-narwhal-client", b"team-a")], peer) == "team-a"


@pytest.mark.parametrize(
    ("proxies", "peer"),
    [
        (["10.0.0.0/8"], "11.0.0.1"),
        (["10.0.0.0/8"], "::ffff:11.0.0.1"),
        (["192.0.2.7"], "192.0.2.8"),
        (["fd00::/8"], "fe80::1"),
        (["fd00::/8"], "10.0.0.1"),
        (["10.0.0.0/8"], "fd00::1"),
        (["10.0.0.0/8"], ""),
        (["10.0.0.0/8"], "proxy.internal"),
        (["10.0.0.0/8"], "10.0.0.1:443"),
    ],
)
def test_untrusted_peer_is_denied(proxies: list[str], peer: str) -> None:
    error = denied(trusted_auth(*proxies), [(b"x-narwhal-client", b"team-a")], peer)
    assert error.message == "Requests must come through the trusted ingress proxy."
    assert error.code == "untrusted_peer"


def test_configured_header_name_is_used_lowercased() -> None:
    auth = trusted_auth("10.0.0.0/8", header="X-Forwarded-User")
    assert auth.client_header == b"x-forwarded-user"
    assert auth.authenticate([(b"x-forwarded-user", b"u1")], "10.0.0.1") == "u1"
    denied(auth, [(b"x-narwhal-client", b"u1")])


def test_header_value_is_trimmed() -> None:
    assert trusted_auth("10.0.0.0/8").authenticate([(b"x-narwhal-client", b"  team-a \t")], "10.0.0.1") == "team-a"


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"x-narwhal-client", b"")],
        [(b"x-narwhal-client", b"   ")],
        [(b"x-narwhal-client", b"c" * 129)],
        [(b"x-narwhal-client", b"team\x00a")],
        [(b"x-narwhal-client", b"team\x1ba")],
        [(b"x-narwhal-client", b"team\x7f")],
        [(b"x-narwhal-client", "tëam".encode())],
        [(b"x-narwhal-client", b"\xff")],
        [(b"x-narwhal-client", b"a"), (b"x-narwhal-client", b"b")],
    ],
)
def test_bad_client_header_is_denied(headers: list[tuple[bytes, bytes]]) -> None:
    error = denied(trusted_auth("10.0.0.0/8"), headers, "10.0.0.1")
    assert error.code == "invalid_client_identity"
    assert error.message == "Missing or invalid client identity."


def test_client_header_limit_is_inclusive() -> None:
    auth = trusted_auth("10.0.0.0/8")
    assert auth.authenticate([(b"x-narwhal-client", b"c" * 128)], "10.0.0.1") == "c" * 128
    assert auth.authenticate([(b"x-narwhal-client", b"team a/b@c")], "10.0.0.1") == "team a/b@c"


def test_trusted_header_ignores_bearer_keys() -> None:
    auth = trusted_auth("10.0.0.0/8")
    denied(auth, bearer("sk-anything"), "10.0.0.1")
