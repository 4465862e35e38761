// SPDX-License-Identifier: BSD-3-Clause
// The policy concepts, and nothing else. Each concept is built from
// one-requirement pieces so a failed check names the missing piece; each
// policy opts in with a tag so nothing matches by accident.
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

namespace ddpkit {

// Opt-in tags: a policy says `using parallel_concept = ddpkit::parallel_tag;`.
struct parallel_tag {};
struct sampler_tag {};
struct bn_tag {};
struct lr_scaling_tag {};
struct reduction_tag {};

// ---- samplers --------------------------------------------------------------

template <class S>
concept declares_sampler_tag =
    std::same_as<typename S::sampler_concept, sampler_tag>;

template <class S>
concept yields_index_batches = requires(S s, std::size_t n) {
  typename S::BatchRequestType;
  // libtorch's optional (c10::optional in 1.x, std::optional in 2.x).
  { *s.next(n) } -> std::convertible_to<std::vector<std::size_t>>;
  { static_cast<bool>(s.next(n)) };
  s.reset();
};

template <class S>
concept follows_epochs = requires(S s, std::size_t e) { s.set_epoch(e); };

template <class S>
concept says_if_distributed = requires {
  { S::is_distributed } -> std::convertible_to<bool>;
};

/// A sampler usable by the Trainer (and by `torch::data::make_data_loader`).
template <class S>
concept sampler_policy = declares_sampler_tag<S> && yields_index_batches<S> &&
                         follows_epochs<S> && says_if_distributed<S>;

/// A sampler that gives each rank its own shard.
template <class S>
concept sharding_sampler = sampler_policy<S> && S::is_distributed;

template <class S>
inline constexpr bool is_sampler_policy_v = sampler_policy<S>;

// ---- parallel policies ------------------------------------------------------

template <class P>
concept declares_parallel_tag =
    std::same_as<typename P::parallel_concept, parallel_tag>;

template <class P>
concept says_if_multi_process = requires {
  { P::is_multi_process } -> std::convertible_to<bool>;
};

template <class P>
concept says_if_multi_replica = requires {
  { P::is_multi_replica } -> std::convertible_to<bool>;
};

/// SingleDevice, DataParallel, DDP, or your own.
template <class P>
concept parallel_policy = declares_parallel_tag<P> &&
                          says_if_multi_process<P> && says_if_multi_replica<P>;

/// A policy that runs one process per device and so needs a sharding sampler
/// and may synchronise batch-norm statistics across processes.
template <class P>
concept multi_process_policy = parallel_policy<P> && P::is_multi_process;

template <class P>
inline constexpr bool is_parallel_policy_v = parallel_policy<P>;

// What a policy's engine must offer (`parallel_engine`) is in
// ddpkit/parallel/engine.hpp, beside the engines.

// ---- batch-norm policies ----------------------------------------------------

template <class B>
concept declares_bn_tag = std::same_as<typename B::bn_concept, bn_tag>;

template <class B>
concept says_if_synchronized = requires {
  { B::is_synchronized } -> std::convertible_to<bool>;
};

/// PlainBN or SyncBN.
template <class B>
concept bn_policy = declares_bn_tag<B> && says_if_synchronized<B>;

template <class B>
inline constexpr bool is_bn_policy_v = bn_policy<B>;

// ---- LR scaling -------------------------------------------------------------

template <class L>
concept declares_lr_scaling_tag =
    std::same_as<typename L::lr_scaling_concept, lr_scaling_tag>;

template <class L>
concept scales_lr = requires(double lr, int world) {
  { L::scale(lr, world) } -> std::convertible_to<double>;
};

/// NoScaling, LinearScaling, SqrtScaling, or your own.
template <class L>
concept lr_scaling_policy = declares_lr_scaling_tag<L> && scales_lr<L>;

template <class L>
inline constexpr bool is_lr_scaling_policy_v = lr_scaling_policy<L>;

// ---- metric reduction -------------------------------------------------------

template <class R>
concept declares_reduction_tag =
    std::same_as<typename R::reduction_concept, reduction_tag>;

template <class R>
concept says_who_evaluates = requires {
  { R::shards_evaluation } -> std::convertible_to<bool>;
};

/// How validation is computed and shared: on rank 0 and broadcast, or
/// sharded and all-reduced.
template <class R>
concept reduction_policy = declares_reduction_tag<R> && says_who_evaluates<R>;

template <class R>
inline constexpr bool is_reduction_policy_v = reduction_policy<R>;

// ---- models and combinations ------------------------------------------------

template <class M>
concept is_module_pointer = requires(M m) {
  requires std::derived_from<std::remove_cvref_t<decltype(*m)>,
                             torch::nn::Module>;
};

/// `forward` takes one to four tensors (a batch's `data::Inputs`) and
/// returns a tensor.
template <class M>
concept has_tensor_forward = requires(M m, torch::Tensor x) {
  { m->forward(x) } -> std::convertible_to<torch::Tensor>;
} || requires(M m, torch::Tensor x) {
  { m->forward(x, x) } -> std::convertible_to<torch::Tensor>;
} || requires(M m, torch::Tensor x) {
  { m->forward(x, x, x) } -> std::convertible_to<torch::Tensor>;
} || requires(M m, torch::Tensor x) {
  { m->forward(x, x, x, x) } -> std::convertible_to<torch::Tensor>;
};

/// A module holder (`TORCH_MODULE`) or `std::shared_ptr` to a module whose
/// `forward` takes one to four tensors and returns the output (logits).
template <class M>
concept trainable_model = is_module_pointer<M> && has_tensor_forward<M>;

/// One process per device needs a sampler that shards; one process must not
/// use one (it would see only part of the data).
template <class Parallel, class Sampler>
concept sampler_matches_parallel_policy =
    parallel_policy<Parallel> && sampler_policy<Sampler> &&
    // Fix: DDP takes DistributedSampling; SingleDevice/DataParallel take
    // RandomSampling or SequentialSampling.
    (Parallel::is_multi_process == Sampler::is_distributed);

/// Synchronised batch norm needs several processes to synchronise.
template <class Parallel, class BN>
concept bn_matches_parallel_policy =
    parallel_policy<Parallel> && bn_policy<BN> &&
    // Fix: SyncBN needs a multi-process policy (DDP); use PlainBN otherwise.
    (!BN::is_synchronized || Parallel::is_multi_process);

}  // namespace ddpkit
