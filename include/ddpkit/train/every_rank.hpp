// SPDX-License-Identifier: BSD-3-Clause
// What every rank must hold or learn alike before training: a value that
// must be the same on every rank (the training set's size, the batches of
// an epoch), and an error rank 0 alone can detect (its output folder, its
// checkpoint) raised on every rank, so no rank waits in a collective for
// one that failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/collectives.hpp"

namespace ddpkit::train {

/// Several processes (`group` not null): gathers `value` from every rank (a
/// collective) and throws a UsageError with `message(rank, its value, rank
/// 0's)` for the first rank whose value differs from rank 0's. Nothing for
/// one process.
template <class Message>
void require_same_on_every_rank(const dist::Group* group, std::size_t value,
                                Message message) {
  if (!group) return;
  dist::CollectiveTag tag("same on every rank");
  auto all = dist::all_gather_value(*group, static_cast<int64_t>(value));
  for (int r = 0; r < group->size(); ++r) {
    if (all[r] != all[0]) throw UsageError(message(r, all[r], all[0]));
  }
}

/// Runs `fn` on rank 0; a UsageError or IoError it throws is thrown on
/// every rank of `group` (one broadcast; `group` null: one process, thrown
/// as it is).
template <class Fn>
void on_main_or_fail(const dist::Group* group, bool is_main, Fn&& fn) {
  std::int64_t kind = 0;  // 0 fine, 1 usage, 2 I/O
  std::string error;
  if (is_main) {
    try {
      fn();
    } catch (const UsageError& e) {
      if (!group) throw;
      kind = 1;
      error = e.what();
    } catch (const IoError& e) {
      if (!group) throw;
      kind = 2;
      error = e.what();
    }
  }
  if (!group) return;
  dist::CollectiveTag tag("rank 0 status");
  kind = dist::broadcast_value(*group, kind, 0);
  if (kind == 0) return;
  error = dist::broadcast_string(*group, error, 0);
  if (kind == 2) throw IoError(error);
  throw UsageError(error);
}

}  // namespace ddpkit::train
