"""vLLM version families the simulator models (``narwhal sim --vllm-version``).

Pure values: what a vLLM server of one era does on the PD path — request-ID
mangling, the NIXL connector's ``kv_transfer_params``, how long a prefill
engine holds unpulled KV, what a dropped decode request frees, the error body
shape, which abort route exists. Each behaviour and the vLLM source it comes
from is listed in docs/simulator.md ("vLLM versions"). Release boundaries are
reconstructed from pull-request dates; where no release could be pinned the
docs say so.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["VllmFamily", "FAMILIES", "DEFAULT_FAMILY", "family_for", "resolve_version", "kv_event_maps"]


@attrs.frozen(kw_only=True)
class VllmFamily:
    """One era of vLLM's OpenAI server and NIXL connector."""

    #: The family's name, as ``--vllm-version`` takes it.
    name: str
    #: The vLLM releases it stands for (docs/simulator.md).
    releases: str
    #: What ``GET /version`` reports when only the family was named.
    version: str
    #: ``{"error": {...}}`` (from 0.10.1) rather than the flat ``{"object": "error", ...}``.
    nested_errors: bool
    #: Engine request IDs get ``-<8 hex>`` appended (``InputProcessor.assign_request_id``).
    request_id_suffix: bool
    #: 1: the decode engine names the blocks to free by its own request ID; 2: by ``remote_request_id``.
    connector: int
    #: ``remote_block_ids`` is one list per KV-cache group (``[[...]]``).
    block_groups: bool
    #: The lease-era keys: ``dcp_size``, ``pp_size``, ``remote_num_tokens``,
    #: ``remote_blocks_expiry_time``, ``transfer_mode``.
    lease_keys: bool
    #: Seconds unpulled KV stays held (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` or ``kv_lease_duration``).
    hold_s: float
    #: The decode engine renews the lease while the decode request waits in its queue.
    lease_renewal: bool
    #: A prefill whose one token ended the sequence (FINISHED_STOPPED) answers
    #: ``kv_transfer_params: null`` and frees its blocks.
    null_params_on_stop: bool
    #: A decode request refused or cancelled before it reached the engine still
    #: tells the prefill engine to free the blocks.
    notify_on_rejection: bool
    #: ``POST /abort_requests`` exists with ``--tokens-only`` (and in dev mode).
    abort_requests_route: bool
    #: With ``bidirectional_kv_xfer`` a decode engine answers its own ``kv_transfer_params``
    #: (``do_remote_decode: true``, its blocks, ``remote_blocks_expiry_time`` a number) and holds
    #: those blocks for ``decoder_kv_blocks_ttl`` (``NixlPullConnectorScheduler.request_finished``).
    bidirectional_expiry: bool = False
    #: KV events are maps of their fields by name, tag under ``"type"`` (vLLM PR #42892 dropped
    #: ``array_like`` from ``KVCacheEvent``; first released in 0.24.0): see :func:`kv_event_maps`.
    kv_event_maps: bool = True
    #: The lease reaper walks the held entries in insertion order and stops at the
    #: first unexpired one, so entries behind a renewed one are not freed (vLLM issue 58222).
    reaper_stops_at_first_live: bool = False


FAMILIES: dict[str, VllmFamily] = {
    f.name: f
    for f in (
        VllmFamily(
            name="0.9", releases="0.9.1 - 0.10.0", version="0.9.2", nested_errors=False,
            request_id_suffix=False, connector=1, block_groups=False, lease_keys=False, hold_s=120.0,
            lease_renewal=False, null_params_on_stop=True, notify_on_rejection=False, abort_requests_route=False,
            kv_event_maps=False,
        ),
        VllmFamily(
            name="0.10", releases="0.10.1 - 0.11.0", version="0.10.2", nested_errors=True,
            request_id_suffix=False, connector=1, block_groups=False, lease_keys=False, hold_s=120.0,
            lease_renewal=False, null_params_on_stop=True, notify_on_rejection=False, abort_requests_route=False,
            kv_event_maps=False,
        ),
        VllmFamily(
            name="0.11", releases="0.11.1 - 0.13.x", version="0.11.2", nested_errors=True,
            request_id_suffix=False, connector=1, block_groups=False, lease_keys=False, hold_s=480.0,
            lease_renewal=False, null_params_on_stop=True, notify_on_rejection=False, abort_requests_route=False,
            kv_event_maps=False,
        ),
        VllmFamily(
            name="0.14", releases="0.14 - 0.16.x", version="0.14.1", nested_errors=True,
            request_id_suffix=True, connector=2, block_groups=False, lease_keys=False, hold_s=480.0,
            lease_renewal=False, null_params_on_stop=True, notify_on_rejection=False, abort_requests_route=True,
            kv_event_maps=False,
        ),
        VllmFamily(
            name="0.18", releases="0.17 - 0.20.x", version="0.18.1", nested_errors=True,
            request_id_suffix=True, connector=2, block_groups=True, lease_keys=False, hold_s=480.0,
            lease_renewal=False, null_params_on_stop=True, notify_on_rejection=False, abort_requests_route=True,
            kv_event_maps=False,
        ),
        VllmFamily(
            name="lease", releases="0.21 - 0.27.x", version="0.27.1", nested_errors=True,
            request_id_suffix=True, connector=2, block_groups=True, lease_keys=True, hold_s=30.0,
            lease_renewal=True, null_params_on_stop=False, notify_on_rejection=True, abort_requests_route=True,
            reaper_stops_at_first_live=True,
        ),
        VllmFamily(
            name="0.28", releases="0.28 and later", version="0.33.0", nested_errors=True,
            request_id_suffix=True, connector=2, block_groups=True, lease_keys=True, hold_s=30.0,
            lease_renewal=True, null_params_on_stop=False, notify_on_rejection=True, abort_requests_route=True,
            bidirectional_expiry=True,
        ),
    )
}
DEFAULT_FAMILY = "0.28"

#: (first release of the next family, family): a version below the bound belongs to the family.
_BOUNDS = (
    ((0, 10, 1), "0.9"), ((0, 11, 1), "0.10"), ((0, 14, 0), "0.11"), ((0, 17, 0), "0.14"), ((0, 21, 0), "0.18"),
    ((0, 28, 0), "lease"),
)  # fmt: skip
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+\-_a-zA-Z0-9]*)?")


def family_for(version: str) -> VllmFamily:
    """The family of a family name (``0.14``, ``lease``, ``0.28``) or a release (``0.14.1``, ``v0.18.0rc1``).

    ``ValueError`` naming the accepted forms when it is neither.
    """
    family = FAMILIES.get(version)
    if family is not None:
        return family
    match = _VERSION.fullmatch(version.strip())
    if match is None:
        names = ", ".join(FAMILIES)
        raise ValueError(f"--vllm-version must be a family ({names}) or a vLLM release like 0.14.1, got {version!r}")
    release = (int(match[1]), int(match[2]), int(match[3] or 0))
    for bound, name in _BOUNDS:
        if release < bound:
            return FAMILIES[name]
    return FAMILIES[DEFAULT_FAMILY]


def resolve_version(version: str | None) -> tuple[VllmFamily, str]:
    """The family and the ``/version`` string for ``--vllm-version`` (``None``: the default family)."""
    family = family_for(version or DEFAULT_FAMILY)
    if version is None or version in FAMILIES:
        return family, family.version
    return family, version.strip().lstrip("v")


#: The first release whose KV events are maps (vLLM PR #42892; 0.23.x still sends arrays).
KV_EVENT_MAPS_SINCE = (0, 24, 0)


def kv_event_maps(family: VllmFamily, version: str) -> bool:
    """Whether ``version`` (a ``/version`` string of ``family``) sends its KV events as maps.

    A family that spans the change (``lease``: 0.21 and later) sends maps
    from :data:`KV_EVENT_MAPS_SINCE` on, arrays for a release named below it.
    """
    match = _VERSION.fullmatch(version.strip())
    if not family.kv_event_maps or match is None:
        return family.kv_event_maps
    return (int(match[1]), int(match[2]), int(match[3] or 0)) >= KV_EVENT_MAPS_SINCE
