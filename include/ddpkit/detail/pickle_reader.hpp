// SPDX-License-Identifier: BSD-3-Clause
// Reads files in torch.save's zip format with ddpkit's own unpickler, which
// understands what Python's `torch.load(weights_only=True)` understands and
// nothing more: dicts (plain and `collections.OrderedDict`, whose
// `_metadata` is ignored), lists, tuples, strings, bytes, numbers, booleans,
// None, and tensors rebuilt from their storages (`torch._utils.
// _rebuild_tensor_v2`, `_rebuild_parameter`). It reads the same on every
// libtorch version (libtorch's own unpickler turns an OrderedDict into None,
// and 1.13's lacks SETITEM), and a damaged or hostile file is an error
// naming the file, never code run or memory read out of bounds: every
// length is checked against the bytes that are there.
//
// Also reads the TorchScript type tags (`torch.jit._pickle.restore_type_tag`,
// `build_*list`) that `torch::pickle_save` wrote in ddpkit's older weight
// files.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/torch.h>

#include "ddpkit/detail/bytes.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/files.hpp"

namespace ddpkit::detail {

/// A zip archive held in memory, for PyTorchStreamReader.
class MemoryReadAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit MemoryReadAdapter(std::string_view bytes) : bytes_(bytes) {}
  std::size_t size() const override {
    return bytes_.size();
  }
  std::size_t read(std::uint64_t pos, void* buf, std::size_t n,
                   const char* /*what*/ = "") const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<std::size_t>(n, bytes_.size() - static_cast<std::size_t>(pos));
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  std::string_view bytes_;
};

namespace pickle {

/// LONG1's payload (at most 8 bytes): a little-endian two's-complement
/// integer.
inline std::int64_t long1_value(std::string_view bytes) {
  std::uint64_t v = read_le(bytes);
  if (!bytes.empty() && bytes.size() < 8 &&
      (static_cast<unsigned char>(bytes.back()) & 0x80))
    v |= ~std::uint64_t{0} << (8 * bytes.size());
  return static_cast<std::int64_t>(v);
}

/// A value on the unpickler's stack.
struct Obj;
using Ptr = std::shared_ptr<Obj>;
struct Obj {
  enum Kind {
    none,
    boolean,
    integer,
    real,
    string,
    bytes,
    tuple,
    list,
    dict,
    global,  // s = "module name"
    storage,
    tensor,
    mark
  } kind = none;
  bool b = false;
  std::int64_t i = 0;
  double d = 0;
  std::string s;
  std::vector<Ptr> items;                    // tuple, list
  std::vector<std::pair<Ptr, Ptr>> entries;  // dict, in insertion order
  torch::Tensor t;                           // storage (1-D) or tensor
};

inline Ptr make(Obj::Kind k) {
  auto o = std::make_shared<Obj>();
  o->kind = k;
  return o;
}

inline c10::ScalarType storage_dtype(std::string_view name, bool& ok) {
  static const std::map<std::string_view, c10::ScalarType> kTypes = {
      {"torch DoubleStorage", c10::kDouble},
      {"torch FloatStorage", c10::kFloat},
      {"torch HalfStorage", c10::kHalf},
      {"torch BFloat16Storage", c10::kBFloat16},
      {"torch LongStorage", c10::kLong},
      {"torch IntStorage", c10::kInt},
      {"torch ShortStorage", c10::kShort},
      {"torch CharStorage", c10::kChar},
      {"torch ByteStorage", c10::kByte},
      {"torch BoolStorage", c10::kBool},
      {"torch ComplexDoubleStorage", c10::kComplexDouble},
      {"torch ComplexFloatStorage", c10::kComplexFloat}};
  const auto it = kTypes.find(name);
  ok = it != kTypes.end();
  return ok ? it->second : c10::kFloat;
}

/// Loads a storage's bytes: `record(key)` returns the record data/<key>.
using RecordFn =
    std::function<std::pair<at::DataPtr, std::size_t>(const std::string&)>;

class Unpickler {
 public:
  Unpickler(std::string_view p, RecordFn record, std::string what)
      : p_(p), record_(std::move(record)), what_(std::move(what)) {}

  Ptr run() {
    while (true) {
      if (pos_ >= p_.size()) fail("ends without STOP");
      const auto op = static_cast<unsigned char>(p_[pos_++]);
      op_ = op;
      switch (op) {
        case 0x80: take(1); break;  // PROTO
        case 0x95: take(8); break;  // FRAME
        case '.':
          if (stack_.size() != 1) fail("STOP with an unbalanced stack");
          return pop();
        case '(': stack_.push_back(make(Obj::mark)); break;
        case 'N': push(make(Obj::none)); break;
        case 0x88:
        case 0x89: {
          auto o = make(Obj::boolean);
          o->b = op == 0x88;
          push(o);
          break;
        }
        case 'K': push_int(static_cast<std::int64_t>(read_le(take(1)))); break;
        case 'M': push_int(static_cast<std::int64_t>(read_le(take(2)))); break;
        case 'J':
          push_int(static_cast<std::int32_t>(
              static_cast<std::uint32_t>(read_le(take(4)))));
          break;
        case 0x8a: {  // LONG1
          const auto bytes = take(static_cast<std::size_t>(read_le(take(1))));
          if (bytes.size() > 8) fail("an integer of more than 64 bits");
          push_int(long1_value(bytes));
          break;
        }
        case 'G': {  // BINFLOAT: big-endian double
          const auto b = take(8);
          const std::uint64_t v = read_be(b);
          auto o = make(Obj::real);
          std::memcpy(&o->d, &v, 8);
          push(o);
          break;
        }
        case 'X': push_str(Obj::string, take(read_le(take(4)))); break;
        case 0x8c: push_str(Obj::string, take(read_le(take(1)))); break;
        case 0x8d: push_str(Obj::string, take(read_le(take(8)))); break;
        case 'B': push_str(Obj::bytes, take(read_le(take(4)))); break;
        case 'C': push_str(Obj::bytes, take(read_le(take(1)))); break;
        case 0x8e: push_str(Obj::bytes, take(read_le(take(8)))); break;
        case ')': push(make(Obj::tuple)); break;
        case 't': {
          auto o = make(Obj::tuple);
          o->items = pop_to_mark();
          push(o);
          break;
        }
        case 0x85:
        case 0x86:
        case 0x87: {
          auto o = make(Obj::tuple);
          o->items.resize(op - 0x84);
          for (std::size_t k = o->items.size(); k-- > 0;) o->items[k] = pop();
          push(o);
          break;
        }
        case ']': push(make(Obj::list)); break;
        case 'a': {
          auto v = pop();
          expect(top(), Obj::list, "APPEND")->items.push_back(v);
          break;
        }
        case 'e': {
          auto vs = pop_to_mark();
          auto& l = expect(top(), Obj::list, "APPENDS")->items;
          l.insert(l.end(), vs.begin(), vs.end());
          break;
        }
        case '}': push(make(Obj::dict)); break;
        case 's': {
          auto v = pop();
          auto k = pop();
          set_item(expect(top(), Obj::dict, "SETITEM"), k, v);
          break;
        }
        case 'u': {
          auto kvs = pop_to_mark();
          if (kvs.size() % 2) fail("SETITEMS with an odd number of values");
          auto d = expect(top(), Obj::dict, "SETITEMS");
          for (std::size_t k = 0; k < kvs.size(); k += 2)
            set_item(d, kvs[k], kvs[k + 1]);
          break;
        }
        case 'q': memo_put(read_le(take(1))); break;
        case 'r': memo_put(read_le(take(4))); break;
        case 0x94: memo_put(memo_.size()); break;
        case 'h': memo_get(read_le(take(1))); break;
        case 'j': memo_get(read_le(take(4))); break;
        case 'c': {
          auto module = line();
          auto name = line();
          push_global(std::string(module) + " " + std::string(name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          auto name = expect(pop(), Obj::string, "STACK_GLOBAL");
          auto module = expect(pop(), Obj::string, "STACK_GLOBAL");
          push_global(module->s + " " + name->s);
          break;
        }
        case 'R': {
          auto args = expect(pop(), Obj::tuple, "REDUCE");
          auto fn = expect(pop(), Obj::global, "REDUCE");
          push(call(fn->s, args->items));
          break;
        }
        case 0x81: {  // NEWOBJ: cls.__new__(cls, *args)
          auto args = expect(pop(), Obj::tuple, "NEWOBJ");
          auto cls = expect(pop(), Obj::global, "NEWOBJ");
          push(call(cls->s, args->items));
          break;
        }
        case 'b': {  // BUILD: an OrderedDict's attributes (_metadata)
          pop();
          if (top()->kind != Obj::dict) fail("BUILD on something not a dict");
          break;
        }
        case 'Q':
          push(load_storage(expect(pop(), Obj::tuple, "BINPERSID")));
          break;
        default: fail(cat("an opcode ddpkit does not read (", int(op), ")"));
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw UsageError(cat(what_, ": cannot be read as a torch.save file: ", why,
                         " (opcode ", int(op_), " before byte ", pos_, ")"));
  }
  std::string_view take(std::uint64_t n) {
    if (n > p_.size() - pos_) fail("a field runs past the end of the pickle");
    auto v = p_.substr(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return v;
  }
  std::string_view line() {
    const auto nl = p_.find('\n', pos_);
    if (nl == std::string_view::npos) fail("a line runs past the end");
    auto v = p_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return v;
  }
  void push(Ptr o) {
    stack_.push_back(std::move(o));
  }
  void push_int(std::int64_t v) {
    auto o = make(Obj::integer);
    o->i = v;
    push(o);
  }
  void push_str(Obj::Kind k, std::string_view s) {
    auto o = make(k);
    o->s = std::string(s);
    push(o);
  }
  void push_global(std::string name) {
    auto o = make(Obj::global);
    o->s = std::move(name);
    push(o);
  }
  Ptr pop() {
    if (stack_.empty() || stack_.back()->kind == Obj::mark)
      fail("pops an empty stack");
    auto o = std::move(stack_.back());
    stack_.pop_back();
    return o;
  }
  Ptr& top() {
    if (stack_.empty() || stack_.back()->kind == Obj::mark)
      fail("reads an empty stack");
    return stack_.back();
  }
  std::vector<Ptr> pop_to_mark() {
    std::size_t k = stack_.size();
    while (k > 0 && stack_[k - 1]->kind != Obj::mark) --k;
    if (k == 0) fail("no MARK to pop to");
    std::vector<Ptr> out(std::make_move_iterator(stack_.begin() + k),
                         std::make_move_iterator(stack_.end()));
    stack_.resize(k - 1);
    return out;
  }
  Ptr expect(Ptr o, Obj::Kind k, const char* op) {
    if (o->kind != k) fail(cat(op, " on a value of the wrong kind"));
    return o;
  }
  void set_item(const Ptr& d, Ptr k, Ptr v) {
    if (k->kind != Obj::string && k->kind != Obj::integer)
      fail("a dict key that is not a string or an integer");
    for (auto& [key, value] : d->entries) {
      if (key->kind == k->kind && key->s == k->s && key->i == k->i) {
        value = std::move(v);
        return;
      }
    }
    d->entries.emplace_back(std::move(k), std::move(v));
  }
  void memo_put(std::uint64_t index) {
    // Picklers number memo entries from 0, each at least 2 bytes of pickle.
    if (index > p_.size()) fail("a memo index beyond the pickle's size");
    memo_[index] = top();
  }
  void memo_get(std::uint64_t index) {
    const auto it = memo_.find(index);
    if (it == memo_.end()) fail("a memo index that was never set");
    push(it->second);
  }

  Ptr call(const std::string& fn, const std::vector<Ptr>& args) {
    auto arg = [&](std::size_t k, Obj::Kind kind) -> const Ptr& {
      if (k >= args.size() || args[k]->kind != kind)
        fail(cat(fn, ": argument ", k, " is missing or of the wrong kind"));
      return args[k];
    };
    if (fn == "collections OrderedDict") return make(Obj::dict);
    if (fn == "torch._utils _rebuild_tensor_v2" ||
        fn == "torch._utils _rebuild_tensor") {
      const auto& st = arg(0, Obj::storage);
      const auto& size = arg(2, Obj::tuple);
      const auto& stride = arg(3, Obj::tuple);
      const std::int64_t offset = arg(1, Obj::integer)->i;
      std::vector<std::int64_t> sz, sd;
      for (const auto& v : size->items) {
        if (v->kind != Obj::integer || v->i < 0) fail("a bad tensor size");
        sz.push_back(v->i);
      }
      for (const auto& v : stride->items) {
        if (v->kind != Obj::integer || v->i < 0) fail("a bad tensor stride");
        sd.push_back(v->i);
      }
      if (sz.size() != sd.size()) fail("sizes and strides differ in length");
      // The last element the view touches must lie inside the storage.
      std::int64_t last = offset, numel = 1;
      for (std::size_t k = 0; k < sz.size(); ++k) {
        if (sz[k] == 0) numel = 0;
        std::int64_t span = 0;
        if (sz[k] > 0 && (__builtin_mul_overflow(sz[k] - 1, sd[k], &span) ||
                          __builtin_add_overflow(last, span, &last)))
          fail("a tensor that overflows its storage");
      }
      if (offset < 0 || (numel > 0 && last >= st->t.numel()))
        fail(cat("a tensor that reaches past its storage (", st->t.numel(),
                 " elements)"));
      auto o = make(Obj::tensor);
      o->t = numel == 0 ? torch::empty(sz, st->t.options())
                        : st->t.as_strided(sz, sd, offset);
      return o;
    }
    if (fn == "torch._utils _rebuild_parameter" ||
        fn == "torch._utils _rebuild_parameter_with_state") {
      return arg(0, Obj::tensor);
    }
    if (fn == "torch.jit._pickle restore_type_tag") {
      if (args.empty()) fail("restore_type_tag without arguments");
      return args[0];
    }
    if (fn == "torch.jit._pickle build_intlist" ||
        fn == "torch.jit._pickle build_doublelist" ||
        fn == "torch.jit._pickle build_boollist" ||
        fn == "torch.jit._pickle build_tensorlist") {
      return arg(0, Obj::list);
    }
    if (fn == "torch Size") return arg(0, Obj::tuple);
    fail(cat("it holds a ", fn,
             ", which is not a tensor, a number, a string or a container"));
  }

  Ptr load_storage(const Ptr& id) {
    const auto& v = id->items;
    const bool shape = v.size() == 5 && v[0]->kind == Obj::string &&
                       v[0]->s == "storage" && v[1]->kind == Obj::global &&
                       v[2]->kind == Obj::string && v[4]->kind == Obj::integer;
    if (!shape) fail("a persistent id that is not a storage");
    bool known = false;
    const auto dtype = storage_dtype(v[1]->s, known);
    if (!known) fail(cat("an unsupported storage type ", v[1]->s));
    const std::int64_t numel = v[4]->i;
    const auto item = static_cast<std::int64_t>(c10::elementSize(dtype));
    std::int64_t bytes = 0;
    if (numel < 0 || __builtin_mul_overflow(numel, item, &bytes))
      fail(cat("a storage of ", numel, " elements"));
    auto& cached = storages_[v[2]->s];
    if (!cached.defined()) {
      cached = torch::empty({numel}, torch::TensorOptions().dtype(dtype));
      if (bytes > 0) {
        auto [data, size] = record_(v[2]->s);
        if (size < static_cast<std::size_t>(bytes))
          fail(cat("storage '", v[2]->s, "' claims ", bytes,
                   " bytes but its record holds ", size));
        std::memcpy(cached.data_ptr(), data.get(),
                    static_cast<std::size_t>(bytes));
      }
    } else if (cached.scalar_type() != dtype || cached.numel() != numel) {
      fail(cat("storage '", v[2]->s, "' is used with two shapes"));
    }
    auto o = make(Obj::storage);
    o->t = cached;
    return o;
  }

  std::string_view p_;
  std::size_t pos_ = 0;
  unsigned char op_ = 0;
  RecordFn record_;
  std::string what_;
  std::vector<Ptr> stack_;
  std::map<std::uint64_t, Ptr> memo_;
  std::map<std::string, torch::Tensor> storages_;
};

/// `o` as a c10::IValue: dicts become GenericDicts (insertion order kept),
/// lists GenericLists, tuples Tuples; a storage or a global is refused.
inline c10::IValue to_ivalue(const Ptr& o, const std::string& what,
                             int depth = 0) {
  if (depth > 64) {
    throw UsageError(cat(what, ": nested more than 64 levels deep"));
  }
  switch (o->kind) {
    case Obj::none: return c10::IValue();
    case Obj::boolean: return c10::IValue(o->b);
    case Obj::integer: return c10::IValue(o->i);
    case Obj::real: return c10::IValue(o->d);
    case Obj::string: return c10::IValue(o->s);
    case Obj::bytes: {
      auto t =
          torch::empty({static_cast<std::int64_t>(o->s.size())}, torch::kUInt8);
      if (!o->s.empty()) std::memcpy(t.data_ptr(), o->s.data(), o->s.size());
      return c10::IValue(t);
    }
    case Obj::tensor: return c10::IValue(o->t);
    case Obj::tuple: {
      std::vector<c10::IValue> items;
      for (const auto& v : o->items)
        items.push_back(to_ivalue(v, what, depth + 1));
      return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
    }
    case Obj::list: {
      c10::impl::GenericList l(c10::AnyType::get());
      for (const auto& v : o->items) l.push_back(to_ivalue(v, what, depth + 1));
      return c10::IValue(l);
    }
    case Obj::dict: {
      c10::impl::GenericDict d(c10::AnyType::get(), c10::AnyType::get());
      for (const auto& [k, v] : o->entries)
        d.insert_or_assign(to_ivalue(k, what, depth + 1),
                           to_ivalue(v, what, depth + 1));
      return c10::IValue(d);
    }
    default:
      throw UsageError(cat(what, ": holds a ",
                           o->kind == Obj::global ? o->s : "storage",
                           " where a value was expected"));
  }
}

}  // namespace pickle

/// The object in a torch.save zip archive held in `bytes` (see the top of
/// this file); `what` names the file in errors. Tensors come back on the
/// CPU, contiguous or as views of their storage.
inline c10::IValue read_torch_save(std::string_view bytes,
                                   const std::string& what) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(
        std::make_shared<MemoryReadAdapter>(bytes));
    if (reader.hasRecord("byteorder")) {
      auto [order, n] = reader.getRecord("byteorder");
      if (std::string_view(static_cast<const char*>(order.get()), n) !=
          "little")
        throw UsageError(cat(what, ": written on a big-endian machine"));
    }
    if (!reader.hasRecord("data.pkl")) {
      throw UsageError(cat(what, ": not a torch.save file (no data.pkl)"));
    }
    auto [data, size] = reader.getRecord("data.pkl");
    const std::string_view p(static_cast<const char*>(data.get()), size);
    pickle::Unpickler u(
        p,
        [&](const std::string& key) -> std::pair<at::DataPtr, std::size_t> {
          const std::string name = "data/" + key;
          if (!reader.hasRecord(name)) {
            throw UsageError(
                cat(what, ": storage record ", name, " is missing"));
          }
          auto [ptr, n] = reader.getRecord(name);
          return {std::move(ptr), n};
        },
        what);
    return pickle::to_ivalue(u.run(), what);
  } catch (const c10::Error& e) {
    const std::string w = e.what_without_backtrace();
    throw UsageError(cat(what, ": cannot be read as a torch.save file (",
                         ddpkit::detail::first_line(w), ")"));
  }
}

}  // namespace ddpkit::detail
