# Declarations for the compiled build of wire.py (Cython reads this file;
# Python never does): the byte scan every client body and prefill answer
# goes through, with C locals, so that its loops over the bytes run in C.

cimport cython

@cython.locals(run=Py_ssize_t, after=int, openers=Py_ssize_t, risky=int, c=cython.uchar, i=Py_ssize_t, n=Py_ssize_t,
               at=cython.p_uchar)
cpdef Py_ssize_t _scan_loop(bytes data)

@cython.locals(n=Py_ssize_t, near=Py_ssize_t, c=cython.uchar, quote=Py_ssize_t, k=Py_ssize_t, at=cython.p_uchar,
               plain=cython.bint)
cpdef Py_ssize_t _string_end(bytes data, Py_ssize_t i)
