# The part of the MPI C API fastreduce calls, declared nogil (as in mpi4py's
# libmpi.pxd), plus the compatibility layer of _mpicompat.h.

cdef extern from "mpicompat.h" nogil:
    ctypedef long long MPI_Count
    ctypedef struct _mpi_comm_t
    ctypedef _mpi_comm_t* MPI_Comm
    ctypedef struct _mpi_datatype_t
    ctypedef _mpi_datatype_t* MPI_Datatype
    ctypedef struct _mpi_op_t
    ctypedef _mpi_op_t* MPI_Op
    ctypedef struct _mpi_errhandler_t
    ctypedef _mpi_errhandler_t* MPI_Errhandler

    ctypedef struct _mpi_request_t
    ctypedef _mpi_request_t* MPI_Request
    ctypedef struct _mpi_message_t
    ctypedef _mpi_message_t* MPI_Message
    ctypedef struct MPI_Status:
        int MPI_SOURCE
        int MPI_TAG
        int MPI_ERROR

    ctypedef int MPI_Fint
    ctypedef void MPI_User_function(void*, void*, int*, MPI_Datatype*) noexcept
    ctypedef int MPI_Comm_copy_attr_function(MPI_Comm, int, void*, void*, void*, int*) noexcept
    ctypedef int MPI_Comm_delete_attr_function(MPI_Comm, int, void*, void*) noexcept

    enum: MPI_SUCCESS
    enum: MPI_ERR_COUNT
    enum: MPI_ERR_OTHER
    enum: MPI_MAX_LIBRARY_VERSION_STRING
    enum: MPI_KEYVAL_INVALID
    enum: MPI_ANY_SOURCE
    enum: MPI_ANY_TAG
    enum: MPI_PROC_NULL
    MPI_Comm_copy_attr_function* MPI_COMM_NULL_COPY_FN

    void* MPI_IN_PLACE
    MPI_Comm MPI_COMM_NULL
    MPI_Comm MPI_COMM_SELF
    MPI_Errhandler MPI_ERRORS_RETURN
    MPI_Request MPI_REQUEST_NULL
    MPI_Message MPI_MESSAGE_NULL
    MPI_Status* MPI_STATUS_IGNORE
    MPI_Status* MPI_STATUSES_IGNORE

    MPI_Datatype MPI_DATATYPE_NULL
    MPI_Datatype MPI_BYTE
    MPI_Datatype MPI_C_BOOL
    MPI_Datatype MPI_INT8_T
    MPI_Datatype MPI_INT16_T
    MPI_Datatype MPI_INT32_T
    MPI_Datatype MPI_INT64_T
    MPI_Datatype MPI_UINT8_T
    MPI_Datatype MPI_UINT16_T
    MPI_Datatype MPI_UINT32_T
    MPI_Datatype MPI_UINT64_T
    MPI_Datatype MPI_FLOAT
    MPI_Datatype MPI_DOUBLE
    MPI_Datatype MPI_C_FLOAT_COMPLEX
    MPI_Datatype MPI_C_DOUBLE_COMPLEX

    MPI_Op MPI_OP_NULL
    MPI_Op MPI_SUM
    MPI_Op MPI_PROD
    MPI_Op MPI_MIN
    MPI_Op MPI_MAX
    MPI_Op MPI_BAND
    MPI_Op MPI_BOR
    MPI_Op MPI_BXOR
    MPI_Op MPI_LAND
    MPI_Op MPI_LOR
    MPI_Op MPI_LXOR

    int MPI_Initialized(int*)
    int MPI_Finalized(int*)
    int MPI_Get_library_version(char*, int*)
    int MPI_Comm_size(MPI_Comm, int*)
    int MPI_Comm_rank(MPI_Comm, int*)
    int MPI_Comm_test_inter(MPI_Comm, int*)
    int MPI_Comm_free(MPI_Comm*)
    MPI_Fint MPI_Comm_c2f(MPI_Comm)
    MPI_Comm MPI_Comm_f2c(MPI_Fint)
    int MPI_Comm_set_errhandler(MPI_Comm, MPI_Errhandler)
    int MPI_Comm_create_keyval(MPI_Comm_copy_attr_function*, MPI_Comm_delete_attr_function*,
                               int*, void*)
    int MPI_Comm_get_attr(MPI_Comm, int, void*, int*)
    int MPI_Comm_set_attr(MPI_Comm, int, void*)
    int MPI_Op_create(MPI_User_function*, int, MPI_Op*)
    int MPI_Op_free(MPI_Op*)
    int MPI_Reduce_local(const void*, void*, int, MPI_Datatype, MPI_Op)
    int MPI_Allreduce(const void*, void*, int, MPI_Datatype, MPI_Op, MPI_Comm)
    int MPI_Iallgather(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, MPI_Comm,
                       MPI_Request*)
    int MPI_Iallreduce(const void*, void*, int, MPI_Datatype, MPI_Op, MPI_Comm, MPI_Request*)
    int MPI_Waitall(int, MPI_Request*, MPI_Status*)
    int MPI_Wait(MPI_Request*, MPI_Status*)
    int MPI_Cancel(MPI_Request*)
    int MPI_Test(MPI_Request*, int*, MPI_Status*)
    int MPI_Type_contiguous(int, MPI_Datatype, MPI_Datatype*)
    int MPI_Type_commit(MPI_Datatype*)

    # data movement (backend/coll_movement.pxi)
    int MPI_Bcast(void*, int, MPI_Datatype, int, MPI_Comm)
    int MPI_Reduce(const void*, void*, int, MPI_Datatype, MPI_Op, int, MPI_Comm)
    int MPI_Allgather(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, MPI_Comm)
    int MPI_Allgatherv(const void*, int, MPI_Datatype, void*, const int*, const int*,
                       MPI_Datatype, MPI_Comm)
    int MPI_Reduce_scatter_block(const void*, void*, int, MPI_Datatype, MPI_Op, MPI_Comm)
    int MPI_Reduce_scatter(const void*, void*, const int*, MPI_Datatype, MPI_Op, MPI_Comm)
    int MPI_Alltoall(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, MPI_Comm)
    int MPI_Alltoallv(const void*, const int*, const int*, MPI_Datatype, void*, const int*,
                      const int*, MPI_Datatype, MPI_Comm)
    int MPI_Gather(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, int, MPI_Comm)
    int MPI_Scatter(const void*, int, MPI_Datatype, void*, int, MPI_Datatype, int, MPI_Comm)
    int MPI_Send(const void*, int, MPI_Datatype, int, int, MPI_Comm)
    int MPI_Recv(void*, int, MPI_Datatype, int, int, MPI_Comm, MPI_Status*)
    int MPI_Isend(const void*, int, MPI_Datatype, int, int, MPI_Comm, MPI_Request*)
    int MPI_Irecv(void*, int, MPI_Datatype, int, int, MPI_Comm, MPI_Request*)
    int MPI_Get_count(const MPI_Status*, MPI_Datatype, int*)
    int MPI_Mprobe(int, int, MPI_Comm, MPI_Message*, MPI_Status*)
    int MPI_Mrecv(void*, int, MPI_Datatype, MPI_Message*, MPI_Status*)
    int MPI_Testall(int, MPI_Request*, int*, MPI_Status*)

    # _mpicompat.h
    int fr_have_large_count() nogil
    const char* FR_MPI_FAMILY
    const char* FR_MPI_BUILD_VERSION
    MPI_Datatype FR_MPIX_FLOAT16
    MPI_Datatype FR_MPIX_BFLOAT16
    int fr_allreduce_large(const void*, void*, MPI_Count, MPI_Datatype, MPI_Op, MPI_Comm)
    int fr_iallreduce_large(const void*, void*, MPI_Count, MPI_Datatype, MPI_Op, MPI_Comm,
                            MPI_Request*)
