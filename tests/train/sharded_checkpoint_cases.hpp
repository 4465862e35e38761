// Sharded checkpoint files (include/ddpkit/train/sharded_checkpoint.hpp):
// cases of the "train" suite, included by tests/train/trainer_test.cpp.
#pragma once

#include "ddpkit/train/sharded_checkpoint.hpp"

namespace sharded_test {

/// Tensors as a model's state would hold them: a channels-last
/// convolution weight, a bias, a 2-D weight, and an int64 step.
inline std::map<std::string, torch::Tensor> state_tensors() {
  torch::manual_seed(5);
  return {
      {"conv.weight", torch::randn({4, 3, 3, 3})
                          .contiguous(torch::MemoryFormat::ChannelsLast)},
      {"conv.bias", torch::randn({4})},
      {"fc.weight", torch::randn({5, 7})},
      {"optimizer/step", torch::arange(3, torch::kLong)},
  };
}

/// ZeRO-3's cut: the tensors laid end to end in one flat buffer (in key
/// order), padded to a multiple of `world`, each rank owning one equal
/// chunk; rank r's pieces are its chunk's runs of each tensor.
inline train::ShardPieces zero3_pieces(
    const std::map<std::string, torch::Tensor>& ts, int rank, int world) {
  int64_t total = 0;
  for (const auto& kv : ts) total += kv.second.numel();
  const int64_t chunk = (total + world - 1) / world;
  const int64_t lo = rank * chunk, hi = lo + chunk;
  train::ShardPieces pieces;
  int64_t at = 0;
  for (const auto& [key, t] : ts) {
    const int64_t b = std::max(lo, at), e = std::min(hi, at + t.numel());
    if (b < e) pieces[key] = {b - at, train::memory_run(t, b - at, e - at)};
    at += t.numel();
  }
  return pieces;
}

inline std::vector<fs::path> write_all(
    const fs::path& dir, const std::map<std::string, torch::Tensor>& ts,
    int world) {
  std::vector<fs::path> files;
  for (int r = 0; r < world; ++r) {
    files.push_back(dir / train::shard_file_name(r, world));
    train::write_shard_file(files.back(), r, world, zero3_pieces(ts, r, world));
  }
  return files;
}

inline train::ShardIndex index_of(
    const std::map<std::string, torch::Tensor>& ts) {
  train::ShardIndex index;
  for (const auto& [key, t] : ts) index[key] = train::TensorMeta::of(t);
  // Through the entry a manifest would hold, and back.
  return train::read_shard_index(train::shard_index_value(index), "test");
}

inline std::string assemble_error(const train::ShardIndex& index,
                                  const std::vector<fs::path>& files) {
  try {
    train::assemble_shards(index, files);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

}  // namespace sharded_test

TEST_SUITE("train") {
  TEST_CASE(
      "sharded checkpoint files: pieces written by each rank at worlds 1, 2, "
      "3 and 4 assemble into the whole tensors, strides and dtypes kept") {
    const auto ts = sharded_test::state_tensors();
    const auto index = sharded_test::index_of(ts);
    for (int world : {1, 2, 3, 4}) {
      CAPTURE(world);
      TempDir dir;
      const auto files = sharded_test::write_all(dir.path(), ts, world);
      // Each file holds only its rank's share (a quarter at world 4).
      if (world == 4) {
        const auto c = train::open_checkpoint(files[1]);
        c10::IValue pieces;
        REQUIRE(c.try_read("pieces", pieces));
        int64_t n = 0;
        for (const auto& kv : pieces.toGenericDict()) {
          n += kv.value().toTensor().numel();
        }
        CHECK(n == 38);  // ceil(150 / 4): 108 + 4 + 35 + 3 elements
      }
      const auto whole = train::assemble_shards(index, files);
      REQUIRE(whole.size() == ts.size());
      for (const auto& [key, t] : ts) {
        CAPTURE(key);
        const auto& got = whole.at(key);
        CHECK((got.scalar_type() == t.scalar_type()));
        CHECK(got.strides().vec() == t.strides().vec());
        CHECK(torch::equal(got, t));
      }
    }
  }

  TEST_CASE(
      "sharded checkpoint files: a missing piece, an overlap, a file of "
      "another world or rank, and a damaged file are errors naming them") {
    const auto ts = sharded_test::state_tensors();
    const auto index = sharded_test::index_of(ts);
    TempDir dir;
    auto files = sharded_test::write_all(dir.path(), ts, 3);
    REQUIRE(sharded_test::assemble_error(index, files).empty());

    // Rank 1 lost its piece of conv.weight (elements 46 to 96 at world 3):
    // the gap is named, and the files holding the rest.
    auto pieces = sharded_test::zero3_pieces(ts, 1, 3);
    REQUIRE(pieces.count("conv.weight") == 1);
    const auto [off, run] = pieces.at("conv.weight");
    CHECK(off == 46);
    pieces.erase("conv.weight");
    train::write_shard_file(files[1], 1, 3, pieces);
    auto msg = sharded_test::assemble_error(index, files);
    CAPTURE(msg);
    CHECK(msg.find("no file holds elements [46, " +
                   std::to_string(46 + run.numel()) + ") of 'conv.weight'") !=
          std::string::npos);
    CHECK(msg.find(files[2].string()) != std::string::npos);

    // Rank 1 holds all of conv.weight: an overlap, named.
    pieces = sharded_test::zero3_pieces(ts, 1, 3);
    pieces["conv.weight"] = {0,
                             train::memory_run(ts.at("conv.weight"), 0, 108)};
    train::write_shard_file(files[1], 1, 3, pieces);
    msg = sharded_test::assemble_error(index, files);
    CHECK(msg.find("pieces of 'conv.weight' overlap") != std::string::npos);

    // Files of a world of 3 read as a world of 2; rank 2's file as rank 1.
    sharded_test::write_all(dir.path(), ts, 3);
    msg = sharded_test::assemble_error(index, {files[0], files[1]});
    CHECK(msg.find("is rank 0 of 3; expected rank 0 of 2") !=
          std::string::npos);
    msg = sharded_test::assemble_error(index, {files[0], files[2], files[1]});
    CHECK(msg.find(files[2].string() + " is rank 2 of 3; expected rank 1") !=
          std::string::npos);

    // A key the index does not list, and a damaged file.
    auto partial = index;
    partial.erase("conv.bias");
    msg = sharded_test::assemble_error(partial, files);
    CHECK(msg.find("holds 'conv.bias', which the checkpoint's index does not "
                   "list") != std::string::npos);
    fs::resize_file(files[2], fs::file_size(files[2]) / 2);
    msg = sharded_test::assemble_error(index, files);
    CHECK(msg.find(files[2].string()) != std::string::npos);
  }
}
