// Must not compile: an engine that declares it shards the optimizer state
// but misspells one of the methods (the Trainer would otherwise skip the
// consolidation before a checkpoint and save one rank's shard).
#include <ddpkit/ddpkit.hpp>
struct MisspeltZeRO {
  using parallel_concept = ddpkit::parallel_tag;
  static constexpr bool is_multi_process = false;
  static constexpr bool is_multi_replica = false;
  using options_type = ddpkit::parallel::SingleDevice::options_type;
  template <class Model>
  struct engine : ddpkit::parallel::SingleDevice::engine<Model> {
    using base = ddpkit::parallel::SingleDevice::engine<Model>;
    using base::base;
    using capabilities = typename base::capabilities::template with<
        ddpkit::parallel::capability::shards_optimizer>;
    std::unique_ptr<torch::optim::Optimizer> make_optimizer(
        ddpkit::parallel::OptimizerFactory make) {
      return make(this->module()->parameters());
    }
    void consolidate_optimzer() {}  // misspelt
    std::uint64_t gather_buffer_bytes() const {
      return 0;
    }
  };
};
ddpkit::Trainer<ddpkit::nn::CifarNet, MisspeltZeRO, ddpkit::RandomSampling,
                ddpkit::PlainBN>* t;
