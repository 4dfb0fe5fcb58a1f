// fault.cpp: the fault path (cf. Linux mm/memory.c): acquire, release, and
// the start and completion of page reads.
//
// acquire(p):
//   resident  -> hit (or readahead hit), refs++
//   in_flight -> wait for the read already under way (time counted as I/O wait)
//   on_disk   -> fault: make room, allocate a frame, submit the read as urgent,
//                then wait like in_flight
// Until it takes its ref the acquire holds the page as a waiter, so that the
// read it waits for is not evicted the moment it lands; and while it makes
// room for its own read, that room is reserved from readahead.
// A read failing puts the page back on disk with its error; the acquire that
// waited for it throws PageReadError, a later acquire tries again. A read
// whose bytes fail their checksum twice is failed as corrupt: the acquire
// that waited for it asks the rebuild hook once, then reads again (pager.h).
#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <utility>

#include "mm/bug.h"
#include "mm/pager.h"

namespace mlx_pager {

void Pager::advance_cursor_locked(const Lock& lock, PageId id) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  if (schedule_.empty()) {
    return;
  }
  // On schedule: step past this access. Off schedule: resynchronise at the
  // page's next scheduled access (e.g. an evaluation pass reusing the pager).
  std::size_t pos = schedule_.next_position(id, cursor_);
  if (pos != Schedule::npos) {
    cursor_ = schedule_.repeats() ? (pos + 1) % schedule_.size() : pos + 1;
  }
}

Frame Pager::acquire(PageId id) {
  std::unique_lock<std::mutex> lock(mu_);
  PageEntry& e = table_.at(id);  // throws std::out_of_range
  ++stat_.acquires;
  advance_cursor_locked(lock, id);
  // From here until it takes its ref, this acquire holds the page (waiters):
  // the cursor has moved past it, so once its read lands its next use looks
  // a cycle away, and readahead, on any thread, would evict it before this
  // thread takes the lock back (start_read_locked and the wait drop it),
  // then read it again for this very acquire.
  ++e.waiters;
  struct Unwait {  // destroyed before `lock`
    Lock& lock;
    PageEntry& e;
    bool waiting = true;
    void done() {
      if (waiting) {
        if (!lock.owns_lock()) {
          lock.lock();
        }
        --e.waiters;
        waiting = false;
      }
    }
    ~Unwait() { done(); }
  } unwait{lock, e};
  bool counted = false;
  bool rebuilt = false;
  // Read `gen` of the page failed: rebuild its bytes once where the page is
  // corrupt and a hook can (then the loop reads it again), else throw.
  auto read_failed = [&](std::uint64_t gen) {
    MLX_PAGER_ASSERT(e.state == PageState::on_disk && e.failed_gen == gen);
    if (e.corrupt && !rebuilt && rebuild_hook_) {
      // Rebuild the page's bytes on this thread, unlocked (the hook may
      // run Python and MLX), then read again.
      std::shared_ptr<const RebuildHook> hook = rebuild_hook_;
      rebuilt = true;
      lock.unlock();
      bool ok = (*hook)(id);
      lock.lock();
      if (ok) {
        ++stat_.pages_rebuilt;
        return;
      }
    }
    throw PageReadError(e.error);
  };
  for (;;) {
    if (e.state == PageState::resident) {
      if (!counted) {
        ++(e.prefetched ? stat_.readahead_hits : stat_.hits);
      }
      e.prefetched = false;
      ++e.refs;
      unwait.done();
      e.last_access = ++access_clock_;
      Frame f = e.frame;
      lock.unlock();
      readahead();
      return f;
    }
    if (e.state == PageState::in_flight) {
      if (!counted) {
        counted = true;
        ++(e.prefetched ? stat_.readahead_hits : stat_.faults);
      }
      bool late_prefetch = e.prefetched;
      e.prefetched = false;
      std::uint64_t gen = e.read_gen;
      auto t0 = std::chrono::steady_clock::now();
      cv_.wait(lock, [&] { return e.state != PageState::in_flight; });
      auto t1 = std::chrono::steady_clock::now();
      stat_.io_wait_ns += static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
      if (trace_.enabled()) {
        TraceEvent te;
        te.kind = TraceKind::wait;
        te.readahead = late_prefetch;
        te.page = id;
        te.read = gen;
        te.start_ns = TraceRecorder::ns(t0);
        te.end_ns = TraceRecorder::ns(t1);
        trace_.record(te);
      }
      if (e.state == PageState::on_disk && e.failed_gen == gen) {
        read_failed(gen);
      }
      continue;
    }
    // on_disk: a major fault. start_read_locked drops the lock to submit,
    // so the read this acquire started may have landed (or failed) before
    // it returns: count the fault by the read it started, not by the state.
    std::uint64_t gen = start_read_locked(lock, id, /*urgent=*/true);
    if (gen != 0 && !counted) {
      counted = true;
      ++stat_.faults;
    }
    if (gen != 0 && e.state == PageState::on_disk && e.failed_gen == gen) {
      read_failed(gen);
    }
  }
}

void Pager::release(PageId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    PageEntry& e = table_.at(id);
    if (e.refs <= 0) {
      throw std::logic_error("[Pager::release] page '" + e.spec.name + "' is not acquired");
    }
    --e.refs;
  }
  cv_.notify_all();
  readahead();
}

Frame Pager::acquire_lease(PageId id) {
  Frame f = acquire(id);
  std::lock_guard<std::mutex> lock(mu_);
  ++table_.at(id).leases;
  return f;
}

std::function<void()> Pager::lease_releaser(PageId id) {
  return [gate = gate_, id] { gate->run([id](Pager& p) { p.release_lease(id); }); };
}

void Pager::release_lease(PageId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    PageEntry& e = table_.at(id);
    if (e.leases <= 0 || e.refs <= 0) {
      // Called from a buffer's deleter: throwing would terminate.
      MLX_PAGER_ASSERT(false && "release_lease without a lease");
      return;
    }
    --e.leases;
    --e.refs;
  }
  cv_.notify_all();
  accounting_->wake_readahead();
}

std::uint64_t Pager::start_read_locked(Lock& lock, PageId id, bool urgent) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  PageEntry& e = table_.at(id);
  std::uint64_t need = allocator_->footprint(e.spec.frame_bytes);
  if (urgent) {
    // While this fault makes room (it may wait, unlocked), the room it
    // needs is reserved: readahead, reading pages needed after this one,
    // counts it as taken (readahead.cpp). Else it reads into the room made
    // here, and the fault evicts that page again to fit its own.
    fault_room_ += need;
    try {
      make_room_locked(lock, need, id, /*or_free_frame=*/true);
    } catch (...) {
      fault_room_ -= need;
      throw;
    }
    fault_room_ -= need;
  }
  // make_room may have waited with the lock released: another thread may have
  // started this very read meanwhile.
  if (e.state != PageState::on_disk) {
    return 0;
  }
  std::ptrdiff_t kept = free_frame_for_locked(lock, e.spec.frame_bytes, need);
  if (kept >= 0) {
    // A kept free frame of this page's size: already charged.
    FreeFrame f = std::move(free_frames_[static_cast<std::size_t>(kept)]);
    free_frames_.erase(free_frames_.begin() + kept);
    free_frame_bytes_ -= f.charged;
    held_bytes_ += f.charged;
    e.charged = f.charged;
    e.state = PageState::in_flight;
    e.prefetched = !urgent;
    std::uint64_t gen = ++e.read_gen;
    e.frame = std::move(f.frame);
    ++stat_.frames_reused;
    note_peak_locked(lock);
    submit_read_locked(lock, id, urgent);
    return gen;
  }
  accounting_->add(need);
  held_bytes_ += need;
  e.charged = need;
  e.state = PageState::in_flight;
  e.prefetched = !urgent;
  std::uint64_t gen = ++e.read_gen;
  note_peak_locked(lock);

  // Allocate without the lock: the allocator may be slow or call into MLX.
  // The frame's on_free credits back whatever it is charged when it goes:
  // the reservation now, its exact footprint once known.
  auto charge = std::make_shared<std::atomic<std::uint64_t>>(need);
  lock.unlock();
  Frame frame;
  std::exception_ptr alloc_error;
  try {
    auto acct = accounting_;
    frame = allocator_->allocate(e.spec.frame_bytes, [acct, charge] { acct->sub(charge->load()); });
  } catch (...) {
    alloc_error = std::current_exception();
  }
  lock.lock();
  if (alloc_error) {
    accounting_->sub(need);
    held_bytes_ -= need;
    e.charged = 0;
    e.state = PageState::on_disk;
    e.prefetched = false;
    cv_.notify_all();
    std::rethrow_exception(alloc_error);
  }
  // Nothing but this read's completion moves a page out of in_flight.
  MLX_PAGER_ASSERT(e.state == PageState::in_flight && e.read_gen == gen);
  MLX_PAGER_ASSERT(frame.data != nullptr && frame.size >= e.spec.frame_bytes);
  MLX_PAGER_ASSERT(reinterpret_cast<std::uintptr_t>(frame.data) % kIoAlign == 0);
  e.frame = frame;
  if (frame.footprint > need && charged_now() + (frame.footprint - need) > budget_) {
    // The allocator handed out more than reserved (a larger cached buffer):
    // a fault makes room for the rest, readahead gives up this read.
    std::exception_ptr room_error;
    if (urgent) {
      try {
        make_room_locked(lock, frame.footprint - need, id);
      } catch (...) {
        room_error = std::current_exception();
      }
    }
    if (!urgent || room_error) {
      abandon_read_locked(lock, id);
      if (room_error) {
        std::rethrow_exception(room_error);
      }
      return 0;
    }
  }
  // Charge the exact footprint in place of the reservation.
  if (frame.footprint != need) {
    accounting_->add(frame.footprint);
    accounting_->sub(need);
    held_bytes_ = held_bytes_ - need + frame.footprint;
    e.charged = frame.footprint;
    charge->store(frame.footprint);
    note_peak_locked(lock);
    if (frame.footprint > need) {
      // The page pool filled the frame against the reservation: it holds
      // no more than the room the exact charge leaves.
      if (PagePool* pool = allocator_->pool()) {
        pool->trim_to_room();
      }
    }
  }
  submit_read_locked(lock, id, urgent);
  return gen;
}

void Pager::submit_read_locked(Lock& lock, PageId id, bool urgent) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  PageEntry& e = table_.at(id);
  MLX_PAGER_ASSERT(e.state == PageState::in_flight && e.frame.data != nullptr);
  std::uint64_t gen = e.read_gen;
  std::vector<ReadOp> ops;
  ops.reserve(e.spec.extents.size());
  for (const Extent& x : e.spec.extents) {
    ops.push_back(ReadOp{
        &table_.file(x.file), x.file_offset, static_cast<std::size_t>(x.length),
        static_cast<std::size_t>(x.required), e.frame.data + x.frame_offset});
  }
  if (!urgent) {
    ++stat_.readahead_reads;
  }
  // A page's moves and checksum are done as its chunks land (landing.h).
  std::shared_ptr<Landing> landing;
  std::function<void(const ReadOp&)> on_chunk;
  if (e.spec.checked || !e.spec.moves.empty()) {
    char* base = e.frame.data;
    std::vector<FrameRange> reads;
    for (const Extent& x : e.spec.extents) {
      reads.push_back(FrameRange{x.frame_offset, x.length});
    }
    landing = std::make_shared<Landing>(
        base, std::move(reads), e.spec.moves,
        !e.spec.checked                     ? std::vector<FrameRange>{}
            : e.spec.verify_as_read.empty() ? e.spec.verify
                                            : e.spec.verify_as_read,
        e.spec.checked);
    on_chunk = [landing, base](const ReadOp& piece) {
      landing->landed(static_cast<std::uint64_t>(piece.dst - base), piece.length);
    };
  }
  check_accounting_locked(lock);
  if (reads_in_flight_++ == 0) {
    busy_since_ = std::chrono::steady_clock::now();
  }
  // The completion may run before submit() returns; it takes the lock, so
  // the submit happens with the lock released.
  lock.unlock();
  std::int64_t submitted = TraceRecorder::now_ns();
  io_.submit(
      std::move(ops),
      [this, id, gen, submitted, urgent, landing](IoBatch& b) {
        complete_read(id, gen, b, submitted, urgent, landing.get());
      },
      urgent, TraceTag{id, gen}, std::move(on_chunk));
  lock.lock();
  cv_.notify_all();  // off disk now (wait_off_disk)
}

void Pager::abandon_read_locked(Lock& lock, PageId id) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  PageEntry& e = table_.at(id);
  MLX_PAGER_ASSERT(e.state == PageState::in_flight);
  std::shared_ptr<void> dead = std::move(e.frame.owner);
  e.frame = Frame{};
  held_bytes_ -= e.charged;
  e.charged = 0;
  e.state = PageState::on_disk;
  e.prefetched = false;
  cv_.notify_all();
  lock.unlock();
  dead.reset();  // its on_free credits the reservation back
  lock.lock();
}

void Pager::complete_read(
    PageId id,
    std::uint64_t gen,
    IoBatch& batch,
    std::int64_t submitted_ns,
    bool urgent,
    Landing* landing) {
  Lock lock(mu_);
  // Every submitted read completes here once: the disk's busy time ends as
  // the last read in flight lands (its checks below are the CPU's).
  MLX_PAGER_ASSERT(reads_in_flight_ > 0);
  if (--reads_in_flight_ == 0) {
    stat_.read_busy_ns += elapsed_ns(busy_since_);
  }
  PageEntry& e = table_.at(id);
  if (e.read_gen != gen || e.state != PageState::in_flight) {
    return;
  }
  std::string corrupt;        // why the bytes read are wrong, if they are
  std::uint64_t counted = 0;  // bytes this read adds to stat_.bytes_read
  if (!batch.error() && (!e.spec.moves.empty() || e.spec.checked)) {
    // Align tensors the reads left misaligned (layout.h), then verify. The
    // frame is ours alone while in flight and specs never change, so this
    // runs without the lock (pager.h: Integrity).
    char* data = e.frame.data;
    const PageSpec& spec = e.spec;
    std::vector<ReadOp> again;  // the reads, for a second try
    if (spec.checked) {
      for (const Extent& x : spec.extents) {
        again.push_back(ReadOp{
            &table_.file(x.file), x.file_offset, static_cast<std::size_t>(x.length),
            static_cast<std::size_t>(x.required), data + x.frame_offset});
      }
    }
    lock.unlock();
    std::int64_t t0 = trace_.enabled() ? TraceRecorder::now_ns() : 0;
    // What landed was hashed as it landed, before any move shifted it,
    // and moved as it landed; finish() does the rest.
    std::optional<std::uint64_t> landed_sum;
    if (landing != nullptr) {
      landed_sum = landing->finish();
    } else {
      for (const FrameMove& m : spec.moves) {
        std::memmove(data + m.to, data + m.from, m.length);
      }
    }
    std::uint64_t mismatches = 0, reread_bytes = 0;
    if (spec.checked && landed_sum != spec.checksum) {
      // Not hashed while landing, or a mismatch: verify (and read again) the
      // slow way, which names what is wrong.
      corrupt = verify_unlocked(spec, TraceTag{id, gen}, data, again, mismatches, reread_bytes);
    }
    if (t0 != 0 && trace_.enabled()) {
      TraceEvent te;
      te.kind = TraceKind::verify;
      te.failed = !corrupt.empty();
      te.thread = PageIO::current_thread();
      te.page = id;
      te.read = gen;
      te.start_ns = t0;
      te.end_ns = TraceRecorder::now_ns();
      trace_.record(te);
    }
    lock.lock();
    stat_.verified_landing += spec.checked && landed_sum == spec.checksum;
    stat_.moves_early += landing != nullptr ? landing->moved_early() : 0;
    stat_.checksum_errors += mismatches;
    stat_.rereads += mismatches > 0;
    stat_.bytes_read += reread_bytes;
    counted += reread_bytes;
  }
  if (batch.error() || !corrupt.empty()) {
    std::string what = corrupt;
    if (std::exception_ptr err = batch.error()) {
      try {
        std::rethrow_exception(err);
      } catch (const std::exception& ex) {
        what = ex.what();
      } catch (...) {
        what = "unknown error";
      }
    }
    std::string files;
    for (const Extent& x : e.spec.extents) {
      const std::string& p = table_.file(x.file).path();
      if (files.find(p) == std::string::npos) {
        files += (files.empty() ? "" : ", ") + p;
      }
    }
    e.error = "[Pager::acquire] cannot read page '" + e.spec.name + "' from " + files + ": " + what;
    e.failed_gen = gen;
    e.corrupt = !corrupt.empty();
    ++stat_.read_errors;
    // Free the frame while the page still reads as in flight, so that the
    // acquire that waits for it wakes to memory already given back. The
    // page stops holding its charge first: until on_free runs, the memory
    // counts as let go of but still referenced (the invariant in pager.h).
    std::shared_ptr<void> dead = std::move(e.frame.owner);
    e.frame = Frame{};
    held_bytes_ -= e.charged;
    e.charged = 0;
    lock.unlock();
    dead.reset();
    lock.lock();
    e.state = PageState::on_disk;
    e.prefetched = false;
  } else {
    e.state = PageState::resident;
    e.last_access = ++access_clock_;
    ++stat_.pages_read;
    stat_.bytes_read += batch.bytes_read();
    counted += batch.bytes_read();
  }
  if (trace_.enabled()) {
    // Under mu_ with the counter it reports: `total` places this read
    // exactly between any two snapshots of the stats.
    TraceEvent te;
    te.kind = TraceKind::read;
    te.readahead = !urgent;
    te.failed = e.state != PageState::resident;
    te.thread = PageIO::current_thread();
    te.page = id;
    te.read = gen;
    te.bytes = counted;
    te.total = stat_.bytes_read;
    te.start_ns = submitted_ns;
    te.end_ns = TraceRecorder::now_ns();
    trace_.record(te);
  }
  check_accounting_locked(lock);
  cv_.notify_all();
  drop_graveyard_unlocked(lock);
}

std::string Pager::verify_unlocked(
    const PageSpec& spec,
    TraceTag tag,
    char* data,
    const std::vector<ReadOp>& again,
    std::uint64_t& mismatches,
    std::uint64_t& reread_bytes) {
  if (frame_checksum(data, spec.verify) == spec.checksum) {
    return "";
  }
  ++mismatches;
  // Read the page once more: a bad transfer (or a page rewritten meanwhile)
  // reads right the second time; bytes wrong on the disk do not.
  TraceEvent te;
  te.kind = TraceKind::reread;
  te.thread = PageIO::current_thread();
  te.page = tag.page;
  te.read = tag.read;
  te.start_ns = TraceRecorder::now_ns();
  try {
    for (const ReadOp& op : again) {
      reread_bytes += io_.read_retrying(op);
    }
  } catch (const std::exception& ex) {
    te.failed = true;
    te.bytes = reread_bytes;
    te.end_ns = TraceRecorder::now_ns();
    trace_.record(te);
    return std::string("its bytes did not match their checksum and reading them again failed: ") +
        ex.what();
  }
  te.bytes = reread_bytes;
  te.end_ns = TraceRecorder::now_ns();
  trace_.record(te);
  for (const FrameMove& m : spec.moves) {
    std::memmove(data + m.to, data + m.from, m.length);
  }
  if (frame_checksum(data, spec.verify) == spec.checksum) {
    return "";
  }
  ++mismatches;
  return "its bytes do not match their checksum (read twice): the file changed since the "
         "checksum was taken, or is corrupt";
}

}  // namespace mlx_pager
