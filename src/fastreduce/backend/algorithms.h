/* All-reduce algorithms composed from MPI calls, in place on host memory.
 *
 * Every algorithm computes each element's result on one rank and copies it to the others,
 * so every rank ends with the same bits. MPI moves every byte: these are schedules of
 * MPI_Isend/MPI_Irecv, MPI_Reduce_scatter_block, MPI_Allgather, MPI_Reduce and MPI_Bcast.
 *
 *   ring          reduce-scatter then all-gather around a ring of the ranks: each rank
 *                 sends and receives 2(P-1)/P of the message at once, so both directions
 *                 of every link stay busy; received pieces are combined while later pieces
 *                 arrive. With a 16-bit wire, float32 data is sent as float16/bfloat16 and
 *                 accumulated in float32.
 *   rsag          MPI_Reduce_scatter_block then MPI_Allgather (the MPI's own algorithms).
 *   hierarchical  where every node has the same number of ranks: MPI_Reduce_scatter
 *                 inside the node, the ring of each shard between the ranks with the
 *                 same local rank, MPI_Allgatherv inside the node (every rank works and
 *                 every pair of nodes has as many connections as ranks per node);
 *                 otherwise MPI_Reduce to one leader per node, the ring between the
 *                 leaders, MPI_Bcast inside the node.
 *   mpi, with a 16-bit wire: the data narrowed, MPI_Allreduce of the 16-bit values with
 *                 their reduction, widened back.
 */
#ifndef FASTREDUCE_ALGORITHMS_H
#define FASTREDUCE_ALGORITHMS_H

#include <limits.h>
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "halfops.h"

enum { FR_ALGO_MPI = 0, FR_ALGO_RING = 1, FR_ALGO_RSAG = 2, FR_ALGO_HIERARCHICAL = 3 };
enum { FR_WIRE_NONE = 0, FR_WIRE_F16 = 1, FR_WIRE_BF16 = 2 };
/* op codes as reductions.pxd numbers them */
enum { FR_OPC_SUM = 0, FR_OPC_PROD = 1, FR_OPC_MIN = 2, FR_OPC_MAX = 3, FR_OPC_AVG = 4 };

#define FR_MAX_PIECES 64

typedef struct {
  MPI_Datatype datatype; /* the data's elements */
  MPI_Op op;
  int itemsize;
  int wire;              /* FR_WIRE_*: float32 data sent as 16 bits */
  int opcode;            /* FR_OPC_*, for the float32 accumulation of a 16-bit wire */
  MPI_Datatype wire_datatype; /* how 16-bit values reduce inside MPI (mpi, rsag) */
  MPI_Op wire_op;
} fr_combine;

/* Block b of `count` elements split as evenly as possible into `parts` blocks. */
static inline int64_t fr_block_offset(int64_t count, int parts, int b)
{
  int64_t base = count / parts, rem = count % parts;
  return b * base + (b < rem ? b : rem);
}

static inline int64_t fr_block_length(int64_t count, int parts, int b)
{
  return count / parts + (b < count % parts ? 1 : 0);
}

static void fr_narrow(const float *src, uint16_t *dst, int64_t n, int wire)
{
  int64_t i;
  if (wire == FR_WIRE_BF16)
    for (i = 0; i < n; i++) dst[i] = fr_f32_to_bf16(src[i]);
  else
    for (i = 0; i < n; i++) dst[i] = fr_f32_to_f16(src[i]);
}

static void fr_widen(const uint16_t *src, float *dst, int64_t n, int wire)
{
  int64_t i;
  if (wire == FR_WIRE_BF16)
    for (i = 0; i < n; i++) dst[i] = fr_bf16_to_f32(src[i]);
  else
    for (i = 0; i < n; i++) dst[i] = fr_f16_to_f32(src[i]);
}

/* data[i] = widen(narrow(data[i])): the values a 16-bit wire carries. */
static void fr_round_through_wire(float *data, int64_t n, int wire)
{
  int64_t i;
  if (wire == FR_WIRE_BF16)
    for (i = 0; i < n; i++) data[i] = fr_bf16_to_f32(fr_f32_to_bf16(data[i]));
  else
    for (i = 0; i < n; i++) data[i] = fr_f16_to_f32(fr_f32_to_f16(data[i]));
}

/* inout[i] = op(inout[i], widen(in[i])): a 16-bit wire accumulated in float32.
 * Widened a block at a time, so that each loop is branch-free and vectorises. */
static void fr_accumulate_wire(const uint16_t *in, float *inout, int64_t n, int wire, int opcode)
{
  float widened[1024];
  int64_t start, i, m;
  for (start = 0; start < n; start += m) {
    m = n - start < 1024 ? n - start : 1024;
    fr_widen(in + start, widened, m, wire);
    float *out = inout + start;
    switch (opcode) {
      case FR_OPC_PROD: for (i = 0; i < m; i++) out[i] *= widened[i]; break;
      case FR_OPC_MIN: for (i = 0; i < m; i++) out[i] = fr_min_f32(out[i], widened[i]); break;
      case FR_OPC_MAX: for (i = 0; i < m; i++) out[i] = fr_max_f32(out[i], widened[i]); break;
      default: for (i = 0; i < m; i++) out[i] += widened[i]; break;
    }
  }
}

/* Combine `n` received elements into the data: the MPI's op, or float32 for a 16-bit wire. */
static int fr_combine_into(const fr_combine *c, const char *received, char *data, int64_t n)
{
  if (c->wire != FR_WIRE_NONE) {
    fr_accumulate_wire((const uint16_t *)received, (float *)data, n, c->wire, c->opcode);
    return MPI_SUCCESS;
  }
  return MPI_Reduce_local(received, data, (int)n, c->datatype, c->op);
}

/* Elements per message piece: at least piece_bytes (0: the whole block), at most
 * FR_MAX_PIECES per block and never above INT_MAX. */
static int64_t fr_piece(int64_t block, int wire_size, int64_t piece_bytes)
{
  int64_t piece = piece_bytes > 0 ? piece_bytes / wire_size : block;
  int64_t fewest = (block + FR_MAX_PIECES - 1) / FR_MAX_PIECES;
  if (piece < fewest) piece = fewest;
  if (piece < 1) piece = 1;
  if (piece > INT_MAX) piece = INT_MAX;
  /* a block over FR_MAX_PIECES x INT_MAX elements would need more pieces than requests */
  if ((block + piece - 1) / piece > FR_MAX_PIECES) piece = (block + FR_MAX_PIECES - 1) / FR_MAX_PIECES;
  return piece;
}

/* One ring step: send block `sb` (already in wire form at `out`) to the right, receive
 * block `rb` from the left into `in`, each in pieces; `combine` decides what is done with
 * each received piece (reduce it into the data, widen it, or nothing when `in` is the
 * data itself). */
static int fr_ring_step(const fr_combine *c, const char *out, int64_t sendn, char *in,
                        int64_t recvn, char *data, int combine, int left, int right,
                        MPI_Comm comm, int64_t piece_bytes)
{
  MPI_Request sends[FR_MAX_PIECES], recvs[FR_MAX_PIECES];
  int wsize = c->wire != FR_WIRE_NONE ? 2 : c->itemsize;
  MPI_Datatype wtype = c->wire != FR_WIRE_NONE ? MPI_UINT16_T : c->datatype;
  int64_t rpiece = fr_piece(recvn, wsize, piece_bytes), spiece = fr_piece(sendn, wsize, piece_bytes);
  int nr = 0, ns = 0, k, ierr = MPI_SUCCESS, err2;
  int64_t off, n;
  /* nr, ns count only the requests MPI started: a failed call leaves its handle undefined */
  for (off = 0; off < recvn && ierr == MPI_SUCCESS; off += rpiece) {
    n = recvn - off < rpiece ? recvn - off : rpiece;
    ierr = MPI_Irecv(in + off * wsize, (int)n, wtype, left, 0, comm, &recvs[nr]);
    if (ierr == MPI_SUCCESS) nr++;
  }
  for (off = 0; off < sendn && ierr == MPI_SUCCESS; off += spiece) {
    n = sendn - off < spiece ? sendn - off : spiece;
    ierr = MPI_Isend(out + off * wsize, (int)n, wtype, right, 0, comm, &sends[ns]);
    if (ierr == MPI_SUCCESS) ns++;
  }
  if (ierr != MPI_SUCCESS) {  /* nothing may still write into `in` once we return */
    for (k = 0; k < nr; k++) MPI_Cancel(&recvs[k]);
    MPI_Waitall(nr, recvs, MPI_STATUSES_IGNORE);
    MPI_Waitall(ns, sends, MPI_STATUSES_IGNORE);
    return ierr;
  }
  for (k = 0, off = 0; k < nr; k++, off += rpiece) {
    n = recvn - off < rpiece ? recvn - off : rpiece;
    err2 = MPI_Wait(&recvs[k], MPI_STATUS_IGNORE);
    if (err2 != MPI_SUCCESS) { ierr = err2; continue; }
    if (ierr != MPI_SUCCESS) continue;
    if (combine == 1)
      ierr = fr_combine_into(c, in + off * wsize, data + off * c->itemsize, n);
    else if (combine == 2)
      fr_widen((const uint16_t *)(in + off * wsize), (float *)(data + off * c->itemsize), n, c->wire);
  }
  err2 = MPI_Waitall(ns, sends, MPI_STATUSES_IGNORE);
  return ierr != MPI_SUCCESS ? ierr : err2;
}

/* Ring all-reduce of `count` elements of `buf` over comm, in place. */
static int fr_ring_allreduce(char *buf, int64_t count, const fr_combine *c, MPI_Comm comm,
                             int64_t piece_bytes)
{
  int size, rank, s, sb, rb, left, right, ierr;
  int wire = c->wire != FR_WIRE_NONE;
  int wsize = wire ? 2 : c->itemsize;
  int64_t isz = c->itemsize, biggest, ob, n;
  char *scratch, *out;
  if ((ierr = MPI_Comm_size(comm, &size)) != MPI_SUCCESS) return ierr;
  if ((ierr = MPI_Comm_rank(comm, &rank)) != MPI_SUCCESS) return ierr;
  if (count == 0) return MPI_SUCCESS;
  if (size == 1) {  /* alone: a 16-bit wire still rounds, as it does with others */
    if (wire) fr_round_through_wire((float *)buf, count, c->wire);
    return MPI_SUCCESS;
  }
  left = (rank + size - 1) % size;
  right = (rank + 1) % size;
  biggest = count / size + 1;
  /* received pieces; with a 16-bit wire also the narrowed block being sent */
  scratch = (char *)malloc((size_t)biggest * wsize * (wire ? 2 : 1));
  if (scratch == NULL) return MPI_ERR_NO_MEM;
  out = scratch + biggest * wsize;
  /* reduce-scatter: after step s, rank r holds s+2 contributions of block r-s-1 */
  for (s = 0; s < size - 1 && ierr == MPI_SUCCESS; s++) {
    sb = ((rank - s) % size + size) % size;
    rb = ((rank - s - 1) % size + size) % size;
    n = fr_block_length(count, size, sb);
    if (wire)
      fr_narrow((const float *)(buf + fr_block_offset(count, size, sb) * isz), (uint16_t *)out, n, c->wire);
    ierr = fr_ring_step(c, wire ? out : buf + fr_block_offset(count, size, sb) * isz, n,
                        scratch, fr_block_length(count, size, rb),
                        buf + fr_block_offset(count, size, rb) * isz, 1, left, right, comm,
                        piece_bytes);
  }
  /* the block this rank completed; with a 16-bit wire it keeps what the others receive */
  ob = (rank + 1) % size;
  if (wire && ierr == MPI_SUCCESS)
    fr_round_through_wire((float *)(buf + fr_block_offset(count, size, (int)ob) * isz),
                          fr_block_length(count, size, (int)ob), c->wire);
  /* all-gather: each completed block travels once around the ring */
  for (s = 0; s < size - 1 && ierr == MPI_SUCCESS; s++) {
    sb = ((rank + 1 - s) % size + size) % size;
    rb = ((rank - s) % size + size) % size;
    n = fr_block_length(count, size, sb);
    if (wire) {
      fr_narrow((const float *)(buf + fr_block_offset(count, size, sb) * isz), (uint16_t *)out, n, c->wire);
      ierr = fr_ring_step(c, out, n, scratch, fr_block_length(count, size, rb),
                          buf + fr_block_offset(count, size, rb) * isz, 2, left, right, comm,
                          piece_bytes);
    } else {
      ierr = fr_ring_step(c, buf + fr_block_offset(count, size, sb) * isz, n,
                          buf + fr_block_offset(count, size, rb) * isz,
                          fr_block_length(count, size, rb), NULL, 0, left, right, comm,
                          piece_bytes);
    }
  }
  free(scratch);
  return ierr;
}

/* MPI_Allreduce in place in int-sized pieces. */
static int fr_mpi_allreduce(char *buf, int64_t count, MPI_Datatype datatype, MPI_Op op,
                            int itemsize, MPI_Comm comm)
{
  int64_t off, n;
  int ierr = MPI_SUCCESS;
  for (off = 0; off < count && ierr == MPI_SUCCESS; off += n) {
    n = count - off < INT_MAX ? count - off : INT_MAX;
    ierr = MPI_Allreduce(MPI_IN_PLACE, buf + off * itemsize, (int)n, datatype, op, comm);
  }
  return ierr;
}

/* MPI_Reduce_scatter_block then MPI_Allgather, in place; the last count % P elements by
 * MPI_Allreduce. */
static int fr_rsag_allreduce(char *buf, int64_t count, MPI_Datatype datatype, MPI_Op op,
                             int itemsize, MPI_Comm comm)
{
  int size, rank, ierr;
  int64_t block, done = 0, b;
  char *region;
  if ((ierr = MPI_Comm_size(comm, &size)) != MPI_SUCCESS) return ierr;
  if ((ierr = MPI_Comm_rank(comm, &rank)) != MPI_SUCCESS) return ierr;
  if (size == 1 || count == 0) return MPI_SUCCESS;
  block = count / size;
  while (done < block && ierr == MPI_SUCCESS) {
    b = block - done < INT_MAX / size ? block - done : INT_MAX / size;  /* b * size fits */
    region = buf + done * size * itemsize;
    ierr = MPI_Reduce_scatter_block(MPI_IN_PLACE, region, (int)b, datatype, op, comm);
    if (ierr != MPI_SUCCESS) break;
    /* the result is at the start of the region; the all-gather wants it at this rank's place */
    memmove(region + rank * b * itemsize, region, (size_t)(b * itemsize));
    ierr = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, region, (int)b, datatype, comm);
    done += b;
  }
  if (ierr == MPI_SUCCESS && count > block * size)
    ierr = fr_mpi_allreduce(buf + block * size * itemsize, count - block * size, datatype, op,
                            itemsize, comm);
  return ierr;
}

/* Reduce to the node's leader, ring between the leaders (leaders: MPI_COMM_NULL on the
 * other ranks), broadcast inside the node. */
static int fr_hierarchical_allreduce(char *buf, int64_t count, const fr_combine *c,
                                     MPI_Comm local, MPI_Comm leaders, int64_t piece_bytes)
{
  int local_rank, local_size, ierr;
  int64_t off, n;
  if ((ierr = MPI_Comm_rank(local, &local_rank)) != MPI_SUCCESS) return ierr;
  if ((ierr = MPI_Comm_size(local, &local_size)) != MPI_SUCCESS) return ierr;
  for (off = 0; off < count && ierr == MPI_SUCCESS && local_size > 1; off += n) {
    n = count - off < INT_MAX ? count - off : INT_MAX;
    ierr = MPI_Reduce(local_rank == 0 ? MPI_IN_PLACE : buf + off * c->itemsize,
                      buf + off * c->itemsize, (int)n, c->datatype, c->op, 0, local);
  }
  if (ierr == MPI_SUCCESS && leaders != MPI_COMM_NULL)
    ierr = fr_ring_allreduce(buf, count, c, leaders, piece_bytes);
  for (off = 0; off < count && ierr == MPI_SUCCESS && local_size > 1; off += n) {
    n = count - off < INT_MAX ? count - off : INT_MAX;
    ierr = MPI_Bcast(buf + off * c->itemsize, (int)n, c->datatype, 0, local);
  }
  return ierr;
}

/* Every local rank owns a shard: reduce-scatter inside the node, the ring of each shard
 * between the ranks of the same local rank on every node (cross), all-gather inside the
 * node. Every node must have the same number of ranks. */
static int fr_sharded_allreduce(char *buf, int64_t count, const fr_combine *c, MPI_Comm local,
                                MPI_Comm cross, int64_t piece_bytes)
{
  int local_rank, local_size, ierr, i;
  int *counts, *displs;
  int64_t isz = c->itemsize, off, len;
  if ((ierr = MPI_Comm_rank(local, &local_rank)) != MPI_SUCCESS) return ierr;
  if ((ierr = MPI_Comm_size(local, &local_size)) != MPI_SUCCESS) return ierr;
  counts = (int *)malloc(2 * sizeof(int) * (size_t)local_size);
  if (counts == NULL) return MPI_ERR_NO_MEM;
  displs = counts + local_size;
  for (i = 0; i < local_size; i++) {
    counts[i] = (int)fr_block_length(count, local_size, i);
    displs[i] = (int)fr_block_offset(count, local_size, i);
  }
  off = fr_block_offset(count, local_size, local_rank);
  len = fr_block_length(count, local_size, local_rank);
  ierr = MPI_Reduce_scatter(MPI_IN_PLACE, buf, counts, c->datatype, c->op, local);
  if (ierr == MPI_SUCCESS) {
    /* the shard arrives at the start of buf; the all-gather wants it at its place */
    memmove(buf + off * isz, buf, (size_t)(len * isz));
    ierr = fr_ring_allreduce(buf + off * isz, len, c, cross, piece_bytes);
  }
  if (ierr == MPI_SUCCESS)
    ierr = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts, displs,
                          c->datatype, local);
  free(counts);
  return ierr;
}

/* mpi or rsag with a 16-bit wire: narrow, reduce the 16-bit values, widen. */
static int fr_wire_allreduce(char *buf, int64_t count, const fr_combine *c, MPI_Comm comm,
                             int algorithm)
{
  int ierr;
  uint16_t *half = (uint16_t *)malloc((size_t)(count > 0 ? count : 1) * 2);
  if (half == NULL) return MPI_ERR_NO_MEM;
  fr_narrow((const float *)buf, half, count, c->wire);
  if (algorithm == FR_ALGO_RSAG)
    ierr = fr_rsag_allreduce((char *)half, count, c->wire_datatype, c->wire_op, 2, comm);
  else
    ierr = fr_mpi_allreduce((char *)half, count, c->wire_datatype, c->wire_op, 2, comm);
  if (ierr == MPI_SUCCESS) fr_widen(half, (float *)buf, count, c->wire);
  free(half);
  return ierr;
}

/* The all-reduce of `count` elements of buf, in place, by `algorithm` (not plain mpi
 * without a wire: the caller segments that one itself). */
static int fr_allreduce_by(int algorithm, char *buf, int64_t count, const fr_combine *c,
                           MPI_Comm comm, MPI_Comm local, MPI_Comm leaders, MPI_Comm cross,
                           int64_t piece_bytes)
{
  int local_size = 1;
  switch (algorithm) {
    case FR_ALGO_RING:
      return fr_ring_allreduce(buf, count, c, comm, piece_bytes);
    case FR_ALGO_HIERARCHICAL:
      if (local == MPI_COMM_NULL) return fr_ring_allreduce(buf, count, c, comm, piece_bytes);
      if (cross != MPI_COMM_NULL && MPI_Comm_size(local, &local_size) == MPI_SUCCESS
          && count >= local_size && count <= INT_MAX)  /* int counts and displacements */
        return fr_sharded_allreduce(buf, count, c, local, cross, piece_bytes);
      return fr_hierarchical_allreduce(buf, count, c, local, leaders, piece_bytes);
    case FR_ALGO_RSAG:
      if (c->wire != FR_WIRE_NONE) return fr_wire_allreduce(buf, count, c, comm, FR_ALGO_RSAG);
      return fr_rsag_allreduce(buf, count, c->datatype, c->op, c->itemsize, comm);
    default:
      if (c->wire != FR_WIRE_NONE) return fr_wire_allreduce(buf, count, c, comm, FR_ALGO_MPI);
      return fr_mpi_allreduce(buf, count, c->datatype, c->op, c->itemsize, comm);
  }
}

#endif
