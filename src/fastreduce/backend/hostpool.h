/* A small cache of page-aligned host blocks for out-of-place results.
 *
 * A fresh multi-megabyte allocation costs one page fault per 4 KiB page when
 * MPI first writes it, which halves the bandwidth of an out-of-place
 * all-reduce. Results above FR_POOL_MIN_BYTES are therefore carved from blocks
 * that come back here when the framework frees the tensor (the DLPack deleter
 * runs on whatever thread drops the last reference, without the GIL, hence the
 * mutex). At most `fr_pool_limit` bytes are kept; the rest goes back to libc.
 */
#ifndef FASTREDUCE_HOSTPOOL_H
#define FASTREDUCE_HOSTPOOL_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define FR_POOL_SLOTS 64
#define FR_POOL_ALIGN 4096
#define FR_POOL_MIN_BYTES (128 * 1024)

typedef struct { void *ptr; size_t size; } fr_pool_slot;

static pthread_mutex_t fr_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static fr_pool_slot fr_pool_slots[FR_POOL_SLOTS];
static size_t fr_pool_cached = 0;                 /* bytes held in free slots */
static size_t fr_pool_limit = (size_t)256 << 20;  /* most bytes to keep */
static uint64_t fr_pool_hits = 0, fr_pool_misses = 0;

static inline size_t fr_pool_round(size_t nbytes)
{
  return (nbytes + FR_POOL_ALIGN - 1) / FR_POOL_ALIGN * FR_POOL_ALIGN;
}

/* A block of at least `nbytes` (its rounded size in *size), or NULL. */
static void *fr_pool_take(size_t nbytes, size_t *size)
{
  void *ptr = NULL;
  *size = fr_pool_round(nbytes ? nbytes : 1);
  pthread_mutex_lock(&fr_pool_lock);
  for (int i = 0; i < FR_POOL_SLOTS; i++) {
    if (fr_pool_slots[i].ptr && fr_pool_slots[i].size == *size) {
      ptr = fr_pool_slots[i].ptr;
      fr_pool_slots[i].ptr = NULL;
      fr_pool_cached -= *size;
      break;
    }
  }
  if (ptr) fr_pool_hits++; else fr_pool_misses++;
  pthread_mutex_unlock(&fr_pool_lock);
  if (!ptr && posix_memalign(&ptr, FR_POOL_ALIGN, *size) != 0)
    ptr = NULL;
  return ptr;
}

/* Return a block from fr_pool_take: kept for reuse while under the limit, else freed. */
static void fr_pool_give(void *ptr, size_t size)
{
  pthread_mutex_lock(&fr_pool_lock);
  if (fr_pool_cached + size <= fr_pool_limit) {
    for (int i = 0; i < FR_POOL_SLOTS; i++) {
      if (!fr_pool_slots[i].ptr) {
        fr_pool_slots[i].ptr = ptr;
        fr_pool_slots[i].size = size;
        fr_pool_cached += size;
        ptr = NULL;
        break;
      }
    }
  }
  pthread_mutex_unlock(&fr_pool_lock);
  free(ptr); /* NULL when kept */
}

/* Free every cached block and set the limit; returns the old limit. */
static size_t fr_pool_set_limit(size_t limit)
{
  size_t old;
  void *doomed[FR_POOL_SLOTS];
  int n = 0;
  pthread_mutex_lock(&fr_pool_lock);
  old = fr_pool_limit;
  fr_pool_limit = limit;
  for (int i = 0; i < FR_POOL_SLOTS; i++) {
    if (fr_pool_slots[i].ptr) {
      doomed[n++] = fr_pool_slots[i].ptr;
      fr_pool_slots[i].ptr = NULL;
    }
  }
  fr_pool_cached = 0;
  pthread_mutex_unlock(&fr_pool_lock);
  for (int i = 0; i < n; i++) free(doomed[i]);
  return old;
}

#endif /* FASTREDUCE_HOSTPOOL_H */
