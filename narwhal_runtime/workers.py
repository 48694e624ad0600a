"""What one worker of ``narwhal serve --workers N`` is given (docs/operate.md, "Workers").

Pure functions, computed once at start-up: how many workers ``ingress.workers``
asks for, the config each worker serves (its share of the fleet-wide limits,
its own journal file, the port the supervisor picked) and the journal file
names. The supervisor (:mod:`.supervisor`) uses them before it starts a
worker; a worker (``narwhal serve`` with the hidden worker flags) applies
:func:`worker_config` to the config file it reads, so both agree.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
from pathlib import PurePath

import attrs

from narwhal_core import Config, ConfigError
from narwhal_core.config import TenantsConfig

__all__ = ["die_with_supervisor", "resolve_workers", "share", "worker_config", "worker_journal_path", "WORKER_JOURNAL"]

#: A per-worker journal file name: ``<stem>.w<K><suffix>``.
WORKER_JOURNAL = re.compile(r"\.w(\d+)$")


def resolve_workers(config: Config, override: int | None = None) -> int:
    """The number of worker processes: ``override`` (``--workers``), else ``ingress.workers`` ("auto": one per core)."""
    if override is not None:
        if override < 1:
            raise ConfigError("ingress.workers", f"--workers must be at least 1, got {override}")
        return override
    workers = config.ingress.workers
    if workers == "auto":
        return max(1, os.cpu_count() or 1)
    return workers


def share(value: int, workers: int) -> int:
    """One worker's share of a fleet-wide limit: ``ceil(value / workers)``; 0 (off, no queue) stays 0.

    Rounding up means no worker ever gets 0 from a positive limit, and the
    group together allows at least ``value`` and at most ``value + workers - 1``.
    """
    return math.ceil(value / workers) if value > 0 else 0


def worker_journal_path(path: str, index: int) -> str:
    """Worker ``index``'s journal file: ``journal.jsonl`` -> ``journal.w0.jsonl`` (no suffix: ``journal.w0``)."""
    if path == "-":
        raise ConfigError("journal.path", '"-" (stdout) cannot be split per worker: name a file when ingress.workers > 1')
    pure = PurePath(path)
    if pure.suffix:
        return str(pure.with_name(f"{pure.stem}.w{index}{pure.suffix}"))
    return f"{path}.w{index}"


def worker_config(config: Config, *, index: int, workers: int, port: int) -> Config:
    """The config worker ``index`` of ``workers`` serves: its share of every fleet-wide limit.

    Fleet-wide (docs/configure.md marks them): ``ingress.max_connections``,
    ``admission.max_inflight``, ``admission.queue_size``,
    ``admission.per_client_max_inflight``, ``engine.max_inflight_per_engine``,
    and each tenant's budget (``[tenants]``: its rates divided, its in-flight
    limit shared). ``ingress.workers`` keeps the group's size (listening sockets then set
    ``SO_REUSEPORT``); the listen port is the one the supervisor bound.
    """
    ingress = config.ingress
    host = ingress.listen.rsplit(":", 1)[0]
    return attrs.evolve(
        config,
        ingress=attrs.evolve(
            ingress, listen=f"{host}:{port}", workers=workers,
            max_connections=share(ingress.max_connections, workers),
        ),
        admission=attrs.evolve(
            config.admission,
            max_inflight=share(config.admission.max_inflight, workers),
            queue_size=share(config.admission.queue_size, workers),
            per_client_max_inflight=share(config.admission.per_client_max_inflight, workers),
        ),
        engine=attrs.evolve(
            config.engine,
            max_inflight_per_engine=share(config.engine.max_inflight_per_engine, workers),
        ),
        tenants=None if config.tenants is None else tenants_share(config.tenants, workers),
        journal=attrs.evolve(config.journal, path=worker_journal_path(config.journal.path, index)),
    )


def tenants_share(tenants: TenantsConfig, workers: int) -> TenantsConfig:
    """One worker's share of every tenant's budget: rates / ``workers``, in-flight limits by :func:`share`.

    Each worker's router enforces its share on its own (docs/operate.md, "Budgets").
    """
    def rate(value: float | None) -> float | None:
        return None if value is None else value / workers

    def inflight(value: int | None) -> int | None:
        return None if value is None else share(value, workers)

    return attrs.evolve(
        tenants,
        default_requests_per_s=tenants.default_requests_per_s / workers,
        default_prompt_tokens_per_min=tenants.default_prompt_tokens_per_min / workers,
        default_max_inflight=inflight(tenants.default_max_inflight),
        tenant=tuple(
            attrs.evolve(
                t, requests_per_s=rate(t.requests_per_s), prompt_tokens_per_min=rate(t.prompt_tokens_per_min),
                max_inflight=inflight(t.max_inflight),
            )
            for t in tenants.tenant
        ),
    )


def die_with_supervisor(supervisor_pid: int | None) -> None:
    """Have the kernel send this worker SIGTERM (a drain) when its supervisor dies (Linux ``PR_SET_PDEATHSIG``).

    A supervisor killed with SIGKILL cannot forward anything; without this
    its workers would serve on, orphaned. Elsewhere it is a no-op. A
    supervisor already gone when this runs: the worker exits at once.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if supervisor_pid is not None and os.getppid() != supervisor_pid:
        raise SystemExit(1)
