// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's DDP gradient reducer (c10d's reducer.hpp is not usable with
// Debian's libtorch). Parameters are grouped into flat buckets in reverse
// order (backward produces the last layers' gradients first), and each
// parameter's `.grad` is a view into its bucket, so autograd accumulates
// straight into the buffer that is all-reduced (PyTorch's
// `gradient_as_bucket_view`): no copy in, no write-back. A full bucket starts
// its all-reduce at once, so communication overlaps the rest of backward.
//
// Each synchronised backward is one step: idle -> running (the first gradient
// hook; it queues the end-of-backward callback) -> idle (the callback waited
// for every bucket, or threw after waiting for them). A backward that
// throws never reaches its callback: the engine then waits for the buckets
// that step launched and resets (`abandon_step`), and a later step that finds
// such leftovers either finishes them first (`prepare_for_backward`,
// `zero_grad`) or is refused with an error, never run on top of them.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/scope_guard.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/parallel/autograd_hooks.hpp"
#include "ddpkit/parallel/bucket_store.hpp"
#include "ddpkit/parallel/grad_comm.hpp"
#include "ddpkit/parallel/reducer_options.hpp"
#include "ddpkit/parallel/trace.hpp"

namespace ddpkit::parallel {

// Note [The reducer's step protocol]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The reducer's step is a state machine (idle → running at the first gradient
// hook, which queues the end-of-backward callback → idle when that callback
// has waited for every bucket). A backward that throws (a failing op, a
// failed SyncBN collective) never reaches its callback and may leave buckets
// in flight. The DDP engine catches it, waits for those buckets and resets
// (`Reducer::abandon_step`), then rethrows: a loop that catches the error and
// skips the batch trains exactly as if it had never seen it (test "DDP: a
// backward that throws mid-step can be skipped…", ≤ 1e-5 against one process;
// 0 buckets in flight after). Code that drives the Reducer directly gets the
// same recovery from `prepare_for_backward()` or `zero_grad()`; a backward
// started without either is refused at its first gradient ("the previous
// step's reduction did not finish"). The reducer tells an abandoned step from
// a running one without a graph-task id (libtorch 1.13 has none): the queued
// callback holds a token, and the token expires when the autograd graph task
// holding it is destroyed unrun. A gradient accumulated twice in one backward
// (reentrant backward, reentrant checkpointing) is an error naming the
// parameter, not a race with its bucket's all-reduce. An error while waiting
// for buckets still waits for the rest (a broken channel fails them at once),
// so nothing is left in flight. Hooks take a mutex (parameters on several
// devices run hooks on several autograd threads; untested here, no GPU).
// Bucket views have their parameter's strides (`channels_last` weights keep
// theirs), and `Reducer::gradient_copies()` counts gradients copied back in
// after `.grad` was set to None: the Trainer test asserts 0 after whole
// epochs.

// Note [Static graphs]
// ~~~~~~~~~~~~~~~~~~~~
// With `ReducerOptions::static_graph` (PyTorch's `static_graph`) the first
// synchronised backward records, per parameter, how many times its gradient
// is accumulated (the post-hook of its AccumulateGrad runs once per
// accumulation: twice for a module run twice under reentrant activation
// checkpointing, where each recomputation runs its own backward; 0 for an
// unused one). That step launches nothing during backward: `finish_backward()`
// (the DDP engine calls it once `loss.backward()` has returned) checks that
// the counts agree on every rank (one all-reduce of the counts and their
// squares: equal everywhere iff W·Σc² = (Σc)², the same verdict on every
// rank), then reduces every bucket, and rebuilds the buckets in the order
// the parameters' last accumulations came (unused ones first). From the
// second step a parameter is marked ready when its count is reached, so
// buckets overlap with backward again; the unused ones are marked ready at
// the step's first gradient (no graph walk, no used-flag all-reduce: a
// parameter unused on every rank keeps an undefined gradient, as with
// find_unused_parameters). The end-of-backward callback is queued when the
// last bucket launches, not at the first gradient: a reentrant backward
// runs in its own graph task, and a callback queued there runs when that
// nested backward ends, which is only safe once every gradient is in. A
// gradient accumulated more often than recorded is an error at once; fewer
// (the callback never queued) is an error from `finish_backward()` naming
// the parameters; either way nothing stays in flight. Tests (parallel
// suite): a block run twice under ddpkit::nn::checkpoint at world 2 —
// refused by the dynamic path ("marked ready twice"), equal to one process
// on the joined batch under static_graph; static and dynamic paths equal on
// an ordinary model with an unused parameter.

/// Averages the gradients of `params` across the ranks of `group` during
/// backward. Construct it once; every `backward()` afterwards leaves averaged
/// gradients in `.grad` by the time it returns (a callback queued on the
/// autograd engine waits for the last buckets).
///
/// Example:
/// ```
/// ddpkit::parallel::Reducer<> reducer(params, names, group);
/// loss.backward();        // .grad now holds the average over ranks
/// {
///   auto guard = reducer.no_sync();
///   loss2.backward();     // accumulates locally
/// }
/// ```
template <comm_hook Comm = AllReduceMean>
class Reducer : public BucketStore {
 public:
  /// `comm`: the communication hook that averages each bucket (its state
  /// lives as long as the reducer).
  Reducer(std::vector<torch::Tensor> params, std::vector<std::string> names,
          dist::Group group, ReducerOptions opts = {}, Trace* trace = nullptr,
          Comm comm = Comm())
      : BucketStore(std::move(group), std::move(opts)),
        trace_(trace),
        comm_(std::move(comm)) {
    check_owners(params.size());
    if (opts_.static_graph()) {
      if (!opts_.gradient_owners().empty()) {
        throw Error(
            "DDP: static_graph applies to DDP's all-reduce, not to ZeRO-2's "
            "reduce to each bucket's owner (gradient_owners is set)");
      }
      static_phase_ = StaticPhase::recording;
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!params[i].requires_grad()) continue;
      std::string name =
          i < names.size() ? names[i] : "parameter " + std::to_string(i);
      // A tensor registered under several names (tied weights) has one
      // gradient accumulator: one slot and one hook, as PyTorch's reducer
      // de-duplicates. Its name lists the others.
      auto same = std::find_if(
          params_.begin(), params_.end(),
          [&](const torch::Tensor& p) { return p.is_same(params[i]); });
      if (same != params_.end()) {
        names_[static_cast<std::size_t>(same - params_.begin())] +=
            " (also " + name + ")";
        continue;
      }
      params_.push_back(params[i]);
      names_.push_back(std::move(name));
      owner_.push_back(
          opts_.gradient_owners().empty() ? -1 : opts_.gradient_owners()[i]);
    }
    std::vector<std::size_t> order(params_.size());
    // Until gradients have arrived once: reverse registration order
    // (backward usually produces the last layers' gradients first).
    for (std::size_t k = 0; k < order.size(); ++k) {
      order[k] = order.size() - 1 - k;
    }
    build_buckets(order);
    fires_.assign(params_.size(), 0);
    adopt_existing_grads();
    // A hook's collective set-up (e.g. a capability probe) runs here, at
    // the same point on every rank, not inside the first backward.
    if constexpr (requires { comm_.prepare(group_); }) comm_.prepare(group_);
    install_hooks();
  }

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  ~Reducer() {
    *target_ = nullptr;
    try {
      abandon_step();
    } catch (...) {
    }
    for (std::size_t i = 0; i < accumulators_.size(); ++i) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
  }

  /// While alive, backward accumulates gradients locally without
  /// communicating (gradient accumulation); the next synced backward
  /// averages the accumulated sum.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(Reducer& r) : r_(r), prev_(r.enabled_) {
      r_.enabled_ = false;
    }
    ~NoSyncGuard() {
      r_.enabled_ = prev_;
    }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    Reducer& r_;
    bool prev_;
  };
  [[nodiscard]] NoSyncGuard no_sync() {
    return NoSyncGuard(*this);
  }

  /// The communication hook (e.g. to read PowerSGD's state).
  Comm& comm_hook() {
    return comm_;
  }
  const Comm& comm_hook() const {
    return comm_;
  }
  /// Synchronised steps completed (joined shadow steps included; a step
  /// abandoned by a throwing backward is not): what hooks see as
  /// `GradBucket::step`.
  int64_t steps_completed() const {
    return steps_completed_;
  }
  /// Bytes of the collectives the last synchronised step started (gradient
  /// buckets as the hook sent them, and any used-parameter flags): see
  /// dist::Group::bytes_started.
  uint64_t last_step_bytes() const {
    return last_step_bytes_;
  }
  std::size_t num_parameters() const {
    return params_.size();
  }
  /// Seconds spent, in the last step, waiting for communication after
  /// backward had finished computing.
  double last_wait_seconds() const {
    return last_wait_seconds_;
  }
  bool sync_enabled() const {
    return enabled_;
  }
  /// Before a backward (the DDP engine calls it from forward, as PyTorch's
  /// `prepare_for_backward`). If an earlier backward threw after launching
  /// some buckets, waits for them (nothing stays in flight) and resets the
  /// step; throws an `Error` ("the previous step's reduction did not
  /// finish") if they fail. Without it, a backward that finds such a step
  /// is refused with that error at its first gradient.
  void prepare_for_backward() {
    std::lock_guard<std::mutex> lock(mutex_);
    finish_abandoned();
  }

  /// The same, given forward's outputs: with find_unused_parameters, walks
  /// the autograd graph from them; the parameters it does not reach are
  /// marked ready as soon as backward starts.
  void prepare_for_backward(const std::vector<torch::Tensor>& outputs) {
    std::lock_guard<std::mutex> lock(mutex_);
    finish_abandoned();
    if (!uses_flags()) return;
    const auto seen = detail::reachable_nodes(outputs);
    expect_unused_.clear();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!seen.count(accumulators_[i].get())) expect_unused_.push_back(i);
    }
  }

  /// After each backward (the DDP engine calls it once `loss.backward()`
  /// has returned): with static_graph, reduces the first step's buckets
  /// (see Note [Static graphs]) and reports a later step whose parameters
  /// got fewer gradients than recorded. A no-op otherwise.
  void finish_backward() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (static_phase_ == StaticPhase::off || state_ != StepState::running) {
      return;
    }
    if (static_phase_ == StaticPhase::recording) {
      finalize_recording();
      return;
    }
    std::vector<std::size_t> short_of;
    for (std::size_t k = 0; k < params_.size(); ++k) {
      if (!ready_[k]) short_of.push_back(k);
    }
    const std::string list = name_list(short_of, [this](std::size_t k) {
      return ddpkit::detail::cat(names_[k], " (", fires_[k], " of ",
                                 expected_[k], ")");
    });
    (void)drain_and_reset();
    throw Error(ddpkit::detail::cat(
        "DDP static_graph: ", short_of.size(),
        " parameter(s) received fewer gradients in this backward than in the "
        "first step: ",
        list,
        ". The graph changed, which static_graph does not allow (turn it off "
        "for this model)"));
  }

  /// With static_graph, after the first step: how many times each
  /// parameter's gradient is accumulated in one backward (de-duplicated
  /// parameters, in the order given).
  const std::vector<int32_t>& static_gradient_counts() const {
    return expected_;
  }

  /// Uneven inputs (PyTorch's Join): on a rank that has run out of
  /// batches, takes part in one step of the others: every bucket is
  /// all-reduced holding zeros (this rank's gradients are zeroed), in the
  /// same order and with the same strategy as a real step, so the others'
  /// averages divide by the whole world size, as PyTorch's Join does by
  /// default (divide_by_initial_world_size).
  void join_shadow_step() {
    std::lock_guard<std::mutex> lock(mutex_);
    finish_abandoned();
    if (state_ == StepState::running) {
      throw Error("DDP: join_shadow_step() called during a backward");
    }
    if (static_phase_ == StaticPhase::recording) {
      throw Error(
          "DDP static_graph: this rank ran out of batches before the first "
          "synchronised step, which records the graph; give every rank at "
          "least one batch");
    }
    torch::NoGradGuard no_grad;
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      if (!buckets_[bi].flat.defined()) allocate_unowned(bi);
      buckets_[bi].flat.zero_();
      launch(bi);
    }
    dist::compat::WorkPtr used_work;
    if (uses_flags()) used_work = start_used_flags(nullptr).second;
    std::exception_ptr failed;
    complete_buckets("gradient all-reduce (joined)", failed);
    release_unowned();
    if (used_work) {
      wait_keeping_first(used_work, "used-parameter all-reduce", failed);
    }
    ++steps_completed_;
    reset_step();
    if (failed) std::rethrow_exception(failed);
  }

  /// Whether a step that completes now may rebuild the buckets (not while
  /// some rank has joined: it could not take part in the broadcast).
  void allow_rebuild(bool allowed) {
    std::lock_guard<std::mutex> lock(mutex_);
    rebuild_allowed_ = allowed;
  }

  /// Times the buckets were rebuilt in arrival order (0 before the first
  /// synchronised step completes, then 1; see rebuild_buckets).
  std::size_t rebuilds() const {
    return rebuilds_;
  }
  /// Buckets launched before the end-of-backward callback in the last
  /// synchronised step (the rest were launched by the callback, with
  /// nothing left to overlap).
  std::size_t buckets_launched_in_backward() const {
    return launched_in_backward_;
  }

  /// After a backward that threw (the DDP engine calls it): waits for the
  /// buckets the step had launched, ignoring their errors (the backward's
  /// own error is the one to report), and resets the step. Idempotent; a
  /// no-op between steps.
  void abandon_step() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ == StepState::running && !callback_token_.expired()) {
      return;  // a backward is running now (called from inside it)
    }
    (void)drain_and_reset();
  }

  /// Steps whose backward threw after the reducer had started them
  /// (finished by `abandon_step`, `prepare_for_backward` or `zero_grad`).
  std::size_t abandoned_steps() const {
    return abandoned_steps_;
  }
  /// Gradients copied into their bucket because `.grad` was not the bucket
  /// view (set to None or replaced, e.g. by an optimizer's `zero_grad`):
  /// 0 when zeroing goes through `zero_grad` here.
  std::size_t gradient_copies() const {
    return gradient_copies_;
  }
  /// Buckets whose all-reduce was started and not yet waited for (0 between
  /// steps, and after any exception the reducer threw).
  std::size_t buckets_in_flight() const {
    std::size_t n = 0;
    for (const auto& b : buckets_) n += b.launched ? 1 : 0;
    return n;
  }
  /// Zeroes every gradient in place: one fill per bucket, and `.grad`
  /// stays the bucket view (an optimizer's `zero_grad` that sets gradients
  /// to None makes the next backward copy them back in).
  void zero_grad() {
    std::lock_guard<std::mutex> lock(mutex_);
    finish_abandoned();
    torch::NoGradGuard no_grad;
    release_unowned();
    for (auto& b : buckets_) {
      if (b.flat.defined()) b.flat.zero_();
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& g = params_[i].mutable_grad();
      if (!buckets_[slot_bucket_[i]].flat.defined()) {  // ZeRO-2: not ours
        if (!g.defined()) was_undefined_[i] = 1;
        g = torch::Tensor();
        continue;
      }
      // Remembered so a parameter unused on every rank gets its undefined
      // gradient back (PyTorch's set-to-None default).
      if (!g.defined()) was_undefined_[i] = 1;
      if (!g.defined() || !is_view_of(g, view_of(i))) g = view_of(i);
    }
  }

 private:
  // The buckets laid out in `order` (BucketStore::layout_buckets), and a
  // new step's bookkeeping.
  void build_buckets(const std::vector<std::size_t>& order) {
    layout_buckets(order);
    const std::size_t n = params_.size();
    ready_.assign(n, false);
    used_.assign(n, 0);
    was_undefined_.assign(n, 0);
    reset_step();
  }

  // After the first complete synchronised step (every rank at the same
  // point): rank 0's arrival order is broadcast and the buckets are rebuilt
  // in it; each gradient moves into its new bucket view.
  void rebuild_in_arrival_order() {
    auto order_t = torch::tensor(
        std::vector<int64_t>(arrival_.begin(), arrival_.end()), torch::kLong);
    if (!group_.device().is_cpu()) order_t = order_t.to(group_.device());
    dist::broadcast(group_, order_t, 0);
    order_t = order_t.cpu();
    const auto* o = order_t.data_ptr<int64_t>();
    const std::vector<std::size_t> order(o, o + order_t.numel());
    std::vector<torch::Tensor> grads;
    for (auto& p : params_) grads.push_back(p.grad());
    build_buckets(order);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!grads[i].defined()) continue;
      view_of(i).copy_(grads[i]);
      params_[i].mutable_grad() = view_of(i);
    }
    ++rebuilds_;
  }

  // ZeRO-2, during a step: gives bucket `bi` (another rank's) its buffer,
  // first waiting for the oldest launched ones' reduces and freeing them
  // while unowned_buckets_in_flight are held. The parameters of the bucket
  // whose gradients have not arrived get their views now, so autograd
  // accumulates into them in place (only the first arrival is copied).
  // See Note [ZeRO-2's buckets in flight] (bucket_store.hpp).
  void allocate_unowned(std::size_t bi) {
    const auto limit = static_cast<std::size_t>(
        std::max(1, opts_.unowned_buckets_in_flight()));
    for (;;) {
      std::size_t held = 0, oldest = buckets_.size();
      for (std::size_t k = 0; k < buckets_.size(); ++k) {
        const auto& o = buckets_[k];
        if (keeps(o) || !o.flat.defined()) continue;
        ++held;
        if (o.launched && oldest == buckets_.size()) oldest = k;
      }
      if (held < limit || oldest == buckets_.size()) break;
      auto& o = buckets_[oldest];
      while (o.future.pending()) {
        dist::CollectiveTag tag("bucket", static_cast<long>(oldest));
        o.future.advance(group_, "gradient reduce");
      }
      release(oldest);
    }
    auto& b = buckets_[bi];
    allocate(b);
    note_unowned_held();
    if (state_ != StepState::running) return;
    for (std::size_t j = 0; j < b.params.size(); ++j) {
      const auto k = b.params[j];
      auto& g = params_[k].mutable_grad();
      if (!ready_[k] && !g.defined()) {
        g = b.views[j];
        was_undefined_[k] = 1;
      }
    }
  }

  // Gradients that exist already (e.g. accumulated before DDP was set up)
  // move into the buckets; undefined ones stay undefined until backward.
  void adopt_existing_grads() {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].grad().defined()) adopt_grad(i);
    }
  }

  void install_hooks() {
    *target_ = [this](std::size_t i) { on_accumulated(i); };
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
      if (!acc) {
        throw Error(ddpkit::detail::cat(
            "DDP: parameter ", names_[i],
            " is not a leaf tensor (it has a grad_fn); DDP averages the "
            "gradients of leaf parameters only"));
      }
      hook_keys_.push_back(acc->add_post_hook(
          std::make_unique<detail::AccumulatedHook>(target_, i)));
      accumulators_.push_back(std::move(acc));
    }
  }

  void reset_step() {
    std::fill(ready_.begin(), ready_.end(), false);
    for (auto& b : buckets_) {
      b.pending = b.params.size();
      b.launched = false;
      b.future = CommFuture();
    }
    next_to_launch_ = 0;
    state_ = StepState::idle;
    callback_token_.reset();
    std::fill(used_.begin(), used_.end(), 0);
    std::fill(was_undefined_.begin(), was_undefined_.end(), 0);
    expect_unused_.clear();
    arrival_.clear();
    step_unowned_held_ = 0;
    std::fill(fires_.begin(), fires_.end(), 0);
    fire_order_.clear();
    finalize_queued_ = false;
  }

  // find_unused_parameters' used-flag all-reduce (a recorded static graph
  // knows the unused parameters without it).
  bool uses_flags() const {
    return opts_.find_unused_parameters() && static_phase_ == StaticPhase::off;
  }

  // A step is abandoned when it is running but the graph task that held
  // its end-of-backward callback is gone (the callback's token expired):
  // that backward threw, or another final callback before ours did.
  bool step_abandoned() const {
    return state_ == StepState::running && callback_token_.expired();
  }

  // Waits for `work`; a failure is kept in `failed` unless an earlier one
  // is, so callers wait for everything they started (nothing stays in
  // flight) and report the first error. True when it completed.
  bool wait_keeping_first(const dist::compat::WorkPtr& work, const char* what,
                          std::exception_ptr& failed) {
    try {
      dist::detail::wait(group_, work, what);
      return true;
    } catch (...) {
      if (!failed) failed = std::current_exception();
      return false;
    }
  }

  // Starts the all-reduce of one used-flag per parameter (`used`: this
  // rank's flags, or null for all zero), after every bucket, at the same
  // point on every rank.
  std::pair<torch::Tensor, dist::compat::WorkPtr> start_used_flags(
      const std::vector<uint8_t>* used) {
    auto flags =
        torch::zeros({static_cast<int64_t>(params_.size())}, torch::kInt32);
    if (used) {
      auto* f = flags.data_ptr<int32_t>();
      for (std::size_t i = 0; i < used->size(); ++i) f[i] = (*used)[i];
    }
    if (!group_.device().is_cpu()) flags = flags.to(group_.device());
    dist::CollectiveTag tag("used parameters");
    auto work = dist::all_reduce_async(group_, flags);
    return {flags, work};
  }

  // Waits for every launched bucket, then resets. Returns the first
  // failure's message (empty when every bucket completed).
  std::string drain_and_reset() {
    std::string error;
    if (state_ == StepState::running) ++abandoned_steps_;
    for (auto& b : buckets_) {
      // The collective in flight only: the hook's later steps (and the
      // state they would update) are not run for a step nobody wants.
      if (!b.launched) continue;
      try {
        b.future.wait_current(group_, "gradient all-reduce");
      } catch (const std::exception& e) {
        if (error.empty()) error = e.what();
      } catch (...) {
        if (error.empty()) error = "unknown error";
      }
    }
    release_unowned();
    reset_step();
    return error;
  }

  void finish_abandoned() {
    if (static_phase_ != StaticPhase::off) {
      if (state_ != StepState::running || !callback_token_.expired()) return;
      auto error = drain_and_reset();
      throw Error(ddpkit::detail::cat(
          "DDP static_graph: the previous backward was neither finished "
          "(Reducer::finish_backward) nor abandoned (Reducer::abandon_step); "
          "the DDP engine calls them",
          error.empty() ? "" : "; waiting for its buckets failed: ", error));
    }
    if (!step_abandoned()) return;
    auto error = drain_and_reset();
    if (!error.empty()) {
      throw Error(ddpkit::detail::cat(
          "DDP: the previous step's reduction did not finish (its backward "
          "threw after starting gradient all-reduces, and waiting for them "
          "failed): ",
          error));
    }
  }

  // Parameter i's view into its bucket (ZeRO-2: the bucket is allocated
  // if it was freed).
  torch::Tensor& view_of(std::size_t i) {
    const std::size_t bi = slot_bucket_[i];
    if (!buckets_[bi].flat.defined()) allocate_unowned(bi);
    return buckets_[bi].views[slot_index_[i]];
  }

  // Makes parameter i's .grad its bucket view, keeping what .grad holds.
  // Free when .grad is the view already (the usual case: autograd
  // accumulated into it); one copy after the gradient was set to None or
  // replaced.
  void adopt_grad(std::size_t i) {
    auto& view = view_of(i);
    auto& g = params_[i].mutable_grad();
    if (!g.defined()) {
      view.zero_();
      g = view;
      was_undefined_[i] = 1;
    } else if (!is_view_of(g, view)) {
      view.copy_(g);
      if (i < loose_.size() && loose_[i]) {
        loose_bytes_ -=
            std::min(loose_bytes_, static_cast<uint64_t>(g.nbytes()));
        loose_[i] = 0;
      }
      g = view;
      ++gradient_copies_;
    }
  }

  // Runs on an autograd thread after parameter i's AccumulateGrad: .grad
  // holds everything accumulated so far, including earlier no_sync steps.
  // Parameters on several devices run hooks on several threads: the step's
  // state is guarded by mutex_.
  void on_accumulated(std::size_t i) {
    std::lock_guard<std::mutex> lock(mutex_);
    used_[i] = 1;           // also under no_sync: it has a gradient to average
    if (!enabled_) return;  // no_sync: the sum stays in .grad
    if (static_phase_ != StaticPhase::off) {
      on_accumulated_static(i);
      return;
    }
    if (step_abandoned()) {
      throw Error(ddpkit::detail::cat(
          "DDP: the previous step's reduction did not finish (its backward "
          "threw after starting gradient all-reduces), so this backward ",
          "would run on top of it; call the reducer's prepare_for_backward() "
          "or zero_grad() before the next backward (the DDP engine's forward "
          "and zero_grad do)"));
    }
    if (state_ != StepState::running) {
      state_ = StepState::running;
      step_bytes_at_start_ = group_.bytes_started();
      count_loose_gradients(i);
      note_unowned_held();
      // The token lives as long as the graph task holding the callback.
      auto token = std::make_shared<char>();
      callback_token_ = token;
      torch::autograd::Engine::get_default_engine().queue_callback(
          [this, token] { finalize(); });
      // Parameters the graph walk found unused: ready now, so the buckets
      // holding them launch while backward still runs.
      torch::NoGradGuard no_grad;
      for (auto k : expect_unused_) {
        if (k == i || ready_[k]) continue;
        adopt_grad(k);
        mark_ready(k);
      }
    }
    if (ready_[i]) {
      const bool walked_past =
          std::find(expect_unused_.begin(), expect_unused_.end(), i) !=
          expect_unused_.end();
      throw Error(ddpkit::detail::cat(
          "DDP: parameter ", names_[i],
          " was marked ready twice in one backward: its gradient was "
          "accumulated again after it had been handed to an all-reduce ",
          walked_past
              ? "(find_unused_parameters found it unreachable from the "
                "model's output, yet backward reached it: is it used in the "
                "loss outside the model's forward?)"
              : "(a reentrant backward, e.g. reentrant activation "
                "checkpointing, or a custom autograd function that calls "
                "backward). Use non-reentrant checkpointing, or compute that "
                "part outside the DDP model"));
    }
    torch::NoGradGuard no_grad;
    adopt_grad(i);
    mark_ready(i);
  }

  // See Note [Static graphs].
  void on_accumulated_static(std::size_t i) {
    torch::NoGradGuard no_grad;
    if (state_ != StepState::running) {
      state_ = StepState::running;
      step_bytes_at_start_ = group_.bytes_started();
      count_loose_gradients(i);
      if (static_phase_ == StaticPhase::fixed) {
        for (auto k : static_unused_) {
          adopt_grad(k);
          mark_ready(k);
        }
      }
    }
    const int32_t n = ++fires_[i];
    adopt_grad(i);  // later accumulations add into the bucket view
    if (static_phase_ == StaticPhase::recording) {
      fire_order_.push_back(i);
      return;
    }
    if (n > expected_[i]) {
      throw Error(ddpkit::detail::cat(
          "DDP static_graph: parameter ", names_[i], " received a gradient ", n,
          " times in this backward, but ", expected_[i],
          " times in the first step: the graph changed, which static_graph "
          "does not allow (turn it off for this model)"));
    }
    if (n < expected_[i]) return;
    mark_ready(i);
    if (next_to_launch_ == buckets_.size() && !finalize_queued_) {
      // Every gradient is in: the callback may run at the end of whichever
      // (possibly nested) graph task is current.
      finalize_queued_ = true;
      auto token = std::make_shared<char>();
      callback_token_ = token;
      torch::autograd::Engine::get_default_engine().queue_callback(
          [this, token] { finalize(); });
    }
  }

  // The static graph's first step, after backward (see Note [Static
  // graphs]): the counts agreed across ranks, every bucket reduced, the
  // buckets rebuilt in the order of the last accumulations.
  void finalize_recording() {
    torch::NoGradGuard no_grad;
    const auto t0 = Trace::clock::now();
    const std::size_t n = params_.size();
    auto stats = torch::zeros({static_cast<int64_t>(2 * n)}, torch::kLong);
    auto* st = stats.data_ptr<int64_t>();
    for (std::size_t k = 0; k < n; ++k) {
      st[k] = fires_[k];
      st[n + k] = static_cast<int64_t>(fires_[k]) * fires_[k];
    }
    if (!group_.device().is_cpu()) stats = stats.to(group_.device());
    {
      dist::CollectiveTag tag("static graph counts");
      dist::all_reduce(group_, stats);
    }
    stats = stats.cpu();
    st = stats.data_ptr<int64_t>();
    const int64_t world = group_.size();
    for (std::size_t k = 0; k < n; ++k) {
      if (st[n + k] * world == st[k] * st[k]) continue;
      const auto mine = fires_[k];
      (void)drain_and_reset();
      throw Error(ddpkit::detail::cat(
          "DDP static_graph: the ranks' graphs differ in the first step: "
          "parameter ",
          names_[k], " received a gradient ", mine,
          " time(s) on this rank and ", st[k], " in total over ", world,
          " ranks; static_graph needs the same graph on every rank"));
    }
    expected_.assign(fires_.begin(), fires_.end());
    static_unused_.clear();
    for (std::size_t k = 0; k < n; ++k) {
      if (expected_[k] == 0) static_unused_.push_back(k);
    }
    // Unused parameters first (ready at a step's start), then by the
    // position of each parameter's last accumulation.
    std::vector<std::size_t> last(n, 0);
    for (std::size_t pos = 0; pos < fire_order_.size(); ++pos) {
      last[fire_order_[pos]] = pos + 1;
    }
    std::vector<std::size_t> order(n);
    for (std::size_t k = 0; k < n; ++k) order[k] = k;
    std::stable_sort(
        order.begin(), order.end(),
        [&](std::size_t a, std::size_t b) { return last[a] < last[b]; });
    in_finalize_ = true;
    ddpkit::detail::ScopeExit leave([this] { in_finalize_ = false; });
    launched_now_ = 0;
    launched_in_backward_ = 0;
    for (auto k : order) {
      adopt_grad(k);
      mark_ready(k);
    }
    std::exception_ptr failed;
    complete_buckets("gradient all-reduce", failed);
    restore_unused_grads();
    static_phase_ = StaticPhase::fixed;
    complete_step(t0, failed);
  }

  // A recorded static graph: a parameter no rank uses keeps the undefined
  // gradient it had before the step (as find_unused_parameters gives).
  void restore_unused_grads() {
    for (auto k : static_unused_) {
      if (was_undefined_[k]) params_[k].mutable_grad() = torch::Tensor();
    }
  }

  void mark_ready(std::size_t i) {
    ready_[i] = true;
    if (opts_.rebuild_buckets() && rebuilds_ == 0) arrival_.push_back(i);
    auto& b = buckets_[slot_bucket_[i]];
    if (--b.pending == 0) launch_ready_in_order();
  }

  // Buckets start strictly in index order on every rank, so the sequence of
  // collectives is the same everywhere even if gradients arrive in another
  // order.
  void launch_ready_in_order() {
    while (next_to_launch_ < buckets_.size() &&
           buckets_[next_to_launch_].pending == 0) {
      launch(next_to_launch_);
      if (!in_finalize_) ++launched_now_;
      ++next_to_launch_;
    }
  }

  // Hands bucket bi to the hook.
  void launch(std::size_t bi) {
    auto& b = buckets_[bi];
    b.launch_time = Trace::clock::now();
    b.launched = true;
    GradBucket view{bi,     buckets_.size(), steps_completed_,
                    b.flat, b.views,         b.params};
    dist::CollectiveTag tag("bucket", static_cast<long>(bi));
    if (b.owner >= 0) {  // ZeRO-2: the mean on its owner only
      b.future = CommFuture(dist::reduce_mean_async(group_, b.flat, b.owner));
    } else {
      b.future = comm_.run(group_, view);
    }
  }

  // Completes every launched bucket's future: one link of each in bucket
  // order, then the next link of each, so the collectives a hook's
  // continuations start come in the same order on every rank (and the
  // second round of one bucket overlaps with the others'). A bucket whose
  // future fails is dropped; the others are still completed, so nothing
  // stays in flight. Records each bucket in the trace.
  void complete_buckets(const char* what, std::exception_ptr& failed) {
    for (bool more = true; more;) {
      more = false;
      for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
        auto& b = buckets_[bi];
        if (!b.launched || !b.future.pending()) continue;
        try {
          dist::CollectiveTag tag("bucket", static_cast<long>(bi));
          b.future.advance(group_, what);
        } catch (...) {
          if (!failed) failed = std::current_exception();
          b.future = CommFuture();
        }
        if (b.future.pending()) {
          more = true;
        } else if (trace_) {
          trace_->record("allreduce bucket " + std::to_string(bi),
                         b.launch_time, Trace::clock::now(), 1);
        }
      }
    }
  }

  void finalize() {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::NoGradGuard no_grad;
    auto t0 = Trace::clock::now();
    launched_in_backward_ = launched_now_;
    launched_now_ = 0;
    in_finalize_ = true;
    ddpkit::detail::ScopeExit leave([this] { in_finalize_ = false; });
    // Parameters that got no gradient this step (those used only in
    // earlier no_sync micro-steps have one: theirs is averaged).
    std::vector<std::size_t> missing;
    bool error = false;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) continue;
      missing.push_back(i);
      error |= !used_[i] && !opts_.find_unused_parameters();
    }
    if (error) {
      std::erase_if(missing, [&](std::size_t i) { return used_[i] != 0; });
      const std::string list =
          name_list(missing, [this](std::size_t k) { return names_[k]; });
      (void)drain_and_reset();  // nothing left in flight
      throw Error(ddpkit::detail::cat(
          "DDP: ", missing.size(),
          " parameter(s) received no gradient in this backward: ", list,
          ". Either use them in forward or set find_unused_parameters(true)."));
    }
    // Unused here, maybe used on another rank: send what .grad holds
    // (zero, or what earlier no_sync steps accumulated).
    for (auto i : missing) {
      adopt_grad(i);
      mark_ready(i);
    }
    // Which parameters some rank used (launched after every bucket, at the
    // same point on every rank).
    torch::Tensor used_by;
    dist::compat::WorkPtr used_work;
    if (uses_flags()) {
      std::tie(used_by, used_work) = start_used_flags(&used_);
    }
    // Wait for every bucket; the averages land in place, in .grad. After a
    // failure the rest are still waited for (a broken channel fails them at
    // once), so the error leaves nothing in flight.
    std::exception_ptr failed;
    for (const auto& b : buckets_) {
      if (!b.launched && !failed) {
        failed = std::make_exception_ptr(
            Error("DDP reducer: a bucket was never launched (internal)"));
      }
    }
    complete_buckets("gradient all-reduce", failed);
    release_unowned();  // ZeRO-2: what other ranks own
    if (static_phase_ == StaticPhase::fixed) restore_unused_grads();
    if (used_work &&
        wait_keeping_first(used_work, "used-parameter all-reduce", failed)) {
      // Unused on every rank: its gradient stays as it was before the step
      // (undefined stays undefined).
      auto counts = used_by.cpu();
      const auto* c = counts.data_ptr<int32_t>();
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if (c[i] == 0 && was_undefined_[i]) {
          params_[i].mutable_grad() = torch::Tensor();
        }
      }
    }
    // Before a rebuild, which starts a new step's counts.
    last_step_unowned_held_ = step_unowned_held_;
    complete_step(t0, failed);
  }

  // The end of every synchronised step (finalize, finalize_recording),
  // every bucket completed: the buckets rebuilt in arrival order once, the
  // step counted and reset, then the first failure rethrown or the wait
  // since `t0` recorded.
  void complete_step(Trace::clock::time_point t0,
                     const std::exception_ptr& failed) {
    if (!failed && opts_.rebuild_buckets() && rebuilds_ == 0 &&
        rebuild_allowed_ && arrival_.size() == params_.size()) {
      rebuild_in_arrival_order();
    }
    ++steps_completed_;
    last_step_bytes_ = group_.bytes_started() - step_bytes_at_start_;
    reset_step();
    if (failed) std::rethrow_exception(failed);
    const auto t1 = Trace::clock::now();
    last_wait_seconds_ = std::chrono::duration<double>(t1 - t0).count();
    if (trace_) trace_->record("wait after backward", t0, t1, 0);
  }

  // Up to ten of `which`, each as `describe` gives it, joined by ", "
  // (", ..." after the tenth): the parameters an error names.
  template <class Describe>
  static std::string name_list(const std::vector<std::size_t>& which,
                               Describe describe) {
    std::string list;
    for (std::size_t k = 0; k < which.size() && k < 10; ++k) {
      list += (k ? ", " : "") + describe(which[k]);
    }
    if (which.size() > 10) list += ", ...";
    return list;
  }

  Trace* trace_;
  Comm comm_;
  int64_t steps_completed_ = 0;
  uint64_t step_bytes_at_start_ = 0, last_step_bytes_ = 0;
  std::vector<std::string> names_;
  std::shared_ptr<detail::AccumulatedHook::Callback> target_ =
      std::make_shared<detail::AccumulatedHook::Callback>();
  std::vector<ddpkit::compat::GradAccumulatorPtr> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::vector<bool> ready_;
  std::size_t next_to_launch_ = 0;
  // See Note [The reducer's step protocol].
  enum class StepState { idle, running };
  StepState state_ = StepState::idle;
  std::weak_ptr<char> callback_token_;  // see on_accumulated
  std::size_t abandoned_steps_ = 0;
  std::size_t gradient_copies_ = 0;
  // Per parameter: got a gradient since the last synchronised step (no_sync
  // micro-steps included); .grad was undefined before this step bound it.
  std::vector<uint8_t> used_, was_undefined_;
  std::vector<std::size_t> expect_unused_;  // from the graph walk
  bool in_finalize_ = false;
  std::size_t launched_now_ = 0, launched_in_backward_ = 0;
  std::vector<std::size_t> arrival_;  // until the rebuild
  std::size_t rebuilds_ = 0;
  bool rebuild_allowed_ = true;
  std::mutex mutex_;
  bool enabled_ = true;
  // See Note [Static graphs].
  enum class StaticPhase { off, recording, fixed };
  StaticPhase static_phase_ = StaticPhase::off;
  std::vector<int32_t> fires_;     // accumulations per parameter this step
  std::vector<int32_t> expected_;  // recorded by the first step
  std::vector<std::size_t> static_unused_;  // expected_ 0: no rank uses them
  std::vector<std::size_t> fire_order_;     // the first step's accumulations
  bool finalize_queued_ = false;
  double last_wait_seconds_ = 0;
};

}  // namespace ddpkit::parallel
