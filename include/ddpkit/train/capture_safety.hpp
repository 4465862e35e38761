// SPDX-License-Identifier: BSD-3-Clause
// Whether a training step could be captured whole in a CUDA graph, checked
// on any device (a CPU too): the step's operators are observed through
// libtorch's RecordFunction callbacks, and what a capture cannot take — a
// host synchronisation, or a step that does not repeat the same operators on
// the same shapes — is named.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/scope_guard.hpp"
#include "ddpkit/detail/strings.hpp"

namespace ddpkit::train {

// Note [Capture safety]
// ~~~~~~~~~~~~~~~~~~~~~
// A CUDA graph replays the kernels one capture recorded: a step can be
// captured only if it never waits for the device on the host (a value read
// back: `item()`, a Scalar taken from a tensor, `nonzero`, `masked_select`
// and other ops whose output size depends on data; on a GPU each is a
// synchronisation, which capture forbids) and if every step launches the
// same operators on the same shapes (the graph's memory pool and kernels
// are fixed: a short last batch, a data-dependent branch or a different
// allocation pattern breaks it). Both are properties of the operator
// sequence, so they are checked without a GPU: `check_capture_safety` runs
// the step a few times to warm up, then records every operator of the
// checked steps (RecordFunction, global callback: autograd's operators too,
// on whichever thread runs them) with its tensor inputs' shapes, and
// reports (1) each operator of the host-synchronising list below, where it
// came in the step, (2) the first operator at which two checked steps
// differ (name or shapes), allocations (`empty`, `empty_strided`)
// included, since their sizes are what a graph's pool replays. Not
// checked: host scalars a step reads that are not tensors (a learning rate
// passed as a double is baked into a capture: issue-level work), and CUDA
// specifics (stream use, NCCL's own rules). Test (train suite): a step
// with an inserted `loss.item()` is named, a step whose batch shrinks is
// named at its first differing operator, a plain SGD step passes.

/// The operators that read a device value back to the host (or whose
/// output size depends on the data, which needs the same): any of them in
/// a step stops a CUDA graph capture.
inline const std::vector<std::string>& host_sync_operators() {
  static const std::vector<std::string> ops = {
      "aten::_local_scalar_dense",  // item(), Scalar(tensor), bool(tensor)
      "aten::item",
      "aten::is_nonzero",
      "aten::nonzero",
      "aten::masked_select",
      "aten::unique_consecutive",
      "aten::_unique",
      "aten::_unique2",
      "aten::unique_dim",
      "aten::equal",
      "aten::allclose",
      "aten::bincount",
      "aten::repeat_interleave",
      "aten::_assert_scalar",
  };
  return ops;
}

/// What `check_capture_safety` runs.
struct CaptureSafetyOptions {
  /// Steps run first and not checked (optimizer state made, buckets
  /// rebuilt, a static graph recorded: what a capture's warm-up does).
  TORCH_ARG(int, warmup_steps) = 3;
  /// Steps recorded and compared (at least 1; 2 or more also checks that
  /// the steps repeat).
  TORCH_ARG(int, checked_steps) = 2;
};

/// One reason a step cannot be captured.
struct CaptureViolation {
  /// "host sync" or "step differs".
  std::string kind;
  /// The operator (e.g. "aten::_local_scalar_dense").
  std::string op;
  /// Which checked step (0-based) and the operator's position in it.
  int step = 0;
  std::size_t index = 0;
  /// The operators just before it, and for "step differs" what the first
  /// checked step ran there.
  std::string detail;
};

/// What `check_capture_safety` found.
struct CaptureSafetyReport {
  std::vector<CaptureViolation> violations;
  /// Operators recorded in each checked step.
  std::vector<std::size_t> ops_per_step;
  bool ok() const {
    return violations.empty();
  }
  /// One line per violation (at most 20), or "capturable".
  std::string summary() const {
    if (violations.empty()) {
      std::ostringstream s;
      s << "capture-safe: " << ops_per_step.size()
        << " checked step(s), the same "
        << (ops_per_step.empty() ? 0 : ops_per_step.front())
        << " operators each, no host synchronisation";
      return s.str();
    }
    std::ostringstream s;
    for (std::size_t k = 0; k < violations.size() && k < 20; ++k) {
      const auto& v = violations[k];
      s << (k ? "\n" : "") << v.kind << ": " << v.op << " (checked step "
        << v.step << ", operator " << v.index << ")"
        << (v.detail.empty() ? "" : "; ") << v.detail;
    }
    if (violations.size() > 20) {
      s << "\n... " << violations.size() - 20 << " more";
    }
    return s.str();
  }
};

namespace detail {

struct RecordedOp {
  std::string name;
  std::string shapes;  // "[4, 3] [3]" for its tensor inputs
  int depth = 0;       // operators it runs inside, on its thread
  bool operator==(const RecordedOp&) const = default;
};

inline int& capture_depth() {
  thread_local int depth = 0;
  return depth;
}

struct CaptureRecorder {
  std::mutex mutex;
  std::vector<RecordedOp>* into = nullptr;
};

inline CaptureRecorder& capture_recorder() {
  static CaptureRecorder r;
  return r;
}

inline std::unique_ptr<at::ObserverContext> record_capture_op(
    const at::RecordFunction& fn) {
  auto& r = capture_recorder();
  RecordedOp op{fn.name(), {}, capture_depth()++};
  for (const auto& v : fn.inputs()) {
    if (!v.isTensor()) continue;
    const auto& t = v.toTensor();
    if (!op.shapes.empty()) op.shapes += ' ';
    op.shapes += t.defined() ? ddpkit::detail::cat(t.sizes()) : "[]";
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.into) r.into->push_back(std::move(op));
  return nullptr;
}

inline void end_capture_op(const at::RecordFunction&, at::ObserverContext*) {
  --capture_depth();
}

inline std::string ops_before(const std::vector<RecordedOp>& ops,
                              std::size_t at) {
  std::string s = "after ";
  const std::size_t from = at >= 3 ? at - 3 : 0;
  if (from == at) return "the step's first operator";
  for (std::size_t k = from; k < at; ++k) {
    s += (k > from ? ", " : "") + ops[k].name;
  }
  return s;
}

}  // namespace detail

/// Runs `step` options.warmup_steps() times, then options.checked_steps()
/// times observing every operator, and reports what would stop a CUDA graph
/// capture of it (see Note [Capture safety]). `step` is one whole training
/// step (zero_grad, forward, loss, backward, optimizer step) on fixed-size
/// data. One check at a time per process (the observer is global).
///
/// Example:
/// ```
/// auto report = ddpkit::train::check_capture_safety([&] {
///   opt.zero_grad();
///   loss_fn(model(x), y).backward();
///   opt.step();
/// });
/// if (!report.ok()) std::cerr << report.summary() << "\n";
/// ```
inline CaptureSafetyReport check_capture_safety(
    const std::function<void()>& step, CaptureSafetyOptions options = {}) {
  if (options.checked_steps() < 1 || options.warmup_steps() < 0) {
    throw UsageError(ddpkit::detail::cat(
        "check_capture_safety: checked_steps must be >= 1 and warmup_steps "
        ">= 0 (got ",
        options.checked_steps(), " and ", options.warmup_steps(), ")"));
  }
  for (int s = 0; s < options.warmup_steps(); ++s) step();
  auto& rec = detail::capture_recorder();
  std::vector<std::vector<detail::RecordedOp>> steps(
      static_cast<std::size_t>(options.checked_steps()));
  {
    std::lock_guard<std::mutex> lock(rec.mutex);
    if (rec.into) {
      throw UsageError("check_capture_safety: another check is running");
    }
  }
  const auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&detail::record_capture_op,
                                 &detail::end_capture_op)
          .needsInputs(true)
          .scopes(
              {at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  ddpkit::detail::ScopeExit remove([&] {
    {
      std::lock_guard<std::mutex> lock(rec.mutex);
      rec.into = nullptr;
    }
    at::removeCallback(handle);
  });
  for (std::size_t s = 0; s < steps.size(); ++s) {
    {
      std::lock_guard<std::mutex> lock(rec.mutex);
      rec.into = &steps[s];
    }
    step();
    std::lock_guard<std::mutex> lock(rec.mutex);
    rec.into = nullptr;
  }
  CaptureSafetyReport report;
  const auto& syncs = host_sync_operators();
  for (std::size_t s = 0; s < steps.size(); ++s) {
    const auto& ops = steps[s];
    report.ops_per_step.push_back(ops.size());
    // The outermost synchronising operator is named (item(), not also the
    // _local_scalar_dense it runs).
    int inside = -1;
    for (std::size_t k = 0; k < ops.size(); ++k) {
      if (inside >= 0 && ops[k].depth > inside) continue;
      inside = -1;
      if (std::find(syncs.begin(), syncs.end(), ops[k].name) == syncs.end()) {
        continue;
      }
      inside = ops[k].depth;
      report.violations.push_back({"host sync", ops[k].name,
                                   static_cast<int>(s), k,
                                   detail::ops_before(ops, k)});
    }
    if (s == 0) continue;
    const auto& first = steps[0];
    const std::size_t n = std::min(first.size(), ops.size());
    std::size_t k = 0;
    while (k < n && first[k] == ops[k]) ++k;
    if (k == n && first.size() == ops.size()) continue;
    CaptureViolation v{"step differs",
                       k < ops.size() ? ops[k].name : "(end)",
                       static_cast<int>(s),
                       k,
                       {}};
    v.detail = ddpkit::detail::cat(
        "inputs ", k < ops.size() ? ops[k].shapes : "-",
        " where checked step 0 ran ",
        k < first.size() ? first[k].name + " on " + first[k].shapes
                         : std::string("nothing more"),
        "; ", detail::ops_before(ops, k));
    report.violations.push_back(std::move(v));
  }
  return report;
}

}  // namespace ddpkit::train
