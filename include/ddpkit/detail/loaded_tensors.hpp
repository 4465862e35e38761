// SPDX-License-Identifier: BSD-3-Clause
// Checks on tensors read from files. libtorch 1.13's unpickler builds each
// tensor from the sizes, strides and storage offset the file states without
// checking them against the storage it read: a damaged checkpoint yields a
// tensor whose elements lie outside its memory, and copying it into a model
// reads past the end of a heap buffer (found by fuzzing, tests/fuzz).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"

namespace ddpkit::detail {

/// Why `t` cannot be used safely, or "" when every element of it lies
/// inside its storage (an undefined or empty tensor is fine).
inline std::string loaded_tensor_problem(const at::Tensor& t) {
  if (!t.defined()) return "";
  if (t.layout() != c10::kStrided) {
    return cat("has layout ", t.layout(), " (only dense tensors are read)");
  }
  if (t.numel() == 0) return "";
  if (!t.has_storage()) return "has no storage";
  const std::int64_t itemsize = static_cast<std::int64_t>(t.element_size());
  std::int64_t last = t.storage_offset();
  bool bad = last < 0;
  for (std::int64_t d = 0; d < t.dim() && !bad; ++d) {
    std::int64_t span = 0;
    bad = t.stride(d) < 0 ||
          __builtin_mul_overflow(t.size(d) - 1, t.stride(d), &span) ||
          __builtin_add_overflow(last, span, &last);
  }
  std::int64_t end_bytes = 0;
  bad = bad || __builtin_add_overflow(last, std::int64_t{1}, &end_bytes) ||
        __builtin_mul_overflow(end_bytes, itemsize, &end_bytes) ||
        end_bytes > static_cast<std::int64_t>(t.storage().nbytes());
  if (!bad) return "";
  return cat("has elements outside its storage (sizes ", t.sizes(),
             ", strides ", t.strides(), ", offset ", t.storage_offset(), ", ",
             t.storage().nbytes(), " bytes of storage)");
}

/// Throws a UsageError naming `what` when `t` cannot be used safely.
inline void check_loaded_tensor(const at::Tensor& t, const std::string& what) {
  const auto problem = loaded_tensor_problem(t);
  if (!problem.empty()) {
    throw UsageError(cat(what, " ", problem, ": the file is damaged"));
  }
}

/// Checks every tensor reachable from `v` (containers, objects such as a
/// nested archive), each shared container once; `what` names the file.
inline void check_loaded_tensors(const c10::IValue& v,
                                 const std::string& what) {
  std::unordered_set<const void*> seen;
  struct Walk {
    std::unordered_set<const void*>& seen;
    const std::string& what;
    void operator()(const c10::IValue& x, int depth) {
      if (depth > 1000) {
        throw UsageError(cat(what,
                             " nests containers more than 1000 deep: "
                             "the file is damaged"));
      }
      if (x.isTensor()) {
        check_loaded_tensor(x.toTensor(), what);
        return;
      }
      if (!x.isPtrType() || !seen.insert(x.internalToPointer()).second) return;
      if (x.isGenericDict()) {
        for (const auto& kv : x.toGenericDict()) {
          (*this)(kv.key(), depth + 1);
          (*this)(kv.value(), depth + 1);
        }
      } else if (x.isList()) {
        for (const c10::IValue& e : x.toListRef()) (*this)(e, depth + 1);
      } else if (x.isTuple()) {
        for (const auto& e : x.toTupleRef().elements()) (*this)(e, depth + 1);
      } else if (x.isObject()) {
        for (const auto& e : x.toObjectRef().slots()) (*this)(e, depth + 1);
      }
    }
  };
  Walk{seen, what}(v, 0);
}

}  // namespace ddpkit::detail
