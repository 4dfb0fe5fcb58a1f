// vmstat.h: the pager's counters (cf. Linux mm/vmstat.c, /proc/vmstat).
//
// A snapshot is taken under the pager's lock, so its fields are consistent
// with each other. Every counter only grows, except the *_now gauges.
#pragma once

#include <cstdint>

namespace mlx_pager {

struct VmStat {
  std::uint64_t acquires = 0;                  // acquire() calls
  std::uint64_t hits = 0;                      // acquire() found the page resident
  std::uint64_t readahead_hits = 0;            // ... resident or in flight thanks to readahead
  std::uint64_t faults = 0;                    // acquire() had to start the read itself
  std::uint64_t readahead_reads = 0;           // pages whose read readahead started
  std::uint64_t readahead_idle_evictions = 0;  // idle pages MIN evicts anyway, evicted early
  std::uint64_t evictions = 0;                 // pages dropped to make room
  std::uint64_t read_errors = 0;               // page reads that failed
  std::uint64_t io_retries = 0;                // chunk reads retried after an error
  std::uint64_t checksum_errors = 0;           // page reads whose bytes did not match
  std::uint64_t verified_landing = 0;          // checked reads verified as they landed
  std::uint64_t moves_early = 0;               // tensor moves (layout.h) done as reads landed
  std::uint64_t rereads = 0;                   // pages read again after a mismatch
  std::uint64_t pages_rebuilt = 0;             // pages rewritten from the model's files
  std::uint64_t pages_read = 0;                // page reads completed
  std::uint64_t bytes_read = 0;                // bytes transferred from files
  std::uint64_t io_wait_ns = 0;                // time acquire() spent blocked on reads
  std::uint64_t read_busy_ns = 0;              // time with at least one page read in flight
  std::uint64_t reclaim_wait_ns = 0;           // time spent waiting for memory to free
  std::uint64_t resident_bytes_now = 0;        // memory charged to the budget now
  std::uint64_t peak_resident_bytes = 0;       // most ever charged at once
  std::uint64_t pinned_bytes_now = 0;
  std::uint64_t mlocked_bytes_now = 0;  // pinned memory the OS agreed to lock
  std::uint64_t resident_pages_now = 0;
  std::uint64_t in_flight_pages_now = 0;
  // What the reads in flight now will add to bytes_read (read_bytes): a
  // snapshot counts a read by when it started, bytes_read by when it landed.
  std::uint64_t in_flight_bytes_now = 0;
  std::uint64_t frames_reused = 0;         // reads into a kept free frame
  std::uint64_t free_frame_bytes_now = 0;  // kept free frames (charged)
  std::uint64_t direct_files = 0;          // files opened with O_DIRECT/F_NOCACHE
  std::uint64_t buffered_files = 0;        // files that fell back to buffered+drop
};

}  // namespace mlx_pager
