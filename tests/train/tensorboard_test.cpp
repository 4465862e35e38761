// TensorBoard's event files byte by byte: CRC-32C and TFRecord's mask
// against published check values, and whole records against the bytes
// TensorBoard's own Python (tensorboard.compat.proto's event_pb2 and
// summary_pb2, framed by tensorboard.summary.writer.record_writer) writes
// for the same events. No Python is needed to run these.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "../support.hpp"
#include "ddpkit/train/tensorboard.hpp"

using namespace ddpkit;
using ddpkit::test::TempDir;
namespace tb = ddpkit::train::tensorboard_detail;

namespace {

using Bytes = std::vector<std::uint8_t>;

Bytes bytes_of(const std::string& s) {
  return Bytes(s.begin(), s.end());
}

/// "20 00 ..." (what a failed comparison prints).
std::string hex(const Bytes& b) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (auto c : b) {
    if (!out.empty()) out += ' ';
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

/// CRC-32C bit by bit (no table), to check the writer's CRCs of data whose
/// wall time is only known at run time.
std::uint32_t crc32c_bitwise(const std::uint8_t* p, std::size_t n) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}
std::uint32_t masked(std::uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::uint64_t le64(const Bytes& b, std::size_t at) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[at + i];
  return v;
}
std::uint32_t le32(const Bytes& b, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | b[at + i];
  return v;
}

/// One TFRecord of a file: its length field, the two CRC fields as
/// written, and its data.
struct Record {
  std::uint64_t length;
  std::uint32_t length_crc, data_crc;
  Bytes length_bytes, data;
};

std::vector<Record> records_of(const Bytes& file) {
  std::vector<Record> out;
  std::size_t at = 0;
  while (at + 12 <= file.size()) {
    Record r;
    r.length = le64(file, at);
    r.length_bytes.assign(file.begin() + at, file.begin() + at + 8);
    r.length_crc = le32(file, at + 8);
    REQUIRE(at + 16 + r.length <= file.size());
    r.data.assign(file.begin() + at + 12, file.begin() + at + 12 + r.length);
    r.data_crc = le32(file, at + 12 + r.length);
    at += 16 + r.length;
    out.push_back(std::move(r));
  }
  CHECK(at == file.size());  // whole records only
  return out;
}

// Python: event_pb2.Event(wall_time=1.0, step=2, summary=Summary(value=[
//   Summary.Value(tag="train/loss", simple_value=0.6931471805599453)]))
//   .SerializeToString(), and RecordWriter's framing of it.
const Bytes kScalarRecord = {
    // length 32, little-endian u64
    0x20, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    // masked CRC-32C of the length
    0x29, 0xed, 0xa9, 0x50,
    // Event.wall_time (field 1, fixed64): 1.0
    0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, 0x3f,
    // Event.step (field 2, varint): 2
    0x10, 0x02,
    // Event.summary (field 5, 19 bytes) { Summary.value (field 1, 17 bytes)
    0x2a, 0x13, 0x0a, 0x11,
    // { tag (field 1): "train/loss"
    0x0a, 0x0a, 0x74, 0x72, 0x61, 0x69, 0x6e, 0x2f, 0x6c, 0x6f, 0x73, 0x73,
    // simple_value (field 2, fixed32): 0.6931472f } }
    0x15, 0x18, 0x72, 0x31, 0x3f,
    // masked CRC-32C of the 32 data bytes
    0x9c, 0x97, 0x7f, 0x30};

// Python: Event(wall_time=1.5, step=3, summary=Summary(value=[
//   Summary.Value(tag="hparams", tensor=TensorProto(dtype=DT_STRING,
//   tensor_shape=TensorShapeProto(), string_val=[b"| a | b |"]),
//   metadata=SummaryMetadata(plugin_data=PluginData(plugin_name="text")))]))
// .SerializeToString(), from byte 9 on (after the wall time).
const Bytes kTextDataAfterWallTime = {
    // step (field 2): 3
    0x10, 0x03,
    // summary (field 5) { value (field 1) { tag (field 1): "hparams"
    0x2a, 0x26, 0x0a, 0x24, 0x0a, 0x07, 0x68, 0x70, 0x61, 0x72, 0x61, 0x6d,
    0x73,
    // tensor (field 8) { dtype (field 1): DT_STRING (7), tensor_shape
    // (field 2): {}, string_val (field 8): "| a | b |" }
    0x42, 0x0f, 0x08, 0x07, 0x12, 0x00, 0x42, 0x09, 0x7c, 0x20, 0x61, 0x20,
    0x7c, 0x20, 0x62, 0x20, 0x7c,
    // metadata (field 9) { plugin_data (field 1) { plugin_name (field 1):
    // "text" } } } }
    0x4a, 0x08, 0x0a, 0x06, 0x0a, 0x04, 0x74, 0x65, 0x78, 0x74};

}  // namespace

TEST_SUITE("train") {
  TEST_CASE("TensorBoard: CRC-32C and TFRecord's mask give the known answers") {
    const std::string digits = "123456789";
    // The CRC-32C check value (RFC 3720 and every CRC catalogue).
    CHECK(tb::crc32c(digits.data(), digits.size()) == 0xE3069283u);
    // RFC 3720, B.4: 32 bytes of zeros, 32 bytes of 0xFF.
    const Bytes zeros(32, 0x00), ones(32, 0xFF);
    CHECK(tb::crc32c(zeros.data(), zeros.size()) == 0x8A9136AAu);
    CHECK(tb::crc32c(ones.data(), ones.size()) == 0x62A8AB43u);
    CHECK(tb::crc32c(digits.data(), 0) == 0u);
    // TFRecord's mask, ((crc >> 15) | (crc << 17)) + 0xa282ead8, as
    // TensorBoard's masked_crc32c computes it.
    CHECK(tb::masked_crc32c(digits.data(), digits.size()) == 0xC78AB0E5u);
    CHECK(tb::masked_crc32c(digits.data(), 0) == 0xA282EAD8u);
  }

  TEST_CASE(
      "TensorBoard: a scalar event record is byte for byte what TensorBoard "
      "writes") {
    // Event and record framing alone, at a fixed wall time: the payload is
    // Event.summary's bytes (field 5).
    const std::string summary(kScalarRecord.begin() + 23,
                              kScalarRecord.end() - 4);
    const auto rec = bytes_of(tb::record(tb::event(1.0, 2, summary)));
    CHECK(hex(rec) == hex(kScalarRecord));

    // The writer: its file is the file_version event, then the scalar. The
    // wall time is the clock's, so it is checked to lie between the clocks
    // read around the write, and the data CRC is checked by a CRC of our
    // own (bit by bit).
    TempDir dir;
    const double t0 = tb::now_seconds();
    std::filesystem::path path;
    {
      train::TensorBoardWriter w(dir.path() / "tb");
      w.add_scalar("train/loss", 0.6931471805599453, 2);
      w.flush();
      path = w.path();
    }
    const double t1 = tb::now_seconds();
    CHECK(path.parent_path() == dir.path() / "tb");
    CHECK(path.filename().string().rfind("events.out.tfevents.", 0) == 0);
    const auto file = bytes_of(test::file_bytes(path));
    const auto recs = records_of(file);
    REQUIRE(recs.size() == 2);
    for (const auto& r : recs) {
      CHECK(r.length == r.data.size());
      CHECK(r.length_crc == masked(crc32c_bitwise(r.length_bytes.data(), 8)));
      CHECK(r.data_crc == masked(crc32c_bitwise(r.data.data(), r.data.size())));
      REQUIRE(r.data.size() > 9);
      CHECK(r.data[0] == 0x09);  // wall_time, fixed64
      double wall = 0;
      std::memcpy(&wall, r.data.data() + 1, 8);
      CHECK(wall >= t0);
      CHECK(wall <= t1);
    }
    // Event{step: 0, file_version: "brain.Event:2"} (TensorBoard's own
    // writer leaves out the zero step; readers take either).
    const Bytes version = {0x10, 0x00, 0x1a, 0x0d, 'b', 'r', 'a', 'i', 'n',
                           '.',  'E',  'v',  'e',  'n', 't', ':', '2'};
    CHECK(hex(Bytes(recs[0].data.begin() + 9, recs[0].data.end())) ==
          hex(version));
    // The scalar: the same length (and so length CRC) as TensorBoard's, and
    // the same bytes after the wall time.
    CHECK(hex(recs[1].length_bytes) ==
          hex(Bytes(kScalarRecord.begin(), kScalarRecord.begin() + 8)));
    CHECK(recs[1].length_crc == le32(kScalarRecord, 8));
    CHECK(hex(Bytes(recs[1].data.begin() + 9, recs[1].data.end())) ==
          hex(Bytes(kScalarRecord.begin() + 21, kScalarRecord.end() - 4)));
  }

  TEST_CASE(
      "TensorBoard: a text event is byte for byte what TensorBoard writes") {
    TempDir dir;
    std::filesystem::path path;
    {
      train::TensorBoardWriter w(dir.path());
      w.add_text("hparams", "| a | b |", 3);
      w.flush();
      path = w.path();
    }
    const auto recs = records_of(bytes_of(test::file_bytes(path)));
    REQUIRE(recs.size() == 2);
    const auto& r = recs[1];
    CHECK(r.length == 9 + kTextDataAfterWallTime.size());
    CHECK(r.length_crc == masked(crc32c_bitwise(r.length_bytes.data(), 8)));
    CHECK(r.data_crc == masked(crc32c_bitwise(r.data.data(), r.data.size())));
    CHECK(hex(Bytes(r.data.begin() + 9, r.data.end())) ==
          hex(kTextDataAfterWallTime));
  }
}  // TEST_SUITE("train")
