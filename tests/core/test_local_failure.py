"""``local_failure``: which failed connects are Narwhal's own shortage, whatever wraps them."""

from __future__ import annotations

import errno
import os

import pytest

from narwhal_core import local_failure


def _os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def _raised_from(outer: BaseException, cause: BaseException) -> BaseException:
    try:
        raise outer from cause
    except BaseException as exc:  # noqa: BLE001 - the test wants the raised object
        return exc


def _raised_during(outer: BaseException, context: BaseException) -> BaseException:
    try:
        try:
            raise context
        except BaseException:  # noqa: BLE001
            raise outer  # noqa: B904 - the implicit __context__ is the point
    except BaseException as exc:  # noqa: BLE001
        return exc


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL])
def test_local_errnos_are_local_in_every_wrapping(code: int) -> None:
    bare = _os_error(code)
    assert local_failure(bare)
    # control.connect_first: OSError("no address ... took the connection") from ExceptionGroup([...]).
    assert local_failure(_raised_from(OSError("all attempts to connect failed"),
                                      ExceptionGroup("attempts", [_os_error(code)])))
    # httpx: ConnectError raised while handling the OSError (its context), or from it.
    assert local_failure(_raised_during(RuntimeError("ConnectError"), _os_error(code)))
    assert local_failure(_raised_from(RuntimeError("ConnectError"), _os_error(code)))


@pytest.mark.parametrize("code", [errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ETIMEDOUT])
def test_engine_side_errnos_are_not_local(code: int) -> None:
    assert not local_failure(_os_error(code))
    assert not local_failure(_raised_from(OSError("all attempts to connect failed"),
                                          ExceptionGroup("attempts", [_os_error(code)])))
    assert not local_failure(_raised_during(RuntimeError("ConnectError"), _os_error(code)))
    assert not local_failure(TimeoutError())


def test_a_cycle_of_contexts_ends() -> None:
    a = RuntimeError("a")
    b = RuntimeError("b")
    a.__context__ = b
    b.__context__ = a
    assert not local_failure(a)
