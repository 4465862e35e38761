// Must not compile: a type that does not opt in as a parallel policy.
#include <ddpkit/ddpkit.hpp>
struct MyParallel {
  static constexpr bool is_multi_process = false;
  static constexpr bool is_multi_replica = false;
};
ddpkit::Trainer<ddpkit::nn::CifarNet, MyParallel, ddpkit::RandomSampling,
                ddpkit::PlainBN>* t;
