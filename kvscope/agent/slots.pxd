# Reading the fields of msgspec Structs (kvscope's events) from compiled code at C speed.
#
# msgspec keeps a Struct's fields as object slots after its header, each with a member
# descriptor on the type giving its offset (as __slots__ do): read through that offset, a field
# costs a pointer load instead of an attribute lookup. Callers check the event's exact type
# first; the offsets come from the type itself (offset_of), so a msgspec that laid fields out
# otherwise would fail at import with TypeError, never misread.

from cpython.object cimport PyObject
from libc.math cimport NAN
from libc.stdint cimport int64_t


cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    bint PyFloat_CheckExact(PyObject *)
    double PyFloat_AS_DOUBLE(PyObject *)
    bint PyLong_CheckExact(PyObject *)
    double PyFloat_AsDouble(object) except? -1.0
    int PyObject_IsTrue(PyObject *) except -1
    Py_ssize_t PyTuple_GET_SIZE(tuple)
    PyObject *PyTuple_GET_ITEM(tuple, Py_ssize_t)
    bint PyUnicode_Check(PyObject *)
    int PyUnicode_Compare(object, object) noexcept


cdef extern from "structmember.h":
    int T_OBJECT_EX


cdef inline Py_ssize_t offset_of(object cls, str name) except -1:
    """The offset of field ``name`` in instances of msgspec Struct ``cls``."""
    descriptor = getattr(cls, name)
    if (type(descriptor).__name__ != "member_descriptor"
            or (<PyMemberDescrObject *>descriptor).d_member.type != T_OBJECT_EX):
        raise TypeError(f"{cls.__name__}.{name} is not a slot: this msgspec lays out Structs "
                        "in a way kvscope's compiled fold does not know")
    return (<PyMemberDescrObject *>descriptor).d_member.offset


cdef inline PyObject *_at(object obj, Py_ssize_t offset):
    return (<PyObject **>(<char *><PyObject *>obj + offset))[0]


cdef inline object field(object obj, Py_ssize_t offset):
    """The field at ``offset`` (a new reference)."""
    return <object>_at(obj, offset)


cdef inline double float_field(object obj, Py_ssize_t offset) except? -1.0:
    """The float field at ``offset`` (an int in it, from an event made in Python, as float)."""
    cdef PyObject *value = _at(obj, offset)
    if PyFloat_CheckExact(value):
        return PyFloat_AS_DOUBLE(value)
    return PyFloat_AsDouble(<object>value)


cdef inline double optional_float_field(object obj, Py_ssize_t offset) except? -1.0:
    """The float field at ``offset``, NaN where it is None (not measured)."""
    if _at(obj, offset) == <PyObject *>None:
        return NAN
    return float_field(obj, offset)


cdef inline int64_t int_field(object obj, Py_ssize_t offset) except? -1:
    """The int field at ``offset`` (Cython's conversion reads a small int's digit in place)."""
    cdef object value = <object>_at(obj, offset)
    if PyLong_CheckExact(<PyObject *>value):
        return value
    return int(value)


cdef inline bint bool_field(object obj, Py_ssize_t offset) except -1:
    cdef PyObject *value = _at(obj, offset)
    if value == <PyObject *>True or value == <PyObject *>False:  # what msgspec decodes
        return value == <PyObject *>True
    return PyObject_IsTrue(value)


cdef inline int index_of(tuple names, object name) noexcept:
    """The index of ``name`` in ``names`` (of str), -1 when it is none of them. msgspec hands
    out the very str objects of the events' Literal types, so identity is tried first."""
    cdef Py_ssize_t i, n = PyTuple_GET_SIZE(names)
    for i in range(n):
        if PyTuple_GET_ITEM(names, i) == <PyObject *>name:
            return i
    if not PyUnicode_Check(<PyObject *>name):
        return -1
    for i in range(n):
        if PyUnicode_Compare(<object>PyTuple_GET_ITEM(names, i), name) == 0:
            return i
    return -1
