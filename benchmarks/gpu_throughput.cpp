// Training throughput of ddpkit's ResNet-34 on one device, on synthetic
// tensors: the flowers recipe's step (SGD momentum 0.9, weight decay 0.005,
// cross-entropy, 5 classes) through ddpkit's SingleDevice engine, in float32,
// 16-mixed (float16 autocast and ddpkit's LossScaler; --amp is its alias) or
// bf16-mixed (bfloat16 autocast, no scaler), NCHW or channels-last (model
// and inputs). The PyTorch twin is scripts/gpu_pytorch_baseline.py;
// scripts/gpu-check.sh runs both.
//
//   ddpkit_gpu_throughput [--device cuda|cpu] [--image-size 224]
//                         [--batch-size 64] [--steps 40] [--warmup 10]
//                         [--precision 32|16-mixed|bf16-mixed] [--amp]
//                         [--channels-last] [--optimizer sgd|adamw]
//                         [--foreach]
//
// --optimizer adamw: AdamW (lr 1e-3, weight decay 0.01, the char LM's) in
// place of the recipe's SGD. --foreach (alias --foreach-sgd): ddpkit's
// multi-tensor version (ForeachSGD, ForeachAdamW) in place of libtorch's
// optimizer (a loop over the parameters).
//
// Prints one JSON object: {"impl":"ddpkit","data":"tensors",...,"img_per_s":N}.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include <ddpkit/ddpkit.hpp>

namespace {

int arg_int(int argc, char** argv, const char* name, int dflt) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) {
      char* end = nullptr;
      const long v = std::strtol(argv[i + 1], &end, 10);
      if (*end != '\0' || v <= 0) {
        std::fprintf(stderr, "error: %s '%s' must be a positive integer\n",
                     name, argv[i + 1]);
        std::exit(2);
      }
      return static_cast<int>(v);
    }
  }
  return dflt;
}

bool has_flag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return true;
  return false;
}

std::string arg_str(int argc, char** argv, const char* name, const char* dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return dflt;
}

void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string device_name = arg_str(argc, argv, "--device", "cuda");
  if (device_name != "cuda" && device_name != "cpu") {
    std::fprintf(stderr, "error: --device '%s' must be cuda or cpu\n",
                 device_name.c_str());
    return 2;
  }
  const std::string precision = has_flag(argc, argv, "--amp")
                                    ? std::string("16-mixed")
                                    : arg_str(argc, argv, "--precision", "32");
  if (precision != "32" && precision != "16-mixed" &&
      precision != "bf16-mixed") {
    std::fprintf(stderr,
                 "error: --precision '%s' must be 32, 16-mixed or bf16-mixed\n",
                 precision.c_str());
    return 2;
  }
  const bool amp = precision == "16-mixed";
  const bool bf16 = precision == "bf16-mixed";
  const bool channels_last = has_flag(argc, argv, "--channels-last");
  const bool foreach = has_flag(argc, argv, "--foreach") ||
                       has_flag(argc, argv, "--foreach-sgd");
  const std::string optimizer = arg_str(argc, argv, "--optimizer", "sgd");
  if (optimizer != "sgd" && optimizer != "adamw") {
    std::fprintf(stderr, "error: --optimizer '%s' must be sgd or adamw\n",
                 optimizer.c_str());
    return 2;
  }
  const auto layout = channels_last ? at::MemoryFormat::ChannelsLast
                                    : at::MemoryFormat::Contiguous;
  if (device_name == "cuda" && !torch::cuda::is_available()) {
    std::fprintf(stderr,
                 "error: --device cuda, but no CUDA device is visible\n");
    return 2;
  }
  if (amp && device_name != "cuda") {
    std::fprintf(stderr, "error: --precision 16-mixed needs --device cuda\n");
    return 2;
  }
  const torch::Device device(device_name == "cuda" ? torch::kCUDA
                                                   : torch::kCPU);
  const int size = arg_int(argc, argv, "--image-size", 224);
  const int batch = arg_int(argc, argv, "--batch-size", 64);
  const int steps = arg_int(argc, argv, "--steps", 40);
  const int warmup = arg_int(argc, argv, "--warmup", 10);

  torch::manual_seed(0);
  using Engine = ddpkit::parallel::SingleDevice::engine<ddpkit::nn::ResNet>;
  Engine engine(ddpkit::nn::resnet34(5), ddpkit::dist::Group(), {}, device);
  auto& model = ddpkit::parallel::as_module(engine.module());
  model.train();
  if (channels_last) ddpkit::parallel::to_memory_format(model, layout);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (optimizer == "sgd") {
    const auto o =
        torch::optim::SGDOptions(0.001).momentum(0.9).weight_decay(0.005);
    if (foreach) {
      opt =
          std::make_unique<ddpkit::parallel::ForeachSGD>(model.parameters(), o);
    } else {
      opt = std::make_unique<torch::optim::SGD>(model.parameters(), o);
    }
  } else {
    const auto o = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
    if (foreach) {
      opt = std::make_unique<ddpkit::parallel::ForeachAdamW>(model.parameters(),
                                                             o);
    } else {
      opt = std::make_unique<torch::optim::AdamW>(model.parameters(), o);
    }
  }
  ddpkit::parallel::LossScaler scaler;
  const ddpkit::dist::Group solo;
  // A few distinct batches already on the device: the step, not the input
  // pipeline, is measured here.
  std::vector<torch::Tensor> xs, ys;
  for (int k = 0; k < 4; ++k) {
    xs.push_back(
        torch::randn({batch, 3, size, size}, device).contiguous(layout));
    ys.push_back(torch::randint(
        0, 5, {batch},
        torch::TensorOptions().dtype(torch::kLong).device(device)));
  }
  auto ce = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(out.to(torch::kFloat32), y);
  };
  auto step = [&](int i) {
    engine.zero_grad();
    const auto& x = xs[static_cast<std::size_t>(i) % xs.size()];
    const auto& y = ys[static_cast<std::size_t>(i) % ys.size()];
    if (amp) {
      const double scale = scaler.scale();
      {
        ddpkit::compat::AutocastGuard autocast(true, torch::kHalf);
        engine.forward_backward(
            x, y, [&](const torch::Tensor& o, const torch::Tensor& t) {
              return ce(o, t) * scale;
            });
      }
      if (scaler.unscale_and_check(model.parameters(), solo, false))
        opt->step();
    } else if (bf16) {
      {
        ddpkit::compat::AutocastGuard autocast(ddpkit::compat::AutocastState{
            true, torch::kBFloat16, device.type()});
        engine.forward_backward(x, y, ce);
      }
      opt->step();
    } else {
      engine.forward_backward(x, y, ce);
      opt->step();
    }
  };
  for (int i = 0; i < warmup; ++i) step(i);
  sync(device);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step(i);
  sync(device);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  std::printf(
      "{\"impl\":\"ddpkit\",\"data\":\"tensors\",\"mode\":\"%s\","
      "\"layout\":\"%s\",\"optimizer\":\"%s\",\"sgd\":\"%s\",\"device\":\"%s\","
      "\"image_size\":%d,"
      "\"batch_size\":%d,"
      "\"steps\":%d,"
      "\"seconds\":%.4f,\"img_per_s\":%.1f,\"torch\":\"%s\"}\n",
      amp    ? "amp"
      : bf16 ? "bf16"
             : "fp32",
      channels_last ? "channels-last" : "contiguous", optimizer.c_str(),
      foreach ? "foreach" : "loop", device_name.c_str(), size, batch, steps,
      secs, steps * batch / secs, ddpkit::compat::torch_version().c_str());
  return 0;
}
