// Shared by the multi-process benchmarks: a launcher registers Google
// Benchmark entries that each spawn a world of ranks (this same binary),
// and the ranks time their own loop and hand the numbers back through a
// small key/value file written by rank 0.
#pragma once

#include <benchmark/benchmark.h>
#include <array>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <ddpkit/ddpkit.hpp>

namespace ddpkit_bench {

using clock = std::chrono::steady_clock;
using Values = std::map<std::string, double>;

inline double seconds_since(clock::time_point t0) {
  return std::chrono::duration<double>(clock::now() - t0).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline double mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size();
}

/// `--key=value` arguments of a rank task.
class Args {
 public:
  Args(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) continue;
      auto eq = a.find('=');
      if (eq == std::string::npos) {
        kv_[a.substr(2)] = "1";
      } else {
        kv_[a.substr(2, eq - 2)] = a.substr(eq + 1);
      }
    }
  }
  std::string str(const std::string& k, std::string dflt = "") const {
    auto it = kv_.find(k);
    return it == kv_.end() ? dflt : it->second;
  }
  double num(const std::string& k, double dflt = 0) const {
    auto it = kv_.find(k);
    return it == kv_.end() ? dflt : std::stod(it->second);
  }
  bool has(const std::string& k) const {
    return kv_.count(k) != 0;
  }

 private:
  std::map<std::string, std::string> kv_;
};

/// Rank 0 writes its numbers where the launcher told it to.
inline void write_values(const ddpkit::dist::Group& g, const Values& v) {
  if (!g.is_main()) return;
  const char* path = std::getenv("DDPKIT_BENCH_RESULT");
  if (path == nullptr) {
    for (auto& [k, x] : v) std::printf("%s %.9g\n", k.c_str(), x);
    return;
  }
  std::ofstream out(path);
  out.precision(9);
  for (auto& [k, x] : v) out << k << ' ' << x << '\n';
}

/// Spawns `world` ranks of this binary with `args` and returns rank 0's
/// numbers (empty on failure, with the reason in `error`).
inline Values run_world(int world, std::vector<std::string> args,
                        std::string* error = nullptr) {
  namespace fs = std::filesystem;
  static int counter = 0;
  fs::path file = fs::temp_directory_path() /
                  ("ddpkit-bench-" + std::to_string(::getpid()) + "-" +
                   std::to_string(counter++) + ".txt");
  args.insert(args.begin(), "--rank-task");
  auto res =
      ddpkit::dist::spawn(ddpkit::dist::SpawnOptions(world).args(args).env(
          {{"DDPKIT_BENCH_RESULT", file}}));
  Values v;
  if (!res.ok()) {
    if (error) *error = res.message;
    return v;
  }
  std::ifstream in(file);
  std::string k;
  double x;
  while (in >> k >> x) v[k] = x;
  fs::remove(file);
  if (v.empty() && error) *error = "rank 0 wrote no results";
  return v;
}

/// The device a rank trains on: its GPU where CUDA is there, else the CPU.
inline torch::Device rank_device(const ddpkit::dist::Group& g) {
  if (torch::cuda::is_available()) {
    return torch::Device(torch::kCUDA,
                         g.local_rank() % torch::cuda::device_count());
  }
  return torch::kCPU;
}

/// Waits for queued GPU work (a no-op on the CPU).
inline void sync_device(const torch::Tensor& t) {
  if (t.is_cuda()) (void)t.view(-1)[0].item<float>();
}

/// How many ranks a scaling run may use: anything on the CPU, at most one
/// per GPU with CUDA.
inline int max_world() {
  if (torch::cuda::is_available()) {
    return static_cast<int>(torch::cuda::device_count());
  }
  return 1 << 20;
}

/// One Google Benchmark entry whose single iteration is a whole spawned
/// world; the reported time is the per-step time rank 0 measured.
inline benchmark::internal::Benchmark* register_world(
    const std::string& name, int world, std::vector<std::string> args,
    std::function<void(benchmark::State&, const Values&)> report) {
  return benchmark::RegisterBenchmark(
             name.c_str(),
             [world, args, report](benchmark::State& st) {
               for (auto _ : st) {
                 std::string err;
                 auto v = run_world(world, args, &err);
                 if (v.empty()) {
                   st.SkipWithError(("world failed: " + err).c_str());
                   break;
                 }
                 st.SetIterationTime(v.count("time_s") ? v.at("time_s") : 0);
                 report(st, v);
               }
             })
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

/// Copies every `Values` entry into the benchmark's counters.
inline void all_counters(benchmark::State& st, const Values& v) {
  for (auto& [k, x] : v) st.counters[k] = x;
}

/// Removes the launcher's own `--flag[=v]` options before Google Benchmark
/// sees argv; returns them.
inline Args take_own_flags(int& argc, char** argv,
                           const std::vector<std::string>& own) {
  std::vector<char*> kept{argv[0]};
  std::vector<char*> mine{argv[0]};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool is_own = false;
    for (auto& o : own) {
      if (a == "--" + o || a.rfind("--" + o + "=", 0) == 0) is_own = true;
    }
    (is_own ? mine : kept).push_back(argv[i]);
  }
  Args args(static_cast<int>(mine.size()), mine.data());
  argc = static_cast<int>(kept.size());
  for (int i = 0; i < argc; ++i) argv[i] = kept[i];
  return args;
}

}  // namespace ddpkit_bench

namespace ddpkit_bench {

/// A communication hook that sends nothing: the reducer still hooks every
/// gradient into its bucket and hands each bucket to the hook, so a step
/// with it costs exactly the reducer's own bookkeeping.
struct NullComm {
  static constexpr const char* name = "none";
  ddpkit::parallel::CommFuture run(const ddpkit::dist::Group&,
                                   ddpkit::parallel::GradBucket&) {
    return {};
  }
};

/// The models the suite trains, with the input they are timed on.
struct ModelSpec {
  std::string name;  // resnet18 | resnet34 | cifarnet
  int64_t image;     // square input side
  int64_t batch;     // per rank
  std::string label() const {
    return name + "@" + std::to_string(image) + "/b" + std::to_string(batch);
  }
  std::vector<std::string> args() const {
    return {"--model=" + name, "--image=" + std::to_string(image),
            "--batch=" + std::to_string(batch)};
  }
};

/// Calls `f(model)` with a freshly built model of that name.
/// A plain conv net whose modules are registered in the reverse of the
/// order they run (head first): the reducer's initial bucket order (reverse
/// registration) is then the reverse of the order gradients arrive, which
/// the learned bucket order repairs after the first step.
struct HeadFirstNetImpl : torch::nn::Module {
  HeadFirstNetImpl() {
    head = register_module("head", torch::nn::Linear(256, 10));
    for (int k = 4; k >= 0; --k) {
      const int64_t in = k == 0 ? 3 : (k == 1 ? 64 : (k == 2 ? 128 : 256));
      const int64_t out = k == 0 ? 64 : (k == 1 ? 128 : 256);
      convs[static_cast<std::size_t>(k)] =
          register_module("conv" + std::to_string(k),
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3)
                                                .padding(1)
                                                .stride(k < 3 ? 2 : 1)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& c : convs) x = torch::relu(c(x));
    return head(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
  }
  torch::nn::Linear head{nullptr};
  std::array<torch::nn::Conv2d, 5> convs{nullptr, nullptr, nullptr, nullptr,
                                         nullptr};
};
TORCH_MODULE(HeadFirstNet);

template <class F>
auto with_model(const std::string& name, F&& f) {
  if (name == "resnet18") return f(ddpkit::nn::resnet18(10));
  if (name == "resnet34") return f(ddpkit::nn::resnet34(10));
  if (name == "cifarnet") {
    return f(ddpkit::nn::CifarNet(ddpkit::nn::CifarNetOptions(10)));
  }
  if (name == "headfirst") return f(HeadFirstNet());
  throw std::runtime_error("unknown model " + name);
}

/// "1,2,4" -> {1, 2, 4} (the --worlds style flags).
inline std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoi(item));
  return out;
}

inline int64_t gradient_bytes(torch::nn::Module& m) {
  int64_t b = 0;
  for (auto& p : m.parameters()) {
    if (p.requires_grad()) b += p.numel() * p.element_size();
  }
  return b;
}

}  // namespace ddpkit_bench
