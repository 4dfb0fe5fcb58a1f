// paged_tensor.h: a page's tensors as lazy MLX arrays that fault the page in
// when MLX evaluates them, inside a graph.
//
// TensorPager::acquire gives a page's tensors now; a graph that must not
// hold a page from one use to the next (a segment's forward and backward in
// one vjp, segment.py/stream.py) needs them later: when MLX reaches them in
// evaluation order. paged_tensors() returns arrays whose primitive, when
// evaluated, acquires the page (reading it if needed, and blocking while the
// page budget is full: the budget throttles how far MLX's graph submission
// runs ahead; a page on disk waits for readahead to start it, which it does
// once the stream frees an earlier page, or for the stream to drain), makes each output either a
// view of the page's frame (no copy; the frame lives while the view does) or, where `copy` says so,
// a copy in its own buffer (for a tensor the graph keeps long after the page's use). The views
// hold a lease on the page (TensorPager::acquire_leased): the pager counts it in use until MLX
// frees the last of them, then it may be evicted. The one input `after` orders the read: the page
// is acquired once `after` is submitted, never earlier (MLX evaluates inputs first; a lazy array
// without inputs, such as Load, may be read as soon as the evaluation starts).
//
// The arrays (and graphs holding them) may outlive `tp`: evaluated after it
// is gone, they throw std::runtime_error naming the page; views already
// evaluated keep their frame's memory. The outputs are not differentiable (their cotangent for
// `after` is zero); use them where nothing differentiates them, or behind a custom vjp.
#pragma once

#include <vector>

#include <mlx/array.h>

#include "mlx/tensor_pager.h"

namespace mlx_pager {

// The page's tensors in registration order; copy[i]: tensor i gets a buffer
// of its own (empty `copy`: all are views).
std::vector<mx::array> paged_tensors(
    TensorPager& tp, PageId page, const mx::array& after, const std::vector<bool>& copy);

}  // namespace mlx_pager
