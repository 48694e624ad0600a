# Declarations for the compiled build of http1.py (Cython reads this file;
# Python never does): the reference codec's connections as extension types,
# so that their methods read and write their own fields directly (and
# http1_fast's client-side connection, which extends ServerConnection).
# Every field is a Python object, as in the source, and must be declared
# here to exist at all in the compiled build: tests/core/test_core_builds.py
# checks that these lists match what the classes' methods assign to self.

cdef class ServerConnection:
    cdef public object _max_line, _max_header_bytes, _max_headers, _max_body, _max_buffered, _buf, _scan, _eof
    cdef public object _overflow, _state, _error, _close, _method, _target, _headers, _version, _keep_alive
    cdef public object _content_length, _chunked, _chunk_phase, _chunk_left, _trailer_bytes, _trailer_count
    cdef public object _body, _framing

cdef class EngineConnection:
    cdef public object _max_header_bytes, _max_body, _max_unparsed, _h11, _fed, _unparsed, _eof, _overflow
    cdef public object _state, _error, _end, _head_request, _head_start, _close_delimited, _received
