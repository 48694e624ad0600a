"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one completion from its body to its answer.

A completion is parsed (off the loop with a tokenizer), meets its injected
faults, is admitted into the engine core as a plain, prefill or decode request
(docs/simulator.md, "Prefill leg" and "Decode leg"), waits for its tokens and
answers whole or streamed. The prefill side's KV is :mod:`narwhal_sim.prefill`'s,
the decode side's :mod:`narwhal_sim.decode`'s.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Coroutine
from typing import Any

from narwhal_sim.answers import Answers
from narwhal_sim.decode import DecodeClaim, DecodeKv
from narwhal_sim.driving import CoreDriver, Flow
from narwhal_sim.engine import DECODE_REMOTE, PLAIN, PREFILL_REMOTE, EngineRequest
from narwhal_sim.http1 import HttpRequest, ServerConnection
from narwhal_sim.model import FaultPlan, Prompt, generate_tokens, owner_key
from narwhal_sim.prefill import PrefillKv
from narwhal_sim.protocol import (
    ApiError,
    CompletionJob,
    KvParams,
    parse_completion,
    usage,
)
from narwhal_sim.serving import NO_FAULTS, ClientGone, Record, Routes, Serving
from narwhal_sim.tokens import CHARS_PER_TOKEN

__all__ = ["Completions"]

class _Leg:
    """One completion as it goes: what it has claimed so far, for the cleanup at its end."""

    __slots__ = ("record", "request_id", "chat", "plan", "external", "core_id", "flow", "decode_kv", "admitted",
                 "out_tokens", "finish_reason", "done")  # fmt: skip

    def __init__(self, record: Record, request_id: str, chat: bool, plan: FaultPlan) -> None:
        self.record = record
        self.request_id = request_id
        self.chat = chat
        self.plan = plan
        self.external: str | None = None
        self.core_id: str | None = None
        self.flow: Flow | None = None
        self.decode_kv: DecodeClaim | None = None
        #: Its flow and external ID are registered with the driver.
        self.admitted = False
        self.out_tokens = 0
        self.finish_reason = "length"
        #: It was answered (or deliberately not): a leg that ends otherwise lost its client.
        self.done = False


class Completions:
    """The completion routes: parse, admit, wait on the engine core, answer."""

    def __init__(self, serving: Serving, driver: CoreDriver, prefill: PrefillKv, decode: DecodeKv) -> None:
        self.serving = serving
        self.driver = driver
        self.prefill = prefill
        self.decode = decode
        self.step_config = driver.step_config
        self.answers = Answers(serving)
        #: The engine died (``incomplete_kv_params = "crash"``): every later completion is a 500.
        self._dead = False
        self._owner_seq = 0
        self._hash_memo: dict[str, list[int]] = {}
        self.routes: Routes = {
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat_completions},
        }

    def _completions(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None]:
        return self._complete(conn, request, chat=False)

    def _chat_completions(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None]:
        return self._complete(conn, request, chat=True)

    async def _complete(self, conn: ServerConnection, request: HttpRequest, *, chat: bool) -> None:
        serving = self.serving
        record: Record = request.tag
        counters = serving.counters
        counters["completions"] += 1
        request_id = request.request_id or os.urandom(16).hex()
        plan = serving.faults.plan(serving.config.seed, request_id) if serving.faults_active else NO_FAULTS
        leg = _Leg(record, request_id, chat, plan)
        try:
            job = await self._accept(conn, request, leg)
            if job is not None:
                await self._serve(conn, request, job, leg)
            leg.done = True
        except ApiError as exc:
            counters["errors"] += 1
            serving.answer_error(conn, request, exc)
            if leg.decode_kv is None:
                self.decode.rejected_before_admission(request.body, record)
            leg.done = True
        except ClientGone:
            pass
        finally:
            self._end(leg)

    # ------------------------------------------------------------------ before the engine

    async def _accept(self, conn: ServerConnection, request: HttpRequest, leg: _Leg) -> CompletionJob | None:
        """The parsed request, past the faults that come before the engine; ``None`` when already answered."""
        serving = self.serving
        counters = serving.counters
        if self._dead:
            counters["errors"] += 1
            serving.answer(conn, request, 500, serving.error_body(
                500, "EngineCore encountered an issue. See stack trace (above) for the root cause."))
            return None
        try:
            job = await self._parse(request, leg.chat)
        except ApiError as exc:
            counters["errors"] += 1
            serving.answer_error(conn, request, exc)
            self.decode.rejected_before_admission(request.body, leg.record)
            return None
        plan = leg.plan
        if plan.drop:
            counters["faults_drop"] += 1
            leg.record.outcome = "dropped"
            conn.close()
            return None
        if plan.delay_s:
            counters["faults_delay"] += 1
            await asyncio.sleep(plan.delay_s)
        if plan.error_status is not None:
            counters["faults_error"] += 1
            counters["errors"] += 1
            status = plan.error_status
            serving.answer(conn, request, status, serving.error_body(status, "injected fault"), outcome="fault_error")
            return None
        return job

    async def _parse(self, request: HttpRequest, chat: bool) -> CompletionJob:
        serving = self.serving
        config = serving.config
        parse = functools.partial(
            parse_completion,
            request.body,
            chat=chat,
            served_model=config.model,
            max_model_len=config.max_model_len,
            tokenizer=serving.tokenizer,
            require_request_id=serving.family.connector >= 2,
            push=serving.config.kv_transfer_mode == "push",
        )
        if serving.tokenizing is None:
            job = parse()
        else:
            job = await asyncio.get_running_loop().run_in_executor(serving.tokenizing, parse)
        self._check_role(job)
        if job.kv is not None and job.kv.mode == "invalid":
            self._incomplete_params(job.kv)
        return job

    def _check_role(self, job: CompletionJob) -> None:
        mode = job.kv.mode if job.kv is not None else None
        role = self.serving.config.role
        if mode == "prefill":
            if role == "decode":
                raise ApiError(400, "this is a decode engine: it does not take do_remote_decode (prefill) requests",
                               param="kv_transfer_params")  # fmt: skip
            if job.stream:
                raise ApiError(400, "streaming is not supported for prefill requests (do_remote_decode)",
                               param="stream")  # fmt: skip
        elif mode in ("decode", "invalid") and role == "prefill":
            raise ApiError(400, "this is a prefill engine: it does not take do_remote_prefill (decode) requests",
                           param="kv_transfer_params")  # fmt: skip

    def _incomplete_params(self, params: KvParams) -> None:
        """A decode request whose params lack a field the connector reads (docs/simulator.md)."""
        setting = self.serving.config.incomplete_kv_params
        if setting == "recompute":
            return  # counted with the plain request it becomes
        self.serving.counters["kv_params_invalid"] += 1
        message = f"kv_transfer_params.{params.missing} is missing or not usable"
        if setting == "crash":
            # vLLM through 0.29.0 dies on a KeyError in the scheduler (CVE-2026-94622).
            self._dead = True
            raise ApiError(500, f"EngineCore encountered an issue: KeyError: {params.missing!r}")
        raise ApiError(400, message, param="kv_transfer_params")

    def _check_fits(self, job: CompletionJob, mode: str | None, out_tokens: int) -> None:
        step = self.step_config
        prompt_tokens = job.prompt.num_tokens
        needed = step.blocks_for(prompt_tokens if mode == "prefill" else prompt_tokens + out_tokens)
        if needed > step.num_gpu_blocks:
            raise ApiError(400, f"request needs {needed} KV blocks; the engine has {step.num_gpu_blocks}")
        if not step.chunked_prefill and prompt_tokens > step.max_num_batched_tokens and mode != "decode":
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens, more than max_num_batched_tokens "
                                f"({step.max_num_batched_tokens}) with chunked prefill off")  # fmt: skip

    # ------------------------------------------------------------------ in the engine

    async def _serve(self, conn: ServerConnection, request: HttpRequest, job: CompletionJob, leg: _Leg) -> None:
        flow = await self._admit(conn, request, job, leg)
        if leg.decode_kv is not None:
            await self._load(conn, job, leg, flow)
        if flow.generated < 1:
            await flow.wait_for(lambda: flow.generated >= 1)
            flow.check_aborted(leg.external)
        if conn.closed:
            raise ClientGone
        await self._respond(conn, request, job, leg, flow)

    async def _admit(self, conn: ServerConnection, request: HttpRequest, job: CompletionJob, leg: _Leg) -> Flow:
        """Hand the request to the engine core as a plain, prefill or decode request; its flow."""
        serving = self.serving
        config = serving.config
        counters = serving.counters
        record = leg.record
        kv = job.kv
        mode = kv.mode if kv is not None else None
        out_tokens = 1 if mode == "prefill" else job.max_tokens
        if leg.plan.eos and job.min_tokens < 1:
            # The first sampled token is the end of sequence (FINISHED_STOPPED).
            out_tokens, leg.finish_reason = 1, "stop"
        leg.out_tokens = out_tokens
        self._check_fits(job, mode, out_tokens)
        if mode == "decode" and config.pre_admission_ms > 0:
            # The serving layer's own work before the engine sees the request: a client that
            # leaves meanwhile wins the race, and the request never reaches the engine.
            if conn.closed or await conn.wait_closed(config.pre_admission_ms / 1000.0):
                self.decode.rejected_before_admission(request.body, record)
                raise ClientGone
        external, engine_rid = self._engine_request_id(leg.request_id, leg.chat)
        leg.external = external
        if mode == "decode":
            assert kv is not None
            leg.decode_kv = self.decode.claim(kv, engine_rid, fail_pull=leg.plan.pull_fail,
                                              lose_registration=leg.plan.push_reg_lost)
            record.kv = {"role": "decode", "owner": kv.remote_request_id, "outcome": "pending"}
        elif mode == "invalid":
            counters["kv_params_invalid"] += 1
        leg.core_id = core_id = engine_rid
        if mode == "prefill":
            kind = PREFILL_REMOTE
        else:
            kind = DECODE_REMOTE if leg.decode_kv is not None else PLAIN
        if kind == PLAIN and (config.role == "decode" or mode == "invalid"):
            counters["recomputed"] += 1
        flow = leg.flow = Flow(kind, job.prompt.num_tokens)
        self.driver.flows[core_id] = flow
        self.driver.external[external] = core_id
        leg.admitted = True
        self._submit(job, leg, kind)
        return flow

    def _submit(self, job: CompletionJob, leg: _Leg, kind: str) -> None:
        driver = self.driver
        step = self.step_config
        prompt = job.prompt
        assert leg.core_id is not None
        events_on = driver.publisher is not None
        engine_request = EngineRequest(
            request_id=leg.core_id,
            kind=kind,
            prompt_tokens=prompt.num_tokens,
            max_tokens=leg.out_tokens,
            block_hashes=self._block_hashes(prompt) if step.prefix_caching else (),
            token_ids=prompt.block_token_ids(step.block_size) if events_on else None,
            linger=leg.plan.stall_after is not None,
            hold=leg.decode_kv is not None and self.serving.config.bidirectional_kv,
        )
        if driver.speed == 0:
            driver.dispatch(driver.core.serve_now(engine_request, now=driver.core.now))
            driver.publish()
        else:
            driver.core.add_request(engine_request, now=driver.core_now())
            driver.pump()

    async def _load(self, conn: ServerConnection, job: CompletionJob, leg: _Leg, flow: Flow) -> None:
        """A decode request's KV, pulled once the core started it; recomputed when the pull fails."""
        decode_kv = leg.decode_kv
        assert decode_kv is not None and leg.core_id is not None
        await flow.wait_for(lambda: flow.started)
        flow.check_aborted(leg.external)
        cached = await self.decode.load_kv(conn, job, decode_kv, leg.record)
        if cached is None and self.serving.config.kv_load_failure == "fail":
            raise ApiError(500, "KV transfer from the prefill engine failed")
        if cached is None:
            # The pull failed: the core recomputes the prompt here (with prefix hits).
            self.serving.counters["recomputed"] += 1
            flow.kind = PLAIN
            flow.started = False
        else:
            flow.cached = cached
        driver = self.driver
        driver.core.kv_loaded(leg.core_id, now=driver.core_now(), ok=cached is not None)
        driver.pump()

    def _end(self, leg: _Leg) -> None:
        """Whatever the way out: forget the request, free what the core holds, release unpulled KV."""
        driver = self.driver
        if leg.admitted and leg.external is not None:
            driver.external.pop(leg.external, None)
        core_id = leg.core_id
        flow = leg.flow
        if core_id is not None:
            driver.flows.pop(core_id, None)
            now = driver.core_now()
            if driver.core.abort(core_id, now=now) or (
                flow is not None and flow.block_ids and driver.core.free_held(core_id, now=now) is not None
            ):
                driver.pump()
        record = leg.record
        if leg.decode_kv is not None and leg.decode_kv.phase == "pending":
            # Aborted before the pull: tell the prefill engine to free the blocks (vLLM does).
            self.decode.release_remote(leg.decode_kv, record)
        if not leg.done and record.outcome is None:
            record.outcome = "client_gone"
            self.serving.counters["client_gone"] += 1
        self.serving.finish(record)

    def _block_hashes(self, prompt: Prompt) -> list[int]:
        """The prompt's block hashes; those of recent texts are remembered (clients repeat prompts)."""
        size = self.step_config.block_size
        if prompt.num_tokens < size:
            return []
        text = prompt.text
        if prompt.token_ids is not None or text is None:
            return prompt.block_hashes(size)
        key = text[: (prompt.num_tokens // size) * size * CHARS_PER_TOKEN]
        memo = self._hash_memo
        hashes = memo.get(key)
        if hashes is None:
            hashes = prompt.block_hashes(size)
            memo[key] = hashes
            if len(memo) > 4096:
                del memo[next(iter(memo))]
        return hashes

    def _engine_request_id(self, request_id: str, chat: bool) -> tuple[str, str]:
        """The external and the engine request ID of a completion, as vLLM mangles ``X-Request-Id``.

        External: ``cmpl-<X-Request-Id>-0`` (the prompt's index) or ``chatcmpl-<X-Request-Id>``.
        Engine: the same, plus ``-<8 hex>`` from the 0.14 family on (deterministic here: from the
        seed, the ID and a per-engine sequence). The engine ID names the KV (``remote_request_id``).
        """
        external = f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}-0"
        ledger = self.prefill.ledger
        core = self.driver.core
        if not self.serving.family.request_id_suffix:
            if external in self.driver.external or external in ledger or core.state_of(external) is not None:
                raise ApiError(400, f"Request id {external} already running.")
            return external, external
        while True:  # a client reusing a request id may meet a key in use: take the next one
            self._owner_seq += 1
            owner = owner_key(self.serving.config.seed, external, self._owner_seq)
            if owner not in ledger and core.state_of(owner) is None:
                return external, owner

    # ------------------------------------------------------------------ the answer

    async def _respond(self, conn: ServerConnection, request: HttpRequest, job: CompletionJob, leg: _Leg,
                       flow: Flow) -> None:  # fmt: skip
        """Answer whole or streamed: a prefill's answer with its KV params, a bidirectional decode's with its own."""
        config = self.serving.config
        record = leg.record
        prompt = job.prompt
        core_id = leg.core_id
        assert core_id is not None
        out_tokens = leg.out_tokens
        tokens = generate_tokens(config.seed, prompt.digest, out_tokens, chat=job.chat)
        self.serving.counters["generation_tokens"] += out_tokens
        kv_params = None
        if job.kv is not None and job.kv.mode == "prefill":
            if not flow.finished:
                await flow.wait_for(lambda: flow.finished)
                flow.check_aborted(leg.external)
            kv_params = self.prefill.answer_params(core_id, flow, prompt, record, leg.plan, leg.finish_reason)
        answer_usage = usage(prompt.num_tokens, out_tokens, flow.cached,
                             details=config.enable_prompt_tokens_details)  # fmt: skip
        response_id = ("chatcmpl-" if job.chat else "cmpl-") + leg.request_id
        chat_mode = "tool" if job.tool_name else ("reasoning" if self.serving.faults.reasoning_only else "text")
        computed = prompt.num_tokens + out_tokens - 1
        if job.stream:
            await self.answers.stream(conn, request, job, leg.plan, flow, tokens, answer_usage, response_id, chat_mode,
                                      leg.finish_reason)  # fmt: skip
            if leg.decode_kv is not None and config.bidirectional_kv and flow.finished:
                self.decode.hold_decoded(core_id, flow, computed, prompt, record)
        else:
            if not flow.finished:
                await flow.wait_for(lambda: flow.finished)
                flow.check_aborted(leg.external)
            if leg.decode_kv is not None and config.bidirectional_kv:
                kv_params = self.decode.hold_decoded(core_id, flow, computed, prompt, record)
            body = self.answers.whole_body(job, response_id, tokens, chat_mode, answer_usage, kv_params,
                                          leg.finish_reason)  # fmt: skip
            await self.answers.send_whole(conn, request, leg.plan, body)
