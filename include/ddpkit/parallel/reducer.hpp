// ddpkit's DDP gradient reducer (c10d's reducer.hpp is not usable with
// Debian's libtorch). Gradients are copied into flat buckets, in reverse
// parameter order, as backward produces them; a full bucket starts its
// all-reduce at once, so communication overlaps the rest of backward.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/dist/collectives.hpp"
#include "ddpkit/parallel/grad_comm.hpp"
#include "ddpkit/parallel/trace.hpp"

namespace ddpkit::parallel {

/// Reducer settings.
struct ReducerOptions {
  /// Bucket size cap (PyTorch: bucket_cap_mb = 25).
  TORCH_ARG(int64_t, bucket_cap_bytes) = 25 * 1024 * 1024;
  /// The first bucket (the last layers' gradients, ready first) is smaller,
  /// so communication starts early.
  TORCH_ARG(int64_t, first_bucket_cap_bytes) = 1024 * 1024;
  /// Parameters that get no gradient in a step are treated as zero (true),
  /// or are an error naming them (false).
  TORCH_ARG(bool, find_unused_parameters) = false;
};

/// One bucket: a flat buffer over some parameters' gradients.
struct Bucket {
  std::vector<std::size_t> params;  // indices into the reducer's parameters
  std::vector<int64_t> offsets;
  torch::Tensor flat;
  torch::Tensor scratch;  // the strategy's own buffer (e.g. fp16 copy)
  std::size_t pending = 0;
  bool launched = false;
  dist::compat::WorkPtr work;
  Trace::clock::time_point launch_time;
};

/// Averages the gradients of `params` across the ranks of `group` during
/// backward. Construct it once; every `backward()` afterwards leaves averaged
/// gradients in `.grad` by the time it returns (a callback queued on the
/// autograd engine waits for the last buckets).
///
/// Example:
/// ```
/// ddpkit::parallel::Reducer<> reducer(model->parameters(), group);
/// loss.backward();        // .grad now holds the average over ranks
/// {
///   auto guard = reducer.no_sync();
///   loss2.backward();     // accumulates locally
/// }
/// ```
template <class Comm = AllReduceMean>
class Reducer {
 public:
  Reducer(std::vector<torch::Tensor> params, std::vector<std::string> names,
          dist::Group group, ReducerOptions opts = {}, Trace* trace = nullptr)
      : group_(std::move(group)), opts_(opts), trace_(trace) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!params[i].requires_grad()) continue;
      params_.push_back(params[i]);
      names_.push_back(i < names.size() ? names[i]
                                        : "parameter " + std::to_string(i));
    }
    build_buckets();
    install_hooks();
  }

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  ~Reducer() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      try {
        params_[i].remove_hook(hooks_[i]);
      } catch (...) {
      }
    }
  }

  /// While alive, backward accumulates gradients locally without
  /// communicating (gradient accumulation); the next synced backward
  /// averages the accumulated sum.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(Reducer& r) : r_(r), prev_(r.enabled_) {
      r_.enabled_ = false;
    }
    ~NoSyncGuard() {
      r_.enabled_ = prev_;
    }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    Reducer& r_;
    bool prev_;
  };
  [[nodiscard]] NoSyncGuard no_sync() {
    return NoSyncGuard(*this);
  }

  const std::vector<Bucket>& buckets() const {
    return buckets_;
  }
  std::size_t num_parameters() const {
    return params_.size();
  }
  /// Seconds spent, in the last step, waiting for communication after
  /// backward had finished computing.
  double last_wait_seconds() const {
    return last_wait_seconds_;
  }
  bool sync_enabled() const {
    return enabled_;
  }

 private:
  void build_buckets() {
    // Reverse order: backward produces the last layers' gradients first.
    Bucket current;
    int64_t bytes = 0;
    int64_t cap = opts_.first_bucket_cap_bytes();
    auto close = [&] {
      if (current.params.empty()) return;
      int64_t total =
          current.offsets.back() + params_[current.params.back()].numel();
      current.flat =
          torch::zeros({total}, params_[current.params.front()].options());
      buckets_.push_back(std::move(current));
      current = Bucket{};
      bytes = 0;
      cap = opts_.bucket_cap_bytes();
    };
    for (std::size_t k = params_.size(); k-- > 0;) {
      const auto& p = params_[k];
      int64_t pbytes = p.numel() * static_cast<int64_t>(p.element_size());
      bool other_kind =
          !current.params.empty() &&
          (params_[current.params.front()].dtype() != p.dtype() ||
           params_[current.params.front()].device() != p.device());
      if (other_kind || (!current.params.empty() && bytes + pbytes > cap)) {
        close();
      }
      int64_t offset =
          current.params.empty()
              ? 0
              : current.offsets.back() + params_[current.params.back()].numel();
      current.params.push_back(k);
      current.offsets.push_back(offset);
      bytes += pbytes;
    }
    close();
    slot_bucket_.assign(params_.size(), 0);
    slot_offset_.assign(params_.size(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      for (std::size_t j = 0; j < buckets_[b].params.size(); ++j) {
        slot_bucket_[buckets_[b].params[j]] = b;
        slot_offset_[buckets_[b].params[j]] = buckets_[b].offsets[j];
      }
    }
    ready_.assign(params_.size(), false);
    reset_step();
  }

  void install_hooks() {
    hooks_.resize(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      hooks_[i] = params_[i].register_hook(
          [this, i](const torch::Tensor& grad) { on_grad(i, grad); });
    }
  }

  void reset_step() {
    std::fill(ready_.begin(), ready_.end(), false);
    for (auto& b : buckets_) {
      b.pending = b.params.size();
      b.launched = false;
      b.work.reset();
    }
    next_to_launch_ = 0;
    callback_queued_ = false;
    local_accumulation_ = false;
  }

  torch::Tensor view_of(std::size_t i) {
    auto& b = buckets_[slot_bucket_[i]];
    return b.flat.narrow(0, slot_offset_[i], params_[i].numel())
        .view(params_[i].sizes());
  }

  // Runs on the autograd thread as parameter i's gradient arrives (before it
  // is accumulated into .grad).
  void on_grad(std::size_t i, const torch::Tensor& grad) {
    if (!enabled_) {
      local_accumulation_ = true;
      return;
    }
    if (!callback_queued_) {
      callback_queued_ = true;
      torch::autograd::Engine::get_default_engine().queue_callback(
          [this] { finalize(); });
    }
    if (ready_[i]) return;  // a second backward through the same graph
    torch::NoGradGuard no_grad;
    auto view = view_of(i);
    view.copy_(grad);
    // After no_sync steps, .grad holds what was accumulated locally: the
    // average must cover it too. (Otherwise .grad is zero or undefined after
    // zero_grad, and adding it would be a wasted pass over the gradients.)
    if (local_accumulation_) {
      const auto& acc = params_[i].grad();
      if (acc.defined()) view.add_(acc);
    }
    mark_ready(i);
  }

  void mark_ready(std::size_t i) {
    ready_[i] = true;
    auto& b = buckets_[slot_bucket_[i]];
    if (--b.pending == 0) launch_ready_in_order();
  }

  // Buckets start strictly in index order on every rank, so the sequence of
  // collectives is the same everywhere even if gradients arrive in another
  // order.
  void launch_ready_in_order() {
    while (next_to_launch_ < buckets_.size() &&
           buckets_[next_to_launch_].pending == 0) {
      auto& b = buckets_[next_to_launch_];
      b.launch_time = Trace::clock::now();
      b.work = Comm::start(group_, b.flat, b.scratch);
      b.launched = true;
      ++next_to_launch_;
    }
  }

  void finalize() {
    torch::NoGradGuard no_grad;
    auto t0 = Trace::clock::now();
    // Parameters that got no gradient this step.
    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!ready_[i]) missing.push_back(i);
    }
    if (!missing.empty()) {
      if (!opts_.find_unused_parameters()) {
        std::string list;
        for (std::size_t k = 0; k < missing.size() && k < 10; ++k) {
          list += (k ? ", " : "") + names_[missing[k]];
        }
        if (missing.size() > 10) list += ", ...";
        reset_step();
        throw Error(ddpkit::detail::cat("DDP: ", missing.size(),
                                        " parameter(s) received no gradient in "
                                        "this backward: ",
                                        list,
                                        ". Either use them in forward or set "
                                        "find_unused_parameters(true)."));
      }
      for (auto i : missing) {
        auto view = view_of(i);
        const auto& acc = params_[i].grad();
        if (acc.defined()) {
          view.copy_(acc);
        } else {
          view.zero_();
        }
        mark_ready(i);
      }
    }
    // Wait for every bucket and write the averages back.
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      auto& b = buckets_[bi];
      if (!b.launched) {
        throw Error("DDP reducer: a bucket was never launched (internal)");
      }
      dist::detail::wait(group_, b.work, "gradient all-reduce");
      Comm::finish(b.flat, b.scratch);
      if (trace_) {
        trace_->record("allreduce bucket " + std::to_string(bi), b.launch_time,
                       Trace::clock::now(), 1);
      }
      for (std::size_t j = 0; j < b.params.size(); ++j) {
        auto& p = params_[b.params[j]];
        auto view = b.flat.narrow(0, b.offsets[j], p.numel()).view(p.sizes());
        if (p.grad().defined()) {
          p.mutable_grad().copy_(view);
        } else {
          p.mutable_grad() = view.clone();
        }
      }
    }
    auto t1 = Trace::clock::now();
    last_wait_seconds_ = std::chrono::duration<double>(t1 - t0).count();
    if (trace_) trace_->record("wait after backward", t0, t1, 0);
    reset_step();
  }

  dist::Group group_;
  ReducerOptions opts_;
  Trace* trace_;
  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<unsigned> hooks_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> slot_bucket_;
  std::vector<int64_t> slot_offset_;
  std::vector<bool> ready_;
  std::size_t next_to_launch_ = 0;
  bool callback_queued_ = false;
  bool enabled_ = true;
  // A backward ran under no_sync since the last synced one.
  bool local_accumulation_ = false;
  double last_wait_seconds_ = 0;
};

}  // namespace ddpkit::parallel
