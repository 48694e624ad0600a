"""vLLM's NIXL connector in push mode, ``engine.protocol = "vllm-nixl-push"`` (docs/operate.md, "vLLM compatibility").

As vLLM's push proxy drives it (vllm-project/vllm,
``tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py``, commit
d1655eec): the prefill leg is pull's, and its answer (``transfer_mode:
"push"``) names the prefill engine; the decode leg, sent once that answer is
in and with the prefill leg's ``X-Request-Id``, carries only the prefill
engine's coordinates, no ``remote_block_ids``. The decode engine allocates
blocks and registers them with the prefill engine, which writes the KV into
them and frees its own (``nixl/push_scheduler.py``,
``NixlPushConnectorScheduler.update_state_after_alloc`` and
``request_finished``, commit 0316d25a). The prefill engine pairs a
registration with its finished request by request ID, exactly or with the
``-<8 hex>`` suffix each engine adds stripped from both
(``nixl/push_worker.py``, ``_pop_matching_registration``, commit 039e79a6):
hence the one ``X-Request-Id`` for both legs (``KvHandoff.shared_id``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from .. import leg_bodies
from ..errors import NarwhalError

__all__ = ["VllmNixlPush", "push_decode_params"]

_PUSH_MODES: Final = frozenset({"push"})
#: The prefill answer's keys a push decode engine reads, in the proxy's order; ``pp_size``
#: too where the answer has it (``update_state_after_alloc`` reads it, 1 when absent).
_DECODE_KEYS: Final = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size", "pp_size")


def push_decode_params(params: dict[str, Any]) -> dict[str, Any]:
    """A push decode leg's ``kv_transfer_params``: a remote prefill, the prefill engine's coordinates, no blocks."""
    out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False}
    for key in _DECODE_KEYS:
        if key in params:
            out[key] = params[key]
    return out


class VllmNixlPush:
    """The push protocol: prefill, then a decode leg that registers blocks for the prefill engine to write."""

    __slots__ = ()

    name: Final = "vllm-nixl-push"
    legs_together: Final = False
    prefill_body: Final = staticmethod(leg_bodies.prefill_body)

    @staticmethod
    def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        """The client's body with the push decode params (none: a plain request that recomputes)."""
        params = None if kv_transfer_params is None else push_decode_params(kv_transfer_params)
        return leg_bodies.decode_body(body, params)

    @staticmethod
    def check_prefill_answer(
        body: bytes, backend_id: str, kv_host_allowed: Callable[[str], bool], *, require_request_id: bool = False
    ) -> leg_bodies.KvHandoff:
        """Pull's checks, ``remote_request_id`` and ``tp_size`` required (the decode engine reads both)."""
        handoff = leg_bodies.check_prefill_answer(
            body, backend_id, kv_host_allowed, require_request_id=True, modes=_PUSH_MODES,
        )
        params = handoff.params
        if params is not None and params.get("transfer_mode") == "push":
            tp_size = params.get("tp_size")
            if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
                # update_state_after_alloc reads params["tp_size"]: a KeyError on the decode engine.
                raise leg_bodies.PrefillAnswerError("kv_transfer_params.tp_size is missing or not a number")
            handoff.shared_id = True
        return handoff

    @staticmethod
    def refused_mode(params: dict[str, Any]) -> str | None:
        """Any mode but ``push``: a pull engine would read blocks this decode leg never names."""
        return leg_bodies.unsupported_transfer_mode(params, _PUSH_MODES)

    @staticmethod
    def mode_error(mode: str) -> NarwhalError:
        """The 502 a request gets when its prefill engine does not answer in push mode."""
        return NarwhalError(
            f"The prefill engine answered kv_transfer_params.transfer_mode {mode!r}; engine.protocol "
            "'vllm-nixl-push' drives only the 'push' mode (run the NIXL connector in push mode on every engine, "
            "or set engine.protocol = 'vllm-nixl').",
            status=502, code="unsupported_kv_transfer_mode",
        )

    @staticmethod
    def release_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """A one-token decode request that registers, so that the prefill engine writes its KV and frees it."""
        return leg_bodies.release_body(body, push_decode_params(kv_transfer_params))
