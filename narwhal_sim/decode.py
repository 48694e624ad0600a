"""The decode side's KV: a decode request's claim on a prefill engine's blocks, pulled or released.

:class:`DecodeKv` pulls the prompt's KV from the prefill engine named by
``remote_host``/``remote_port`` (NIXL's READ), tells it to free blocks it will
not read (NIXL's notification), renews its leases (lease family) and, with
``bidirectional_kv``, holds a finished decode request's own blocks
(docs/simulator.md, "Decode leg" and "vLLM versions").
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from narwhal_sim.driving import CoreDriver, Flow
from narwhal_sim.http1 import ServerConnection
from narwhal_sim.http_client import EngineClient
from narwhal_sim.model import KvLedger, Prompt
from narwhal_sim.protocol import ApiError, CompletionJob, KvParams
from narwhal_sim.serving import (
    KV_HEARTBEAT_PATH, KV_NOTIFY_PATH, KV_PULL_PATH, KV_PUSH_PATH, ClientGone, Record, Serving,
)

__all__ = ["DecodeClaim", "DecodeKv"]


class DecodeClaim:
    """A decode leg's claim on remote KV: ``pending`` until pulled, released or failed.

    ``notify_id`` is the request ID the decode engine names when it tells the prefill engine
    to free the blocks: its own (connector 1) or ``remote_request_id`` (connector 2).
    """

    __slots__ = ("params", "phase", "notify_id", "fail_pull", "lose_registration", "engine_rid")

    def __init__(self, params: KvParams, notify_id: str | None, engine_rid: str | None = None) -> None:
        self.params = params
        #: The decode engine's own request ID: what a push-mode registration names.
        self.engine_rid = engine_rid
        self.phase = "pending"
        self.notify_id = notify_id
        #: The ``pull_fail`` fault: the read fails (the prefill engine is not told).
        self.fail_pull = False
        #: The ``push_reg_lost`` fault: the push registration never reaches the prefill engine.
        self.lose_registration = False


class DecodeKv:
    """Pulls, releases and lease renewals a decode engine sends; its own finished requests' held KV."""

    def __init__(self, serving: Serving, driver: CoreDriver, *, lease_s: float,
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self.serving = serving
        self.driver = driver
        self.loop = loop
        #: The period of lease renewals derives from the engine's own lease (the fleet shares one).
        self.lease_s = lease_s
        config = serving.config
        self.client = EngineClient(loop, timeout_s=config.kv_pull_timeout_s, authorization=serving.auth)
        #: Push registrations wait for the write as long as the request does.
        self.push_client = EngineClient(loop, timeout_s=None, authorization=serving.auth)
        #: A decode engine's own finished requests' KV, held for ``decoder_kv_blocks_ttl`` (bidirectional).
        self.decoder_ledger = KvLedger(config.decoder_kv_blocks_ttl_s)
        self._decoder_timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()

    def cancel_timer(self) -> None:
        if self._decoder_timer is not None:
            self._decoder_timer.cancel()

    def close(self) -> None:
        self.client.close()
        self.push_client.close()
        for task in list(self._background):
            task.cancel()

    # ------------------------------------------------------------------ the claim

    def claim(self, kv: KvParams, engine_rid: str, *, fail_pull: bool, lose_registration: bool = False) -> DecodeClaim:
        """A decode request's claim, its lease renewed while it waits where the family does it."""
        # From here on, a request that ends before its pull releases the
        # prefill engine's KV, as vLLM's NIXL connector does -- naming its own
        # request ID with connector 1, remote_request_id with connector 2.
        family = self.serving.family
        decode_kv = DecodeClaim(kv, engine_rid if family.connector == 1 else kv.remote_request_id, engine_rid)
        decode_kv.fail_pull = fail_pull
        decode_kv.lose_registration = lose_registration
        if family.lease_renewal and kv.tp_size is not None:
            self._start_heartbeats(decode_kv)
        return decode_kv

    def rejected_before_admission(self, body: bytes, record: Record) -> None:
        """A decode request refused before it reached the engine: only the lease family tells the prefill engine."""
        if not self.serving.family.notify_on_rejection or self.serving.config.role == "prefill":
            return
        try:
            data = orjson.loads(body)
            push = self.serving.config.kv_transfer_mode == "push"
            params = KvParams.parse(data.get("kv_transfer_params"), push=push) if isinstance(data, dict) else None
        except (orjson.JSONDecodeError, ApiError):
            return
        if params is not None and params.mode == "decode":
            self.release_remote(DecodeClaim(params, params.remote_request_id), record)

    def _start_heartbeats(self, decode_kv: DecodeClaim) -> None:
        """Renew the prefill engine's lease while this decode request waits (lease family)."""
        task = self.loop.create_task(self._heartbeats(decode_kv))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _heartbeats(self, decode_kv: DecodeClaim) -> None:
        params = decode_kv.params
        assert params.remote_host is not None and params.remote_port is not None
        period = self.lease_s / 6.0  # vLLM: kv_lease_duration // 6
        body = orjson.dumps({"remote_request_ids": [params.remote_request_id]})
        while decode_kv.phase == "pending":
            try:
                await self.client.post(params.remote_host, params.remote_port, KV_HEARTBEAT_PATH, body)
                self.serving.counters["kv_heartbeats"] += 1
            except (OSError, TimeoutError, ConnectionError):
                pass
            await asyncio.sleep(period)

    # ------------------------------------------------------------------ pull and release

    async def load_kv(
        self, conn: ServerConnection, job: CompletionJob, decode_kv: DecodeClaim, record: Record
    ) -> int | None:
        """Pull the prompt's KV from the prefill engine; cached tokens, or ``None`` to recompute."""
        params = decode_kv.params
        # decode_abort (docs/simulator.md, "Decode leg"): a router frees KV by sending this request and
        # closing at once. Give the loop a few turns to see that EOF (it may
        # come in a later read than the request) before committing to the pull.
        for _ in range(3):
            await asyncio.sleep(0)
        config = self.serving.config
        grace = config.pull_grace_s
        if conn.closed or (grace > 0 and await conn.wait_closed(grace)):
            raise ClientGone
        speed = config.speed
        if speed > 0:
            # The load takes the transfer time (the first token then takes one engine
            # step); a client leaving meanwhile cancels us (and releases).
            blocks = len(params.flat_block_ids)
            await asyncio.sleep(self.driver.step_config.transfer_s(blocks) / speed)
        if conn.closed:
            raise ClientGone
        decode_kv.phase = "pulling"
        if config.kv_transfer_mode == "push":
            return await self._push(conn, job, decode_kv, record)
        # Shielded: a client leaving mid-pull must not leave the prefill engine guessing.
        task = self.loop.create_task(self._pull(job, decode_kv, record))
        return await asyncio.shield(task)

    async def _push(self, conn: ServerConnection, job: CompletionJob, decode_kv: DecodeClaim,
                    record: Record) -> int | None:  # fmt: skip
        """Register the request's blocks with the prefill engine, which writes the KV (push mode).

        vLLM's ``NixlPushConnectorScheduler`` (nixl/push_scheduler.py, commit 0316d25a): the
        registration names the decode engine's own request ID; its watchdog drops one the
        prefill engine has not fulfilled after ``push_registration_timeout``
        (``decoder_kv_blocks_ttl`` by default) but keeps the request waiting for the write,
        which still completes it if it comes later. The prefill engine answers the
        registration once it has written the KV: at once, or when the prefill request it
        parked for arrives (docs/simulator.md, "Push mode, the decode side").
        """
        params = decode_kv.params
        assert params.remote_host is not None and params.remote_port is not None
        counters = self.serving.counters
        kv_record = record.kv if record.kv is not None else {}
        kv_record["outcome"] = "push_waiting"
        closed = conn.gone()
        waits: set[asyncio.Future[Any]] = {closed}
        if decode_kv.lose_registration:
            # The PUSH_REG notification never leaves: nixl/push_worker.py (039e79a6),
            # _do_send_reg_notif, logs push_reg_notif_failed and keeps the receive pending.
            counters["faults_push_reg_lost"] += 1
        else:
            counters["kv_push_registrations"] += 1
            body = orjson.dumps({"request_id": decode_kv.engine_rid, "remote_engine_id": params.remote_engine_id,
                                 "requester_engine_id": self.serving.engine_id})  # fmt: skip
            waits.add(self.loop.create_task(
                self.push_client.post(params.remote_host, params.remote_port, KV_PUSH_PATH, body)))
        try:
            data = await self._push_written(waits, closed, counters, kv_record)
        finally:
            for task in waits - {closed}:
                task.cancel()
        if data is None:
            decode_kv.phase = "failed"
            raise ClientGone
        decode_kv.phase = "pulled"
        counters["kv_pulls"] += 1
        kv_record["outcome"], kv_record["blocks"] = "pushed", data.get("num_blocks")
        if data.get("prompt_digest") != job.prompt.digest:
            counters["kv_prompt_mismatch"] += 1
            kv_record["outcome"] = "prompt_mismatch"
            return None
        return job.prompt.num_tokens

    async def _push_written(self, waits: set[asyncio.Future[Any]], closed: asyncio.Future[Any],
                            counters: dict[str, int], kv_record: dict[str, Any]) -> dict[str, Any] | None:  # fmt: skip
        """The prefill engine's answer once it wrote the KV, or ``None`` once the client left."""
        deadline: float | None = self.loop.time() + self.serving.config.decoder_kv_blocks_ttl_s
        while True:
            timeout = None if deadline is None else max(0.0, deadline - self.loop.time())
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                counters["kv_push_registration_timeouts"] += 1
                kv_record["outcome"] = "push_registration_timeout"
                deadline = None
                continue
            if closed in done:
                return None
            (written,) = done
            waits.discard(written)
            try:
                status, answer = written.result()
                data = orjson.loads(answer) if status == 200 else None
            except (OSError, TimeoutError, ConnectionError, orjson.JSONDecodeError):
                data = None
            if isinstance(data, dict):
                return data
            # Refused or unreachable: nothing will write the KV; the request waits for its client.

    async def _pull(self, job: CompletionJob, decode_kv: DecodeClaim, record: Record) -> int | None:
        params = decode_kv.params
        assert params.remote_host is not None and params.remote_port is not None
        counters = self.serving.counters
        body = orjson.dumps(
            {
                # Connector 1 reads by block ids and names no remote request.
                "remote_request_id": params.remote_request_id if self.serving.family.connector >= 2 else None,
                "remote_engine_id": params.remote_engine_id,
                "remote_block_ids": params.remote_block_ids,
                "notify_id": decode_kv.notify_id,
                "requester_engine_id": self.serving.engine_id,
            }
        )
        kv_record = record.kv if record.kv is not None else {}
        if decode_kv.fail_pull:
            # An injected failed read: nothing reaches the prefill engine, which keeps the blocks.
            decode_kv.phase = "failed"
            counters["kv_pull_failures"] += 1
            counters["faults_pull_fail"] += 1
            kv_record["outcome"] = "pull_failed"
            kv_record["error"] = "injected pull failure"
            return None
        try:
            status, answer = await self.client.post(params.remote_host, params.remote_port, KV_PULL_PATH, body)
            if status != 200:
                raise ConnectionError(f"prefill engine answered {status}: {answer[:200]!r}")
            data = orjson.loads(answer)
        except (OSError, TimeoutError, ConnectionError, orjson.JSONDecodeError) as exc:
            decode_kv.phase = "failed"
            counters["kv_pull_failures"] += 1
            kv_record["outcome"] = "pull_failed"
            kv_record["error"] = str(exc) or type(exc).__name__
            return None
        decode_kv.phase = "pulled"
        counters["kv_pulls"] += 1
        kv_record["outcome"] = "pulled"
        kv_record["blocks"] = data.get("num_blocks")
        if data.get("stale"):
            # The blocks were freed before this read: vLLM's decode engine cannot tell and
            # answers normally (vLLM issue 21570); only the simulator's counters say so.
            counters["kv_stale_reads"] += 1
            kv_record["stale_read"] = True
        if data.get("prompt_digest") != job.prompt.digest:
            # The router changed the prompt between the legs: this KV is for another prompt.
            counters["kv_prompt_mismatch"] += 1
            kv_record["outcome"] = "prompt_mismatch"
            return None
        # A decode engine counts every transferred prompt token as cached (docs/simulator.md, "Decode leg").
        return job.prompt.num_tokens

    def release_remote(self, decode_kv: DecodeClaim, record: Record) -> None:
        decode_kv.phase = "released"
        self.serving.counters["kv_releases_sent"] += 1
        if record.kv is None:
            record.kv = {"role": "decode", "owner": decode_kv.params.remote_request_id}
        record.kv["outcome"] = "released"
        task = self.loop.create_task(self._send_release(decode_kv))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_release(self, decode_kv: DecodeClaim) -> None:
        params = decode_kv.params
        assert params.remote_host is not None and params.remote_port is not None
        body = orjson.dumps({"notify_id": decode_kv.notify_id, "remote_block_ids": params.remote_block_ids})
        try:
            status, _ = await self.client.post(params.remote_host, params.remote_port, KV_NOTIFY_PATH, body)
        except (OSError, TimeoutError, ConnectionError):
            status = 0
        if status != 200:
            self.serving.counters["kv_release_failures"] += 1

    # ------------------------------------------------------------------ bidirectional: the decode engine's own KV

    def hold_decoded(self, owner: str, flow: Flow, computed: int, prompt: Prompt, record: Record) -> dict[str, Any]:
        """Hold a finished decode request's blocks for ``decoder_kv_blocks_ttl`` (bidirectional transfer).

        vLLM's ``NixlPullConnectorScheduler.request_finished`` (nixl/pull_scheduler.py, commit
        0050936b): on a decode engine with ``bidirectional_kv_xfer`` a request that finished
        (length or stop) keeps its blocks for ``decoder_kv_blocks_ttl`` (base_scheduler.py, 480 s
        by default; no lease renewal) so that the next turn's prefill can read them, and answers
        the engine's own ``kv_transfer_params``: ``do_remote_decode: true``, the blocks, and
        ``remote_blocks_expiry_time``, the deadline on the engine's clock (PR 47021), and
        ``remote_num_tokens``, the tokens whose KV it computed (``computed``: the prompt and the
        output but its last token). Only a prefill request carrying these params would read them:
        nothing here does, so they expire.
        """
        entry = self.decoder_ledger.hold(owner, flow.block_ids, now=self.loop.time(),
                                         prompt_tokens=computed, prompt_digest=prompt.digest)  # fmt: skip
        flow.block_ids = []
        if record.kv is not None:
            record.kv["decoder_held_blocks"] = len(entry.block_ids)
        if self._decoder_timer is None:
            self._arm_decoder_timer()
        serving = self.serving
        return {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [entry.block_ids],
            "remote_engine_id": serving.engine_id,
            "remote_request_id": owner,
            "remote_host": serving.advertise_host,
            "remote_port": serving.port,
            "tp_size": serving.config.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": entry.prompt_tokens,
            "remote_blocks_expiry_time": entry.expires_at,
            "transfer_mode": "pull",
        }

    def _arm_decoder_timer(self) -> None:
        deadline = self.decoder_ledger.next_deadline()
        if deadline is not None:
            self._decoder_timer = self.loop.call_at(deadline, self._expire_decoded)

    def _expire_decoded(self) -> None:
        self._decoder_timer = None
        driver = self.driver
        for entry in self.decoder_ledger.expire_due(self.loop.time() + 0.001):
            driver.core.free_held(entry.owner, now=driver.core_now())
        driver.pump()
        self._arm_decoder_timer()
