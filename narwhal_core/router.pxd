# Declarations for the compiled build of router.py (Cython reads this file;
# Python never does). Each class named here becomes an extension type whose
# fields are declared below, so that the router's methods, whose parameters
# are annotated with these classes, read and write the fields directly
# instead of looking them up by name. Every field is a Python object, as in
# the source. A field must be declared here to exist at all in the compiled
# build: tests/core/test_core_builds.py checks that these lists match the
# classes' __slots__ (and, for Router, what its methods assign to self).

cdef class _Conn:
    cdef public object handle, codec, peer_host, rid, read_deadline, timer, armed, closed, reading
    cdef public object body_phase, buffered, stalled

cdef class _Kv:
    cdef public object handoff, engine, leg, outcome, method, error, release_id, start_by

cdef class _Leg:
    cdef public object bid, phase, attempt, engine, codec, rid, started, data, deadline, timer, armed
    cdef public object status, body, outcome, ended, kv, open, streaming, got_bytes, fresh_retry, orphan
    cdef public object held, prompt

cdef class _Request:
    cdef public object rid, conn, route, client, client_rid, received, stream, accepted, state, attempts
    cdef public object failed_on, leg, legs, kv, pending_releases, admitted, answered, bytes_sent
    cdef public object first_byte, relay, retry_phase, pulled_cached_tokens, waiting_for_slot, terminal
    cdef public object status, error, usage, timers, plain_decode, prompts, prompt, answers, prompt_base

cdef class Router:
    cdef public object config, fleet, admission, stats
    cdef public object _auth, _auth_header, _buffered, _codec, _conns, _controls, _draining
    cdef public object _first_phase, _journal_ok, _journal_problem, _legs, _max_buffered, _mode, _model
    cdef public object _names, _no_kv_warned, _now, _out, _pd, _phases, _probe_seq, _probe_timers, _pump, _render_metrics, _requests
    cdef public object _request_timer_actions, _retry_after, _rid, _secret, _shortage_logged, _shortages, _shutdown_reported
    cdef public object _slot_waiters, _timers, _transitions, _wall_offset
