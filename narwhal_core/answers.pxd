# Declarations for the compiled build of answers.py (Cython reads this file;
# Python never does): each class named here is an extension type whose
# fields are declared below, so that the methods, whose parameters are
# annotated with these classes, read and write the fields directly. A field
# typed with a declared class (a part, a record) is read without a lookup.
# A field must be declared here to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__.

from narwhal_core.context cimport Context
from narwhal_core.kv cimport KvLedger
from narwhal_core.legs cimport Leg, Legs
from narwhal_core.lifecycle cimport Lifecycle
from narwhal_core.requests cimport Request, Requests
from narwhal_core.slots cimport SlotQueue

cdef class Answers:
    cdef public Context ctx
    cdef public Legs legs
    cdef public Requests requests
    cdef public Lifecycle lifecycle
    cdef public KvLedger kv
    cdef public SlotQueue slots
    cdef public object health
