# Declarations for the compiled build of kv.py (Cython reads this file;
# Python never does): each class named here is an extension type whose
# fields are declared below, so that the methods, whose parameters are
# annotated with these classes, read and write the fields directly. A field
# typed with a declared class (a part, a record) is read without a lookup.
# A field must be declared here to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__.

from narwhal_core.context cimport Context
from narwhal_core.legs cimport Leg
from narwhal_core.requests cimport Request

cdef class Kv:
    cdef public object handoff, engine, leg, outcome, method, error, release_id, start_by

cdef class KvLedger:
    cdef public Context ctx
    cdef public object releases, warned_no_kv, release_settled
