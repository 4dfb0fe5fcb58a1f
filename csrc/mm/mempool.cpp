// mempool.cpp: fixed pool of aligned staging buffers.
#include "mm/mempool.h"

#include <algorithm>
#include <utility>

#include "mm/direct_io.h"

namespace mlx_pager {

MemPool::MemPool(std::size_t count, std::size_t buffer_bytes)
    : buffer_bytes_(align_up(buffer_bytes == 0 ? 1 : buffer_bytes, kIoAlign)) {
  all_.reserve(count);
  try {
    for (std::size_t i = 0; i < count; ++i) {
      all_.push_back(static_cast<char*>(aligned_alloc_io(buffer_bytes_)));
    }
  } catch (...) {
    for (char* p : all_) {
      aligned_free_io(p);
    }
    throw;
  }
  free_ = all_;
}

MemPool::~MemPool() {
  // Every Buffer must have been returned: a Buffer outliving its pool would
  // write into freed memory. AddressSanitizer reports it if one does.
  for (char* p : all_) {
    aligned_free_io(p);
  }
}

MemPool::Buffer MemPool::get() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !free_.empty(); });
  char* p = free_.back();
  free_.pop_back();
  high_water_ = std::max(high_water_, all_.size() - free_.size());
  return Buffer(this, p, buffer_bytes_);
}

MemPool::Buffer MemPool::try_get() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) {
    return Buffer();
  }
  char* p = free_.back();
  free_.pop_back();
  high_water_ = std::max(high_water_, all_.size() - free_.size());
  return Buffer(this, p, buffer_bytes_);
}

std::size_t MemPool::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return all_.size() - free_.size();
}

std::size_t MemPool::high_water() const {
  std::lock_guard<std::mutex> lock(mu_);
  return high_water_;
}

void MemPool::put(char* data) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(data);
  }
  cv_.notify_one();
}

MemPool::Buffer::Buffer(Buffer&& o) noexcept
    : pool_(std::exchange(o.pool_, nullptr)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

MemPool::Buffer& MemPool::Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (pool_ != nullptr) {
      pool_->put(data_);
    }
    pool_ = std::exchange(o.pool_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

MemPool::Buffer::~Buffer() {
  if (pool_ != nullptr) {
    pool_->put(data_);
  }
}

}  // namespace mlx_pager
