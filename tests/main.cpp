// The one test main. Run normally, it is doctest. Run with
// DDPKIT_TEST_WORKER=name (as `run_workers` does), it is one rank of a
// multi-process test and runs that worker instead.
// (doctest's implementation is doctest_impl.cpp.)
#include "doctest_torch.hpp"

#include <cstdio>
#include <cstdlib>
#include <exception>

#include "support.hpp"

namespace {

// Keeps the running case's name for DDPKIT_SKIP's report.
struct CurrentCase : doctest::IReporter {
  explicit CurrentCase(const doctest::ContextOptions& /*opts*/) {}
  void report_query(const doctest::QueryData& /*data*/) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& /*stats*/) override {}
  void test_case_start(const doctest::TestCaseData& data) override {
    ddpkit::test::current_case() = data.m_name;
  }
  void test_case_reenter(const doctest::TestCaseData& /*data*/) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& /*stats*/) override {}
  void test_case_exception(const doctest::TestCaseException& /*e*/) override {}
  void subcase_start(const doctest::SubcaseSignature& /*s*/) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData& /*data*/) override {}
  void log_message(const doctest::MessageData& /*data*/) override {}
  void test_case_skipped(const doctest::TestCaseData& /*data*/) override {}
};
REGISTER_LISTENER("ddpkit-current-case", 1, CurrentCase);

}  // namespace

int main(int argc, char** argv) {
  if (const char* name = std::getenv("DDPKIT_TEST_WORKER")) {
    auto it = ddpkit::test::workers().find(name);
    if (it == ddpkit::test::workers().end()) {
      std::fprintf(stderr, "no test worker named '%s'\n", name);
      return 99;
    }
    torch::set_num_threads(1);
    try {
      return it->second();
    } catch (const ddpkit::PeerFailure& e) {
      std::fprintf(stderr, "worker %s (rank %s) stopped: %s\n", name,
                   std::getenv("RANK") ? std::getenv("RANK") : "?", e.what());
      return ddpkit::kPeerFailureExitCode;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "worker %s (rank %s) failed: %s\n", name,
                   std::getenv("RANK") ? std::getenv("RANK") : "?", e.what());
      return 1;
    }
  }
  // DDPKIT_TEST_LAUNCH=name:N makes this process a self-spawn launcher of N
  // ranks of worker `name` (tests signal it like a user would).
  if (const char* launch = std::getenv("DDPKIT_TEST_LAUNCH")) {
    std::string spec = launch;
    auto colon = spec.find(':');
    auto name = spec.substr(0, colon);
    int n = std::stoi(spec.substr(colon + 1));
    ddpkit::dist::EnvVars env{{"DDPKIT_TEST_WORKER", name},
                              {"OMP_NUM_THREADS", "1"}};
    ::unsetenv("DDPKIT_TEST_LAUNCH");
    return ddpkit::dist::spawn(ddpkit::dist::SpawnOptions(n).env(env))
        .exit_code;
  }
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  const int rc = context.run();
  // A skipped case is not a pass: exit 77 (CTest: skipped) when nothing
  // failed but something was skipped (DDPKIT_SKIP, outside CI only).
  const auto& skipped = ddpkit::test::skipped_cases();
  if (rc == 0 && !skipped.empty() && !context.shouldExit()) {
    std::fprintf(stderr, "%zu test case(s) SKIPPED:\n", skipped.size());
    for (const auto& s : skipped) std::fprintf(stderr, "  %s\n", s.c_str());
    return 77;
  }
  return rc;
}
