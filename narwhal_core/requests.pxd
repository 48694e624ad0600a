# Declarations for the compiled build of requests.py (Cython reads this file;
# Python never does): each class named here is an extension type whose
# fields are declared below, so that the methods, whose parameters are
# annotated with these classes, read and write the fields directly. A field
# typed with a declared class (a part, a record) is read without a lookup.
# A field must be declared here to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__.

from narwhal_core.clients cimport Conn, Clients
from narwhal_core.context cimport Context
from narwhal_core.kv cimport Kv
from narwhal_core.legs cimport Leg
from narwhal_core.lifecycle cimport Lifecycle
from narwhal_core.slots cimport SlotQueue

cdef class Request:
    cdef public Conn conn
    cdef public Leg leg
    cdef public Kv kv
    cdef public object rid, route, client, client_rid, received, stream, accepted, state, attempts
    cdef public object failed_on, legs, pending_releases, admitted, answered, bytes_sent, first_byte, relay
    cdef public object retry_phase, pulled_cached_tokens, waiting_for_slot, terminal, status, error, usage
    cdef public object timers, plain_decode, prompts, prompt, answers, prompt_base, size, plan, trace
    cdef public object tokenizing

cdef class Requests:
    cdef public Context ctx
    cdef public Clients clients
    cdef public Lifecycle lifecycle
    cdef public SlotQueue slots
    cdef public object active, timer_actions, shutdown_reported
