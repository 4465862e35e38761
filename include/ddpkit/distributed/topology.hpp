// SPDX-License-Identifier: BSD-3-Clause
// Which ranks share a host, decided by what shared memory needs: the same
// /dev/shm (a marker file one rank makes and the others look for), the same
// boot and the same PID namespace (a rank's pid is watched to notice its
// death, which only works inside one PID namespace). A host name alone says
// neither: containers share names and hosts share names by accident.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"

namespace ddpkit::dist {

// Note [Which ranks share a host]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Which ranks share a host (`distributed/topology.hpp`, `Group::topology()`,
// `Group::hosts()`) is decided by what shared memory needs, not by host name:
// at `Group::init` each rank makes a marker file in `/dev/shm` named by a
// token of this rendezvous and posts its boot id and PID namespace
// (`/proc/self/ns/pid`) in the store; ranks share a host when each sees the
// other's marker and both identities are equal (a rank in another PID
// namespace cannot have its pid watched, so it counts as another host and its
// sums go over gloo). The markers are removed before `init` returns. What a
// crashed run can leave in /dev/shm (a segment between creation and the
// moment every rank has mapped it, a marker) is removed at the next
// `Group::init` on that host: files named `ddpkit-<pid>-…` or
// `ddpkit-host-<pid>-…` whose process no longer exists and that are over 60 s
// old (`detail::sweep_stale_shm`; tested with a reaped child's pid: stale
// files go, a recent one, a live process's one and other files stay). If the
// ranks' views disagree, every rank counts as a host of its own (said once on
// stderr). Hosts are numbered by their lowest rank; each rank's host name is
// kept for messages. Tests: two test hosts given the same host name are still
// two hosts (`multihost.flowers-2x2-same-host-name`; red when the name
// decides: one host, no shared memory); two ranks that share /dev/shm but not
// a PID namespace (`unshare --pid`) are two hosts over gloo
// (`multihost.pid-namespace-is-another-host`; red without the namespace in
// the identity: transport "shm+gloo").

namespace detail {

inline std::vector<uint8_t> to_bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

inline std::string from_bytes(const std::vector<uint8_t>& b) {
  return {b.begin(), b.end()};
}

/// Every rank posts `value` under `key`/<rank>; every rank's value, in rank
/// order (a collective over the store).
inline std::vector<std::string> all_ranks_post(const compat::StorePtr& store,
                                               const std::string& key, int rank,
                                               int world,
                                               const std::string& value) {
  store->set(ddpkit::detail::cat(key, rank), to_bytes(value));
  std::vector<std::string> out;
  for (int r = 0; r < world; ++r) {
    out.push_back(from_bytes(store->get(ddpkit::detail::cat(key, r))));
  }
  return out;
}

/// Every rank posts `value` under `key`/<rank>; true on every rank iff all
/// posted the same value (a collective over the store).
inline bool all_ranks_say(const compat::StorePtr& store, const std::string& key,
                          int rank, int world, const std::string& value) {
  const auto all = all_ranks_post(store, key, rank, world, value);
  return std::all_of(all.begin(), all.end(),
                     [&](const std::string& v) { return v == value; });
}

inline std::string first_line_of(const char* path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

inline std::string this_host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

/// What must be equal for two ranks to share memory and watch each other's
/// pids: the boot and the PID namespace.
inline std::string shm_identity() {
  char ns[128] = {};
  const auto n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  return ddpkit::detail::cat(
      first_line_of("/proc/sys/kernel/random/boot_id"), " ",
      n > 0 ? std::string(ns, static_cast<std::size_t>(n)) : "?");
}

/// Removes what crashed runs left in /dev/shm: ddpkit's segments
/// (`ddpkit-<pid>-<n>`, normally unlinked as soon as every rank mapped
/// them) and host markers (`ddpkit-host-<pid>-<n>-<rank>`), when the
/// process that made them (`pid`) no longer exists here and the file is
/// more than `min_age_s` old (a run still setting up is younger). Called by
/// every rank at `Group::init`; races between ranks are harmless.
inline int sweep_stale_shm(const char* dir = "/dev/shm", long min_age_s = 60) {
  DIR* d = ::opendir(dir);
  if (d == nullptr) return 0;
  int removed = 0;
  while (const dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind("ddpkit-", 0) != 0) continue;
    std::string rest = name.substr(7);
    if (rest.rfind("host-", 0) == 0) rest = rest.substr(5);
    const long pid = std::strtol(rest.c_str(), nullptr, 10);
    if (pid <= 0) continue;
    const std::string path = std::string(dir) + "/" + name;
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0) continue;
    if (std::time(nullptr) - st.st_mtime < min_age_s) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    if (::unlink(path.c_str()) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

}  // namespace detail

/// Where each rank runs: hosts are numbered by their lowest rank (host 0
/// holds rank 0), ranks on a host by rank. The same on every rank.
struct Topology {
  std::vector<int> host_of;            ///< rank -> host
  std::vector<std::string> host_name;  ///< rank -> its host's name
  /// False when the ranks' views of who shares /dev/shm did not agree
  /// (then every rank counts as a host of its own, and nothing is shared).
  bool consistent = true;

  int world() const {
    return static_cast<int>(host_of.size());
  }
  int hosts() const {
    return host_of.empty()
               ? 1
               : *std::max_element(host_of.begin(), host_of.end()) + 1;
  }
  std::vector<int> ranks_on(int host) const {
    std::vector<int> out;
    for (int r = 0; r < world(); ++r) {
      if (host_of[static_cast<std::size_t>(r)] == host) out.push_back(r);
    }
    return out;
  }
  /// Position of `rank` among its host's ranks (0: the host's leader).
  int local_index(int rank) const {
    const auto on = ranks_on(host_of[static_cast<std::size_t>(rank)]);
    return static_cast<int>(std::find(on.begin(), on.end(), rank) - on.begin());
  }
  int max_per_host() const {
    int most = 1;
    for (int h = 0; h < hosts(); ++h) {
      most = std::max(most, static_cast<int>(ranks_on(h).size()));
    }
    return most;
  }
  /// "ranks 2, 3 on host 'b'" for messages.
  std::string describe_host(int host) const {
    const auto on = ranks_on(host);
    std::ostringstream s;
    s << (on.size() == 1 ? "rank " : "ranks ");
    s << ddpkit::detail::join(on, ", ");
    if (!on.empty()) {
      s << " on host '" << host_name[static_cast<std::size_t>(on.front())]
        << "'";
    }
    return s.str();
  }

  /// Collective over `store`: which ranks share this rank's /dev/shm, boot
  /// and PID namespace. Each rank makes a marker file in /dev/shm named by a
  /// token of this rendezvous, then looks for the others' markers; the
  /// markers are removed before it returns. Hosts without /dev/shm count
  /// as one rank each.
  static Topology discover(const compat::StorePtr& store, int rank, int world) {
    using ddpkit::detail::cat;
    const std::string k = "ddpkit/topology/";
    detail::sweep_stale_shm();
    if (rank == 0) {
      std::random_device rd;
      store->set(k + "token", detail::to_bytes(cat(::getpid(), "-", rd())));
    }
    const std::string token = detail::from_bytes(store->get(k + "token"));
    auto marker = [&](int r) {
      return cat("/dev/shm/ddpkit-host-", token, "-", r);
    };
    const int fd =
        ::open(marker(rank).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    const bool made = fd >= 0;
    if (made) ::close(fd);
    const std::string me = cat(made ? "1" : "0", " ", detail::shm_identity());
    const auto ids = detail::all_ranks_post(store, k + "id/", rank, world, me);
    const auto names = detail::all_ranks_post(store, k + "name/", rank, world,
                                              detail::this_host_name());
    // Every marker exists now (each was made before its id was posted).
    std::vector<int> mine;
    for (int r = 0; r < world; ++r) {
      const bool same =
          r == rank || (made && ids[static_cast<std::size_t>(r)] == me &&
                        ::access(marker(r).c_str(), F_OK) == 0);
      if (same) mine.push_back(r);
    }
    const auto sets = detail::all_ranks_post(store, k + "set/", rank, world,
                                             ddpkit::detail::join(mine, ","));
    // Every rank has looked: the marker can go.
    if (made) ::unlink(marker(rank).c_str());

    Topology t;
    t.host_name = names;
    t.host_of.assign(static_cast<std::size_t>(world), -1);
    int hosts = 0;
    for (int r = 0; r < world; ++r) {
      auto& h = t.host_of[static_cast<std::size_t>(r)];
      if (h >= 0) continue;
      h = hosts;
      // Every rank in r's set must name the same set, or the views of
      // /dev/shm disagree (e.g. a marker seen one way only).
      std::stringstream in(sets[static_cast<std::size_t>(r)]);
      for (std::string item; std::getline(in, item, ',');) {
        const int q = std::stoi(item);
        if (q == r) continue;
        if (sets[static_cast<std::size_t>(q)] !=
                sets[static_cast<std::size_t>(r)] ||
            t.host_of[static_cast<std::size_t>(q)] >= 0) {
          t.consistent = false;
        } else {
          t.host_of[static_cast<std::size_t>(q)] = hosts;
        }
      }
      ++hosts;
    }
    if (!t.consistent) {
      for (int r = 0; r < world; ++r)
        t.host_of[static_cast<std::size_t>(r)] = r;
    }
    return t;
  }
};

}  // namespace ddpkit::dist
