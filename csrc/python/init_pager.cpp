// init_pager.cpp: binds TensorPager (the pager of mx.array pages) as Pager.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <optional>

#include <mlx/array.h>

#include "mlx/paged_tensor.h"
#include "mlx/tensor_pager.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace mlx_pager;

namespace {

using InPlaceTensor =
    std::tuple<std::string, std::string, std::uint64_t, std::uint64_t, mx::Dtype, std::vector<int>>;
using SwapTensor = std::tuple<std::string, mx::Dtype, std::vector<int>>;

PageId page_id(const TensorPager& tp, const nb::handle& page) {
  if (nb::isinstance<nb::str>(page)) {
    return tp.pager().lookup(nb::cast<std::string>(page));
  }
  auto id = nb::cast<std::int64_t>(page);
  if (id < 0 || static_cast<std::size_t>(id) >= tp.pager().num_pages()) {
    throw nb::index_error(("[Pager] no page with id " + std::to_string(id)).c_str());
  }
  return static_cast<PageId>(id);
}

nb::dict stats_dict(const VmStat& s) {
  nb::dict d;
  d["acquires"] = s.acquires;
  d["hits"] = s.hits;
  d["readahead_hits"] = s.readahead_hits;
  d["faults"] = s.faults;
  d["readahead_reads"] = s.readahead_reads;
  d["readahead_idle_evictions"] = s.readahead_idle_evictions;
  d["evictions"] = s.evictions;
  d["read_errors"] = s.read_errors;
  d["io_retries"] = s.io_retries;
  d["checksum_errors"] = s.checksum_errors;
  d["verified_landing"] = s.verified_landing;
  d["moves_early"] = s.moves_early;
  d["rereads"] = s.rereads;
  d["pages_rebuilt"] = s.pages_rebuilt;
  d["pages_read"] = s.pages_read;
  d["bytes_read"] = s.bytes_read;
  d["io_wait_s"] = s.io_wait_ns * 1e-9;
  d["read_busy_s"] = s.read_busy_ns * 1e-9;
  d["reclaim_wait_s"] = s.reclaim_wait_ns * 1e-9;
  d["resident_bytes"] = s.resident_bytes_now;
  d["peak_resident_bytes"] = s.peak_resident_bytes;
  d["pinned_bytes"] = s.pinned_bytes_now;
  d["mlocked_bytes"] = s.mlocked_bytes_now;
  d["resident_pages"] = s.resident_pages_now;
  d["in_flight_pages"] = s.in_flight_pages_now;
  d["in_flight_bytes"] = s.in_flight_bytes_now;
  d["frames_reused"] = s.frames_reused;
  d["free_frame_bytes"] = s.free_frame_bytes_now;
  d["direct_files"] = s.direct_files;
  d["buffered_files"] = s.buffered_files;
  return d;
}

// A Python callable kept by C++: released with the GIL held, wherever the
// last reference goes.
struct PyCallable {
  nb::object fn;
  explicit PyCallable(nb::object f) : fn(std::move(f)) {}
  ~PyCallable() {
    nb::gil_scoped_acquire gil;
    fn.reset();
  }
};

}  // namespace

void init_pager(nb::module_& m) {
  // The pager's errors as Python classes: a page that cannot be read is an
  // OSError (the message names page and file), a budget that cannot hold a
  // page a MemoryError.
  nb::exception<PageReadError>(m, "PageReadError", PyExc_OSError);
  m.def(
      "trace_now_ns", [] { return TraceRecorder::now_ns(); },
      "Now on the pager's trace clock (steady clock, nanoseconds).");
  nb::exception<BudgetError>(m, "PagerBudgetError", PyExc_MemoryError);
  nb::class_<TensorPager>(
      m, "Pager",
      "Pages of named mx.arrays kept on SSD or in memory under a byte budget.\n"
      "See csrc/mlx/tensor_pager.h and csrc/mm/pager.h for the contract.")
      .def(
          "__init__",
          [](TensorPager* self, std::uint64_t budget_bytes, const std::string& policy,
             int readahead, int io_threads, std::uint64_t io_chunk_bytes, bool direct_io,
             const std::string& readahead_mode, bool keep_free_frames, bool page_pool) {
            PagerConfig c;
            if (readahead_mode != "conservative" && readahead_mode != "aggressive") {
              throw std::invalid_argument(
                  "[Pager] readahead_mode must be 'conservative' or 'aggressive', not '" +
                  readahead_mode + "'");
            }
            c.readahead_aggressive = readahead_mode == "aggressive";
            c.budget_bytes = budget_bytes;
            c.policy = policy_from_string(policy);
            c.readahead_pages = readahead;
            c.io_threads = io_threads;
            c.io_chunk_bytes = io_chunk_bytes;
            c.direct_io = direct_io;
            c.keep_free_frames = keep_free_frames;
            c.page_pool = page_pool;
            new (self) TensorPager(c);
          },
          "budget_bytes"_a, "policy"_a = "optimal", "readahead"_a = 2, "io_threads"_a = 4,
          "io_chunk_bytes"_a = kDefaultIoChunkBytes, "direct_io"_a = true,
          "readahead_mode"_a = "conservative", "keep_free_frames"_a = true, "page_pool"_a = true)
      .def(
          "add_page_in_place",
          [](TensorPager& tp, const std::string& name, const std::vector<InPlaceTensor>& tensors,
             int priority, std::optional<std::uint64_t> checksum) {
            std::vector<FileTensor> ft;
            for (auto& [tname, path, offset, nbytes, dtype, shape] : tensors) {
              ft.push_back(FileTensor{
                  {tname, dtype, mx::Shape(shape.begin(), shape.end())}, path, offset, nbytes});
            }
            return tp.add_page_in_place(name, ft, priority, checksum ? &*checksum : nullptr);
          },
          "name"_a, "tensors"_a, "priority"_a = 0, "checksum"_a = nb::none(),
          "Registers a page read in place; tensors are (name, path, offset, nbytes, dtype, "
          "shape).\n"
          "checksum: combine_digests of the tensors' XXH3s in this order; every read is verified.")
      .def(
          "add_page_from_swap",
          [](TensorPager& tp, const std::string& name, const std::string& swap_path,
             std::uint64_t page_offset, const std::vector<SwapTensor>& tensors, int priority,
             std::optional<std::uint64_t> checksum) {
            std::vector<TensorSpec> specs;
            for (auto& [tname, dtype, shape] : tensors) {
              specs.push_back(TensorSpec{tname, dtype, mx::Shape(shape.begin(), shape.end())});
            }
            return tp.add_page_from_swap(
                name, swap_path, page_offset, specs, priority, checksum ? &*checksum : nullptr);
          },
          "name"_a, "swap_path"_a, "page_offset"_a, "tensors"_a, "priority"_a = 0,
          "checksum"_a = nb::none(),
          "Registers a page written by SwapWriter.write_page; tensors are (name, dtype, shape).")
      .def(
          "acquire",
          [](TensorPager& tp, nb::handle page) {
            PageId id = page_id(tp, page);
            NamedArrays arrays;
            {
              nb::gil_scoped_release unlocked;
              arrays = tp.acquire(id);
            }
            nb::dict d;
            for (auto& [name, a] : arrays) {
              d[nb::str(name.c_str())] = nb::cast(std::move(a));
            }
            return d;
          },
          "page"_a, "The page's tensors as {name: mx.array}; reads the page if needed.")
      .def(
          "lazy_page",
          [](TensorPager& tp, nb::handle page, const mx::array& after,
             const std::vector<bool>& copy) {
            return paged_tensors(tp, page_id(tp, page), after, copy);
          },
          "page"_a, "after"_a, "copy"_a = std::vector<bool>{},
          "The page's tensors (registration order) as lazy arrays that acquire the page when "
          "MLX evaluates them, after `after`; copy[i]: tensor i in a buffer of its own, not a "
          "view of the frame (mlx/paged_tensor.h).")
      .def(
          "release",
          [](TensorPager& tp, nb::handle page) {
            PageId id = page_id(tp, page);
            nb::gil_scoped_release unlocked;
            tp.release(id);
          },
          "page"_a)
      .def(
          "pin",
          [](TensorPager& tp, nb::handle page) {
            PageId id = page_id(tp, page);
            nb::gil_scoped_release unlocked;
            tp.pager().pin(id);
          },
          "page"_a)
      .def(
          "evict_all",
          [](TensorPager& tp) {
            nb::gil_scoped_release unlocked;  // waits for readahead in flight
            tp.pager().evict_all();
          },
          "Drops every page in memory nobody holds or pinned, and the reads ahead in flight.")
      .def(
          "drop_free_frames",
          [](TensorPager& tp) {
            nb::gil_scoped_release unlocked;
            return tp.pager().drop_free_frames();
          },
          "Frees the frames of evicted pages kept (charged) for the next reads "
          "(PagerConfig::keep_free_frames); returns their bytes.")
      .def(
          "drop_kept_frame", [](TensorPager& tp) { return tp.frames().drop_kept(); },
          "Frees the frame kept for the next read to MLX and the page pool's pages to the OS\n"
          "(mlx_frames.h); returns their bytes.")
      .def(
          "kept_frame_bytes", [](const TensorPager& tp) { return tp.frames().kept_bytes(); },
          "Bytes of the frame kept for the next read (no longer charged to the budget; in MLX's\n"
          "active memory). The page pool's, outside MLX's counts: stats()['pool_bytes'].")
      .def(
          "reset_peak", [](TensorPager& tp) { tp.pager().reset_peak(); },
          "Starts stats()['peak_resident_bytes'] over from what is resident now.")
      .def(
          "discard",
          [](TensorPager& tp, nb::handle page) {
            PageId id = page_id(tp, page);
            nb::gil_scoped_release unlocked;
            tp.pager().discard(id);
          },
          "page"_a, "Drops the page's copy in memory: its bytes on disk were rewritten.")
      .def(
          "set_schedule",
          [](TensorPager& tp, const std::vector<PageId>& order, bool repeat) {
            tp.pager().set_schedule(order, repeat);
          },
          "order"_a, "repeat"_a = true)
      .def(
          "set_budget", [](TensorPager& tp, std::uint64_t b) { return tp.pager().set_budget(b); },
          "bytes"_a)
      .def(
          "set_readahead", [](TensorPager& tp, int n) { return tp.pager().set_readahead(n); },
          "pages"_a, "Pages read ahead of the schedule (0: off); returns the previous value.")
      .def(
          "set_readahead_mode",
          [](TensorPager& tp, const std::string& mode) {
            if (mode != "conservative" && mode != "aggressive") {
              throw std::invalid_argument(
                  "[Pager] readahead_mode must be 'conservative' or 'aggressive', not '" + mode +
                  "'");
            }
            bool was = tp.pager().set_readahead_aggressive(mode == "aggressive");
            return std::string(was ? "aggressive" : "conservative");
          },
          "mode"_a, "'conservative' or 'aggressive' (readahead.cpp); returns the previous mode.")
      .def(
          "page_state",
          [](const TensorPager& tp, nb::handle page) {
            return std::string(to_string(tp.pager().state(page_id(tp, page))));
          },
          "page"_a, "'on_disk', 'in_flight' or 'resident'.")
      .def_prop_ro("budget", [](const TensorPager& tp) { return tp.pager().budget(); })
      .def_prop_ro(
          "readahead", [](const TensorPager& tp) { return tp.pager().readahead_pages(); },
          "Pages read ahead of the schedule now (set_readahead).")
      .def_prop_ro(
          "readahead_mode",
          [](const TensorPager& tp) {
            return std::string(tp.pager().readahead_aggressive() ? "aggressive" : "conservative");
          },
          "The readahead mode now (set_readahead_mode).")
      .def(
          "lookup",
          [](const TensorPager& tp, const std::string& n) { return tp.pager().lookup(n); },
          "name"_a)
      .def(
          "page_name", [](const TensorPager& tp, PageId id) { return tp.pager().spec(id).name; },
          "page"_a)
      .def(
          "page_bytes",
          [](const TensorPager& tp, PageId id) { return tp.pager().spec(id).frame_bytes; },
          "page"_a, "Bytes of the page's frame in memory.")
      .def(
          "page_charge_bound",
          [](const TensorPager& tp, PageId id) { return tp.pager().charge_bound(id); }, "page"_a,
          "The most the page may be charged while resident (Pager::charge_bound).")
      .def(
          "frame_charge_bound",
          [](const TensorPager& tp, std::uint64_t frame_bytes) {
            return tp.pager().frame_charge_bound(frame_bytes);
          },
          "frame_bytes"_a,
          "The most a page of `frame_bytes` (page_bytes) may be charged while resident\n"
          "(Pager::charge_bound): what a budget that must hold several pages at once counts.")
      .def(
          "page_read_bytes",
          [](const TensorPager& tp, PageId id) { return tp.pager().read_bytes(id); }, "page"_a,
          "Bytes one read of the page transfers (Pager::read_bytes).")
      .def(
          "stats",
          [](const TensorPager& tp) {
            nb::dict d = stats_dict(tp.pager().stats());
            // The page pool's (mlx_frames.h): memory outside MLX's counts,
            // and the bytes frames took from it in place of fresh memory.
            const MlxFrameAllocator& frames = tp.frames();
            d["pool_bytes"] = frames.pooled_bytes();
            d["pool_filled_bytes"] = frames.pooled_filled_bytes();
            return d;
          })
      .def(
          "enable_trace", [](TensorPager& tp, bool on) { tp.pager().set_tracing(on); },
          "on"_a = true, "Starts (True) or stops recording the pager's events (csrc/mm/trace.h).")
      .def(
          "take_trace",
          [](TensorPager& tp) {
            std::vector<TraceEvent> events = tp.pager().take_trace();
            nb::list out;
            for (const TraceEvent& e : events) {
              out.append(nb::make_tuple(
                  to_string(e.kind), e.thread, e.page, e.read, e.bytes, e.total, e.start_ns,
                  e.end_ns, e.readahead, e.failed));
            }
            return out;
          },
          "The events recorded since the last call, oldest first, as tuples\n"
          "(kind, thread, page, read, bytes, total, start_ns, end_ns, readahead, failed):\n"
          "kind 'chunk', 'verify', 'reread', 'read', 'wait', 'reclaim' or 'evict'; thread the\n"
          "I/O thread's index or -1 (the caller's); times on trace_now_ns()'s clock.")
      .def_prop_ro(
          "trace_dropped", [](const TensorPager& tp) { return tp.pager().trace_dropped(); },
          "Events dropped because nobody took them (csrc/mm/trace.h: kMaxTraceEvents).")
      .def(
          "set_rebuild_hook",
          [](TensorPager& tp, nb::object hook) {
            if (hook.is_none()) {
              tp.pager().set_rebuild_hook({});
              return;
            }
            auto fn = std::make_shared<PyCallable>(std::move(hook));
            tp.pager().set_rebuild_hook([fn](PageId id) {
              nb::gil_scoped_acquire gil;
              return nb::cast<bool>(fn->fn(id));
            });
          },
          "hook"_a.none(),
          "hook(page_id) -> bool, called when a page's bytes fail their checksum twice;\n"
          "returns whether it rewrote them (the read is then tried again). None: no hook.")
      .def(
          "inject_faults",
          [](TensorPager& tp, const std::string& kind, const std::string& path_contains, long skip,
             long count, std::size_t length) {
            if (kind == "none") {
              tp.pager().set_fault_injector({});
              return;
            }
            int err = 0;
            if (kind == "eio") {
              err = EIO;
            } else if (kind != "short") {
              throw std::invalid_argument(
                  "[Pager.inject_faults] kind must be 'eio', 'short' or 'none', not '" + kind +
                  "'");
            }
            tp.pager().set_fault_injector(fault_rule(path_contains, err, length, skip, count));
          },
          "kind"_a, "path_contains"_a = "", "skip"_a = 0, "count"_a = -1, "length"_a = 0,
          "Test hook (page_io.h): chunk reads of files whose path contains path_contains fail:\n"
          "the first `skip` pass, the next `count` (-1: all) fail with EIO ('eio') or are cut\n"
          "to `length` bytes ('short'). 'none' removes it. Each chunk is tried 3 times.");
}
