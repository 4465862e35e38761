// Must not compile: a parallel policy whose engine has no zero_grad (the
// Trainer zeroes gradients only through the engine).
#include <ddpkit/ddpkit.hpp>
struct NoZeroGrad {
  using parallel_concept = ddpkit::parallel_tag;
  static constexpr bool is_multi_process = false;
  static constexpr bool is_multi_replica = false;
  using options_type = ddpkit::parallel::SingleDevice::options_type;
  template <class Model>
  struct engine : ddpkit::parallel::SingleDevice::engine<Model> {
    using ddpkit::parallel::SingleDevice::engine<Model>::engine;
    void zero_grad() = delete;
  };
};
ddpkit::Trainer<ddpkit::nn::CifarNet, NoZeroGrad, ddpkit::RandomSampling,
                ddpkit::PlainBN>* t;
