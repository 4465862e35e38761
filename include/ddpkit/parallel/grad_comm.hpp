// SPDX-License-Identifier: BSD-3-Clause
// Communication hooks for the DDP reducer: how one bucket of gradients is
// averaged across ranks (PyTorch's `register_comm_hook`). A hook is a
// policy type with state: the reducer owns one instance, hands it every
// bucket as it fills, and waits for the `CommFuture` it returns. Built in:
// `AllReduceMean` (the default), `Fp16Compression`, `Bf16Compression` and
// `PowerSGD`.
//
// Writing one (see Note [Communication hooks] below):
// ```
// struct Float16Wire {                  // what Fp16Compression does
//   static constexpr const char* name = "my_fp16";
//   std::vector<torch::Tensor> wire;    // state: one buffer per bucket
//   ddpkit::parallel::CommFuture run(const ddpkit::dist::Group& g,
//                                    ddpkit::parallel::GradBucket& b) {
//     if (wire.size() <= b.index) wire.resize(b.index + 1);
//     wire[b.index] = b.buffer.div(g.size()).to(torch::kHalf);
//     auto half = wire[b.index];
//     return ddpkit::parallel::CommFuture(
//                ddpkit::dist::all_reduce_async(g, half))
//         .then([buf = b.buffer, half]() mutable {
//           buf.copy_(half);                    // the mean, back in place
//           return ddpkit::dist::compat::WorkPtr();  // nothing more to send
//         });
//   }
// };
// using MyDDP = ddpkit::parallel::BasicDDP<Float16Wire>;
// ```
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstdio>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/parse.hpp"
#include "ddpkit/detail/seed.hpp"
#include "ddpkit/distributed/collectives.hpp"

namespace ddpkit::parallel {

// Note [Communication hooks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Communication hooks (PyTorch's `register_comm_hook`, as a policy with
// state): `BasicDDP<Hook>`'s reducer owns one `Hook` and hands it each bucket
// as it fills, a `GradBucket` (flat `buffer`, per-parameter `gradients`
// views, the reducer's stable parameter indices, bucket index and count, and
// `step`, the synchronised steps completed). `run(group, bucket)` returns a
// `CommFuture`: the collective it started plus continuations (`then`), each
// of which may start another collective. The reducer advances every bucket's
// future one link at a time, in bucket order (all first links, then all
// second links...), so continuations' collectives come in the same order on
// every rank; they run on the thread that finishes backward, after the last
// bucket is launched (a second round does not overlap backward; untested
// whether chaining on gloo's completion threads would be faster). An
// abandoned step waits for the collective in flight only and drops the
// continuations, so a hook that updates its state in its last link (PowerSGD
// does) keeps no trace of that step. Optional `prepare(group)` runs in the
// reducer's constructor on every rank. A hook constructible from
// `CommOptions` gets `DDPOptions::comm()`. Built in: `AllReduceMean`
// (default), `Fp16Compression`, `Bf16Compression`, `PowerSGD`, and
// `RuntimeComm` (one of those four chosen at run time by `CommOptions::kind`,
// so one Trainer type serves the examples' `--comm` flag). Writing one (fp16
// on the wire; also at the top of `parallel/grad_comm.hpp`): ```cpp struct
// Float16Wire { static constexpr const char* name = "my_fp16";
// std::vector<torch::Tensor> wire; // state: one buffer per bucket
// ddpkit::parallel::CommFuture run(const ddpkit::dist::Group& g,
// ddpkit::parallel::GradBucket& b) { if (wire.size() <= b.index)
// wire.resize(b.index + 1); wire[b.index] =
// b.buffer.div(g.size()).to(torch::kHalf); auto half = wire[b.index]; return
// ddpkit::parallel::CommFuture( ddpkit::dist::all_reduce_async(g, half))
// .then([buf = b.buffer, half]() mutable { buf.copy_(half); // the mean, back
// in place return ddpkit::dist::compat::WorkPtr(); // nothing more to send
// }); } }; using MyDDP = ddpkit::parallel::BasicDDP<Float16Wire>; ``` Limits:
// continuations run after backward (no overlap of a second round); a hook
// must start the same collectives in the same order on every rank (as any
// collective code). - fp16/bf16 divide, cast into a per-bucket wire buffer,
// all-reduce in that type, widen back. On one host the half-precision buffer
// goes through the shared-memory channel (which now adds fp16 and bf16; test:
// the `ddp_train` worker fails unless every bucket of every step is an
// operation of the channel, checked for fp16 and bf16 — red when the channel
// refused half types: "0 of 1 buckets went through shared memory"). It is
// copied through the channel's slots, while float32 buckets are reduced in
// place in shared memory, so on one host fp16 moves fewer bytes but is not
// obviously faster (see BENCHMARKS.md, `comm/`). Where the backend cannot add
// the type (gloo in libtorch 1.13 cannot add bf16 over TCP; found by a
// one-element probe in `prepare`), the bucket is sent uncompressed as float32
// and rank 0 says so once; the old "round to bf16, then send float32" (no
// bytes saved) is gone. A failed probe followed by a failing float32
// all-reduce is a broken group and reported as such (untested: no test breaks
// a group during construction). - PowerSGD (Vogels et al. 2019; PyTorch's
// `powerSGD_hook`): each gradient as an n×m matrix M (first dimension by the
// rest); M += last step's error; P = M·Q (Q: last step's when `warm_start`,
// else a seeded random matrix, the same on every rank); one all-reduce of the
// Ps together with the uncompressed tensors; P orthonormalised (modified
// Gram–Schmidt in float64, twice: one float32 pass made full rank differ from
// plain averaging by 5e-3, now 8.9e-8); Q = Mᵀ·P all-reduced and divided by
// the world size; the gradient becomes P·Qᵀ and M − P·Qᵀ is kept as the
// error. 1-D tensors and matrices that would not shrink by
// `min_compression_rate` go uncompressed; `start_step` plain steps first
// (default 1000, PyTorch's; the CIFAR example uses 100). State is kept per
// parameter, so the bucket rebuild after step 0 loses nothing (PyTorch keys
// it by bucket and needs `start_powerSGD_iter > 1`). Unlike PyTorch's hook,
// uncompressed tensors carry no error (theirs sums to zero over the ranks).
// Tests: at full rank with no minimum rate, 5 steps of SGD with momentum
// equal plain averaging within 8.9e-8; at rank 1 they differ (2.8e-2); with
// error feedback, w0 − w_T = lr·(mean over ranks of the true gradients − mean
// error left) for every parameter (≤ 2.7e-5; red without error feedback:
// 0.59), the ranks' weights are identical, 1-D tensors carry no error, and a
// step carries 596 bytes instead of 3412 (`Group::bytes_started`).
// `examples/cifar10 --comm powersgd --powersgd-rank 2` loses no validation
// accuracy against all-reduce in the CTest run (0.958 both with 0.2's seeds;
// 0.933 against 0.904 with 0.3's, `tests/examples/compare_comm.sh` allows it
// 0.02 lower) with 76.8× fewer gradient bytes per step (`summary.json`'s
// `gradient_bytes_per_step`). Not done: PyTorch's batching of same-shaped
// tensors, and a comparison with PyTorch's own hook in Python (its random Q
// comes from NumPy's generator).

/// One bucket as a hook sees it. `buffer` holds this rank's gradients
/// (summed over any no_sync micro-steps), flat; when the hook's future
/// completes it must hold their mean over the ranks. `gradients[j]` is the
/// view of `buffer` that is parameter `parameters[j]`'s `.grad`, shaped
/// (and strided) like it.
struct GradBucket {
  std::size_t index;  // 0 .. count-1, the order buckets are launched in
  std::size_t count;  // buckets in this step
  /// Synchronised steps completed before this one (0 in the first).
  int64_t step;
  torch::Tensor buffer;
  const std::vector<torch::Tensor>& gradients;
  /// The reducer's indices of the parameters, the same across bucket
  /// rebuilds: key per-parameter state by them.
  const std::vector<std::size_t>& parameters;
  bool is_last() const {
    return index + 1 == count;
  }
};

/// What a hook returns: the collective it started, and what to do after it
/// completes, which may start another collective, and so on. The reducer
/// advances every bucket's future one link at a time, in bucket order, on
/// every rank the same way, so the collectives a hook's continuations start
/// come in the same order everywhere (as collectives must). Continuations
/// run on the thread that finishes the backward, not on a communication
/// thread.
class CommFuture {
 public:
  using Next = std::function<dist::compat::WorkPtr()>;
  /// Already complete: nothing to wait for.
  CommFuture() = default;
  explicit CommFuture(dist::compat::WorkPtr work) : work_(std::move(work)) {}

  /// Appends a step that runs once everything before it has completed; it
  /// returns the work of the collective it starts, or null for none.
  CommFuture& then(Next next) & {
    next_.push_back(std::move(next));
    return *this;
  }
  CommFuture&& then(Next next) && {
    next_.push_back(std::move(next));
    return std::move(*this);
  }

  /// Whether something is left to wait for or run.
  bool pending() const {
    return work_ || !next_.empty();
  }
  /// Waits for the current collective and runs the next step (starting its
  /// collective, if any). `what` names the collective in errors.
  void advance(const dist::Group& g, const char* what) {
    wait_work(g, what);
    if (!next_.empty()) {
      auto next = std::move(next_.front());
      next_.pop_front();
      work_ = next();
    }
  }
  /// Waits for the current collective only and drops the steps after it
  /// (an abandoned step: its results are not wanted).
  void wait_current(const dist::Group& g, const char* what) {
    next_.clear();
    wait_work(g, what);
  }

 private:
  // Waits for the collective in flight, if any (it is gone after, even
  // when the wait throws).
  void wait_work(const dist::Group& g, const char* what) {
    if (!work_) return;
    auto work = std::move(work_);
    work_.reset();
    dist::detail::wait(g, work, what);
  }

  dist::compat::WorkPtr work_;
  std::deque<Next> next_;
};

/// What the reducer needs of a hook: a name, and `run`, which starts
/// averaging one bucket and returns its future. Optional members, called
/// when present: `void prepare(const dist::Group&)` (collective set-up, by
/// the reducer's constructor at the same point on every rank).
template <class H>
concept comm_hook =
    std::movable<H> && requires(H& h, const dist::Group& g, GradBucket& b) {
      { H::name } -> std::convertible_to<std::string_view>;
      { h.run(g, b) } -> std::same_as<CommFuture>;
    };

/// Settings of the built-in hooks (DDPOptions::comm); a hook constructible
/// from it gets it from the DDP engine.
struct PowerSGDOptions {
  /// Rank of the approximation of each gradient matrix.
  TORCH_ARG(int64_t, rank) = 1;
  /// Synchronised steps of plain all-reduce before compression starts
  /// (PyTorch's start_powerSGD_iter; compression early in training costs
  /// accuracy).
  TORCH_ARG(int64_t, start_step) = 1000;
  /// A gradient is compressed only when its n×m matrix is at least this
  /// many times larger than the rank-r factors, (n + m)·r; others (and every
  /// 1-D tensor: biases, BN weights) are averaged uncompressed.
  TORCH_ARG(double, min_compression_rate) = 2.0;
  /// Add last step's compression error to this step's gradient (without it
  /// PowerSGD converges to a worse model).
  TORCH_ARG(bool, error_feedback) = true;
  /// Start each step's power iteration from last step's Q, not a new random
  /// matrix.
  TORCH_ARG(bool, warm_start) = true;
  /// Seed of the random initial Q (the same on every rank).
  TORCH_ARG(uint64_t, seed) = 0;
};

/// The built-in hooks, for choosing one at run time (e.g. a `--comm` flag).
enum class CommKind { allreduce, fp16, bf16, powersgd };

struct CommOptions {
  /// Which built-in hook `RuntimeComm` runs (other hooks ignore it).
  TORCH_ARG(CommKind, kind) = CommKind::allreduce;
  TORCH_ARG(PowerSGDOptions, powersgd) = {};
};

/// Plain averaging: each bucket all-reduced in float32, divided by the
/// world size (through shared memory on one host, in the same pass).
struct AllReduceMean {
  static constexpr const char* name = "allreduce_mean";
  CommFuture run(const dist::Group& g, GradBucket& b) {
    return CommFuture(dist::all_reduce_mean_async(g, b.buffer));
  }
};

namespace detail {

/// Whether the group can add `dtype` (gloo in libtorch 1.13 cannot add
/// bf16 over TCP; the shared-memory channel can). Probed once per process
/// with a one-element all-reduce, called by the reducer's constructor at
/// the same point on every rank. A failed probe is followed by a float32
/// all-reduce: if that fails too, the group is broken (a peer died or timed
/// out), which is reported as such, not taken for "cannot add".
inline bool backend_sums(const dist::Group& g, c10::ScalarType dtype) {
  static std::array<int, 64> probed{};  // 0 unknown, 1 yes, 2 no
  int& known = probed[static_cast<std::size_t>(dtype) % probed.size()];
  if (known == 0) {
    auto t = torch::zeros({1}, torch::TensorOptions(dtype).device(g.device()));
    std::string why;
    try {
      dist::all_reduce(g, t);
      known = 1;
    } catch (const std::exception& e) {
      why = e.what();
      why = ddpkit::detail::first_line(why);
      // The backend's own words, without the wrapper's "(a peer may have
      // died ...)" guess, which the float32 all-reduce below settles.
      const auto own = why.rfind("): ");
      if (own != std::string::npos) why = why.substr(own + 3);
    }
    if (known == 0) {
      auto f = torch::zeros(
          {1}, torch::TensorOptions(torch::kFloat).device(g.device()));
      dist::all_reduce(g, f);  // throws PeerFailure if the group is broken
      known = 2;
      if (g.is_main()) {
        std::fprintf(stderr,
                     "ddpkit: this backend cannot all-reduce %s (%s); "
                     "gradients are sent uncompressed, as float32\n",
                     c10::toString(dtype), why.c_str());
      }
    }
  }
  return known == 1;
}

/// Compressed averaging: the bucket travels as `Dtype` (half the bytes of
/// float32), is summed in `Dtype`, and is widened back. Dividing before the
/// cast keeps sums of large gradients inside fp16's range. On one host the
/// half-precision buffer goes through the shared-memory channel; where the
/// backend cannot add `Dtype`, the bucket is sent as float32 (said once).
template <c10::ScalarType Dtype>
struct CompressedAllReduce {
  void prepare(const dist::Group& g) {
    sums_ = backend_sums(g, Dtype);
  }
  /// False where the backend cannot add `Dtype`: buckets go as float32.
  bool compressing() const {
    return sums_;
  }
  CommFuture run(const dist::Group& g, GradBucket& b) {
    if (!sums_) return CommFuture(dist::all_reduce_mean_async(g, b.buffer));
    if (wire_.size() <= b.index) wire_.resize(b.index + 1);
    auto& wire = wire_[b.index];
    if (!wire.defined() || wire.numel() != b.buffer.numel()) {
      wire = torch::empty({b.buffer.numel()}, b.buffer.options().dtype(Dtype));
    }
    b.buffer.div_(g.size());
    wire.copy_(b.buffer);
    return CommFuture(dist::all_reduce_async(g, wire))
        .then([buffer = b.buffer, wire]() mutable {
          buffer.copy_(wire);
          return dist::compat::WorkPtr();
        });
  }

 private:
  bool sums_ = true;
  std::vector<torch::Tensor> wire_;  // per bucket
};

}  // namespace detail

/// fp16 on the wire. Documented tolerance: relative error of the averaged
/// gradient about 1e-3 (fp16 has an 11-bit significand), for gradients
/// within fp16's range (|g| < 65504 · world_size).
struct Fp16Compression : detail::CompressedAllReduce<torch::kHalf> {
  static constexpr const char* name = "fp16";
};

/// bf16 on the wire. Documented tolerance: relative error about 1e-2
/// (8-bit significand), float32's range.
struct Bf16Compression : detail::CompressedAllReduce<torch::kBFloat16> {
  static constexpr const char* name = "bf16";
};

/// PowerSGD (Vogels, Karimireddy, Jaggi 2019; PyTorch's `powerSGD_hook`):
/// each gradient reshaped to an n×m matrix M (first dimension by the rest)
/// is sent as two rank-r factors. Per step and bucket:
///   1. M += last step's error (error feedback); P = M·Q (Q: last step's,
///      warm start, or random, orthogonalised);
///   2. all-reduce (sum) the Ps with the uncompressed tensors, in one
///      buffer; orthonormalise each P (Gram–Schmidt);
///   3. Q = Mᵀ·P, all-reduce (sum) the Qs, divide by the world size;
///   4. the gradient becomes P·Qᵀ (the same on every rank); the error
///      M − P·Qᵀ is kept for the next step.
/// Before `start_step` synchronised steps, and for 1-D tensors and matrices
/// too small to gain `min_compression_rate`, the plain mean is sent. State
/// is kept per parameter, so it survives the reducer's bucket rebuild.
/// Unlike PyTorch's hook, uncompressed tensors keep no error (it would sum
/// to zero over the ranks). With rank ≥ min(n, m) the result equals plain
/// averaging up to rounding.
class PowerSGD {
 public:
  static constexpr const char* name = "powersgd";
  PowerSGD() = default;
  explicit PowerSGD(PowerSGDOptions opts) : opts_(opts) {
    if (opts_.rank() < 1 || opts_.start_step() < 0 ||
        !(opts_.min_compression_rate() >= 0)) {
      throw UsageError(ddpkit::detail::cat(
          "PowerSGD: rank ", opts_.rank(), ", start_step ", opts_.start_step(),
          ", min_compression_rate ", opts_.min_compression_rate(),
          " (expected rank >= 1, start_step >= 0, min_compression_rate >= "
          "0)"));
    }
  }
  explicit PowerSGD(const CommOptions& opts) : PowerSGD(opts.powersgd()) {}

  const PowerSGDOptions& options() const {
    return opts_;
  }
  /// The compression error parameter `index` carries into the next step
  /// (as its n×m matrix), undefined if it has none.
  torch::Tensor error_of(std::size_t index) const {
    auto it = state_.find(index);
    return it == state_.end() ? torch::Tensor() : it->second.error;
  }
  /// Gradients compressed in the last step (0 before start_step).
  std::size_t compressed_last_step() const {
    return compressed_last_step_;
  }

  CommFuture run(const dist::Group& g, GradBucket& b) {
    if (b.index == 0) compressed_last_step_ = 0;
    if (b.step < opts_.start_step()) {
      return CommFuture(dist::all_reduce_mean_async(g, b.buffer));
    }
    torch::NoGradGuard no_grad;
    auto step = std::make_shared<Step>();
    int64_t plain_numel = 0, p_numel = 0, q_numel = 0;
    for (std::size_t j = 0; j < b.gradients.size(); ++j) {
      const auto& grad = b.gradients[j];
      if (grad.dim() >= 2 && grad.numel() > 0) {
        const int64_t n = grad.size(0), m = grad.numel() / n;
        const int64_t r = std::min({n, m, opts_.rank()});
        if (static_cast<double>((n + m) * r) * opts_.min_compression_rate() <
            static_cast<double>(n * m)) {
          step->matrices.push_back(
              {b.parameters[j], grad, n, m, r, {}, {}, {}});
          p_numel += n * r;
          q_numel += m * r;
          continue;
        }
      }
      step->plain.push_back(grad);
      plain_numel += grad.numel();
    }
    compressed_last_step_ += step->matrices.size();
    const auto opts = b.buffer.options();
    // [uncompressed values..., P of each matrix...]: one all-reduce.
    step->first = torch::empty({plain_numel + p_numel}, opts);
    step->qs = torch::empty({q_numel}, opts);
    int64_t at = 0;
    for (const auto& t : step->plain) {
      step->first.narrow(0, at, t.numel()).view(t.sizes()).copy_(t);
      at += t.numel();
    }
    int64_t q_at = 0;
    for (auto& mat : step->matrices) {
      auto& st = state_[mat.param];
      // M (+ last step's error), contiguous n×m.
      mat.input = mat.grad.reshape({mat.n, mat.m}).clone();
      if (opts_.error_feedback() && st.error.defined() &&
          st.error.sizes() == mat.input.sizes()) {
        mat.input.add_(st.error);
      }
      auto q = (opts_.warm_start() && st.q.defined() && st.q.size(0) == mat.m &&
                st.q.size(1) == mat.r)
                   ? st.q.clone()
                   : random_q(mat, b.step);
      orthonormalise(q);
      mat.p = step->first.narrow(0, at, mat.n * mat.r).view({mat.n, mat.r});
      at += mat.n * mat.r;
      torch::mm_out(mat.p, mat.input, q);
      mat.q = step->qs.narrow(0, q_at, mat.m * mat.r).view({mat.m, mat.r});
      q_at += mat.m * mat.r;
    }
    const auto world = g.size();
    return CommFuture(dist::all_reduce_async(g, step->first))
        .then([step, g, world] {
          torch::NoGradGuard no_grad;
          int64_t off = 0;
          for (auto& t : step->plain) {
            t.copy_(step->first.narrow(0, off, t.numel()).view(t.sizes()));
            t.div_(world);
            off += t.numel();
          }
          if (step->matrices.empty()) return dist::compat::WorkPtr();
          for (auto& mat : step->matrices) {
            orthonormalise(mat.p);
            torch::mm_out(mat.q, mat.input.t(), mat.p);
          }
          return dist::all_reduce_async(g, step->qs);
        })
        .then([this, step, world] {
          torch::NoGradGuard no_grad;
          if (step->matrices.empty()) return dist::compat::WorkPtr();
          step->qs.div_(world);
          for (auto& mat : step->matrices) {
            auto approx = torch::mm(mat.p, mat.q.t());
            mat.grad.copy_(approx.view(mat.grad.sizes()));
            auto& st = state_[mat.param];
            if (opts_.error_feedback()) st.error = mat.input.sub_(approx);
            if (opts_.warm_start()) st.q = mat.q.clone();
          }
          return dist::compat::WorkPtr();
        });
  }

 private:
  struct Matrix {
    std::size_t param;
    torch::Tensor grad;  // the bucket view (the parameter's shape)
    int64_t n, m, r;
    torch::Tensor input, p, q;
  };
  struct Step {
    torch::Tensor first, qs;  // [uncompressed..., Ps...] and the Qs
    std::vector<torch::Tensor> plain;
    std::vector<Matrix> matrices;
  };
  struct ParamState {
    torch::Tensor error;  // n×m
    torch::Tensor q;      // m×r, averaged
  };

  // Random m×r, the same on every rank: seeded by the options' seed, the
  // parameter and (without warm start) the step.
  torch::Tensor random_q(const Matrix& mat, int64_t step) const {
    const uint64_t seed = ddpkit::detail::mix_seed(
        {opts_.seed(), static_cast<uint64_t>(mat.param),
         opts_.warm_start() ? 0 : static_cast<uint64_t>(step)});
    auto gen = at::detail::createCPUGenerator(seed);
    auto q = torch::randn({mat.m, mat.r}, gen, torch::kFloat);
    return q.to(mat.input.options());
  }

  // Orthonormalises the columns of `a` (k×r, r small) in place: modified
  // Gram–Schmidt in float64, twice (one float32 pass loses orthogonality
  // in proportion to the matrix's condition number, which made full-rank
  // PowerSGD differ from plain averaging by 5e-3). A column that is
  // (numerically) zero stays zero.
  static void orthonormalise(torch::Tensor& a) {
    auto d = a.to(torch::kDouble);
    const int64_t r = d.size(1);
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t i = 0; i < r; ++i) {
        auto col = d.narrow(1, i, 1);
        col.div_(col.norm().clamp_min(1e-300));
        if (i + 1 < r) {
          auto rest = d.narrow(1, i + 1, r - i - 1);
          rest.sub_(col.mm(col.t().mm(rest)));
        }
      }
    }
    a.copy_(d);
  }

  PowerSGDOptions opts_;
  std::unordered_map<std::size_t, ParamState> state_;
  std::size_t compressed_last_step_ = 0;
};

/// Parses "allreduce", "fp16", "bf16" or "powersgd"; UsageError otherwise.
inline CommKind parse_comm_kind(const std::string& s) {
  return ddpkit::detail::parse_choice<CommKind>(
      "communication hook", s,
      {{"allreduce", CommKind::allreduce},
       {"fp16", CommKind::fp16},
       {"bf16", CommKind::bf16},
       {"powersgd", CommKind::powersgd}});
}

/// A hook chosen at run time among the built-in ones by
/// `CommOptions::kind`: one Trainer type serves every `--comm` choice.
class RuntimeComm {
 public:
  static constexpr const char* name = "runtime";
  RuntimeComm() = default;
  explicit RuntimeComm(const CommOptions& opts) {
    switch (opts.kind()) {
      case CommKind::allreduce: hook_ = AllReduceMean(); break;
      case CommKind::fp16: hook_ = Fp16Compression(); break;
      case CommKind::bf16: hook_ = Bf16Compression(); break;
      case CommKind::powersgd: hook_ = PowerSGD(opts.powersgd()); break;
    }
  }
  void prepare(const dist::Group& g) {
    std::visit(
        [&](auto& h) {
          if constexpr (requires { h.prepare(g); }) h.prepare(g);
        },
        hook_);
  }
  CommFuture run(const dist::Group& g, GradBucket& b) {
    return std::visit([&](auto& h) { return h.run(g, b); }, hook_);
  }
  /// The chosen hook's name.
  std::string_view chosen() const {
    return std::visit([](const auto& h) -> std::string_view { return h.name; },
                      hook_);
  }
  /// The chosen hook if it is an `H`, else null.
  template <class H>
  H* get() {
    return std::get_if<H>(&hook_);
  }

 private:
  std::variant<AllReduceMean, Fp16Compression, Bf16Compression, PowerSGD> hook_;
};

}  // namespace ddpkit::parallel
