// page_table.cpp: the page registry.
#include "mm/page_table.h"

#include <algorithm>
#include <stdexcept>

namespace mlx_pager {

const char* to_string(PageState s) {
  switch (s) {
    case PageState::on_disk:
      return "on_disk";
    case PageState::in_flight:
      return "in_flight";
    case PageState::resident:
      return "resident";
  }
  return "?";
}

FileId PageTable::add_file(const std::string& path, bool want_direct) {
  if (auto it = file_by_path_.find(path); it != file_by_path_.end()) {
    return it->second;
  }
  auto f = std::make_unique<DirectFile>(DirectFile::open_read(path, want_direct));
  FileId id = static_cast<FileId>(files_.size());
  files_.push_back(std::move(f));
  file_by_path_.emplace(path, id);
  return id;
}

PageId PageTable::add_page(PageSpec spec) {
  if (spec.name.empty()) {
    throw std::invalid_argument("[PageTable::add_page] a page needs a name");
  }
  if (by_name_.count(spec.name)) {
    throw std::invalid_argument(
        "[PageTable::add_page] page '" + spec.name + "' is already registered");
  }
  for (const Extent& e : spec.extents) {
    if (e.file >= files_.size()) {
      throw std::invalid_argument(
          "[PageTable::add_page] page '" + spec.name + "' reads from unregistered file id " +
          std::to_string(e.file));
    }
    if (e.frame_offset + e.length > spec.frame_bytes) {
      throw std::invalid_argument(
          "[PageTable::add_page] page '" + spec.name + "': an extent ends past the frame (" +
          std::to_string(e.frame_offset + e.length) + " > " + std::to_string(spec.frame_bytes) +
          " bytes)");
    }
    if (e.required > e.length) {
      throw std::invalid_argument(
          "[PageTable::add_page] page '" + spec.name +
          "': an extent requires more bytes than it reads");
    }
    if (files_[e.file]->needs_alignment() &&
        (e.file_offset % kIoAlign || e.length % kIoAlign || e.frame_offset % kIoAlign)) {
      throw std::invalid_argument(
          "[PageTable::add_page] page '" + spec.name + "': extent in " + files_[e.file]->path() +
          " is not aligned for direct I/O (plan pages with layout.h)");
    }
  }
  for (const FrameMove& m : spec.moves) {
    if (std::max(m.from, m.to) + m.length > spec.frame_bytes) {
      throw std::invalid_argument(
          "[PageTable::add_page] page '" + spec.name + "': a move runs past the frame");
    }
  }
  PageId id = static_cast<PageId>(pages_.size());
  by_name_.emplace(spec.name, id);
  PageEntry entry;
  entry.spec = std::move(spec);
  pages_.push_back(std::move(entry));
  return id;
}

PageId PageTable::lookup(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) {
    throw std::out_of_range("[PageTable] no page named '" + name + "'");
  }
  return it->second;
}

}  // namespace mlx_pager
