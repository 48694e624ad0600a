"""The prefill engine's internal KV routes a decode engine calls: pull, push, notify, heartbeat.

``POST /kv/pull`` is NIXL's READ with its notification, ``POST /kv/push`` a
push-mode decode engine's registration (the prefill engine then WRITEs the
blocks), ``POST /kv/notify`` the notification alone (a decode engine that will
not read the blocks), and ``POST /kv/heartbeat`` the lease family's renewal
(docs/simulator.md, "vLLM versions").
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson

from narwhal_sim.http1 import HttpRequest, ServerConnection
from narwhal_sim.model import KvEntry
from narwhal_sim.prefill import PrefillKv
from narwhal_sim.protocol import ApiError, flat_block_ids
from narwhal_sim.serving import (
    KV_HEARTBEAT_PATH, KV_NOTIFY_PATH, KV_PULL_PATH, KV_PUSH_PATH, Routes, Serving, json_body,
)

__all__ = ["MAX_PARKED_PUSHES", "KvPullRoutes", "base_request_id"]

#: Push registrations a prefill engine keeps waiting for their prefill request; past it the
#: oldest is answered 404. The simulator's own bound: vLLM's has none (docs/simulator.md, "Push mode").
MAX_PARKED_PUSHES = 1024

#: The ``-<8 hex>`` suffix each vLLM engine adds to the request ID it was sent (0.14 on).
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(request_id: str) -> str:
    """``request_id`` without the engine's random suffix (vLLM's ``nixl/utils.py``, ``get_base_request_id``)."""
    return _RANDOM_SUFFIX.sub("", request_id)


class KvPullRoutes:
    """Answers a decode engine's reads, notifications and lease renewals from the prefill side's ledger."""

    def __init__(self, serving: Serving, prefill: PrefillKv) -> None:
        self.serving = serving
        self.prefill = prefill
        self.routes: Routes = {
            KV_PULL_PATH: {"POST": self._kv_pull},
            KV_PUSH_PATH: {"POST": self._kv_push},
            KV_NOTIFY_PATH: {"POST": self._kv_notify},
            KV_HEARTBEAT_PATH: {"POST": self._kv_heartbeat},
        }
        #: Registrations that came before their prefill request: request ID -> its answer, once written
        #: (``None``: dropped unpaired). A waiter whose decode engine left stays until it pairs.
        self.parked: dict[str, asyncio.Future[bytes | None]] = {}
        prefill.on_held = self._pair_parked

    def _kv_pull(self, conn: ServerConnection, request: HttpRequest) -> None:
        """A decode engine reads held blocks (NIXL's READ) and names the request to free (its notification).

        ``remote_request_id`` (connector 2) finds the entry by owner; without it (connector 1)
        the blocks are found by their ids. The blocks are freed only when ``notify_id`` names
        the owner; any other name is an "unrecognized request": the data was read but the
        blocks stay held until the timeout. A pull after the hold ran out reads the freed
        blocks all the same: it answers 200 marked ``stale`` (docs/simulator.md, "vLLM versions").
        """
        try:
            data = json_body(request)
            entry, stale = self._find(data)
        except ApiError as exc:
            self.serving.answer_error(conn, request, exc)
            return
        owner = entry.owner
        notify_id = data.get("notify_id", owner)
        if stale:
            self.prefill.stale_read(entry)
        elif notify_id == owner:
            self.prefill.ledger.pull(owner)
            self.prefill.kv_ended(entry)
        else:
            self.prefill.unrecognized(notify_id, entry)
        answer = {
            "remote_request_id": owner,
            "num_blocks": len(entry.block_ids),
            "prompt_tokens": entry.prompt_tokens,
            "prompt_digest": entry.prompt_digest,
            "stale": stale,
        }
        self.serving.answer(conn, request, 200, orjson.dumps(answer))

    async def _kv_push(self, conn: ServerConnection, request: HttpRequest) -> None:
        """A push-mode decode engine registers its blocks: the held request it names is written, then freed.

        vLLM's ``nixl/push_worker.py`` (commit 039e79a6): ``_pop_matching_finished_blocks``
        pairs the registration's ``request_id`` with a finished request, exactly or with the
        ``-<8 hex>`` suffix stripped from both; the WRITE's completion frees the prefill
        engine's blocks (``NixlPushConnectorScheduler.update_connector_output``). A
        registration that pairs with nothing is parked (``_handle_push_reg_notif`` keeps it in
        ``_pending_d_registrations``) and answered once its prefill request is held and written.
        """
        read = self._string_field(conn, request, "request_id")
        if read is None:
            return
        _, request_id = read
        ledger = self.prefill.ledger
        base = base_request_id(request_id)
        owner = request_id if request_id in ledger else next(
            (held for held in ledger.owners() if base_request_id(held) == base), None)
        entry = None if owner is None else ledger.pull(owner)
        if entry is not None:
            self.serving.answer(conn, request, 200, self._written(entry))
            return
        counters = self.serving.counters
        counters["kv_push_parked"] += 1
        parked = self.parked
        waiter: asyncio.Future[bytes | None] = self.prefill.loop.create_future()
        # A second registration of one ID replaces the first, as vLLM's dict does.
        self._unpark(parked.pop(request_id, None))
        parked[request_id] = waiter
        if len(parked) > MAX_PARKED_PUSHES:
            self._unpark(parked.pop(next(iter(parked))))
        answer = await waiter
        if answer is None:
            counters["kv_push_unmatched"] += 1
            self.serving.answer(conn, request, 404, orjson.dumps({"matched": False}))
        else:
            self.serving.answer(conn, request, 200, answer)

    @staticmethod
    def _unpark(waiter: asyncio.Future[bytes | None] | None) -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pair_parked(self, owner: str) -> None:
        """A prefill request was held: write it to the registration parked for it, if any.

        vLLM's ``_pop_matching_registration`` (``nixl/push_worker.py``, 039e79a6): the exact
        ID first, then with the suffix stripped from both. The write happens even if the
        registering decode request has gone meanwhile (vLLM's prefill side is not told), and
        frees the blocks.
        """
        parked = self.parked
        if not parked:
            return
        request_id: str | None = owner if owner in parked else None
        if request_id is None:
            base = base_request_id(owner)
            request_id = next((parked_id for parked_id in parked if base_request_id(parked_id) == base), None)
        if request_id is None:
            return
        entry = self.prefill.ledger.pull(owner)
        if entry is None:
            return
        waiter = parked.pop(request_id)
        self.serving.counters["kv_push_parked_paired"] += 1
        answer = self._written(entry)
        if not waiter.done():
            waiter.set_result(answer)

    def _written(self, entry: KvEntry) -> bytes:
        """The KV written to the registering decode engine and the prefill engine's blocks freed; the answer."""
        self.serving.counters["kv_pushes"] += 1
        self.prefill.kv_ended(entry)
        return orjson.dumps({"remote_request_id": entry.owner, "num_blocks": len(entry.block_ids),
                             "prompt_tokens": entry.prompt_tokens, "prompt_digest": entry.prompt_digest})  # fmt: skip

    def _find(self, data: dict[str, object]) -> tuple[KvEntry, bool]:
        """The entry a pull reads, and whether its hold already ran out (a stale read)."""
        ledger = self.prefill.ledger
        stale = False
        owner = data.get("remote_request_id")
        if owner is not None and not isinstance(owner, str):
            raise ApiError(400, "remote_request_id must be a string", param="remote_request_id")
        expected = data.get("remote_engine_id")
        engine_id = self.serving.engine_id
        if expected is not None and expected != engine_id:
            raise ApiError(409, f"this is engine {engine_id}, not {expected}", param="remote_engine_id")
        block_ids = flat_block_ids(data.get("remote_block_ids"))
        if owner is None:
            entry = ledger.find_blocks(block_ids)
            if entry is None:
                entry = ledger.find_blocks(block_ids, expired=True)
                stale = entry is not None
            if entry is None:
                raise ApiError(404, "no KV held in blocks " + str(block_ids[:8]))
        else:
            entry = ledger.get(owner)
            if entry is None:
                entry = ledger.expired_entry(owner)
                stale = entry is not None
            if entry is None:
                raise ApiError(404, f"no KV held for {owner} (never held, or pulled or released)")
            if data.get("remote_block_ids") is not None and block_ids != entry.block_ids:
                raise ApiError(409, f"remote_block_ids do not match the blocks held for {owner}")
        return entry, stale

    def _string_field(self, conn: ServerConnection, request: HttpRequest, name: str) -> tuple[dict[str, Any], str] | None:
        """The JSON body and its string field ``name``; ``None`` once a 400 has answered a body without one."""
        try:
            data = json_body(request)
            value = data.get(name)
            if not isinstance(value, str):
                raise ApiError(400, f"{name} must be a string", param=name)
        except ApiError as exc:
            self.serving.answer_error(conn, request, exc)
            return None
        return data, value

    def _kv_notify(self, conn: ServerConnection, request: HttpRequest) -> None:
        """A decode engine that will not read the blocks tells the prefill engine to free them."""
        read = self._string_field(conn, request, "notify_id")
        if read is None:
            return
        data, notify_id = read
        ledger = self.prefill.ledger
        entry = ledger.release(notify_id)
        if entry is not None:
            self.prefill.kv_ended(entry)
        else:
            self.prefill.unrecognized(notify_id, ledger.find_blocks(flat_block_ids(data.get("remote_block_ids"))))
        self.serving.answer(conn, request, 200, orjson.dumps({"freed": entry is not None}))

    def _kv_heartbeat(self, conn: ServerConnection, request: HttpRequest) -> None:
        """Renew the leases a decode engine names (lease family); expired entries stay gone."""
        try:
            ids = json_body(request).get("remote_request_ids")
            if not isinstance(ids, list):
                raise ApiError(400, "remote_request_ids must be an array", param="remote_request_ids")
        except ApiError as exc:
            self.serving.answer_error(conn, request, exc)
            return
        ledger = self.prefill.ledger
        now = self.prefill.loop.time()
        renewed = sum(1 for owner in ids if isinstance(owner, str) and ledger.renew(owner, now))
        if renewed:
            self.prefill.renewed()
        self.serving.answer(conn, request, 200, orjson.dumps({"renewed": renewed}))
