// SPDX-License-Identifier: BSD-3-Clause
// ZeRO's sharded optimizer (Rajbhandari et al., SC'20): which rank owns
// each parameter, the user's libtorch optimizer over this rank's share,
// the updated parameters gathered to every rank, a checkpoint's whole
// optimizer state consolidated on rank 0 and split again on load; and the
// bytes of optimizer state, counted from the tensors. The policies that use
// it are zero1.hpp and zero2.hpp.
//
// Note [ZeRO's ownership]
// ~~~~~~~~~~~~~~~~~~~~~~~
// One partition decides everything a rank owns: partition_parameters cuts
// the parameters (each tensor once) into contiguous runs, one per rank,
// the same on every rank. ZeRO-1's optimizer steps only its run; ZeRO-2's
// reducer builds its buckets so that none spans two owners (the
// partition is given to the reducer as gradient_owners, each entry of
// parameters() taking its tensor's owner) and reduces each bucket to its
// owner, which alone keeps it between steps (see the reducer's Note
// [ZeRO-2's buckets in flight]). After the step every owner's updated
// parameters reach the others (gather_parameters). Checkpoints hold the
// whole optimizer state, as a plain optimizer over every parameter would
// save it (consolidate() on every rank gathers the shards on rank 0;
// load gives each rank its part), so a checkpoint resumes at any world
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
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/optimizer_state.hpp"

namespace ddpkit::parallel {

// Note [ZeRO stage 1 wraps the user's optimizer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ZeRO stage 1 wraps the user's optimizer (`parallel/zero.hpp`, issue 29).
// `ZeRO1` is DDP's engine (same reducer, buckets, hooks, SyncBN,
// accumulation) plus `make_optimizer(factory)`, which the Trainer calls
// instead of the factory when an engine has it. It returns a
// `ShardedOptimizer`: a `torch::optim::Optimizer` over every parameter (so
// clipping, `set_lr` and anything walking `param_groups()` work unchanged)
// holding an optimizer of the user's type built by the same factory over this
// rank's parameters only. Ownership is by whole parameter, contiguous in
// parameter order, cut so each rank owns about 1/world of the elements
// (`partition_parameters`: the contiguous cut whose largest share is
// smallest, by bisection on the capacity; a share can exceed 1/world by less
// than the largest parameter: ResNet-34 at world 2 splits its 81.2 MiB of
// momentum 44.7/36.5, a 9 MiB convolution at the cut). `step()` copies the
// learning rate in, steps the shard, then gathers every rank's updated
// parameters (tagged "zero parameters" in the flight record), in chunks of at
// most 4 MiB (`set_gather_chunk_bytes`; a larger parameter goes alone). On
// one host the gather is an all-gather in place through the shared-memory
// channel (`dist::all_gather_shared`): each chunk lives in a buffer in shared
// memory, each rank writes its own parameters into its buffer (a memcpy for
// contiguous ones) and the channel, once every rank has arrived, copies the
// other ranks' parts from their buffers; a barrier after it keeps a rank from
// overwriting its buffer while another still reads. Owners ascend in
// parameter order, so in a chunk each rank's part is one range. A blocking
// call found with the channel idle runs on the calling thread (no hand-over
// to the channel's thread). It was first an all-reduce of zero-filled chunks
// (x + 0 = x), which moved about four times the bytes; that sum remains where
// no shared segment could be made and when hosts are joined hierarchically
// (the leaders' all-reduce carries it between hosts). gloo's loopback
// broadcasts had made the step 1.2–1.3× DDP's; between hosts without the
// channel the gather is one coalesced broadcast per owner and chunk (an
// all-reduce would carry twice a broadcast's bytes over a network). Why whole
// parameters and not flat slices of the buckets: any libtorch optimizer (and
// a user's own) works on whole tensors, and its state per parameter can be
// moved between optimizers by key (`compat::optimizer_state_key`: the
// TensorImpl's address, a string in 1.13). Checkpoints hold the whole model's
// optimizer state, as a plain optimizer would save it: before rank 0 writes
// (at each epoch's end when checkpoints are on, and in the mid-epoch and
// signal checkpoints, which every rank enters) every rank calls
// `consolidate()` — each shard serialized by its own optimizer and broadcast
// in turn; rank 0 loads each into an optimizer over that shard's parameters
// and moves the states into a whole one until the next step. `load` does the
// reverse on every rank (a whole optimizer loads the file; the rank keeps its
// parameters' states). So a checkpoint resumes at another world size, and
// DDP's and ZeRO's checkpoints are the same format (tests: 2→4, 4→2, 4→1
// equal DDP resumed alike; the example's ZeRO → DDP → ZeRO resume). What we
// chose for rank 0's memory: it holds the whole state while it writes (as
// PyTorch's `consolidate_state_dict`); the other ranks receive each shard's
// bytes one at a time. Not built: the gather is not overlapped with the next
// forward (libtorch's C++ modules have no forward pre-hooks to wait on a
// parameter's chunk; see stage 3 below).

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

/// PyTorch's clip_grad_norm_ over gradients sharded across `group` (each
/// rank holds `grads`, its part): each rank's sum of its gradients' norms
/// to the power `norm_type` (the maximum for inf), one all-reduce, each
/// rank scales its part by max_norm / (total + 1e-6) when that is below 1.
/// Returns the total norm (the same on every rank). ZeRO-2's and ZeRO-3's
/// clipping.
inline double clip_sharded_grad_norm(const dist::Group& group,
                                     std::vector<torch::Tensor> grads,
                                     double max_norm, double norm_type) {
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
      group, local, inf ? dist::Reduce::max : dist::Reduce::sum);
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
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

  /// The whole optimizer `consolidate` gathered on this rank, or null (not
  /// consolidated since the last step).
  const torch::optim::Optimizer* consolidated() const {
    return full_.get();
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

  /// This rank's part of each parameter (a sharded checkpoint's pieces):
  /// the parameters it owns, whole, with their optimizer state. Views of
  /// them: copy them before training changes them.
  std::vector<ParamPart> checkpoint_parts() const {
    std::vector<ParamPart> out;
    for (const auto& p : owned_[static_cast<std::size_t>(group_.rank())]) {
      out.push_back(detail::whole_part(p, *inner_));
    }
    return out;
  }
  /// A new optimizer of the user's type over every parameter, at this
  /// one's learning rate, with no state.
  std::unique_ptr<torch::optim::Optimizer> whole() const {
    return fresh(params_);
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

}  // namespace ddpkit::parallel
