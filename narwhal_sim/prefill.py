"""The prefill side's KV: a finished prefill's blocks held for a decode engine, and how the hold ends.

:class:`PrefillKv` owns the engine's :class:`~narwhal_sim.model.KvLedger` and
its lease timer. It writes the ``kv_transfer_params`` of a prefill answer
(docs/simulator.md, "Prefill leg" and "vLLM versions"); the routes that read or
free the held blocks are in :mod:`narwhal_sim.kv_pull` and :mod:`narwhal_sim.control`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from narwhal_sim.driving import CoreDriver, Flow
from narwhal_sim.model import FaultPlan, KvEntry, KvLedger, Prompt
from narwhal_sim.serving import Record, Serving

__all__ = ["PrefillKv"]


class PrefillKv:
    """The KV a prefill engine holds for decode engines, and its lease timer."""

    def __init__(self, serving: Serving, driver: CoreDriver, *, lease_s: float, reaper_stops_at_first_live: bool,
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self.serving = serving
        self.driver = driver
        self.loop = loop
        self.ledger = KvLedger(lease_s, reaper_stops_at_first_live=reaper_stops_at_first_live)
        self._lease_timer: asyncio.TimerHandle | None = None
        #: Told of each owner held, after the hold (the push routes pair parked registrations with it).
        self.on_held: Callable[[str], None] | None = None

    def close(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()

    def answer_params(self, owner: str, flow: Flow, prompt: Prompt, record: Record, plan: FaultPlan,
                      finish_reason: str) -> dict[str, Any] | None:  # fmt: skip
        """A finished prefill's ``kv_transfer_params``: its blocks held for ``owner``, or ``None`` (freed)."""
        kv_params = None
        if plan.omit_kv_params:
            # Like an engine without the KV connector: no params, nothing held.
            self.serving.counters["faults_omit_kv_params"] += 1
            self.driver.free_held(owner)
        elif finish_reason == "stop" and self.serving.family.null_params_on_stop:
            # Connectors before the lease hold KV only for FINISHED_LENGTH_CAPPED:
            # a prefill that stopped frees its blocks and hands off nothing.
            self.driver.free_held(owner)
            record.kv = {"role": "prefill", "owner": None, "blocks": 0, "outcome": "none",
                         "reason": "finished_stopped"}  # fmt: skip
        else:
            kv_params = self.hold(owner, flow.block_ids, prompt, record)
        flow.block_ids = []
        return kv_params

    def hold(self, owner: str, block_ids: list[int], prompt: Prompt, record: Record) -> dict[str, Any]:
        """Lease a finished prefill's blocks (pinned in the core) to ``owner``; the ``kv_transfer_params``."""
        entry = self.ledger.hold(
            owner,
            block_ids,
            now=self.loop.time(),
            prompt_tokens=prompt.num_tokens,
            prompt_digest=prompt.digest,
            tag=record,
        )
        record.kv = {"role": "prefill", "owner": owner, "blocks": len(entry.block_ids), "outcome": "held"}
        if self._lease_timer is None:
            self._arm_lease_timer()
        if self.on_held is not None:
            self.loop.call_soon(self.on_held, owner)
        # The NIXL connector's fields, in its order, for the modelled version
        # (docs/simulator.md, "Prefill leg" and "vLLM versions").
        serving = self.serving
        family = serving.family
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [entry.block_ids] if family.block_groups else entry.block_ids,
            "remote_engine_id": serving.engine_id,
        }
        if family.connector >= 2:
            params["remote_request_id"] = owner
        params["remote_host"] = serving.advertise_host
        params["remote_port"] = serving.port
        params["tp_size"] = serving.config.tp_size
        if serving.config.kv_transfer_mode == "push":
            # vLLM's push scheduler (nixl/push_scheduler.py, NixlPushConnectorScheduler.request_finished,
            # commit 0316d25a): the pull answer's keys without dcp_size and remote_blocks_expiry_time.
            params["pp_size"] = 1
            params["remote_num_tokens"] = prompt.num_tokens
            params["transfer_mode"] = "push"
        elif family.lease_keys:
            params["dcp_size"] = 1
            params["pp_size"] = 1
            params["remote_num_tokens"] = prompt.num_tokens
            params["remote_blocks_expiry_time"] = None
            params["transfer_mode"] = "pull"
        return params

    def stale_read(self, entry: KvEntry) -> None:
        """A READ of blocks freed at the hold's end: vLLM's prefill side only logs the late notification.

        ``NixlConnectorWorker._get_new_notifs`` (``nixl/base_worker.py``) warns of
        "potentially invalid KV blocks for unrecognized request"; the decode engine
        is told nothing (vLLM issue 21570). The simulator counts it and marks the record.
        """
        serving = self.serving
        serving.counters["kv_stale_reads"] += 1
        record: Record | None = entry.tag
        if record is not None and record.kv is not None:
            record.kv["stale_read"] = True
        serving.log({"ts": time.time(), "event": "kv_stale_read", "engine_id": serving.engine_id,
                     "owner": entry.owner})  # fmt: skip

    def unrecognized(self, notify_id: Any, entry: KvEntry | None) -> None:
        """A notification naming no held request: logged and ignored, as vLLM's prefill side does."""
        serving = self.serving
        serving.counters["kv_notifs_unrecognized"] += 1
        record: Record | None = entry.tag if entry is not None else None
        if record is not None and record.kv is not None:
            record.kv["unrecognized_notify"] = str(notify_id)[:200]
        serving.log({"ts": time.time(), "event": "kv_unrecognized", "engine_id": serving.engine_id,
                     "notify_id": str(notify_id)[:200], "held_owner": entry.owner if entry is not None else None})

    def renewed(self) -> None:
        """Leases were renewed: the reaper's next deadline moved."""
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
            self._arm_lease_timer()

    def kv_ended(self, entry: KvEntry) -> None:
        self.driver.free_held(entry.owner)
        if entry.outcome != "expired" and self._lease_timer is not None:
            # The reaper's next deadline may have moved (the head of the lease era's reaper).
            self._lease_timer.cancel()
            self._lease_timer = None
            self._arm_lease_timer()
        record: Record | None = entry.tag
        if record is not None and record.kv is not None:
            record.kv["outcome"] = entry.outcome
        serving = self.serving
        if serving.logging:
            serving.log(
                {
                    "ts": time.time(),
                    "event": "kv",
                    "engine_id": serving.engine_id,
                    "owner": entry.owner,
                    "request_id": record.request_id if record is not None else None,
                    "blocks": len(entry.block_ids),
                    "outcome": entry.outcome,
                }
            )

    def _arm_lease_timer(self) -> None:
        deadline = self.ledger.next_deadline()
        if deadline is not None:
            self._lease_timer = self.loop.call_at(deadline, self._expire_leases)

    def _expire_leases(self) -> None:
        self._lease_timer = None
        # Timers may fire up to a clock tick early; a millisecond of slack avoids a spin.
        for entry in self.ledger.expire_due(self.loop.time() + 0.001):
            self.kv_ended(entry)
        self._arm_lease_timer()
