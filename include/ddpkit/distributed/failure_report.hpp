// SPDX-License-Identifier: BSD-3-Clause
// Naming the ranks that went away: after a failed collective every rank
// still running posts a key in the store (a roll call); those whose key does
// not appear are named, by host.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/topology.hpp"

namespace ddpkit::dist::detail {

// Note [Casualty vs cause]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Casualty vs cause. A collective that fails because a peer went away throws
// `PeerFailure`; `launch` exits 75 for it, and the launcher names the first
// rank that failed *for another reason* (waiting up to 1 s for it to exit on
// its own) — on 2 busy cores the casualty is often reaped first.

// Note [Naming what was lost]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Naming what was lost. When a collective fails with `PeerFailure`, `launch`
// asks `Group::unanswered(3 s)` before exiting 75: every surviving rank posts
// a key in the store and waits up to 3 s for the others'; the ranks whose key
// never comes are named by host, from the topology ("every rank of host
// 'ddpkit-host1' (ranks 2, 3) did not answer within 3 s (lost, or stuck
// elsewhere)"). It runs on a thread of its own and is abandoned after 4 s, so
// a store that is itself gone (its host lost) adds nothing rather than a
// hang.

/// Who of `seen`'s ranks did not answer the roll call, for the error:
/// "every rank of host 'b' (ranks 2, 3) and rank 5 on host 'c' did not
/// answer within 3 s", or "" when every rank answered.
inline std::string describe_missing(const std::vector<bool>& seen,
                                    const Topology& topo,
                                    std::chrono::milliseconds wait) {
  using ddpkit::detail::cat;
  const int world = static_cast<int>(seen.size());
  const bool known = topo.world() == world;
  std::string text;
  std::vector<bool> said(seen.size(), false);
  for (int r = 0; r < world; ++r) {
    if (seen[static_cast<std::size_t>(r)] ||
        said[static_cast<std::size_t>(r)]) {
      continue;
    }
    if (!text.empty()) text += " and ";
    if (!known) {
      text += cat("rank ", r);
      continue;
    }
    const int host = topo.host_of[static_cast<std::size_t>(r)];
    const auto on = topo.ranks_on(host);
    bool all = true;
    for (int q : on) all = all && !seen[static_cast<std::size_t>(q)];
    if (all && on.size() > 1) {
      for (int q : on) said[static_cast<std::size_t>(q)] = true;
      text += cat("every rank of host '",
                  topo.host_name[static_cast<std::size_t>(r)], "' (ranks ",
                  ddpkit::detail::join(on, ", "), ")");
    } else {
      text += cat("rank ", r, " on host '",
                  topo.host_name[static_cast<std::size_t>(r)], "'");
    }
  }
  if (text.empty()) return text;
  return cat(text, " did not answer within ", wait.count() / 1000.0,
             " s (lost, or stuck elsewhere)");
}

/// Posts this rank's key and waits up to `wait` for every rank's: the
/// description of the ranks that did not answer (`describe_missing`), or ""
/// when all did or the store itself does not answer. Never takes much longer
/// than `wait` (the polling runs on a thread of its own that may outlive the
/// call when the store hangs).
inline std::string roll_call(const compat::StorePtr& store,
                             const Topology& topo, int rank, int world,
                             std::chrono::milliseconds wait) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string text;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, store, topo, rank, world, wait] {
    std::string text;
    try {
      using ddpkit::detail::cat;
      store->set(cat("ddpkit/alive/", rank), std::vector<uint8_t>{1});
      const auto deadline = std::chrono::steady_clock::now() + wait;
      std::vector<bool> seen(static_cast<std::size_t>(world), false);
      int missing = world;
      while (missing > 0) {
        missing = 0;
        for (int r = 0; r < world; ++r) {
          const auto i = static_cast<std::size_t>(r);
          if (!seen[i]) seen[i] = store->check({cat("ddpkit/alive/", r)});
          missing += seen[i] ? 0 : 1;
        }
        if (missing == 0 || std::chrono::steady_clock::now() > deadline) {
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      text = describe_missing(seen, topo, wait);
    } catch (...) {
      text.clear();  // the store is gone too: nothing to add
    }
    std::lock_guard<std::mutex> lock(shared->mu);
    shared->text = std::move(text);
    shared->done = true;
    shared->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait_for(lock, wait + std::chrono::seconds(1),
                      [&] { return shared->done; });
  return shared->text;
}

}  // namespace ddpkit::dist::detail
