"""Per-tenant budgets (docs/operate.md, "Tenants"): requests per second and prompt tokens per minute.

With ``[tenants]`` and a rate in some tenant's budget, admission
(:class:`~narwhal_core.tenants.FairAdmission`) asks :class:`Budgets` about
each request before it takes a slot or a place in the queue. Each tenant
has up to two token buckets:

* requests: ``requests_per_s`` a second, holding ``max(1, requests_per_s)``
  (one second's worth, at least one request);
* prompt tokens: ``prompt_tokens_per_min / 60`` a second, holding
  ``prompt_tokens_per_min`` (one minute's worth); a request costs its
  estimated prompt tokens, the estimate the fair queue weighs.

A request is admitted only if both buckets hold its cost; it is charged
only once admission has admitted or queued it. Over any window of ``t``
seconds a bucket therefore admits at most ``rate × t + capacity``. A
refusal is 429 with the time until the request would fit as
``Retry-After``, and the OpenAI rate-limit headers. A prompt larger than
its tenant's token bucket never fits: 429 ``prompt_over_budget``, with
``x-should-retry: false`` and no ``Retry-After``.

Allowance enters a bucket in one place, :meth:`Bucket.refill` (here from
the time it is given); everything else only reads or takes from the level.
Pure arithmetic on the ``now`` the router hands in: no clock, no I/O.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from .errors import NarwhalError

if TYPE_CHECKING:
    from .tenants_config import TenantsConfig

__all__ = ["Bucket", "BudgetRefusal", "Budgets", "duration"]

#: Slack for float rounding: a cost this close to the level fits.
_EPS: Final = 1e-9
_Headers = tuple[tuple[bytes, bytes], ...]


class Bucket:
    """A token bucket: up to ``capacity`` units, earning ``rate`` units a second."""

    __slots__ = ("rate", "capacity", "level", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate: Final = rate
        self.capacity: Final = capacity
        #: The units it holds (it starts full).
        self.level = capacity
        #: The time the level was last brought up to date.
        self.stamp = now

    def refill(self, now: float) -> None:
        """Add what the time since the last refill earned, up to the capacity."""
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait(self, cost: float) -> float:
        """Seconds until ``cost`` fits (0: now; ``inf``: never, it is more than the capacity)."""
        short = cost - self.level
        if short <= _EPS:
            return 0.0
        if cost > self.capacity + _EPS:
            return math.inf
        return short / self.rate

    def take(self, cost: float) -> None:
        """Charge ``cost`` (it fits: :meth:`wait` said 0)."""
        self.level -= cost

    def headers(self, unit: bytes) -> _Headers:
        """The OpenAI rate-limit headers of ``unit`` (``requests`` or ``tokens``) for this bucket."""
        return (
            (b"x-ratelimit-limit-" + unit, b"%d" % math.floor(self.capacity + _EPS)),
            (b"x-ratelimit-remaining-" + unit, b"%d" % max(0, math.floor(self.level + _EPS))),
            (b"x-ratelimit-reset-" + unit, duration((self.capacity - self.level) / self.rate).encode()),
        )


class BudgetRefusal(NarwhalError):
    """A tenant's budget refused a request: 429, with the headers its answer carries."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, reason: str, headers: _Headers) -> None:
        super().__init__(message, code=reason)
        #: The metrics' reason, also the error's code.
        self.reason: Final = reason
        #: Retry-After (or x-should-retry) and the OpenAI rate-limit headers.
        self.headers: Final = headers


class Budgets:
    """Each tenant's buckets, made when its first request comes and dropped once full again."""

    def __init__(self, tenants: TenantsConfig) -> None:
        self._tenants: Final = tenants
        #: Client -> (requests bucket, prompt tokens bucket); ``None`` where its budget sets no such rate.
        self._buckets: dict[str, tuple[Bucket | None, Bucket | None]] = {}
        self._prune_at = 64

    def check(self, client: str, cost: int, now: float) -> BudgetRefusal | None:
        """Whether a request of ``client`` costing ``cost`` prompt tokens fits its budget now; if not, why."""
        buckets = self._buckets.get(client)
        if buckets is None:
            budget = self._tenants.budget(client)
            if not budget.rated:
                return None
            if len(self._buckets) >= self._prune_at:
                self._prune(now)
            rps, tpm = budget.requests_per_s, budget.prompt_tokens_per_min
            buckets = self._buckets[client] = (
                Bucket(rps, max(1.0, rps), now) if rps else None,
                Bucket(tpm / 60.0, tpm, now) if tpm else None,
            )
        requests, tokens = buckets
        waits = []
        if requests is not None:
            requests.refill(now)
            waits.append((requests.wait(1), "requests_budget"))
        if tokens is not None:
            tokens.refill(now)
            waits.append((tokens.wait(cost), "prompt_tokens_budget"))
        wait, reason = max(waits)
        if not wait:
            return None
        return _refusal(wait, reason, cost, requests, tokens)

    def charge(self, client: str, cost: int) -> None:
        """Admission took the request :meth:`check` let through (at the same ``now``): charge its budget."""
        buckets = self._buckets.get(client)
        if buckets is None:
            return
        requests, tokens = buckets
        if requests is not None:
            requests.take(1)
        if tokens is not None:
            tokens.take(cost)

    def headers(self, client: str) -> _Headers:
        """The OpenAI rate-limit headers of ``client``'s buckets as they are (none: it has no rate budget)."""
        buckets = self._buckets.get(client)
        if buckets is None:
            return ()
        requests, tokens = buckets
        return (
            *(() if requests is None else requests.headers(b"requests")),
            *(() if tokens is None else tokens.headers(b"tokens")),
        )

    def __len__(self) -> int:
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        # A bucket full again is the same as a new one: forget it.
        for client, pair in list(self._buckets.items()):
            for bucket in pair:
                if bucket is not None:
                    bucket.refill(now)
            if all(b is None or b.level >= b.capacity for b in pair):
                del self._buckets[client]
        self._prune_at = 2 * len(self._buckets) + 64


def _refusal(wait: float, reason: str, cost: int, requests: Bucket | None, tokens: Bucket | None) -> BudgetRefusal:
    """The 429 of a request that does not fit: ``wait`` seconds until it would (``inf``: never)."""
    rate_headers = (
        *(() if requests is None else requests.headers(b"requests")),
        *(() if tokens is None else tokens.headers(b"tokens")),
    )  # (Budgets.headers, from the pair it already holds)
    if math.isinf(wait):
        assert tokens is not None
        return BudgetRefusal(
            f"The request's estimated {cost} prompt tokens exceed this client's budget of "
            f"{math.floor(tokens.capacity)} prompt tokens per minute; it can never be admitted.",
            reason="prompt_over_budget", headers=((b"x-should-retry", b"false"), *rate_headers),
        )
    what = "requests per second" if reason == "requests_budget" else "prompt tokens per minute"
    retry = (
        (b"retry-after", b"%d" % math.ceil(wait)),  # whole seconds (RFC 9110's delay-seconds)
        (b"retry-after-ms", b"%d" % math.ceil(wait * 1000.0)),  # what the openai SDK reads first
    )
    return BudgetRefusal(
        f"This client's budget of {what} is used up; retry in {duration(wait)}.",
        reason=reason, headers=(*retry, *rate_headers),
    )


def duration(seconds: float) -> str:
    """``seconds`` rounded up to the millisecond, as OpenAI's reset headers write it: ``20ms``, ``1s``, ``6m0s``."""
    ms = max(0, math.ceil(seconds * 1000.0 - 1e-6))
    if not ms:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    whole, frac = divmod(ms, 1000)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    text = f"{secs}.{frac:03d}".rstrip("0") if frac else str(secs)
    if hours:
        return f"{hours}h{minutes}m{text}s"
    if minutes:
        return f"{minutes}m{text}s"
    return f"{text}s"
