// DDP cost and scaling. Each multi-process entry spawns a world of ranks
// (this binary again, one intra-op thread each) that train on a fixed
// random batch; rank 0 reports per-step times and the time spent waiting
// for communication after backward.
//
//   overhead/<model>/world:N/round:R   step at world 2 over world 1 (issue 3)
//   scaling/<model>/world:N            throughput at 1, 2, 4, 8 workers
//   buckets/<model>/cap_mib:C | flat   reducer bucket cap sweep against one
//                                      all-reduce of a flat buffer after
//                                      backward
//   decompose/<model>/world:2/mode:M  world 2 with no communication (bare),
//                                      reducer without sending (ddp_nocomm),
//                                      full DDP, DDP with buckets outside
//                                      shared memory (ddp_copy), flat
//                                      all-reduce
//   local/<kind>/<model>               in one process: bare model, world-1
//                                      engine, reducer hooks without comm
//   order/headfirst/world:2/rebuild:R  a net registered head first: buckets
//                                      in registration order (0) or rebuilt
//                                      in arrival order (1)
//   comm/<model>/world:2/hook:H        communication hooks side by side:
//                                      allreduce, fp16, powersgd (rank 4,
//                                      from the first step); bytes_per_step
//                                      is what the gradient collectives
//                                      carried
//   syncbn/resnet34@64/b16/world:2/bn:B ResNet-34's BatchNorm plain (each
//                                      rank its own statistics) or
//                                      synchronised (SyncBN), side by side,
//                                      max(2, --rounds) pairs
//   precision/<model>/world:2/prec:P/fmt:F  the DDP engine under precision
//                                      32 or bf16-mixed (CPU autocast, as
//                                      the Trainer runs it) and memory
//                                      format contiguous or channels_last,
//                                      with the step's phases (forward,
//                                      backward, gradient wait, optimizer);
//                                      models: ResNet-34 at 64/128/224 px,
//                                      the CIFAR net, the char LM (charlm@T:
//                                      context T, AdamW). Off by default
//                                      (long); benchmarks/precision_bench.py
//                                      runs each entry next to PyTorch's.
//
// Launcher flags (before Google Benchmark's): --quick, --sections=a,b,...
// (overhead, decompose, scaling, buckets, local, order, comm, syncbn;
// precision only when named),
// --rounds=N,
// --round-id=K,
// --worlds=1,2,4,8,
// --op-profile=N (precision: N more steps with the time inside each
// outermost ATen operator measured, as op:<name> ms and calls:<name> per
// step, with in_ops_ms and profiled_step_ms; see op_profile.hpp).
#include <sys/resource.h>

#include <sstream>

#include "../examples/char_lm/char_model.hpp"
#include "bench_common.hpp"
#include "op_profile.hpp"

namespace b = ddpkit_bench;
namespace dp = ddpkit::parallel;
namespace dd = ddpkit::dist;

namespace {

constexpr int64_t kMiB = 1024 * 1024;
constexpr int64_t kClasses = 10;

/// CPU seconds this process has used (every thread: compute, autograd,
/// gloo). Unlike wall time it barely moves when other jobs share the cores.
double cpu_seconds(bool kernel_only = false) {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  double sys = u.ru_stime.tv_sec + 1e-6 * u.ru_stime.tv_usec;
  return kernel_only ? sys
                     : sys + u.ru_utime.tv_sec + 1e-6 * u.ru_utime.tv_usec;
}

torch::Tensor loss_fn(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

struct Batch {
  torch::Tensor x, y;
};

Batch make_batch(const b::Args& a, int rank, torch::Device dev) {
  torch::manual_seed(1234 + rank);
  auto batch = static_cast<int64_t>(a.num("batch", 8));
  auto image = static_cast<int64_t>(a.num("image", 64));
  return {torch::randn({batch, 3, image, image}).to(dev),
          torch::randint(kClasses, {batch}, torch::kLong).to(dev)};
}

torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(),
                           torch::optim::SGDOptions(0.01).momentum(0.9));
}

/// Fills the common result fields from per-step times and waits.
b::Values summarize(const std::vector<double>& steps,
                    const std::vector<double>& waits, int world,
                    const b::Args& a) {
  std::vector<double> frac;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    frac.push_back(i < waits.size() && steps[i] > 0 ? waits[i] / steps[i] : 0);
  }
  const double med = b::median(steps);
  const double batch = a.num("batch", 8);
  return {{"time_s", med},
          {"step_ms", 1e3 * med},
          {"step_ms_mean", 1e3 * b::mean(steps)},
          {"step_ms_min", 1e3 * *std::min_element(steps.begin(), steps.end())},
          {"step_ms_max", 1e3 * *std::max_element(steps.begin(), steps.end())},
          {"wait_ms", 1e3 * b::median(waits)},
          {"wait_frac", b::median(frac)},
          {"images_per_s", world * batch / med},
          {"world", double(world)},
          {"batch", batch},
          {"image", a.num("image", 64)},
          {"steps", double(steps.size())},
          {"cores", double(std::thread::hardware_concurrency())}};
}

/// Timed steps through a DDP-like engine; returns the number of buckets.
template <class Policy, class Model>
double ddp_steps(Model model, const dd::Group& g, const b::Args& a,
                 const Batch& data, int warmup, int steps,
                 std::vector<double>& times, std::vector<double>& waits,
                 double& cpu0, double& sys0, double* bytes = nullptr) {
  const auto dev = b::rank_device(g);
  auto ro = dp::ReducerOptions()
                .bucket_cap_bytes(
                    static_cast<int64_t>(a.num("bucket_mib", 25) * kMiB))
                .first_bucket_cap_bytes(
                    static_cast<int64_t>(a.num("first_bucket_mib", 1) * kMiB))
                .shared_buckets(a.num("shared_buckets", 1) != 0)
                .rebuild_buckets(a.num("rebuild", 1) != 0);
  if (a.num("sync_bn", 0) != 0) ddpkit::nn::convert_sync_batchnorm(*model, g);
  auto comm = dp::CommOptions().powersgd(
      dp::PowerSGDOptions()
          .rank(static_cast<int64_t>(a.num("powersgd_rank", 4)))
          .start_step(0));
  typename Policy::template engine<Model> eng(
      model, g, dp::DDPOptions().reducer(ro).comm(comm), dev);
  auto opt = make_sgd(*eng.module());
  double buckets = eng.reducer() ? double(eng.reducer()->buckets().size()) : 0;
  dd::barrier(g);
  for (int i = 0; i < warmup + steps; ++i) {
    auto t0 = b::clock::now();
    opt.zero_grad();
    auto out = eng.forward_backward(data.x, data.y, loss_fn);
    opt.step();
    b::sync_device(out.loss);
    double dt = b::seconds_since(t0);
    if (i == warmup - 1) {
      cpu0 = cpu_seconds();
      sys0 = cpu_seconds(true);
    }
    if (i >= warmup) {
      times.push_back(dt);
      waits.push_back(eng.last_wait_seconds());
    }
  }
  if (bytes) *bytes = static_cast<double>(eng.last_step_bytes());
  return buckets;
}

/// Rank task `train`, `--mode=`: `ddp` (the DDP engine), `ddp_nocomm` (the
/// engine with a strategy that sends nothing), `flat` (the bare model, then
/// one all-reduce of all gradients as a flat buffer, in shared memory like
/// the reducer's buckets), `bare` (the bare model
/// in every rank, no communication).
template <class Model>
b::Values train(Model model, const dd::Group& g, const b::Args& a) {
  const auto dev = b::rank_device(g);
  const int warmup = static_cast<int>(a.num("warmup", 3));
  const int steps = static_cast<int>(a.num("steps", 10));
  const auto mode = a.str("mode", "ddp");
  auto data = make_batch(a, g.rank(), dev);
  std::vector<double> times, waits;
  double cpu0 = 0, sys0 = 0;
  int64_t grad_bytes = b::gradient_bytes(*model);
  double buckets = 0, bytes = -1;

  if (mode == "ddp") {
    buckets = ddp_steps<dp::DDP>(model, g, a, data, warmup, steps, times, waits,
                                 cpu0, sys0, &bytes);
  } else if (mode == "ddp_fp16") {
    buckets = ddp_steps<dp::DDPFp16>(model, g, a, data, warmup, steps, times,
                                     waits, cpu0, sys0, &bytes);
  } else if (mode == "ddp_powersgd") {
    buckets = ddp_steps<dp::DDPPowerSGD>(model, g, a, data, warmup, steps,
                                         times, waits, cpu0, sys0, &bytes);
  } else if (mode == "ddp_nocomm") {
    buckets = ddp_steps<dp::BasicDDP<b::NullComm>>(
        model, g, a, data, warmup, steps, times, waits, cpu0, sys0);
  } else if (mode == "flat" || mode == "bare") {
    // bare: the model alone in every rank, no communication at all (what
    // sharing the machine with the other ranks costs by itself).
    const bool comm = mode == "flat";
    model->to(dev);
    std::vector<torch::Tensor> params;
    for (auto& p : model->parameters()) params.push_back(p);
    for (auto& p : params) {  // same start everywhere, like the engine
      torch::NoGradGuard ng;
      dd::broadcast(g, p, 0);
    }
    auto opt = make_sgd(*model);
    int64_t numel = 0;
    for (auto& p : params) numel += p.numel();
    // Like the reducer's buckets, the flat buffer lives in shared memory
    // when the ranks share a host (reduced in place), so the two compare
    // the same transport.
    torch::Tensor flat;
    if (comm && g.shm() && a.num("shared_buckets", 1) != 0) {
      flat = g.shm()->shared_buffer(numel, params[0].scalar_type());
    }
    if (!flat.defined()) flat = torch::zeros({numel}, params[0].options());
    dd::barrier(g);
    for (int i = 0; i < warmup + steps; ++i) {
      auto t0 = b::clock::now();
      opt.zero_grad();
      auto loss = loss_fn(model->forward(data.x), data.y);
      loss.backward();
      auto tw = b::clock::now();
      if (comm) {
        torch::NoGradGuard ng;
        int64_t off = 0;
        for (auto& p : params) {
          flat.narrow(0, off, p.numel()).view_as(p).copy_(p.grad());
          off += p.numel();
        }
        flat.div_(g.size());
        dd::all_reduce(g, flat);
        off = 0;
        for (auto& p : params) {
          p.mutable_grad().copy_(flat.narrow(0, off, p.numel()).view_as(p));
          off += p.numel();
        }
      }
      double wait = b::seconds_since(tw);
      opt.step();
      b::sync_device(loss);
      double dt = b::seconds_since(t0);
      if (i == warmup - 1) {
        cpu0 = cpu_seconds();
        sys0 = cpu_seconds(true);
      }
      if (i >= warmup) {
        times.push_back(dt);
        waits.push_back(wait);
      }
    }
    buckets = comm ? 1 : 0;
  } else {
    throw std::runtime_error("unknown --mode=" + mode);
  }
  auto v = summarize(times, waits, g.size(), a);
  v["cpu_ms_per_step"] = 1e3 * (cpu_seconds() - cpu0) / times.size();
  v["sys_ms_per_step"] = 1e3 * (cpu_seconds(true) - sys0) / times.size();
  v["grad_bytes"] = double(grad_bytes);
  v["buckets"] = buckets;
  if (bytes >= 0) v["bytes_per_step"] = bytes;
  return v;
}

// ---- precision and memory layout ----

constexpr int64_t kCharVocab = 96;  // printable ASCII and newline, about

/// Rank task `--mode=precision`: the DDP engine on a fixed random batch,
/// the way the Trainer runs a step: under CPU autocast to bfloat16 when
/// `--bf16=1` (the loss in float32), with the model's 4-D parameters and
/// buffers and the batch in channels-last when `--channels_last=1`.
/// SGD(0.01, momentum 0.9), or AdamW(3e-3, weight decay 0.01) for the
/// char LM (`--lm=1`: input and target B×T tokens, cross entropy over
/// every position). Per step: forward (to the loss), backward (including
/// the wait for the last gradient bucket), that wait, the optimizer.
template <class Model>
b::Values precision_train(Model model, const dd::Group& g, const b::Args& a) {
  const auto dev = b::rank_device(g);
  const int warmup = static_cast<int>(a.num("warmup", 2));
  const int steps = static_cast<int>(a.num("steps", 6));
  const bool bf16 = a.num("bf16", 0) != 0;
  const bool lm = a.num("lm", 0) != 0;
  const bool cl = a.num("channels_last", 0) != 0;
  const auto batch = static_cast<int64_t>(a.num("batch", 16));
  const auto image = static_cast<int64_t>(a.num("image", 64));
  torch::manual_seed(1234 + g.rank());
  torch::Tensor x, y;
  if (lm) {
    x = torch::randint(kCharVocab, {batch, image}, torch::kLong);
    y = torch::randint(kCharVocab, {batch, image}, torch::kLong);
  } else {
    x = torch::randn({batch, 3, image, image});
    y = torch::randint(kClasses, {batch}, torch::kLong);
  }
  if (cl) {
    ddpkit::parallel::to_memory_format(ddpkit::parallel::as_module(model),
                                       torch::MemoryFormat::ChannelsLast);
    x = x.contiguous(torch::MemoryFormat::ChannelsLast);
  }
  x = x.to(dev);
  y = y.to(dev);
  dp::DDP::engine<Model> eng(model, g, dp::DDPOptions(), dev);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (lm) {
    opt = std::make_unique<torch::optim::AdamW>(
        eng.module()->parameters(),
        torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  } else {
    opt = std::make_unique<torch::optim::SGD>(
        eng.module()->parameters(),
        torch::optim::SGDOptions(0.01).momentum(0.9));
  }
  const ddpkit::compat::AutocastState on{true, torch::kBFloat16, dev.type()};
  std::vector<double> times, waits, fwd, bwd, optim;
  b::clock::time_point forward_end;
  auto loss = [&](const torch::Tensor& out, const torch::Tensor& target) {
    forward_end = b::clock::now();
    auto o = out.to(torch::kFloat32);
    if (lm) {
      return torch::nn::functional::cross_entropy(o.reshape({-1, o.size(-1)}),
                                                  target.reshape(-1));
    }
    return torch::nn::functional::cross_entropy(o, target);
  };
  b::clock::time_point t1;
  auto one_step = [&] {
    opt->zero_grad();
    ddpkit::parallel::StepOutput out;
    if (bf16) {
      ddpkit::compat::AutocastGuard guard(on);
      out = eng.forward_backward(x, y, loss);
    } else {
      out = eng.forward_backward(x, y, loss);
    }
    t1 = b::clock::now();
    opt->step();
    b::sync_device(out.loss);
  };
  dd::barrier(g);
  for (int i = 0; i < warmup + steps; ++i) {
    auto t0 = b::clock::now();
    one_step();
    auto t2 = b::clock::now();
    if (i >= warmup) {
      times.push_back(std::chrono::duration<double>(t2 - t0).count());
      waits.push_back(eng.last_wait_seconds());
      fwd.push_back(std::chrono::duration<double>(forward_end - t0).count());
      bwd.push_back(std::chrono::duration<double>(t1 - forward_end).count());
      optim.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
  }
  auto v = summarize(times, waits, g.size(), a);
  v["forward_ms"] = 1e3 * b::median(fwd);
  v["backward_ms"] = 1e3 * b::median(bwd);
  v["optimizer_ms"] = 1e3 * b::median(optim);
  // --op_profile=N: N more steps with every rank's operators timed (the
  // timed steps above run without the callback).
  if (const int n = static_cast<int>(a.num("op_profile", 0)); n > 0) {
    dd::barrier(g);
    b::OpProfile prof;
    const auto t0 = b::clock::now();
    for (int i = 0; i < n; ++i) one_step();
    const double total =
        std::chrono::duration<double>(b::clock::now() - t0).count();
    double in_ops = 0;
    for (const auto& [name, sc] : prof.ops()) {  // aten:: names: one word
      v["op:" + name] = 1e3 * sc.first / n;
      v["calls:" + name] = double(sc.second) / n;
      in_ops += sc.first;
    }
    v["profiled_steps"] = n;
    v["profiled_step_ms"] = 1e3 * total / n;
    v["in_ops_ms"] = 1e3 * in_ops / n;
  }
  if (lm) v["tokens_per_s"] = v["images_per_s"] * static_cast<double>(image);
  return v;
}

int rank_main(int argc, char** argv) {
  b::Args a(argc, argv);
  torch::set_num_threads(static_cast<int>(a.num("threads", 1)));
  auto g = dd::Group::init(dd::read_env());
  if (a.str("mode", "ddp") == "precision") {
    const auto name = a.str("model", "resnet34");
    b::Values v;
    if (name == "charlm") {
      v = precision_train(
          char_lm::CharTransformer(
              char_lm::CharTransformerOptions(kCharVocab)
                  .context(static_cast<int64_t>(a.num("image", 64)))),
          g, a);
    } else {
      v = b::with_model(
          name, [&](auto m) { return precision_train(std::move(m), g, a); });
    }
    b::write_values(g, v);
    return 0;
  }
  auto v = b::with_model(a.str("model", "resnet18"),
                         [&](auto m) { return train(std::move(m), g, a); });
  b::write_values(g, v);
  return 0;
}

// ---- in-process entries (real Google Benchmark loops) ----

enum class Local { bare, engine_world1, reducer_no_comm };

template <class Model>
void local_step(benchmark::State& st, Model model, Local kind,
                const b::ModelSpec& spec) {
  torch::set_num_threads(1);
  b::Args a(0, nullptr);
  torch::manual_seed(1);
  auto x = torch::randn({spec.batch, 3, spec.image, spec.image});
  auto y = torch::randint(kClasses, {spec.batch}, torch::kLong);
  auto run = [&](auto&& step) {
    for (int i = 0; i < 2; ++i) step();  // warm-up
    for (auto _ : st) step();
    st.counters["images_per_s"] = benchmark::Counter(
        double(st.iterations() * spec.batch), benchmark::Counter::kIsRate);
  };
  if (kind == Local::engine_world1) {
    dp::DDP::engine<Model> eng(model, dd::Group(), dp::DDPOptions(),
                               torch::kCPU);
    st.counters["has_reducer"] = eng.reducer() != nullptr;
    auto opt = make_sgd(*eng.module());
    run([&] {
      opt.zero_grad();
      eng.forward_backward(x, y, loss_fn);
      opt.step();
    });
    return;
  }
  auto opt = make_sgd(*model);
  std::unique_ptr<dp::Reducer<b::NullComm>> reducer;
  if (kind == Local::reducer_no_comm) {
    std::vector<torch::Tensor> params;
    std::vector<std::string> names;
    for (auto& p : model->named_parameters()) {
      names.push_back(p.key());
      params.push_back(p.value());
    }
    reducer =
        std::make_unique<dp::Reducer<b::NullComm>>(params, names, dd::Group());
    st.counters["buckets"] = double(reducer->buckets().size());
  }
  run([&] {
    opt.zero_grad();
    loss_fn(model->forward(x), y).backward();
    opt.step();
  });
}

bool wants(const std::string& sections, const std::string& s) {
  return sections == "all" ||
         ("," + sections + ",").find("," + s + ",") != std::string::npos;
}

std::string itos(double x) {
  return std::to_string(static_cast<long long>(x));
}

void register_all(const b::Args& o) {
  const bool quick = o.has("quick");
  const auto sections = o.str("sections", "all");
  const int rounds = static_cast<int>(o.num("rounds", quick ? 1 : 3));
  const int round0 = static_cast<int>(o.num("round-id", 1));
  // Step counts are per world; cifarnet steps are short, so it gets more.
  auto steps_for = [&](const std::string& model, bool scaling,
                       int64_t image = 64) {
    int s = model == "cifarnet" ? 40 : (image > 64 ? 6 : 12);
    if (scaling) s = model == "cifarnet" ? 20 : 5;
    if (!quick) s *= 2;
    return std::vector<std::string>{"--steps=" + std::to_string(s),
                                    "--warmup=3"};
  };
  auto cat = [](std::vector<std::string> a, const std::vector<std::string>& c) {
    a.insert(a.end(), c.begin(), c.end());
    return a;
  };
  const std::vector<b::ModelSpec> overhead_models{{"resnet18", 64, 8},
                                                  {"cifarnet", 32, 32}};
  const std::vector<b::ModelSpec> scaling_models{{"resnet34", 64, 8},
                                                 {"cifarnet", 32, 32}};

  if (wants(sections, "overhead")) {
    // ResNet-18 twice: @64/b8 is the stress setting (45 MB of gradients per
    // ~150 ms of compute), @96/b16 has 4.5x the compute per byte sent.
    auto models = overhead_models;
    models.push_back({"resnet18", 96, 16});
    for (int r = round0; r < round0 + rounds; ++r) {
      for (auto& m : models) {
        for (int w : {1, 2}) {
          if (w > b::max_world()) continue;
          b::register_world("overhead/" + m.label() +
                                "/world:" + std::to_string(w) +
                                "/round:" + std::to_string(r),
                            w, cat(m.args(), steps_for(m.name, false, m.image)),
                            b::all_counters);
        }
      }
    }
  }
  if (wants(sections, "decompose")) {
    // Where world 2's extra time goes: two ranks computing side by side
    // (bare), plus the reducer's hooks and copies (ddp_nocomm), plus
    // communication (ddp).
    for (auto& m : overhead_models) {
      for (auto mode : {"bare", "ddp_nocomm", "ddp", "ddp_copy", "flat"}) {
        // ddp_copy: DDP with the buckets in ordinary memory, copied through
        // the shared-memory channel (ReducerOptions::shared_buckets(false)).
        const bool copy = std::string(mode) == "ddp_copy";
        b::register_world(
            "decompose/" + m.label() + "/world:2/mode:" + mode, 2,
            cat(cat(m.args(), steps_for(m.name, false)),
                {std::string("--mode=") + (copy ? "ddp" : mode),
                 copy ? "--shared_buckets=0" : "--shared_buckets=1"}),
            b::all_counters);
      }
    }
  }
  if (wants(sections, "buckets")) {
    b::ModelSpec m{"resnet18", 64, 8};
    for (double cap : {1, 5, 25, 100}) {
      b::register_world(
          "buckets/" + m.label() + "/cap_mib:" + itos(cap), 2,
          cat(cat(m.args(), steps_for(m.name, false)),
              {"--mode=ddp", "--bucket_mib=" + std::to_string(cap)}),
          b::all_counters);
    }
    b::register_world(
        "buckets/" + m.label() + "/flat", 2,
        cat(cat(m.args(), steps_for(m.name, false)), {"--mode=flat"}),
        b::all_counters);
  }
  if (wants(sections, "order")) {
    // Learned bucket order: the same net, world 2, side by side.
    for (int round = 0; round < 2; ++round) {
      for (int rebuild : {0, 1}) {
        b::register_world(
            "order/headfirst@64/b16/world:2/rebuild:" +
                std::to_string(rebuild) + "/round:" + std::to_string(round + 1),
            2,
            {"--model=headfirst", "--image=64", "--batch=16", "--bucket_mib=1",
             "--first_bucket_mib=1", quick ? "--steps=12" : "--steps=24",
             "--warmup=3", "--rebuild=" + std::to_string(rebuild)},
            b::all_counters);
      }
    }
  }
  if (wants(sections, "comm")) {
    // Communication hooks, the same net and batch, world 2, interleaved.
    b::ModelSpec m{"resnet18", 64, 8};
    for (int round = 0; round < 2; ++round) {
      for (auto hook : {"allreduce", "fp16", "powersgd"}) {
        const std::string h = hook;
        b::register_world(
            "comm/" + m.label() + "/world:2/hook:" + h +
                "/round:" + std::to_string(round + 1),
            2,
            cat(cat(m.args(), steps_for(m.name, false)),
                {"--mode=" + std::string(h == "allreduce" ? "ddp" : "ddp_" + h),
                 "--powersgd_rank=4"}),
            b::all_counters);
      }
    }
  }
  if (wants(sections, "syncbn")) {
    // SyncBN's cost (issue 14's setting: flowers' ResNet-34 at 64 px, batch
    // 16 per rank, world 2, one thread per rank), plain and synchronised
    // BatchNorm interleaved.
    // --rounds=N pairs (at least 2).
    b::ModelSpec m{"resnet34", 64, 16};
    for (int round = 0; round < std::max(rounds, 2); ++round) {
      for (int sync : {0, 1}) {
        b::register_world(
            "syncbn/" + m.label() +
                "/world:2/bn:" + std::string(sync ? "sync" : "plain") +
                "/round:" + std::to_string(round + 1),
            2,
            cat(m.args(), {quick ? "--steps=6" : "--steps=12", "--warmup=2",
                           "--mode=ddp", "--sync_bn=" + std::to_string(sync)}),
            b::all_counters);
      }
    }
  }
  if (("," + sections + ",").find(",precision,") != std::string::npos) {
    // Not in "all": ResNet-34 at 224 px takes minutes. Each entry once;
    // benchmarks/precision_bench.py alternates them with PyTorch's.
    const std::vector<b::ModelSpec> models{{"resnet34", 64, 16},
                                           {"resnet34", 128, 16},
                                           {"resnet34", 224, 16},
                                           {"cifarnet", 32, 64},
                                           {"charlm", 64, 32}};
    for (auto& m : models) {
      const bool lm = m.name == "charlm";
      const int s = lm || m.name == "cifarnet" ? 20
                    : m.image >= 224           ? 4
                    : m.image >= 128           ? 6
                                               : 10;
      for (int bf16 : {0, 1}) {
        for (int cl : {0, 1}) {
          if (lm && cl) continue;  // no 4-D tensors
          b::register_world(
              "precision/" + m.label() +
                  "/world:2/prec:" + (bf16 ? "bf16-mixed" : "32") +
                  "/fmt:" + (cl ? "channels_last" : "contiguous"),
              2,
              cat(m.args(), {"--mode=precision",
                             "--steps=" + std::to_string(quick ? 2 : s),
                             "--warmup=2", "--bf16=" + std::to_string(bf16),
                             "--channels_last=" + std::to_string(cl),
                             "--lm=" + std::to_string(lm ? 1 : 0),
                             "--op_profile=" + itos(o.num("op-profile", 0))}),
              b::all_counters);
        }
      }
    }
  }
  if (wants(sections, "scaling")) {
    for (auto& m : scaling_models) {
      for (int w : b::parse_ints(o.str("worlds", "1,2,4,8"))) {
        if (w > b::max_world()) continue;
        b::register_world(
            "scaling/" + m.label() + "/world:" + std::to_string(w), w,
            cat(m.args(), steps_for(m.name, true)), b::all_counters);
      }
    }
  }
  if (wants(sections, "local")) {
    for (auto& m : overhead_models) {
      for (auto [kind, label] :
           {std::pair{Local::bare, "bare"},
            std::pair{Local::engine_world1, "ddp_engine_world1"},
            std::pair{Local::reducer_no_comm, "reducer_hooks_no_comm"}}) {
        benchmark::RegisterBenchmark(
            ("local/" + std::string(label) + "/" + m.label()).c_str(),
            [kind = kind, m](benchmark::State& st) {
              b::with_model(m.name, [&](auto model) {
                local_step(st, std::move(model), kind, m);
                return 0;
              });
            })
            ->Unit(benchmark::kMillisecond)
            ->MinTime(quick ? 0.5 : 2.0)
            ->UseRealTime();
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (ddpkit::dist::is_spawned_rank()) {
    try {
      return rank_main(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddp_bench rank: %s\n", e.what());
      return 1;
    }
  }
  auto own = b::take_own_flags(
      argc, argv,
      {"quick", "sections", "rounds", "round-id", "worlds", "op-profile"});
  if (const auto n = own.str("op-profile", "0");
      n.empty() || n.find_first_not_of("0123456789") != std::string::npos) {
    std::fprintf(stderr,
                 "ddp_bench: --op-profile=%s: expected a number of steps (an "
                 "integer >= 0)\n",
                 n.c_str());
    return 2;
  }
  register_all(own);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
