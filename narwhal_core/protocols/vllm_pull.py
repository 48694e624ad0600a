"""vLLM's NIXL connector in pull mode, ``engine.protocol = "vllm-nixl"`` (docs/operate.md, "vLLM compatibility").

The prefill leg asks for one token with ``do_remote_decode``; its answer's
``kv_transfer_params`` name the blocks the prefill engine holds; the decode
leg, sent once that answer is in, carries them verbatim and its engine reads
the blocks, which frees them on the prefill engine. The bodies and the
answer's checks are :mod:`~narwhal_core.leg_bodies`' (docs/contract.md,
"Prefill and decode legs").
"""

from __future__ import annotations

from typing import Final

from .. import leg_bodies

__all__ = ["VllmNixlPull"]


class VllmNixlPull:
    """The pull protocol: prefill, then decode with the prefill answer's KV params."""

    __slots__ = ()

    name: Final = "vllm-nixl"
    legs_together: Final = False
    # (Plain functions: a call costs what calling leg_bodies directly did.)
    prefill_body: Final = staticmethod(leg_bodies.prefill_body)
    decode_body: Final = staticmethod(leg_bodies.decode_body)
    check_prefill_answer: Final = staticmethod(leg_bodies.check_prefill_answer)
    refused_mode: Final = staticmethod(leg_bodies.unsupported_transfer_mode)
    mode_error: Final = staticmethod(leg_bodies.transfer_mode_error)
    release_body: Final = staticmethod(leg_bodies.release_body)
