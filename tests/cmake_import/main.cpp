// Uses a little of every layer through the umbrella header.
#include <ddpkit/ddpkit.hpp>

#include <torch/version.h>

#include <cstdio>

int main() {
  auto env = ddpkit::dist::read_env();
  ddpkit::dist::Group group;  // a world of one
  auto t = torch::ones({2});
  ddpkit::dist::all_reduce(group, t);
  ddpkit::DistributedSampling sampler(10, {.rank = 0, .world_size = 2});
  auto model = ddpkit::nn::resnet18(10);
  // run.cmake checks the libtorch a find_package(ddpkit) consumer got.
  std::printf(
      "ddpkit consumer: libtorch %s, rank %d, shard %zu, %lld parameters\n",
      TORCH_VERSION, env.rank, sampler.size(),
      static_cast<long long>(ddpkit::nn::count_parameters(*model)));
  return sampler.size() == 5 ? 0 : 1;
}
