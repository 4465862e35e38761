// ProgressDisplay, the rank-0 display: the bar (on a terminal: a
// pseudo-terminal here), its throughput, and the per-epoch and stop lines.
#include <fcntl.h>
#include <poll.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "../support.hpp"
#include "ddpkit/train/callbacks.hpp"

using namespace ddpkit;
using clock_type = std::chrono::steady_clock;

namespace {

/// Runs `f` with stdout (fd 1) on `fd`, then puts stdout back.
void with_stdout_on(int fd, const std::function<void()>& f) {
  std::cout.flush();
  std::fflush(stdout);
  const int saved = ::dup(STDOUT_FILENO);
  ::dup2(fd, STDOUT_FILENO);
  try {
    f();
  } catch (...) {
    std::fflush(stdout);
    ::dup2(saved, STDOUT_FILENO);
    ::close(saved);
    throw;
  }
  std::fflush(stdout);
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
}

/// What `f` prints with stdout on a pseudo-terminal in raw mode (so "\n"
/// stays "\n"), or "no pty: ..." when none can be opened.
std::string printed_on_terminal(const std::function<void()>& f) {
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY);
  if (master < 0 || ::grantpt(master) != 0 || ::unlockpt(master) != 0) {
    return "no pty: posix_openpt failed";
  }
  const int slave = ::open(::ptsname(master), O_RDWR | O_NOCTTY);
  if (slave < 0) {
    ::close(master);
    return "no pty: cannot open the slave";
  }
  termios raw{};
  ::tcgetattr(slave, &raw);
  ::cfmakeraw(&raw);
  ::tcsetattr(slave, TCSANOW, &raw);
  const std::string end = "<end of output>";
  with_stdout_on(slave, [&] {
    f();
    std::printf("%s", end.c_str());
  });
  // The terminal hands the bytes over asynchronously: read up to the
  // marker (or 10 s of silence).
  std::string out;
  char buf[4096];
  while (out.find(end) == std::string::npos) {
    pollfd p{master, POLLIN, 0};
    if (::poll(&p, 1, 10000) <= 0) break;
    const ssize_t n = ::read(master, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(slave);
  ::close(master);
  const auto at = out.find(end);
  return at == std::string::npos ? out + "<marker missing>" : out.substr(0, at);
}

/// What `f` prints with stdout on a regular file.
std::string printed_to_file(const std::function<void()>& f) {
  test::TempDir dir;
  const auto path = dir / "stdout";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(fd >= 0);
  with_stdout_on(fd, f);
  ::close(fd);
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

/// An epoch row as the Trainer would make it.
train::EpochMetrics epoch_row() {
  train::EpochMetrics m;
  m.epoch = 1;
  m.task = {{"train_loss", 0.5},
            {"train_acc", 0.25},
            {"val_loss", 0.75},
            {"val_acc", 0.6}};
  m.lr = 0.01;
  m.seconds = 8;
  m.train_seconds = 6;
  m.val_seconds = 2;
  m.train_images_per_second = 400;
  return m;
}

const std::string kEpochLine =
    "epoch 1/3  train_loss 0.5000  train_acc 0.2500  val_loss 0.7500  "
    "val_acc 0.6000  lr 0.01  8.0s (train 6.0s, val 2.0s)  400 train img/s\n";

}  // namespace

TEST_SUITE("train") {
  TEST_CASE(
      "progress bar: images per second over every rank since the epoch "
      "began, the bar's shape, the epoch line and the stop line") {
    // Two ranks; rank 0 has trained `count` images (its share) in the
    // epoch's `elapsed`: the bar shows count * world / elapsed.
    struct Draw {
      std::size_t step;
      double count, loss, elapsed;  // seconds since the epoch began
      double slowest = 0;           // seconds, measured after drawing
    };
    Draw draws[] = {{2, 600, 0.25, 4}, {8, 2400, 0.5, 6}};
    train::FitState s;
    s.world = 2;
    s.epochs = 3;
    s.epoch = 0;
    s.steps = 8;
    s.stop_reason =
        "early stopping after epoch 2: no better val_acc for 1 "
        "epochs";
    const std::string out = printed_on_terminal([&] {
      train::ProgressDisplay display(true);
      display.on(train::EpochBegin{s});
      // The second draw ends the epoch: drawn however soon it follows.
      for (Draw& d : draws) {
        s.step = d.step;
        s.count = d.count;
        s.loss_sum = d.loss * d.count;
        s.epoch_start = clock_type::now() -
                        std::chrono::duration_cast<clock_type::duration>(
                            std::chrono::duration<double>(d.elapsed));
        display.on(train::BatchEnd{s, 0.0});
        d.slowest =
            std::chrono::duration<double>(clock_type::now() - s.epoch_start)
                .count();
      }
      const auto m = epoch_row();
      display.on(train::EpochEnd{s, m});
      // Epoch 2: a bar (its last batch: drawn however soon it follows),
      // then the stop line on a line of its own.
      s.epoch = 1;
      display.on(train::EpochBegin{s});
      s.step = 8;
      display.on(train::BatchEnd{s, 0.0});
      display.on(train::FitEnd{s});
    });
    CAPTURE(out);
    REQUIRE(out.rfind("no pty", 0) != 0);
    const std::regex bar(
        "\repoch (\\d)/3 \\[(#*)(\\.*)\\] (\\d)/8 loss (\\d\\.\\d{4}) (\\d+) "
        "img/s ETA (\\d+)s ");
    std::vector<std::smatch> bars;
    for (std::sregex_iterator it(out.begin(), out.end(), bar), e; it != e;
         ++it) {
      bars.push_back(*it);
    }
    REQUIRE(bars.size() == 3);
    for (int i = 0; i < 2; ++i) {
      CAPTURE(i);
      const auto& b = bars[static_cast<std::size_t>(i)];
      const Draw& d = draws[i];
      CHECK(b[1] == "1");
      // 24 characters, a '#' per 1/24 of the epoch's batches done.
      CHECK(static_cast<std::size_t>(b[2].length()) == 24 * d.step / 8);
      CHECK(b[2].length() + b[3].length() == 24);
      CHECK(std::stoul(b[4]) == d.step);
      CHECK(b[5] == (i == 0 ? "0.2500" : "0.5000"));
      // Printed rounded: between the images over the longest the elapsed
      // time can have been and over the time set.
      const double shown = std::stod(b[6]);
      const double images = d.count * s.world;
      MESSAGE("bar ", i, ": ", shown, " img/s for ", images, " images in ",
              d.elapsed, " to ", d.slowest, " s");
      CHECK(shown >= std::floor(images / d.slowest));
      CHECK(shown <= std::ceil(images / d.elapsed));
    }
    CHECK(bars[2][1] == "2");
    // The epoch line clears the bar's line first; the stop line ends the
    // epoch-2 bar's line before it.
    CHECK(out.find("\r\033[K" + kEpochLine) != std::string::npos);
    CHECK(out.size() >= s.stop_reason.size() + 2);
    CHECK(out.substr(out.size() - s.stop_reason.size() - 2) ==
          "\n" + s.stop_reason + "\n");

    // Not a terminal: no bar, the epoch line alone; disabled: nothing.
    for (bool enabled : {true, false}) {
      CAPTURE(enabled);
      const std::string plain = printed_to_file([&] {
        train::ProgressDisplay display(enabled);
        s.epoch = 0;
        display.on(train::EpochBegin{s});
        s.step = 8;
        display.on(train::BatchEnd{s, 0.0});
        const auto m = epoch_row();
        display.on(train::EpochEnd{s, m});
      });
      CHECK(plain == (enabled ? kEpochLine : ""));
    }
    const std::string off = printed_on_terminal([&] {
      train::ProgressDisplay display(false);
      display.on(train::EpochBegin{s});
      display.on(train::BatchEnd{s, 0.0});
      display.on(train::FitEnd{s});
    });
    CHECK(off.empty());
  }

  TEST_CASE(
      "progress lines where stdout is not a terminal: every N batches and "
      "every S seconds, with step, loss, throughput and time left") {
    train::FitState s;
    s.world = 2;
    s.epochs = 3;
    s.epoch = 0;
    s.steps = 6;
    // Every 2 batches (time off): lines at steps 2, 4, 6 and nothing else.
    const std::string by_steps = printed_to_file([&] {
      train::ProgressDisplay display(
          true, train::ProgressOptions().every_n_steps(2).every_seconds(0));
      display.on(train::EpochBegin{s});
      s.epoch_start = clock_type::now() - std::chrono::seconds(4);
      for (std::size_t k = 1; k <= 6; ++k) {
        s.step = k;
        s.count = 100.0 * static_cast<double>(k);
        s.loss_sum = 0.5 * s.count;
        display.on(train::BatchEnd{s, 0.0});
      }
    });
    CAPTURE(by_steps);
    const std::regex line(
        "epoch 1/3 step (\\d)/6 loss 0\\.5000 (\\d+) img/s ETA (\\d+)s\n");
    std::vector<std::smatch> lines;
    for (std::sregex_iterator it(by_steps.begin(), by_steps.end(), line), e;
         it != e; ++it) {
      lines.push_back(*it);
    }
    REQUIRE(lines.size() == 3);
    std::string joined;
    for (const auto& m : lines) joined += m.str();
    CHECK(joined == by_steps);  // nothing but those lines
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(std::stoul(lines[i][1]) == 2 * (i + 1));
      // 2 ranks × 100 images per step over the 4 s since the epoch began.
      const double shown = std::stod(lines[i][2]);
      const double images = 2.0 * 100.0 * static_cast<double>(2 * (i + 1));
      CHECK(shown <= std::ceil(images / 4.0));
      CHECK(shown >= std::floor(images / 5.0));
    }
    CHECK(lines[2][3] == "0");  // the last batch: no time left

    // Every 0.2 s (steps off): a batch right after the epoch begins prints
    // nothing, one 0.25 s later prints a line, one right after it nothing.
    const std::string by_time = printed_to_file([&] {
      train::ProgressDisplay display(
          true, train::ProgressOptions().every_n_steps(0).every_seconds(0.2));
      display.on(train::EpochBegin{s});
      s.epoch_start = clock_type::now();
      s.step = 1;
      display.on(train::BatchEnd{s, 0.0});
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      s.step = 2;
      display.on(train::BatchEnd{s, 0.0});
      s.step = 3;
      display.on(train::BatchEnd{s, 0.0});
    });
    CAPTURE(by_time);
    CHECK(by_time.rfind("epoch 1/3 step 2/6 loss ", 0) == 0);
    CHECK(std::count(by_time.begin(), by_time.end(), '\n') == 1);

    // Both off, or --quiet (disabled): nothing.
    for (bool enabled : {true, false}) {
      const std::string none = printed_to_file([&] {
        train::ProgressDisplay display(enabled,
                                       train::ProgressOptions()
                                           .every_n_steps(enabled ? 0 : 1)
                                           .every_seconds(0));
        display.on(train::EpochBegin{s});
        for (std::size_t k = 1; k <= 6; ++k) {
          s.step = k;
          display.on(train::BatchEnd{s, 0.0});
        }
      });
      CHECK(none.empty());
    }
  }
}
