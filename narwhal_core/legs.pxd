# Declarations for the compiled build of legs.py (Cython reads this file;
# Python never does): each class named here is an extension type whose
# fields are declared below, so that the methods, whose parameters are
# annotated with these classes, read and write the fields directly. A field
# typed with a declared class (a part, a record) is read without a lookup.
# A field must be declared here to exist at all in the compiled build:
# tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__.

from narwhal_core.answers cimport Answers
from narwhal_core.context cimport Context
from narwhal_core.kv cimport Kv
from narwhal_core.lifecycle cimport Lifecycle
from narwhal_core.requests cimport Request, Requests
from narwhal_core.slots cimport SlotQueue
from narwhal_core.timers cimport Timer

cdef class Leg:
    cdef public Kv kv
    cdef public Timer timer
    cdef public object bid, phase, attempt, engine, codec, rid, started, data, deadline, armed, status, body
    cdef public object outcome, ended, open, streaming, got_bytes, fresh_retry, orphan, held, prompt, tokens

cdef class Legs:
    cdef public Context ctx
    cdef public Requests requests
    cdef public Lifecycle lifecycle
    cdef public SlotQueue slots
    cdef public Answers answers
    cdef public object running, health
