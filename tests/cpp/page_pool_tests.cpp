// page_pool_tests.cpp: a freed frame's resident pages move to the next
// frames with their bytes (moved, not copied, and not faulted again), only
// as many as the room allows, and only into pages not already populated.
#include <sys/mman.h>
#include <sys/resource.h>

#include <cstring>

#include "check.h"
#include "mm/page_pool.h"

using namespace mlx_pager;

namespace {

// A sanitizer's shadow memory faults in on first use beside the memory it
// checks: fault counts are this process's own only without one.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

const std::uint64_t kPg = PagePool::page_size();

// `pages` pages of fresh private anonymous memory (what malloc maps).
struct Region {
  char* p;
  std::uint64_t n;
  explicit Region(std::uint64_t pages) : n(pages * kPg) {
    void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(m != MAP_FAILED);
    p = static_cast<char*>(m);
  }
  ~Region() { ::munmap(p, n); }
  void touch(char v, std::uint64_t from = 0, std::uint64_t to = ~0ull) const {
    for (std::uint64_t o = from * kPg; o < std::min(n, to * kPg); o += kPg) {
      std::memset(p + o, v + static_cast<char>(o / kPg), kPg);
    }
  }
  std::uint64_t resident_pages() const {
    std::vector<unsigned char> v(n / kPg);
    REQUIRE(::mincore(p, n, v.data()) == 0);
    std::uint64_t k = 0;
    for (unsigned char c : v) {
      k += c & 1;
    }
    return k;
  }
};

long minor_faults() {
  rusage u{};
  ::getrusage(RUSAGE_THREAD, &u);
  return u.ru_minflt;
}

PagePool::Room room_of(std::uint64_t bytes) {
  return [bytes](std::uint64_t) { return bytes; };
}

}  // namespace

TEST_CASE("page_pool: a freed frame's pages land in the next one with their bytes, no faults") {
  if (!PagePool::supported()) {
    return;  // nothing moves on this platform: the allocators map fresh
  }
  PagePool pool;
  pool.set_room(room_of(1 << 30));
  Region a(64);
  a.touch(7);
  CHECK_EQ(pool.put(a.p, a.n, 0), a.n);
  CHECK_EQ(pool.bytes(), a.n);
  CHECK_EQ(pool.taken_bytes(), a.n);
  // The freed range stays mapped, unpopulated: its owner may touch it.
  CHECK_EQ(a.resident_pages(), 0u);
  CHECK_EQ(a.p[5], 0);
  // A frame of another size (larger): the pool's pages, then fresh ones.
  Region b(80);
  CHECK_EQ(pool.fill(b.p, b.n), a.n);
  CHECK_EQ(pool.bytes(), 0u);
  CHECK_EQ(pool.filled_bytes(), a.n);
  CHECK_EQ(b.resident_pages(), 64u);
  long before = minor_faults();
  // The moved pages' bytes came along: pages, not copies (which of the
  // freed pages went where does not matter to a frame about to be read).
  std::uint64_t sevens = 0;
  for (std::uint64_t pg = 0; pg < 64; ++pg) {
    char c = b.p[pg * kPg];
    sevens += c >= 7 && c < 7 + 64 && b.p[pg * kPg + kPg - 1] == c;
  }
  CHECK_EQ(sevens, 64u);
  if (!kSanitized) {
    CHECK(minor_faults() - before < 8);
  }
}

TEST_CASE("page_pool: it holds no more than its room, and nothing without one") {
  if (!PagePool::supported()) {
    return;
  }
  Region a(32);
  a.touch(1);
  PagePool none;
  CHECK_EQ(none.put(a.p, a.n, a.n), 0u);  // no room set: keeps nothing
  CHECK_EQ(a.resident_pages(), 32u);
  // Room for 20 pages once this frame's 32 are credited back.
  std::uint64_t charged = 40 * kPg;
  std::uint64_t budget = 28 * kPg;
  PagePool pool;
  pool.set_room([&](std::uint64_t freeing) {
    std::uint64_t stays = charged - freeing;
    return budget > stays ? budget - stays : 0;
  });
  CHECK_EQ(pool.put(a.p, a.n, 32 * kPg), 20 * kPg);
  CHECK_EQ(a.resident_pages(), 12u);  // the rest stays with the frame (freed to the OS)
  Region c(8);
  c.touch(2);
  CHECK_EQ(pool.put(c.p, c.n, 0), 0u);  // no room left
  // A budget that shrinks: trim_to_room lets go of the rest.
  budget = charged + 5 * kPg;
  CHECK_EQ(pool.trim_to_room(), 15 * kPg);
  CHECK_EQ(pool.bytes(), 5 * kPg);
  CHECK_EQ(pool.trim(0), 5 * kPg);
  CHECK_EQ(pool.bytes(), 0u);
  // Released (paging stopped): nothing is kept until the next fill.
  budget = charged + 64 * kPg;
  Region d(4);
  d.touch(3);
  CHECK_EQ(pool.release(), 0u);
  CHECK_EQ(pool.put(d.p, d.n, 0), 0u);
  Region f(4);
  CHECK_EQ(pool.fill(f.p, f.n), 0u);  // nothing to move, but paging again
  CHECK_EQ(pool.put(d.p, d.n, 0), 4 * kPg);
}

TEST_CASE("page_pool: only resident pages are taken, only unpopulated ones filled") {
  if (!PagePool::supported()) {
    return;
  }
  PagePool pool;
  pool.set_room(room_of(1 << 30));
  Region a(16);
  a.touch(3, 4, 12);  // pages 4..11 resident
  CHECK_EQ(pool.put(a.p, a.n, 0), 8 * kPg);
  // A target whose first half is populated already (a buffer from a cache):
  // its pages keep their bytes; only the unpopulated half takes the pool's.
  Region b(16);
  b.touch(50, 0, 8);
  CHECK_EQ(pool.fill(b.p, b.n), 8 * kPg);
  for (std::uint64_t pg = 0; pg < 8; ++pg) {
    CHECK_EQ(b.p[pg * kPg], static_cast<char>(50 + pg));
  }
  CHECK_EQ(b.resident_pages(), 16u);
  // Partial pages at the ends are not the pool's to move.
  Region c(4);
  c.touch(9);
  CHECK_EQ(pool.put(c.p + 100, 2 * kPg, 0), kPg);  // only the whole page inside
  CHECK_EQ(pool.fill(b.p, b.n), 0u);               // nothing unpopulated left
  CHECK_EQ(pool.bytes(), kPg);
}

TEST_CASE("page_pool: a frame filled from several pieces gives all its pages back") {
  if (!PagePool::supported()) {
    return;
  }
  PagePool pool;
  pool.set_room(room_of(1 << 30));
  Region a(8);
  Region b(8);
  a.touch(1);
  b.touch(20);
  CHECK_EQ(pool.put(a.p, a.n, 0), a.n);
  CHECK_EQ(pool.put(b.p, b.n, 0), b.n);
  // One frame from two pieces: its range is several mappings now.
  Region f(16);
  CHECK_EQ(pool.fill(f.p, f.n), 16 * kPg);
  CHECK_EQ(f.resident_pages(), 16u);
  CHECK_EQ(pool.put(f.p, f.n, 0), 16 * kPg);
  CHECK_EQ(f.resident_pages(), 0u);
  CHECK_EQ(pool.bytes(), 16 * kPg);
}
