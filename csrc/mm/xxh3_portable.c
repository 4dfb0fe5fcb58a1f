/* xxh3_portable.c: XXH3 for the compiler's default instruction set
 * (xxh3_kernels.h), and the streaming state every build shares. */
#include "mm/xxh3_kernels.h"

#define MLXP_XXH3_NAME "portable"
#define MLXP_XXH3_GETTER mlxp_xxh3_portable
#include "mm/xxh3_kernels.inc"

void* mlxp_xxh3_create_state(void) {
  XXH3_state_t* s = XXH3_createState();
  if (s != NULL) {
    XXH3_64bits_reset(s);
  }
  return s;
}

void mlxp_xxh3_free_state(void* state) {
  XXH3_freeState((XXH3_state_t*)state);
}

int mlxp_cpu_runs_avx2(void) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx2"); /* XGETBV included */
#else
  return 0;
#endif
}
