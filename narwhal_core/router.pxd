# Declarations for the compiled build of router.py (Cython reads this file;
# Python never does). Each class named here becomes an extension type whose
# fields are declared below, so that the router's methods, whose parameters
# are annotated with these classes, read and write the fields directly
# instead of looking them up by name. Every field is a Python object, as in
# the source. A field must be declared here to exist at all in the compiled
# build: tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__ (and, for Router, what its methods assign to self).

cdef class Router:
    cdef public object config, fleet, admission, stats, clients, requests, lifecycle, legs, slots, kv, health
    cdef public object _ctx
