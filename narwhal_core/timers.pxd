# Declarations for the compiled build of timers.py (Cython reads this file;
# Python never does): each class named here is an extension type whose
# fields are declared below, so that the methods, whose parameters are
# annotated with these classes, read and write the fields directly. A field
# typed with a declared class (a part, a record) is read without a lookup.
# A field must be declared here to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__.


cdef class Timer:
    cdef public object when, action, owner

cdef class Timers:
    cdef public object _heap, _seq, _compact_at
