// Gradient communication strategies for the DDP reducer: how one bucket's
// flat gradient is averaged across ranks. `AllReduceMean` is the reference:
// copy it to write your own (e.g. a PowerSGD-style hook).
#pragma once

#include <array>
#include <cstdio>
#include <string>

#include "ddpkit/dist/collectives.hpp"

namespace ddpkit::parallel {

/// Plain averaging: divide by the world size, all-reduce (sum) in place.
///
/// A strategy is a class with:
///  - `static constexpr const char* name`;
///  - `static dist::compat::WorkPtr start(const dist::Group&, torch::Tensor&
///    flat, torch::Tensor& scratch)`: begin averaging `flat` (may use
///    `scratch`, which persists per bucket between steps);
///  - `static void finish(torch::Tensor& flat, torch::Tensor& scratch)`:
///    after the work completed, leave the average in `flat`;
///  - optionally `static void prepare(const dist::Group&)`: collective
///    set-up, called once by the reducer's constructor on every rank.
struct AllReduceMean {
  static constexpr const char* name = "allreduce_mean";
  static dist::compat::WorkPtr start(const dist::Group& g, torch::Tensor& flat,
                                     torch::Tensor&) {
    return dist::all_reduce_mean_async(g, flat);
  }
  static void finish(torch::Tensor&, torch::Tensor&) {}
};

namespace detail {

/// Whether the group's backend can add `dtype` (gloo in libtorch 1.13
/// cannot add bf16). Probed once per process with a one-element all-reduce,
/// called by the reducer's constructor at the same point on every rank. A
/// failed probe is followed by a float32 all-reduce: if that fails too, the
/// group is broken (a peer died or timed out), which is reported as such,
/// not taken for "cannot add".
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
    }
    if (known == 0) {
      auto f = torch::zeros({1}, torch::TensorOptions(torch::kFloat)
                                     .device(g.device()));
      dist::all_reduce(g, f);  // throws PeerFailure if the group is broken
      known = 2;
      if (g.is_main()) {
        std::fprintf(stderr,
                     "ddpkit: this backend cannot all-reduce %s (%s); the "
                     "gradients are rounded to it and sent as float32\n",
                     c10::toString(dtype),
                     why.substr(0, why.find('\n')).c_str());
      }
    }
  }
  return known == 1;
}

/// Compressed averaging: the bucket travels as `Dtype` (half the bytes of
/// float32), is summed in `Dtype`, and is widened back. Dividing before the
/// cast keeps sums of large gradients inside fp16's range.
template <c10::ScalarType Dtype>
struct CompressedAllReduce {
  /// Called by the reducer's constructor on every rank.
  static void prepare(const dist::Group& g) {
    (void)backend_sums(g, Dtype);
  }
  static dist::compat::WorkPtr start(const dist::Group& g, torch::Tensor& flat,
                                     torch::Tensor& scratch) {
    if (!backend_sums(g, Dtype)) {
      // Same numerics as the compressed wire, float32 bytes.
      flat.div_(g.size());
      flat.copy_(flat.to(Dtype));
      scratch = torch::Tensor();
      return dist::all_reduce_async(g, flat);
    }
    if (!scratch.defined() || scratch.numel() != flat.numel()) {
      scratch = torch::empty({flat.numel()}, flat.options().dtype(Dtype));
    }
    scratch.copy_(flat.div(g.size()));
    return dist::all_reduce_async(g, scratch);
  }
  static void finish(torch::Tensor& flat, torch::Tensor& scratch) {
    if (scratch.defined()) flat.copy_(scratch);
  }
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

}  // namespace ddpkit::parallel
