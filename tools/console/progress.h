// A training loop's progress, printed by rank 0 of the tools' programs (train_fashion_mnist,
// train_gpt): a bar redrawn in place on a terminal, a plain line every 10% otherwise (logs, pipes,
// `dtrain run`'s relay of a worker's output).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <utility>

namespace console {

class Progress {
 public:
  // title: what runs ("epoch 1/3", "train"); unit: what the rate counts ("samples", "tokens").
  Progress(std::string title, std::string unit, int64_t total_steps)
      : title_(std::move(title)),
        unit_(std::move(unit)),
        total_(total_steps),
        tty_(isatty(STDOUT_FILENO)),
        start_(Clock::now()) {}

  // After `step` of the steps, `items` units done since the start. loss() is called only when a
  // line is drawn: reading a loss off a GPU waits for the step to finish, and a wait every step
  // would keep the host from queueing the next one meanwhile.
  template <typename LossFn>
  void update(int64_t step, int64_t items, LossFn&& loss) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    const double rate = static_cast<double>(items) / std::max(elapsed, 1e-9);
    const double eta = step > 0 ? elapsed / static_cast<double>(step) * (total_ - step) : 0.0;
    const int percent = static_cast<int>(100 * step / std::max<int64_t>(total_, 1));
    char line[256];
    if (tty_) {
      // Redraw at most ten times a second: a step can take well under a millisecond.
      const auto now = Clock::now();
      if (step != total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
      last_draw_ = now;
      std::snprintf(line, sizeof line, "\r%s [%-25s] %3d%% %8.0f %s/s loss %.4f ETA %5.1fs",
                    title_.c_str(), std::string(percent / 4, '#').c_str(), percent, rate,
                    unit_.c_str(), loss(), eta);
      std::cout << line << std::flush;
    } else if (percent >= next_percent_ || step == total_) {
      std::snprintf(line, sizeof line, "%s %3d%% step %lld/%lld %.0f %s/s loss %.4f ETA %.1fs",
                    title_.c_str(), percent, static_cast<long long>(step),
                    static_cast<long long>(total_), rate, unit_.c_str(), loss(), eta);
      std::cout << line << std::endl;
      next_percent_ = percent / 10 * 10 + 10;
    }
  }
  // The steps in all, when they change on the way (in place, a re-formed group deals the rest of
  // the epoch anew).
  void set_total(int64_t total_steps) { total_ = total_steps; }
  // Ends the redrawn line.
  void done() {
    if (tty_) std::cout << std::endl;
  }

 private:
  using Clock = std::chrono::steady_clock;
  std::string title_, unit_;
  int64_t total_;
  bool tty_;
  Clock::time_point start_;
  Clock::time_point last_draw_{};
  int next_percent_ = 10;
};

}  // namespace console
