"""The settings of one simulated engine (:class:`SimConfig`); each has a ``narwhal sim`` flag (docs/simulator.md)."""

from __future__ import annotations

import attrs

from narwhal_sim.engine import StepConfig
from narwhal_sim.model import ROLES, Faults
from narwhal_sim.versions import resolve_version

__all__ = ["SimConfig", "DEFAULT_MODEL"]

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@attrs.frozen(kw_only=True)
class SimConfig:
    """Every setting of one simulated engine; each has a ``narwhal sim`` flag of the same name."""

    #: ``prefill``, ``decode`` or ``mixed`` (both, like vLLM's ``kv_both``).
    role: str = "mixed"
    #: The engine protocol spoken: ``vllm`` (the NIXL connector's pull) or ``sglang`` (SGLang's
    #: bootstrap rooms, :mod:`narwhal_sim.sglang`; docs/simulator.md, "SGLang PD").
    protocol: str = "vllm"
    #: SGLang's ``--disaggregation-bootstrap-port`` (8998 in its server_args.py): where a SGLang prefill
    #: engine serves its bootstrap rooms; 0 picks a free port.
    bootstrap_port: int = 8998
    #: SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``: seconds a prefill room waits for its decode side.
    bootstrap_timeout_s: float = 300.0
    #: SGLang's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``: seconds a decode request waits for its room's KV.
    waiting_timeout_s: float = 300.0
    #: Address to listen on; port 0 picks a free port.
    host: str = "127.0.0.1"
    port: int = 0
    #: The served model name; requests naming another model get 404.
    model: str = DEFAULT_MODEL
    #: Seeds the output text, the KV owner suffixes and every fault decision.
    seed: int = 0
    #: Divides every modelled time; 0 answers at once without sleeping.
    speed: float = 1.0
    #: Required bearer credential on every route but ``/sim/*``; sent on KV pulls and releases.
    api_key: str | None = None
    #: ``remote_engine_id`` of this engine; random per start when ``None``.
    engine_id: str | None = None
    #: ``remote_host`` handed to decode engines; the listen host when ``None`` (127.0.0.1 for a wildcard).
    advertise_host: str | None = None
    #: ``tp_size`` reported in ``kv_transfer_params``.
    tp_size: int = 1
    #: The vLLM version family modelled (docs/simulator.md, "vLLM versions"): a family name
    #: (``0.9``, ``0.10``, ``0.11``, ``0.14``, ``0.18``, ``lease``, ``0.28``) or a release like ``0.14.1``; ``None``: ``0.28``.
    vllm_version: str | None = None
    #: ``usage.prompt_tokens_details`` is filled (vLLM's ``--enable-prompt-tokens-details``); else ``null``.
    enable_prompt_tokens_details: bool = False
    #: vLLM's ``--tokens-only``: ``POST /abort_requests`` (fire and forget), where the family has it.
    tokens_only: bool = False
    #: vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``): ``POST /abort_requests`` answering ``{"status", "aborted"}``.
    dev_mode: bool = False
    #: Serve the simulator's own ``POST /abort_request`` (no vLLM has it; SGLang has a route of that name):
    #: ``True``/``"json"`` answers ``{"request_id", "released", "num_blocks"}``; ``"bare"`` answers 200 with
    #: no body, as SGLang does.
    abort_request_route: bool | str = False
    #: Real milliseconds the serving layer takes before a request reaches the engine (rendering,
    #: tokenizing); a decode request whose client leaves within it never reached the engine.
    pre_admission_ms: float = 0.0
    #: A decode request whose ``kv_transfer_params`` lack a field the connector reads: ``reject`` (400),
    #: ``recompute`` (warn and recompute, what the connector's validity check does) or ``crash`` (the
    #: engine dies: 500 on every later completion, as CVE-2026-94622 describes).
    incomplete_kv_params: str = "reject"
    #: The NIXL connector's ``transfer_mode`` (lease family only): ``pull`` (the decode engine reads the
    #: blocks) or ``push`` (vLLM's push scheduler: prefill answers say ``transfer_mode: "push"``; see
    #: docs/simulator.md, "vLLM versions").
    kv_transfer_mode: str = "pull"
    #: Tokens per KV block.
    block_size: int = 16
    #: KV blocks of the engine (28,000 x 16 tokens ~ an H100 80 GB serving Llama-3.1-8B).
    num_gpu_blocks: int = 28_000
    #: Sequences running at once; more wait in a FCFS queue.
    max_num_seqs: int = 256
    #: Token budget of one engine step; ``None``: 8192, or ``max_model_len`` without chunked prefill.
    max_num_batched_tokens: int | None = None
    #: Split prompts over steps when they do not fit the budget.
    chunked_prefill: bool = True
    #: Longest prompt plus output, in tokens.
    max_model_len: int = 131_072
    #: Seconds a prefill engine holds unpulled KV before freeing it as *expired* (wall clock);
    #: ``None``: the version family's (120 s, 480 s, or the 30 s lease).
    kv_lease_s: float | None = None
    #: vLLM's ``kv_connector_extra_config.bidirectional_kv_xfer`` on a decode engine (``0.28`` family on):
    #: a finished decode request's answer carries the engine's own ``kv_transfer_params`` and its
    #: blocks stay held for ``decoder_kv_blocks_ttl_s`` (docs/simulator.md, "vLLM versions").
    bidirectional_kv: bool = False
    #: vLLM's ``decoder_kv_blocks_ttl`` (480 s by default): how long a decode engine holds those blocks.
    decoder_kv_blocks_ttl_s: float = 480.0
    #: Whether prompts hit the prefix cache (full blocks kept in the KV pool until evicted).
    prefix_caching: bool = True
    #: Step time: ``step_base_ms + prefill tokens × prefill_per_token_ms + decoding sequences ×
    #: decode_per_seq_ms`` (see :class:`narwhal_sim.engine.StepConfig`).
    step_base_ms: float = 7.0
    prefill_per_token_ms: float = 0.08
    decode_per_seq_ms: float = 0.05
    kv_transfer_base_ms: float = 2.0
    kv_transfer_per_block_ms: float = 0.05
    #: Timeout of a KV pull or release sent to a prefill engine.
    kv_pull_timeout_s: float = 10.0
    #: Real (unscaled) time a decode leg watches its client before pulling, so a
    #: router's decode_abort (send, close at once) counts as released; ``None``:
    #: 2 ms, or 0 at speed 0 (only a few loop turns). See docs/simulator.md.
    kv_pull_grace_ms: float | None = None
    #: A failed pull ``recompute``\\ s the prompt (vLLM's default) or ``fail``\\ s the request (500).
    kv_load_failure: str = "recompute"
    #: Idle keep-alive connections close after this long (uvicorn's default).
    keep_alive_s: float = 5.0
    #: Headers and body of a request must arrive within this time.
    read_timeout_s: float = 30.0
    #: Largest request body.
    max_body_bytes: int = 64 * 1024 * 1024
    #: Requests kept in memory for ``/sim/requests``.
    record_limit: int = 10_000
    #: Request log: ``None``/``"none"`` off, ``"-"`` stdout, ``"stderr"``, or a file path.
    log: str | None = None
    #: Fault settings at start.
    faults: Faults = Faults()
    #: ``tcp://HOST:PORT``: publish vLLM KV events on a ZMQ PUB socket bound there.
    kv_events_endpoint: str | None = None
    #: ``tcp://HOST:PORT`` of the replay ROUTER socket; ``None``: the PUB port + 1.
    kv_events_replay_endpoint: str | None = None
    #: Topic frame of every published batch.
    kv_events_topic: str = ""
    #: The engine's data-parallel rank (vLLM's ``--data-parallel-rank``): its KV events go to the
    #: endpoints' ports + the rank, and every batch says it (docs/simulator.md, "KV events").
    data_parallel_rank: int = 0
    #: The KV-event batch as a map, not an array (``EventBatch`` without ``array_like``; docs/simulator.md).
    kv_events_batch_map: bool = False
    #: A Hugging Face ``tokenizer.json`` (or its directory): counts and hashes prompts by its ids.
    tokenizer: str | None = None
    #: A jinja2 chat template file (default: the tokenizer's; none: chat is refused, as vLLM refuses it).
    chat_template: str | None = None

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if self.speed < 0:
            raise ValueError("speed must be >= 0")
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_model_len", "tp_size", "record_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.step_config.check()
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not _tcp_endpoint(value):
                raise ValueError(f"{name} must be tcp://HOST:PORT, got {value!r}")
        if self.data_parallel_rank < 0:
            raise ValueError("data_parallel_rank must be >= 0")
        if self.kv_pull_grace_ms is not None and self.kv_pull_grace_ms < 0:
            raise ValueError("kv_pull_grace_ms must be >= 0")
        family, _ = resolve_version(self.vllm_version)  # ValueError naming the accepted forms
        if self.bidirectional_kv and not family.bidirectional_expiry:
            raise ValueError(f"bidirectional_kv is modelled from the 0.28 family on, not {family.name}")
        if self.decoder_kv_blocks_ttl_s <= 0:
            raise ValueError("decoder_kv_blocks_ttl_s must be > 0")
        if self.abort_request_route not in (False, True, "json", "bare"):
            raise ValueError("abort_request_route must be json or bare")
        if self.pre_admission_ms < 0:
            raise ValueError("pre_admission_ms must be >= 0")
        if self.incomplete_kv_params not in ("reject", "recompute", "crash"):
            raise ValueError("incomplete_kv_params must be reject, recompute or crash")
        if self.kv_transfer_mode not in ("pull", "push"):
            raise ValueError("kv_transfer_mode must be pull or push")
        if self.kv_transfer_mode == "push" and not resolve_version(self.vllm_version)[0].lease_keys:
            raise ValueError("kv_transfer_mode push needs the lease family (vLLM's push scheduler came with it)")
        if (self.kv_lease_s is not None and self.kv_lease_s <= 0) or self.kv_pull_timeout_s <= 0:
            raise ValueError("kv_lease_s and kv_pull_timeout_s must be > 0")
        if self.kv_load_failure not in ("recompute", "fail"):
            raise ValueError("kv_load_failure must be recompute or fail")
        if not 0 <= self.port <= 65535 or not 0 <= self.bootstrap_port <= 65535:
            raise ValueError("port and bootstrap_port must be between 0 and 65535")
        if self.protocol not in ("vllm", "sglang"):
            raise ValueError("protocol must be vllm or sglang")
        if self.bootstrap_timeout_s <= 0 or self.waiting_timeout_s <= 0:
            raise ValueError("bootstrap_timeout_s and waiting_timeout_s must be > 0")

    @property
    def pull_grace_s(self) -> float:
        """The pre-pull grace in seconds."""
        if self.kv_pull_grace_ms is None:
            return 0.0 if self.speed == 0 else 0.002
        return self.kv_pull_grace_ms / 1000.0

    @property
    def step_config(self) -> StepConfig:
        """The engine core's settings."""
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if self.chunked_prefill else max(self.max_model_len, 8192)
        return StepConfig(
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            chunked_prefill=self.chunked_prefill,
            prefix_caching=self.prefix_caching,
            step_base_ms=self.step_base_ms,
            prefill_per_token_ms=self.prefill_per_token_ms,
            decode_per_seq_ms=self.decode_per_seq_ms,
            kv_transfer_base_ms=self.kv_transfer_base_ms,
            kv_transfer_per_block_ms=self.kv_transfer_per_block_ms,
        )


def _tcp_endpoint(value: str) -> bool:
    if not value.startswith("tcp://"):
        return False
    host, sep, port = value[6:].rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) <= 65535)

