// SPDX-License-Identifier: BSD-3-Clause
// Checks a checkpoint archive before libtorch reads it.
//
// `torch::serialize::InputArchive::load_from` (torch::jit::load) trusts
// the archive: libtorch 1.13 sizes buffers from the zip's and the pickles'
// length fields before checking that the bytes are there (a 16 KB damaged
// file made it allocate and fill 1.7 GB), and it compiles the class
// definitions in the `code/` entries, crashing (null dereference in
// ScriptTypeParser) on some damaged ones — all found by fuzzing
// (tests/fuzz). ddpkit's checkpoints are written by `OutputArchive`, so
// they have a known shape, checked here first:
//
// - the zip: every entry inside the file, stored or (code) deflated to at
//   most deflate's largest ratio and 64 MiB, and every stored entry's bytes
//   matching the CRC-32 its directory records;
// - every pickle (`*.pkl`, `*_pkl`): no length field runs past its entry,
//   no memo index is beyond its size, no storage claims more bytes than its
//   record holds;
// - every `code/*.py`: only attribute declarations of a small fixed shape,
//
//     class Module(Module):
//       __parameters__ = ["epochs_done", ]
//       __buffers__ = []
//       __annotations__ = []
//       __annotations__["param_groups/0"] = __torch__.___torch_mangle_9.Module
//       model : Dict[str, Tensor]
//
// Anything else is refused before libtorch sees it.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <caffe2/serialize/inline_container.h>

#include "ddpkit/detail/bytes.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/pickle_reader.hpp"

namespace ddpkit::detail {

/// A cursor over one line of archive code.
class CodeLine {
 public:
  explicit CodeLine(std::string_view s) : s_(s) {}

  bool eat(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) return false;
    pos_ += lit.size();
    return true;
  }
  bool done() const {
    return pos_ == s_.size();
  }
  /// [A-Za-z_][A-Za-z0-9_]*
  bool ident(std::string_view* out = nullptr) {
    const auto start = pos_;
    auto word = [](char c, bool first) {
      const auto u = static_cast<unsigned char>(c);
      return c == '_' || std::isalpha(u) || (!first && std::isdigit(u));
    };
    while (pos_ < s_.size() && word(s_[pos_], pos_ == start)) ++pos_;
    if (out) *out = s_.substr(start, pos_ - start);
    return pos_ > start;
  }
  /// A double-quoted string without quotes, backslashes or control bytes.
  bool quoted() {
    if (!eat("\"")) return false;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      const auto u = static_cast<unsigned char>(s_[pos_]);
      if (u == '\\' || u < 0x20 || u == 0x7f) return false;
      ++pos_;
    }
    return eat("\"");
  }
  /// `[` (quoted `, `)* `]`: OutputArchive's parameter and buffer lists.
  bool name_list() {
    if (!eat("[")) return false;
    while (!eat("]")) {
      if (!quoted() || !eat(", ")) return false;
    }
    return true;
  }
  /// Tensor, bool, int, float, str, NoneType, Dict[K, V], List[T],
  /// Optional[T], Tuple[T, ...], or a class `__torch__.a.b.Name`.
  bool type(int depth = 0) {
    if (depth > 8) return false;
    std::string_view name;
    if (!ident(&name)) return false;
    if (name == "__torch__") {
      int parts = 0;
      while (eat(".")) {
        if (!ident()) return false;
        ++parts;
      }
      return parts > 0;
    }
    int arity = -1;  // -1: no brackets; 0: one or more
    if (name == "Dict")
      arity = 2;
    else if (name == "List" || name == "Optional")
      arity = 1;
    else if (name == "Tuple")
      arity = 0;
    else if (name != "Tensor" && name != "bool" && name != "int" &&
             name != "float" && name != "str" && name != "NoneType")
      return false;
    if (arity < 0) return true;
    if (!eat("[") || !type(depth + 1)) return false;
    int n = 1;
    while (eat(", ")) {
      if (!type(depth + 1)) return false;
      ++n;
    }
    return eat("]") && (arity == 0 || n == arity);
  }

 private:
  std::string_view s_;
  std::size_t pos_ = 0;
};

/// The line number (1-based) of the first line of `code` that is not of
/// the shape above, or 0 when all are.
inline std::size_t archive_code_problem(std::string_view code) {
  std::vector<std::string_view> lines;
  for (std::size_t at = 0; at <= code.size();) {
    const auto nl = code.find('\n', at);
    const auto end = nl == std::string_view::npos ? code.size() : nl;
    lines.push_back(code.substr(at, end - at));
    at = end + 1;
  }
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (lines.empty()) return 1;
  std::size_t i = 0;
  while (i < lines.size()) {
    // A class header, then __parameters__ and __buffers__, which libtorch's
    // importer relies on.
    CodeLine head(lines[i]);
    if (!(head.eat("class ") && head.ident() && head.eat("(Module):") &&
          head.done()))
      return i + 1;
    ++i;
    for (const char* list : {"  __parameters__ = ", "  __buffers__ = "}) {
      CodeLine l(i < lines.size() ? lines[i] : std::string_view{});
      if (!(l.eat(list) && l.name_list() && l.done())) return i + 1;
      ++i;
    }
    for (; i < lines.size() && lines[i].substr(0, 2) == "  "; ++i) {
      CodeLine a(lines[i]);
      CodeLine b(lines[i]);
      CodeLine c(lines[i]);
      const bool ok =
          (a.eat("  __annotations__ = []") && a.done()) ||
          (b.eat("  __annotations__[") && b.quoted() && b.eat("] = ") &&
           b.type() && b.done()) ||
          (c.eat("  ") && c.ident() && c.eat(" : ") && c.type() && c.done());
      if (!ok) return i + 1;
    }
  }
  return 0;
}

/// The bytes per element of libtorch's `torch.<T>Storage` classes, or 0.
inline std::int64_t storage_itemsize(std::string_view global) {
  constexpr std::string_view prefix = "torch ";
  if (global.substr(0, prefix.size()) != prefix) return 0;
  const auto t = global.substr(prefix.size());
  struct Entry {
    std::string_view name;
    std::int64_t size;
  };
  static constexpr Entry kTypes[] = {
      {"DoubleStorage", 8},         {"FloatStorage", 4},
      {"HalfStorage", 2},           {"BFloat16Storage", 2},
      {"LongStorage", 8},           {"IntStorage", 4},
      {"ShortStorage", 2},          {"CharStorage", 1},
      {"ByteStorage", 1},           {"BoolStorage", 1},
      {"ComplexDoubleStorage", 16}, {"ComplexFloatStorage", 8},
      {"QInt8Storage", 1},          {"QUInt8Storage", 1},
      {"QInt32Storage", 4},         {"QUInt4x2Storage", 1},
      {"QUInt2x4Storage", 1}};
  for (const auto& e : kTypes)
    if (e.name == t) return e.size;
  return 0;
}

/// What is wrong with the pickle `p` for libtorch's unpickler, or "":
///
/// - a length field that runs past its end, or a memo index beyond its
///   size (libtorch allocates both before reading);
/// - a storage whose persistent id `('storage', torch.<T>Storage, key,
///   location, numel)` claims more than its record holds: libtorch sizes
///   the storage by `numel` but reads only the record, `record_size(key)`
///   bytes (-1: no such record).
///
/// Walks the opcodes of protocols 0-5, following only strings, integers,
/// marks and the memo (enough for the persistent ids torch.save and
/// OutputArchive write); stops at STOP or at an opcode it does not know
/// (libtorch refuses those itself).
template <class RecordSize>
std::string pickle_problem(std::string_view p, const RecordSize& record_size) {
  const std::size_t n = p.size();
  auto le = [&](std::size_t at, int bytes) {
    return read_le(p.substr(at, static_cast<std::size_t>(bytes)));
  };
  // A value on the unpickler's stack, as far as this check follows it.
  struct Value {
    enum Kind { opaque, string, integer } kind = opaque;
    std::string s;
    std::int64_t i = 0;
  };
  struct Frame {  // what was pushed since a MARK
    std::vector<Value> values;
    bool simple = true;  // nothing but pushes since the MARK
  };
  std::vector<Frame> frames;
  std::unordered_map<std::uint64_t, Value> memo;
  std::uint64_t memo_next = 0;
  Value last;  // what the previous opcode pushed
  bool last_pushed = false;
  std::vector<Value> tuple;  // what the previous opcode (TUPLE) built
  bool tuple_ready = false;
  std::size_t i = 0;
  while (i < n) {
    const auto op = static_cast<unsigned char>(p[i]);
    const std::size_t at = i;
    auto bad = [&](const std::string& what) {
      return cat("opcode ", int(op), " at byte ", at, ": ", what);
    };
    ++i;
    std::size_t fixed = 0;  // fixed-size argument
    int length_bytes = 0;   // argument: a length of this many bytes, then data
    int lines = 0;          // argument: newline-terminated lines
    switch (op) {
      case '.':  // STOP
        return "";
      case 0x80:
      case 'K':
      case 'h':
      case 'q':
      case 0x82: fixed = 1; break;
      case 'M':
      case 0x83: fixed = 2; break;
      case 'J':
      case 'j':
      case 'r':
      case 0x84: fixed = 4; break;
      case 'G':
      case 0x95:  // BINFLOAT, FRAME (an 8-byte size, no data)
        fixed = 8;
        break;
      case 'U':
      case 0x8c:
      case 'C':
      case 0x8a: length_bytes = 1; break;
      case 'T':
      case 'X':
      case 'B':
      case 0x8b: length_bytes = 4; break;
      case 0x8d:
      case 0x8e:
      case 0x96: length_bytes = 8; break;
      case 'c':
      case 'i': lines = 2; break;
      case 'I':
      case 'L':
      case 'F':
      case 'S':
      case 'V':
      case 'P':
      case 'g':
      case 'p': lines = 1; break;
      case '(':
      case '0':
      case '1':
      case '2':
      case 'N':
      case 0x88:
      case 0x89:
      case '}':
      case ']':
      case ')':
      case 'a':
      case 'e':
      case 'b':
      case 'd':
      case 'l':
      case 't':
      case 0x85:
      case 0x86:
      case 0x87:
      case 'R':
      case 0x81:
      case 0x92:
      case 's':
      case 'u':
      case 'Q':
      case 0x8f:
      case 0x90:
      case 0x91:
      case 0x93:
      case 0x94:
      case 'o':
      case 0x97:
      case 0x98: break;
      default: return "";
    }
    if (fixed > n - i) return bad("runs past the end");
    const std::size_t arg = i;
    i += fixed;
    std::string_view payload;
    if (length_bytes > 0) {
      if (static_cast<std::size_t>(length_bytes) > n - i)
        return bad("runs past the end");
      const std::uint64_t len = le(i, length_bytes);
      i += static_cast<std::size_t>(length_bytes);
      if (len > n - i) return bad("runs past the end");
      payload = p.substr(i, static_cast<std::size_t>(len));
      i += static_cast<std::size_t>(len);
    }
    std::string text;
    for (int k = 0; k < lines; ++k) {
      const auto nl = p.find('\n', i);
      if (nl == std::string_view::npos) return bad("runs past the end");
      if (k > 0) text += ' ';
      text += p.substr(i, nl - i);
      i = nl + 1;
    }

    // Follow the stack as far as the persistent ids need.
    const bool was_tuple = tuple_ready;
    tuple_ready = false;
    std::optional<Value> pushed;  // a plain push of this value
    auto integer = [](std::int64_t v) { return Value{Value::integer, {}, v}; };
    switch (op) {
      case 'X':
      case 0x8c:
      case 0x8d:
      case 'U':
      case 'T': pushed = Value{Value::string, std::string(payload), 0}; break;
      case 'c': pushed = Value{Value::string, text, 0}; break;
      case 'K': pushed = integer(static_cast<std::int64_t>(le(arg, 1))); break;
      case 'M': pushed = integer(static_cast<std::int64_t>(le(arg, 2))); break;
      case 'J':
        pushed = integer(
            static_cast<std::int32_t>(static_cast<std::uint32_t>(le(arg, 4))));
        break;
      case 0x8a:  // LONG1: little-endian two's complement
        if (payload.size() <= 8) {
          pushed = integer(pickle::long1_value(payload));
        } else {
          pushed = Value{};
        }
        break;
      case 'h':
      case 'j': {
        const auto it = memo.find(le(arg, op == 'h' ? 1 : 4));
        pushed = it == memo.end() ? Value{} : it->second;
        break;
      }
      case 'N':
      case 0x88:
      case 0x89:
      case 'G':
      case 'I':
      case 'L':
      case 'F':
      case 'S':
      case 'V':
      case 'C':
      case 'B':
      case 0x8e:
      case 0x96:
      case '}':
      case ']':
      case ')':
      case 0x8f:
      case 0x8b:
      case 'g': pushed = Value{}; break;
      default: break;
    }
    if (pushed) {
      if (!frames.empty()) frames.back().values.push_back(*pushed);
      last = std::move(*pushed);
      last_pushed = true;
      continue;
    }
    switch (op) {
      case 'q':
      case 'r':
      case 'p':
      case 0x94: {
        // Picklers number memo entries from 0, each at least 2 bytes of
        // pickle; libtorch sizes its memo table by the index.
        std::uint64_t index = memo_next;
        if (op == 'q') index = le(arg, 1);
        if (op == 'r') index = le(arg, 4);
        if (op == 'p') {
          if (text.empty() || text.size() > 9 ||
              text.find_first_not_of("0123456789") != std::string::npos)
            return bad("a memo index that is not a small number");
          index = std::stoull(text);
        }
        if (index >= n) return bad("a memo index beyond the pickle's size");
        memo[index] = last_pushed ? last : Value{};
        memo_next = index + 1;
        tuple_ready = was_tuple;  // memoizing keeps the tuple on top
        continue;
      }
      case '(': frames.emplace_back(); break;
      case 't':
        if (!frames.empty()) {
          tuple_ready = frames.back().simple;
          tuple = std::move(frames.back().values);
          frames.pop_back();
          if (!frames.empty()) frames.back().values.emplace_back();
        }
        break;
      case 'l':
      case 'd':
      case 'e':
      case 'u':
      case '1':
      case 'o':
      case 'i':
      case 0x90:
      case 0x91:
        if (!frames.empty()) frames.pop_back();
        if (!frames.empty()) frames.back().simple = false;
        break;
      case 'Q': {
        // BINPERSID: a storage. Only the form torch.save and OutputArchive
        // write is understood: a fresh 5-tuple.
        const bool ok =
            was_tuple && tuple.size() == 5 && tuple[0].kind == Value::string &&
            tuple[0].s == "storage" && tuple[1].kind == Value::string &&
            tuple[2].kind == Value::string && tuple[3].kind == Value::string &&
            tuple[4].kind == Value::integer;
        if (!ok) return bad("a persistent id that is not a storage tuple");
        const std::int64_t itemsize = storage_itemsize(tuple[1].s);
        if (itemsize == 0) return bad("an unknown storage type " + tuple[1].s);
        std::int64_t bytes = 0;
        if (tuple[4].i < 0 ||
            __builtin_mul_overflow(tuple[4].i, itemsize, &bytes)) {
          return bad(cat("a storage of ", tuple[4].i, " elements"));
        }
        if (bytes > 0) {
          const std::int64_t have = record_size(tuple[2].s);
          if (have < bytes) {
            return bad(cat("storage '", tuple[2].s, "' claims ", bytes,
                           " bytes but its record holds ",
                           std::max<std::int64_t>(have, 0)));
          }
        }
        if (!frames.empty()) frames.back().values.emplace_back();
        break;
      }
      case 'P': return bad("a text persistent id");
      default:
        // Anything else pops or rearranges values this check does not
        // follow: the values since the last MARK no longer form a tuple.
        if (!frames.empty()) frames.back().simple = false;
        break;
    }
    last_pushed = false;
  }
  return "";
}

/// One entry of a zip archive: its name and where its bytes are.
struct ZipEntry {
  std::string name;
  std::uint64_t offset = 0, stored_size = 0, size = 0;
  std::uint32_t crc = 0;  ///< as the central directory records it
  bool deflated = false;
};

/// Whether `check_archive` compares each stored entry's bytes with its
/// CRC-32 (true; the fuzz targets turn it off to reach the parsers).
inline bool& verify_zip_checksums() {
  static bool on = true;
  return on;
}

/// The largest uncompressed size of a deflated entry (OutputArchive
/// deflates only its code entries, a few KB each).
inline constexpr std::uint64_t kMaxDeflatedEntry = std::uint64_t{64} << 20;

/// The entries of the zip archive held in `bytes`, read through
/// bounds-checked copies; "" in `problem` when the archive is what
/// torch.save and OutputArchive write (every entry inside the file, stored
/// or deflated to a bounded size), else what is wrong.
inline std::vector<ZipEntry> read_zip_entries(std::string_view bytes,
                                              std::string& problem) {
  problem.clear();
  std::vector<ZipEntry> entries;
  const auto file_size = static_cast<std::uint64_t>(bytes.size());
  // Copies [at, at + n) of the file, or fails when that is not inside it.
  auto read = [&](std::uint64_t at, std::uint64_t n, std::string& out) {
    if (at > file_size || n > file_size - at) return false;
    out.assign(bytes.substr(static_cast<std::size_t>(at),
                            static_cast<std::size_t>(n)));
    return true;
  };
  auto le = [](const std::string& b, std::size_t at, int bytes) {
    return read_le(
        std::string_view(b).substr(at, static_cast<std::size_t>(bytes)));
  };
  // The end-of-central-directory record, searched backwards (as miniz does)
  // through the last 64 KiB + 22 bytes.
  const std::uint64_t tail_size = std::min<std::uint64_t>(file_size, 65557);
  std::string tail;
  if (!read(file_size - tail_size, tail_size, tail) || tail_size < 22) {
    problem = "is not a zip archive (too short)";
    return entries;
  }
  std::size_t eocd = std::string::npos;
  for (std::size_t k = tail.size() - 22 + 1; k-- > 0;) {
    if (tail.compare(k, 4, "PK\x05\x06") == 0) {
      eocd = k;
      break;
    }
  }
  if (eocd == std::string::npos) {
    problem = "is not a zip archive (no end of central directory)";
    return entries;
  }
  const std::uint64_t eocd_at = file_size - tail_size + eocd;
  std::uint64_t count = le(tail, eocd + 10, 2);
  std::uint64_t cdir_size = le(tail, eocd + 12, 4);
  std::uint64_t cdir_at = le(tail, eocd + 16, 4);
  // Zip64: a locator right before the record points at the zip64 record.
  std::string loc, z64;
  if (eocd_at >= 20 && read(eocd_at - 20, 20, loc) &&
      loc.compare(0, 4, "PK\x06\x07") == 0) {
    if (!read(le(loc, 8, 8), 56, z64) || z64.compare(0, 4, "PK\x06\x06") != 0) {
      problem = "has a damaged zip64 end of central directory";
      return entries;
    }
    count = le(z64, 32, 8);
    cdir_size = le(z64, 40, 8);
    cdir_at = le(z64, 48, 8);
  }
  std::string cdir;
  if (!read(cdir_at, cdir_size, cdir)) {
    problem = "has a central directory outside the file";
    return entries;
  }
  std::size_t at = 0;
  for (std::uint64_t e = 0; e < count; ++e) {
    if (cdir.size() - at < 46 || cdir.compare(at, 4, "PK\x01\x02") != 0) {
      problem = "has a damaged central directory";
      return entries;
    }
    const auto method = le(cdir, at + 10, 2);
    const auto crc = static_cast<std::uint32_t>(le(cdir, at + 16, 4));
    std::uint64_t csize = le(cdir, at + 20, 4), usize = le(cdir, at + 24, 4);
    const auto name_len = le(cdir, at + 28, 2);
    const auto extra_len = le(cdir, at + 30, 2);
    const auto comment_len = le(cdir, at + 32, 2);
    std::uint64_t local = le(cdir, at + 42, 4);
    if (cdir.size() - at - 46 < name_len + extra_len + comment_len) {
      problem = "has a damaged central directory";
      return entries;
    }
    ZipEntry entry;
    entry.name = cdir.substr(at + 46, name_len);
    // Zip64 extra field: the 8-byte values of the fields that read 0xFFFFFFFF.
    for (std::size_t x = at + 46 + name_len, end = x + extra_len;
         x + 4 <= end;) {
      const auto id = le(cdir, x, 2), len = le(cdir, x + 2, 2);
      if (x + 4 + len > end) break;
      if (id == 1) {
        std::size_t f = x + 4;
        for (std::uint64_t* v : {&usize, &csize, &local}) {
          if (*v == 0xFFFFFFFFu) {
            if (f + 8 > x + 4 + len) break;
            *v = le(cdir, f, 8);
            f += 8;
          }
        }
      }
      x += 4 + len;
    }
    at += 46 + name_len + extra_len + comment_len;
    // Stored, or deflated to at most deflate's largest ratio (1032:1).
    const bool sizes_ok =
        (method == 0 && csize == usize) ||
        (method == 8 && usize <= kMaxDeflatedEntry && usize / 1032 <= csize);
    std::string lh;
    if (!sizes_ok || !read(local, 30, lh) ||
        lh.compare(0, 4, "PK\x03\x04") != 0) {
      problem = cat("has a damaged entry ", entry.name, " (method ", method,
                    ", ", csize, " -> ", usize, " bytes)");
      return entries;
    }
    entry.offset = local + 30 + le(lh, 26, 2) + le(lh, 28, 2);
    entry.stored_size = csize;
    entry.size = usize;
    entry.deflated = method == 8;
    entry.crc = crc;
    if (entry.offset > file_size ||
        entry.stored_size > file_size - entry.offset) {
      problem = cat("has an entry ", entry.name, " that ends past the file");
      return entries;
    }
    entries.push_back(std::move(entry));
  }
  return entries;
}

/// Checks the archive held in `bytes` as described at the top of this file;
/// a UsageError otherwise, "`what` cannot be read (damaged, or not written
/// by `writers`): it ..." (`what` names the file).
inline void check_archive(std::string_view bytes, const std::string& what,
                          const std::string& writers) {
  auto refuse = [&](const std::string& why) {
    return UsageError(cat(what, " cannot be read (damaged, or not written by ",
                          writers, "): it ", why));
  };
  std::string problem;
  const auto entries = read_zip_entries(bytes, problem);
  if (!problem.empty()) throw refuse(problem);
  // Bytes changed after writing (a bad disk, a flipped bit, a partial
  // copy) show as a checksum mismatch. A CRC of 0 is what a writer that
  // skips checksums records (torch.save with compute_crc32 off).
  if (verify_zip_checksums()) {
    for (const auto& e : entries) {
      if (e.deflated || e.crc == 0) continue;
      const auto got = crc32(bytes.substr(static_cast<std::size_t>(e.offset),
                                          static_cast<std::size_t>(e.size)));
      if (got != e.crc) {
        throw refuse(cat("has an entry ", e.name,
                         " whose bytes do not match its checksum (changed "
                         "after it was written)"));
      }
    }
  }
  // Every size libtorch will allocate is now bounded: read the code and
  // pickle entries through its file reader (which inflates).
  std::unordered_map<std::string, std::uint64_t> sizes;  // by name in archive
  for (const auto& e : entries) {
    const auto slash = e.name.find('/');
    sizes[slash == std::string::npos ? e.name : e.name.substr(slash + 1)] =
        e.size;
  }
  try {
    caffe2::serialize::PyTorchStreamReader reader(
        std::make_shared<MemoryReadAdapter>(bytes));
    for (const auto& e : entries) {
      const std::string_view n(e.name);
      auto ends_with = [&](std::string_view suffix) {
        return n.size() >= suffix.size() &&
               n.substr(n.size() - suffix.size()) == suffix;
      };
      // Entries are named ARCHIVE/code/..., ARCHIVE/data.pkl, ...
      const auto slash = n.find('/');
      const auto rel =
          slash == std::string_view::npos ? n : n.substr(slash + 1);
      const bool code = rel.substr(0, 5) == "code/" && ends_with(".py");
      const bool pickle = ends_with(".pkl") || ends_with("_pkl");
      if (!code && !pickle) continue;
      if (e.deflated && !code) {
        throw refuse(cat("has a compressed pickle ", e.name));
      }
      auto [data, size] = reader.getRecord(std::string(rel));
      const std::string_view bytes(static_cast<const char*>(data.get()), size);
      if (code) {
        if (const auto line = archive_code_problem(bytes)) {
          throw refuse(cat("has an entry ", e.name, " whose line ", line,
                           " is not an attribute declaration"));
        }
      } else {
        // A pickle X.pkl reads its storages from the records X/<key>.
        const std::string stem =
            ends_with(".pkl") ? std::string(rel.substr(0, rel.size() - 4))
                              : std::string();
        auto record_size = [&](const std::string& key) -> std::int64_t {
          if (stem.empty()) return -1;
          const auto it = sizes.find(stem + "/" + key);
          return it == sizes.end() ? -1 : static_cast<std::int64_t>(it->second);
        };
        const auto why = pickle_problem(bytes, record_size);
        if (!why.empty()) {
          throw refuse(cat("has a damaged pickle ", e.name, " (", why, ")"));
        }
      }
    }
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    throw refuse(ddpkit::detail::first_line(what));
  }
}

/// `check_archive` of the file at `path`.
inline void check_archive(const std::filesystem::path& path,
                          const std::string& what, const std::string& writers) {
  check_archive(std::string_view(read_whole_file(path, what)), what, writers);
}

}  // namespace ddpkit::detail
