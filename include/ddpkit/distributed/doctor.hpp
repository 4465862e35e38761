// SPDX-License-Identifier: BSD-3-Clause
// The verdict of `ddpkit-doctor` (scripts/ddpkit-doctor, installed beside
// ddpkit's other programs) printed by a failing job itself: when a rank
// ends on a lost peer, a desync or a failed collective, the first rank to
// claim the flight-record folder waits briefly for the other ranks'
// records, runs the doctor on them, keeps its whole report in
// DIR/verdict.txt and prints the verdict's first line; the other ranks
// wait for that report before they exit. Nothing happens
// when the doctor or Python cannot be found.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <thread>

namespace ddpkit::dist {

/// Where ddpkit-doctor is: `$DDPKIT_DOCTOR`, else beside this program (a
/// build's bin/ or an install's bin/), else on `PATH`; empty when nowhere.
inline std::filesystem::path find_doctor() {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (const char* e = std::getenv("DDPKIT_DOCTOR"); e != nullptr && *e) {
    return fs::exists(e, ec) ? fs::path(e) : fs::path();
  }
  const auto exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto here = exe.parent_path() / "ddpkit-doctor";
    if (fs::exists(here, ec)) return here;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  for (std::size_t at = 0; at <= dirs.size();) {
    auto end = dirs.find(':', at);
    if (end == std::string::npos) end = dirs.size();
    const auto p = fs::path(dirs.substr(at, end - at)) / "ddpkit-doctor";
    if (end > at && fs::exists(p, ec)) return p;
    at = end + 1;
  }
  return {};
}

namespace detail {

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

inline std::size_t count_records(const std::filesystem::path& dir) {
  std::error_code ec;
  std::size_t n = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
    const auto name = f.path().filename().string();
    if (name.rfind("rank-", 0) == 0 && f.path().extension() == ".json") ++n;
  }
  return n;
}

}  // namespace detail

/// Runs ddpkit-doctor on the flight records in `dir` once per folder and
/// returns its first line. The first rank to create DIR/verdict.claim
/// (O_EXCL) does it: it waits until no new record has appeared for a
/// second (at most `settle`), runs the doctor and renames its report to
/// DIR/verdict.txt. Another rank waits up to `settle` + 5 s for that file
/// and returns "" (so the job's first exit, which a launcher answers by
/// stopping the other ranks, does not cut the doctor short). "" too when
/// the doctor or Python is missing, or the doctor fails.
inline std::string doctor_verdict(
    const std::filesystem::path& dir,
    std::chrono::milliseconds settle = std::chrono::seconds(3)) {
  namespace fs = std::filesystem;
  using Clock = std::chrono::steady_clock;
  if (dir.empty() || detail::count_records(dir) == 0) return {};
  const auto doctor = find_doctor();
  if (doctor.empty()) return {};
  const auto verdict = dir / "verdict.txt";
  const auto claim = dir / "verdict.claim";
  const auto start = Clock::now();
  const int fd = ::open(claim.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) {
    // Another rank runs it: wait for its report.
    std::error_code ec;
    while (!fs::exists(verdict, ec) &&
           Clock::now() - start < settle + std::chrono::seconds(5)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return {};
  }
  ::close(fd);
  auto changed = start;
  std::size_t seen = detail::count_records(dir);
  while (Clock::now() - start < settle &&
         Clock::now() - changed < std::chrono::seconds(1)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto n = detail::count_records(dir);
    if (n != seen) {
      seen = n;
      changed = Clock::now();
    }
  }
  const auto tmp = dir / "verdict.txt.tmp";
  const std::string cmd = "python3 " + detail::shell_quote(doctor.string()) +
                          " " + detail::shell_quote(dir.string()) + " > " +
                          detail::shell_quote(tmp.string()) +
                          " 2>&1 < /dev/null";
  const int status = std::system(cmd.c_str());
  // The doctor exits 0 (no fault) or 1 (a fault); anything else (no
  // Python: 127) is not a verdict.
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) > 1) {
    std::error_code ec;
    fs::remove(tmp, ec);
    return {};
  }
  std::string first;
  std::getline(std::ifstream(tmp), first);
  std::error_code ec;
  fs::rename(tmp, verdict, ec);
  return ec ? std::string() : first;
}

/// Prints `ddpkit-doctor: <verdict> (all of it: DIR/verdict.txt)` on
/// stderr when this rank ran the doctor (see doctor_verdict).
inline void print_doctor_verdict(const std::filesystem::path& dir) {
  const auto first = doctor_verdict(dir);
  if (first.empty()) return;
  std::fprintf(stderr, "ddpkit-doctor: %s (the whole report: %s)\n",
               first.c_str(), (dir / "verdict.txt").c_str());
  std::fflush(stderr);
}

}  // namespace ddpkit::dist
