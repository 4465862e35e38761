// Must not compile: a callback with hooks under names fit does not call
// (the old duck-typed spelling), which would otherwise be silently ignored.
#include <ddpkit/ddpkit.hpp>
struct OldStyleHooks {
  void on_epoch_end(const ddpkit::train::EpochMetrics&) {}
};
inline void t(ddpkit::Trainer<ddpkit::nn::CifarNet, ddpkit::SingleDevice,
                              ddpkit::RandomSampling, ddpkit::PlainBN>& trainer,
              const ddpkit::data::ImageTensors& set) {
  trainer.fit(set, set, ddpkit::data::CifarEval{}, ddpkit::data::CifarEval{},
              ddpkit::data::LoaderOptions(8), OldStyleHooks{});
}
