// The distributed runtime: environment parsing, collectives over real
// processes (gloo, loopback), spawn failure propagation, rendezvous timeout.
#include <signal.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include "../support.hpp"
#include "ddpkit/train/signals.hpp"

using namespace ddpkit;
using ddpkit::test::run_workers;
using ddpkit::test::TempDir;

namespace {

dist::EnvLookup table(std::map<std::string, std::string> vars) {
  return [vars](std::string_view n) -> std::optional<std::string> {
    auto it = vars.find(std::string(n));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(std::map<std::string, std::string> vars) {
  try {
    dist::read_env(table(std::move(vars)));
  } catch (const UsageError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_SUITE("dist") {
  TEST_CASE("read_env: launchers") {
    SUBCASE("nothing set is a single process") {
      auto e = dist::read_env(table({}));
      CHECK(e.world_size == 1);
      CHECK(e.rank == 0);
      CHECK(e.source == dist::LaunchSource::single);
    }
    SUBCASE("torchrun") {
      auto e = dist::read_env(table({{"RANK", "3"},
                                     {"LOCAL_RANK", "1"},
                                     {"WORLD_SIZE", "4"},
                                     {"LOCAL_WORLD_SIZE", "2"},
                                     {"MASTER_ADDR", "10.0.0.1"},
                                     {"MASTER_PORT", "1234"}}));
      CHECK(e.source == dist::LaunchSource::torchrun);
      CHECK(e.rank == 3);
      CHECK(e.local_rank == 1);
      CHECK(e.world_size == 4);
      CHECK(e.local_world_size == 2);
      CHECK(e.master_addr == "10.0.0.1");
      CHECK(e.master_port == 1234);
    }
    SUBCASE("torchrun without LOCAL_* defaults to one node") {
      auto e = dist::read_env(table(
          {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "localhost"}}));
      CHECK(e.local_rank == 1);
      CHECK(e.local_world_size == 2);
      CHECK(e.master_port == 29500);
    }
    SUBCASE("slurm") {
      auto e = dist::read_env(table({{"SLURM_PROCID", "5"},
                                     {"SLURM_LOCALID", "1"},
                                     {"SLURM_NTASKS", "8"},
                                     {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                                     {"MASTER_ADDR", "node01"}}));
      CHECK(e.source == dist::LaunchSource::slurm);
      CHECK(e.rank == 5);
      CHECK(e.local_rank == 1);
      CHECK(e.world_size == 8);
      CHECK(e.local_world_size == 4);
      CHECK(e.master_addr == "node01");
    }
    SUBCASE("slurm falls back to the launch node's address") {
      auto e =
          dist::read_env(table({{"SLURM_PROCID", "0"},
                                {"SLURM_NTASKS", "2"},
                                {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}}));
      CHECK(e.master_addr == "10.1.2.3");
    }
    SUBCASE("open mpi") {
      auto e = dist::read_env(table({{"OMPI_COMM_WORLD_RANK", "2"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                     {"OMPI_COMM_WORLD_SIZE", "3"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
                                     {"MASTER_ADDR", "h"}}));
      CHECK(e.source == dist::LaunchSource::openmpi);
      CHECK(e.rank == 2);
      CHECK(e.world_size == 3);
      CHECK(e.local_world_size == 1);
    }
    SUBCASE("torchrun wins over slurm variables") {
      auto e = dist::read_env(table({{"RANK", "0"},
                                     {"WORLD_SIZE", "1"},
                                     {"SLURM_PROCID", "4"},
                                     {"SLURM_NTASKS", "8"}}));
      CHECK(e.source == dist::LaunchSource::torchrun);
      CHECK(e.world_size == 1);
    }
    SUBCASE("explicit") {
      auto e = dist::explicit_env(1, 2, "127.0.0.1", 4000);
      CHECK(e.source == dist::LaunchSource::explicit_args);
      CHECK(e.local_rank == 1);
      CHECK_THROWS_WITH_AS(
          dist::explicit_env(2, 2, "h", 1),
          doctest::Contains("rank=2 must be less than world size=2"),
          UsageError);
    }
  }

  TEST_CASE("read_env: malformed values name the variable") {
    struct Case {
      std::map<std::string, std::string> vars;
      const char* message;
    };
    std::vector<Case> cases{
        {{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},
         "RANK=2 must be less than WORLD_SIZE=2"},
        {{{"RANK", "x"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},
         "environment variable RANK='x' is not an integer"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "2abc"}, {"MASTER_ADDR", "h"}},
         "WORLD_SIZE='2abc' is not an integer"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "0"}},
         "WORLD_SIZE=0 is out of range (expected >= 1)"},
        {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},
         "RANK=-1 is out of range"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "2"}},
         "MASTER_ADDR is missing (required when WORLD_SIZE=2 > 1)"},
        {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}},
         "MASTER_ADDR is empty"},
        {{{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},
         "environment variable RANK is missing"},
        {{{"RANK", "0"},
          {"WORLD_SIZE", "2"},
          {"MASTER_ADDR", "h"},
          {"MASTER_PORT", "70000"}},
         "MASTER_PORT=70000 is not a TCP port"},
        {{{"RANK", "0"},
          {"WORLD_SIZE", "2"},
          {"MASTER_ADDR", "h"},
          {"MASTER_PORT", "http"}},
         "MASTER_PORT='http' is not an integer"},
        {{{"RANK", "1"},
          {"LOCAL_RANK", "2"},
          {"WORLD_SIZE", "4"},
          {"LOCAL_WORLD_SIZE", "2"},
          {"MASTER_ADDR", "h"}},
         "LOCAL_RANK=2 must be less than LOCAL_WORLD_SIZE=2"},
        {{{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}, {"MASTER_ADDR", "h"}},
         "SLURM_PROCID=3 must be less than SLURM_NTASKS=2"},
        {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}},
         "MASTER_ADDR is missing (required when SLURM_NTASKS=2 > 1)"},
        {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "two"}},
         "OMPI_COMM_WORLD_SIZE='two' is not an integer"},
        // Found by fuzzing (tests/fuzz): the largest int as SLURM_LOCALID
        // overflowed `local_rank + 1` (UB) when SLURM_NTASKS_PER_NODE is
        // unset, and an empty launch-node address became the master.
        {{{"SLURM_PROCID", "0"},
          {"SLURM_NTASKS", "2"},
          {"SLURM_LOCALID", "2147483647"},
          {"MASTER_ADDR", "h"}},
         "SLURM_LOCALID=2147483647 must be less than SLURM_NTASKS=2"},
        {{{"SLURM_PROCID", "1"},
          {"SLURM_NTASKS", "8"},
          {"SLURM_LAUNCH_NODE_IPADDR", ""}},
         "SLURM_LAUNCH_NODE_IPADDR is empty"},
    };
    for (auto& c : cases) {
      CAPTURE(c.message);
      CHECK(error_of(c.vars).find(c.message) != std::string::npos);
    }
  }

  TEST_CASE("world_size_from_args") {
    std::vector<std::string> a{"prog", "--epochs", "2", "--world-size", "4"};
    std::vector<char*> argv;
    for (auto& s : a) argv.push_back(s.data());
    CHECK(dist::world_size_from_args(static_cast<int>(argv.size()),
                                     argv.data()) == 4);
    std::vector<std::string> b{"prog", "--world-size=0"};
    std::vector<char*> bv;
    for (auto& s : b) bv.push_back(s.data());
    CHECK_THROWS_WITH_AS(
        dist::world_size_from_args(2, bv.data()),
        doctest::Contains("--world-size=0 is out of range (expected >= 1)"),
        UsageError);
  }

  // ---- collectives over real processes
  // ------------------------------------------

  DDPKIT_WORKER(collectives) {
    auto g = ddpkit::test::worker_group();
    const int r = g.rank();
    const int w = g.size();
    auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
      return 1;
    };
    // sum and mean
    auto t = torch::full({5}, static_cast<float>(r + 1));
    dist::all_reduce(g, t);
    float expect_sum = w * (w + 1) / 2.0f;
    if (!torch::allclose(t, torch::full({5}, expect_sum))) return fail("sum");
    auto m = torch::full({2, 2}, static_cast<double>(r), torch::kFloat64);
    dist::all_reduce(g, m, dist::Reduce::mean);
    if (!torch::allclose(m,
                         torch::full({2, 2}, (w - 1) / 2.0, torch::kFloat64)))
      return fail("mean");
    auto mx = torch::tensor({static_cast<float>(r)});
    dist::all_reduce(g, mx, dist::Reduce::max);
    if (mx.item<float>() != w - 1) return fail("max");
    if (dist::all_reduce_value(g, r + 1) != w * (w + 1) / 2)
      return fail("value");
    if (dist::all_reduce_value(g, 1.0 * r, dist::Reduce::mean) != (w - 1) / 2.0)
      return fail("value mean");
    // broadcast from 0 and from the last rank
    auto b = torch::full({3}, static_cast<float>(r * 10));
    dist::broadcast(g, b, 0);
    if (!torch::equal(b, torch::zeros({3}))) return fail("broadcast 0");
    auto b2 = torch::full({3}, static_cast<float>(r * 10));
    dist::broadcast(g, b2, w - 1);
    if (!torch::equal(b2, torch::full({3}, (w - 1) * 10.0f)))
      return fail("broadcast last");
    struct Small {
      int epoch;
      double best;
      bool stop;
    };
    Small s{r == 1 ? 7 : -1, r == 1 ? 0.5 : -1.0, r == 1};
    Small got = dist::broadcast_value(g, s, 1);
    if (got.epoch != 7 || got.best != 0.5 || !got.stop) return fail("struct");
    std::string str = r == 0 ? std::string(1000, 'x') + "end" : "";
    if (dist::broadcast_string(g, str, 0) != std::string(1000, 'x') + "end")
      return fail("string");
    // all-gather in rank order
    auto parts = dist::all_gather(g, torch::full({2}, static_cast<float>(r)));
    if (static_cast<int>(parts.size()) != w) return fail("gather size");
    for (int k = 0; k < w; ++k) {
      if (!torch::equal(parts[k], torch::full({2}, static_cast<float>(k))))
        return fail("gather order");
    }
    // An empty all-gather returns empty tensors (gloo in 1.13 died of
    // SIGFPE on it).
    auto none = dist::all_gather(g, torch::empty({0, 3}));
    if (static_cast<int>(none.size()) != w || none[0].numel() != 0 ||
        none[0].size(1) != 3)
      return fail("empty all_gather");
    auto vals = dist::all_gather_value(g, r * r);
    for (int k = 0; k < w; ++k) {
      if (vals[k] != k * k) return fail("gather value");
    }
    // barrier: rank 0 arrives late; nobody may leave before it arrives.
    auto flag = ddpkit::test::worker_dir() / "barrier_flag";
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::ofstream(flag) << "here";
    }
    dist::barrier(g);
    if (!std::filesystem::exists(flag)) return fail("barrier passed early");
    dist::barrier(g);
    return 0;
  }

  TEST_CASE(
      "host loss: the roll call names a missing rank with its host, a whole "
      "missing host by its ranks, several joined by 'and'") {
    using dist::detail::describe_missing;
    // Hosts a (ranks 0, 1), b (2, 3), c (4 alone), d (5 and 7: not
    // contiguous), e (6).
    dist::Topology topo;
    topo.host_of = {0, 0, 1, 1, 2, 3, 4, 3};
    topo.host_name = {"a", "a", "b", "b", "c", "d", "e", "d"};
    const std::chrono::milliseconds wait(3000);
    auto seen_all_but = [](std::vector<int> missing) {
      std::vector<bool> seen(8, true);
      for (int r : missing) seen[static_cast<std::size_t>(r)] = false;
      return seen;
    };
    const std::string tail =
        " did not answer within 3 s (lost, or stuck "
        "elsewhere)";
    CHECK(describe_missing(seen_all_but({}), topo, wait) == "");
    CHECK(describe_missing(seen_all_but({3}), topo, wait) ==
          "rank 3 on host 'b'" + tail);
    CHECK(describe_missing(seen_all_but({2, 3}), topo, wait) ==
          "every rank of host 'b' (ranks 2, 3)" + tail);
    // A host of one rank is that rank; a host's ranks are named once, in
    // order, wherever they stand.
    CHECK(describe_missing(seen_all_but({4}), topo, wait) ==
          "rank 4 on host 'c'" + tail);
    CHECK(describe_missing(seen_all_but({5, 7}), topo, wait) ==
          "every rank of host 'd' (ranks 5, 7)" + tail);
    CHECK(describe_missing(seen_all_but({0, 2, 3, 5, 6, 7}), topo, wait) ==
          "rank 0 on host 'a' and every rank of host 'b' (ranks 2, 3) and "
          "every rank of host 'd' (ranks 5, 7) and rank 6 on host 'e'" +
              tail);
    CHECK(describe_missing(seen_all_but({1}), topo,
                           std::chrono::milliseconds(1500)) ==
          "rank 1 on host 'a' did not answer within 1.5 s (lost, or stuck "
          "elsewhere)");
    // Without the topology (it did not match the world): ranks alone.
    CHECK(describe_missing({true, false, false}, topo, wait) ==
          "rank 1 and rank 2" + tail);
  }

  TEST_CASE("collectives over gloo with real processes") {
    // Self-spawn meets through a private file; the TCPStore path is the one
    // torchrun/SLURM/MPI jobs take.
    for (std::string method : {"file", "tcp"}) {
      for (int world : {2, 4}) {
        CAPTURE(method);
        CAPTURE(world);
        TempDir dir;
        dist::EnvVars env;
        if (method == "tcp") env.emplace_back("DDPKIT_INIT_METHOD", "env://");
        auto res = run_workers("collectives", world, dir.str(), env);
        CHECK(res.ok());
        CHECK(res.message == "");
      }
    }
  }

  TEST_CASE("a world of one needs no rendezvous") {
    dist::Group g;
    auto t = torch::ones({2});
    dist::all_reduce(g, t, dist::Reduce::mean);
    CHECK(torch::equal(t, torch::ones({2})));
    CHECK(dist::broadcast_value(g, 5) == 5);
    CHECK(dist::all_gather(g, t).size() == 1);
    dist::barrier(g);
  }

  TEST_CASE(
      "NCCL: a rank whose LOCAL_RANK has no GPU (or a build without NCCL) "
      "fails at once, before waiting for the others at the rendezvous") {
    TempDir dir;
    const int gpus = static_cast<int>(torch::cuda::device_count());
    // Rank `gpus` of gpus + 2, local rank `gpus` of gpus + 1 on this host,
    // the others never started: the check must come before the rendezvous
    // (30 s here), not after.
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(
        dist::Group::init(dist::explicit_env(gpus, gpus + 2, "127.0.0.1", 29500,
                                             gpus, gpus + 1),
                          dist::GroupOptions()
                              .backend(dist::BackendKind::nccl)
                              .init_method("file://" + (dir / "store").string())
                              .rendezvous_timeout(std::chrono::seconds(30))),
        doctest::Contains(dist::compat::has_nccl ? "but this host has"
                                                 : "has no NCCL"),
        UsageError);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  }

  TEST_CASE(
      "shared memory left by a crashed run is removed at the next start; a "
      "live or recent one is kept") {
    TempDir dir;
    // A pid that no longer exists: a child that has exited and been reaped.
    const pid_t child = ::fork();
    if (child == 0) ::_exit(0);
    ::waitpid(child, nullptr, 0);
    const auto dead = std::to_string(child);
    const auto live = std::to_string(::getpid());
    auto make = [&](const std::string& name, long age_s) {
      const auto path = dir / name;
      std::ofstream(path) << "x";
      const timeval then[2] = {{std::time(nullptr) - age_s, 0},
                               {std::time(nullptr) - age_s, 0}};
      ::utimes(path.c_str(), then);
      return path;
    };
    const auto stale = make("ddpkit-" + dead + "-123", 3600);
    const auto stale_marker = make("ddpkit-host-" + dead + "-9-1", 3600);
    const auto recent = make("ddpkit-" + dead + "-456", 0);
    const auto alive = make("ddpkit-" + live + "-789", 3600);
    const auto other = make("other-" + dead, 3600);
    CHECK(dist::detail::sweep_stale_shm(dir.str().c_str()) == 2);
    CHECK_FALSE(std::filesystem::exists(stale));
    CHECK_FALSE(std::filesystem::exists(stale_marker));
    CHECK(std::filesystem::exists(recent));
    CHECK(std::filesystem::exists(alive));
    CHECK(std::filesystem::exists(other));
  }

  // ---- across hosts (run by tests/multihost/collectives.sh on test hosts)
  // --------------------------------------------------------------------

  // Sums and means of every type the shared-memory channel takes, small
  // and larger than one 2 MiB slot, in ordinary memory and in a shared
  // buffer (the reducer's buckets), an empty tensor, and a type gloo may
  // not add: each result is checked against the value the ranks' inputs
  // give, and every rank must hold the same bits (compared over gloo).
  // EXPECT_TRANSPORT and EXPECT_HOSTS say what the group must report.
  DDPKIT_WORKER(collectives_across_hosts) {
    auto g = dist::Group::init(dist::read_env());
    const int r = g.rank();
    const int w = g.size();
    auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
      return 1;
    };
    const std::string want = std::getenv("EXPECT_TRANSPORT");
    if (g.transport() != want) {
      return fail("transport '" + g.transport() + "', expected '" + want + "'");
    }
    if (g.hosts() != std::stoi(std::getenv("EXPECT_HOSTS"))) {
      return fail("hosts " + std::to_string(g.hosts()));
    }
    const auto ops_before = g.shm() ? g.shm()->operations_started() : 0;
    int64_t through_channel = 0;
    // The same bits on every rank: all-gather and compare with rank 0's.
    auto same_everywhere = [&](const torch::Tensor& t) {
      auto bytes = t.contiguous().view(torch::kUInt8).clone();
      auto all = dist::all_gather(g, bytes);
      for (auto& x : all) {
        if (!torch::equal(x, all[0])) return false;
      }
      return true;
    };
    // Element i of rank q: (q + 1) * (i % 7 + 1); the sum over ranks is
    // w(w+1)/2 * (i % 7 + 1), exact in every type below.
    auto input = [&](int64_t n, torch::ScalarType type) {
      return (torch::arange(n, torch::kLong).remainder(7) + 1)
          .mul(r + 1)
          .to(type);
    };
    auto expected = [&](int64_t n, torch::ScalarType type, double scale) {
      auto e = (torch::arange(n, torch::kLong).remainder(7) + 1)
                   .to(torch::kDouble)
                   .mul(w * (w + 1) / 2.0 * scale);
      return e.to(type);
    };
    const int64_t big = (5 << 20) / 4 + 3;  // > two 2 MiB slots of floats
    for (auto type : {torch::kFloat, torch::kDouble, torch::kLong, torch::kInt,
                      torch::kHalf}) {
      for (int64_t n : {int64_t{0}, int64_t{5}, big}) {
        auto t = input(n, type);
        dist::all_reduce(g, t);
        ++through_channel;
        if (!torch::equal(t, expected(n, type, 1.0))) {
          return fail(std::string("sum of ") + c10::toString(type) + " x" +
                      std::to_string(n));
        }
        if (!same_everywhere(t)) return fail("ranks differ");
      }
    }
    // A mean (as the reducer's gradients): float, divided by the world.
    {
      auto t = input(big, torch::kFloat);
      dist::detail::wait(g, dist::all_reduce_mean_async(g, t), "mean");
      ++through_channel;
      if (!torch::allclose(t, expected(big, torch::kFloat, 1.0 / w))) {
        return fail("mean");
      }
      if (!same_everywhere(t)) return fail("ranks differ (mean)");
    }
    // A shared buffer (in place, as DDP's buckets).
    if (g.shm()) {
      auto buf = g.shm()->shared_buffer(big, torch::kFloat);
      if (!buf.defined()) return fail("no shared buffer");
      buf.copy_(input(big, torch::kFloat));
      auto view = buf.narrow(0, 0, big);
      dist::detail::wait(g, dist::all_reduce_mean_async(g, view),
                         "shared mean");
      ++through_channel;
      if (!torch::allclose(buf, expected(big, torch::kFloat, 1.0 / w))) {
        return fail("mean in a shared buffer");
      }
      if (!same_everywhere(buf)) return fail("ranks differ (shared buffer)");
    }
    // bf16: gloo in libtorch 1.13 cannot add it. Either it is summed, or
    // it fails on every rank, and the channel still works afterwards.
    {
      auto t = input(5, torch::kBFloat16);
      bool summed = true;
      try {
        dist::all_reduce(g, t);
      } catch (const std::exception& e) {
        summed = false;
        std::fprintf(stderr, "rank %d: bf16 not summed: %s\n", r, e.what());
      }
      ++through_channel;
      if (summed && !torch::equal(t, expected(5, torch::kBFloat16, 1.0))) {
        return fail("sum of bf16");
      }
      if (!same_everywhere(torch::tensor({summed ? 1 : 0}))) {
        return fail("bf16 summed on some ranks only");
      }
      auto after = input(5, torch::kFloat);
      dist::all_reduce(g, after);
      ++through_channel;
      if (!torch::equal(after, expected(5, torch::kFloat, 1.0))) {
        return fail("sum after bf16");
      }
    }
    if (g.shm()) {
      const auto ops = g.shm()->operations_started() - ops_before;
      if (static_cast<int64_t>(ops) < through_channel) {
        return fail("only " + std::to_string(ops) + " of " +
                    std::to_string(through_channel) +
                    " all-reduces went through shared memory");
      }
    }
    if (r == 0) {
      std::printf("%d ranks on %d hosts (%s): %lld all-reduces checked\n", w,
                  g.hosts(), g.transport().c_str(),
                  static_cast<long long>(through_channel));
    }
    return 0;
  }

  // ---- spawn
  // --------------------------------------------------------------------

  DDPKIT_WORKER(exit_three_on_rank_one) {
    auto g = ddpkit::test::worker_group();
    // Write our pid so the test can check no process survives.
    std::ofstream(ddpkit::test::worker_dir() /
                  ("pid" + std::to_string(g.rank())))
        << ::getpid();
    dist::barrier(g);
    if (g.rank() == 1) return 3;
    // The survivors block in a collective that can never complete.
    auto t = torch::ones({1});
    dist::all_reduce(g, t);
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }

  DDPKIT_WORKER(sigkill_rank_two) {
    auto g = ddpkit::test::worker_group();
    // Write our pid so the test can check no process survives.
    std::ofstream(ddpkit::test::worker_dir() /
                  ("pid" + std::to_string(g.rank())))
        << ::getpid();
    dist::barrier(g);
    if (g.rank() == 2) ::kill(::getpid(), SIGKILL);
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }

  DDPKIT_WORKER(rendezvous_missing_rank) {
    // Rank MISSING (default 1) never joins; the other must give up with a
    // clear error.
    const char* missing = std::getenv("T_MISSING");
    if (dist::read_env().rank == (missing ? std::atoi(missing) : 1)) {
      std::this_thread::sleep_for(std::chrono::seconds(20));
      return 0;
    }
    try {
      dist::Group::init(
          dist::read_env(),
          dist::GroupOptions().rendezvous_timeout(std::chrono::seconds(2)));
    } catch (const DistError& e) {
      std::ofstream(ddpkit::test::worker_dir() / "error.txt") << e.what();
      return 4;
    }
    return 0;
  }

  // Rank 1 stays alive but never joins the all-reduce: rank 0 fails after
  // the collective timeout (DDPKIT_COLLECTIVE_TIMEOUT=2 s here), naming the
  // operation, instead of waiting forever.
  DDPKIT_WORKER(collective_never_completes) {
    auto g = ddpkit::test::worker_group();
    dist::barrier(g);
    if (g.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    try {
      auto t = torch::ones({1000});
      dist::all_reduce(g, t);
    } catch (const PeerFailure& e) {
      std::ofstream(ddpkit::test::worker_dir() / "error0") << e.what();
      return 4;
    }
    return 0;
  }

  namespace {
  bool process_alive(int pid) {
    return ::kill(pid, 0) == 0;
  }
  /// The pids ranks 0..world-1 wrote to DIR/pidR, once all have (up to
  /// 30 s; fewer when some never did).
  std::vector<int> wait_for_pid_files(const TempDir& dir, int world) {
    std::vector<int> pids;
    for (int i = 0; i < 300 && static_cast<int>(pids.size()) < world; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      pids.clear();
      for (int r = 0; r < world; ++r) {
        std::ifstream in(dir / ("pid" + std::to_string(r)));
        int pid = 0;
        if (in >> pid && pid > 0) pids.push_back(pid);
      }
    }
    return pids;
  }
  /// Whether every rank wrote its pid to DIR/pidR and none is alive now.
  bool no_survivors(const TempDir& dir, int world) {
    bool ok = true;
    for (int r = 0; r < world; ++r) {
      std::ifstream in(dir / ("pid" + std::to_string(r)));
      int pid = 0;
      in >> pid;
      CAPTURE(r);
      CHECK(pid > 0);
      if (pid <= 0 || process_alive(pid)) ok = false;
    }
    return ok;
  }
  }  // namespace

  TEST_CASE("spawn: a failing rank stops the job and is named") {
    SUBCASE("exit status 3") {
      TempDir dir;
      auto [res, secs] =
          test::timed_run_workers("exit_three_on_rank_one", 2, dir.str());
      MESSAGE("launcher returned after ", secs, " s");
      CHECK(res.exit_code == 3);
      REQUIRE(res.first_failure.has_value());
      CHECK(res.first_failure->rank == 1);
      CHECK(res.message.find("rank 1") != std::string::npos);
      CHECK(res.message.find("exited with status 3") != std::string::npos);
      CHECK(secs < 10);
      // The survivor, blocked in a collective, was stopped: no orphan.
      CHECK(no_survivors(dir, 2));
    }
    SUBCASE("SIGKILL") {
      TempDir dir;
      auto [res, secs] =
          test::timed_run_workers("sigkill_rank_two", 4, dir.str());
      MESSAGE("launcher returned after ", secs, " s");
      CHECK(res.exit_code == 128 + SIGKILL);
      REQUIRE(res.first_failure.has_value());
      CHECK(res.first_failure->rank == 2);
      CHECK(res.message.find("rank 2") != std::string::npos);
      CHECK(res.message.find("killed by signal 9") != std::string::npos);
      CHECK(secs < 10);
      CHECK(no_survivors(dir, 4));
    }
  }

  DDPKIT_WORKER(write_pid_and_sleep) {
    std::ofstream(ddpkit::test::worker_dir() /
                  ("pid" + std::string(std::getenv("RANK"))))
        << ::getpid();
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }

  // The launcher whose process the next case kills.
  TEST_CASE("launcher victim" *
            doctest::skip(std::getenv("DDPKIT_TEST_VICTIM_DIR") == nullptr)) {
    run_workers("write_pid_and_sleep", 2,
                std::getenv("DDPKIT_TEST_VICTIM_DIR"));
  }

  TEST_CASE("the launcher killed with SIGKILL: its ranks die with it") {
    TempDir dir;
    const auto exe = std::filesystem::read_symlink("/proc/self/exe").string();
    std::vector<std::string> env_s;
    for (char** e = environ; *e != nullptr; ++e) env_s.emplace_back(*e);
    env_s.push_back("DDPKIT_TEST_VICTIM_DIR=" + dir.str());
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string a0 = exe, a1 = "--test-case=launcher victim";
    char* argv[] = {a0.data(), a1.data(), nullptr};
    pid_t launcher = 0;
    REQUIRE(::posix_spawn(&launcher, exe.c_str(), nullptr, nullptr, argv,
                          envp.data()) == 0);
    // Both ranks running.
    const std::vector<int> pids = wait_for_pid_files(dir, 2);
    REQUIRE(pids.size() == 2);
    ::kill(launcher, SIGKILL);
    ::waitpid(launcher, nullptr, 0);
    // Gone (or a zombie nobody reaped yet) within 5 s.
    auto gone = [](int pid) {
      if (::kill(pid, 0) != 0) return true;
      std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
      std::string line;
      std::getline(stat, line);
      const auto close = line.rfind(')');
      return close == std::string::npos || line.substr(close + 2, 1) == "Z";
    };
    const auto t0 = std::chrono::steady_clock::now();
    bool all_gone = false;
    while (!all_gone &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
      all_gone = gone(pids[0]) && gone(pids[1]);
      if (!all_gone) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    MESSAGE("ranks gone ",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                .count(),
            " s after the launcher was killed");
    CHECK(all_gone);
    for (int pid : pids) {
      if (!gone(pid)) ::kill(pid, SIGKILL);  // leave nothing behind
    }
  }

  TEST_CASE("a collective that never completes fails after the timeout") {
    for (std::string shm : {"1", "0"}) {
      CAPTURE(shm);  // through shared memory, and over gloo
      TempDir dir;
      auto [res, secs] = test::timed_run_workers(
          "collective_never_completes", 2, dir.str(),
          {{"DDPKIT_COLLECTIVE_TIMEOUT", "2"}, {"DDPKIT_SHM", shm}});
      MESSAGE("DDPKIT_SHM=", shm, ": launcher returned after ", secs, " s");
      CHECK(res.exit_code == 4);
      std::ifstream in(dir / "error0");
      std::string msg((std::istreambuf_iterator<char>(in)), {});
      CAPTURE(msg);
      CHECK(msg.find("all_reduce") != std::string::npos);
      CHECK(msg.find("timed out after 2 s") != std::string::npos);
      CHECK(secs >= 2);
      CHECK(secs < 20);
    }
  }

  // ---- the flight recorder and ddpkit-doctor
  // ----------------------------------------

  // Both ranks run the same tagged collectives; then rank 1 skips the
  // "bucket 3" all-reduce rank 0 starts and goes on to a broadcast of an
  // int64 (the "stop flag"): a desync that hangs until the timeout.
  // T_FLIGHT_STOP=1: rank 1 stops (sleeps) instead, before the all-reduce.
  DDPKIT_WORKER(flight_desync) {
    auto g = ddpkit::test::worker_group();
    {
      dist::CollectiveTag tag("metrics");
      for (int i = 0; i < 3; ++i) {
        auto t = torch::ones({10});
        dist::all_reduce(g, t);
      }
    }
    dist::barrier(g);
    try {
      if (g.rank() == 0) {
        dist::CollectiveTag tag("bucket", 3);
        auto t = torch::ones({1000});
        dist::all_reduce(g, t);
      } else if (std::getenv("T_FLIGHT_STOP") != nullptr) {
        std::this_thread::sleep_for(std::chrono::seconds(60));
        return 0;
      } else {
        dist::CollectiveTag tag("stop flag");
        auto t = torch::zeros({1}, torch::kInt64);
        dist::broadcast(g, t, 0);
      }
    } catch (const PeerFailure& e) {
      std::ofstream(ddpkit::test::worker_dir() /
                    ("error" + std::to_string(g.rank())))
          << e.what();
      return 4;
    }
    return 0;
  }

  namespace {
  /// Runs ddpkit-doctor on `args`: its exit status and standard output.
  std::pair<int, std::string> run_doctor(const TempDir& dir,
                                         const std::string& args) {
    const auto out = dir / "doctor.txt";
    const std::string cmd = std::string("python3 ") + test::doctor_script() +
                            " " + args + " > " + out.string() + " 2>&1";
    const int status = std::system(cmd.c_str());
    std::ifstream in(out);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text};
  }
  }  // namespace

  TEST_CASE(
      "flight recorder: a desync (rank 1 skipped a collective) is dumped by "
      "both ranks and ddpkit-doctor names both sides") {
    TempDir dir;
    const auto flight = dir / "flight";
    auto [res, secs] =
        test::timed_run_workers("flight_desync", 2, dir.str(),
                                {{"DDPKIT_COLLECTIVE_TIMEOUT", "2"},
                                 {"DDPKIT_FLIGHT_DIR", flight.string()}});
    CHECK(res.exit_code == 4);
    CHECK(secs < 20);
    std::ifstream in(dir / "error0");
    std::string msg((std::istreambuf_iterator<char>(in)), {});
    CAPTURE(msg);
    CHECK(msg.find("(flight record: " + (flight / "rank-0.json").string() +
                   ")") != std::string::npos);
    REQUIRE(std::filesystem::exists(flight / "rank-0.json"));
    REQUIRE(std::filesystem::exists(flight / "rank-1.json"));
    auto [code, text] = run_doctor(dir, flight.string());
    CAPTURE(text);
    CHECK(code == 1);
    // The three "metrics" all-reduces are #0-#2, the barrier #3, then the
    // two sides of #4.
    CHECK(text.rfind("fault: collective #4 (default group): rank 1 broadcast "
                     "8 B Long (stop flag) vs rank 0 all_reduce 4.0 kB Float "
                     "(bucket 3): the ranks called different collectives "
                     "(desync)",
                     0) == 0);
    CHECK(text.find("rank 0 failed after") != std::string::npos);
  }

  TEST_CASE(
      "flight recorder: a stopped rank writes nothing; the other rank's "
      "record shows where it waited and ddpkit-doctor names the missing "
      "rank") {
    TempDir dir;
    const auto flight = dir / "flight";
    auto [res, secs] =
        test::timed_run_workers("flight_desync", 2, dir.str(),
                                {{"DDPKIT_COLLECTIVE_TIMEOUT", "2"},
                                 {"DDPKIT_FLIGHT_DIR", flight.string()},
                                 {"T_FLIGHT_STOP", "1"}});
    CHECK(res.exit_code == 4);
    REQUIRE(std::filesystem::exists(flight / "rank-0.json"));
    CHECK_FALSE(std::filesystem::exists(flight / "rank-1.json"));
    auto [code, text] = run_doctor(dir, dir.str());  // OUT works too
    CAPTURE(text);
    CHECK(code == 1);
    CHECK(text.rfind("fault: rank 1 wrote no flight record", 0) == 0);
    CHECK(text.find("rank 0 failed after ") != std::string::npos);
    CHECK(text.find("in collective #4 all_reduce 4.0 kB Float (bucket 3)") !=
          std::string::npos);
    // Every collective before #4 completed on rank 0.
    const auto record = ddpkit::detail::read_whole_file(flight / "rank-0.json",
                                                        "flight record");
    CHECK(record.find("\"seq\":3,\"group\":\"default\",\"kind\":\"all_reduce\","
                      "\"dtype\":\"Byte\"") != std::string::npos);
  }

  TEST_CASE(
      "ddpkit-doctor: records of a healthy run are no fault; bad input "
      "exits 2 naming the file") {
    TempDir dir;
    const auto flight = dir / "flight";
    std::filesystem::create_directories(flight);
    for (int r = 0; r < 2; ++r) {
      dist::FlightRecorder rec(8, r, 2, "h");
      for (int i = 0; i < 12; ++i) {  // more than the ring holds
        auto t = torch::ones({4});
        dist::CollectiveTag tag("bucket", i % 2);
        rec.end(rec.start(0, "all_reduce", &t, t.nbytes()));
      }
      rec.set_dump_dir(flight);
      REQUIRE(rec.dump("SIGUSR1") ==
              flight / ("rank-" + std::to_string(r) + ".json"));
      CHECK(rec.entries().size() == 8);
      CHECK(rec.entries().front().seq == 4);
    }
    auto [code, text] = run_doctor(dir, flight.string());
    CAPTURE(text);
    CHECK(code == 0);
    CHECK(text.rfind("no fault found: 2 rank(s) recorded, every collective "
                     "matches and completed (up to #11)",
                     0) == 0);
    std::ofstream(flight / "rank-1.json") << "{not json";
    std::tie(code, text) = run_doctor(dir, flight.string());
    CHECK(code == 2);
    CHECK(text.find("cannot read " + (flight / "rank-1.json").string()) !=
          std::string::npos);
  }

  // Twenty tagged all-reduces; rank 1 sends itself SIGUSR1 after the tenth.
  DDPKIT_WORKER(flight_sigusr1) {
    auto g = ddpkit::test::worker_group();
    dist::CollectiveTag tag("metrics");
    for (int i = 0; i < 20; ++i) {
      auto t = torch::ones({10});
      dist::all_reduce(g, t);
      if (i == 9 && g.rank() == 1) ::raise(SIGUSR1);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    dist::barrier(g);
    // Time for the other rank's heartbeat (each second) to see the request.
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    return 0;
  }

  TEST_CASE(
      "flight recorder: SIGUSR1 writes the rank's record and training goes "
      "on") {
    TempDir dir;
    const auto flight = dir / "flight";
    auto res = run_workers("flight_sigusr1", 2, dir.str(),
                           {{"DDPKIT_FLIGHT_DIR", flight.string()}});
    CHECK(res.ok());  // SIGUSR1's default action would have ended rank 1
    REQUIRE(std::filesystem::exists(flight / "rank-1.json"));
    // The other rank writes its record too, through the liveness watch's
    // store (libtorch >= 2.5); without it only the signalled rank does.
    CHECK(std::filesystem::exists(flight / "rank-0.json") ==
          dist::compat::can_clone_store);
    if (dist::compat::can_clone_store) {
      const auto other =
          ddpkit::detail::read_whole_file(flight / "rank-0.json", "record");
      CHECK(other.find("\"reason\": \"SIGUSR1 to another rank\"") !=
            std::string::npos);
    }
    const auto record =
        ddpkit::detail::read_whole_file(flight / "rank-1.json", "record");
    CAPTURE(record.substr(0, 400));
    CHECK(record.find("\"reason\": \"SIGUSR1\"") != std::string::npos);
    CHECK(record.find("{\"seq\":9,\"group\":\"default\",\"kind\":"
                      "\"all_reduce\",\"dtype\":\"Float\",\"numel\":10,"
                      "\"bytes\":40,\"tag\":\"metrics\"") != std::string::npos);
  }

  // ---- the liveness watch
  // ---------------------------------------------------------

  // Rank 1 stops itself (SIGSTOP) after a barrier; rank 0 waits for it in
  // an all-reduce with the default collective timeout (300 s).
  DDPKIT_WORKER(liveness_stopped_rank) {
    auto g = ddpkit::test::worker_group();
    dist::barrier(g);
    const auto dir = ddpkit::test::worker_dir();
    std::ofstream(dir / ("pid" + std::to_string(g.rank())))
        << ::getpid() << "\n";
    std::ofstream(dir / ("t" + std::to_string(g.rank())))
        << dist::FlightRecorder::now_us() << "\n";
    if (g.rank() == 1) {
      ::raise(SIGSTOP);
      return 0;
    }
    dist::CollectiveTag tag("bucket", 0);
    auto t = torch::ones({100});
    dist::all_reduce(g, t);
    return 0;
  }

  // Busy ranks are not lost: rank 1 computes 8 s before an all-reduce rank
  // 0 waits in; then rank 0 "evaluates alone" 8 s while rank 1 waits for it
  // through the store (broadcast_when_ready). Run with a 3 s silence limit.
  DDPKIT_WORKER(liveness_busy_ranks) {
    auto g = ddpkit::test::worker_group();
    dist::barrier(g);
    if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(8));
    auto t = torch::ones({100});
    dist::all_reduce(g, t);
    if (g.rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(8));
    auto v = torch::full({1}, g.rank() == 0 ? 7.0 : 0.0);
    dist::broadcast_when_ready(g, v, 0, std::chrono::seconds(60), "evaluation");
    return v.item<double>() == 7.0 && t[0].item<float>() == 2.0f ? 0 : 1;
  }

  TEST_CASE(
      "liveness: a stopped rank (SIGSTOP) is named by the other within 30 s "
      "at the default settings, with its pid, in the flight record") {
    DDPKIT_REQUIRE_BUILD(dist::compat::can_clone_store,
                         "libtorch < 2.5 cannot clone a store: no liveness "
                         "watch");
    TempDir dir;
    const auto flight = dir / "flight";
    auto [res, secs] =
        test::timed_run_workers("liveness_stopped_rank", 2, dir.str(),
                                {{"DDPKIT_FLIGHT_DIR", flight.string()}});
    CHECK(res.exit_code == kPeerFailureExitCode);
    REQUIRE(std::filesystem::exists(flight / "rank-0.json"));
    const auto record =
        ddpkit::detail::read_whole_file(flight / "rank-0.json", "record");
    std::string pid1;
    std::ifstream(dir / "pid1") >> pid1;
    CAPTURE(record.substr(0, 600));
    CHECK(record.find("\"reason\": \"rank 1 (pid " + pid1 + " on host '") !=
          std::string::npos);
    CHECK(record.find("sent no heartbeat for 15.0 s") != std::string::npos);
    CHECK(record.find("(bucket 0)") != std::string::npos);
    // From the barrier to rank 0's record (the launcher's SIGKILL of the
    // stopped rank comes after).
    long long t0 = 0;
    std::ifstream(dir / "t0") >> t0;
    const auto at = record.find("\"time_us\": ");
    REQUIRE(at != std::string::npos);
    const double took =
        static_cast<double>(std::stoll(record.substr(at + 11)) - t0) / 1e6;
    MESSAGE("rank 1 declared lost ", took, " s after it stopped");
    CHECK(took < 30);
    CHECK(took >= 15);
    auto [code, text] = run_doctor(dir, flight.string());
    CHECK(code == 1);
    CHECK(text.rfind("fault: rank 1 wrote no flight record", 0) == 0);
  }

  TEST_CASE(
      "liveness: ranks busy longer than the silence limit (computing, or "
      "evaluating alone) are not declared lost") {
    TempDir dir;
    auto res = run_workers("liveness_busy_ranks", 2, dir.str(),
                           {{"DDPKIT_LIVENESS_TIMEOUT", "3"}});
    CHECK(res.ok());
    CHECK(res.message == "");
  }

  TEST_CASE(
      "desync: ranks waiting at the same collective number in different "
      "collectives are told within 10 s at the default settings, both sides "
      "named") {
    DDPKIT_REQUIRE_BUILD(dist::compat::can_clone_store,
                         "libtorch < 2.5 cannot clone a store: no liveness "
                         "watch");
    TempDir dir;
    const auto flight = dir / "flight";
    auto [res, secs] =
        test::timed_run_workers("flight_desync", 2, dir.str(),
                                {{"DDPKIT_FLIGHT_DIR", flight.string()}});
    // 75 from the rank that saw it, or 4 from the worker whose collective
    // then failed (the launcher names that one: 75 is a casualty's code).
    CHECK((res.exit_code == kPeerFailureExitCode || res.exit_code == 4));
    MESSAGE("the launcher returned after ", secs, " s");
    CHECK(secs < 15);  // the 300 s collective timeout was not waited for
    const std::string said[2] = {
        "desync at collective #4: rank 1 broadcast 8 B Long (stop flag) vs "
        "rank 0 all_reduce 4.0 kB Float (bucket 3): the ranks called "
        "different collectives",
        "desync at collective #4: rank 0 all_reduce 4.0 kB Float (bucket 3) "
        "vs rank 1 broadcast 8 B Long (stop flag): the ranks called "
        "different collectives"};
    int told = 0;
    for (int r = 0; r < 2; ++r) {
      const auto f = flight / ("rank-" + std::to_string(r) + ".json");
      if (!std::filesystem::exists(f)) continue;
      const auto record = ddpkit::detail::read_whole_file(f, "record");
      CAPTURE(record.substr(0, 400));
      told += record.find(said[r]) != std::string::npos ? 1 : 0;
    }
    // The first rank to see it ends the job; the other may be stopped by
    // the launcher before it says so too.
    CHECK(told >= 1);
  }

  // Both ranks take SIGTERM into a flag (as the Trainer does) and tell the
  // liveness watch; rank 1 is stuck outside any collective, rank 0 waits
  // for it in an all-reduce: the step boundary where the flag would be
  // acted on never comes.
  DDPKIT_WORKER(hang_then_signal) {
    auto g = ddpkit::test::worker_group();
    train::SignalFlag signals(true);
    g.watch_interrupt([&signals] { return signals.pending(); },
                      [] { return std::string("(the resume note)"); });
    dist::barrier(g);
    std::ofstream(ddpkit::test::worker_dir() /
                  ("pid" + std::to_string(g.rank())))
        << ::getpid() << "\n";
    if (g.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(120));
      return 0;
    }
    auto t = torch::ones({100});
    dist::all_reduce(g, t);
    return 0;
  }

  TEST_CASE(
      "SIGTERM during a hang ends the ranks within 30 s, saying that no "
      "consistent checkpoint was possible and which one a resume uses") {
    DDPKIT_REQUIRE_BUILD(dist::compat::can_clone_store,
                         "libtorch < 2.5 cannot clone a store: no liveness "
                         "watch");
    TempDir dir;
    const auto flight = dir / "flight";
    dist::SpawnResult res;
    std::thread launcher([&] {
      res = run_workers("hang_then_signal", 2, dir.str(),
                        {{"DDPKIT_FLIGHT_DIR", flight.string()}});
    });
    const std::vector<int> pids = wait_for_pid_files(dir, 2);
    REQUIRE(pids.size() == 2);
    std::this_thread::sleep_for(std::chrono::seconds(1));  // rank 0 waits
    const auto t0 = std::chrono::steady_clock::now();
    for (int pid : pids) ::kill(pid, SIGTERM);
    launcher.join();
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    MESSAGE("every rank ended ", took, " s after SIGTERM");
    CHECK(took < 30);
    CHECK(res.exit_code == 128 + SIGTERM);
    const auto record =
        ddpkit::detail::read_whole_file(flight / "rank-0.json", "record");
    CAPTURE(record.substr(0, 500));
    CHECK(record.find("SIGTERM received 1") != std::string::npos);
    CHECK(record.find("in collective #1 all_reduce 400 B Float: the ranks "
                      "cannot meet to agree on a step, so no consistent "
                      "checkpoint is possible; (the resume note)") !=
          std::string::npos);
  }

  TEST_CASE("rendezvous with a missing rank times out with a clear error") {
    for (std::string method : {"tcp", "file"}) {
      CAPTURE(method);
      TempDir dir;
      dist::EnvVars env;
      if (method == "tcp") env.emplace_back("DDPKIT_INIT_METHOD", "env://");
      auto [res, secs] =
          test::timed_run_workers("rendezvous_missing_rank", 2, dir.str(), env);
      CHECK(res.exit_code == 4);
      std::ifstream in(dir / "error.txt");
      std::string msg((std::istreambuf_iterator<char>(in)), {});
      MESSAGE(msg);
      CHECK(msg.find(method == "tcp"
                         ? "rendezvous at 127.0.0.1:"
                         : "rendezvous at file://") != std::string::npos);
      CHECK(msg.find("waiting for 2 ranks (1 joined") != std::string::npos);
      CHECK(secs < 15);
    }
  }

  TEST_CASE(
      "rendezvous without rank 0 (the store's host): the other rank fails "
      "within the timeout naming the address, the port and what to check") {
    TempDir dir;
    auto [res, secs] = test::timed_run_workers(
        "rendezvous_missing_rank", 2, dir.str(),
        {{"DDPKIT_INIT_METHOD", "env://"}, {"T_MISSING", "0"}});
    CHECK(res.exit_code == 4);
    std::ifstream in(dir / "error.txt");
    std::string msg((std::istreambuf_iterator<char>(in)), {});
    MESSAGE(msg);
    CHECK(msg.find("rank 1: cannot reach the rendezvous store at 127.0.0.1:") !=
          std::string::npos);
    CHECK(msg.find("check that rank 0 is running") != std::string::npos);
    // The 2 s timeout, plus libtorch's retry delay (up to ~4 s), plus start.
    CHECK(secs < 15);
  }

}  // TEST_SUITE("dist")

// ---- bad input at rendezvous
// ----------------------------------------------------

#include <netinet/in.h>
#include <sys/socket.h>

TEST_SUITE("dist") {
  TEST_CASE(
      "rendezvous: an unresolvable MASTER_ADDR is a usage error naming it") {
    auto env = dist::explicit_env(1, 2, "no-such-host.invalid", 29500);
    CHECK_THROWS_WITH_AS(
        dist::Group::init(
            env, dist::GroupOptions().init_method("env://").rendezvous_timeout(
                     std::chrono::seconds(2))),
        doctest::Contains(
            "MASTER_ADDR 'no-such-host.invalid' cannot be resolved"),
        UsageError);
  }

  TEST_CASE(
      "rendezvous: a MASTER_PORT already in use is a usage error naming it") {
    // Hold a listening socket on a port, then ask rank 0 to host there.
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = 0;
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::listen(fd, 1) == 0);
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    int port = ntohs(addr.sin_port);
    auto env = dist::explicit_env(0, 2, "127.0.0.1", port);
    auto t0 = std::chrono::steady_clock::now();
    const std::string expected =
        "port " + std::to_string(port) + ": the port is already in use";
    CHECK_THROWS_WITH_AS(
        dist::Group::init(
            env, dist::GroupOptions().init_method("env://").rendezvous_timeout(
                     std::chrono::seconds(3))),
        doctest::Contains(expected.c_str()), UsageError);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
    ::close(fd);
  }

}  // TEST_SUITE("dist")

// ---- shared-memory all-reduce
// ---------------------------------------------------

namespace {

torch::Tensor shm_input(int rank, int64_t n, torch::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(1000 * n + rank);
  if (dtype == torch::kLong) {
    return torch::randint(-1000000, 1000000, {n}, gen, torch::kLong);
  }
  return torch::randn({n}, gen, torch::TensorOptions(dtype));
}

const std::vector<int64_t> kShmSizes{0, 1, 7, 1000, 786432, 1000003};
const std::vector<torch::ScalarType> kShmTypes{torch::kFloat, torch::kDouble,
                                               torch::kLong};

}  // namespace

TEST_SUITE("dist") {
  // Sums of many sizes (empty, one element, several 2 MiB chunks, odd
  // lengths) and types; every rank saves its results for the test to
  // compare bit for bit.
  DDPKIT_WORKER(shm_allreduce) {
    auto g = ddpkit::test::worker_group();
    const bool want_shm = std::getenv("DDPKIT_SHM") == nullptr ||
                          std::string(std::getenv("DDPKIT_SHM")) == "1";
    if (static_cast<bool>(g.shm()) != want_shm) {
      std::fprintf(stderr, "rank %d: shared memory %s\n", g.rank(),
                   g.shm() ? "on but should be off" : "off but should be on");
      return 1;
    }
    std::vector<torch::Tensor> results;
    for (auto dtype : kShmTypes) {
      for (auto n : kShmSizes) {
        auto t = shm_input(g.rank(), n, dtype);
        dist::all_reduce(g, t);
        results.push_back(t);
      }
    }
    // The mean (through shared memory the division happens on each slice).
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      auto t = shm_input(g.rank(), 1000003, dtype);
      dist::all_reduce_mean_async(g, t)->wait();
      auto want = torch::zeros({1000003}, torch::kDouble);
      for (int q = 0; q < g.size(); ++q) {
        want += shm_input(q, 1000003, dtype).to(torch::kDouble);
      }
      want /= g.size();
      double err = (t.to(torch::kDouble) - want).abs().max().item<double>();
      if (!(err <= 1e-5)) {
        std::fprintf(stderr, "rank %d: mean off by %g\n", g.rank(), err);
        return 1;
      }
    }
    // Shared buffers (the DDP reducer's buckets): slices one after another
    // in one buffer, all started before any is waited for, reduced in
    // place. Without shared memory the same sums on ordinary tensors.
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      int64_t total = 0;
      for (auto n : kShmSizes) total += n + 3;  // odd offsets
      torch::Tensor buf;
      if (g.shm()) {
        buf = g.shm()->shared_buffer(total, dtype);
        if (!buf.defined() || !g.shm()->in_shared_buffer(buf)) {
          std::fprintf(stderr, "rank %d: no shared buffer\n", g.rank());
          return 1;
        }
      } else {
        buf = torch::zeros({total}, dtype);
      }
      std::vector<torch::Tensor> views;
      std::vector<dist::compat::WorkPtr> pending;
      int64_t off = 0;
      for (auto n : kShmSizes) {
        auto v = buf.narrow(0, off + 3, n);
        v.copy_(shm_input(g.rank(), n, dtype));
        if (g.shm() && n > 0 && !g.shm()->in_shared_buffer(v)) return 1;
        views.push_back(v);
        pending.push_back(dist::all_reduce_async(g, views.back()));
        off += n + 3;
      }
      for (auto& w : pending) w->wait();
      for (auto& v : views) results.push_back(v.clone());
    }
    // Overlapping asynchronous calls complete in order.
    std::vector<torch::Tensor> many;
    std::vector<dist::compat::WorkPtr> works;
    for (int k = 0; k < 5; ++k) {
      many.push_back(torch::full({300000}, static_cast<float>(g.rank() + k)));
      works.push_back(dist::all_reduce_async(g, many.back()));
    }
    for (auto& w : works) w->wait();
    const int n = g.size();
    for (int k = 0; k < 5; ++k) {
      float want = static_cast<float>(n * (n - 1) / 2 + n * k);
      if (!torch::equal(many[k], torch::full({300000}, want))) {
        std::fprintf(stderr, "rank %d: async call %d wrong\n", g.rank(), k);
        return 1;
      }
    }
    torch::save(results, (ddpkit::test::worker_dir() /
                          ("shm" + std::to_string(g.rank()) + ".pt"))
                             .string());
    return 0;
  }

  TEST_CASE(
      "shared-memory all-reduce: right sums, the same bits on every rank, and "
      "gloo when turned off") {
    for (std::string shm : {"1", "0"}) {
      for (int world : {2, 3}) {
        CAPTURE(shm);
        CAPTURE(world);
        TempDir dir;
        auto res = run_workers("shm_allreduce", world, dir.str(),
                               {{"DDPKIT_SHM", shm}});
        REQUIRE(res.ok());
        std::vector<std::vector<torch::Tensor>> got(world);
        for (int r = 0; r < world; ++r) {
          torch::load(got[r],
                      (dir / ("shm" + std::to_string(r) + ".pt")).string());
        }
        std::size_t k = 0;
        for (auto dtype : kShmTypes) {
          for (auto n : kShmSizes) {
            auto want = shm_input(0, n, dtype).to(torch::kDouble);
            for (int q = 1; q < world; ++q) {
              want += shm_input(q, n, dtype).to(torch::kDouble);
            }
            CAPTURE(n);
            CHECK((got[0][k].scalar_type() == dtype));
            double err = n == 0 ? 0.0
                                : (got[0][k].to(torch::kDouble) - want)
                                      .abs()
                                      .max()
                                      .item<double>();
            CHECK(err <= (dtype == torch::kFloat    ? 1e-5
                          : dtype == torch::kDouble ? 1e-12
                                                    : 0.0));
            for (int r = 1; r < world; ++r)
              CHECK(torch::equal(got[r][k], got[0][k]));
            ++k;
          }
        }
        // The same sums from shared buffers (reduced in place).
        for (auto dtype : {torch::kFloat, torch::kDouble}) {
          for (auto n : kShmSizes) {
            auto want = shm_input(0, n, dtype).to(torch::kDouble);
            for (int q = 1; q < world; ++q) {
              want += shm_input(q, n, dtype).to(torch::kDouble);
            }
            CAPTURE(n);
            REQUIRE(k < got[0].size());
            double err = n == 0 ? 0.0
                                : (got[0][k].to(torch::kDouble) - want)
                                      .abs()
                                      .max()
                                      .item<double>();
            CHECK(err <= (dtype == torch::kFloat ? 1e-5 : 1e-12));
            for (int r = 1; r < world; ++r)
              CHECK(torch::equal(got[r][k], got[0][k]));
            ++k;
          }
        }
        CHECK(k == got[0].size());
      }
    }
  }

  // A /dev/shm too small for a shared buffer (Docker's default is 64 MiB):
  // `shared_buffer` is undefined on every rank (the reducer then uses
  // ordinary buckets), smaller buffers still work. Run inside a 12 MiB
  // /dev/shm by the test case below.
  DDPKIT_WORKER(shm_small_devshm) {
    auto g = ddpkit::test::worker_group();
    if (!g.shm()) return 2;  // the channel's own 8 MiB segment must fit
    // 16 MiB per rank, 32 MiB in all: more than /dev/shm holds.
    auto big = g.shm()->shared_buffer(int64_t{4} << 20, torch::kFloat);
    if (big.defined()) return 3;
    auto small = g.shm()->shared_buffer(1000, torch::kFloat);
    if (!small.defined() || !g.shm()->in_shared_buffer(small)) return 4;
    small.fill_(static_cast<float>(g.rank() + 1));
    dist::all_reduce(g, small);
    if (!torch::equal(small, torch::full({1000}, 3.0f))) return 5;
    return 0;
  }

  // Runs only inside the private mount namespace the next case sets up.
  TEST_CASE("shared-memory all-reduce: inside a 12 MiB /dev/shm" *
            doctest::skip(std::getenv("DDPKIT_TEST_SMALL_SHM") == nullptr)) {
    TempDir dir;
    auto res = run_workers("shm_small_devshm", 2, dir.str());
    CAPTURE(res.message);
    CHECK(res.ok());
  }

  TEST_CASE(
      "shared-memory all-reduce: a /dev/shm too small for a shared buffer "
      "means ordinary memory, not a crash") {
    if (std::system("unshare -m sh -c 'mount -t tmpfs -o size=12m tmpfs "
                    "/dev/shm' >/dev/null 2>&1") != 0) {
      // CI runs as root (the project's containers do): there it must run.
      DDPKIT_SKIP(
          "no private mount namespace with its own /dev/shm here (unshare "
          "-m + mount need CAP_SYS_ADMIN)");
    }
    TempDir dir;
    const auto exe = std::filesystem::read_symlink("/proc/self/exe").string();
    const auto log = (dir / "log").string();
    const std::string cmd =
        "DDPKIT_TEST_SMALL_SHM=1 unshare -m sh -c 'mount -t tmpfs -o "
        "size=12m tmpfs /dev/shm && exec \"$0\" --force-colors=0 "
        "--test-case=\"*inside a 12 MiB /dev/shm\"' '" +
        exe + "' > '" + log + "' 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(log);
    std::string out((std::istreambuf_iterator<char>(in)), {});
    CAPTURE(out);
    CHECK(rc == 0);
    CHECK(out.find(" 1 passed") != std::string::npos);  // ran, not skipped
    CHECK(out.find("Status: SUCCESS") != std::string::npos);
  }

  // Ranks that disagree on a collective's size fail with an error naming
  // both sizes instead of hanging or mixing data.
  // `T_GATHER=1`: first an all-gather in a shared buffer (ZeRO's), checked;
  // then rank 0 all-gathers while rank 1 all-reduces that buffer.
  DDPKIT_WORKER(shm_mismatch) {
    auto g = ddpkit::test::worker_group();
    if (!g.shm()) return 2;
    const bool gather = std::getenv("T_GATHER") != nullptr;
    std::string what = "no error";
    try {
      if (gather) {
        auto buf = g.shm()->shared_buffer(8, torch::kFloat);
        if (!buf.defined()) return 4;
        const std::vector<int64_t> parts{0, 3, 8};
        buf.narrow(0, parts[g.rank()], parts[g.rank() + 1] - parts[g.rank()])
            .fill_(g.rank() + 1);
        dist::all_gather_shared(g, buf, parts);
        auto want = torch::tensor({1, 1, 1, 2, 2, 2, 2, 2}, torch::kFloat);
        if (!buf.equal(want)) return 3;
        if (g.rank() == 0) {
          dist::all_gather_shared(g, buf, parts);
        } else {
          dist::all_reduce(g, buf);
        }
      } else {
        auto t = torch::ones({10 + g.rank()});
        dist::all_reduce(g, t);
      }
    } catch (const ddpkit::Error& e) {
      what = e.what();
    }
    std::ofstream(ddpkit::test::worker_dir() /
                  ("mismatch" + std::to_string(g.rank()) + ".txt"))
        << what << "\n";
    return 0;
  }

  TEST_CASE(
      "shared-memory all-reduce: ranks reducing different sizes fail, "
      "naming both") {
    TempDir dir;
    auto res = run_workers("shm_mismatch", 2, dir.str());
    REQUIRE(res.ok());
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(dir / ("mismatch" + std::to_string(r) + ".txt"));
      std::string what;
      std::getline(in, what);
      CAPTURE(what);
      CHECK(what.find("all-reduce mismatch") != std::string::npos);
      CHECK(what.find("reduces " + std::to_string(10 + r) + " elements") !=
            std::string::npos);
      CHECK(what.find("reduces " + std::to_string(11 - r) + " elements") !=
            std::string::npos);
    }
    // An all-gather in place (each rank's part read from its buffer; ZeRO's
    // parameters) gives every rank every part; against an all-reduce of
    // the same buffer it fails on both ranks, saying which is which.
    TempDir gdir;
    auto gres = run_workers("shm_mismatch", 2, gdir.str(), {{"T_GATHER", "1"}});
    CAPTURE(gres.message);
    REQUIRE(gres.ok());
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(gdir / ("mismatch" + std::to_string(r) + ".txt"));
      std::string what;
      std::getline(in, what);
      CAPTURE(what);
      CHECK(what.find("all-reduce mismatch") != std::string::npos);
      CHECK(what.find("8 elements of Float in a shared buffer (an "
                      "all-gather)") != std::string::npos);
    }
  }

  // Rank 1 leaves cleanly (so the launcher does not stop rank 0) while rank
  // 0 waits for it in a shared-memory all-reduce.
  DDPKIT_WORKER(shm_peer_leaves) {
    auto g = ddpkit::test::worker_group();
    if (!g.shm()) return 2;
    if (g.rank() == 1) return 0;
    auto t0 = std::chrono::steady_clock::now();
    std::string what = "no error";
    try {
      auto t = torch::ones({1000});
      dist::all_reduce(g, t);
    } catch (const PeerFailure& e) {
      what = e.what();
    }
    double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    std::ofstream(ddpkit::test::worker_dir() / "peer.txt") << secs << "\n"
                                                           << what << "\n";
    return 0;
  }

  TEST_CASE(
      "shared-memory all-reduce: a rank that is gone fails the others "
      "at once, naming it") {
    TempDir dir;
    auto res = run_workers("shm_peer_leaves", 2, dir.str());
    REQUIRE(res.ok());
    std::ifstream in(dir / "peer.txt");
    double secs = -1;
    std::string line, what;
    in >> secs;
    std::getline(in, line);
    std::getline(in, what);
    MESSAGE("detected after ", secs, " s: ", what);
    CHECK(what.find("rank 1 (pid") != std::string::npos);
    CHECK(what.find("is gone") != std::string::npos);
    CHECK(secs < 5);
  }
}  // TEST_SUITE("dist")
