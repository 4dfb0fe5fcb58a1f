// mempool.h: a fixed pool of aligned staging buffers (cf. Linux mm/mempool.c).
//
// Staging memory is sized once, up front, and reused: the pool never grows,
// so it can never be the thing that exhausts RAM (the DeepSpeed pinned-buffer
// failure). A caller that finds every buffer busy waits for one.
//
// The read path does not stage (reads land in MLX's own buffers); the pool
// serves the swap-file writer, whose O_DIRECT writes need aligned memory.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

namespace mlx_pager {

class MemPool {
 public:
  // `count` buffers of `buffer_bytes` each (rounded up to kIoAlign), all
  // allocated here. Throws std::bad_alloc.
  MemPool(std::size_t count, std::size_t buffer_bytes);
  ~MemPool();
  MemPool(const MemPool&) = delete;
  MemPool& operator=(const MemPool&) = delete;

  // A buffer on loan; returned to the pool when destroyed.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&& o) noexcept;
    Buffer& operator=(Buffer&& o) noexcept;
    ~Buffer();
    char* data() const { return data_; }
    std::size_t size() const { return size_; }
    explicit operator bool() const { return data_ != nullptr; }

   private:
    friend class MemPool;
    Buffer(MemPool* pool, char* data, std::size_t size)
        : pool_(pool), data_(data), size_(size) {}
    MemPool* pool_ = nullptr;
    char* data_ = nullptr;
    std::size_t size_ = 0;
  };

  // Takes a free buffer, waiting until one is returned if all are on loan.
  Buffer get();
  // Takes a free buffer if one is free now; an empty Buffer otherwise.
  Buffer try_get();

  std::size_t buffer_bytes() const { return buffer_bytes_; }
  std::size_t capacity() const { return all_.size(); }
  std::size_t total_bytes() const { return all_.size() * buffer_bytes_; }
  std::size_t in_use() const;
  // Most buffers ever on loan at once.
  std::size_t high_water() const;

 private:
  void put(char* data);

  std::size_t buffer_bytes_;
  std::vector<char*> all_;
  std::vector<char*> free_;
  std::size_t high_water_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace mlx_pager
