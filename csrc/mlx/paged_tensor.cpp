#include "mlx/paged_tensor.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include <mlx/allocator.h>
#include <mlx/ops.h>
#include <mlx/primitives.h>
#include <mlx/scheduler.h>
#include <mlx/transforms.h>

namespace mlx_pager {
namespace {

class PagedTensors : public mx::Primitive {
 public:
  PagedTensors(mx::Stream s, TensorPager& tp, PageId page, std::vector<bool> copy)
      : mx::Primitive(s),
        gate_(tp.gate()),
        page_(page),
        name_(tp.pager().spec(page).name),
        copy_(std::move(copy)) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>& outputs) override {
    eval(outputs);
  }
  // The frame is MLX's own memory on every backend (mlx_frames.h): sharing
  // it needs no device work.
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>& outputs) override {
    eval(outputs);
  }
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>&,
      const std::vector<int>& argnums,
      const std::vector<mx::array>&) override {
    std::vector<mx::array> out;
    for (int i : argnums) {
      out.push_back(mx::zeros_like(primals[i], stream()));
    }
    return out;
  }
  const char* name() const override { return "PagedTensors"; }

 private:
  void eval(std::vector<mx::array>& outputs) {
    // The graph may outlive the pager (a Python user drops it first).
    if (!gate_->run([&](TensorPager& tp) { eval(tp, outputs); })) {
      throw std::runtime_error(
          "[lazy_page] page '" + name_ +
          "' is evaluated after its Pager was destroyed: evaluate lazy pages (or drop the "
          "arrays built on them) while the Pager lives");
    }
  }

  void eval(TensorPager& tp, std::vector<mx::array>& outputs) {
    // This runs when MLX submits the op, ahead of the stream that computes.
    // A page not in memory (nor on its way) needs room, which earlier pages
    // the stream still computes with may hold. Wait until the pager's
    // readahead starts this page (it does once the stream frees one of
    // them, so the read overlaps the compute still queued), or until the
    // stream has drained, and fault it in then. A synchronize instead would
    // wait for all the queued compute before the read even starts.
    if (tp.pager().state(page_) == PageState::on_disk) {
      if (stream().device == mx::Device::cpu) {
        auto drained = std::make_shared<std::atomic<bool>>(false);
        mx::scheduler::enqueue(stream(), [drained] { drained->store(true); });
        tp.pager().wait_off_disk(page_, *drained);
      } else {
        // A GPU stream's work is not on the scheduler's queue.
        mx::synchronize(stream());
      }
    }
    // Leased: the views release the page when MLX frees the last of them,
    // so the pager counts it in use exactly while the graph computes with
    // it (a page released here could be evicted under its views, and
    // evicting it would free nothing until they go).
    NamedArrays arrays = tp.acquire_leased(page_);
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const mx::array& view = arrays.at(i).second;
      if (i < copy_.size() && copy_[i]) {
        outputs[i].set_data(mx::allocator::malloc(view.nbytes()));
        std::memcpy(outputs[i].data<char>(), view.data<char>(), view.nbytes());
      } else {
        outputs[i].copy_shared_buffer(view);
      }
    }
    arrays.clear();  // copies need no lease: it ends once the views are gone
  }

  std::shared_ptr<LifetimeGate<TensorPager>> gate_;
  PageId page_;
  std::string name_;  // for the error once the pager is gone
  std::vector<bool> copy_;
};

}  // namespace

std::vector<mx::array> paged_tensors(
    TensorPager& tp, PageId page, const mx::array& after, const std::vector<bool>& copy) {
  auto specs = tp.specs(page);
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (auto& [dtype, shape] : specs) {
    dtypes.push_back(dtype);
    shapes.push_back(shape);
  }
  auto s = mx::default_stream(mx::default_device());
  return mx::array::make_arrays(
      std::move(shapes), dtypes, std::make_shared<PagedTensors>(s, tp, page, copy), {after});
}

}  // namespace mlx_pager
