from cpython.object cimport PyObject
from libc.stdint cimport int64_t

from kvscope.agent.requests cimport RequestRecord, Ring


cdef struct _Slot:
    Py_hash_t hash
    PyObject *record  # owned; NULL: the slot is free (its key: the record's request_id)


cdef class _Index:
    cdef _Slot *_slots
    cdef Py_ssize_t _mask, _count

    cdef Py_ssize_t _find(self, object key, Py_hash_t hash) except? -2
    cdef RequestRecord get(self, object key)
    cdef RequestRecord put_new(self, RequestRecord record)
    cdef void replace(self, RequestRecord record)
    cdef void remove(self, RequestRecord record)
    cdef void _grow(self)


cdef class _Recent:
    cdef _Index by_id  # request id -> its newest record (linked to its older ones)
    cdef Ring order  # records in finish order (see _Recent in the .pyx)
    cdef Py_ssize_t count, capacity

    cdef RequestRecord newest(self, str request_id)
    cdef void _prefetch(self) noexcept
    cdef int add(self, RequestRecord record) except -1


cdef class _Requests:
    cdef dict inflight  # request id -> record, oldest first
    cdef _Recent recent
    cdef set unstarted
    cdef dict aborted  # request id -> None, oldest first


cdef class RequestAssembler:
    cdef dict _sources  # source -> _Requests
    cdef Py_ssize_t _max, _max_recent
    cdef public object joined
    cdef public object abandoned
    cdef set _bound_logged  # sources whose bound was logged
    cdef public dict amended

    cdef _Requests _tables(self, str source)
    cdef RequestRecord _find(self, str source, _Requests tables, str request_id, double ts)
    cdef RequestRecord _open(self, str source, _Requests tables, str request_id, double ts)
    cdef int _bound(self, str source, _Requests tables) except -1
    cdef int start(self, str source, _Requests tables, bint joined, object event) except -1
    cdef RequestRecord lookup(self, str source, _Requests tables, object event)
    cdef RequestRecord transfer(self, str source, _Requests tables, object rid, double ts,
                                object src, object dst, int64_t blocks, int64_t nbytes,
                                double duration, bint ok)
    cdef RequestRecord finish(self, str source, _Requests tables, bint joined, object event)
    cdef int abort(self, _Requests tables, object rid) except -1
    cpdef RequestRecord finished_recently(self, str source, str request_id, double ts,
                                          until=*)
