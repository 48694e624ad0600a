# Declarations for the compiled build of router.py (Cython reads this file;
# Python never does). Each class named here becomes an extension type whose
# fields are declared below, so that the router's methods, whose parameters
# are annotated with these classes, read and write the fields directly
# instead of looking them up by name. A field typed with a declared class
# (a part) is read without a lookup; the others are Python objects, as in
# the source. A field must be declared here to exist at all in the compiled
# build: tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__ (and, for Router, what its methods assign to self).

from narwhal_core.answers cimport Answers
from narwhal_core.clients cimport Clients
from narwhal_core.context cimport Context
from narwhal_core.kv cimport KvLedger
from narwhal_core.legs cimport Legs
from narwhal_core.lifecycle cimport Lifecycle
from narwhal_core.requests cimport Request, Requests
from narwhal_core.slots cimport SlotQueue

cdef class Router:
    cdef public Clients clients
    cdef public Requests requests
    cdef public Lifecycle lifecycle
    cdef public Legs legs
    cdef public Answers answers
    cdef public SlotQueue slots
    cdef public KvLedger kv
    cdef public Context _ctx
    cdef public object config, fleet, admission, stats, health, load, membership
