// SPDX-License-Identifier: BSD-3-Clause
// The prefetching loader: worker threads fetch, decode and augment batches
// ahead of the training loop into a bounded window, handed out in order.
// Every batch's randomness is seeded from (seed, epoch, rank, batch index),
// so the batches are the same whatever the number of workers.
#pragma once

#ifdef __linux__
#include <pthread.h>
#endif

#include <algorithm>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/inputs.hpp"
#include "ddpkit/data/transforms.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/seed.hpp"
#include "ddpkit/detail/strings.hpp"

namespace ddpkit::data {

/// One batch: the model's input and the task's target (images: `data`
/// float N×3×H×W, `target` int64 N; a language model: int64 N×T both). A
/// model whose forward takes several tensors gets `data` and then `extra`'s.
struct Batch {
  torch::Tensor data;
  torch::Tensor target;
  /// The model's further inputs, after `data` (empty for a forward of one
  /// tensor).
  std::vector<torch::Tensor> extra = {};

  /// `data` and `extra`, as the engines take them.
  Inputs inputs() const {
    if (extra.empty()) return Inputs(data);
    std::vector<torch::Tensor> all{data};
    all.insert(all.end(), extra.begin(), extra.end());
    return Inputs(std::move(all));
  }
};

/// One sample of a dataset whose `get(i)` returns samples: the model's
/// input and the task's target. (Several inputs: a sample whose input is a
/// `data::Inputs`, a tuple or a vector of tensors, e.g.
/// `std::pair<data::Inputs, torch::Tensor>`.)
struct Example {
  torch::Tensor input;
  torch::Tensor target;
};

namespace detail {
/// A sample's input as Inputs: a tensor, an Inputs, a vector, a tuple or a
/// pair of tensors.
template <class T>
Inputs as_inputs(const T& x) {
  if constexpr (std::is_convertible_v<const T&, torch::Tensor>) {
    return Inputs(torch::Tensor(x));
  } else if constexpr (std::is_same_v<T, Inputs>) {
    return x;
  } else if constexpr (std::is_same_v<T, std::vector<torch::Tensor>>) {
    return Inputs(x);
  } else {
    static_assert(std::is_constructible_v<Inputs, const T&>,
                  "a sample's input is a tensor, a data::Inputs, or a vector, "
                  "tuple or pair of tensors");
    return Inputs(x);
  }
}

/// A sample's input and target: an `Example`, a pair or tuple of two
/// (input, target), or anything with `data` and `target` (libtorch's
/// Example).
template <class S>
std::pair<Inputs, torch::Tensor> unpack(const S& s) {
  if constexpr (requires {
                  s.input;
                  s.target;
                }) {
    return {as_inputs(s.input), s.target};
  } else if constexpr (requires {
                         s.data;
                         s.target;
                       }) {
    return {as_inputs(s.data), s.target};
  } else {
    static_assert(std::tuple_size_v<S> == 2,
                  "a sample is an Example, a pair or tuple (input, target), or "
                  "a struct with data and target");
    return {as_inputs(std::get<0>(s)), std::get<1>(s)};
  }
}

/// The samples' inputs, position by position (`out.first[j]`: input j of
/// every sample), and their targets, in lists; every sample must have as
/// many inputs as the first.
template <class Sample>
std::pair<std::vector<std::vector<torch::Tensor>>, std::vector<torch::Tensor>>
unzip(const std::vector<Sample>& samples) {
  std::pair<std::vector<std::vector<torch::Tensor>>, std::vector<torch::Tensor>>
      out;
  out.second.reserve(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    auto [x, y] = unpack(samples[i]);
    if (i == 0) {
      out.first.resize(x.size());
      for (auto& column : out.first) column.reserve(samples.size());
    } else if (x.size() != out.first.size()) {
      throw UsageError(ddpkit::detail::cat(
          "collate: sample ", i, " of the batch has ", x.size(),
          " input tensor(s), the first has ", out.first.size()));
    }
    for (std::size_t j = 0; j < x.size(); ++j) out.first[j].push_back(x[j]);
    out.second.push_back(std::move(y));
  }
  return out;
}

/// A batch from collated input columns (the first is `data`) and target.
inline Batch make_batch(std::vector<torch::Tensor> inputs,
                        torch::Tensor target) {
  Batch b;
  if (!inputs.empty()) {
    b.data = std::move(inputs[0]);
    b.extra.assign(std::make_move_iterator(inputs.begin() + 1),
                   std::make_move_iterator(inputs.end()));
  }
  b.target = std::move(target);
  return b;
}
}  // namespace detail

/// A dataset that makes whole batches, `get(indices)` returning
/// `{images, labels}` (the image path: CIFAR, ImageFolder).
template <class D>
concept batch_dataset =
    requires(const D& d, const std::vector<std::size_t>& idx) {
      { d.size() } -> std::convertible_to<std::size_t>;
      d.get(idx);
    };

/// A dataset of samples: `size()` and `get(i)` for one index (and not a
/// `batch_dataset`).
template <class D>
concept sample_dataset =
    !batch_dataset<D> && requires(const D& d, std::size_t i) {
      { d.size() } -> std::convertible_to<std::size_t>;
      d.get(i);
    };

/// The default collate step: stacks the samples' inputs and targets along a
/// new first dimension (they must have equal shapes).
struct Stack {
  template <class Sample>
  Batch operator()(const std::vector<Sample>& samples,
                   torch::Generator&) const {
    if (samples.empty()) return {};
    auto [xs, ys] = detail::unzip(samples);
    std::vector<torch::Tensor> inputs;
    for (const auto& column : xs) inputs.push_back(torch::stack(column));
    return detail::make_batch(std::move(inputs), torch::stack(ys));
  }
};

/// Collates variable-length sequences: inputs (and targets) of shape L×...
/// padded at the end to the batch's longest L, inputs with `input_pad` and
/// targets with `target_pad` (-100: what LanguageModel ignores).
struct PadSequences {
  double input_pad = 0;
  double target_pad = -100;

  template <class Sample>
  Batch operator()(const std::vector<Sample>& samples,
                   torch::Generator&) const {
    if (samples.empty()) return {};
    auto [xs, ys] = detail::unzip(samples);
    std::vector<torch::Tensor> inputs;
    for (const auto& column : xs) inputs.push_back(pad(column, input_pad));
    return detail::make_batch(std::move(inputs), pad(ys, target_pad));
  }

 private:
  static torch::Tensor pad(const std::vector<torch::Tensor>& ts, double value) {
    if (ts.empty()) return torch::Tensor();
    int64_t longest = 0;
    for (const auto& t : ts) {
      if (t.dim() < 1 || t.sizes().slice(1) != ts[0].sizes().slice(1)) {
        throw UsageError(
            ddpkit::detail::cat("PadSequences: sample of shape ", t.sizes(),
                                " does not match the first's ", ts[0].sizes(),
                                " past the first (length) dimension"));
      }
      longest = std::max(longest, t.size(0));
    }
    std::vector<int64_t> shape{static_cast<int64_t>(ts.size()), longest};
    for (auto d : ts[0].sizes().slice(1)) shape.push_back(d);
    auto out = torch::full(shape, value, ts[0].options());
    for (std::size_t i = 0; i < ts.size(); ++i) {
      out[static_cast<int64_t>(i)].narrow(0, 0, ts[i].size(0)).copy_(ts[i]);
    }
    return out;
  }
};

/// Options of `Loader`.
struct LoaderOptions {
  explicit LoaderOptions(std::size_t batch_size = 64)
      : batch_size_(batch_size) {}
  TORCH_ARG(std::size_t, batch_size);
  /// Worker threads; 0 makes each batch in `next()` on the calling thread.
  TORCH_ARG(int, workers) = 2;
  /// How many batches may be ready or in the making ahead of the consumer
  /// (the bound of the queue; memory is about prefetch × batch).
  TORCH_ARG(std::size_t, prefetch) = 4;
  /// Seed of the augmentation; combined with epoch, rank and batch index.
  TORCH_ARG(std::uint64_t, seed) = 0;
  /// This process's rank, so ranks draw different augmentations.
  TORCH_ARG(int, rank) = 0;
  /// Drop a last batch smaller than `batch_size`.
  TORCH_ARG(bool, drop_last) = false;
  /// Put batches in page-locked memory (CUDA builds only; ignored on CPU)
  /// so `to(device, /*non_blocking=*/true)` overlaps the copy.
  TORCH_ARG(bool, pin_memory) = false;
};

/// The seed of batch `batch` of `epoch` on `rank`: a splitmix64 chain, so
/// neighbouring inputs give unrelated streams.
inline std::uint64_t batch_seed(std::uint64_t seed, std::uint64_t epoch,
                                std::uint64_t rank, std::uint64_t batch) {
  return ddpkit::detail::mix_seed({seed, epoch, rank, batch});
}

/// Moves a batch to `device`; asynchronous from pinned memory on CUDA.
inline Batch to_device(const Batch& b, const torch::Device& device) {
#ifdef DDPKIT_HAS_CUDA
  const bool async = device.is_cuda() && b.data.is_pinned();
#else
  const bool async = false;
#endif
  Batch out{b.data.to(device, async), b.target.to(device, async)};
  for (const auto& t : b.extra) out.extra.push_back(t.to(device, async));
  return out;
}

/// Iterates the batches of one epoch; move-only, stops its workers when
/// destroyed (also mid-epoch).
template <class Dataset, class Transform>
class LoaderEpoch;

/// A prefetching loader over a dataset and a transform.
///
/// Two kinds of dataset:
/// - batched (`batch_dataset`, the image path): `size()` and
///   `get(const std::vector<std::size_t>&)` returning `{images, labels}`
///   (images: a uint8 N×3×H×W tensor or a vector of uint8 3×H×W tensors);
///   the transform is called as `transform(images, torch::Generator&)` and
///   returns float N×3×H×W (`CifarTrain`, `CifarEval`, `ImageNetTrain`,
///   `ImageNetEval`);
/// - of samples (`sample_dataset`): `size()` and `get(std::size_t)`
///   returning one sample (`Example`, a pair or tuple of tensors); the
///   transform is the collate step, called as
///   `collate(std::vector<Sample>, torch::Generator&)` and returning a
///   `Batch` (`Stack`, `PadSequences`, or your own).
///
/// Example:
/// ```
/// using namespace ddpkit::data;
/// auto set = ddpkit::testing::make_synthetic(
///     ddpkit::testing::SyntheticOptions(5000).seed(1));
/// Loader loader(set, CifarTrain{}, LoaderOptions(128).workers(2).seed(7));
/// RandomSampling sampler(set.size(), {.seed = 7});
/// for (size_t epoch = 0; epoch < 3; ++epoch) {
///   sampler.set_epoch(epoch);
///   for (Batch b : loader.epoch(sampler.indices(), epoch)) { ... }
/// }
/// ```
template <class Dataset, class Transform>
class Loader {
 public:
  Loader(Dataset dataset, Transform transform, LoaderOptions options)
      : state_(std::make_shared<State>(
            State{std::move(dataset), std::move(transform), options})) {
    if (options.batch_size() == 0)
      throw UsageError("Loader: batch_size must be at least 1");
    if (options.workers() < 0)
      throw UsageError(ddpkit::detail::cat("Loader: workers ",
                                           options.workers(), " must be >= 0"));
  }

  /// Starts an epoch over `indices` (a sampler's `indices()`), from batch
  /// `first_batch` on (a run resumed mid-epoch: the batches it makes are
  /// those an uninterrupted epoch makes there, augmentation included).
  LoaderEpoch<Dataset, Transform> epoch(std::vector<std::size_t> indices,
                                        std::size_t epoch,
                                        std::size_t first_batch = 0) const {
    return LoaderEpoch<Dataset, Transform>(state_, std::move(indices), epoch,
                                           first_batch);
  }

  /// Batches in an epoch of `n` indices.
  std::size_t num_batches(std::size_t n) const {
    const auto bs = state_->options.batch_size();
    return state_->options.drop_last() ? n / bs : (n + bs - 1) / bs;
  }

  /// Makes batch `batch_index` of `indices` synchronously: what a worker
  /// runs.
  Batch make_batch(const std::vector<std::size_t>& indices, std::size_t epoch,
                   std::size_t batch_index) const {
    return state_->make(indices, epoch, batch_index);
  }

  const Dataset& dataset() const {
    return state_->dataset;
  }
  const LoaderOptions& options() const {
    return state_->options;
  }

 private:
  friend class LoaderEpoch<Dataset, Transform>;
  struct State {
    Dataset dataset;
    Transform transform;
    LoaderOptions options;

    Batch make(const std::vector<std::size_t>& indices, std::size_t epoch,
               std::size_t b) const {
      const auto bs = options.batch_size();
      const auto begin = b * bs;
      const auto end = std::min(indices.size(), begin + bs);
      std::vector<std::size_t> idx(indices.begin() + begin,
                                   indices.begin() + end);
      auto gen = make_generator(
          batch_seed(options.seed(), epoch,
                     static_cast<std::uint64_t>(options.rank()), b));
      Batch out;
      if constexpr (batch_dataset<Dataset>) {
        auto [images, labels] = dataset.get(idx);
        out = Batch{transform(images, gen), labels};
      } else {
        // Samples, collated by the transform (Stack, PadSequences, yours).
        std::vector<std::remove_cvref_t<decltype(dataset.get(std::size_t{}))>>
            samples;
        samples.reserve(idx.size());
        for (std::size_t i : idx) samples.push_back(dataset.get(i));
        out = transform(samples, gen);
      }
#ifdef DDPKIT_HAS_CUDA
      if (options.pin_memory() && torch::cuda::is_available()) {
        out.data = out.data.pin_memory();
        out.target = out.target.pin_memory();
        for (auto& t : out.extra) t = t.pin_memory();
      }
#endif
      return out;
    }
  };
  std::shared_ptr<const State> state_;
};

template <class Dataset, class Transform>
class LoaderEpoch {
  using State = typename Loader<Dataset, Transform>::State;

 public:
  LoaderEpoch(std::shared_ptr<const State> state,
              std::vector<std::size_t> indices, std::size_t epoch,
              std::size_t first_batch = 0)
      : shared_(std::make_unique<Shared>()) {
    auto& s = *shared_;
    s.state = std::move(state);
    s.indices = std::move(indices);
    s.epoch = epoch;
    const auto bs = s.state->options.batch_size();
    s.num_batches = s.state->options.drop_last()
                        ? s.indices.size() / bs
                        : (s.indices.size() + bs - 1) / bs;
    s.claimed = s.given = std::min(first_batch, s.num_batches);
    if (s.state->options.pin_memory()) {
      s.cuda_device = ddpkit::compat::current_cuda_device();
    }
    for (int w = 0; w < s.state->options.workers(); ++w) {
      threads_.emplace_back([p = shared_.get()] { p->work(); });
#ifdef __linux__
      // Named for top, gdb and /proc (the tests count them by this name).
      pthread_setname_np(threads_.back().native_handle(), "ddpkit-loader");
#endif
    }
  }
  LoaderEpoch(LoaderEpoch&&) noexcept = default;
  LoaderEpoch& operator=(LoaderEpoch&&) = delete;
  LoaderEpoch(const LoaderEpoch&) = delete;
  ~LoaderEpoch() {
    if (shared_) {
      {
        std::lock_guard lock(shared_->m);
        shared_->stop = true;
      }
      shared_->work_cv.notify_all();
    }
    for (auto& t : threads_) t.join();
  }

  /// Batches in this epoch (those before `first_batch` included).
  std::size_t size() const {
    return shared_->num_batches;
  }

  /// The next batch in order, or nothing at the end of the epoch. A worker's
  /// exception is rethrown here, on the consumer's thread.
  std::optional<Batch> next() {
    auto& s = *shared_;
    if (s.given >= s.num_batches) return std::nullopt;
    if (threads_.empty()) return s.state->make(s.indices, s.epoch, s.given++);
    std::unique_lock lock(s.m);
    s.ready_cv.wait(lock, [&] { return s.ready.count(s.given) > 0; });
    auto node = s.ready.extract(s.given);
    ++s.given;
    lock.unlock();
    s.work_cv.notify_all();
    if (auto* err = std::get_if<std::exception_ptr>(&node.mapped()))
      std::rethrow_exception(*err);
    return std::get<Batch>(std::move(node.mapped()));
  }

  /// Input iteration: `for (Batch b : loader.epoch(...))`.
  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(LoaderEpoch* e) : e_(e) {
      ++*this;
    }
    Batch& operator*() {
      return *cur_;
    }
    iterator& operator++() {
      cur_ = e_->next();
      if (!cur_) e_ = nullptr;
      return *this;
    }
    void operator++(int) {
      ++*this;
    }
    bool operator==(const iterator& o) const {
      return e_ == o.e_;
    }

   private:
    LoaderEpoch* e_ = nullptr;
    std::optional<Batch> cur_;
  };
  iterator begin() {
    return iterator(this);
  }
  iterator end() {
    return iterator();
  }

 private:
  struct Shared {
    std::shared_ptr<const State> state;
    std::vector<std::size_t> indices;
    std::size_t epoch = 0;
    std::size_t num_batches = 0;
    std::mutex m;
    std::condition_variable work_cv, ready_cv;
    std::size_t claimed = 0;  // next batch a worker takes
    std::size_t given = 0;    // next batch the consumer takes
    std::map<std::size_t, std::variant<Batch, std::exception_ptr>> ready;
    bool stop = false;
    // The consumer's CUDA device when batches are pinned (-1: none): the
    // workers pin on it, not on the device 0 a new thread starts on.
    int cuda_device = -1;

    void work() {
      ddpkit::compat::CudaDeviceScope on_device(cuda_device);
      const auto window = std::max<std::size_t>(1, state->options.prefetch());
      for (;;) {
        std::size_t b;
        {
          std::unique_lock lock(m);
          work_cv.wait(lock, [&] {
            return stop || claimed >= num_batches || claimed < given + window;
          });
          if (stop || claimed >= num_batches) return;
          b = claimed++;
        }
        std::variant<Batch, std::exception_ptr> result;
        try {
          result = state->make(indices, epoch, b);
        } catch (...) {
          result = std::current_exception();
        }
        {
          std::lock_guard lock(m);
          ready.emplace(b, std::move(result));
        }
        ready_cv.notify_all();
      }
    }
  };
  std::unique_ptr<Shared> shared_;
  std::vector<std::thread> threads_;
};

}  // namespace ddpkit::data
