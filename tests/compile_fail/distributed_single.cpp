// Must not compile: a DistributedSampling shard with one process sees part of
// the data.
#include <ddpkit/ddpkit.hpp>
ddpkit::Trainer<ddpkit::nn::CifarNet, ddpkit::SingleDevice,
                ddpkit::DistributedSampling, ddpkit::PlainBN>* t;
