# Declarations for the compiled build of relay.py (Cython reads this file;
# Python never does): the SSE relay, which runs for every relayed chunk, as
# an extension type whose methods read and write their own fields directly.
# Every field is a Python object, as in the source, and must be declared here
# to exist at all in the compiled build: tests/core/test_core_builds.py checks
# that this list matches the class's __slots__.

cdef class SseRelay:
    cdef public object route, model, pd, cached_tokens, redact, max_event_bytes, _buffer, _lines, _event_size
    cdef public object done, error, usage, events, good_before_error
    cdef public object index, last, response_id, prior_usage, _held, _drop
