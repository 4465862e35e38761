// Must not compile: the model must be a module holder or pointer with
// forward(Tensor).
#include <ddpkit/ddpkit.hpp>
ddpkit::Trainer<int, ddpkit::SingleDevice, ddpkit::RandomSampling,
                ddpkit::PlainBN>* t;
