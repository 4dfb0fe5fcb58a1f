// trace.cpp: the pager's event recorder (trace.h).
#include "mm/trace.h"

#include <utility>

namespace mlx_pager {

const char* to_string(TraceKind k) {
  switch (k) {
    case TraceKind::chunk:
      return "chunk";
    case TraceKind::verify:
      return "verify";
    case TraceKind::reread:
      return "reread";
    case TraceKind::read:
      return "read";
    case TraceKind::wait:
      return "wait";
    case TraceKind::reclaim:
      return "reclaim";
    case TraceKind::evict:
      return "evict";
  }
  return "?";
}

void TraceRecorder::record(const TraceEvent& e) {
  if (!enabled()) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() >= kMaxTraceEvents) {
    ++dropped_;
    return;
  }
  events_.push_back(e);
}

std::vector<TraceEvent> TraceRecorder::take() {
  std::vector<TraceEvent> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(events_);
  return out;
}

std::uint64_t TraceRecorder::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

}  // namespace mlx_pager
