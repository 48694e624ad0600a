# Declarations for the compiled build of context.py (Cython reads this file;
# Python never does): each class named here is an extension type whose
# fields are declared below, so that the methods, whose parameters are
# annotated with these classes, read and write the fields directly. A field
# typed with a declared class (a part, a record) is read without a lookup.
# A field must be declared here to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__.

from narwhal_core.timers cimport Timers

cdef class Context:
    cdef public Timers timers
    cdef public object config, out, stats, fleet, admission, now, wall_offset, model, mode, pd, first_phase
    cdef public object phases, codec, new_rid, auth_header, secret, draining, journal_ok, journal_problem
    cdef public object shortages, shortage_logged, routing
