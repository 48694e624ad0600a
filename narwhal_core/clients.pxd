# Declarations for the compiled build of clients.py (Cython reads this file;
# Python never does): each class named here is an extension type whose
# fields are declared below, so that the methods, whose parameters are
# annotated with these classes, read and write the fields directly. A field
# typed with a declared class (a part, a record) is read without a lookup.
# A field must be declared here to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__.

from narwhal_core.context cimport Context
from narwhal_core.requests cimport Requests
from narwhal_core.timers cimport Timer

cdef class Conn:
    cdef public Timer timer
    cdef public object handle, codec, peer_host, rid, read_deadline, armed, closed, reading, body_phase
    cdef public object buffered, stalled

cdef class Clients:
    cdef public Context ctx
    cdef public Requests requests
    cdef public object conns, pump, buffered, max_buffered, auth, metrics, retry_after, admin
