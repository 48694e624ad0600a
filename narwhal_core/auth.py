"""Ingress authentication (docs/security.md): who is asking, as a trusted client ID.

Three modes, chosen by ``ingress.auth``:

* ``none`` — every request is the client ``"anonymous"`` (the config only
  allows this on a loopback listen address);
* ``api_keys`` — ``Authorization: Bearer <key>``; the SHA-256 of the key is
  compared, in constant time, against every digest of the keys file, whose
  matching entry names the client;
* ``trusted_header`` — an authenticating proxy names the client in
  ``ingress.client_header``; only peers inside ``ingress.trusted_proxies``
  may do so.

A refusal is an :class:`~narwhal_core.errors.AuthError` (401, journal
``denied``) whose message never echoes what the client sent. The keys file
holds digests only, and :class:`ApiKeys` never shows them in its repr.
"""

import hashlib
import hmac
import ipaddress
import tomllib
from collections.abc import Sequence
from typing import Final

import attrs

from .config import AuthMode, IngressConfig
from .errors import AuthError, ConfigError

__all__ = [
    "ANONYMOUS",
    "MAX_CLIENT_ID_CHARS",
    "ApiKeys",
    "Authenticator",
    "parse_api_keys",
    "api_key_digest",
]

#: The client ID of every request when ``ingress.auth = "none"``.
ANONYMOUS: Final = "anonymous"
#: Longest client ID accepted, from the keys file or the trusted header.
MAX_CLIENT_ID_CHARS: Final = 128

_KEYS_FILE: Final = "ingress.api_keys_file"
_FIELDS: Final = frozenset({"client", "sha256", "role"})
#: A key entry's ``role``: ``client`` (the default) may send completions, ``admin`` may use ``/admin/*`` only.
ROLES: Final = ("client", "admin")
_HEX: Final = frozenset("0123456789abcdefABCDEF")

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


def _client_id_problem(value: str) -> str | None:
    # A client ID ends up in journal records and as a metrics label.
    if not value:
        return "must not be empty"
    if len(value) > MAX_CLIENT_ID_CHARS:
        return f"must be at most {MAX_CLIENT_ID_CHARS} characters"
    if not all(" " <= ch <= "~" for ch in value):
        return "must be printable ASCII"
    return None


def _digest_tuple(value: list[bytes] | tuple[bytes, ...]) -> tuple[bytes, ...]:
    return tuple(value)


def _client_tuple(value: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    return tuple(value)


def api_key_digest(key: str) -> str:
    """The ``sha256`` value to store for ``key``: hex SHA-256 of its UTF-8 bytes.

    The same as ``printf %s "$KEY" | sha256sum``.
    """
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@attrs.frozen(kw_only=True, repr=False)
class ApiKeys:
    """The digests of the API keys and the client each one names; never the keys."""

    digests: tuple[bytes, ...] = attrs.field(
        converter=_digest_tuple, metadata=_doc("SHA-256 digests (32 bytes each), all distinct.")
    )
    clients: tuple[str, ...] = attrs.field(
        converter=_client_tuple, metadata=_doc("Client ID of each digest, at the same position.")
    )
    admin_digests: tuple[bytes, ...] = attrs.field(
        default=(), converter=_digest_tuple,
        metadata=_doc("SHA-256 digests of the admin keys (role = \"admin\"): /admin/* only, never completions."),
    )
    admins: tuple[str, ...] = attrs.field(
        default=(), converter=_client_tuple, metadata=_doc("The name of each admin key, at the same position.")
    )

    def __attrs_post_init__(self) -> None:
        if len(self.digests) != len(self.clients) or len(self.admin_digests) != len(self.admins):
            raise ConfigError(_KEYS_FILE, "every key needs exactly one client")
        if set(self.digests) & set(self.admin_digests):
            raise ConfigError(_KEYS_FILE, "a key is both a client key and an admin key")
        seen: set[bytes] = set()
        for i, (digest, client) in enumerate(zip(self.digests, self.clients)):
            if not isinstance(digest, bytes) or len(digest) != 32:
                raise ConfigError(_KEYS_FILE, f"keys[{i}].sha256: must be a 32-byte SHA-256 digest")
            if digest in seen:
                raise ConfigError(_KEYS_FILE, f"keys[{i}].sha256: repeats an earlier key")
            seen.add(digest)
            problem = _client_id_problem(client) if isinstance(client, str) else "must be a string"
            if problem is not None:
                raise ConfigError(_KEYS_FILE, f"keys[{i}].client: {problem}")

    def __len__(self) -> int:
        return len(self.digests)

    def __repr__(self) -> str:
        shown = f"ApiKeys(keys={len(self.digests)}, clients={len(set(self.clients))}"
        return shown + (f", admin_keys={len(self.admins)})" if self.admins else ")")


def _field_problem(what: str, value: object) -> str:
    return f"{what}: must be a string, got {type(value).__name__}"


def parse_api_keys(text: str) -> ApiKeys:
    """Parse the TOML keys file; raise ConfigError("ingress.api_keys_file", ...).

    The format: docs/configure.md, "The API keys file".

    Each ``[[keys]]`` table has ``client`` and ``sha256`` (64 hex
    digits), and may have ``role``: ``client`` (the default) or ``admin``
    (a key for ``/admin/*`` only, docs/security.md). Entries are counted from 0 in messages: ``keys[2].sha256``.
    A file with no entries is valid and lets nobody in, so a reload can
    revoke every key. Messages never quote a value from the file.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(_KEYS_FILE, f"not valid TOML: {exc}") from None
    for name in data:
        if name != "keys":
            raise ConfigError(_KEYS_FILE, f"{name}: unknown key (expected only [[keys]] tables)")
    entries = data.get("keys", [])
    if not isinstance(entries, list):
        raise ConfigError(_KEYS_FILE, "keys: must be an array of [[keys]] tables")
    digests: list[bytes] = []
    clients: list[str] = []
    admin_digests: list[bytes] = []
    admins: list[str] = []
    first_seen: dict[bytes, int] = {}
    for i, entry in enumerate(entries):
        where = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(_KEYS_FILE, f"{where}: must be a [[keys]] table")
        for name in entry:
            if name not in _FIELDS:
                # Most likely a plaintext key ("key", "secret", "token"): refuse it
                # without repeating it.
                raise ConfigError(
                    _KEYS_FILE,
                    f"{where}.{name}: unknown field; a key entry holds only client, sha256 and role "
                    "(the SHA-256 of the key, never the key itself)",
                )
        for name in ("client", "sha256"):
            if name not in entry:
                raise ConfigError(_KEYS_FILE, f"{where}.{name}: missing")
        client, hex_digest = entry["client"], entry["sha256"]
        if not isinstance(client, str):
            raise ConfigError(_KEYS_FILE, _field_problem(f"{where}.client", client))
        problem = _client_id_problem(client)
        if problem is not None:
            raise ConfigError(_KEYS_FILE, f"{where}.client: {problem}")
        if not isinstance(hex_digest, str):
            raise ConfigError(_KEYS_FILE, _field_problem(f"{where}.sha256", hex_digest))
        if len(hex_digest) != 64 or not set(hex_digest) <= _HEX:
            raise ConfigError(_KEYS_FILE, f"{where}.sha256: must be 64 hex digits")
        digest = bytes.fromhex(hex_digest)
        if digest in first_seen:
            raise ConfigError(_KEYS_FILE, f"{where}.sha256: repeats keys[{first_seen[digest]}].sha256")
        first_seen[digest] = i
        role = entry.get("role", "client")
        if role not in ROLES:
            raise ConfigError(_KEYS_FILE, f'{where}.role: must be "client" or "admin"')
        if role == "admin":
            admin_digests.append(digest)
            admins.append(client)
        else:
            digests.append(digest)
            clients.append(client)
    return ApiKeys(digests=tuple(digests), clients=tuple(clients), admin_digests=tuple(admin_digests),
                   admins=tuple(admins))


def _peer_address(peer_host: str) -> _Address | None:
    host = peer_host
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host.partition("%")[0]  # an IPv6 zone ("fe80::1%eth0") names no network
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    # A dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _denied() -> AuthError:
    return AuthError("Missing or invalid API key.", code="invalid_api_key")


def _presented(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The SHA-256 of the ``Authorization: Bearer`` key; raises AuthError."""
    values = [value for name, value in headers if name == b"authorization"]
    if len(values) != 1:
        raise _denied()
    scheme, _, token = values[0].strip(b" \t").partition(b" ")
    token = token.strip(b" \t")
    if scheme.lower() != b"bearer" or not token or b" " in token or b"\t" in token:
        raise _denied()
    return hashlib.sha256(token).digest()


def _match(presented: bytes, digests: Sequence[bytes]) -> int:
    """The position of ``presented`` among ``digests``; raises AuthError."""
    # Compare against every digest, never stopping at a match, so the time
    # taken does not depend on which key (if any) matched.
    found = -1
    for index, digest in enumerate(digests):
        if hmac.compare_digest(digest, presented):
            found = index
    if found < 0:
        raise _denied()
    return found


@attrs.frozen(kw_only=True)
class Authenticator:
    """Turns a request's headers and peer address into a trusted client ID (pure)."""

    mode: AuthMode = attrs.field(metadata=_doc("none, api_keys or trusted_header (ingress.auth)."))
    client_header: bytes = attrs.field(
        default=b"x-narwhal-client", metadata=_doc("Lowercase name of the trusted client-ID header.")
    )
    trusted_networks: tuple[_Network, ...] = attrs.field(
        default=(), metadata=_doc("Networks whose peers may set client_header.")
    )
    keys: ApiKeys | None = attrs.field(default=None, metadata=_doc("The key digests, for api_keys mode."))

    def __attrs_post_init__(self) -> None:
        if self.mode == "api_keys" and self.keys is None:
            raise ConfigError(_KEYS_FILE, 'no keys loaded for auth = "api_keys"')

    @classmethod
    def from_config(cls, ingress: IngressConfig, keys: ApiKeys | None) -> "Authenticator":
        """The authenticator ``ingress`` describes; ``keys`` is the parsed keys file (api_keys mode)."""
        return cls(
            mode=ingress.auth,
            client_header=ingress.client_header.encode("ascii"),
            trusted_networks=ingress.trusted_networks,
            keys=keys,
        )

    def with_keys(self, keys: ApiKeys) -> "Authenticator":
        """The same authenticator with a reloaded keys file (SIGHUP)."""
        return attrs.evolve(self, keys=keys)

    def authenticate(self, headers: Sequence[tuple[bytes, bytes]], peer_host: str) -> str:
        """The trusted client ID of a request, or raise AuthError (401).

        ``headers`` are (lowercase name, value) pairs; ``peer_host`` is the
        TCP peer's address as the socket reports it.
        """
        if self.mode == "none":
            return ANONYMOUS
        if self.mode == "api_keys":
            return self._by_api_key(headers)
        return self._by_trusted_header(headers, peer_host)

    def _by_api_key(self, headers: Sequence[tuple[bytes, bytes]]) -> str:
        keys = self.keys
        assert keys is not None  # guaranteed by __attrs_post_init__
        return keys.clients[_match(_presented(headers), keys.digests)]

    @property
    def admin_enabled(self) -> bool:
        """Whether the keys file holds an admin key (else ``/admin/*`` does not exist: docs/security.md)."""
        return self.mode == "api_keys" and self.keys is not None and bool(self.keys.admin_digests)

    def authenticate_admin(self, headers: Sequence[tuple[bytes, bytes]]) -> str:
        """The name of the admin key a request to ``/admin/*`` carries, or raise AuthError (401)."""
        keys = self.keys
        if not self.admin_enabled or keys is None:
            raise _denied()
        return keys.admins[_match(_presented(headers), keys.admin_digests)]

    def _by_trusted_header(self, headers: Sequence[tuple[bytes, bytes]], peer_host: str) -> str:
        address = _peer_address(peer_host)
        if address is None or not any(address in network for network in self.trusted_networks):
            raise AuthError("Requests must come through the trusted ingress proxy.", code="untrusted_peer")
        values = [value for name, value in headers if name == self.client_header]
        # Two values would make the proxy's answer ambiguous: refuse rather than pick.
        if len(values) != 1:
            raise AuthError("Missing or invalid client identity.", code="invalid_client_identity")
        raw = values[0].strip(b" \t")
        try:
            client = raw.decode("ascii")
        except UnicodeDecodeError:
            raise AuthError("Missing or invalid client identity.", code="invalid_client_identity") from None
        if _client_id_problem(client) is not None:
            raise AuthError("Missing or invalid client identity.", code="invalid_client_identity")
        return client
