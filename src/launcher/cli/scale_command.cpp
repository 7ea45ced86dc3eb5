// `dtrain scale`: the runs (see scale_command.h); the analysis lives in scale_analysis.cpp.
//
// Each worker count gets one WorkerGroup built by the same worker_group_options() as `dtrain run`
// (so OMP_NUM_THREADS=1 per worker when several share the node and the user set none, as torchrun
// does), with the workers' output going only to per-rank log files (stdout stays free for the
// report or its JSON) and DTRAIN_PROFILE=<folder>/profile.jsonl. While the workers run, a 100 ms
// timer wakes the wait so the profile file is read as it grows: with --steps K the workers get
// SIGTERM (then SIGKILL after the grace period) as soon as every rank recorded warm-up + K steps.
#include "launcher/cli/scale_command.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>

#include "common/format.h"
#include "dtrain/errors.h"
#include "launcher/cli/run_command.h"
#include "launcher/cli/scale_nodes.h"
#include "launcher/cli/scale_options.h"
#include "launcher/cli/scale_report.h"
#include "launcher/elastic/ports.h"
#include "launcher/elastic/signal_pipe.h"
#include "launcher/elastic/worker_group.h"

namespace dtrain::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using scale::RunResult;
using scale::StepRecord;

void write_text(int fd, const std::string& text) {
  std::string_view rest = text;
  while (!rest.empty()) {
    ssize_t n = write(fd, rest.data(), rest.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
}

// One line of `dtrain scale` to stderr (stdout carries the report).
void tell(const std::string& message) { write_text(2, "dtrain scale: " + message + "\n"); }

// A message of the shared launcher code or of the flag parser without its "dtrain run: " or
// "dtrain scale: " (tell() adds the latter).
std::string without_prefix(const std::string& message) {
  for (const std::string prefix : {"dtrain run: ", "dtrain scale: "}) {
    if (message.rfind(prefix, 0) == 0) return message.substr(prefix.size());
  }
  return message;
}

// A file descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// The whole record lines appended to one DTRAIN_PROFILE file since the last look, as it grows.
class ProfileFile {
 public:
  explicit ProfileFile(std::string path) : path_(std::move(path)) {}

  // The complete lines added since the last call; at_end also takes an unterminated last line
  // (the workers are gone, nothing will complete it).
  std::string new_lines(bool at_end = false) {
    int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      Fd file(fd);
      if (lseek(fd, offset_, SEEK_SET) == offset_) {
        char buffer[65536];
        for (;;) {
          ssize_t n = read(fd, buffer, sizeof buffer);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) break;
          offset_ += n;
          partial_.append(buffer, static_cast<std::size_t>(n));
        }
      }
    }
    std::size_t whole = at_end ? partial_.size() : partial_.rfind('\n') + 1;  // npos + 1 == 0
    std::string lines = partial_.substr(0, whole);
    partial_.erase(0, whole);
    if (at_end && !lines.empty() && lines.back() != '\n') lines += '\n';
    return lines;
  }

 private:
  std::string path_;
  off_t offset_ = 0;
  std::string partial_;
};

// The records of one run: this node's ranks' (a ProfileFile's lines) and, on node 0 of several
// hosts, the other nodes' (scale_nodes.h).
class ProfileReader {
 public:
  // Parses whole lines.
  void add(const std::string& lines) {
    std::size_t start = 0;
    for (std::size_t newline; (newline = lines.find('\n', start)) != std::string::npos;
         start = newline + 1) {
      take(lines.substr(start, newline - start));
    }
  }

  // Ranks in [0, workers) with at least `count` records.
  int ranks_with(int workers, int count) const {
    int ranks = 0;
    for (const auto& [rank, n] : per_rank_) ranks += rank >= 0 && rank < workers && n >= count;
    return ranks;
  }
  int fewest(int workers) const {
    int least = -1;
    for (int rank = 0; rank < workers; ++rank) {
      auto found = per_rank_.find(rank);
      int n = found == per_rank_.end() ? 0 : found->second;
      least = least < 0 ? n : std::min(least, n);
    }
    return std::max(least, 0);
  }
  std::vector<StepRecord>& records() { return records_; }
  int malformed() const { return malformed_; }

 private:
  void take(const std::string& line) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) return;
    if (std::optional<StepRecord> record = scale::parse_record(line)) {
      ++per_rank_[record->rank];
      records_.push_back(*record);
    } else {
      ++malformed_;
    }
  }

  std::vector<StepRecord> records_;
  std::map<int, int> per_rank_;
  int malformed_ = 0;
};

// The job's throughput as the program printed it: the last report of the lowest rank that printed
// one (a trainer's rank 0 usually reports for the whole job).
std::optional<double> printed_throughput(const std::string& dir, int workers,
                                         const std::map<int, std::uintmax_t>& log_offsets) {
  for (int rank = 0; rank < workers; ++rank) {
    std::ifstream log(dir + "/rank" + std::to_string(rank) + ".log");
    auto offset = log_offsets.find(rank);
    if (offset != log_offsets.end()) log.seekg(static_cast<std::streamoff>(offset->second));
    std::optional<double> last;
    for (std::string line; std::getline(log, line);) {
      if (std::optional<double> value = scale::printed_samples_per_s(line)) last = value;
    }
    if (last) return last;
  }
  return std::nullopt;
}

struct Session {
  const ScaleOptions& options;
  const LaunchPlan& plan;
  elastic::SignalPipe& signals;
  int dev_null;
  // Inside a Slurm allocation: each count is one srun step (the group's one worker is srun).
  std::optional<SlurmAllocation> slurm;
  // On several hosts: node 0's store (on node 0) or the client of it (on the others).
  scale::Coordinator* coordinator = nullptr;
  scale::Member* member = nullptr;
  int interrupted_by = 0;  // set when the user stopped `dtrain scale`
};

// The one worker that runs `workers` ranks of `command` as a step of the allocation: srun with the
// task counts spelled out (an inherited SLURM_NTASKS_PER_NODE would otherwise count), ending the
// step when one task fails. srun passes a SIGTERM from stop() on to the tasks.
std::vector<std::string> srun_command(const SlurmAllocation& allocation, int workers,
                                      const std::vector<std::string>& command) {
  std::vector<std::string> srun = {
      "srun", "--ntasks=" + std::to_string(workers),
      "--nodes=" + std::to_string(allocation.nodes_for(workers)),
      "--ntasks-per-node=" + std::to_string(std::min(workers, allocation.tasks_per_node)),
      "--kill-on-bad-exit=1"};
  srun.insert(srun.end(), command.begin(), command.end());
  return srun;
}

// How long all ranks that write records may have reached the target while others wrote none
// before the run is stopped anyway (a program where only rank 0 records).
constexpr auto kSilentRanksGrace = std::chrono::seconds(5);

// Node 0 of several hosts waits this long beyond the grace period for the others to report
// that their workers are gone; the others wait this long beyond the time limit for node 0's stop.
constexpr auto kNodeSlack = std::chrono::seconds(10);

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

// Runs this node's share of the `index`-th count, `workers` over all nodes.
RunResult run_count(Session& session, int index, int workers, const std::string& dir) {
  const ScaleOptions& options = session.options;
  RunResult result;
  result.workers = workers;
  // On several hosts this node runs ranks base_rank.. of the count's nodes_for(workers) nodes.
  const bool hosts = options.nnodes > 1;
  result.nodes = hosts ? options.nodes_for(workers) : 1;
  const int base_rank = options.node_rank * options.nproc_per_node;
  const int local = hosts ? std::min(options.nproc_per_node, workers - base_rank) : workers;
  const std::string profile_path = dir + "/profile.jsonl";
  std::error_code ignored;
  fs::remove(profile_path, ignored);  // a kept --log-dir from an earlier scale run: start afresh
  std::map<int, std::uintmax_t> log_offsets;
  for (int rank = 0; rank < workers; ++rank) {
    std::uintmax_t size = fs::file_size(dir + "/rank" + std::to_string(rank) + ".log", ignored);
    if (!ignored) log_offsets[rank] = size;
  }

  RunOptions run_options;
  // A measurement recovers nothing: the plain DDP step, without the in-place path's admission
  // all-reduce in its bytes.
  run_options.recovery = "restart";
  run_options.nproc_per_node = session.slurm ? 1 : local;
  run_options.nnodes = result.nodes;
  run_options.master_port = hosts ? options.master_port + 1 + index : 0;
  run_options.log_dir = dir;
  run_options.grace_period_s = options.grace_period_s;
  run_options.no_python = options.no_python;
  run_options.command = options.command;
  LaunchPlan plan = session.plan;
  if (session.slurm) plan.command = srun_command(*session.slurm, workers, plan.command);
  elastic::WorkerGroupOptions group_options = worker_group_options(run_options, plan);
  if (session.slurm) {
    // The tasks place themselves from srun's SLURM_PROCID, SLURM_NTASKS, ...; one OpenMP thread
    // each at more than one, as dtrain run gives its workers.
    group_options.rank_variables = false;
    if (workers > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
      group_options.extra_env.emplace_back("OMP_NUM_THREADS", "1");
    }
  }
  group_options.out_fd = session.dev_null;
  group_options.err_fd = session.dev_null;
  group_options.extra_env.emplace_back("DTRAIN_PROFILE", profile_path);
  elastic::WorkerGroup group(group_options);

  Fd timer(timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
  Fd wakeups(epoll_create1(EPOLL_CLOEXEC));
  if (timer.get() < 0 || wakeups.get() < 0) throw InternalError("timerfd/epoll: cannot create");
  itimerspec period{};
  period.it_interval.tv_nsec = period.it_value.tv_nsec = 100 * 1000 * 1000;
  timerfd_settime(timer.get(), 0, &period, nullptr);
  for (int fd : {timer.get(), session.signals.fd()}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    epoll_ctl(wakeups.get(), EPOLL_CTL_ADD, fd, &event);
  }

  elastic::WorkerGroupRound round;
  round.world_size = workers;
  round.master_port = hosts ? run_options.master_port : elastic::pick_free_port();
  if (hosts) {
    round.group_rank = options.node_rank;
    round.group_world_size = result.nodes;
    round.base_rank = base_rank;
    round.master_addr = options.master_addr;
  }
  ProfileFile file(profile_path);
  ProfileReader reader;
  // Node 0 decides when to stop; the others stop when it says so, or (node 0 lost) at the time
  // limit plus the slack.
  const bool decides = session.member == nullptr;
  const double time_limit_s =
      options.time_limit_s + (decides ? 0 : options.grace_period_s + kNodeSlack.count());
  const int target = options.warmup_steps + options.steps;
  const Clock::time_point start = Clock::now();
  Clock::time_point next_progress = start + std::chrono::seconds(10);
  Clock::time_point writers_done_since{};  // epoch: not all writers are done
  if (session.coordinator) session.coordinator->start(index);
  group.start(round);

  auto stop = [&](const std::string& ending) {
    group.stop(session.signals.fd());
    if (session.coordinator) session.coordinator->stop(index);
    result.ending = ending;
  };
  auto fail = [&](const std::string& ending, int exit_code) {
    stop(ending);
    result.ok = false;
    result.exit_code = exit_code;
  };
  for (;;) {
    elastic::WaitResult waited = group.wait(wakeups.get());
    if (!waited.failures.empty()) {
      const elastic::WorkerExit& root = waited.failures.front();
      fail("rank " + std::to_string(root.global_rank) + " " + root.describe(),
           root.launcher_exit_code());
      if (!root.stderr_tail.empty()) result.failure_line = root.stderr_tail.back();
      break;
    }
    if (waited.state == elastic::WaitResult::State::kSucceeded) {
      group.stop();
      result.finished_by_itself = true;
      result.ending = "finished";
      break;
    }
    if (int signo = session.signals.take(); signo != 0) {
      tell("received " + elastic::signal_name(signo) + "; stopping the " + std::to_string(local) +
           " worker(s)");
      session.interrupted_by = signo;
      stop("interrupted");
      break;
    }
    std::uint64_t expirations = 0;
    ssize_t drained = read(timer.get(), &expirations, sizeof expirations);
    (void)drained;
    const Clock::time_point now = Clock::now();
    const double elapsed = std::chrono::duration<double>(now - start).count();
    if (session.member) {
      std::string lost;
      if (session.member->send_and_check_stop(index, file.new_lines(), &lost)) {
        if (lost.empty()) {
          stop("stopped by node 0");
        } else {
          fail(lost, 1);
        }
        break;
      }
    } else {
      reader.add(file.new_lines());
      if (session.coordinator) {
        reader.add(session.coordinator->new_records(index, result.nodes));
        if (std::optional<scale::NodeEnding> failed =
                session.coordinator->failed_node(index, result.nodes)) {
          fail(failed->ending, failed->exit_code);
          break;
        }
      }
      if (options.seconds) {
        if (elapsed >= *options.seconds) {
          stop("stopped after " + detail::seconds_text(*options.seconds));
          break;
        }
      } else {
        int done = reader.ranks_with(workers, target);
        int writers = reader.ranks_with(workers, 1);
        if (done == workers) {
          stop("stopped after " + std::to_string(options.steps) + " measured steps");
          break;
        }
        if (writers > 0 && done == writers) {
          if (writers_done_since == Clock::time_point{}) writers_done_since = now;
          if (now - writers_done_since >= kSilentRanksGrace) {
            stop("stopped after " + std::to_string(options.steps) + " measured steps of the " +
                 std::to_string(writers) + " rank(s) that write records");
            break;
          }
        } else {
          writers_done_since = Clock::time_point{};
        }
      }
    }
    if (elapsed >= time_limit_s) {
      result.time_limit = true;
      stop("over --time-limit " + detail::seconds_text(options.time_limit_s) + " with " +
           std::to_string(reader.fewest(workers)) + " of " + std::to_string(target) +
           " steps on the slowest rank");
      break;
    }
    if (decides && now >= next_progress) {
      next_progress = now + std::chrono::seconds(10);
      tell(std::to_string(workers) + " worker(s): " + detail::seconds_text(elapsed) + ", " +
           std::to_string(reader.fewest(workers)) + " step(s) recorded by the slowest rank");
    }
  }
  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (session.member) {
    // This node's last records, then how its workers ended: node 0 reads both (unless it is lost:
    // each call would wait out its timeout).
    if (!session.member->lost().empty()) return result;
    std::string ignored_loss;
    session.member->send_and_check_stop(index, file.new_lines(/*at_end=*/true), &ignored_loss);
    int exit_code = result.ok ? 0 : result.exit_code;
    if (result.ok && session.interrupted_by != 0) exit_code = 128 + session.interrupted_by;
    session.member->report_end(index, {exit_code, result.ending});
    return result;
  }
  reader.add(file.new_lines(/*at_end=*/true));
  if (session.coordinator) {
    int signo = 0;
    std::string missing = session.coordinator->wait_for_ends(
        index, result.nodes, to_ms(options.grace_period_s) + kNodeSlack, session.signals, &signo);
    if (signo != 0) session.interrupted_by = signo;
    reader.add(session.coordinator->new_records(index, result.nodes));
    std::optional<scale::NodeEnding> failed = session.coordinator->failed_node(index, result.nodes);
    if (result.ok && (failed || !missing.empty())) {
      result.ok = false;
      result.exit_code = failed ? failed->exit_code : 1;
      result.ending = failed ? failed->ending : missing;
    }
  }
  result.records = std::move(reader.records());
  if (!options.seconds) {
    // Measure the same steps on every rank: the first warm-up + K of each (ranks that ran ahead
    // while the others caught up, or before SIGTERM arrived, add nothing).
    std::map<int, int> kept;
    std::vector<StepRecord> first;
    for (const StepRecord& record : result.records) {
      if (kept[record.rank]++ < target) first.push_back(record);
    }
    result.records = std::move(first);
  }
  result.malformed_records = reader.malformed();
  result.printed_samples_per_s = printed_throughput(dir, workers, log_offsets);
  return result;
}

// run_count, with a failure to start (a program gone meanwhile, no socket) as the count's result,
// which the other hosts learn too.
RunResult run_or_fail(Session& session, int index, int workers, const std::string& root) {
  try {
    return run_count(session, index, workers, root + "/workers" + std::to_string(workers));
  } catch (const std::exception& failure) {
    RunResult result;
    result.workers = workers;
    result.ok = false;
    result.exit_code = 1;
    result.ending = "could not start: " + without_prefix(failure.what());
    if (session.coordinator) session.coordinator->stop(index);
    if (session.member) session.member->report_end(index, {1, result.ending});
    return result;
  }
}

std::string join(const std::vector<std::string>& words) {
  std::string text;
  for (const std::string& word : words) text += (text.empty() ? "" : " ") + word;
  return text;
}

// Writes `text` to `path` through a temporary file and a rename, so a reader never sees half a
// plot and an old one survives a failed write.
bool write_file_atomically(const std::string& path, const std::string& text) {
  std::string temporary = path + ".tmp";
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    file << text;
    if (!file.flush()) return false;
  }
  std::error_code error;
  fs::rename(temporary, path, error);
  if (error) fs::remove(temporary, error);
  return !error;
}

// The folder a plot goes to must exist and be writable before anything runs.
void check_plot_path(const std::string& path) {
  fs::path parent = fs::path(path).parent_path();
  if (parent.empty()) parent = ".";
  if (!fs::is_directory(parent) || access(parent.c_str(), W_OK) != 0) {
    throw UsageError("dtrain scale: --plot: cannot write '" + path + "': folder '" +
                     parent.string() + "' is missing or not writable");
  }
}

// " on 2 hosts" for a count that spans several, else "".
std::string on_nodes(const ScaleOptions& options, int workers) {
  int nodes = options.nnodes > 1 ? options.nodes_for(workers) : 1;
  return nodes > 1 ? " on " + std::to_string(nodes) + " hosts" : "";
}

// A node other than 0: runs its share of each count node 0 starts, sends its records there, and
// leaves when node 0 ends. Returns the exit code: 1 when node 0 was lost or ended early, or a share
// failed.
int run_as_member(Session& session, const std::string& root) {
  const ScaleOptions& options = session.options;
  const std::string me = "node " + std::to_string(options.node_rank) + ": ";
  const auto count_wait = to_ms(options.time_limit_s + 2 * options.grace_period_s) + 2 * kNodeSlack;
  // Leaving early: node 0 learns why (a count it starts without this node fails at once).
  auto quit = [&](const std::string& why, int exit_code) {
    tell(me + why);
    session.member->quit(why);
    return exit_code;
  };
  int exit_code = 0;
  for (std::size_t index = 0; index < options.nproc.size(); ++index) {
    const int workers = options.nproc[index];
    std::string failure;
    if (!session.member->wait_for_start(static_cast<int>(index), count_wait, session.signals,
                                        &failure)) {
      if (!failure.empty()) return quit(failure, 1);
      tell(me + "node 0 ended the measurement before " + std::to_string(workers) +
           " worker(s); see its report");
      session.member->leave(count_wait, session.signals);  // the end is there: says goodbye
      return 1;
    }
    if (options.node_rank >= options.nodes_for(workers)) {
      tell(me + std::to_string(workers) +
           " worker(s) run on fewer hosts; waiting for the next count");
      continue;
    }
    RunResult result = run_or_fail(session, static_cast<int>(index), workers, root);
    // Node 0's host stopped answering: waiting for its next count would only run into the timeout.
    if (!session.member->lost().empty()) return quit(session.member->lost(), 1);
    tell(me + std::to_string(workers) + " worker(s): " + result.ending);
    if (!result.ok) exit_code = 1;
    if (session.interrupted_by != 0) {
      return quit("received " + elastic::signal_name(session.interrupted_by),
                  128 + session.interrupted_by);
    }
  }
  std::string failure = session.member->leave(count_wait, session.signals);
  if (!failure.empty()) return quit(failure, 1);
  tell(me + "done; node 0 reports");
  return exit_code;
}

}  // namespace

int scale_main(const std::vector<std::string>& args) {
  ScaleOptions options;
  LaunchPlan plan;
  std::optional<SlurmAllocation> slurm;
  std::unique_ptr<scale::Coordinator> coordinator;
  std::unique_ptr<scale::Member> member;
  try {
    options = parse_scale_options(args);
    if (options.help) {
      write_text(1, scale_usage());
      return 0;
    }
    RunOptions run_options;
    run_options.command = options.command;
    run_options.no_python = options.no_python;
    plan = prepare_launch(run_options);
    if (!options.plot_path.empty()) check_plot_path(options.plot_path);
    slurm = slurm_allocation([](const char* name) { return std::getenv(name); });
    if (slurm) {
      fit_to_allocation(options, *slurm);
      std::string why;
      if (elastic::find_executable("srun", &why).empty()) {
        throw UsageError("dtrain scale: inside Slurm allocation " + slurm->job_id +
                         " (SLURM_JOB_ID) but srun: " + why +
                         "; expected srun on PATH to start each count as a step");
      }
    }
    if (options.nnodes > 1 && options.node_rank == 0) {
      for (std::size_t i = 0; i < options.nproc.size(); ++i) {
        const int port = options.master_port + 1 + static_cast<int>(i);
        if (elastic::probe_port(options.master_addr, port) == elastic::PortProbe::kInUse) {
          throw UsageError("dtrain scale: --master-port: the workers of count " +
                           std::to_string(options.nproc[i]) + " meet at port " +
                           std::to_string(port) + " (--master-port + " + std::to_string(i + 1) +
                           "), which is in use on this host; pick another --master-port");
        }
      }
      coordinator = std::make_unique<scale::Coordinator>(options);
    } else if (options.nnodes > 1) {
      member = std::make_unique<scale::Member>(options);
    }
  } catch (const UsageError& error) {
    tell(without_prefix(error.what()));
    return 2;
  }

  // Where the runs keep their logs and records: --log-dir, or a temporary folder removed at the
  // end.
  std::string root = options.log_dir;
  bool temporary = root.empty();
  std::error_code error;
  if (temporary) {
    std::string pattern = (fs::temp_directory_path(error) / "dtrain-scale-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      tell("cannot create a temporary folder in " + fs::temp_directory_path(error).string() +
           "; set TMPDIR or give --log-dir");
      return 1;
    }
    root = pattern;
  }
  for (int workers : options.nproc) {
    fs::create_directories(root + "/workers" + std::to_string(workers), error);
    if (error) {
      tell("--log-dir: cannot create '" + root + "/workers" + std::to_string(workers) +
           "': " + error.message() + "; expected a writable directory");
      return 2;
    }
  }

  int dev_null = open("/dev/null", O_WRONLY | O_CLOEXEC);
  Fd dev_null_fd(dev_null);
  std::vector<RunResult> results;
  int exit_code = 0;
  {
    elastic::SignalPipe signals(elastic::kLauncherSignals);
    Session session{options, plan, signals, dev_null, slurm, coordinator.get(), member.get()};
    // Node 0's own store failing it (scale_nodes.h) ends everything: one line, exit 1.
    try {
      if (options.nnodes > 1) {
        std::string failed;
        try {
          failed = coordinator ? coordinator->wait_for_nodes(to_ms(options.time_limit_s), signals)
                               : member->join(to_ms(options.time_limit_s), signals);
        } catch (const UsageError& error) {
          failed = without_prefix(error.what());
          exit_code = 2;
        }
        if (!failed.empty()) {
          tell(failed);
          if (exit_code == 0) exit_code = 1;
        } else if (member) {
          exit_code = run_as_member(session, root);
        } else {
          tell("all " + std::to_string(options.nnodes) + " nodes joined; counts are totals, " +
               std::to_string(options.nproc_per_node) + " worker(s) per node");
        }
      }
      if (slurm) {
        tell("inside Slurm allocation " + slurm->job_id + ": " + std::to_string(slurm->tasks) +
             " task(s) on " + std::to_string(slurm->nodes) + " node(s), " +
             std::to_string(slurm->tasks_per_node) + " per node; each count runs as an srun step");
      }
      const std::size_t counts = exit_code == 0 && !member ? options.nproc.size() : 0;
      for (std::size_t index = 0; index < counts; ++index) {
        const int workers = options.nproc[index];
        tell("running " + std::to_string(workers) + " worker(s)" + on_nodes(options, workers) +
             ": " + join(slurm ? srun_command(*slurm, workers, plan.command) : plan.command));
        RunResult result = run_or_fail(session, static_cast<int>(index), workers, root);
        tell(std::to_string(workers) + " worker(s): " + result.ending + " (" +
             detail::seconds_text(result.wall_s) + ", " + std::to_string(result.records.size()) +
             " records)");
        results.push_back(std::move(result));
        if (session.interrupted_by != 0) {
          exit_code = 128 + session.interrupted_by;
          break;
        }
      }
      if (coordinator) {
        std::string missing = coordinator->finish(kNodeSlack, signals);
        if (!missing.empty()) tell(missing);
      }
    } catch (const CommError& error) {
      tell(without_prefix(error.what()));
      exit_code = 1;
    }
  }

  if (exit_code == 0 && !member) {
    scale::AnalysisSettings settings;
    settings.warmup_steps = options.warmup_steps;
    settings.link_gbps = options.link_gbps;
    if (slurm) {
      // The allocation's tasks hold a CPU each at least, on however many nodes: no count given
      // here oversubscribes them.
      settings.host_cpus = slurm->tasks;
      settings.notes.push_back("each count ran as an srun step of Slurm allocation " +
                               slurm->job_id + " (" + std::to_string(slurm->tasks) + " tasks on " +
                               std::to_string(slurm->nodes) + " node(s))");
    }
    if (options.nnodes > 1) {
      // Each host runs at most --nproc-per-node: no count oversubscribes one it was told of.
      settings.host_cpus = options.nnodes * options.nproc_per_node;
      settings.notes.push_back("counts are totals over " + std::to_string(options.nnodes) +
                               " hosts, " + std::to_string(options.nproc_per_node) +
                               " worker(s) per host; node 0 (this host) ran ranks 0.." +
                               std::to_string(options.nproc_per_node - 1));
    }
    if (std::getenv("OMP_NUM_THREADS") == nullptr && options.nproc.front() == 1 &&
        options.nproc.back() > 1) {
      settings.notes.push_back(
          "OMP_NUM_THREADS was unset at 1 worker (the program may use every core) and 1 per "
          "worker at more (dtrain run's rule, as torchrun's); set it to compare the same threads "
          "per worker");
    }
    scale::Report report = scale::analyze(results, settings);
    std::string mode = options.seconds ? detail::seconds_text(*options.seconds) + " per count"
                                       : std::to_string(options.steps) + " steps per count after " +
                                             std::to_string(options.warmup_steps) + " warm-up";
    std::string title = "dtrain scale: " + join(options.command) + " (" + mode + ")";
    write_text(1, options.json ? scale::render_json(report, options.command)
                               : scale::render_text(report, title));
    if (!options.plot_path.empty()) {
      if (write_file_atomically(options.plot_path, scale::render_svg(report, title))) {
        tell("plot written to " + options.plot_path);
      } else {
        tell("--plot: cannot write '" + options.plot_path + "'");
        exit_code = 1;
      }
    }
    if (report.any_failed && exit_code == 0) exit_code = 1;
  }
  if (temporary) {
    fs::remove_all(root, error);
  } else {
    tell("worker logs and profile records kept in " + root + "/workers<N>/");
  }
  return exit_code;
}

}  // namespace dtrain::cli
