// Samplers: PyTorch's DistributedSampler semantics, evaluation sharding,
// determinism across processes, libtorch data-loader compatibility.
#include <algorithm>
#include <fstream>
#include <numeric>
#include <set>

#include "../support.hpp"
#include "ddpkit/data/samplers.hpp"

using namespace ddpkit;
using data::DistributedSampling;
using data::ShardSpec;

namespace {

std::vector<std::size_t> all_of(auto& s, std::size_t batch = 3) {
  std::vector<std::size_t> out;
  while (auto b = s.next(batch)) out.insert(out.end(), b->begin(), b->end());
  return out;
}

}  // namespace

static_assert(sampler_policy<data::SequentialSampling>);
static_assert(sampler_policy<data::RandomSampling>);
static_assert(sampler_policy<DistributedSampling>);
static_assert(sharding_sampler<DistributedSampling>);
static_assert(!sharding_sampler<data::RandomSampling>);

TEST_SUITE("samplers") {
  TEST_CASE("DistributedSampling: shards cover the dataset, equal length") {
    for (std::size_t n : {10u, 11u, 16u, 3u}) {
      for (int w : {2, 3, 4}) {
        CAPTURE(n);
        CAPTURE(w);
        std::multiset<std::size_t> seen;
        std::set<std::size_t> lengths;
        for (int r = 0; r < w; ++r) {
          DistributedSampling s(n, {.rank = r, .world_size = w, .seed = 1});
          s.set_epoch(2);
          auto idx = all_of(s);
          lengths.insert(idx.size());
          seen.insert(idx.begin(), idx.end());
        }
        CHECK(lengths.size() == 1);
        CHECK(*lengths.begin() == (n + w - 1) / w);
        std::set<std::size_t> unique(seen.begin(), seen.end());
        CHECK(unique.size() == n);                    // every sample appears
        CHECK(seen.size() == ((n + w - 1) / w) * w);  // padded by repeats
      }
    }
  }

  TEST_CASE("DistributedSampling: drop_last gives disjoint shards") {
    const std::size_t n = 11;
    const int w = 4;
    std::set<std::size_t> seen;
    std::size_t total = 0;
    for (int r = 0; r < w; ++r) {
      DistributedSampling s(n, {.rank = r, .world_size = w, .drop_last = true});
      auto idx = all_of(s);
      CHECK(idx.size() == n / w);
      total += idx.size();
      seen.insert(idx.begin(), idx.end());
    }
    CHECK(seen.size() == total);  // disjoint
  }

  TEST_CASE(
      "DistributedSampling: padding repeats the head of the permutation") {
    // 5 samples over 4 ranks: total 8, the last 3 are the first 3 again.
    std::vector<std::size_t> global(8);
    for (int r = 0; r < 4; ++r) {
      DistributedSampling s(5, {.rank = r, .world_size = 4},
                            data::DistributedSamplingOptions().shuffle(false));
      auto idx = all_of(s);
      for (std::size_t k = 0; k < idx.size(); ++k) global[r + 4 * k] = idx[k];
    }
    CHECK(global == std::vector<std::size_t>{0, 1, 2, 3, 4, 0, 1, 2});
  }

  TEST_CASE("DistributedSampling: set_epoch reshuffles, same seed same order") {
    DistributedSampling a(100, {.rank = 0, .world_size = 2, .seed = 7});
    DistributedSampling b(100, {.rank = 0, .world_size = 2, .seed = 7});
    a.set_epoch(0);
    b.set_epoch(0);
    CHECK(a.indices() == b.indices());
    auto first = a.indices();
    a.set_epoch(1);
    CHECK(a.indices() != first);
    b.set_epoch(1);
    CHECK(a.indices() == b.indices());
    DistributedSampling c(100, {.rank = 0, .world_size = 2, .seed = 8});
    c.set_epoch(1);
    CHECK(c.indices() != a.indices());
  }

  TEST_CASE("seeded permutation equals Python's torch.randperm") {
    // Printed by Debian's python3-torch 1.13.1:
    //   g = torch.Generator(); g.manual_seed(5); torch.randperm(10,
    //   generator=g) g.manual_seed(45); torch.randperm(12, generator=g)
    // so a Python DistributedSampler and ours shuffle alike.
    CHECK(data::detail::seeded_permutation(10, 5) ==
          std::vector<std::size_t>{1, 4, 9, 6, 3, 5, 0, 2, 8, 7});
    CHECK(data::detail::seeded_permutation(12, 45) ==
          std::vector<std::size_t>{11, 6, 3, 0, 4, 5, 7, 10, 2, 1, 8, 9});
  }

  TEST_CASE("evaluation mode counts every sample exactly once") {
    for (std::size_t n : {10u, 11u, 13u}) {
      for (int w : {2, 3, 4}) {
        std::vector<int> count(n, 0);
        for (int r = 0; r < w; ++r) {
          DistributedSampling s(
              n, {.rank = r, .world_size = w},
              data::DistributedSamplingOptions().evaluation(true));
          for (auto i : all_of(s)) ++count[i];
        }
        CHECK(std::all_of(count.begin(), count.end(),
                          [](int c) { return c == 1; }));
      }
    }
  }

  TEST_CASE("Sequential and Random samplers") {
    data::SequentialSampling seq(5);
    CHECK(all_of(seq) == std::vector<std::size_t>{0, 1, 2, 3, 4});
    data::RandomSampling r1(50, {.seed = 3}), r2(50, {.seed = 3});
    CHECK(r1.indices() == r2.indices());
    auto before = r1.indices();
    r1.set_epoch(1);
    CHECK(r1.indices() != before);
    auto sorted = r1.indices();
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::size_t> iota(50);
    std::iota(iota.begin(), iota.end(), 0);
    CHECK(sorted == iota);
  }

  TEST_CASE("samplers save and load their position") {
    DistributedSampling s(20, {.rank = 1, .world_size = 2, .seed = 4});
    s.set_epoch(3);
    s.next(4);
    torch::serialize::OutputArchive out;
    s.save(out);
    test::TempDir dir;
    out.save_to((dir / "s.pt").string());
    DistributedSampling t(20, {.rank = 1, .world_size = 2, .seed = 4});
    torch::serialize::InputArchive in;
    in.load_from((dir / "s.pt").string());
    t.load(in);
    CHECK(t.epoch() == 3);
    CHECK(t.next(100) == s.next(100));
  }

  TEST_CASE("samplers plug into torch::data::make_data_loader") {
    auto ds =
        torch::data::datasets::TensorDataset(torch::arange(10).view({10, 1}))
            .map(torch::data::transforms::Stack<torch::data::TensorExample>());
    auto loader = torch::data::make_data_loader(
        std::move(ds), DistributedSampling(10, {.rank = 1, .world_size = 2}),
        torch::data::DataLoaderOptions().batch_size(2));
    int64_t seen = 0;
    for (auto& batch : *loader) seen += batch.data.size(0);
    CHECK(seen == 5);
  }

}  // TEST_SUITE("samplers")

// Identical across real processes: each rank writes its shard for epoch 1;
// shards of one run must partition the padded permutation.
DDPKIT_WORKER(sampler_shards) {
  auto env = dist::read_env();
  DistributedSampling s(
      23, {.rank = env.rank, .world_size = env.world_size, .seed = 9});
  s.set_epoch(1);
  std::ofstream out(test::worker_dir() / ("shard" + std::to_string(env.rank)));
  for (auto i : s.indices()) out << i << " ";
  return 0;
}

TEST_SUITE("samplers") {
  TEST_CASE("DistributedSampling is identical across processes") {
    test::TempDir dir;
    REQUIRE(test::run_workers("sampler_shards", 4, dir.str()).ok());
    for (int r = 0; r < 4; ++r) {
      std::ifstream in(dir / ("shard" + std::to_string(r)));
      std::vector<std::size_t> got;
      for (std::size_t v; in >> v;) got.push_back(v);
      DistributedSampling local(23, {.rank = r, .world_size = 4, .seed = 9});
      local.set_epoch(1);
      CHECK(got == local.indices());
    }
  }
}
