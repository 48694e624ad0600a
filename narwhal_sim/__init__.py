"""Narwhal's engine simulator: a vLLM-compatible OpenAI engine speaking the PD protocol (SPEC §3, §9).

* :mod:`narwhal_sim.model` — the pure engine model (KV blocks, leases, prefix
  cache, latency, text, fault decisions).
* :mod:`narwhal_sim.protocol` — OpenAI request/answer shapes as vLLM writes them.
* :mod:`narwhal_sim.server` — :class:`SimEngine`, the HTTP engine on asyncio.
* :mod:`narwhal_sim.testing` — :class:`SimThread` and :class:`SimProcess` for tests,
  the demo and benchmarks.
* :mod:`narwhal_sim.cli` — ``narwhal sim`` / ``python -m narwhal_sim``.

See ``docs/simulator.md``.
"""

from narwhal_sim.model import Faults, LatencyModel
from narwhal_sim.server import ABORT_PATH, DEFAULT_MODEL, KV_PULL_PATH, SimConfig, SimEngine

__all__ = ["Faults", "LatencyModel", "SimConfig", "SimEngine", "KV_PULL_PATH", "ABORT_PATH", "DEFAULT_MODEL"]
