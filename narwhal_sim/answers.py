"""A completion's answer, whole or streamed as server-sent events, with the faults that cut or break it.

The bodies are :mod:`narwhal_sim.protocol`'s, in the shapes vLLM writes them;
a stream sends each token as the engine core makes it (docs/simulator.md).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from narwhal_sim.driving import Flow
from narwhal_sim.http1 import HttpRequest, ServerConnection
from narwhal_sim.model import FaultPlan
from narwhal_sim.protocol import CompletionJob, StreamFormat, chat_body, completion_body
from narwhal_sim.serving import ClientGone, Record, Serving, rid_header

__all__ = ["Answers"]

_SSE = b"text/event-stream; charset=utf-8"


class Answers:
    """Writes a completion's answer on its connection and counts how it went."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    def whole_body(
        self,
        job: CompletionJob,
        response_id: str,
        tokens: list[str],
        chat_mode: str,
        answer_usage: dict[str, Any],
        kv_params: dict[str, Any] | None,
        finish_reason: str = "length",
    ) -> bytes:
        model = self.serving.config.model
        if job.chat:
            body = chat_body(
                response_id=response_id,
                created=int(time.time()),
                model=model,
                tokens=tokens,
                mode=chat_mode,
                tool_name=job.tool_name,
                digest=job.prompt.digest,
                usage=answer_usage,
                kv_transfer_params=kv_params,
                finish_reason=finish_reason if chat_mode != "tool" else "tool_calls",
            )
        else:
            body = completion_body(
                response_id=response_id,
                created=int(time.time()),
                model=model,
                text="".join(tokens),
                usage=answer_usage,
                kv_transfer_params=kv_params,
                finish_reason=finish_reason,
            )
        return orjson.dumps(body)

    async def send_whole(self, conn: ServerConnection, request: HttpRequest, plan: FaultPlan, body: bytes) -> None:
        record: Record = request.tag
        counters = self.serving.counters
        if plan.malformed_json:
            counters["faults_malformed_json"] += 1
            body = body[: max(len(body) // 2, 1)]
            record.outcome = "fault_malformed_json"
        # A non-streaming answer is one chunk: a stall or drop "after 0 chunks" hits it.
        if plan.stall_after == 0:
            counters["faults_stall"] += 1
            record.outcome = "fault_stall"
            await conn.wait_closed()
            return
        if plan.drop_after == 0:
            counters["faults_drop_after_chunks"] += 1
            record.outcome = "fault_drop_after_chunks"
            conn.close()
            return
        record.status = 200
        conn.respond(200, body, headers=rid_header(request))
        counters["completions_ok"] += 1

    async def stream(
        self,
        conn: ServerConnection,
        request: HttpRequest,
        job: CompletionJob,
        plan: FaultPlan,
        flow: Flow,
        tokens: list[str],
        answer_usage: dict[str, Any],
        response_id: str,
        chat_mode: str,
        finish_reason: str = "length",
    ) -> None:
        record: Record = request.tag
        fmt = StreamFormat(
            finish_reason=finish_reason if chat_mode != "tool" else "tool_calls",
            response_id=response_id,
            created=int(time.time()),
            model=self.serving.config.model,
            chat=job.chat,
            mode=chat_mode,
            tool_name=job.tool_name,
            digest=job.prompt.digest,
        )
        events = fmt.events(tokens, answer_usage if job.include_usage else None)
        limit, action = self._stream_faults(plan, record, fmt, events)
        record.status = 200
        conn.start_stream(200, content_type=_SSE, headers=rid_header(request))
        total = len(tokens)
        if flow.generated >= total:
            conn.send_chunks(events[:limit], end=action is None)
        else:
            # The first token is ready now; each further one comes with an engine step.
            upto = fmt.first_token_event() + 1
            conn.send_chunks(events[: min(upto, limit)])
            sent = 1
            while sent < total and upto < limit:
                if flow.generated <= sent:
                    await flow.wait_for(lambda: flow.generated > sent)
                if flow.aborted:
                    limit = upto  # vLLM ends an aborted stream where it stands
                    break
                if conn.closed:
                    raise ClientGone
                n = min(flow.generated, total) - sent
                conn.send_chunks(events[upto : min(upto + n, limit)])
                upto += n
                sent += n
            if upto < limit:
                conn.send_chunks(events[upto:limit])
        await self._stream_end(conn, record, action)

    def _stream_faults(self, plan: FaultPlan, record: Record, fmt: StreamFormat,
                       events: list[bytes]) -> tuple[int, str | None]:  # fmt: skip
        """Break the first token's event if asked; where a stall or drop cuts the stream, if anywhere."""
        if plan.malformed_json:
            self.serving.counters["faults_malformed_json"] += 1
            record.outcome = "fault_malformed_json"
            first = fmt.first_token_event()
            events[first] = events[first][: len(events[first]) // 2] + b"\n\n"
        # Where a stall or drop cuts the stream, if anywhere.
        limit, action = len(events), None
        if plan.stall_after is not None and plan.stall_after < limit:
            limit, action = plan.stall_after, "stall"
        if plan.drop_after is not None and plan.drop_after < limit:
            limit, action = plan.drop_after, "drop"
        return limit, action

    async def _stream_end(self, conn: ServerConnection, record: Record, action: str | None) -> None:
        counters = self.serving.counters
        if action == "stall":
            counters["faults_stall"] += 1
            record.outcome = "fault_stall"
            conn.flush()
            await conn.wait_closed()
        elif action == "drop":
            counters["faults_drop_after_chunks"] += 1
            record.outcome = "fault_drop_after_chunks"
            conn.flush()
            conn.close()
        else:
            conn.end_stream()
            counters["completions_ok"] += 1
