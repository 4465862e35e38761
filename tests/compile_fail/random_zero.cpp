// Must not compile: ZeRO ranks, like DDP's, would each draw from the whole
// dataset (and overlap) without distributed sampling.
#include <ddpkit/ddpkit.hpp>
ddpkit::Trainer<ddpkit::nn::CifarNet, ddpkit::ZeRO2, ddpkit::RandomSampling,
                ddpkit::PlainBN>* t;
