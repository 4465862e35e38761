// Uses a little of every layer through the umbrella header.
#include <ddpkit/ddpkit.hpp>

#include <cstdio>

int main() {
  auto env = ddpkit::dist::read_env();
  ddpkit::dist::Group group;  // a world of one
  auto t = torch::ones({2});
  ddpkit::dist::all_reduce(group, t);
  ddpkit::DistributedSampling sampler(10, {.rank = 0, .world_size = 2});
  auto model = ddpkit::nn::resnet18(10);
  std::printf("ddpkit consumer: rank %d, shard %zu, %lld parameters\n",
              env.rank, sampler.size(),
              static_cast<long long>(ddpkit::nn::count_parameters(*model)));
  return sampler.size() == 5 ? 0 : 1;
}
