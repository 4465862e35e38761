// Communication: all-reduce time and bandwidth against message size, and
// the reducer's bucketed all-reduce of ResNet-18's gradients against one
// all-reduce of the same bytes as a flat buffer. Each sweep is one spawned
// world (this binary again); the launcher turns rank 0's numbers into one
// Google Benchmark entry per point.
//
//   allreduce/bytes:B/world:N      median time of one in-place all-reduce
//                                  (algbw = B / t; busbw = algbw·2(N-1)/N)
//   bucketed_comm/<model>/cap_mib:C   the buckets the reducer makes at cap
//                                  C, all launched back to back then waited
//   bucketed_comm/<model>/flat     one all-reduce of all gradient bytes
//   flight_recorder/start_end      what the flight recorder adds to one
//                                  collective (start, then end by id), in
//                                  this process
//
// Launcher flags: --quick (sizes up to 64 MiB), --max-mib=M, --worlds=2,4.
#include <sstream>

#include "bench_common.hpp"

namespace b = ddpkit_bench;
namespace dd = ddpkit::dist;
namespace dp = ddpkit::parallel;

namespace {

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * 1024;

std::vector<int64_t> sweep_sizes(int64_t max_bytes) {
  std::vector<int64_t> s;
  for (int64_t n = kKiB; n <= max_bytes; n *= 4) s.push_back(n);
  if (s.back() != max_bytes) s.push_back(max_bytes);
  return s;
}

/// Median seconds of `op` over `reps` runs after `warmup`, every rank in
/// step (a barrier before each timed run keeps a slow rank's lag out of the
/// next measurement).
template <class Op>
double timed(const dd::Group& g, int warmup, int reps, Op&& op) {
  for (int i = 0; i < warmup; ++i) op();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    dd::barrier(g);
    auto t0 = b::clock::now();
    op();
    t.push_back(b::seconds_since(t0));
  }
  return b::median(t);
}

int reps_for(int64_t bytes, bool quick) {
  int64_t budget = (quick ? 128 : 512) * kMiB;
  return static_cast<int>(
      std::clamp<int64_t>(budget / bytes, 3, quick ? 50 : 200));
}

b::Values bandwidth(const dd::Group& g, const b::Args& a) {
  const auto dev = b::rank_device(g);
  const bool quick = a.has("quick");
  b::Values v;
  for (auto bytes : sweep_sizes(static_cast<int64_t>(a.num("max_bytes")))) {
    auto t = torch::ones({bytes / 4},
                         torch::TensorOptions(torch::kFloat32).device(dev));
    double s = timed(g, 2, reps_for(bytes, quick), [&] {
      dd::all_reduce(g, t);
      b::sync_device(t);
    });
    v["t" + std::to_string(bytes)] = s;
  }
  return v;
}

/// The reducer's bucket sizes (bytes) for `model` at each cap, from a real
/// `Reducer` (with no communication) so the layout is exactly the engine's.
template <class Model>
std::vector<int64_t> bucket_bytes(Model model, double cap_mib) {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (auto& p : model->named_parameters()) {
    names.push_back(p.key());
    params.push_back(p.value());
  }
  dp::Reducer<b::NullComm> r(params, names, dd::Group(),
                             dp::ReducerOptions().bucket_cap_bytes(
                                 static_cast<int64_t>(cap_mib * kMiB)));
  std::vector<int64_t> out;
  for (auto& bk : r.buckets()) out.push_back(bk.flat.numel() * 4);
  return out;
}

b::Values bucketed(const dd::Group& g, const b::Args& a) {
  const auto dev = b::rank_device(g);
  const int reps = a.has("quick") ? 5 : 15;
  const auto model = a.str("model", "resnet18");
  b::Values v;
  int64_t total = 0;
  for (double cap : {1.0, 5.0, 25.0, 100.0}) {
    auto sizes =
        b::with_model(model, [&](auto m) { return bucket_bytes(m, cap); });
    std::vector<torch::Tensor> bufs;
    total = 0;
    for (auto s : sizes) {
      bufs.push_back(torch::ones(
          {s / 4}, torch::TensorOptions(torch::kFloat32).device(dev)));
      total += s;
    }
    double s = timed(g, 2, reps, [&] {
      std::vector<dd::compat::WorkPtr> work;
      for (auto& t : bufs) work.push_back(dd::all_reduce_async(g, t));
      for (auto& w : work) w->wait();
      b::sync_device(bufs.back());
    });
    v["cap" + std::to_string(static_cast<int>(cap))] = s;
    v["buckets" + std::to_string(static_cast<int>(cap))] = double(sizes.size());
  }
  auto flat = torch::ones({total / 4},
                          torch::TensorOptions(torch::kFloat32).device(dev));
  v["flat"] = timed(g, 2, reps, [&] {
    dd::all_reduce(g, flat);
    b::sync_device(flat);
  });
  v["grad_bytes"] = double(total);
  return v;
}

int rank_main(int argc, char** argv) {
  b::Args a(argc, argv);
  torch::set_num_threads(1);
  auto g = dd::Group::init(dd::read_env());
  auto task = a.str("task");
  b::Values v = task == "bandwidth" ? bandwidth(g, a) : bucketed(g, a);
  b::write_values(g, v);
  return 0;
}

/// A sweep runs once, the first time one of its entries needs it.
const b::Values& cached(int world, const std::vector<std::string>& args) {
  static std::map<std::string, b::Values> cache;
  std::string key = std::to_string(world);
  for (auto& s : args) key += " " + s;
  auto it = cache.find(key);
  if (it == cache.end()) {
    std::string err;
    auto v = b::run_world(world, args, &err);
    if (v.empty()) std::fprintf(stderr, "comm_bench: %s\n", err.c_str());
    it = cache.emplace(key, std::move(v)).first;
  }
  return it->second;
}

void register_point(const std::string& name, int world,
                    std::vector<std::string> args, std::string key,
                    int64_t bytes, bool bus) {
  benchmark::RegisterBenchmark(
      name.c_str(),
      [=](benchmark::State& st) {
        for (auto _ : st) {
          const auto& v = cached(world, args);
          if (!v.count(key)) {
            st.SkipWithError("sweep failed");
            break;
          }
          double t = v.at(key);
          st.SetIterationTime(t);
          st.counters["bytes"] = double(bytes);
          st.counters["world"] = world;
          st.counters["algbw_GBps"] = bytes / t / 1e9;
          if (bus)
            st.counters["busbw_GBps"] =
                bytes / t / 1e9 * 2 * (world - 1) / world;
          for (auto& [k, x] : v) {
            if (k.rfind("buckets", 0) == 0 || k == "grad_bytes")
              st.counters[k] = x;
          }
        }
      })
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

void register_all(const b::Args& o) {
  const bool quick = o.has("quick");
  const int64_t max_bytes =
      static_cast<int64_t>(o.num("max-mib", quick ? 64 : 256)) * kMiB;
  std::vector<std::string> q;
  if (quick) q.push_back("--quick");
  for (int w : b::parse_ints(o.str("worlds", "2"))) {
    if (w > b::max_world() || w < 2) continue;
    auto args = q;
    args.push_back("--task=bandwidth");
    args.push_back("--max_bytes=" + std::to_string(max_bytes));
    for (auto bytes : sweep_sizes(max_bytes)) {
      register_point("allreduce/bytes:" + std::to_string(bytes) +
                         "/world:" + std::to_string(w),
                     w, args, "t" + std::to_string(bytes), bytes, true);
    }
  }
  if (b::max_world() >= 2) {
    auto args = q;
    args.push_back("--task=bucketed");
    args.push_back("--model=resnet18");
    auto grad =
        b::with_model("resnet18", [](auto m) { return b::gradient_bytes(*m); });
    for (int cap : {1, 5, 25, 100}) {
      register_point("bucketed_comm/resnet18/cap_mib:" + std::to_string(cap), 2,
                     args, "cap" + std::to_string(cap), grad, false);
    }
    register_point("bucketed_comm/resnet18/flat", 2, args, "flat", grad, false);
  }
}

}  // namespace

// The flight recorder's cost per collective: the entry written at the
// start and closed at the end, as `begin_collective` and `detail::wait` do.
void flight_recorder_cost(benchmark::State& st) {
  dd::FlightRecorder rec(dd::FlightRecorder::kDefaultCapacity, 0, 2, "host");
  auto t = torch::ones({1024});
  dd::CollectiveTag tag("bucket", 3);
  for (auto _ : st) {
    rec.end(rec.start(0, "all_reduce", &t, t.nbytes()));
  }
  st.counters["recorded"] = static_cast<double>(rec.recorded());
}

int main(int argc, char** argv) {
  if (dd::is_spawned_rank()) {
    try {
      return rank_main(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "comm_bench rank: %s\n", e.what());
      return 1;
    }
  }
  auto own = b::take_own_flags(argc, argv, {"quick", "max-mib", "worlds"});
  register_all(own);
  benchmark::RegisterBenchmark("flight_recorder/start_end",
                               flight_recorder_cost);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
