/* xxh3_avx2.c: XXH3 for AVX2 (xxh3_kernels.h). CMake compiles this file with
 * -mavx2 on x86-64; elsewhere it builds nothing and says so. */
#include "mm/xxh3_kernels.h"

#if defined(__AVX2__)
#define MLXP_XXH3_NAME "avx2"
#define MLXP_XXH3_GETTER mlxp_xxh3_avx2
#include "mm/xxh3_kernels.inc"
#else
const MlxpXxh3Kernels* mlxp_xxh3_avx2(void) {
  return NULL;
}
#endif
