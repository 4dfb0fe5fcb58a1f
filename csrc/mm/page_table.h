// page_table.h: the registry of pages (cf. the page tables of Linux mm).
//
// A page is a named group of bytes that is paged in and out as one unit:
// typically the frozen tensors of one transformer block, or one pinned
// tensor. It is described by where its bytes live on disk (extents in
// registered files) and how big its in-memory frame is. Its state moves
//
//     on_disk --(fault/readahead: read)--> in_flight --(done)--> resident
//        ^                                    |                     |
//        +------------(read error)------------+                     |
//        +-------------------------(eviction)-----------------------+
//
// The PageTable only stores; the Pager drives the transitions.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "mm/checksum.h"
#include "mm/direct_io.h"
#include "mm/frame.h"

namespace mlx_pager {

using PageId = std::uint32_t;
using FileId = std::uint32_t;

enum class PageState { on_disk, in_flight, resident };
const char* to_string(PageState s);

// One contiguous read: `length` bytes at `file_offset` land at `frame_offset`
// in the page's frame; only the first `required` must exist in the file (the
// rest is alignment padding). In direct mode offsets and lengths are aligned
// to kIoAlign (the layout planner guarantees it).
struct Extent {
  FileId file = 0;
  std::uint64_t file_offset = 0;
  std::uint64_t length = 0;
  std::uint64_t required = 0;
  std::uint64_t frame_offset = 0;
};

// A memmove inside the frame, applied after the reads (layout.h: tensors
// moved to an aligned place). Moves run in the order given.
struct FrameMove {
  std::uint64_t from = 0;
  std::uint64_t to = 0;
  std::uint64_t length = 0;
};

struct PageSpec {
  std::string name;
  std::uint64_t frame_bytes = 0;  // size of the in-memory frame
  std::vector<Extent> extents;
  int priority = 0;  // eviction class: lower classes are evicted first
  std::vector<FrameMove> moves;
  // Integrity (checksum.h): when `checked`, every read of the page is
  // verified on its I/O threads: frame_checksum(frame, verify) == checksum,
  // the ranges hashed where the read lands them (landing.h).
  bool checked = false;
  std::uint64_t checksum = 0;
  std::vector<FrameRange> verify;
  // The same ranges where the read puts their bytes, before the moves (what
  // landing.h hashes as the read lands); empty: where `verify` says (a page
  // that moves nothing).
  std::vector<FrameRange> verify_as_read;
};

// What the pager knows of one page at run time.
struct PageEntry {
  PageSpec spec;
  PageState state = PageState::on_disk;
  Frame frame;                // set while in_flight or resident
  std::uint64_t charged = 0;  // bytes this page holds against the budget
  int refs = 0;               // acquire() calls not yet released
  int leases = 0;             // of those, acquire_lease() calls (released by release_lease())
  // acquire() calls that have moved the schedule's cursor past this page
  // and not yet taken their ref (waiting for its read, or making room for
  // it). They hold it like refs: once it lands it is theirs.
  int waiters = 0;
  bool pinned = false;
  bool mlocked = false;
  bool prefetched = false;       // read by readahead and not yet acquired
  std::uint64_t read_bytes = 0;  // what one read transfers (Pager::read_bytes), set at add_page
  std::uint64_t last_access = 0;
  std::uint64_t read_gen = 0;  // counts reads started, to match completions
  std::uint64_t failed_gen = 0;
  std::string error;     // message of the last failed read
  bool corrupt = false;  // the last failed read read wrong bytes (twice)

  // An acquire has it or is getting it (refs or waiters).
  bool held() const { return refs > 0 || waiters > 0; }
  // In memory and wanted by no one: the pager may evict it.
  bool evictable() const { return state == PageState::resident && !held() && !pinned; }
};

class PageTable {
 public:
  // Registers a file (deduplicated by path) and opens it for cache-free reads.
  FileId add_file(const std::string& path, bool want_direct);
  // Registers a page; names must be unique. Checks that every extent names a
  // registered file. Throws std::invalid_argument otherwise.
  PageId add_page(PageSpec spec);

  std::size_t size() const { return pages_.size(); }
  PageEntry& at(PageId id) { return pages_.at(id); }
  const PageEntry& at(PageId id) const { return pages_.at(id); }
  const DirectFile& file(FileId id) const { return *files_.at(id); }
  std::size_t num_files() const { return files_.size(); }
  // Throws std::out_of_range naming the page when it is not registered.
  PageId lookup(const std::string& name) const;

 private:
  std::deque<PageEntry> pages_;  // deque: entries never move
  std::unordered_map<std::string, PageId> by_name_;
  std::vector<std::unique_ptr<DirectFile>> files_;
  std::unordered_map<std::string, FileId> file_by_path_;
};

}  // namespace mlx_pager
