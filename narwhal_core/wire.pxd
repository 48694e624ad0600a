# Declarations for the compiled build of wire.py (Cython reads this file;
# Python never does): the byte scan every client body and prefill answer
# goes through, with C locals, so that its loop over the bytes runs in C.

cimport cython

@cython.locals(run=Py_ssize_t, after=int, openers=Py_ssize_t, risky=int, c=cython.uchar)
cpdef Py_ssize_t _scan_loop(bytes data)
