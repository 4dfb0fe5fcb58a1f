/* xxh3_kernels.h: XXH3-64 built for more than one instruction set.
 *
 * The pager hashes every byte it reads (checksum.h, landing.h) on the I/O
 * threads, beside training's compute: on a 2-vCPU AMD EPYC the compiler's
 * default x86-64 build (SSE2) hashes 8 GB/s from cache, AVX2 17 GB/s, so
 * AVX2 halves the CPU time reading costs in hashing. A default x86-64 build
 * cannot assume AVX2, so that build lives in its own file, compiled with
 * -mavx2 (xxh3_avx2.c), and checksum.cpp calls it only where the CPU runs it.
 * Other targets (arm64's NEON, which is its default) have the portable build
 * only. Every build gives the same digests (XXH3 is defined bit for bit).
 *
 * C, not C++: a C++ file compiled with -mavx2 may emit AVX2 copies of inline
 * functions from the standard headers that the linker then keeps for the
 * whole program; these files include only C headers and define nothing
 * inline outside themselves.
 *
 * A kernel's state is an XXH3_state_t made by the portable build's
 * create_state (its layout does not depend on the instruction set).
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct MlxpXxh3Kernels {
  const char* name; /* "portable" or "avx2" */
  uint64_t (*hash)(const void* data, size_t n);
  void (*update)(void* state, const void* data, size_t n);
  uint64_t (*digest)(const void* state);
} MlxpXxh3Kernels;

/* The compiler's default build for this target; always there. */
const MlxpXxh3Kernels* mlxp_xxh3_portable(void);
/* The AVX2 build, or NULL where none was built (not x86-64). The caller
 * checks that the CPU runs AVX2 (mlxp_cpu_runs_avx2) before calling any of
 * it. */
const MlxpXxh3Kernels* mlxp_xxh3_avx2(void);
/* Whether this CPU runs AVX2 and the OS saves its registers (x86-64 with
 * GCC or Clang; 0 elsewhere). */
int mlxp_cpu_runs_avx2(void);

/* A reset streaming state (free with mlxp_xxh3_free_state), NULL when out of
 * memory. */
void* mlxp_xxh3_create_state(void);
void mlxp_xxh3_free_state(void* state);

#ifdef __cplusplus
}
#endif
