"""Python values kept in communicator attributes, freed by a delete callback written in C.

A keyval made here (`create_keyval(on_delete)`) holds one Python value per communicator;
when the communicator is freed, or the value replaced, `on_delete(value)` runs, given the
value only. mpi4py's own attribute callbacks (`Comm.Create_keyval(delete_fn=...)`) cannot
be used for this: they hand the Python function an mpi4py object for the communicator
being freed, and making that object asks MPI for the communicator's topology
(MPI_Topo_test) in the middle of MPI_Comm_free. MPICH answers it by walking the
communicator's attribute list while it is freeing that list node by node: it reads the
nodes it has already freed, and ends in a segmentation fault when its pool of attribute
objects was full at that moment (a freed node then points nowhere). The callback here makes
no MPI call on the communicator being freed.
"""

from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from mpi4py cimport MPI

from .libmpi cimport *
from .mpierrors cimport CHKERR

cdef extern from "Python.h":
    int Py_IsInitialized() nogil

cdef list _on_delete = []  # each keyval's callable, kept alive: MPI holds a bare pointer


cdef void _call(object on_delete, object value) noexcept:
    on_delete(value)  # an exception is reported as unraisable: MPI_Comm_free goes on


cdef int _delete(MPI_Comm comm, int keyval, void* value, void* extra) noexcept nogil:
    if not Py_IsInitialized():  # freed at MPI_Finalize after Python's end: leave it
        return MPI_SUCCESS
    with gil:
        _call(<object>extra, <object>value)
        Py_XDECREF(<PyObject*>value)  # the reference set_attr took
    return MPI_SUCCESS


def create_keyval(on_delete) -> int:
    """A communicator keyval whose values are Python objects; `on_delete(value)` runs when
    a communicator carrying one is freed (or the value is replaced). Not copied by
    MPI_Comm_dup."""
    if not callable(on_delete):
        raise TypeError(f"fastreduce: on_delete must be callable, not {on_delete!r}")
    cdef int keyval = MPI_KEYVAL_INVALID
    CHKERR(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, _delete, &keyval,
                                  <void*>on_delete))
    _on_delete.append(on_delete)
    return keyval


def get_attr(comm, int keyval):
    """The value comm holds for keyval, or None."""
    cdef void* value = NULL
    cdef int found = 0
    CHKERR(MPI_Comm_get_attr((<MPI.Comm?>comm).ob_mpi, keyval, &value, &found))
    if not found or value == NULL:
        return None
    return <object>value


def set_attr(comm, int keyval, value) -> None:
    """Attach value to comm under keyval (a value it held before goes to on_delete)."""
    Py_INCREF(value)  # the attribute's reference, dropped by _delete
    cdef int ierr = MPI_Comm_set_attr((<MPI.Comm?>comm).ob_mpi, keyval, <void*>value)
    if ierr != MPI_SUCCESS:
        Py_XDECREF(<PyObject*>value)
        CHKERR(ierr)
