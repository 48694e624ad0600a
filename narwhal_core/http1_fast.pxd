# Declarations for the compiled build of http1_fast.py (Cython reads this
# file; Python never does): the connections as extension types, so that
# their methods read and write their own fields directly. Every field is a
# Python object, as in the source, and must be declared here (or, for
# FastServerConnection, in http1.pxd) to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that these lists match the classes.

from narwhal_core.http1 cimport ServerConnection

cdef class FastServerConnection(ServerConnection):
    pass

cdef class FastEngineConnection:
    cdef public object _max_header_bytes, _max_body, _max_unparsed, _buf, _unparsed, _scan, _eof, _overflow
    cdef public object _state, _error, _end, _head_request, _request_close, _keep_alive, _framing, _remaining
    cdef public object _chunk, _crlf_left, _received
