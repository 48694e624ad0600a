# Declarations for the compiled build of http/request_reader.py (Cython reads
# this file; Python never does): the reading half of a client connection as
# an extension type, so that its methods read and write its own fields
# directly. Every field is a Python object, as in the source, and must be
# declared here to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that this list matches what the
# class's methods assign to self.

cdef class RequestReader:
    cdef public object _max_line, _max_header_bytes, _max_headers, _max_body, _max_buffered, _buf, _scan, _eof
    cdef public object _overflow, _state, _error, _memory, _close, _method, _target, _headers, _version
    cdef public object _keep_alive, _content_length, _chunked, _chunk_phase, _chunk_left, _trailer_bytes
    cdef public object _trailer_count, _body
