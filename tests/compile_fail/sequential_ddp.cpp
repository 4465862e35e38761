// Must not compile: DDP ranks would all train on the same samples.
#include <ddpkit/ddpkit.hpp>
ddpkit::Trainer<ddpkit::nn::CifarNet, ddpkit::DDP, ddpkit::SequentialSampling,
                ddpkit::PlainBN>* t;
