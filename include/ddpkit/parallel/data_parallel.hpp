// SPDX-License-Identifier: BSD-3-Clause
// DataParallel: one process, N replicas over a device list. Each step the
// batch is split, every replica runs forward and backward on its part in
// its own thread, gradients are summed into the master, and the replicas
// are refreshed from the master before the next step. On CPU the devices
// are all `cpu` (N threads), so the policy is testable anywhere; on CUDA,
// one replica per GPU.
#pragma once

#include <exception>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/inputs.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/process_group.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/single_device.hpp"

namespace ddpkit::parallel {

/// DataParallel settings.
struct DataParallelOptions {
  /// Replicas. On CUDA, one per device `cuda:0..n-1` (0: every visible GPU);
  /// on CPU, threads (0: 2).
  TORCH_ARG(int, replicas) = 0;
  /// Explicit device list; overrides `replicas` when not empty.
  TORCH_ARG(std::vector<torch::Device>, devices) = {};
};

/// One process, several replicas of the model, the batch split between them.
/// Like PyTorch's `nn.DataParallel`, BatchNorm buffers follow replica 0.
struct DataParallel {
  using parallel_concept = parallel_tag;
  static constexpr bool is_multi_process = false;
  static constexpr bool is_multi_replica = true;
  static constexpr const char* name = "dp";
  using options_type = DataParallelOptions;

  template <class Model>
  class engine : public OneProcessGradients<engine<Model>> {
    static_assert(
        requires { typename Model::ContainedType; },
        "DataParallel needs a module holder (TORCH_MODULE) whose "
        "Impl derives from torch::nn::Cloneable<Impl>, so replicas "
        "can be cloned");
    using Impl = typename Model::ContainedType;

   public:
    /// See Note [Engine capabilities].
    using capabilities =
        ::ddpkit::parallel::capabilities<capability::takes_inputs>;
    engine(Model model, dist::Group, options_type opts, torch::Device device)
        : model_(std::move(model)) {
      devices_ = opts.devices();
      if (devices_.empty()) {
        int n = opts.replicas();
        if (device.is_cuda()) {
          int visible = static_cast<int>(torch::cuda::device_count());
          if (n == 0) n = visible;
          if (n > visible) {
            throw UsageError(ddpkit::detail::cat(
                "DataParallel: ", n, " replicas requested but only ", visible,
                " GPU(s) are visible"));
          }
          for (int k = 0; k < n; ++k) devices_.emplace_back(torch::kCUDA, k);
        } else {
          if (n == 0) n = 2;
          devices_.assign(static_cast<std::size_t>(n),
                          torch::Device(torch::kCPU));
        }
      }
      if (devices_.empty()) {
        throw UsageError("DataParallel: at least one replica is needed");
      }
      model_->to(devices_[0]);
      for (std::size_t k = 1; k < devices_.size(); ++k) {
        auto clone =
            std::dynamic_pointer_cast<Impl>(model_->clone(devices_[k]));
        replicas_.emplace_back(clone);
      }
    }

    Model& module() {
      return model_;
    }
    torch::Device device() const {
      return devices_[0];
    }
    std::size_t num_replicas() const {
      return devices_.size();
    }
    /// Replica `k` (0: the model itself, whose gradients the step sums
    /// into; the others hold their own part's gradient until the next step).
    Model& replica(std::size_t k) {
      if (k >= devices_.size()) {
        throw UsageError(ddpkit::detail::cat("DataParallel: replica ", k,
                                             " of ", devices_.size()));
      }
      return k == 0 ? model_ : replicas_[k - 1];
    }
    /// The rows of the last step's batch that each replica ran forward and
    /// backward on (0 for a replica that had no part: a batch smaller than
    /// the replica count). PyTorch's split: the first `n % replicas` parts
    /// are one row longer.
    const std::vector<int64_t>& last_split() const {
      return last_split_;
    }

    torch::Tensor forward(const data::Inputs& x) {
      return data::forward_inputs(model_, x);
    }

    template <class LossFn>
    StepOutput forward_backward(const data::Inputs& x, const torch::Tensor& y,
                                LossFn&& loss_fn) {
      const int64_t n = x.rows();
      const auto used = static_cast<std::size_t>(
          std::min<int64_t>(n, static_cast<int64_t>(devices_.size())));
      // Each input tensor split the same way (PyTorch's scatter of a tuple).
      auto xs = x.split(static_cast<int64_t>(used));
      auto ys = y.tensor_split(static_cast<int64_t>(used));
      refresh_replicas(used);
      std::vector<torch::Tensor> outs(used), losses(used);
      std::vector<std::exception_ptr> errors(used);
      last_split_.assign(devices_.size(), 0);
      // Autocast is per thread: the replicas' threads take this thread's
      // (PyTorch's parallel_apply does the same).
      const auto autocast = ddpkit::compat::autocast_state(devices_[0].type());
      auto run = [&](std::size_t k) {
        try {
          std::optional<ddpkit::compat::AutocastGuard> ac;
          if (k > 0 && autocast.enabled) ac.emplace(autocast);
          auto dev = devices_[k];
          // This thread's CUDA work on replica k's device.
          ddpkit::compat::CudaDeviceScope on_device(dev);
          auto xk =
              xs[k].map([&](const torch::Tensor& t) { return t.to(dev); });
          auto yk = ys[k].to(dev);
          auto out =
              data::forward_inputs(k == 0 ? model_ : replicas_[k - 1], xk);
          // Weight each part by its share so the sum of the parts' gradients
          // is the gradient of the whole batch's mean loss.
          const int64_t rows = xk.rows();
          auto share = static_cast<double>(rows) / static_cast<double>(n);
          auto loss = loss_fn(out, yk) * share;
          loss.backward();
          outs[k] = out.detach().to(devices_[0]);
          losses[k] = loss.detach().to(devices_[0]);
          last_split_[k] = rows;
        } catch (...) {
          errors[k] = std::current_exception();
        }
      };
      std::vector<std::thread> threads;
      for (std::size_t k = 1; k < used; ++k) threads.emplace_back(run, k);
      run(0);
      for (auto& t : threads) t.join();
      for (auto& e : errors) {
        if (e) std::rethrow_exception(e);
      }
      reduce_gradients(used);
      auto loss = losses[0];
      for (std::size_t k = 1; k < used; ++k) loss = loss + losses[k];
      return {loss, torch::cat(outs)};
    }

    // zero_grad, no_sync, unscale_and_check and last_wait_seconds come from
    // OneProcessGradients: the replicas' gradients are summed into the
    // master's each step (and cleared when the replicas are refreshed).

   private:
    void refresh_replicas(std::size_t used) {
      torch::NoGradGuard no_grad;
      auto master_params = model_->parameters();
      auto master_buffers = model_->buffers();
      for (std::size_t k = 1; k < used; ++k) {
        auto params = replicas_[k - 1]->parameters();
        for (std::size_t i = 0; i < params.size(); ++i) {
          params[i].copy_(master_params[i]);
          params[i].mutable_grad() = torch::Tensor();
        }
        auto buffers = replicas_[k - 1]->buffers();
        for (std::size_t i = 0; i < buffers.size(); ++i) {
          buffers[i].copy_(master_buffers[i]);
        }
      }
    }

    void reduce_gradients(std::size_t used) {
      torch::NoGradGuard no_grad;
      auto master = model_->parameters();
      for (std::size_t k = 1; k < used; ++k) {
        auto params = replicas_[k - 1]->parameters();
        for (std::size_t i = 0; i < params.size(); ++i) {
          const auto& g = params[i].grad();
          if (!g.defined()) continue;
          auto gm = g.to(master[i].device());
          if (master[i].grad().defined()) {
            master[i].mutable_grad().add_(gm);
          } else {
            master[i].mutable_grad() = gm.clone();
          }
        }
      }
    }

    Model model_;
    std::vector<Model> replicas_;
    std::vector<torch::Device> devices_;
    std::vector<int64_t> last_split_;
  };
};

}  // namespace ddpkit::parallel
