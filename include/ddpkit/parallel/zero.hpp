// SPDX-License-Identifier: BSD-3-Clause
// ZeRO stage 1 (Rajbhandari et al., SC'20): the optimizer state sharded
// across ranks. Gradients are averaged as DDP averages them (the same
// reducer, buckets and hooks); each rank then steps only the parameters it
// owns, with the user's own libtorch optimizer built over them, and every
// rank's updated parameters reach the others: among the ranks of one host
// by an all-gather in place in shared memory, elsewhere by a broadcast
// from each owner in turn (gather_parameters). With Adam the
// state is 8 bytes per parameter: a rank keeps about 1/world of it.
//
// Checkpoints hold the optimizer state of the whole model, as a plain
// optimizer over every parameter would save it: `consolidate()` (on every
// rank) gathers the shards on rank 0 before it writes, and `load` gives
// each rank its part of a whole state. So a checkpoint resumes at any world
// size, and between DDP and ZeRO in both directions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/distributed/flight_recorder.hpp"
#include "ddpkit/parallel/ddp.hpp"
#include "ddpkit/parallel/module_utils.hpp"

namespace ddpkit::parallel {

/// Which rank owns each parameter: contiguous runs in parameter order, cut
/// at parameter boundaries so that the largest share (in elements) is as
/// small as any such cut allows: the smallest capacity C for which filling
/// ranks in order, each up to C, places every parameter in `world` ranks
/// (found by bisection), then that filling. A rank's share exceeds
/// total / world by less than the largest parameter (ResNet-34 at world
/// 2: 44.7/36.5 MiB of momentum, a 9 MiB convolution at the cut; the
/// previous rule, the rank holding a parameter's middle element, gave the
/// same there but can be worse). The same on every rank. Later ranks may
/// own nothing when a few parameters dominate.
inline std::vector<int> partition_parameters(
    const std::vector<torch::Tensor>& params, int world) {
  std::vector<int> owner(params.size(), 0);
  if (world <= 1 || params.empty()) return owner;
  int64_t total = 0, largest = 0;
  for (const auto& p : params) {
    total += p.numel();
    largest = std::max<int64_t>(largest, p.numel());
  }
  // Ranks filled in order up to `cap` each; how many are needed.
  auto fill = [&](int64_t cap, bool assign) {
    int rank = 0;
    int64_t load = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const int64_t n = params[i].numel();
      if (load > 0 && load + n > cap) {
        ++rank;
        load = 0;
      }
      load += n;
      if (assign) owner[i] = std::min(rank, world - 1);
    }
    return rank + 1;
  };
  int64_t lo = std::max<int64_t>(largest, (total + world - 1) / world);
  int64_t hi = std::max<int64_t>(lo, total);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fill(mid, false) <= world) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  fill(lo, true);
  return owner;
}

/// Bytes of the tensors an optimizer keeps for its parameters, measured
/// from its state (SGD's momentum, Adam's and AdamW's moments, RMSprop's
/// averages, Adagrad's sums); the state of other optimizer types counts 0.
inline uint64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  namespace o = torch::optim;
  uint64_t n = 0;
  auto add = [&](const torch::Tensor& t) {
    if (t.defined()) n += static_cast<uint64_t>(t.nbytes());
  };
  auto moments = [&](const auto* adam) {  // Adam's and AdamW's
    add(adam->exp_avg());
    add(adam->exp_avg_sq());
    add(adam->max_exp_avg_sq());
  };
  for (const auto& entry : opt.state()) {
    const o::OptimizerParamState* s = entry.second.get();
    if (auto* sgd = dynamic_cast<const o::SGDParamState*>(s)) {
      add(sgd->momentum_buffer());
    } else if (auto* adam = dynamic_cast<const o::AdamParamState*>(s)) {
      moments(adam);
    } else if (auto* adamw = dynamic_cast<const o::AdamWParamState*>(s)) {
      moments(adamw);
    } else if (auto* rms = dynamic_cast<const o::RMSpropParamState*>(s)) {
      add(rms->square_avg());
      add(rms->momentum_buffer());
      add(rms->grad_avg());
    } else if (auto* ada = dynamic_cast<const o::AdagradParamState*>(s)) {
      add(ada->sum());
    }
  }
  return n;
}

/// Per-rank bytes of the model states (parameters, gradients, optimizer
/// state) that each ZeRO stage keeps, as the ZeRO paper counts them
/// (Rajbhandari et al., SC'20, section 5): DDP (stage 0) keeps all three
/// whole; stage 1 divides the optimizer state by the world size, stage 2
/// the gradients too, stage 3 the parameters too. Buffers in flight
/// (buckets, gathers) are not counted: the measured numbers
/// (summary.json's memory_bytes_per_rank) are the ones with them.
struct ModelStateBytes {
  double parameters = 0, gradients = 0, optimizer_state = 0;
  double total() const {
    return parameters + gradients + optimizer_state;
  }
};

/// `psi` parameters at `world` ranks under `stage` (0: DDP, 1-3: ZeRO),
/// with `param_bytes`, `grad_bytes` and `state_bytes` per parameter:
/// float32 Adam is 4, 4, 8 (two moments); the paper's mixed precision is
/// 2, 2, 12 (fp16 parameters and gradients; fp32 master weights and
/// moments: K = 12).
inline ModelStateBytes model_state_bytes(double psi, int world, int stage,
                                         double param_bytes = 4,
                                         double grad_bytes = 4,
                                         double state_bytes = 8) {
  if (world < 1 || stage < 0 || stage > 3) {
    throw UsageError(ddpkit::detail::cat("model_state_bytes: world ", world,
                                         ", stage ", stage,
                                         "; expected world >= 1, stage 0-3"));
  }
  const double n = world;
  ModelStateBytes b;
  b.parameters = psi * param_bytes / (stage >= 3 ? n : 1);
  b.gradients = psi * grad_bytes / (stage >= 2 ? n : 1);
  b.optimizer_state = psi * state_bytes / (stage >= 1 ? n : 1);
  return b;
}

/// ZeRO stage 1's optimizer: an optimizer over every parameter (so code
/// that walks `param_groups()` — clipping, setting the learning rate —
/// works as before) that keeps state only for this rank's shard. `make`
/// is the optimizer factory a Trainer takes (one parameter group); it is
/// called with this rank's parameters, and on rank 0 also with the others'
/// while consolidating.
///
/// Example (what `ZeRO1`'s engine does for the Trainer):
/// ```
/// ShardedOptimizer opt(model->parameters(), [](std::vector<torch::Tensor> p) {
///   return std::make_unique<torch::optim::AdamW>(p, 1e-3);
/// }, group);
/// loss.backward();   // DDP's reducer averaged the gradients
/// opt.step();        // this rank's shard, then every shard to every rank
/// opt.consolidate(); // every rank, before rank 0 saves it
/// ```
class ShardedOptimizer : public torch::optim::Optimizer {
 public:
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(
      std::vector<torch::Tensor>)>;

  /// `params`: each tensor once is kept (a tied weight listed twice is
  /// owned, stepped and saved once).
  ShardedOptimizer(std::vector<torch::Tensor> params, Factory make,
                   dist::Group group)
      : ShardedOptimizer(unique_tensors(params), make, group, 0) {}

  /// This rank's shard (after the learning rate of this optimizer's first
  /// group is copied to it), then the updated parameters from every rank.
  torch::Tensor step(LossClosure closure = nullptr) override {
    if (closure) {
      throw UsageError(
          "ShardedOptimizer: a step with a closure is not supported (each "
          "rank steps only its own parameters)");
    }
    full_.reset();  // a consolidated state is stale after a step
    const double lr = param_groups_.at(0).options().get_lr();
    for (auto& g : inner_->param_groups()) g.options().set_lr(lr);
    {
      torch::NoGradGuard no_grad;
      inner_->step();
    }
    gather_parameters();
    return {};
  }

  /// Every rank: gathers the shards' state on rank `to`, which then holds
  /// the state of a plain optimizer over every parameter until the next
  /// step (for `save`). The other ranks hold one shard at a time.
  void consolidate(int to = 0) {
    dist::CollectiveTag tag("zero consolidate");
    const std::string mine = to_bytes(*inner_);
    std::unique_ptr<torch::optim::Optimizer> full;
    if (group_.rank() == to) full = fresh(params_);
    for (int r = 0; r < group_.size(); ++r) {
      const std::string bytes = dist::broadcast_string(
          group_, r == group_.rank() ? mine : std::string(), r);
      if (!full) continue;
      std::unique_ptr<torch::optim::Optimizer> shard;
      torch::optim::Optimizer* from = inner_.get();
      if (r != group_.rank()) {
        shard = fresh(owned_[static_cast<std::size_t>(r)]);
        from_bytes(*shard, bytes);
        from = shard.get();
      }
      for (const auto& p : owned_[static_cast<std::size_t>(r)]) {
        const auto key = ddpkit::compat::optimizer_state_key(p);
        auto it = from->state().find(key);
        if (it != from->state().end()) full->state()[key] = it->second->clone();
      }
    }
    full_ = std::move(full);
  }

  /// The whole model's optimizer state: on the rank `consolidate` gathered
  /// it on, before the next step.
  void save(torch::serialize::OutputArchive& archive) const override {
    if (!full_) {
      throw UsageError(
          "ShardedOptimizer::save: call consolidate() on every rank first "
          "(each rank holds only its shard of the state)");
    }
    full_->save(archive);
  }

  /// Every rank: reads a whole state (saved by `save`, or by a plain
  /// optimizer of the same type over the same parameters) and keeps its
  /// shard of it.
  void load(torch::serialize::InputArchive& archive) override {
    auto full = fresh(params_);
    full->load(archive);
    inner_->state().clear();
    for (const auto& p : owned_[static_cast<std::size_t>(group_.rank())]) {
      const auto key = ddpkit::compat::optimizer_state_key(p);
      auto it = full->state().find(key);
      if (it != full->state().end()) {
        inner_->state()[key] = it->second->clone();
      }
    }
    full_.reset();
  }

  /// Bytes of optimizer state this rank keeps (measured, see
  /// optimizer_state_bytes).
  uint64_t state_bytes() const {
    return optimizer_state_bytes(*inner_);
  }
  /// The parameters rank `r` steps.
  const std::vector<torch::Tensor>& owned(int r) const {
    return owned_.at(static_cast<std::size_t>(r));
  }
  const torch::optim::Optimizer& shard_optimizer() const {
    return *inner_;
  }
  /// The largest buffer the parameters' gather has used (measured: the
  /// flat tensor each owner's parameters are broadcast through).
  uint64_t gather_buffer_bytes() const {
    return gather_bytes_;
  }
  /// The gather's largest flat buffer (default 4 MiB; a larger parameter
  /// is broadcast alone). Every rank must set the same value.
  void set_gather_chunk_bytes(int64_t bytes) {
    if (bytes <= 0) {
      throw UsageError(ddpkit::detail::cat("ShardedOptimizer: gather chunk of ",
                                           bytes,
                                           " bytes; expected a positive size"));
    }
    gather_chunk_bytes_ = bytes;
  }

 private:
  struct Split {
    std::vector<std::vector<torch::Tensor>> owned;
    std::vector<int> owner;  // per parameter
    std::unique_ptr<torch::optim::Optimizer> inner;
  };

  static Split split(const std::vector<torch::Tensor>& params,
                     const Factory& make, const dist::Group& group) {
    Split s;
    s.owned.resize(static_cast<std::size_t>(group.size()));
    s.owner = partition_parameters(params, group.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      s.owned[static_cast<std::size_t>(s.owner[i])].push_back(params[i]);
    }
    s.inner = checked(make, s.owned[static_cast<std::size_t>(group.rank())]);
    return s;
  }

  static std::unique_ptr<torch::optim::Optimizer> checked(
      const Factory& make, std::vector<torch::Tensor> params) {
    auto opt = make(std::move(params));
    if (!opt) throw UsageError("the optimizer factory returned nothing");
    if (opt->param_groups().size() != 1) {
      throw UsageError(ddpkit::detail::cat(
          "ZeRO: the optimizer factory made ", opt->param_groups().size(),
          " parameter groups; a sharded optimizer takes one"));
    }
    return opt;
  }

  // `params` already without repeats.
  ShardedOptimizer(const std::vector<torch::Tensor>& params,
                   const Factory& make, const dist::Group& group, int)
      : ShardedOptimizer(split(params, make, group), params, make, group) {}

  // (The arguments of the delegating call above are evaluated in no set
  // order: these are copies, so `split` never sees a moved-from factory.)
  ShardedOptimizer(Split s, const std::vector<torch::Tensor>& params,
                   const Factory& make, const dist::Group& group)
      : torch::optim::Optimizer(
            std::vector<torch::optim::OptimizerParamGroup>{
                torch::optim::OptimizerParamGroup(params)},
            s.inner->param_groups().at(0).options().clone()),
        owned_(std::move(s.owned)),
        owner_(std::move(s.owner)),
        inner_(std::move(s.inner)),
        params_(params),
        make_(make),
        group_(group) {}

  // A new optimizer of the user's type over `params`, at this one's rate.
  std::unique_ptr<torch::optim::Optimizer> fresh(
      std::vector<torch::Tensor> params) const {
    auto opt = checked(make_, std::move(params));
    const double lr = param_groups_.at(0).options().get_lr();
    for (auto& g : opt->param_groups()) g.options().set_lr(lr);
    return opt;
  }

  // Every owner's updated parameters to every rank, through flat buffers
  // of at most gather_chunk_bytes (one parameter larger than that goes
  // alone), so the gather's buffer stays small next to the shard. The
  // chunks are the same on every rank (they depend only on the partition
  // and the shapes).
  void gather_parameters() {
    if (group_.size() == 1) return;
    dist::CollectiveTag tag("zero parameters");
    if (gather_on_host()) return;
    // Elsewhere: broadcasts from each owner in turn.
    for (int r = 0; r < group_.size(); ++r) {
      std::vector<torch::Tensor> chunk;
      int64_t bytes = 0;
      for (const auto& p : owned_[static_cast<std::size_t>(r)]) {
        const auto n = static_cast<int64_t>(p.nbytes());
        if (!chunk.empty() && bytes + n > gather_chunk_bytes_) {
          broadcast_coalesced(group_, chunk, r, &gather_bytes_);
          chunk.clear();
          bytes = 0;
        }
        chunk.push_back(p);
        bytes += n;
      }
      broadcast_coalesced(group_, chunk, r, &gather_bytes_);
    }
  }

  // Ranks on one host (the shared-memory channel). Each chunk runs over
  // consecutive parameters of one dtype, whoever owns them; a rank writes
  // its own into the chunk's shared buffer and the channel's all-gather in
  // place copies the others' parts from their buffers. Where no shared
  // buffer could be made, or hosts are joined hierarchically, a rank
  // writes zeros elsewhere and the channel's all-reduce adds them
  // (x + 0 is x exactly). Far faster than broadcasts through gloo's
  // sockets; over a network the sum would carry twice a broadcast's bytes,
  // so it is used only with the channel.
  bool gather_on_host() {
    if (on_host_ < 0) {  // the same answer on every rank
      on_host_ = group_.shm() ? 1 : 0;
      for (const auto& p : params_) {
        // (the flat buffers are what the channel sees: contiguous)
        if (!p.is_floating_point() ||
            !dist::ShmChannel::eligible(torch::empty({0}, p.options()))) {
          on_host_ = 0;
        }
      }
    }
    if (on_host_ == 0) return false;
    torch::NoGradGuard no_grad;
    if (!gather_buffers_made_) make_gather_buffers();
    const int me = group_.rank();
    std::size_t i = 0;
    while (i < params_.size()) {
      // [i, j): one chunk
      std::size_t j = i;
      int64_t numel = 0;
      while (
          j < params_.size() &&
          params_[j].scalar_type() == params_[i].scalar_type() &&
          (j == i || (numel + params_[j].numel()) * params_[j].element_size() <=
                         gather_chunk_bytes_)) {
        numel += params_[j++].numel();
      }
      torch::Tensor flat;
      for (const auto& b : gather_buffers_) {
        if (b.scalar_type() == params_[i].scalar_type() && b.numel() >= numel) {
          flat = b.narrow(0, 0, numel);
        }
      }
      // In a shared buffer on one host: an all-gather in place (each rank
      // reads the others' parts where they wrote them). Otherwise (no
      // segment, or hosts joined hierarchically) the sum of zero-filled
      // buffers.
      const bool in_place = flat.defined() && !group_.shm()->hierarchical();
      if (!flat.defined()) {
        flat = torch::zeros({numel}, params_[i].options());
        gather_bytes_ =
            std::max(gather_bytes_, static_cast<uint64_t>(flat.nbytes()));
      } else if (!in_place) {
        flat.zero_();
      }
      // parts[q]: where rank q's parameters start in the chunk (owners
      // ascend in parameter order).
      std::vector<int64_t> parts(static_cast<std::size_t>(group_.size()) + 1,
                                 0);
      int64_t off = 0;
      for (std::size_t k = i; k < j; ++k) {
        const int64_t n = params_[k].numel();
        if (owner_[k] == me) copy_flat(params_[k], flat, off, true);
        for (std::size_t q = static_cast<std::size_t>(owner_[k]) + 1;
             q < parts.size(); ++q) {
          parts[q] += n;
        }
        off += n;
      }
      if (in_place) {
        dist::all_gather_shared(group_, flat, std::move(parts));
      } else {
        dist::all_reduce(group_, flat);
      }
      off = 0;
      for (std::size_t k = i; k < j; ++k) {
        const int64_t n = params_[k].numel();
        if (owner_[k] != me) copy_flat(params_[k], flat, off, false);
        off += n;
      }
      i = j;
    }
    return true;
  }

  // Parameter `p` into (`to_flat`) or out of `flat` at element `off`: a
  // memcpy for a contiguous CPU tensor (a char LM has hundreds of small
  // parameters: tensor views and dispatch cost more than the bytes),
  // otherwise a copy through views.
  static void copy_flat(const torch::Tensor& p, torch::Tensor& flat,
                        int64_t off, bool to_flat) {
    const int64_t n = p.numel();
    if (p.device().is_cpu() && flat.device().is_cpu() && p.is_contiguous() &&
        p.scalar_type() == flat.scalar_type()) {
      char* f = static_cast<char*>(flat.data_ptr()) + off * p.element_size();
      char* q = static_cast<char*>(p.data_ptr());
      const auto bytes = static_cast<std::size_t>(n * p.element_size());
      to_flat ? std::memcpy(f, q, bytes) : std::memcpy(q, f, bytes);
      return;
    }
    if (to_flat) {
      flat.narrow(0, off, n).copy_(p.detach().reshape({-1}));
    } else {
      p.detach().copy_(flat.narrow(0, off, n).view(p.sizes()));
    }
  }

  // One shared-memory buffer per dtype for gather_on_host, as large as
  // its largest chunk: the channel's all-gather (or, between hosts, its
  // all-reduce) reads the other ranks' chunks where they lie (no copies
  // through the channel's slots). Collective, at the first
  // gather on every rank; where a segment cannot be made, chunks are
  // ordinary tensors.
  void make_gather_buffers() {
    gather_buffers_made_ = true;
    // Per dtype: its elements in all, and its largest parameter's; a
    // chunk holds min(all, chunk size), or one larger parameter.
    struct Need {
      torch::ScalarType type;
      int64_t total, largest, chunk;
    };
    std::vector<Need> need;
    for (const auto& p : params_) {
      auto it = std::find_if(need.begin(), need.end(), [&](const Need& e) {
        return e.type == p.scalar_type();
      });
      if (it == need.end()) {
        need.push_back(
            {p.scalar_type(), 0, 0,
             gather_chunk_bytes_ / static_cast<int64_t>(p.element_size())});
        it = need.end() - 1;
      }
      it->total += p.numel();
      it->largest = std::max(it->largest, p.numel());
    }
    for (const Need& e : need) {
      const auto type = e.type;
      const int64_t n = std::max(e.largest, std::min(e.total, e.chunk));
      auto b = group_.shm()->shared_buffer(n, type);
      if (!b.defined()) continue;
      gather_bytes_ += static_cast<uint64_t>(b.nbytes());
      gather_buffers_.push_back(b);
    }
  }

  static std::string to_bytes(const torch::optim::Optimizer& opt) {
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    std::ostringstream out;
    archive.save_to(out);
    return out.str();
  }
  static void from_bytes(torch::optim::Optimizer& opt,
                         const std::string& bytes) {
    torch::serialize::InputArchive archive;
    std::istringstream in(bytes);
    archive.load_from(in);
    opt.load(archive);
  }

  std::vector<std::vector<torch::Tensor>> owned_;
  std::vector<int> owner_;  // per parameter of params_
  std::unique_ptr<torch::optim::Optimizer> inner_;
  std::vector<torch::Tensor> params_;
  Factory make_;
  dist::Group group_;
  std::unique_ptr<torch::optim::Optimizer> full_;  // after consolidate()
  uint64_t gather_bytes_ = 0;
  int64_t gather_chunk_bytes_ = int64_t{4} << 20;
  int on_host_ = -1;  // gather_on_host applies: -1 not yet known
  bool gather_buffers_made_ = false;
  std::vector<torch::Tensor> gather_buffers_;  // in shared memory
};

/// Bytes of optimizer state this rank keeps: a ShardedOptimizer's shard, or
/// a plain optimizer's whole state (see optimizer_state_bytes).
inline uint64_t local_optimizer_state_bytes(
    const torch::optim::Optimizer& opt) {
  if (const auto* s = dynamic_cast<const ShardedOptimizer*>(&opt)) {
    return s->state_bytes();
  }
  return optimizer_state_bytes(opt);
}

/// ZeRO stage 1 as a parallel policy: DDP's engine (same reducer, hooks,
/// SyncBN, accumulation, join) whose optimizer the Trainer makes through
/// `make_optimizer`, sharded across the ranks (see ShardedOptimizer).
/// Usable wherever DDP is: `Trainer<Model, ZeRO1, DistributedSampling,
/// SyncBN>`.
template <comm_hook Comm = AllReduceMean>
struct BasicZeRO1 {
  using parallel_concept = parallel_tag;
  static constexpr bool is_multi_process = true;
  static constexpr bool is_multi_replica = false;
  static constexpr const char* name = "zero1";
  using options_type = DDPOptions;
  using comm_type = Comm;

  template <class Model>
  class engine : public BasicDDP<Comm>::template engine<Model> {
    using base = typename BasicDDP<Comm>::template engine<Model>;

   public:
    /// DDP's, and the optimizer sharded (Note [Engine capabilities]).
    using capabilities = typename base::capabilities::template with<
        capability::shards_optimizer>;
    using base::base;

    /// The Trainer's optimizer: `make` builds the user's optimizer over
    /// this rank's shard of the parameters.
    template <class Factory>
    std::unique_ptr<torch::optim::Optimizer> make_optimizer(Factory make) {
      auto opt = std::make_unique<ShardedOptimizer>(
          unique_parameters(as_module(this->module())),
          ShardedOptimizer::Factory(std::move(make)), this->group());
      sharded_ = opt.get();
      return opt;
    }
    /// Every rank, before rank 0 writes a checkpoint.
    void consolidate_optimizer() {
      if (sharded_) sharded_->consolidate(0);
    }
    /// Bytes of optimizer state this rank keeps.
    uint64_t optimizer_state_bytes() const {
      return sharded_ ? sharded_->state_bytes() : 0;
    }
    /// The largest buffer the parameters' gather used (measured).
    uint64_t gather_buffer_bytes() const {
      return sharded_ ? sharded_->gather_buffer_bytes() : 0;
    }

   protected:
    ShardedOptimizer* sharded_ = nullptr;
  };
};

/// ZeRO stage 1 with plain all-reduce of float32 gradients.
using ZeRO1 = BasicZeRO1<AllReduceMean>;

/// ZeRO2's settings: DDP's, and which stage.
struct ZeROOptions : DDPOptions {
  ZeROOptions() = default;
  /// DDP's settings, at stage 2.
  ZeROOptions(DDPOptions ddp) : DDPOptions(std::move(ddp)) {}  // NOLINT
  /// 2: the gradients are sharded too (each bucket reduced to its owner);
  /// 1: only the optimizer state (the gradients all-reduced whole, as
  /// ZeRO1 does) — a run-time switch, so one build can compare the two.
  TORCH_ARG(int, stage) = 2;
};

/// ZeRO stage 2: ZeRO-1 plus sharded gradients. Each gradient bucket is
/// reduced to the rank that owns its parameters (the same partition as the
/// optimizer's; buckets never span two owners) while backward runs, and the
/// other ranks free it: between steps a rank holds only its own gradients
/// (about 1/world), and during backward at most
/// `ReducerOptions::unowned_buckets_in_flight` buckets of others' while
/// gradients arrive in bucket order: from the second step on for a model
/// whose backward keeps its order; more before that (see the reducer's
/// Note [ZeRO-2's buckets in flight]). Usable
/// wherever DDP is: `Trainer<Model, ZeRO2, DistributedSampling, SyncBN>`.
///
/// What differs from DDP for code that reads gradients: after a step's
/// backward, `.grad` of a parameter another rank owns is undefined. The
/// Trainer clips by global norm through `clip_grad_norm` (the norm is
/// computed across the shards), and the AMP and finiteness checks agree
/// across ranks. Gradients are averaged with the plain mean only (no
/// compression hook). Under gradient accumulation (no_sync) the micro-
/// steps' gradients are held whole until the synchronised step, as in DDP.
struct ZeRO2 {
  using parallel_concept = parallel_tag;
  static constexpr bool is_multi_process = true;
  static constexpr bool is_multi_replica = false;
  static constexpr const char* name = "zero2";
  using options_type = ZeROOptions;
  using comm_type = AllReduceMean;

  /// The mode's name at ZeROOptions::stage `stage`: "zero1" at 1, else
  /// "zero2" (what summary.json and the examples call it).
  static constexpr const char* name_of_stage(int stage) {
    return stage == 1 ? BasicZeRO1<AllReduceMean>::name : name;
  }

  /// The bucket cap ZeRO-2 uses where DDPOptions sets none.
  static constexpr int64_t kBucketCapBytes = int64_t{4} << 20;
  /// The bucket cap ZeRO-2 runs with under `r`: the one set there, else
  /// kBucketCapBytes.
  static int64_t bucket_cap(const ReducerOptions& r) {
    return r.bucket_cap_set() ? r.bucket_cap_bytes() : kBucketCapBytes;
  }

  template <class Model>
  class engine : public BasicZeRO1<AllReduceMean>::template engine<Model> {
    using base = typename BasicZeRO1<AllReduceMean>::template engine<Model>;

   public:
    /// ZeRO-1's, the norm clipped across gradient shards, and a mode name
    /// by stage (Note [Engine capabilities]).
    using capabilities =
        typename base::capabilities::template with<capability::clips_globally,
                                                   capability::names_mode>;
    engine(Model model, dist::Group group, options_type opts,
           torch::Device device)
        : engine(with_owners(model, group, opts), std::move(model),
                 std::move(group), device) {
      stage_ = opts.stage();
    }

    /// "zero2", or "zero1" when ZeROOptions::stage is 1 (what summary.json
    /// calls the mode).
    const char* mode_name() const {
      return name_of_stage(stage_);
    }

    /// Mixed precision: unscales this rank's gradient shard; the ranks
    /// agree on whether any shard overflowed.
    bool unscale_and_check(LossScaler& scaler) {
      auto* r = this->reducer();
      if (!r) return base::unscale_and_check(scaler);
      std::vector<torch::Tensor> flats;
      for (const auto& b : r->buckets()) {
        if (b.flat.defined()) flats.push_back(b.flat);
      }
      return scaler.unscale_and_check_gradients(flats, this->group(), true);
    }

    /// PyTorch's clip_grad_norm_ over the whole model's averaged gradients,
    /// which are sharded: each rank sums its own gradients' norms (to the
    /// power `norm_type`; the maximum for inf), one all-reduce adds them,
    /// and each rank scales its shard by max_norm / (total + 1e-6) when
    /// that is below 1. Returns the total norm (the same on every rank).
    double clip_grad_norm(double max_norm, double norm_type = 2.0) {
      auto& m = as_module(this->module());
      if (stage_ == 1 || !this->reducer()) {  // every gradient is here
        return torch::nn::utils::clip_grad_norm_(unique_parameters(m), max_norm,
                                                 norm_type);
      }
      std::vector<torch::Tensor> grads;
      for (const auto& p : unique_parameters(m)) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
      const bool inf = std::isinf(norm_type);
      double local = 0;
      if (!grads.empty()) {
        std::vector<torch::Tensor> norms;
        for (const auto& g : grads) norms.push_back(g.detach().norm(norm_type));
        auto n = torch::stack(norms).to(torch::kDouble);
        local = inf ? n.max().template item<double>()
                    : n.pow(norm_type).sum().template item<double>();
      }
      double total = dist::all_reduce_value(
          this->group(), local, inf ? dist::Reduce::max : dist::Reduce::sum);
      if (!inf) total = std::pow(total, 1.0 / norm_type);
      const double coef = max_norm / (total + 1e-6);
      if (coef < 1) {
        torch::NoGradGuard no_grad;
        for (auto& g : grads) g.mul_(coef);
      }
      return total;
    }

   private:
    // DDP's options with every parameter's gradient owner: the optimizer's
    // partition (partition_parameters over the module's parameters, each
    // tensor once), given to every entry of parameters().
    static DDPOptions with_owners(Model& model, const dist::Group& group,
                                  const options_type& zero) {
      if (zero.stage() != 1 && zero.stage() != 2) {
        throw UsageError(ddpkit::detail::cat(
            "ZeROOptions::stage is ", zero.stage(), "; expected 1 or 2"));
      }
      if (zero.comm().kind() != CommKind::allreduce) {
        const char* names[] = {"allreduce", "fp16", "bf16", "powersgd"};
        throw UsageError(ddpkit::detail::cat(
            "ZeRO2: DDPOptions::comm().kind() is ",
            names[static_cast<int>(zero.comm().kind())],
            "; ZeRO2 averages gradients in float32 only (at stage 2 each "
            "bucket is reduced to its owner). For compressed gradients with "
            "the optimizer state sharded use BasicZeRO1<RuntimeComm> (or "
            "BasicZeRO1<Fp16Compression>, <Bf16Compression>, <PowerSGD>)"));
      }
      DDPOptions opts = zero;
      if (zero.stage() == 1) return opts;
      // A bucket of others' gradients is memory held beyond the shard:
      // 4 MiB here unless a cap was set (any set cap is kept, 25 MiB too).
      opts.reducer().bucket_cap_bytes(bucket_cap(opts.reducer()));
      // The optimizer's partition is over each tensor once; the reducer
      // takes an owner per entry of parameters() (a tied weight's every
      // entry gets its tensor's owner).
      const auto unique = unique_parameters(as_module(model));
      const auto owner_of_unique = partition_parameters(unique, group.size());
      std::vector<int> owners;
      for (const auto& p : as_module(model).parameters()) {
        std::size_t k = 0;
        while (!unique[k].is_same(p)) ++k;
        owners.push_back(owner_of_unique[k]);
      }
      opts.reducer().gradient_owners(std::move(owners));
      return opts;
    }
    // (Reference parameters: nothing is moved before `with_owners` has
    // read the model, whatever order the arguments above are evaluated in.)
    engine(DDPOptions opts, Model&& model, dist::Group&& group,
           torch::Device device)
        : base(std::move(model), std::move(group), std::move(opts), device) {}

    int stage_ = 2;
  };
};

}  // namespace ddpkit::parallel
