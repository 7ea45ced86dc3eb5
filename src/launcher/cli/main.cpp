// The `dtrain` command: dispatches to its subcommands (for now `run`, the torchrun equivalent).
// Plain C++17 and POSIX, no LibTorch: the launcher builds in seconds and starts instantly.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "launcher/cli/run_command.h"
#include "launcher/cli/scale_command.h"

namespace {

constexpr const char* kUsage = R"(usage: dtrain <command> [args...]

commands:
  run     start and supervise the worker processes of a training job (torchrun's equivalent);
          see `dtrain run --help`
  scale   run a program at several worker counts and report whether more workers pay off;
          see `dtrain scale --help`
  help    this text
)";

void print(int fd, const std::string& text) {
  ssize_t ignored = write(fd, text.data(), text.size());
  (void)ignored;
}

// If the launcher was started with stdin, stdout or stderr closed, the next open() would land on
// that number and a worker's pipe could end up as "stderr" by accident: park /dev/null there
// instead.
void ensure_standard_fds_open() {
  for (int fd = 0; fd < 3; ++fd) {
    if (fcntl(fd, F_GETFD) == -1) {
      int opened = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
      if (opened >= 0 && opened != fd) close(opened);  // only happens if a lower fd was closed too
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ensure_standard_fds_open();
  // Writing to a closed stdout (`dtrain run ... | head`) must not kill the launcher and orphan the
  // supervision of its workers; relayed output is dropped instead. Workers get SIGPIPE's default
  // back.
  signal(SIGPIPE, SIG_IGN);

  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    print(2, "dtrain: missing command; expected 'run' or 'scale' (see `dtrain --help`)\n");
    return 2;
  }
  const std::string& command = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (command == "run") return dtrain::cli::run_main(rest);
  if (command == "scale") return dtrain::cli::scale_main(rest);
  if (command == "help" || command == "--help" || command == "-h") {
    if (!rest.empty() && rest[0] == "run") return dtrain::cli::run_main({"--help"});
    if (!rest.empty() && rest[0] == "scale") return dtrain::cli::scale_main({"--help"});
    print(1, kUsage);
    return 0;
  }
  print(2, "dtrain: unknown command '" + command +
               "'; expected 'run' or 'scale' (see `dtrain --help`)\n");
  return 2;
}
