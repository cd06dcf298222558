from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint64_t, uint8_t


cdef struct Transfer:
    PyObject *src  # owned references to str (a tier's name)
    PyObject *dst
    int64_t blocks
    int64_t bytes
    double start
    double duration
    bint ok


cdef class RequestRecord:
    # first, beside the object's header in one cache line: what a finish and the eviction of
    # a recent record touch
    cdef readonly str request_id
    # the assembler's: the older record of the same request id it keeps, and whether a newer
    # one has superseded this one (see assembler._Recent)
    cdef RequestRecord _previous
    cdef Py_hash_t _id_hash  # hash(request_id), so that indexing the record reads no string
    cdef public double arrival
    cdef double _finished
    # the largest finish a RequestTable had been given when it last added this record: no
    # record at or before that place finished later (see RequestTable.page)
    cdef double _bound
    cdef int _in_table  # places it holds in a RequestTable's order (see RequestTable.add)
    cdef bint _superseded, _has_finished
    cdef public str source
    cdef str _trace_id  # None until read: then made from _tid (a trace id nobody reads costs nothing)
    cdef uint64_t _tid_hi, _tid_lo
    cdef double _ttft
    cdef bint _has_ttft
    cdef public double queueing, prefill, itl
    cdef double _lookup, _promotion_wait  # NaN: not measured (None in Python)
    cdef public int64_t prompt_tokens, output_tokens, transfers_omitted
    cdef int64_t _tokens[4]  # by TOKEN_SOURCES
    cdef uint8_t _tokens_set  # which of _tokens the record has (a lookup names some sources only)
    cdef dict _tokens_other  # any other source's tokens (None when there are none)
    cdef Transfer *_transfers  # NULL: the one in _first, when _ntransfers is 1
    cdef Py_ssize_t _ntransfers, _capacity
    cdef Transfer _first

    cdef void _clear_transfers(self)
    cdef int add_transfer(self, object src, object dst, int64_t blocks, int64_t nbytes,
                          double start, double duration, bint ok) except -1
    cdef int set_tokens(self, object tokens) except -1
    cdef void set_ttft(self, double ttft)
    cdef void set_finished(self, double finished)
    cdef void new_trace_id(self)


cdef class Ring:
    cdef list _items
    cdef Py_ssize_t _head

    cdef void push(self, object item)
    cdef object pop(self)
    cdef Py_ssize_t size(self)
    cdef object at(self, Py_ssize_t i)
    cdef PyObject *peek(self, Py_ssize_t ahead) noexcept
    cdef list values(self)
    cdef void replace(self, list items)


cdef RequestRecord new_record(str request_id, str source, double arrival)
cpdef bint under_way(RequestRecord record, double ts) except -1
cpdef bint within(RequestRecord record, double start, double end) except -1
cpdef double prefill_within(RequestRecord record) except? -1.0
cpdef double queueing_without_wait(double reported, double measured, double wait)
