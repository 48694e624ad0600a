# Declarations for the compiled build of http/engine.py (Cython reads this
# file; Python never does): the engine exchange as an extension type, so
# that its methods read and write its own fields directly. Every field is a
# Python object, as in the source, and must be declared here to exist at all
# in the compiled build: tests/core/test_core_builds.py checks that this list
# matches the class's __slots__.

cdef class EngineConnection:
    cdef public object _max_header_bytes, _max_body, _max_unparsed, _buf, _unparsed, _scan, _eof, _overflow
    cdef public object _state, _error, _end, _head_request, _request_close, _keep_alive, _framing, _remaining
    cdef public object _chunk, _crlf_left, _received, _memory
