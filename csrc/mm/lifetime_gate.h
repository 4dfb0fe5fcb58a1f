// lifetime_gate.h: callbacks that may outlive an object reach it only while
// it lives.
//
// A lease on a page ends in the deleter of the last MLX array viewing its
// frame, and a lazy page (paged_tensor.h) is acquired when MLX evaluates it:
// both may come after the pager is gone (a Python user drops the Pager while
// a model still holds its views; the interpreter's exit frees them in any
// order). They hold the gate, shared with the object, instead of a pointer to
// it: run() calls them with the object while it lives and tells them when it
// is gone, and the object's destructor closes the gate first, waiting for the
// calls already running.
//
// Contract: the owner calls close() at the start of its destructor, before
// any of its members go. A callback must not close the gate it runs under,
// nor run() it again from inside (a waiting close() would block it).
#pragma once

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>

namespace mlx_pager {

template <typename T>
class LifetimeGate {
 public:
  explicit LifetimeGate(T* owner) : owner_(owner) {}
  LifetimeGate(const LifetimeGate&) = delete;
  LifetimeGate& operator=(const LifetimeGate&) = delete;

  // Calls f(owner) and returns true while the owner lives (calls on several
  // threads run at once); returns false, without calling f, once closed.
  template <typename F>
  bool run(F&& f) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (owner_ == nullptr) {
      return false;
    }
    std::forward<F>(f)(*owner_);
    return true;
  }

  // Waits for the calls running, and makes every later run() return false.
  void close() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    owner_ = nullptr;
  }

 private:
  std::shared_mutex mu_;
  T* owner_;  // guarded by mu_; null once closed
};

}  // namespace mlx_pager
