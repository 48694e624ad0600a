# Declarations for the compiled build of http/server.py (Cython reads this
# file; Python never does): the client connection as an extension type
# extending the reading half's, so that its methods read and write the
# fields directly. It declares only the field it adds (the others are in
# request_reader.pxd): tests/core/test_core_builds.py checks both lists.

from narwhal_core.http.request_reader cimport RequestReader

cdef class ServerConnection(RequestReader):
    cdef public object _framing
