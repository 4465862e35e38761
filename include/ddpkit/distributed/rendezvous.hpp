// SPDX-License-Identifier: BSD-3-Clause
// Rendezvous: the c10d store every rank meets at (a TCPStore hosted by rank
// 0 or by torchrun's agent, or a FileStore), checked for a world size every
// rank agrees on, with errors that name the address and what to fix.
#pragma once

#include <netdb.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/parse.hpp"
#include "ddpkit/distributed/env.hpp"

namespace ddpkit::dist::detail {

// Note [Rendezvous is checked]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rendezvous is checked: every rank compares its world size with rank 0's and
// checks in; a missing rank is a timeout with a count ("1 joined"), not a
// hang inside gloo.

inline bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

/// A master address that does not resolve is bad input, not a timeout.
inline void check_resolvable(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    throw UsageError(ddpkit::detail::cat(
        "MASTER_ADDR '", host, "' cannot be resolved (", ::gai_strerror(rc),
        "); expected the host name or IP address of rank 0"));
  }
  ::freeaddrinfo(res);
}

[[noreturn]] inline void rendezvous_failed(const DistEnv& env,
                                           const std::string& host, int port,
                                           std::chrono::milliseconds timeout,
                                           const std::string& what);

/// torchrun (2.x) hosts the store in its agent and says so.
inline bool agent_store() {
  const auto v = ddpkit::detail::env_value("TORCHELASTIC_USE_AGENT_STORE");
  return v && (*v == "True" || *v == "true" || *v == "1");
}

inline compat::StorePtr rendezvous(const DistEnv& env,
                                   const std::string& init_method,
                                   std::chrono::milliseconds timeout) {
  using ddpkit::detail::cat;
  std::string host = env.master_addr;
  int port = env.master_port;
  try {
    if (init_method.rfind("file://", 0) == 0) {
      std::string path = init_method.substr(7);
      if (path.empty()) {
        throw UsageError("init method 'file://' names no file");
      }
      return compat::make_file_store(path, env.world_size, timeout);
    }
    if (init_method.rfind("tcp://", 0) == 0) {
      std::string hp = init_method.substr(6);
      auto colon = hp.rfind(':');
      if (colon == std::string::npos) {
        throw UsageError(cat("init method '", init_method,
                             "' lacks a port (expected tcp://host:port)"));
      }
      host = hp.substr(0, colon);
      port = ddpkit::detail::parse_int<int>(
          cat("the port of init method '", init_method, "'"),
          hp.substr(colon + 1), 1, 65535);
    } else if (init_method != "env://") {
      throw UsageError(cat("init method '", init_method,
                           "' is unknown (expected env://, tcp://host:port "
                           "or file:///path)"));
    }
    check_resolvable(host);
    // torchrun (2.x) hosts the store in its agent and says so with
    // TORCHELASTIC_USE_AGENT_STORE: every rank is a client, and each
    // restart of the workers gets keys of its own, or a restarted job
    // would meet the previous attempt's rendezvous counters and gloo
    // addresses.
    if (init_method == "env://" && agent_store()) {
      if (!compat::can_use_agent_store()) {
        throw UsageError(cat(
            "rank ", env.rank,
            ": torchrun hosts the rendezvous store in its agent "
            "(TORCHELASTIC_USE_AGENT_STORE=True), and the agent is PyTorch "
            ">= 2.2 (it set TORCH_NCCL_ASYNC_ERROR_HANDLING): this ddpkit "
            "build's libtorch ",
            ddpkit::compat::torch_version(),
            " cannot talk to that store and would wait forever. Launch "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ..., or use "
            "torchrun from the PyTorch this build uses"));
      }
      auto client = compat::make_tcp_store(host, port, /*is_server=*/false,
                                           env.world_size, timeout);
      // The agents' store outlives the rounds, so each round needs keys
      // of its own, the same on every node. TORCHELASTIC_RESTART_COUNT
      // is not that: only a node whose own workers failed counts the
      // restart; a node restarted for the membership change does not
      // (seen: 1 on one host, 0 on the other, and the new round hung).
      // Every round starts every rank once, so how often this rank has
      // started is the same number on every rank.
      const auto starts =
          client->add(cat("ddpkit/agent_starts/rank", env.rank), 1);
      return compat::make_prefix_store(cat("/ddpkit/round_", starts), client);
    }
    return compat::make_tcp_store(host, port, env.rank == 0, env.world_size,
                                  timeout);
  } catch (const c10::Error& e) {
    rendezvous_failed(env, host, port, timeout, e.what_without_backtrace());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    rendezvous_failed(env, host, port, timeout, e.what());
  }
}

[[noreturn]] inline void rendezvous_failed(const DistEnv& env,
                                           const std::string& host, int port,
                                           std::chrono::milliseconds timeout,
                                           const std::string& what) {
  using ddpkit::detail::cat;
  if (what.find("ddress already in use") != std::string::npos) {
    throw UsageError(cat("rank ", env.rank,
                         ": cannot host the rendezvous "
                         "store on port ",
                         port,
                         ": the port is already in use (choose another "
                         "MASTER_PORT)"));
  }
  if (env.rank != 0 && host.rfind("file://", 0) != 0 &&
      what.find("connect") != std::string::npos) {
    // No store answered: rank 0 (its host) is not running, or the address
    // does not lead there (a wrong MASTER_ADDR, a firewall, a partition).
    throw DistError(cat(
        "rank ", env.rank, ": cannot reach the rendezvous store at ", host, ":",
        port, " within ", timeout.count() / 1000.0,
        " s; rank 0 hosts it: check that rank 0 is running, that ", host,
        " is rank 0's host as this host reaches it (MASTER_ADDR), and that "
        "nothing drops TCP port ",
        port, " between them (e.g. `nc -zv ", host, " ", port,
        "` from here while rank 0 runs): ", ddpkit::detail::first_line(what)));
  }
  throw DistError(cat("rank ", env.rank, ": rendezvous at ", host, ":", port,
                      " failed within ", timeout.count() / 1000.0,
                      " s waiting for ", env.world_size,
                      " ranks (is every rank started, with the same "
                      "MASTER_ADDR/MASTER_PORT?): ",
                      ddpkit::detail::first_line(what)));
}

inline void wait_for_all(const compat::StorePtr& store, const DistEnv& env,
                         const std::string& method,
                         std::chrono::milliseconds timeout) {
  using ddpkit::detail::cat;
  const std::string joined = "ddpkit/rendezvous/joined";
  const std::string done = "ddpkit/rendezvous/complete";
  // Ranks told different world sizes would wait for each other forever:
  // compare with rank 0's before waiting.
  const std::string ws_key = "ddpkit/rendezvous/world_size";
  int64_t rank0_world = -1;
  try {
    auto bytes = std::to_string(env.world_size);
    if (env.rank == 0) {
      store->set(ws_key, std::vector<uint8_t>(bytes.begin(), bytes.end()));
    }
    auto got = store->get(ws_key);
    rank0_world = std::stoll(std::string(got.begin(), got.end()));
  } catch (const c10::Error&) {
    // rank 0 never arrived: reported below as a timeout
  }
  if (rank0_world > 0 && rank0_world != env.world_size) {
    throw UsageError(cat("rank ", env.rank, " was started with world size ",
                         env.world_size, " but rank 0 with ", rank0_world,
                         "; every rank must get the same WORLD_SIZE"));
  }
  try {
    auto n = store->add(joined, 1);
    if (n == env.world_size) store->set(done, std::vector<uint8_t>{1});
    store->wait({done}, timeout);
  } catch (const c10::Error& e) {
    int64_t n = -1;
    try {
      n = store->add(joined, 0);
    } catch (...) {
    }
    std::string where = method.rfind("file://", 0) == 0
                            ? method
                            : cat(env.master_addr, ":", env.master_port);
    throw DistError(cat("rank ", env.rank, ": rendezvous at ", where,
                        " timed out after ", timeout.count() / 1000.0,
                        " s waiting for ", env.world_size, " ranks (", n,
                        " joined; is every rank started, with the same "
                        "MASTER_ADDR/MASTER_PORT and WORLD_SIZE?)"));
  }
}

}  // namespace ddpkit::dist::detail
