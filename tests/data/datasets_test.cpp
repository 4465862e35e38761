#include "../support.hpp"

#include <filesystem>
#include <fstream>
#include <string>

#include "ddpkit/data.hpp"

namespace fs = std::filesystem;
using namespace ddpkit::data;

namespace {

std::string usage_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ddpkit::UsageError& e) {
    return e.what();
  }
  return "<no UsageError>";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_SUITE("data") {

TEST_CASE("make_synthetic is deterministic and balanced") {
  auto a = make_synthetic(SyntheticOptions(200).seed(3));
  auto b = make_synthetic(SyntheticOptions(200).seed(3));
  auto c = make_synthetic(SyntheticOptions(200).seed(4));
  CHECK(a.images.sizes() == torch::IntArrayRef({200, 3, 32, 32}));
  CHECK((a.images.scalar_type() == torch::kUInt8));
  CHECK((a.labels.scalar_type() == torch::kInt64));
  CHECK(torch::equal(a.images, b.images));
  CHECK(torch::equal(a.labels, b.labels));
  CHECK_FALSE(torch::equal(a.images, c.images));
  CHECK(torch::bincount(a.labels).eq(20).all().item<bool>());
  CHECK(a.classes.size() == 10);
}

TEST_CASE("load_cifar10 round-trips files written by write_cifar_binary") {
  ddpkit::test::TempDir tmp;
  auto train = make_synthetic(SyntheticOptions(103).seed(1));
  auto test = make_synthetic(SyntheticOptions(17).seed(2));
  write_cifar_binary(tmp / "cifar-10-batches-bin", train, test);
  CHECK(fs::file_size(tmp / "cifar-10-batches-bin" / "data_batch_1.bin") ==
        20 * 3073);

  SUBCASE("parent folder or the batches folder itself") {
    for (auto dir : {tmp.path(), tmp / "cifar-10-batches-bin"}) {
      auto c = load_cifar10(dir, Cifar10Options().val_ratio(0.0));
      CHECK(torch::equal(c.train.images, train.images));
      CHECK(torch::equal(c.train.labels, train.labels));
      CHECK(torch::equal(c.test.images, test.images));
      CHECK(c.val.size() == 0);
      CHECK(c.test.classes == synthetic_classes());
    }
  }
  SUBCASE("seeded split is reproducible and disjoint") {
    auto a = load_cifar10(tmp.path(), Cifar10Options().split_seed(5));
    auto b = load_cifar10(tmp.path(), Cifar10Options().split_seed(5));
    auto c = load_cifar10(tmp.path(), Cifar10Options().split_seed(6));
    CHECK(a.val.size() == 10);  // floor(103 * 0.1)
    CHECK(a.train.size() == 93);
    CHECK(torch::equal(a.val.images, b.val.images));
    CHECK_FALSE(torch::equal(a.val.images, c.val.images));
    // Every image lands in exactly one part.
    auto all = torch::cat({a.train.images, a.val.images}).view({103, -1}).to(torch::kInt64)
                   .sum(1);
    all = std::get<0>(all.sort());
    auto ref = std::get<0>(train.images.view({103, -1}).to(torch::kInt64).sum(1).sort());
    CHECK(torch::equal(all, ref));
  }
}

TEST_CASE("load_cifar10 errors name the file and the problem") {
  ddpkit::test::TempDir tmp;
  auto set = make_synthetic(SyntheticOptions(10).seed(1));
  write_cifar_binary(tmp.path(), set, set);

  SUBCASE("missing file") {
    fs::remove(tmp / "data_batch_3.bin");
    auto msg = usage_error_of([&] { load_cifar10(tmp.path()); });
    CHECK(contains(msg, "missing file"));
    CHECK(contains(msg, "data_batch_3.bin"));
  }
  SUBCASE("size not a multiple of 3073") {
    std::ofstream(tmp / "test_batch.bin", std::ios::app) << "xyz";
    auto msg = usage_error_of([&] { load_cifar10(tmp.path()); });
    CHECK(contains(msg, "test_batch.bin"));
    CHECK(contains(msg, std::to_string(10 * 3073 + 3)));
    CHECK(contains(msg, "3073"));
  }
  SUBCASE("label out of range") {
    {
      std::fstream f(tmp / "test_batch.bin", std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(2 * 3073);
      f.put(static_cast<char>(42));
    }
    auto msg = usage_error_of([&] { load_cifar10(tmp.path()); });
    CHECK(contains(msg, "test_batch.bin"));
    CHECK(contains(msg, "label 42"));
    CHECK(contains(msg, "byte offset 6146"));
  }
}

}  // TEST_SUITE("data")
