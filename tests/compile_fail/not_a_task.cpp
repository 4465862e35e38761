// Must not compile: a loss functor is not a task (no tag, no metrics, no
// monitored metric).
#include <ddpkit/ddpkit.hpp>
struct MyLoss {
  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) const {
    return torch::mse_loss(out, y);
  }
};
ddpkit::Trainer<ddpkit::nn::CifarNet, ddpkit::SingleDevice,
                ddpkit::RandomSampling, ddpkit::PlainBN, ddpkit::NoScaling,
                ddpkit::RankZeroEval, MyLoss>* t;
