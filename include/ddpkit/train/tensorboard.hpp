// SPDX-License-Identifier: BSD-3-Clause
// TensorBoard event files, written without TensorFlow: TFRecord framing
// (length, masked CRC-32C of the length, data, masked CRC-32C of the data)
// around `Event` protocol buffers holding scalar and text summaries.
//
// The messages are tiny and fixed (Event, Summary.Value, a string
// TensorProto), so they are encoded here field by field, by their
// numbers in TensorFlow's event.proto / summary.proto / tensor.proto; a
// test reads every record back with TensorBoard's own reader (CRCs
// checked) and its EventAccumulator.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/bytes.hpp"
#include "ddpkit/detail/error.hpp"

namespace ddpkit::train {

// Note [TensorBoard without TensorFlow]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// TensorBoard without TensorFlow. `train::TensorBoardWriter` writes TFRecord
// framing (length, masked CRC-32C, data, masked CRC-32C) around `Event`
// messages with scalar (`simple_value`) and text (string tensor, text plugin)
// summaries, encoded field by field (about a dozen fields; a protobuf
// dependency and TensorFlow's .proto files would be larger than the encoder).
// CRC-32C is a 256-entry table computed at compile time (TensorBoard's own
// pure-Python reader does the same); a link dependency for it would break
// header-only use. Events stay in memory until the Trainer's epoch-end flush,
// which comes after the checkpoint: a run killed mid-epoch leaves nothing of
// that epoch, its resume logs it once (a test kills a run 0.5 s into epoch 3:
// with a flush per logged step instead, steps 85 and 90 appeared twice). The
// window between the checkpoint's rename and the flush (milliseconds) would
// lose that epoch's events, never duplicate them. `global_step` (batches) is
// in the checkpoint so step numbers continue across resumes.

namespace tensorboard_detail {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), byte at a time.
inline constexpr std::array<std::uint32_t, 256> kCrc32cTable = [] {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);
    t[i] = c;
  }
  return t;
}();

inline std::uint32_t crc32c(const void* data, std::size_t n) {
  auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i)
    c = kCrc32cTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

/// TFRecord's masked CRC (so a CRC of data holding CRCs stays useful).
inline std::uint32_t masked_crc32c(const void* data, std::size_t n) {
  const std::uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// Protocol buffer wire format: key = field << 3 | wire type.
inline void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
inline void key(std::string& out, int field, int wire) {
  varint(out, (static_cast<std::uint64_t>(field) << 3) | wire);
}
using ddpkit::detail::append_le;
inline void bytes_field(std::string& out, int field, const std::string& b) {
  key(out, field, 2);
  varint(out, b.size());
  out += b;
}

/// An Event (wall_time = 1, step = 2) with `payload` (already a field of
/// Event: file_version = 3, summary = 5, session_log = 6).
inline std::string event(double wall_time, std::int64_t step,
                         const std::string& payload) {
  std::string e;
  key(e, 1, 1);
  append_le(e, wall_time);
  key(e, 2, 0);
  varint(e, static_cast<std::uint64_t>(step));
  return e + payload;
}

/// One TFRecord around `data`.
inline std::string record(const std::string& data) {
  std::string r;
  append_le(r, static_cast<std::uint64_t>(data.size()));
  const std::uint32_t len_crc = masked_crc32c(r.data(), 8);
  append_le(r, len_crc);
  r += data;
  append_le(r, masked_crc32c(data.data(), data.size()));
  return r;
}

inline double now_seconds() {
  return std::chrono::duration<double>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace tensorboard_detail

/// Writes one TensorBoard event file, `DIR/events.out.tfevents.<unix
/// time>.<host>` (with `.<n>` added if that name exists). Events are kept in
/// memory until `flush`, which appends them and fsyncs, so what a killed run
/// leaves is whole records of the flushes before it. Not thread-safe.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::filesystem::path& dir) {
    namespace fs = std::filesystem;
    using ddpkit::detail::cat;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      throw UsageError(cat("TensorBoard folder ", dir.string(),
                           " cannot be created: ", ec.message()));
    }
    char host[256] = "localhost";
    ::gethostname(host, sizeof host - 1);
    const auto stem = cat(
        "events.out.tfevents.",
        static_cast<long long>(tensorboard_detail::now_seconds()), ".", host);
    for (int n = 0; fd_ < 0; ++n) {
      path_ = dir / (n == 0 ? stem : cat(stem, ".", n));
      fd_ =
          ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd_ < 0 && errno != EEXIST) {
        throw UsageError(cat("TensorBoard file ", path_.string(),
                             " cannot be created: ", std::strerror(errno)));
      }
    }
    std::string version;
    tensorboard_detail::bytes_field(version, 3, "brain.Event:2");
    pending_ = tensorboard_detail::record(tensorboard_detail::event(
        tensorboard_detail::now_seconds(), 0, version));
    flush();
  }
  /// Closes the file. Events added since the last `flush` are dropped: a
  /// run that fails mid-epoch leaves the epochs it finished, and its resume
  /// logs the rest once.
  ~TensorBoardWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// A scalar (stored as float32, as TensorBoard's `simple_value`).
  void add_scalar(const std::string& tag, double value, std::int64_t step) {
    using namespace tensorboard_detail;
    std::string v;
    bytes_field(v, 1, tag);
    key(v, 2, 5);
    append_le(v, static_cast<float>(value));
    add_value(v, step);
  }

  /// Text (markdown), shown in TensorBoard's Text tab.
  void add_text(const std::string& tag, const std::string& text,
                std::int64_t step) {
    using namespace tensorboard_detail;
    std::string plugin_data, metadata, tensor, v;
    bytes_field(plugin_data, 1, "text");    // PluginData.plugin_name
    bytes_field(metadata, 1, plugin_data);  // SummaryMetadata.plugin_data
    key(tensor, 1, 0);
    varint(tensor, 7);             // TensorProto.dtype = DT_STRING
    bytes_field(tensor, 2, "");    // tensor_shape: a scalar
    bytes_field(tensor, 8, text);  // string_val
    bytes_field(v, 1, tag);
    bytes_field(v, 8, tensor);    // Summary.Value.tensor
    bytes_field(v, 9, metadata);  // Summary.Value.metadata
    add_value(v, step);
  }

  /// Appends what was added since the last flush and syncs it to disk. A
  /// refused write (disk full, I/O error) cuts the file back to the last
  /// whole record and throws IoError naming the file.
  void flush() {
    const off_t start = ::lseek(fd_, 0, SEEK_END);
    int err = ddpkit::detail::write_all(fd_, pending_);
    if (err == 0 && ::fsync(fd_) != 0 && errno != EINVAL) err = errno;
    if (err != 0) {
      if (start >= 0 && ::ftruncate(fd_, start) == 0) ::fsync(fd_);
      throw ddpkit::detail::io_error("cannot write TensorBoard file", path_,
                                     err);
    }
    pending_.clear();
  }

  const std::filesystem::path& path() const {
    return path_;
  }

 private:
  void add_value(const std::string& value, std::int64_t step) {
    using namespace tensorboard_detail;
    std::string summary, payload;
    bytes_field(summary, 1, value);    // Summary.value
    bytes_field(payload, 5, summary);  // Event.summary
    pending_ += record(event(now_seconds(), step, payload));
  }

  std::filesystem::path path_;
  int fd_ = -1;
  std::string pending_;
};

}  // namespace ddpkit::train
