// Must not compile: SyncBN needs several processes.
#include <ddpkit/ddpkit.hpp>
ddpkit::Trainer<ddpkit::nn::CifarNet, ddpkit::SingleDevice,
                ddpkit::RandomSampling, ddpkit::SyncBN>* t;
