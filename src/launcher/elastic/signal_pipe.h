// SignalPipe: turns asynchronous signals (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT) into bytes on a pipe,
// the classic self-pipe trick, so a poll() loop wakes up on them and does the real work outside the
// handler. The handler only write()s the signal number (async-signal-safe); everything else happens
// in the loop.
#pragma once

#include <signal.h>

#include <span>
#include <vector>

namespace dtrain::elastic {

// The signals every launcher command handles (it stops its workers, SIGTERM then SIGKILL after the
// grace period, and exits 128 + signal): torchrun's default --signals-to-handle, in its order.
// Workers see the list as TORCHELASTIC_SIGNALS_TO_HANDLE, as under torchrun.
inline constexpr int kLauncherSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
inline constexpr const char* kLauncherSignalNames = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

class SignalPipe {
 public:
  // Installs handlers for `signals` (SA_RESTART, so plain blocking calls are not cut short). At
  // most one SignalPipe may exist at a time in a process. Throws dtrain::InternalError if the pipe
  // cannot be made.
  explicit SignalPipe(std::span<const int> signals);
  // Restores the previous handlers and closes the pipe.
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  // Readable while a signal is pending: poll it beside the other fds.
  int fd() const { return read_fd_; }
  // The first pending signal number, consuming every pending byte; 0 when none. Never blocks.
  int take();
  // The signals this pipe handles (a child process resets them to the default before exec).
  const std::vector<int>& signals() const { return signals_; }

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
  int read_fd_ = -1;
  int write_fd_ = -1;
};

}  // namespace dtrain::elastic
