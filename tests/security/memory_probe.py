"""Peak memory of the request contract on hostile bodies, measured in a process of its own.

``python -m tests.security.memory_probe`` prints one JSON object per body:
``{"name", "size", "peak", "seconds", "status"}`` (``seconds`` of CPU time) where ``peak`` is the growth
of the resident set's high-water mark (``VmHWM``) while
:func:`narwhal_core.contract.check_request` ran. The high-water mark is reset
before each body by writing ``5`` to ``/proc/self/clear_refs`` (Linux); where
that is not allowed, each body runs in a fresh process instead.

``tracemalloc`` is not used: it books orjson's output buffer at its reserved
capacity (hundreds of MB for a 3 MB output) although the pages are never
touched, so it would report memory that is not used.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable

from narwhal_core.contract import check_request
from narwhal_core.errors import ContractError

#: A number the fast path cannot hold exactly: forces the exact (standard library) decoder.
EXACT = b'"x":1.00000000000000000001,'


def array_of(item: bytes, count: int) -> bytes:
    """The members of a JSON array: ``item`` ``count`` times, comma-separated."""
    return b",".join([item] * count)


#: name -> body of about 2 MB, each a worst case for one part of the decoder.
BODIES: dict[str, Callable[[], bytes]] = {
    "deep-unclosed": lambda: b"[" * 2_000_000,
    "long-integer": lambda: b'{"prompt":"a","x":' + b"9" * 1_950_000 + b"}",
    "many-4300-digit-integers": lambda: b'{"prompt":"a","x":[' + array_of(b"9" * 4300, 900) + b"]}",
    "giant-array": lambda: b"[" + array_of(b"0", 950_000) + b"]",
    "giant-array-of-floats": lambda: b'{' + EXACT + b'"y":[' + array_of(b"0.5", 500_000) + b"]}",
    "giant-array-of-objects": lambda: b"[" + array_of(b"{}", 650_000) + b"]",
    "giant-array-of-objects-exact": lambda: b"{" + EXACT + b'"y":[' + array_of(b"{}", 650_000) + b"]}",
    "giant-array-of-arrays-exact": lambda: b"{" + EXACT + b'"y":[' + array_of(b"[[]]", 390_000) + b"]}",
    "giant-array-of-members": lambda: b"[" + array_of(b'{"a":1}', 275_000) + b"]",
    "giant-messages": lambda: b'{"messages":[' + array_of(b"1", 950_000) + b"]}",
    "giant-prompt-array": lambda: b'{"prompt":[' + array_of(b"0", 950_000) + b"]}",
    "huge-string": lambda: b'{"prompt":"' + b"a" * 1_950_000 + b'"}',
    "huge-string-unterminated": lambda: b'{"prompt":"' + b"a" * 1_950_000,
    "huge-string-of-escapes": lambda: b'{"prompt":"' + b"\\u00e9" * 325_000 + b'"}',
    "huge-model-name": lambda: b'{"prompt":"a","model":"' + b"x" * 1_950_000 + b'"}',
    "many-keys": lambda: b"{" + b",".join(b'"k%d":0' % i for i in range(150_000)) + b"}",
}


def _status() -> tuple[int, int]:
    text = open("/proc/self/status").read()
    rss = int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) * 1024  # type: ignore[union-attr]
    hwm = int(re.search(r"VmHWM:\s+(\d+)", text).group(1)) * 1024  # type: ignore[union-attr]
    return rss, hwm


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def measure(name: str) -> dict[str, object]:
    body = BODIES[name]()
    gc.collect()
    if not _reset_peak():
        raise OSError("cannot reset VmHWM")
    before, _ = _status()
    started = time.process_time()
    try:
        check_request("/v1/completions", body, {"m"}, "m")
        status = 200
    except ContractError as exc:
        status = exc.status
    seconds = time.process_time() - started
    _, peak = _status()
    return {"name": name, "size": len(body), "peak": max(0, peak - before), "seconds": seconds, "status": status}


def main(argv: list[str]) -> int:
    names = argv or list(BODIES)
    if _reset_peak():
        for name in names:
            print(json.dumps(measure(name)), flush=True)
        return 0
    # No clear_refs: one fresh process per body, whose high-water mark starts low.
    for name in names:
        out = subprocess.run([sys.executable, "-m", __spec__.name, "--fresh", name],  # type: ignore[name-defined]
                             capture_output=True, check=True, timeout=120)
        sys.stdout.write(out.stdout.decode())
    return 0


def _fresh(name: str) -> None:
    body = BODIES[name]()
    gc.collect()
    before, _ = _status()
    started = time.process_time()
    try:
        check_request("/v1/completions", body, {"m"}, "m")
        status = 200
    except ContractError as exc:
        status = exc.status
    seconds = time.process_time() - started
    _, peak = _status()
    print(json.dumps({"name": name, "size": len(body), "peak": max(0, peak - before), "seconds": seconds,
                      "status": status}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fresh"]:
        _fresh(sys.argv[2])
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
