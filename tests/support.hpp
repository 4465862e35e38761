// Test support: multi-process "workers" that the test binary runs in child
// processes (spawned through ddpkit's own launcher), and temp folders.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "doctest_torch.hpp"
#include "test_paths.hpp"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ddpkit/detail/archive_check.hpp"
#include "ddpkit/distributed.hpp"

namespace ddpkit::test {

/// The larger of a running maximum and `d`, where a NaN `d` is infinitely
/// large (std::max(0.0, NaN) is 0.0: a NaN weight would pass a tolerance).
inline double worse(double worst, double d) {
  return std::isnan(d) ? std::numeric_limits<double>::infinity()
                       : std::max(worst, d);
}

using WorkerFn = int (*)();

inline std::map<std::string, WorkerFn>& workers() {
  static std::map<std::string, WorkerFn> table;
  return table;
}

struct RegisterWorker {
  RegisterWorker(const char* name, WorkerFn fn) {
    workers()[name] = fn;
  }
};

/// Defines a function run in each rank's process by `run_workers("name")`.
/// It returns the process exit code; throwing fails the rank too.
#define DDPKIT_WORKER(name)                                         \
  static int name##_worker_fn();                                    \
  static ::ddpkit::test::RegisterWorker name##_worker_registration( \
      #name, &name##_worker_fn);                                    \
  static int name##_worker_fn()

/// True when running under CI (`CI=true`): a prerequisite the project's
/// install script provides must then be there, so a check that would skip
/// fails instead.
inline bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci && std::string(ci) == "true";
}

/// The test cases skipped in this process ("case: why"), in order.
inline std::vector<std::string>& skipped_cases() {
  static std::vector<std::string> list;
  return list;
}

/// The name of the test case running now (set by the listener in main.cpp).
inline std::string& current_case() {
  static std::string name;
  return name;
}

/// The one way a doctest case skips; use DDPKIT_SKIP(why), which returns
/// from the case. Under CI=true (where scripts/install-deps.sh and root
/// provide every prerequisite) it fails the case instead. Elsewhere it
/// prints "SKIPPED: <case>: why", appends that line to $DDPKIT_SKIP_LOG
/// when set (scripts/test.sh lists the file in its summary), and the test
/// process then exits 77 unless something failed (main.cpp), which CTest
/// reports as skipped: a skip never counts as a pass.
inline void skip_case(const std::string& why) {
  if (in_ci()) {
    const std::string failure = why + "; CI=true, so this is not skipped";
    FAIL(failure);
  }
  const auto line = current_case() + ": " + why;
  skipped_cases().push_back(line);
  MESSAGE("SKIPPED: " << why);
  if (const char* log = std::getenv("DDPKIT_SKIP_LOG")) {
    std::ofstream(log, std::ios::app) << "ddpkit_tests: " << line << "\n";
  }
}
#define DDPKIT_SKIP(why)            \
  do {                              \
    ::ddpkit::test::skip_case(why); \
    return;                         \
  } while (false)

/// For a case that this libtorch cannot run: tests/CMakeLists.txt excludes
/// it by name from such builds (scripts/test.sh lists the exclusions), so
/// reaching it there is an error, never a pass.
#define DDPKIT_REQUIRE_BUILD(cond, why)                                \
  do {                                                                 \
    if (!(cond)) {                                                     \
      FAIL("this build cannot run this case ("                         \
           << why                                                      \
           << "); tests/CMakeLists.txt excludes it by name from such " \
              "builds, so it should not have run");                    \
    }                                                                  \
  } while (false)

/// The Python with torch 2.x and torchvision that scripts/install-deps.sh
/// puts in the project's virtual environment (configured_python(), set by
/// CMake; the environment variable DDPKIT_PYTHON overrides it), or "" when
/// it cannot import them.
inline std::string python_with_torch() {
  std::string py;
  if (const char* env = std::getenv("DDPKIT_PYTHON")) py = env;
  if (py.empty()) py = configured_python();
  if (py.empty()) return "";
  const std::string cmd =
      py + " -c 'import torch, torchvision' >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0 ? py : "";
}

/// Writes named tensors as one dict that Python's plain `torch.load`
/// (weights_only) reads.
inline void save_tensors(
    const std::filesystem::path& p,
    const std::vector<std::pair<std::string, torch::Tensor>>& items) {
  c10::Dict<std::string, torch::Tensor> d;
  for (const auto& [k, v] : items) d.insert(k, v);
  std::ofstream(p, std::ios::binary)
      << ddpkit::compat::save_for_python(c10::IValue(d));
}

/// Runs `check` (a Python script's text) with the project's Python with
/// torch and torchvision, arguments `args`; its exit status. When there is
/// no such Python: skip_case (a failure under CI), and -1: return then.
inline int run_python_check(const std::filesystem::path& dir,
                            const std::string& check, const std::string& args) {
  const auto py = python_with_torch();
  if (py.empty()) {
    // scripts/install-deps.sh makes the environment: in CI it must be there.
    skip_case(
        "no Python with torch and torchvision (run scripts/install-deps.sh)");
    return -1;
  }
  std::ofstream(dir / "check.py") << check;
  const auto cmd = py + " " + (dir / "check.py").string() + " " + args;
  return std::system(cmd.c_str());
}

/// A fresh folder under the system temp dir, removed by the destructor.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("ddpkit-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const {
    return path_;
  }
  std::string str() const {
    return path_.string();
  }
  std::filesystem::path operator/(const std::string& p) const {
    return path_ / p;
  }

 private:
  std::filesystem::path path_;
};

/// The bytes of `p` (for tests that damage files).
inline std::string file_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
inline void write_file_bytes(const std::filesystem::path& p,
                             const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
inline void write_file_bytes(const std::filesystem::path& p,
                             const std::vector<unsigned char>& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

/// Where libtorch's pickler wrote the string `s` (BINUNICODE: 'X', a 4-byte
/// little-endian length, the bytes) in a torch.save / OutputArchive file.
inline std::size_t find_pickled_string(const std::string& bytes,
                                       const std::string& s) {
  std::string pattern = "X";
  for (int i = 0; i < 4; ++i)
    pattern += static_cast<char>((s.size() >> (8 * i)) & 0xff);
  return bytes.find(pattern + s);
}

/// Sets the storage offset of the tensor pickled right after the dict key
/// `key` (BINPERSID, BINPUT n, BININT1 offset) to `offset`: the tensor then
/// claims elements past the end of its storage. False when not found.
inline bool set_pickled_storage_offset(std::string& bytes,
                                       const std::string& key,
                                       unsigned char offset) {
  const auto at = find_pickled_string(bytes, key);
  if (at == std::string::npos) return false;
  const auto q = bytes.find('Q', at);
  if (q == std::string::npos || q + 4 >= bytes.size() || bytes[q + 1] != 'q' ||
      bytes[q + 3] != 'K' || bytes[q + 4] != 0)
    return false;
  bytes[q + 4] = static_cast<char>(offset);
  return true;
}

/// The folder a worker should write its results to (set by run_workers).
inline std::filesystem::path worker_dir() {
  const char* d = std::getenv("DDPKIT_TEST_DIR");
  return d ? std::filesystem::path(d) : std::filesystem::temp_directory_path();
}

/// Short timeouts so a broken test fails in seconds, not minutes.
inline dist::GroupOptions test_group_options() {
  return dist::GroupOptions()
      .rendezvous_timeout(std::chrono::seconds(30))
      .collective_timeout(std::chrono::seconds(30));
}

/// The process group of the current worker.
inline dist::Group worker_group() {
  return dist::Group::init(dist::read_env(), test_group_options());
}

/// Runs the worker `name` as `world_size` real processes over gloo on
/// loopback, each told to write into `dir`.
inline dist::SpawnResult run_workers(
    const std::string& name, int world_size, const std::string& dir = "",
    std::vector<std::pair<std::string, std::string>> env = {}) {
  env.emplace_back("DDPKIT_TEST_WORKER", name);
  if (!dir.empty()) env.emplace_back("DDPKIT_TEST_DIR", dir);
  env.emplace_back("OMP_NUM_THREADS", "1");
  return dist::spawn(dist::SpawnOptions(world_size)
                         .env(std::move(env))
                         .quiet_workers(false)
                         .report(false));
}

/// `run_workers`, and how long it took (tests that check a failure is
/// noticed promptly).
struct TimedRun {
  dist::SpawnResult result;
  double seconds;
};
inline TimedRun timed_run_workers(
    const std::string& name, int world_size, const std::string& dir = "",
    std::vector<std::pair<std::string, std::string>> env = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  auto result = run_workers(name, world_size, dir, std::move(env));
  return {std::move(result),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count()};
}

/// Loads a tensor a worker saved with `save_tensor`.
inline torch::Tensor load_tensor(const std::filesystem::path& p) {
  torch::Tensor t;
  torch::load(t, p.string());
  return t;
}

inline void save_tensor(const torch::Tensor& t,
                        const std::filesystem::path& p) {
  torch::save(t, p.string());
}

/// For tests of the checks behind the zip's CRC-32 (a damaged pickle, a
/// bad offset): while one lives, `check_archive` skips the checksums, as
/// it does for a file whose writer recorded none.
struct WithoutZipChecksums {
  WithoutZipChecksums() : was(ddpkit::detail::verify_zip_checksums()) {
    ddpkit::detail::verify_zip_checksums() = false;
  }
  ~WithoutZipChecksums() {
    ddpkit::detail::verify_zip_checksums() = was;
  }
  bool was;
};

}  // namespace ddpkit::test
