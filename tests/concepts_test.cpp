// The policy concepts as a wall of positive and negative static_asserts:
// every shipped policy satisfies its concept, nothing satisfies one by
// accident, and the combination rules accept exactly the right pairs.
#include "ddpkit/ddpkit.hpp"
#include "support.hpp"

using namespace ddpkit;

namespace {
struct NotAPolicy {};
struct LooksLikeParallelButNoTag {
  static constexpr bool is_multi_process = true;
  static constexpr bool is_multi_replica = false;
};
struct MyScaling {  // a user policy, written from NoScaling's template
  using lr_scaling_concept = lr_scaling_tag;
  static double scale(double lr, int w) {
    return lr * (1 + 0.5 * (w - 1));
  }
};
using Holder = nn::CifarNet;
/// forward of two tensors (a model of several inputs), and of a string.
struct TwoInputs : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x, torch::Tensor m) {
    return x * m;
  }
};
struct TextInput : torch::nn::Module {
  torch::Tensor forward(const std::string&) {
    return {};
  }
};
using Ptr = std::shared_ptr<nn::CifarNetImpl>;
}  // namespace

// parallel policies
static_assert(parallel_policy<SingleDevice>);
static_assert(parallel_policy<DataParallel>);
static_assert(parallel_policy<DDP>);
static_assert(parallel_policy<DDPFp16>);
static_assert(parallel_policy<DDPBf16>);
static_assert(multi_process_policy<DDP>);
static_assert(!multi_process_policy<SingleDevice>);
static_assert(!multi_process_policy<DataParallel>);
static_assert(!parallel_policy<NotAPolicy>);
static_assert(!parallel_policy<LooksLikeParallelButNoTag>);
static_assert(!parallel_policy<RandomSampling>);
static_assert(is_parallel_policy_v<DDP>);
// samplers
static_assert(sampler_policy<SequentialSampling>);
static_assert(sampler_policy<RandomSampling>);
static_assert(sampler_policy<DistributedSampling>);
static_assert(sharding_sampler<DistributedSampling>);
static_assert(!sharding_sampler<RandomSampling>);
static_assert(!sampler_policy<NotAPolicy>);
static_assert(!sampler_policy<DDP>);
// BN policies
static_assert(bn_policy<PlainBN>);
static_assert(bn_policy<SyncBN>);
static_assert(!bn_policy<NotAPolicy>);
static_assert(!bn_policy<nn::BatchNorm2d>);
// LR scaling
static_assert(lr_scaling_policy<NoScaling>);
static_assert(lr_scaling_policy<LinearScaling>);
static_assert(lr_scaling_policy<SqrtScaling>);
static_assert(lr_scaling_policy<MyScaling>);
static_assert(!lr_scaling_policy<NotAPolicy>);
// reduction
static_assert(reduction_policy<RankZeroEval>);
static_assert(reduction_policy<ShardedEval>);
static_assert(!reduction_policy<PlainBN>);
// models
static_assert(trainable_model<Holder>);
static_assert(trainable_model<Ptr>);
static_assert(trainable_model<nn::ResNet>);
static_assert(!trainable_model<int>);
static_assert(
    !trainable_model<std::shared_ptr<torch::nn::Module>>);  // no forward
static_assert(trainable_model<std::shared_ptr<TwoInputs>>);
static_assert(!trainable_model<std::shared_ptr<TextInput>>);
// combinations
static_assert(sampler_matches_parallel_policy<DDP, DistributedSampling>);
static_assert(sampler_matches_parallel_policy<SingleDevice, RandomSampling>);
static_assert(
    sampler_matches_parallel_policy<DataParallel, SequentialSampling>);
static_assert(
    !sampler_matches_parallel_policy<SingleDevice, DistributedSampling>);
static_assert(!sampler_matches_parallel_policy<DDP, RandomSampling>);
static_assert(bn_matches_parallel_policy<DDP, SyncBN>);
static_assert(bn_matches_parallel_policy<DDP, PlainBN>);
static_assert(bn_matches_parallel_policy<SingleDevice, PlainBN>);
static_assert(!bn_matches_parallel_policy<SingleDevice, SyncBN>);
static_assert(!bn_matches_parallel_policy<DataParallel, SyncBN>);
// the named combinations are valid types
static_assert(
    std::is_class_v<DDPTrainer<Holder, SyncBN, LinearScaling, ShardedEval>>);
static_assert(std::is_class_v<SingleDeviceTrainer<Holder>>);
static_assert(std::is_class_v<DataParallelTrainer<nn::ResNet>>);

// Engine capabilities (Note [Engine capabilities]): what each shipped
// engine declares, each declaration kept, and an engine that has a method
// without declaring it (or declares it without the method) refused.
namespace capability_checks {
namespace cap = parallel::capability;
using parallel::declares;
using SD = SingleDevice::engine<Holder>;
using DP = DataParallel::engine<Holder>;
using D = DDP::engine<Holder>;
using Z1 = ZeRO1::engine<Holder>;
using Z2 = ZeRO2::engine<Holder>;
static_assert(declares<SD, cap::takes_inputs> &&
              declares<DP, cap::takes_inputs>);
static_assert(!declares<SD, cap::joins> &&
              !declares<SD, cap::shards_optimizer>);
static_assert(declares<D, cap::takes_inputs> && declares<D, cap::joins> &&
              declares<D, cap::measures_gradients> &&
              declares<D, cap::counts_traffic> && declares<D, cap::names_comm>);
static_assert(!declares<D, cap::shards_optimizer> &&
              !declares<D, cap::clips_globally>);
static_assert(declares<Z1, cap::shards_optimizer> && declares<Z1, cap::joins> &&
              !declares<Z1, cap::clips_globally>);
static_assert(declares<Z2, cap::shards_optimizer> &&
              declares<Z2, cap::clips_globally> &&
              declares<Z2, cap::names_mode>);
static_assert(engine_keeps_its_declarations<SD> &&
              engine_keeps_its_declarations<DP> &&
              engine_keeps_its_declarations<D> &&
              engine_keeps_its_declarations<Z1> &&
              engine_keeps_its_declarations<Z2>);
static_assert(engine_shards_optimizer<Z1> && engine_clips_globally<Z2> &&
              engine_joins<D> && engine_takes_inputs<SD>);
// Declared, then missing: refused, naming the capability.
struct ClaimsClipping : SD {
  using capabilities = SD::capabilities::with<cap::clips_globally>;
};
static_assert(!keeps_clips_globally<ClaimsClipping>);
static_assert(!engine_keeps_its_declarations<ClaimsClipping>);
// There, but not declared: refused for the two whose absence is wrong.
struct UndeclaredClipping : SD {
  using SD::SD;
  double clip_grad_norm(double, double) {
    return 0;
  }
};
static_assert(!declares_global_clipping<UndeclaredClipping>);
static_assert(!engine_keeps_its_declarations<UndeclaredClipping>);
// An engine that declares nothing: the base contract alone.
struct Plain : SD {
  using capabilities = parallel::capabilities<>;
};
static_assert(engine_keeps_its_declarations<Plain> &&
              !declares<Plain, cap::takes_inputs>);
}  // namespace capability_checks

// Callbacks: an event handled, named by its type; state only complete.
namespace callback_checks {
struct OnEpochEnd {
  void on(const train::EpochEnd&) {}
};
struct OldStyle {  // hooks under names fit never calls
  void on_epoch_end(const train::EpochMetrics&) {}
};
struct Stateful {
  static constexpr const char* name = "stateful";
  void on(const train::BatchEnd&) {}
  c10::IValue state() const {
    return 1;
  }
  void load_state(const c10::IValue&) {}
};
struct HalfStateful {  // state() without name and load_state
  void on(const train::BatchEnd&) {}
  c10::IValue state() const {
    return 1;
  }
};
static_assert(train::callback<OnEpochEnd>);
static_assert(train::callback<OnEpochEnd&>);
static_assert(!train::callback<OldStyle>);
static_assert(!train::callback<int>);
static_assert(train::callbacks<>);
static_assert(!train::callbacks<OnEpochEnd, OldStyle&>);
static_assert(train::stateful_callback<Stateful>);
static_assert(!train::stateful_callback<OnEpochEnd>);
static_assert(train::state_complete<OnEpochEnd>);
static_assert(train::state_complete<Stateful>);
static_assert(!train::state_complete<HalfStateful>);
}  // namespace callback_checks

TEST_SUITE("train") {
  TEST_CASE("a user LR-scaling policy plugs in") {
    CHECK(train::lr_at<MyScaling>(0.1, 3, {}, 0, 1) == doctest::Approx(0.2));
  }
}
