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
#include <optional>

#include "common/format.h"
#include "dtrain/errors.h"
#include "launcher/cli/run_command.h"
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

// Reads the records the ranks append to one DTRAIN_PROFILE file, as the file grows.
class ProfileReader {
 public:
  explicit ProfileReader(std::string path) : path_(std::move(path)) {}

  // Parses the complete lines added since the last call; at_end also takes an unterminated last
  // line (the workers are gone, nothing will complete it).
  void poll(bool at_end = false) {
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
    std::size_t start = 0;
    for (std::size_t newline; (newline = partial_.find('\n', start)) != std::string::npos;
         start = newline + 1) {
      take(partial_.substr(start, newline - start));
    }
    partial_.erase(0, start);
    if (at_end && !partial_.empty()) {
      take(partial_);
      partial_.clear();
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

  std::string path_;
  off_t offset_ = 0;
  std::string partial_;
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

RunResult run_count(Session& session, int workers, const std::string& dir) {
  const ScaleOptions& options = session.options;
  RunResult result;
  result.workers = workers;
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
  run_options.nproc_per_node = session.slurm ? 1 : workers;
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
  round.master_port = elastic::pick_free_port();
  ProfileReader reader(profile_path);
  const int target = options.warmup_steps + options.steps;
  const Clock::time_point start = Clock::now();
  Clock::time_point next_progress = start + std::chrono::seconds(10);
  Clock::time_point writers_done_since{};  // epoch: not all writers are done
  group.start(round);

  auto stop = [&](const std::string& ending) {
    group.stop(session.signals.fd());
    result.ending = ending;
  };
  for (;;) {
    elastic::WaitResult waited = group.wait(wakeups.get());
    if (!waited.failures.empty()) {
      const elastic::WorkerExit& root = waited.failures.front();
      group.stop(session.signals.fd());
      result.ok = false;
      result.ending = "rank " + std::to_string(root.global_rank) + " " + root.describe();
      result.exit_code = root.launcher_exit_code();
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
      tell("received " + elastic::signal_name(signo) + "; stopping the " + std::to_string(workers) +
           " worker(s)");
      session.interrupted_by = signo;
      stop("interrupted");
      break;
    }
    std::uint64_t expirations = 0;
    ssize_t drained = read(timer.get(), &expirations, sizeof expirations);
    (void)drained;
    reader.poll();
    Clock::time_point now = Clock::now();
    double elapsed = std::chrono::duration<double>(now - start).count();
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
    if (elapsed >= options.time_limit_s) {
      result.time_limit = true;
      stop("over --time-limit " + detail::seconds_text(options.time_limit_s) + " with " +
           std::to_string(reader.fewest(workers)) + " of " + std::to_string(target) +
           " steps on the slowest rank");
      break;
    }
    if (now >= next_progress) {
      next_progress = now + std::chrono::seconds(10);
      tell(std::to_string(workers) + " worker(s): " + detail::seconds_text(elapsed) + ", " +
           std::to_string(reader.fewest(workers)) + " step(s) recorded by the slowest rank");
    }
  }
  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  reader.poll(/*at_end=*/true);
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

}  // namespace

int scale_main(const std::vector<std::string>& args) {
  ScaleOptions options;
  LaunchPlan plan;
  std::optional<SlurmAllocation> slurm;
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
    Session session{options, plan, signals, dev_null, slurm};
    if (slurm) {
      tell("inside Slurm allocation " + slurm->job_id + ": " + std::to_string(slurm->tasks) +
           " task(s) on " + std::to_string(slurm->nodes) + " node(s), " +
           std::to_string(slurm->tasks_per_node) + " per node; each count runs as an srun step");
    }
    for (int workers : options.nproc) {
      tell("running " + std::to_string(workers) + " worker(s): " +
           join(slurm ? srun_command(*slurm, workers, plan.command) : plan.command));
      RunResult result;
      try {
        result = run_count(session, workers, root + "/workers" + std::to_string(workers));
      } catch (const std::exception& failure) {
        result.workers = workers;
        result.ok = false;
        result.exit_code = 1;
        result.ending = "could not start: " + without_prefix(failure.what());
      }
      tell(std::to_string(workers) + " worker(s): " + result.ending + " (" +
           detail::seconds_text(result.wall_s) + ", " + std::to_string(result.records.size()) +
           " records)");
      results.push_back(std::move(result));
      if (session.interrupted_by != 0) {
        exit_code = 128 + session.interrupted_by;
        break;
      }
    }
  }

  if (exit_code == 0) {
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
