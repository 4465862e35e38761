#include <ddpkit/ddpkit.hpp>
using namespace ddpkit;

struct NetImpl : torch::nn::Module {  // your model
  torch::nn::Linear a{register_module("a", torch::nn::Linear(1, 32))};
  torch::nn::Linear b{register_module("b", torch::nn::Linear(32, 1))};
  torch::Tensor forward(torch::Tensor x) {
    return b(torch::tanh(a(x)));
  }
};
TORCH_MODULE(Net);
struct Sine {  // your data: any type with size() and get(i)
  torch::Tensor x = torch::linspace(-3, 3, 256).unsqueeze(1);
  std::size_t size() const {
    return 256;
  }
  data::Example get(std::size_t i) const {
    return {x[int64_t(i)], torch::sin(x[int64_t(i)])};
  }
};

struct Rmse {  // your task: the loss, sums that add across ranks, metrics
  using task_concept = task_tag;
  static constexpr std::string_view name = "rmse";
  static constexpr std::array<std::string_view, 2> metrics{"loss", "rmse"};
  static constexpr std::size_t num_sums = 2;  // squared errors, elements
  static constexpr train::MonitorSpec monitor{"val_rmse", train::Goal::min};
  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) const {
    return torch::mse_loss(out, y);
  }
  std::array<double, 2> sums(const torch::Tensor&, const torch::Tensor& y,
                             double loss) const {
    return {loss * y.numel(), static_cast<double>(y.numel())};
  }
  std::array<double, 2> finish(const std::array<double, 2>& s) const {
    return {s[0] / s[1], std::sqrt(s[0] / s[1])};
  }
};

int main(int argc, char** argv) {  // DDP on 2 processes it spawns itself
  return dist::launch(argc, argv, 2, [](dist::Group& group) {
    auto adam = [](auto p) { return std::make_unique<torch::optim::Adam>(p); };
    auto options = TrainerOptions()
                       .epochs(90)
                       .lr(0.01)
                       .out_dir("runs/minimal")
                       .overwrite(true);  // each run starts over
    DDPTrainer<Net, PlainBN, NoScaling, ShardedEval, Rmse> trainer(
        Net(), adam, options, group);
    auto result = trainer.fit(Sine{}, Sine{}, data::LoaderOptions(32));
    return result.best_value < 0.1 ? 0 : 1;  // val_rmse under 0.1: learnt
  });
}
