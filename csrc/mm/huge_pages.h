// huge_pages.h: direct reads land in huge pages where the platform has them.
//
// A direct read is DMA into the destination's physical pages. Into memory
// of scattered 4 KiB pages the kernel builds requests of many small
// segments, and how fast the device then fills them depends on where the
// pages happen to lie: on the dev VM (NVMe-backed volume), 1 GiB read into
// each of eight fresh 64 MiB buffers in turn, 4 threads x 8 MiB chunks,
// ran 1.18-1.65 GB/s by buffer, steady per buffer (its four reads within
// 9%), and four
// buffers read in turn, interleaved, 1.42-1.57 / 1.88-2.02 / 2.07-2.23 /
// 2.17-2.30 GB/s. Buffers whose whole 2 MiB runs are transparent huge
// pages read 2.40-2.71 GB/s, every one of them. A process's frames keep
// their physical pages (page_pool.h), so the pager read at one buffer's
// luck for a whole run: the read shape at one block of budget, in parts,
// 1.57-1.99 GB/s a run with 4 KiB pages, 2.40-2.50 with huge pages, its
// step 0.73-0.91 s against 0.60-0.62 s.
//
// Frames filled from the page pool (page_pool.h) are not huge pages: its
// mremap moves between addresses of different 2 MB phase split them (22-37
// MB of AnonHugePages in ~590 MB resident, read shape at 25%). A split huge
// page keeps its physical memory contiguous, which is what the read rate
// depends on; the step was no faster with the pool off and every frame huge.
//
// advise_huge_pages() asks for huge pages on the whole huge pages inside a
// range, before anything touches it (the fault then maps a huge page), and
// never outside the range: the bytes at its ends stay in small pages, so a
// frame costs what it did. Platform: Linux (madvise MADV_HUGEPAGE, with
// transparent huge pages not set to "never"); elsewhere a no-op (macOS has
// no such advice; Apple silicon's pages are 16 KiB).
#pragma once

#include <cstdint>

namespace mlx_pager {

// The huge page size advise_huge_pages works in (2 MiB on x86-64 Linux),
// or 0 where there are none to ask for: another platform, or Linux with
// transparent huge pages off ("never", or a kernel without them).
std::uint64_t huge_page_bytes();

// Advises the whole huge pages inside [p, p + n) to be mapped as huge
// pages. Returns the bytes advised (0: none: the range holds no whole huge
// page, or huge_page_bytes() is 0, or the kernel refused).
std::uint64_t advise_huge_pages(void* p, std::uint64_t n);

}  // namespace mlx_pager
