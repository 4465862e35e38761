// SPDX-License-Identifier: BSD-3-Clause
// SingleDevice: the model on one device, no communication. It is also the
// reference parallel policy: copy it to write your own.
#pragma once

#include <utility>

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/inputs.hpp"
#include "ddpkit/distributed/process_group.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"

namespace ddpkit::parallel {

/// Options every parallel policy understands; a policy may extend them.
struct SingleDeviceOptions {};

/// The model on one device.
///
/// A parallel policy is a class with `parallel_concept = parallel_tag`,
/// `is_multi_process`, `is_multi_replica`, an `options_type`, and a nested
/// `engine<Model>` with: a constructor `(Model, dist::Group, options_type,
/// torch::Device)`, `module()`, `forward(x)`, `forward_backward(x, y,
/// loss_fn)` returning `StepOutput`, `zero_grad()`, `no_sync()`,
/// `unscale_and_check(LossScaler&)` and `last_wait_seconds()`.
struct SingleDevice {
  using parallel_concept = parallel_tag;
  static constexpr bool is_multi_process = false;
  static constexpr bool is_multi_replica = false;
  static constexpr const char* name = "single";
  using options_type = SingleDeviceOptions;

  template <class Model>
  class engine : public OneProcessGradients<engine<Model>> {
   public:
    /// See Note [Engine capabilities].
    using capabilities =
        ::ddpkit::parallel::capabilities<capability::takes_inputs>;
    engine(Model model, dist::Group, options_type, torch::Device device)
        : model_(std::move(model)), device_(device) {
      as_module(model_).to(device_);
    }

    Model& module() {
      return model_;
    }
    torch::Device device() const {
      return device_;
    }

    torch::Tensor forward(const data::Inputs& x) {
      return data::forward_inputs(model_, x);
    }

    template <class LossFn>
    StepOutput forward_backward(const data::Inputs& x, const torch::Tensor& y,
                                LossFn&& loss_fn) {
      auto out = data::forward_inputs(model_, x);
      auto loss = loss_fn(out, y);
      loss.backward();
      return {loss.detach(), out.detach()};
    }

   private:
    Model model_;
    torch::Device device_;
  };
};

}  // namespace ddpkit::parallel
