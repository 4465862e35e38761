// SPDX-License-Identifier: BSD-3-Clause
// Collectives for training code: all-reduce (sum/mean/max/min) of tensors and
// values, all-gather, broadcast of tensors, values, strings and small
// structs, barrier. The reference recipe's `reduce_value`, typed.
#pragma once

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/process_group.hpp"

namespace ddpkit::dist {

enum class Reduce { sum, mean, max, min };

namespace detail {

inline void wait(const Group& g, const compat::WorkPtr& work,
                 const char* what) {
  const auto& recorder = g.flight_recorder();
  auto peer_failed = [&](const std::exception& e) {
    std::string msg = ddpkit::detail::first_line(e.what());
    const std::string where =
        recorder
            ? recorder->fail(work, msg, ddpkit::detail::cat(what, " failed"))
            : std::string();
    throw PeerFailure(ddpkit::detail::cat(
        "rank ", g.rank(), ": ", what, " failed (a peer may have died or the ",
        "collective timed out after ", g.timeout().count() / 1000.0,
        " s): ", msg, where));
  };
  try {
    work->wait();
  } catch (const PeerFailure& e) {
    peer_failed(e);
  } catch (const DistError& e) {
    // e.g. ranks that disagree on the collective: said precisely
    if (recorder) {
      recorder->fail(work, ddpkit::detail::first_line(e.what()),
                     ddpkit::detail::cat(what, " failed"));
    }
    throw;
  } catch (const std::exception& e) {
    peer_failed(e);
  }
  if (recorder) recorder->end(work);
}

inline c10d::ReduceOp to_c10d(Reduce r) {
  switch (r) {
    case Reduce::max: return compat::reduce_max();
    case Reduce::min: return compat::reduce_min();
    default: return compat::reduce_sum();
  }
}

inline void check_dense(const torch::Tensor& t, const char* what) {
  if (!t.defined() || !t.is_contiguous()) {
    throw Error(
        ddpkit::detail::cat(what, " needs a defined, contiguous tensor"));
  }
}

}  // namespace detail

/// Starts an in-place all-reduce and returns its work handle (no wait). Mean
/// is left to the caller; see `all_reduce` for the blocking form.
/// `caller_waits`: the caller waits for the work at once (see
/// ShmChannel::all_reduce_sum_async).
inline compat::WorkPtr all_reduce_async(const Group& g, torch::Tensor& t,
                                        Reduce op = Reduce::sum,
                                        bool caller_waits = false) {
  const auto id = g.begin_collective("all_reduce", &t, t.nbytes());
  // Sums of CPU tensors among ranks on one host go through shared memory.
  // The choice depends only on the tensor and op, the same on every rank.
  if (g.shm() && (op == Reduce::sum || op == Reduce::mean) &&
      ShmChannel::eligible(t)) {
    return g.started(id, g.shm()->all_reduce_sum_async(t, 1.0, caller_waits));
  }
  std::vector<torch::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = detail::to_c10d(op);
  return g.started(id, g.backend()->allreduce(ts, opts));
}

/// Starts an in-place all-reduce that leaves the mean over ranks in `t`.
/// Through shared memory the division happens on each rank's slice as it is
/// reduced; over gloo `t` is divided first, then summed.
inline compat::WorkPtr all_reduce_mean_async(const Group& g, torch::Tensor& t) {
  if (g.shm() && ShmChannel::eligible(t) && t.is_floating_point()) {
    const auto id = g.begin_collective("all_reduce", &t, t.nbytes());
    return g.started(id, g.shm()->all_reduce_sum_async(t, 1.0 / g.size()));
  }
  t.div_(g.size());
  return all_reduce_async(g, t);
}

/// Starts an in-place reduce that leaves the mean over ranks in `t` on rank
/// `root` (ZeRO-2's gradient shards); what the other ranks' `t` holds after
/// it is unspecified. Over gloo or NCCL: a reduce (`t` divided first, then
/// summed on `root`), so each rank sends its tensor once and only `root`
/// receives. Among ranks on one host, through the shared-memory channel:
/// its all-reduce (every rank reads the others' slices in memory; nothing
/// crosses a link, and `root` gets the same bits a DDP all-reduce gives).
inline compat::WorkPtr reduce_mean_async(const Group& g, torch::Tensor& t,
                                         int root) {
  if (g.shm() && ShmChannel::eligible(t) && t.is_floating_point()) {
    return all_reduce_mean_async(g, t);
  }
  t.div_(g.size());
  const auto id = g.begin_collective("reduce", &t, t.nbytes());
  std::vector<torch::Tensor> ts{t};
  c10d::ReduceOptions opts;
  opts.reduceOp = compat::reduce_sum();
  opts.rootRank = root;
  return g.started(id, g.backend()->reduce(ts, opts));
}

/// Ranks on one host (`g.shm()`, not hierarchical), `t` in a buffer from
/// the channel's `shared_buffer` where rank q has written elements
/// [parts[q], parts[q + 1]): afterwards every rank's `t` holds every part
/// (ShmChannel::all_gather_shared_async). Blocking.
inline void all_gather_shared(const Group& g, torch::Tensor& t,
                              std::vector<int64_t> parts) {
  if (!g.shm()) {
    throw UsageError(
        "all_gather_shared: the group has no shared-memory channel");
  }
  const auto id = g.begin_collective("all_gather", &t, t.nbytes());
  detail::wait(g,
               g.started(id, g.shm()->all_gather_shared_async(
                                 t, std::move(parts), true)),
               "all_gather");
}

/// In-place all-reduce of `t` over every rank.
inline torch::Tensor& all_reduce(const Group& g, torch::Tensor& t,
                                 Reduce op = Reduce::sum) {
  detail::check_dense(t, "all_reduce");
  if (g.size() > 1) {
    detail::wait(g, all_reduce_async(g, t, op, /*caller_waits=*/true),
                 "all_reduce");
  }
  if (op == Reduce::mean) t.div_(g.size());
  return t;
}

/// All-reduce of one arithmetic value (computed in double, or int64 for
/// integers, so counts stay exact).
template <class T>
  requires std::is_arithmetic_v<T>
T all_reduce_value(const Group& g, T value, Reduce op = Reduce::sum) {
  if (g.size() == 1) return value;
  auto dtype = std::is_integral_v<T> ? torch::kInt64 : torch::kFloat64;
  torch::Tensor t =
      torch::full({1}, static_cast<double>(value),
                  torch::TensorOptions().dtype(dtype).device(g.device()));
  if constexpr (std::is_integral_v<T>) {
    t.fill_(static_cast<int64_t>(value));
  }
  all_reduce(g, t, op == Reduce::mean ? Reduce::sum : op);
  if constexpr (std::is_integral_v<T>) {
    auto v = t.item<int64_t>();
    return static_cast<T>(op == Reduce::mean ? v / g.size() : v);
  } else {
    auto v = t.item<double>();
    return static_cast<T>(op == Reduce::mean ? v / g.size() : v);
  }
}

/// Gathers `t` (same shape and dtype on every rank) from all ranks, in rank
/// order.
inline std::vector<torch::Tensor> all_gather(const Group& g,
                                             const torch::Tensor& t) {
  auto src = t.contiguous();
  if (g.size() == 1) return {src.clone()};
  // Nothing to send (the same on every rank, whose shapes must agree);
  // gloo in libtorch 1.13 dies of SIGFPE on an empty all-gather.
  if (src.numel() == 0) {
    return std::vector<torch::Tensor>(static_cast<std::size_t>(g.size()),
                                      torch::empty_like(src));
  }
  std::vector<std::vector<torch::Tensor>> out(1);
  for (int r = 0; r < g.size(); ++r) out[0].push_back(torch::empty_like(src));
  std::vector<torch::Tensor> in{src};
  const auto id = g.begin_collective("all_gather", &src, src.nbytes());
  detail::wait(g, g.started(id, g.backend()->allgather(out, in)), "all_gather");
  return out[0];
}

/// `all_gather_into` (below) started and not waited for: `whole` is
/// complete once the returned work is (`detail::wait`). `part` and `whole`
/// must stay alive and untouched until then. World 1: copied at once, null
/// work.
inline compat::WorkPtr all_gather_into_async(const Group& g,
                                             const torch::Tensor& part,
                                             torch::Tensor& whole) {
  detail::check_dense(whole, "all_gather_into");
  const int64_t n = part.numel();
  if (whole.numel() != n * g.size()) {
    throw Error(ddpkit::detail::cat("all_gather_into: whole has ",
                                    whole.numel(), " elements; expected ", n,
                                    " x ", g.size()));
  }
  auto src = part.detach().reshape({-1}).contiguous();
  if (g.size() == 1 || n == 0) {
    whole.copy_(src);
    return {};
  }
  std::vector<std::vector<torch::Tensor>> out(1);
  for (int r = 0; r < g.size(); ++r)
    out[0].push_back(whole.narrow(0, r * n, n));
  std::vector<torch::Tensor> in{src};
  const auto id = g.begin_collective("all_gather", &src, src.nbytes());
  return g.started(id, g.backend()->allgather(out, in));
}

/// Gathers every rank's `part` (same numel and dtype on every rank) into
/// `whole`, contiguous and `world × part.numel()` long: rank q's part lands
/// at [q * n, (q + 1) * n). Blocking. (ZeRO-3's gather of a unit: `whole`
/// is the unit's flat parameters.)
inline void all_gather_into(const Group& g, const torch::Tensor& part,
                            torch::Tensor& whole) {
  auto work = all_gather_into_async(g, part, whole);
  if (work) detail::wait(g, work, "all_gather");
}

/// Reduce-scatter of a flat tensor into means: afterwards this rank's part
/// of `whole` (elements [rank * n, (rank + 1) * n), n = numel / world)
/// holds the mean over ranks of that part; the other parts are
/// unspecified. Blocking. Over gloo or NCCL: one reduce per part to its
/// rank (each rank sends its tensor once: (world - 1) / world of it leaves
/// the rank, as a ring reduce-scatter's); among ranks of one host through
/// the shared-memory channel: its all-reduce of the whole (nothing crosses
/// a link). Returns the bytes this rank handed to collectives.
inline uint64_t reduce_scatter_mean(const Group& g, torch::Tensor& whole) {
  detail::check_dense(whole, "reduce_scatter_mean");
  const int w = g.size();
  if (w == 1) return 0;
  if (whole.numel() % w != 0) {
    throw Error(ddpkit::detail::cat("reduce_scatter_mean: ", whole.numel(),
                                    " elements do not split into ", w,
                                    " parts"));
  }
  if (g.shm() && ShmChannel::eligible(whole) && whole.is_floating_point()) {
    detail::wait(g, all_reduce_mean_async(g, whole), "reduce_scatter");
    return static_cast<uint64_t>(whole.nbytes());
  }
  const int64_t n = whole.numel() / w;
  std::vector<compat::WorkPtr> works;
  std::vector<torch::Tensor> parts;
  for (int q = 0; q < w; ++q) {
    parts.push_back(whole.narrow(0, q * n, n));
    works.push_back(reduce_mean_async(g, parts.back(), q));
  }
  for (auto& work : works) detail::wait(g, work, "reduce_scatter");
  return static_cast<uint64_t>(whole.nbytes());
}

/// All-gather of one arithmetic value per rank, in rank order.
template <class T>
  requires std::is_arithmetic_v<T>
std::vector<T> all_gather_value(const Group& g, T value) {
  torch::Tensor t =
      torch::tensor({static_cast<double>(value)}, torch::kFloat64);
  if constexpr (std::is_integral_v<T>) {
    t = torch::tensor({static_cast<int64_t>(value)}, torch::kInt64);
  }
  t = t.to(g.device());
  std::vector<T> out;
  for (const torch::Tensor& x : all_gather(g, t)) {
    if constexpr (std::is_integral_v<T>) {
      out.push_back(static_cast<T>(x.item<int64_t>()));
    } else {
      out.push_back(static_cast<T>(x.item<double>()));
    }
  }
  return out;
}

/// In-place broadcast of `t` from rank `src` to all ranks.
inline torch::Tensor& broadcast(const Group& g, torch::Tensor& t, int src = 0) {
  detail::check_dense(t, "broadcast");
  if (src < 0 || src >= g.size()) {
    throw Error(ddpkit::detail::cat("broadcast from rank ", src,
                                    " in a world of ", g.size()));
  }
  if (g.size() == 1) return t;
  std::vector<torch::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  const auto id = g.begin_collective("broadcast", &t, t.nbytes());
  detail::wait(g, g.started(id, g.backend()->broadcast(ts, opts)), "broadcast");
  return t;
}

/// `broadcast` for a value `src` takes long to compute (rank-0 evaluation
/// of a validation set): the other ranks first wait for `src` through the
/// store, for up to `wait`, then meet it in the broadcast, so the work is
/// bounded by `wait` and not by the group's collective timeout. Every rank
/// calls it at the same point; `src` calls it when its value is ready.
/// `what` names the wait in the error when it runs out.
inline torch::Tensor& broadcast_when_ready(const Group& g, torch::Tensor& t,
                                           int src,
                                           std::chrono::milliseconds wait,
                                           const std::string& what) {
  if (g.size() == 1) return t;
  const std::string key =
      ddpkit::detail::cat("ddpkit/ready/", g.next_ready_key());
  // Recorded as a collective of its own ("store_wait", tagged with `what`):
  // a rank stuck here waits for `src`, not in the broadcast.
  CollectiveTag tag(what.c_str());
  const auto id = g.begin_collective("store_wait", nullptr, 0);
  const auto& recorder = g.flight_recorder();
  try {
    if (g.rank() == src) {
      g.store()->set(key, std::vector<uint8_t>{1});
    } else {
      g.store()->wait({key}, wait);
    }
  } catch (const c10::Error& e) {
    std::string msg = ddpkit::detail::first_line(e.what_without_backtrace());
    const std::string where =
        recorder
            ? recorder->fail(id, msg, ddpkit::detail::cat("waiting for ", what))
            : std::string();
    throw PeerFailure(ddpkit::detail::cat(
        "rank ", g.rank(), ": waited for rank ", src, "'s ", what,
        " and it did not come within ", wait.count() / 1000.0,
        " s (or the store is gone): ", msg, where));
  }
  if (recorder) recorder->end(id);
  return broadcast(g, t, src);
}

/// Broadcast of a trivially copyable value (a number or a small struct).
template <class T>
  requires std::is_trivially_copyable_v<T>
T broadcast_value(const Group& g, const T& value, int src = 0) {
  if (g.size() == 1) return value;
  torch::Tensor t =
      torch::empty({static_cast<int64_t>(sizeof(T))}, torch::kUInt8);
  std::memcpy(t.data_ptr(), &value, sizeof(T));
  t = t.to(g.device());
  broadcast(g, t, src);
  t = t.cpu();
  T out;
  std::memcpy(&out, t.data_ptr(), sizeof(T));
  return out;
}

/// Broadcast of a string of any length (length first, then the bytes).
inline std::string broadcast_string(const Group& g, const std::string& s,
                                    int src = 0) {
  if (g.size() == 1) return s;
  auto n = broadcast_value<int64_t>(g, static_cast<int64_t>(s.size()), src);
  auto t = torch::zeros({n}, torch::kUInt8);
  if (g.rank() == src && n > 0) std::memcpy(t.data_ptr(), s.data(), s.size());
  if (n > 0) {
    t = t.to(g.device());
    broadcast(g, t, src);
    t = t.cpu();
  }
  return std::string(static_cast<const char*>(t.data_ptr()),
                     static_cast<std::size_t>(n));
}

/// Blocks until every rank reaches it.
inline void barrier(const Group& g) {
  if (g.size() == 1) return;
  // gloo's barrier is an all-reduce of nothing; one of a single byte has the
  // same effect and the same failure reporting on every backend.
  auto t =
      torch::zeros({1}, torch::TensorOptions(torch::kUInt8).device(g.device()));
  all_reduce(g, t);
}

}  // namespace ddpkit::dist
