// thread_name.h: naming the pager's own threads.
//
// The pager's I/O workers and its readahead thread carry names ("mlxp-io-N",
// "mlxp-readahead") so that top -H, perf, /proc/PID/task/*/comm and debuggers
// tell them apart from MLX's and the BLAS library's threads. Naming is best
// effort: where the platform has no way to name a thread, nothing happens.
#pragma once

namespace mlx_pager {

// Names the calling thread. Platforms cap the length (Linux: 15 characters),
// and a longer name is cut to fit.
void name_this_thread(const char* name);

}  // namespace mlx_pager
