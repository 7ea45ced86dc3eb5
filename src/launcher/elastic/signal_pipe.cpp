// SignalPipe: the self-pipe that lets the launcher's poll loop react to signals (see
// signal_pipe.h).
#include "launcher/elastic/signal_pipe.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "dtrain/errors.h"

namespace dtrain::elastic {
namespace {

// The write end the handler uses; -1 when no SignalPipe exists. A plain int read by a handler must
// be lock-free atomic to be safe against the handler firing mid-update.
std::atomic<int> g_write_fd{-1};

extern "C" void on_signal(int signo) {
  int saved_errno = errno;  // a handler must not clobber errno of the code it interrupted
  int fd = g_write_fd.load();
  if (fd >= 0) {
    unsigned char byte = static_cast<unsigned char>(signo);
    // Non-blocking: if the pipe is full, enough wake-ups are already pending.
    ssize_t ignored = write(fd, &byte, 1);
    (void)ignored;
  }
  errno = saved_errno;
}

}  // namespace

SignalPipe::SignalPipe(std::span<const int> signals) : signals_(signals.begin(), signals.end()) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw InternalError(std::string("dtrain run: cannot create the signal pipe: ") +
                        std::strerror(errno));
  }
  read_fd_ = fds[0];
  write_fd_ = fds[1];
  g_write_fd.store(write_fd_);
  previous_.resize(signals_.size());
  for (std::size_t i = 0; i < signals_.size(); ++i) {
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(signals_[i], &action, &previous_[i]);
  }
}

SignalPipe::~SignalPipe() {
  for (std::size_t i = 0; i < signals_.size(); ++i) sigaction(signals_[i], &previous_[i], nullptr);
  g_write_fd.store(-1);
  close(read_fd_);
  close(write_fd_);
}

int SignalPipe::take() {
  int first = 0;
  unsigned char buffer[64];
  for (;;) {
    ssize_t n = read(read_fd_, buffer, sizeof(buffer));
    if (n > 0) {
      if (first == 0) first = buffer[0];
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return first;  // EAGAIN: drained
  }
}

}  // namespace dtrain::elastic
