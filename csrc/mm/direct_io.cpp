// direct_io.cpp: the platform-specific half of cache-free file I/O.
#include "mm/direct_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <new>
#include <system_error>
#include <utility>

namespace mlx_pager {

namespace {

std::atomic<bool> g_refuse_direct{false};

[[noreturn]] void throw_errno(int err, const std::string& what) {
  throw std::system_error(err, std::generic_category(), "[DirectFile] " + what);
}

// Turns off caching on an already open descriptor where the platform has a
// flag for it (macOS). Returns true on success.
bool set_nocache(int fd) {
#if defined(__APPLE__)
  return fcntl(fd, F_NOCACHE, 1) == 0;
#else
  (void)fd;
  return false;
#endif
}

// Opens with O_DIRECT where it exists. Returns -1 with errno set on failure.
int open_direct(const std::string& path, int flags, mode_t perm) {
  if (g_refuse_direct.load()) {
    errno = EINVAL;
    return -1;
  }
#if defined(O_DIRECT)
  return ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, perm);
#else
  (void)path;
  (void)flags;
  (void)perm;
  errno = EINVAL;
  return -1;
#endif
}

}  // namespace

const char* to_string(IoMode mode) {
  switch (mode) {
    case IoMode::direct:
      return "direct";
    case IoMode::nocache:
      return "nocache";
    case IoMode::buffered_drop:
      return "buffered+drop";
  }
  return "?";
}

// Opens `path` in the best cache-free mode the platform and file system allow.
static std::pair<int, IoMode> open_mode(
    const std::string& path, int flags, mode_t perm, bool want_direct) {
  if (want_direct) {
    int fd = open_direct(path, flags, perm);
    if (fd >= 0) {
      return {fd, IoMode::direct};
    }
    // EINVAL: the file system refuses O_DIRECT (e.g. tmpfs). Anything else
    // (ENOENT, EACCES, ...) is a real error and is reported as such below.
    if (errno != EINVAL) {
      throw_errno(errno, "open(" + path + ")");
    }
  }
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, perm);
  if (fd < 0) {
    throw_errno(errno, "open(" + path + ")");
  }
  if (want_direct && !g_refuse_direct.load() && set_nocache(fd)) {
    return {fd, IoMode::nocache};
  }
  return {fd, IoMode::buffered_drop};
}

bool DirectFile::refuse_direct_for_testing(bool refuse) {
  return g_refuse_direct.exchange(refuse);
}

DirectFile DirectFile::open_read(const std::string& path, bool want_direct) {
  auto [fd, mode] = open_mode(path, O_RDONLY, 0, want_direct);
  return DirectFile(fd, mode, path);
}

DirectFile DirectFile::create_write(
    const std::string& path, std::uint64_t reserve_bytes, bool want_direct) {
  auto [fd, mode] = open_mode(path, O_RDWR | O_CREAT | O_TRUNC, 0600, want_direct);
  DirectFile f(fd, mode, path);
  if (reserve_bytes > 0) {
#if defined(__APPLE__)
    fstore_t store = {F_ALLOCATEALL, F_PEOFPOSMODE, 0, static_cast<off_t>(reserve_bytes), 0};
    if (fcntl(fd, F_PREALLOCATE, &store) != 0 ||
        ftruncate(fd, static_cast<off_t>(reserve_bytes)) != 0) {
      throw_errno(errno, "reserving " + std::to_string(reserve_bytes) + " bytes for " + path);
    }
#else
    int err = posix_fallocate(fd, 0, static_cast<off_t>(reserve_bytes));
    if (err != 0) {
      throw_errno(
          err,
          "reserving " + std::to_string(reserve_bytes) + " bytes for " + path +
              " (posix_fallocate)");
    }
#endif
  }
  return f;
}

DirectFile::DirectFile(DirectFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), mode_(other.mode_), path_(std::move(other.path_)) {}

DirectFile& DirectFile::operator=(DirectFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) {
      ::close(fd_);
    }
    fd_ = std::exchange(other.fd_, -1);
    mode_ = other.mode_;
    path_ = std::move(other.path_);
  }
  return *this;
}

DirectFile::~DirectFile() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

std::uint64_t DirectFile::size() const {
  struct stat st;
  if (fstat(fd_, &st) != 0) {
    throw_errno(errno, "fstat(" + path_ + ")");
  }
  return static_cast<std::uint64_t>(st.st_size);
}

std::size_t DirectFile::pread_full(void* dst, std::size_t n, std::uint64_t offset) const {
  std::size_t done = 0;
  char* p = static_cast<char*>(dst);
  while (done < n) {
    ssize_t r =
        ::pread(fd_, p + done, std::min(n - done, kMaxIoCall), static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw_errno(
          errno,
          "pread(" + path_ + ", offset " + std::to_string(offset + done) + ", " +
              std::to_string(n - done) + " bytes, " + to_string(mode_) + ")");
    }
    if (r == 0) {
      break;  // end of file
    }
    done += static_cast<std::size_t>(r);
    // A direct read that stops short of an aligned length ends at EOF; the
    // next read would start unaligned, so stop here.
    if (mode_ == IoMode::direct && (done % kIoAlign) != 0) {
      break;
    }
  }
  if (mode_ == IoMode::buffered_drop) {
    drop_cache(offset, done);
  }
  return done;
}

void DirectFile::pwrite_full(const void* src, std::size_t n, std::uint64_t offset) const {
  std::size_t done = 0;
  const char* p = static_cast<const char*>(src);
  while (done < n) {
    ssize_t r =
        ::pwrite(fd_, p + done, std::min(n - done, kMaxIoCall), static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw_errno(errno, "pwrite(" + path_ + ", offset " + std::to_string(offset + done) + ")");
    }
    if (r == 0) {
      throw_errno(EIO, "pwrite(" + path_ + ") wrote nothing");
    }
    done += static_cast<std::size_t>(r);
  }
  if (mode_ == IoMode::buffered_drop) {
    drop_cache(offset, n);
  }
}

void DirectFile::drop_cache(std::uint64_t offset, std::uint64_t n) const {
#if defined(POSIX_FADV_DONTNEED)
  if (mode_ == IoMode::buffered_drop && n > 0) {
    // Dirty pages are not dropped by DONTNEED; the writer syncs first.
    (void)posix_fadvise(
        fd_, static_cast<off_t>(offset), static_cast<off_t>(n), POSIX_FADV_DONTNEED);
  }
#else
  (void)offset;
  (void)n;
#endif
}

void DirectFile::sync() const {
#if defined(__APPLE__)
  if (fcntl(fd_, F_FULLFSYNC) == 0) {
    return;
  }
#endif
  if (::fsync(fd_) != 0) {
    throw_errno(errno, "fsync(" + path_ + ")");
  }
}

void DirectFile::truncate(std::uint64_t n) const {
  if (::ftruncate(fd_, static_cast<off_t>(n)) != 0) {
    throw_errno(errno, "ftruncate(" + path_ + ")");
  }
}

void* aligned_alloc_io(std::size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, kIoAlign, n == 0 ? kIoAlign : n) != 0) {
    throw std::bad_alloc();
  }
  return p;
}

void aligned_free_io(void* p) {
  std::free(p);
}

AlignedBuffer::AlignedBuffer(std::size_t bytes)
    : data_(static_cast<char*>(aligned_alloc_io(align_up(bytes == 0 ? 1 : bytes, kIoAlign)))),
      size_(align_up(bytes == 0 ? 1 : bytes, kIoAlign)) {}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    aligned_free_io(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() {
  aligned_free_io(data_);
}

}  // namespace mlx_pager
