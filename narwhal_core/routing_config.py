"""``[routing]``: which engine each leg goes to, and whether a request is disaggregated (docs/configure.md).

The policies and the plan they make are :mod:`narwhal_core.routing`'s; this
module only declares and checks the keys (re-exported by
:mod:`narwhal_core.config`). ``disaggregation = "required"`` is checked
against the other sections here: it needs ``mode = "always"`` and prefill
engines that are configured or may be discovered (docs/routing.md,
"Required disaggregation").
"""

from typing import TYPE_CHECKING, ClassVar, Literal

import attrs

from .config_fields import count, doc, float_in, one_of, seconds, to_float
from .errors import ConfigError

if TYPE_CHECKING:
    from .discovery_config import DiscoveryConfig
    from .engine_config import EngineConfig

__all__ = ["RoutingConfig", "RoutingPolicy", "RoutingMode", "Disaggregation"]

RoutingPolicy = Literal["least_loaded", "round_robin", "prefix", "kv"]
RoutingMode = Literal["always", "never", "auto"]
Disaggregation = Literal["optional", "required"]


@attrs.frozen(kw_only=True)
class RoutingConfig:
    """``[routing]``: each leg's engine, and whether a request is disaggregated (:mod:`narwhal_core.routing`)."""

    SECTION: ClassVar[str] = "routing"

    # prefix by default: it wins on every workload and rate the routing benchmarks replay
    # (benchmarks/README.md, "Defaults that win"; docs/configure.md, "[routing]").
    policy: RoutingPolicy = attrs.field(
        default="prefix",
        validator=one_of(RoutingPolicy),
        metadata=doc("How a leg's engine is chosen: prefix (prefix-cache aware), least_loaded, round_robin or kv."),
    )
    mode: RoutingMode = attrs.field(
        default="always",
        validator=one_of(RoutingMode),
        metadata=doc(
            "Disaggregation per request: always (prefill and decode legs), never (the whole request on one "
            "decode engine) or auto (decided per request by the cost model)."
        ),
    )
    disaggregation: Disaggregation = attrs.field(
        default="optional",
        validator=one_of(Disaggregation),
        metadata=doc(
            "optional (a request may run whole on a decode engine) or required (every request has a prefill "
            "leg; with no prefill engine in rotation it is answered 503 no_prefill_engine)."
        ),
    )
    disaggregate_min_uncached_tokens: int = count(
        512,
        'With mode = "auto": a prompt expected to have fewer uncached tokens than this on the best prefill '
        "engine runs whole on a decode engine.",
        minimum=0,
    )
    metrics_interval_s: float = seconds(
        1.0, "Time between two scrapes of each engine's /metrics (0 = never scraped).", positive=False
    )
    prefill_tokens_per_s: float = seconds(
        8000.0, "Estimated prompt tokens one prefill engine computes per second: the cost model's throughput."
    )
    miss_cost: float = attrs.field(
        default=3.0,
        converter=to_float,
        validator=float_in(positive=True),
        metadata=doc(
            "policy = prefix or kv: how many queued tokens one prompt token the engine must compute counts as "
            "(1: expected TTFT alone; more keeps prefixes where they are cached)."
        ),
    )
    kv_capacity_tokens: int = count(
        2000000,
        "Estimated tokens of KV cache one prefill engine holds: the bound of its prefix index (policy = prefix).",
        minimum=1,
    )
    kv_block_size: int = count(
        16,
        "Tokens per KV block of the engines (vLLM's --block-size): the block of the index built from their KV "
        "events (policy = kv).",
        minimum=1,
        maximum=4096,
    )
    kv_events_stale_s: float = seconds(
        30.0,
        "An engine whose KV-event stream has been lost, or silent while prefills were sent to it, this long is "
        "weighed from the approximate prefix index until its events come back (policy = kv).",
    )
    kv_speculative_ttl_s: float = seconds(
        2.0,
        "How long the blocks of a prefill just sent count as held on its engine before its KV events confirm "
        "them (policy = kv; 0 = off).",
        positive=False,
    )
    tokenize_inline_max_bytes: int = count(
        1024,
        "policy = kv: a prompt larger than this (the request body's bytes; a batch prompt's own text) is "
        "tokenized in a worker thread, off the event loop, before it is routed; a smaller one on the loop "
        "(about 0.5 ms a KB).",
        minimum=0,
    )

    def check(self, engine: "EngineConfig", discovery: "DiscoveryConfig") -> None:
        """What ``disaggregation = "required"`` needs of ``mode`` and of the fleet's sections; raises ConfigError."""
        if self.disaggregation != "required":
            return
        if self.mode != "always":
            raise ConfigError(
                "routing.disaggregation",
                f'"required" needs routing.mode = "always", got "{self.mode}" (with it a request may run whole on a '
                "decode engine)",
            )
        if not (engine.prefill_engines or discovery.may_prefill(engine.discovery)):
            raise ConfigError(
                "routing.disaggregation",
                '"required" needs prefill engines: engine.prefill, engine.discovery = "file", or "dns" with '
                "discovery.prefill",
            )
