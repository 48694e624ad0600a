# Declarations for the compiled build of fleet.py (Cython reads this file;
# Python never does): the fleet and admission bookkeeping as extension types,
# whose methods read and write their own fields directly. Every field is a
# Python object, as in the source, and must be declared here to exist at all
# in the compiled build: tests/core/test_core_builds.py checks that these
# lists match what the classes' methods assign to self.

cdef class Fleet:
    cdef public object engines, _max, _unhealthy_after, _healthy_after, _turn
    cdef public object _kv_static, _kv_addresses, _kv_loopback, _kv_refused

cdef class Admission:
    cdef public object max_inflight, queue_size, per_client_max, inflight, queue, per_client
