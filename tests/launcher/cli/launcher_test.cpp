// `dtrain run` end to end: the real build/bin/dtrain launching small /bin/sh workers (and Python
// ones) that dump their environment, print, fail, get killed or sleep. Asserts on the environment,
// the relayed output and logs, exit codes, the failure summary, restarts, and that no worker
// outlives the launcher. Over 600 lines: one suite for one contract, grouped by what it checks.
//
// Every wait is bounded: a launcher that does not exit in time is SIGKILLed (its workers die with
// it through PR_SET_PDEATHSIG) and the test fails instead of hanging.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "launcher/cli/run_command.h"
#include "launcher/cli/run_options.h"
#include "launcher/elastic/worker_group.h"
#include "launcher_fixture.h"
#include "support/subprocess.h"
#include "support/system.h"
#include "test_support.h"

namespace {

using namespace dtrain::cli::testing_support;

// ---- environment
// ---------------------------------------------------------------------------------

TEST_F(LauncherTest, EveryWorkerGetsTorchrunsEnvironment) {
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "3", "--max-restarts", "2", "--"},
                                sh("env > \"$1/env.$LOCAL_RANK\"")),
                         {{"OMP_NUM_THREADS", std::nullopt},
                          {"TORCH_NCCL_ASYNC_ERROR_HANDLING", std::nullopt},
                          {"RANK", "99"},  // a stale value from an outer launcher is replaced
                          {"DTRAIN_RECOVERY_JOIN", "1"},  // and one that only a newcomer gets
                          {"DTRAIN_TEST_PASSTHROUGH", "kept as is"}});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::string port;
  std::string run_id;
  for (int local_rank = 0; local_rank < 3; ++local_rank) {
    SCOPED_TRACE("local rank " + std::to_string(local_rank));
    auto env = parse_env(read_file(dir_ / ("env." + std::to_string(local_rank))));
    std::string rank = std::to_string(local_rank);
    EXPECT_EQ(env["RANK"], rank);
    EXPECT_EQ(env["LOCAL_RANK"], rank);
    EXPECT_EQ(env["WORLD_SIZE"], "3");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(env["ROLE_RANK"], rank);
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "3");
    EXPECT_EQ(env["ROLE_NAME"], "default");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "2");
    // A single node with a free port is torchrun's standalone mode: a fresh uuid4 for the run,
    // the same for every rank (torchrun_parity_test.cpp checks the shape).
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"].size(), 36u) << env["TORCHELASTIC_RUN_ID"];
    if (local_rank == 0) run_id = env["TORCHELASTIC_RUN_ID"];
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], run_id);
    // In place by default: the launcher hosts the store, as torchrun's agent does.
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "True");
    EXPECT_EQ(env["TORCHELASTIC_SIGNALS_TO_HANDLE"], "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
    EXPECT_TRUE(env["TORCHELASTIC_ERROR_FILE"].ends_with("/attempt_0/" + rank + "/error.json"))
        << env["TORCHELASTIC_ERROR_FILE"];
    EXPECT_EQ(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "1");
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(env["DTRAIN_TEST_PASSTHROUGH"], "kept as is");
    EXPECT_EQ(env["DTRAIN_RECOVERY"], "in-place");
    EXPECT_EQ(env.count("DTRAIN_RECOVERY_JOIN"), 0u);
    // An automatically picked port: a valid one, and the same for every rank.
    int master_port = std::stoi(env["MASTER_PORT"]);
    EXPECT_GT(master_port, 0);
    EXPECT_LE(master_port, 65535);
    if (local_rank == 0) port = env["MASTER_PORT"];
    EXPECT_EQ(env["MASTER_PORT"], port);
  }
}

TEST_F(LauncherTest, SecondNodeGetsItsGlobalRanks) {
  std::string port = std::to_string(dtrain::testing::free_port());
  RunResult run =
      dtrain(concat({"run", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
                     "--master-addr", "127.0.0.1", "--master-port", port, "--run-id", "job7", "--"},
                    sh("env > \"$1/env.$LOCAL_RANK\"")),
             {{"OMP_NUM_THREADS", std::nullopt}});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  for (int local_rank = 0; local_rank < 2; ++local_rank) {
    SCOPED_TRACE("local rank " + std::to_string(local_rank));
    auto env = parse_env(read_file(dir_ / ("env." + std::to_string(local_rank))));
    std::string rank = std::to_string(2 + local_rank);
    EXPECT_EQ(env["RANK"], rank);
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(local_rank));
    EXPECT_EQ(env["WORLD_SIZE"], "4");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(env["GROUP_RANK"], "1");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(env["ROLE_RANK"], rank);
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "4");
    EXPECT_EQ(env["ROLE_NAME"], "default");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["MASTER_PORT"], port);
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "0");
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "job7");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "True");  // node 0's launcher hosts it
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
  }
}

// --recovery restart: torchrun's whole-group restart, rank 0 hosting the store (the launcher hosts
// none).
TEST_F(LauncherTest, RecoveryRestartLeavesTheStoreToRankZero) {
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "2", "--recovery", "restart", "--"},
                                sh("env > \"$1/env.$LOCAL_RANK\"")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  for (int local_rank = 0; local_rank < 2; ++local_rank) {
    SCOPED_TRACE("local rank " + std::to_string(local_rank));
    auto env = parse_env(read_file(dir_ / ("env." + std::to_string(local_rank))));
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "False");
    EXPECT_EQ(env["DTRAIN_RECOVERY"], "restart");
  }
}

// torchrun sets OMP_NUM_THREADS=1 only when it is unset and a node runs several workers.
TEST_F(LauncherTest, OmpNumThreadsIsOnlySetWhenUnsetAndSeveralWorkers) {
  RunResult kept =
      dtrain(concat({"run", "--nproc-per-node", "2", "--"}, sh("env > \"$1/env.$RANK\"")),
             {{"OMP_NUM_THREADS", "4"}});
  ASSERT_EQ(kept.exit_code, 0) << kept.err;
  EXPECT_EQ(parse_env(read_file(dir_ / "env.1"))["OMP_NUM_THREADS"], "4");

  RunResult single = dtrain(concat({"run", "--"}, sh("env > \"$1/single.$RANK\"")),
                            {{"OMP_NUM_THREADS", std::nullopt}});
  ASSERT_EQ(single.exit_code, 0) << single.err;
  EXPECT_EQ(parse_env(read_file(dir_ / "single.0")).count("OMP_NUM_THREADS"), 0u);
}

// ---- output and logs
// -----------------------------------------------------------------------------

// More ranks than the CPU cores the launcher may use (the workers inherit its affinity): one
// warning line naming both numbers and the cost, and the job still runs.
TEST_F(LauncherTest, WarnsWhenRanksOutnumberTheUsableCores) {
  EXPECT_EQ(dtrain::cli::oversubscription_warning(4, 4), "");
  EXPECT_NE(dtrain::cli::oversubscription_warning(5, 4), "");
  int cores = dtrain::cli::usable_cpus();
  std::string ranks = std::to_string(cores + 1);
  RunResult over = dtrain({"run", "--nproc-per-node", ranks, "--", "/bin/true"});
  ASSERT_EQ(over.exit_code, 0) << over.err;
  EXPECT_EQ(count(over.err, "\n"), 1) << over.err;
  EXPECT_EQ(over.err.rfind("dtrain run: warning: --nproc-per-node " + ranks + " starts " + ranks +
                               " ranks on this node, but this process may use only " +
                               std::to_string(cores) + " CPU core(s)",
                           0),
            0u)
      << over.err;
  EXPECT_NE(over.err.find("the ranks share cores and every step slows down"), std::string::npos)
      << over.err;
  RunResult fits = dtrain({"run", "--nproc-per-node", std::to_string(cores), "--", "/bin/true"});
  ASSERT_EQ(fits.exit_code, 0) << fits.err;
  EXPECT_EQ(fits.err, "");
}

TEST_F(LauncherTest, PrefixesEachLineWithItsRankOnTheSameStream) {
  RunResult run =
      dtrain(concat({"run", "--nproc-per-node", "2", "--"},
                    sh("echo \"out $RANK a\"; echo \"err $RANK\" >&2; echo \"out $RANK b\";"
                       " printf \"tail $RANK\"")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  for (int rank : {0, 1}) {
    std::string r = std::to_string(rank);
    // The unterminated "tail" is flushed as a line of its own when the pipe closes.
    EXPECT_EQ(lines_of(run.out, rank), Args({"out " + r + " a", "out " + r + " b", "tail " + r}))
        << run.out;
    EXPECT_EQ(lines_of(run.err, rank), Args({"err " + r})) << run.err;
  }
  EXPECT_EQ(count(run.out, "\n"), 6) << run.out;
  // On a single core the launcher also warns that its 2 ranks share it.
  int launcher_lines = dtrain::cli::usable_cpus() < 2 ? 1 : 0;
  EXPECT_EQ(count(run.err, "\n"), 2 + launcher_lines) << run.err;
  EXPECT_EQ(run.out.find("err"), std::string::npos) << run.out;
  EXPECT_EQ(run.err.find("out"), std::string::npos) << run.err;
}

// A progress bar redrawn with '\r' is relayed one line per redraw, to the terminal and the log;
// "\r\n" is one line end, also when its '\n' comes in a later write.
TEST_F(LauncherTest, CarriageReturnsEndRelayedLines) {
  std::string log_dir = dir_ / "logs";
  RunResult run = dtrain(
      concat({"run", "--log-dir", log_dir, "--"},
             sh("printf 'a\\rb\\rc\\n'; printf 'x\\r\\ny\\r'; sleep 0.2; printf '\\ndone\\n';"
                " printf '\\r10%%\\r20%%\\r\\n\\r\\n' >&2")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(lines_of(run.out, 0), Args({"a", "b", "c", "x", "y", "done"})) << run.out;
  EXPECT_EQ(count(run.out, "\n"), 6) << run.out;
  // The bar's leading '\r' ends nothing; an empty "\r\n" line stays an empty line.
  EXPECT_EQ(lines_of(run.err, 0), Args({"10%", "20%", ""})) << run.err;
  EXPECT_EQ(run.err.find('\r'), std::string::npos) << run.err;
  std::string log = read_file(log_dir + "/rank0.log");
  EXPECT_NE(log.find("[rank0]: a\n[rank0]: b\n[rank0]: c\n"), std::string::npos) << log;
}

// A line ended by '\r' is relayed when it is written, not when a '\n' finally comes: the worker
// waits for the test to see its first line before it writes the second.
TEST_F(LauncherTest, ALineEndedByCarriageReturnIsRelayedAtOnce) {
  ChildProcess launcher(concat({DTRAIN_LAUNCHER, "run", "--"},
                               sh("printf 'step 1\\r'; i=0;"
                                  " while [ ! -e \"$1/go\" ] && [ $i -lt 400 ]; do"
                                  "   sleep 0.05; i=$((i+1)); done; printf 'step 2\\n'")),
                        dir_ / "out", dir_ / "err");
  bool relayed = wait_until(
      [&] { return read_file(dir_ / "out").find("[rank0]: step 1\n") != std::string::npos; }, 10s);
  EXPECT_TRUE(relayed) << read_file(dir_ / "out");
  write_file(dir_ / "go", "");
  ASSERT_TRUE(launcher.wait(kRunTimeout));
  EXPECT_EQ(launcher.exit_code(), 0) << read_file(dir_ / "err");
  EXPECT_EQ(read_file(dir_ / "out"), "[rank0]: step 1\n[rank0]: step 2\n");
}

// Output without a final newline is not lost when its worker dies: rank 0 SIGKILLs itself after
// writing, rank 1 is stopped by the launcher (SIGTERM to its group) after writing.
TEST_F(LauncherTest, UnterminatedLastOutputOfAKilledWorkerIsRelayed) {
  RunResult run =
      dtrain(concat({"run", "--nproc-per-node", "2", "--grace-period", "2", "--"},
                    sh("if [ $RANK = 0 ]; then"
                       "  while [ ! -s \"$1/ready.1\" ]; do sleep 0.05; done;"
                       "  printf 'out 0'; printf 'last words 0' >&2; kill -9 $$;"
                       "fi; printf 'out 1'; printf 'last words 1' >&2; echo 1 > \"$1/ready.1\";"
                       " exec sleep 300")));
  EXPECT_EQ(run.exit_code, 128 + SIGKILL) << run.err;
  EXPECT_LT(run.seconds, 20) << "rank 1 was not stopped promptly";
  EXPECT_EQ(lines_of(run.out, 0), Args({"out 0"})) << run.out;
  EXPECT_EQ(lines_of(run.out, 1), Args({"out 1"})) << run.out;
  EXPECT_EQ(lines_of(run.err, 1), Args({"last words 1"})) << run.err;
  // Rank 0's, relayed and in the failure summary.
  EXPECT_NE(run.err.find("[rank0]: last words 0\n"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("dtrain run:   [rank0]: last words 0\n"), std::string::npos) << run.err;
}

TEST_F(LauncherTest, ManyLinesFromSeveralRanksArriveWhole) {
  constexpr int kLines = 2000;
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "2", "--"},
                                sh("i=0; while [ $i -lt " + std::to_string(kLines) +
                                   " ]; do echo \"line $RANK $i of a reasonably long output line\";"
                                   " i=$((i+1)); done")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::istringstream lines(run.out);
  int total = 0;
  int next[2] = {0, 0};
  for (std::string line; std::getline(lines, line); ++total) {
    int rank = line.rfind("[rank0]: ", 0) == 0 ? 0 : 1;
    ASSERT_EQ(line, "[rank" + std::to_string(rank) + "]: line " + std::to_string(rank) + " " +
                        std::to_string(next[rank]) + " of a reasonably long output line");
    ++next[rank];  // lines of one rank keep their order
  }
  EXPECT_EQ(total, 2 * kLines);
}

TEST_F(LauncherTest, LogDirHoldsEachRanksStdoutAndStderr) {
  std::string log_dir = dir_ / "logs/nested";  // created if missing
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "2", "--log-dir", log_dir, "--"},
                                sh("echo \"hello $RANK\"; echo \"warning $RANK\" >&2")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  for (std::string rank : {"0", "1"}) {
    std::string log = read_file(log_dir + "/rank" + rank + ".log");
    EXPECT_NE(log.find("[rank" + rank + "]: hello " + rank + "\n"), std::string::npos) << log;
    EXPECT_NE(log.find("[rank" + rank + "]: warning " + rank + "\n"), std::string::npos) << log;
    EXPECT_EQ(count(log, "==== dtrain run: attempt 0"), 2) << log;  // a header and an exit line
    EXPECT_NE(log.find("exited with code 0"), std::string::npos) << log;
  }
}

// torchrun's --redirects 1 (stdout to the file only), --local-ranks-filter 1 (the console shows
// local rank 1 only): each stream lands where the two flags say, and nowhere else. These flags
// used to be refused as unknown.
TEST_F(LauncherTest, RedirectsAndLocalRanksFilterRouteEachStream) {
  std::string log_dir = dir_ / "logs";
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "2", "--log-dir", log_dir,
                                 "--redirects", "1", "--local-ranks-filter", "1", "--"},
                                sh("echo \"out $RANK\"; echo \"err $RANK\" >&2")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, "");                            // stdout: redirected to the files
  EXPECT_EQ(lines_of(run.err, 1), Args({"err 1"}));  // stderr: rank 1's only
  EXPECT_EQ(lines_of(run.err, 0), Args()) << run.err;
  for (std::string rank : {"0", "1"}) {
    std::string log = read_file(log_dir + "/rank" + rank + ".log");
    EXPECT_NE(log.find("[rank" + rank + "]: out " + rank + "\n"), std::string::npos) << log;
    EXPECT_EQ(log.find("err " + rank), std::string::npos) << log;  // not redirected nor teed
  }
}

// --role sets ROLE_NAME (torchrun's), and a flag that changes nothing here says so in one line.
TEST_F(LauncherTest, RoleIsTheWorkersRoleNameAndStartMethodWarns) {
  RunResult run = dtrain(concat({"run", "--role", "trainer", "--start-method", "fork", "--"},
                                sh("env > \"$1/env.$RANK\"")));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(parse_env(read_file(dir_ / "env.0"))["ROLE_NAME"], "trainer");
  EXPECT_EQ(run.err.rfind("dtrain run: warning: --start-method fork has no effect", 0), 0u)
      << run.err;
  EXPECT_EQ(count(run.err, "\n"), 1) << run.err;
}

// torchrun's 'gpu' on a node without CUDA devices: one line naming the value, exit code 2 (it used
// to be refused as a value 'gpu' is not, "expected a positive integer or 'auto'").
TEST_F(LauncherTest, NprocPerNodeGpuWithoutCudaIsOneLine) {
  if (dtrain::cli::visible_gpus() > 0) GTEST_SKIP() << "this node has CUDA devices";
  RunResult run = dtrain({"run", "--nproc-per-node", "gpu", "/bin/true"});
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_EQ(count(run.err, "\n"), 1) << run.err;
  EXPECT_EQ(run.err.rfind("dtrain run: --nproc-per-node: expected a positive integer, 'auto', "
                          "'cpu' or 'gpu', got 'gpu'; 'gpu' counts CUDA devices",
                          0),
            0u)
      << run.err;
  RunResult cpu = dtrain({"run", "--nproc-per-node", "cpu", "--", "/bin/true"});
  EXPECT_EQ(cpu.exit_code, 0) << cpu.err;
}

// ---- failures
// ------------------------------------------------------------------------------------

TEST_F(LauncherTest, FirstFailureStopsTheOthersAndIsSummarized) {
  // Rank 1 fails once the others are up; ranks 0 and 2 would sleep for five minutes.
  RunResult run = dtrain(
      concat({"run", "--nproc-per-node", "3", "--grace-period", "2", "--"},
             sh("echo $$ > \"$1/pid.$RANK\";"
                "if [ $RANK = 1 ]; then"
                "  while [ ! -s \"$1/pid.0\" ] || [ ! -s \"$1/pid.2\" ]; do sleep 0.05; done;"
                "  echo 'first words' >&2; echo 'last words of rank 1' >&2; exit 3;"
                "fi; exec sleep 300")));
  std::vector<pid_t> pids = wait_for_pids("pid", 3);
  EXPECT_EQ(run.exit_code, 3) << run.err;
  EXPECT_LT(run.seconds, 20) << "the sleeping ranks were not stopped promptly";
  EXPECT_NE(run.err.find("worker failed: rank 1/3 (local rank 1, pid " + std::to_string(pids[1]) +
                         ") exited with code 3 on attempt 0"),
            std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("dtrain run:   [rank1]: last words of rank 1\n"), std::string::npos)
      << run.err;
  EXPECT_EQ(run.err.find("worker failed: rank 0"), std::string::npos) << run.err;
  EXPECT_EQ(run.err.find("worker failed: rank 2"), std::string::npos) << run.err;
  expect_all_gone(pids, "workers");
}

TEST_F(LauncherTest, WorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "2", "--grace-period", "0.5", "--"},
                                sh("if [ $RANK = 0 ]; then"
                                   "  while [ ! -s \"$1/pid.1\" ]; do sleep 0.05; done; exit 4;"
                                   "fi; trap '' TERM; echo $$ > \"$1/pid.1\";"
                                   "while :; do sleep 0.1; done")));
  EXPECT_EQ(run.exit_code, 4) << run.err;
  EXPECT_LT(run.seconds, 20);
  pid_t stubborn = static_cast<pid_t>(std::stol(read_file(dir_ / "pid.1")));
  cleanup_.push_back(stubborn);
  expect_all_gone({stubborn}, "rank 1, which ignores SIGTERM");
}

// Rank 1 fails; rank 0, told to stop with SIGTERM, saves a checkpoint (`save_s` seconds) and
// exits 143. Each rank writes its pid to pid.<rank>; rank 1 fails only once rank 0's trap is set.
Args saving_on_sigterm_workers(int save_s) {
  return {"/bin/sh", "-c",
          "if [ $RANK = 1 ]; then echo $$ > \"$1/pid.1\";"
          "  while [ ! -e \"$1/ready\" ]; do sleep 0.05; done; exit 3;"
          "fi;"
          "trap 'echo saving; sleep " +
              std::to_string(save_s) +
              "; echo saved; exit 143' TERM;"
              "echo $$ > \"$1/pid.0\"; touch \"$1/ready\"; sleep 300 & wait",
          "sh"};
}

// A signal to the launcher while it stops the other workers after a failure (they have their
// SIGTERM already) is the first signal, not a second: the workers keep their --grace-period, so
// rank 0 finishes saving its checkpoint, and the launcher exits with 128 + SIGTERM. It used to
// SIGKILL them at once, as for a second Ctrl-C.
TEST_F(LauncherTest, SignalWhileStoppingAfterAFailureKeepsTheGracePeriod) {
  Args argv = concat({DTRAIN_LAUNCHER, "run", "--nproc-per-node", "2", "--recovery", "restart",
                      "--grace-period", "10", "--"},
                     concat(saving_on_sigterm_workers(2), {dir_.path().string()}));
  ChildProcess launcher(argv, dir_ / "launcher.out", dir_ / "launcher.err");
  std::vector<pid_t> pids = wait_for_pids("pid", 2);
  ASSERT_TRUE(wait_until(
      [&] { return read_file(dir_ / "launcher.out").find("saving") != std::string::npos; },
      kRunTimeout))
      << read_file(dir_ / "launcher.err");
  kill(launcher.pid(), SIGTERM);
  ASSERT_TRUE(launcher.wait(kRunTimeout)) << read_file(dir_ / "launcher.err");
  const std::string out = read_file(dir_ / "launcher.out");
  const std::string err = read_file(dir_ / "launcher.err");
  EXPECT_EQ(launcher.exit_code(), 128 + SIGTERM) << err;
  EXPECT_EQ(lines_of(out, 0), (std::vector<std::string>{"saving", "saved"}))
      << "rank 0 was killed while it saved:\n"
      << out << err;
  EXPECT_NE(err.find("received SIGTERM"), std::string::npos) << err;
  expect_all_gone(pids, "workers");
}

// A second signal still cuts the grace short (SIGKILL), and the exit code is the first signal's.
TEST_F(LauncherTest, SecondSignalWhileStoppingAfterAFailureKillsAtOnce) {
  Args argv = concat({DTRAIN_LAUNCHER, "run", "--nproc-per-node", "2", "--recovery", "restart",
                      "--grace-period", "20", "--"},
                     concat(saving_on_sigterm_workers(15), {dir_.path().string()}));
  ChildProcess launcher(argv, dir_ / "launcher.out", dir_ / "launcher.err");
  std::vector<pid_t> pids = wait_for_pids("pid", 2);
  ASSERT_TRUE(wait_until(
      [&] { return read_file(dir_ / "launcher.out").find("saving") != std::string::npos; },
      kRunTimeout))
      << read_file(dir_ / "launcher.err");
  kill(launcher.pid(), SIGTERM);
  std::this_thread::sleep_for(300ms);
  Clock::time_point second = Clock::now();
  kill(launcher.pid(), SIGINT);
  ASSERT_TRUE(launcher.wait(kRunTimeout)) << read_file(dir_ / "launcher.err");
  const double after_second = std::chrono::duration<double>(Clock::now() - second).count();
  const std::string err = read_file(dir_ / "launcher.err");
  EXPECT_EQ(launcher.exit_code(), 128 + SIGTERM) << err;
  EXPECT_LT(after_second, 10) << "the second signal did not cut the grace period short\n" << err;
  EXPECT_EQ(read_file(dir_ / "launcher.out").find("saved"), std::string::npos);
  expect_all_gone(pids, "workers");
}

TEST_F(LauncherTest, SignalDeathIsNamedInTheSummary) {
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "2", "--grace-period", "1", "--"},
                                sh("if [ $RANK = 0 ]; then echo 'about to die' >&2; kill -9 $$; fi;"
                                   " exec sleep 300")));
  EXPECT_EQ(run.exit_code, 128 + SIGKILL) << run.err;
  EXPECT_NE(run.err.find("worker failed: rank 0/2"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("killed by signal 9 (SIGKILL)"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("[rank0]: about to die"), std::string::npos) << run.err;
}

TEST_F(LauncherTest, ExecFailureIsReportedAsAWorkerFailure) {
  write_file(dir_ / "no_shebang", "echo this is not a binary\n", /*executable=*/true);
  RunResult run = dtrain({"run", dir_ / "no_shebang"});
  EXPECT_EQ(run.exit_code, 127) << run.err;
  EXPECT_NE(run.err.find("cannot execute"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("Exec format error"), std::string::npos) << run.err;
}

TEST_F(LauncherTest, AScriptWhoseInterpreterIsMissingIsOneLineAndNotRestarted) {
  write_file(dir_ / "bad.sh", "#!/usr/bin/no-such-shell -e\necho never\n", /*executable=*/true);
  RunResult run = dtrain({"run", "--max-restarts", "3", dir_ / "bad.sh"});
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_NE(run.err.find("bad.sh': its #! line asks for the interpreter '/usr/bin/no-such-shell', "
                         "which does not exist on this node"),
            std::string::npos)
      << run.err;
  EXPECT_EQ(run.err.find("restart"), std::string::npos) << run.err;
  EXPECT_EQ(run.err.find("No such file or directory"), std::string::npos) << run.err;
}

TEST_F(LauncherTest, RestartsUntilAnAttemptSucceeds) {
  std::string log_dir = dir_ / "logs";
  RunResult run = dtrain(
      concat({"run", "--nproc-per-node", "2", "--max-restarts", "2", "--log-dir", log_dir, "--"},
             sh("echo \"attempt $TORCHELASTIC_RESTART_COUNT\";"
                "if [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then"
                "  echo \"failing attempt $TORCHELASTIC_RESTART_COUNT\" >&2; exit 1;"
                "fi; echo done")));
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(count(run.err, "worker failed:"), 2) << run.err;
  EXPECT_NE(run.err.find("on attempt 0"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("on attempt 1"), std::string::npos) << run.err;
  EXPECT_EQ(count(run.err, "restarting the worker group"), 2) << run.err;
  for (int rank : {0, 1}) {
    // Attempts 0 and 1 may have been stopped before this rank printed; attempt 2 runs to the end.
    std::vector<std::string> lines = lines_of(run.out, rank);
    ASSERT_GE(lines.size(), 2u) << run.out;
    EXPECT_EQ(Args(lines.end() - 2, lines.end()), Args({"attempt 2", "done"})) << run.out;
    std::string log = read_file(log_dir + "/rank" + std::to_string(rank) + ".log");
    EXPECT_EQ(count(log, ", started "), 3) << log;  // one header per attempt, appended
  }
}

TEST_F(LauncherTest, GivesUpWhenRestartsRunOut) {
  RunResult run =
      dtrain(concat({"run", "--max-restarts", "1", "--"},
                    sh("echo \"failing attempt $TORCHELASTIC_RESTART_COUNT\" >&2; exit 5")));
  EXPECT_EQ(run.exit_code, 5) << run.err;
  EXPECT_EQ(count(run.err, "worker failed:"), 2) << run.err;
  EXPECT_NE(run.err.find("no restarts left (--max-restarts 1); exiting with code 5"),
            std::string::npos)
      << run.err;
}

TEST_F(LauncherTest, UsageErrorIsNotRestarted) {
  RunResult run = dtrain(concat({"run", "--max-restarts", "3", "--"},
                                sh("echo \"attempt $TORCHELASTIC_RESTART_COUNT\" >&2; exit 2")));
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_EQ(count(run.err, "worker failed:"), 1) << run.err;
  EXPECT_NE(run.err.find("not restarting: exit code 2 is a usage error"), std::string::npos)
      << run.err;
}

// ---- stopping the launcher
// -----------------------------------------------------------------------

class LauncherSignalTest : public LauncherTest, public testing::WithParamInterface<int> {};

TEST_P(LauncherSignalTest, ForwardsToEveryWorkerAndItsChildren) {
  const int signo = GetParam();
  Args argv =
      concat({DTRAIN_LAUNCHER, "run", "--nproc-per-node", "2", "--grace-period", "2", "--"},
             sh("sleep 300 & echo $! > \"$1/child.$RANK\"; echo $$ > \"$1/pid.$RANK\"; wait"));
  ChildProcess launcher(argv, dir_ / "launcher.out", dir_ / "launcher.err");
  std::vector<pid_t> workers = wait_for_pids("pid", 2);
  std::vector<pid_t> children = wait_for_pids("child", 2);
  kill(launcher.pid(), signo);
  ASSERT_TRUE(launcher.wait(kRunTimeout)) << "the launcher did not exit after the signal";
  EXPECT_EQ(launcher.exit_code(), 128 + signo) << read_file(dir_ / "launcher.err");
  EXPECT_NE(read_file(dir_ / "launcher.err").find("received SIG"), std::string::npos);
  expect_all_gone(workers, "workers");
  expect_all_gone(children, "children of workers");
}

INSTANTIATE_TEST_SUITE_P(Signals, LauncherSignalTest,
                         testing::Values(SIGTERM, SIGINT, SIGHUP, SIGQUIT),
                         [](const testing::TestParamInfo<int>& info) {
                           return dtrain::elastic::signal_name(info.param);
                         });

TEST_F(LauncherTest, SigkilledLauncherLeavesNoWorker) {
  Args argv = concat({DTRAIN_LAUNCHER, "run", "--nproc-per-node", "2", "--"},
                     sh("echo $$ > \"$1/pid.$RANK\"; exec sleep 300"));
  ChildProcess launcher(argv, dir_ / "launcher.out", dir_ / "launcher.err");
  std::vector<pid_t> workers = wait_for_pids("pid", 2);
  kill(launcher.pid(), SIGKILL);
  ASSERT_TRUE(launcher.wait(kRunTimeout));
  expect_all_gone(workers, "workers of the killed launcher");
}

// ---- bad input
// -----------------------------------------------------------------------------------

struct BadRun {
  Args args;             // after "dtrain"; "{dir}" stands for the test's temporary folder
  std::string expected;  // text the single stderr line must contain
};

class LauncherRejects : public LauncherTest, public testing::WithParamInterface<BadRun> {};

TEST_P(LauncherRejects, WithExitCodeTwoAndOneLine) {
  write_file(dir_ / "not_executable", "#!/bin/sh\n", /*executable=*/false);
  Args args = GetParam().args;
  for (std::string& arg : args) {
    if (std::size_t at = arg.find("{dir}"); at != std::string::npos)
      arg.replace(at, 5, dir_.path().string());
  }
  RunResult run = dtrain(args);
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_EQ(count(run.err, "\n"), 1) << run.err;
  EXPECT_TRUE(!run.err.empty() && run.err.back() == '\n') << run.err;
  EXPECT_NE(run.err.find(GetParam().expected), std::string::npos) << run.err;
  EXPECT_EQ(run.out, "");
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, LauncherRejects,
    testing::Values(
        BadRun{{"run", "--bogus", "/bin/true"}, "dtrain run: unknown flag '--bogus'"},
        BadRun{{"run", "--nproc-per-node"}, "dtrain run: --nproc-per-node: missing value"},
        BadRun{{"run", "--nproc-per-node", "two", "/bin/true"},
               "dtrain run: --nproc-per-node: expected a positive integer, 'auto', 'cpu' or "
               "'gpu', got 'two'"},
        BadRun{{"run", "--nproc-per-node", "0", "/bin/true"},
               "dtrain run: --nproc-per-node: expected a positive integer, 'auto', 'cpu' or "
               "'gpu', got '0'"},
        BadRun{{"run", "--redirects", "3", "/bin/true"},
               "dtrain run: --redirects: '3' writes to <dir>/rank<R>.log, but no --log-dir"},
        BadRun{{"run", "--tee", "9", "--log-dir", "{dir}/logs", "/bin/true"},
               "dtrain run: --tee: expected 0..3"},
        BadRun{{"run", "-m", "mymod"}, "dtrain run: -m/--module: runs Python module 'mymod'"},
        BadRun{{"run", "--run-path", "{dir}/train.py"}, "dtrain run: --run-path: runs '"},
        BadRun{{"run", "--start-method", "thread", "/bin/true"},
               "dtrain run: --start-method: expected one of spawn, fork, forkserver"},
        BadRun{{"run", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "/bin/true"},
               "dtrain run: --node-rank: expected an integer in 0..1 (below --nnodes 2), got '2'"},
        BadRun{{"run", "--nnodes", "1:2", "/bin/true"},
               "dtrain run: --nnodes: an elastic range 1:2 needs --rdzv-backend c10d or etcd"},
        BadRun{{"run", "--nnodes", "3:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                "127.0.0.1:29400", "/bin/true"},
               "dtrain run: --nnodes: expected MIN:MAX with MIN <= MAX, got '3:2'"},
        BadRun{{"run", "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                "127.0.0.1:", "/bin/true"},
               "dtrain run: --rdzv-endpoint: expected HOST:PORT"},
        BadRun{{"run", "--rdzv-endpoint", "hostA:0", "/bin/true"},
               "dtrain run: --rdzv-endpoint: expected HOST:PORT with a port in 1..65535, got "
               "'hostA:0'; give the port"},
        BadRun{{"run", "--rdzv-backend", "consul", "/bin/true"},
               "dtrain run: --rdzv-backend: expected one of c10d, etcd, static, got 'consul'"},
        BadRun{{"run", "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                "127.0.0.1:29400", "--rdzv-conf", "timeout=1,colour=red", "/bin/true"},
               "dtrain run: --rdzv-conf: unknown key 'colour'"},
        BadRun{{"run", "--nnodes", "2", "/bin/true"},
               "dtrain run: --master-port: required with --nnodes 2"},
        BadRun{{"run", "--master-port", "65536", "/bin/true"},
               "dtrain run: --master-port: expected a port"},
        BadRun{{"run", "--max-restarts", "x", "/bin/true"}, "dtrain run: --max-restarts"},
        BadRun{{"run", "--recovery", "sometimes", "/bin/true"},
               "dtrain run: --recovery: expected one of restart, in-place, got 'sometimes'"},
        BadRun{{"run", "--grace-period", "-1", "/bin/true"}, "dtrain run: --grace-period"},
        // A name that can never resolve is a bad flag; one that may resolve later is waited for.
        BadRun{{"run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "no such host",
                "--master-port", "29500", "/bin/true"},
               "dtrain run: --master-addr: 'no such host' is not a host name or address"},
        BadRun{{"run", "--nproc-per-node", "2"}, "dtrain run: no program given"},
        BadRun{{"run", "dtrain-no-such-program"},
               "dtrain run: program 'dtrain-no-such-program': not found on PATH"},
        BadRun{{"run", "{dir}/missing"}, "/missing': no such file"},
        BadRun{{"run", "{dir}/not_executable"}, "not executable"},
        BadRun{{"run", "--no-python", "{dir}/script.py"}, "/script.py': no such file"},
        BadRun{{"run", "--log-dir", "/proc/dtrain-cannot-create", "/bin/true"},
               "dtrain run: --log-dir"},
        BadRun{{"frobnicate"}, "dtrain: unknown command 'frobnicate'"},
        BadRun{{}, "dtrain: missing command"}));

TEST_F(LauncherTest, PortInUseOnTheMasterIsRejected) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t length = sizeof(address);
  getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  std::string port = std::to_string(ntohs(address.sin_port));

  RunResult run = dtrain({"run", "--master-port", port, "/bin/true"});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(run.err,
            "dtrain run: --master-port " + port +
                ": port is already in use on 127.0.0.1; pick another or pass 0 for a free one\n");
  // Another node's launcher does not host the store, so it does not check.
  RunResult other_node =
      dtrain({"run", "--nnodes", "2", "--node-rank", "1", "--master-port", port, "/bin/true"});
  EXPECT_EQ(other_node.exit_code, 0) << other_node.err;
  close(listener);
}

// A master whose name does not resolve yet (a scheduler such as Kubernetes registers a pod's name
// once it runs, maybe after the other nodes started) is no bad flag: another node waits for it up
// to --rdzv-conf join_timeout, as torchrun's store retries the lookup, then ends with one line that
// names the host, the resolver's answer and how long it tried, and exit code 1, which a scheduler
// retries. It used to be exit code 2 at once.
TEST_F(LauncherTest, MasterThatDoesNotResolveIsWaitedForThenEndsWithExitCodeOne) {
  RunResult run =
      dtrain({"run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "master-0.svc.invalid",
              "--master-port", "29500", "--rdzv-conf", "join_timeout=2", "/bin/true"});
  EXPECT_EQ(run.exit_code, 1) << run.err;
  EXPECT_GE(run.seconds, 2) << run.err;
  EXPECT_NE(run.err.find("dtrain run: --master-addr: the host name 'master-0.svc.invalid' did not "
                         "resolve ("),
            std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find(") after trying for 2"), std::string::npos) << run.err;
  EXPECT_EQ(count(run.err, "did not resolve"), 1) << run.err;
}

// A signal ends that wait at once, with 128 + signal.
TEST_F(LauncherTest, SignalWhileWaitingForTheMastersNameEndsAtOnce) {
  Args argv = {DTRAIN_LAUNCHER, "run",   "--nnodes",      "2",
               "--node-rank",   "1",     "--master-addr", "master-0.svc.invalid",
               "--master-port", "29500", "--rdzv-conf",   "join_timeout=60",
               "/bin/true"};
  ChildProcess launcher(argv, dir_ / "launcher.out", dir_ / "launcher.err");
  ASSERT_TRUE(wait_until(
      [&] {
        return read_file(dir_ / "launcher.err").find("does not resolve") != std::string::npos;
      },
      kRunTimeout))
      << read_file(dir_ / "launcher.err");
  Clock::time_point sent = Clock::now();
  kill(launcher.pid(), SIGINT);
  ASSERT_TRUE(launcher.wait(kRunTimeout)) << read_file(dir_ / "launcher.err");
  const std::string err = read_file(dir_ / "launcher.err");
  EXPECT_EQ(launcher.exit_code(), 128 + SIGINT) << err;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - sent).count(), 5) << err;
  EXPECT_NE(err.find("received SIGINT while waiting for --master-addr to resolve"),
            std::string::npos)
      << err;
}

TEST_F(LauncherTest, BadDtrainPythonIsRejected) {
  write_file(dir_ / "script.py", "print('hi')\n");
  RunResult run = dtrain({"run", dir_ / "script.py"}, {{"DTRAIN_PYTHON", dir_ / "no-python"}});
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(count(run.err, "\n"), 1) << run.err;
  EXPECT_EQ(run.err.rfind("dtrain run: DTRAIN_PYTHON: '", 0), 0u) << run.err;
}

TEST_F(LauncherTest, HelpPrintsUsageAndExitsZero) {
  for (Args args : {Args{"run", "--help"}, Args{"run", "-h"}, Args{"help", "run"}}) {
    RunResult run = dtrain(args);
    EXPECT_EQ(run.exit_code, 0);
    EXPECT_NE(run.out.find("usage: dtrain run"), std::string::npos) << run.out;
    EXPECT_NE(run.out.find("  --recovery MODE        in-place (default): only the failed worker"),
              std::string::npos)
        << run.out;
    EXPECT_NE(run.out.find("DTRAIN_RECOVERY_JOIN=1"), std::string::npos) << run.out;
    EXPECT_EQ(run.err, "");
  }
  RunResult top = dtrain({"--help"});
  EXPECT_EQ(top.exit_code, 0);
  EXPECT_NE(top.out.find("usage: dtrain <command>"), std::string::npos) << top.out;
}

// ---- Python workers
// ------------------------------------------------------------------------------

// The interpreter with torch (the `python3` first on PATH may lack it).
constexpr const char* kSystemPython = "/usr/bin/python3";

TEST_F(LauncherTest, PythonScriptRunsUnderDtrainPython) {
  if (access(kSystemPython, X_OK) != 0) GTEST_SKIP() << kSystemPython << " is missing";
  write_file(dir_ / "show.py",
             "import os, sys\nprint('rank', os.environ['RANK'], 'args', sys.argv[1:])\n");
  RunResult run = dtrain({"run", "--nproc_per_node=2", dir_ / "show.py", "--flag", "x"},
                         {{"DTRAIN_PYTHON", kSystemPython}});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("[rank0]: rank 0 args ['--flag', 'x']\n"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("[rank1]: rank 1 args ['--flag', 'x']\n"), std::string::npos) << run.out;
}

TEST_F(LauncherTest, TorchAllReduceAcrossTwoRanks) {
  const std::string python = dtrain::testing::python_with_torch();
  if (python.empty()) GTEST_SKIP() << dtrain::testing::kNoPythonWithTorch;
  write_file(
      dir_ / "allreduce.py",
      "import torch, torch.distributed as dist\n"
      "dist.init_process_group('gloo')\n"
      "t = torch.ones(1) * (dist.get_rank() + 1)\n"
      "dist.all_reduce(t)\n"
      "print('sum', t.item())\n"
      // Without it PyTorch 2.15 sometimes aborts at exit ("terminate called without an
      // active exception"), under either kind of recovery: about 1 run in 10 on 2 busy cores.
      "dist.destroy_process_group()\n");
  RunResult run =
      dtrain({"run", "--nproc-per-node", "2", "--", python, dir_ / "allreduce.py"}, {}, 120s);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("[rank0]: sum 3.0\n"), std::string::npos) << run.out << run.err;
  EXPECT_NE(run.out.find("[rank1]: sum 3.0\n"), std::string::npos) << run.out << run.err;
}

// ---- PyTorch training programs (tests/python): ranks agree, and match one process
// ------------------------------------------------------------------------------

// "sum=S weighted=W" as tests/python/equivalence.py's checksum() prints it.
struct Checksum {
  double sum = 0;
  double weighted = 0;
};
std::optional<Checksum> parse_checksum(const std::string& text) {
  Checksum checksum;
  if (std::sscanf(text.c_str(), "sum=%lf weighted=%lf", &checksum.sum, &checksum.weighted) != 2) {
    return std::nullopt;
  }
  return checksum;
}

// The text after `marker` on the first of `lines` that starts with it; empty if none does.
std::string text_after(const std::vector<std::string>& lines, const std::string& marker) {
  for (const std::string& line : lines) {
    if (line.rfind(marker, 0) == 0) return line.substr(marker.size());
  }
  return "";
}

// Float32 parameters summed in another order (an all-reduce of per-rank gradients vs one batch):
// the reference and the ranks differ by about 1e-7 relative. 1e-5 leaves a wide margin, while a
// wrong learning rate, a rank's missing data or a sum instead of a mean moves them by 1e-2 or more.
constexpr double kReferenceTolerance = 1e-5;

class TrainingScriptTest : public LauncherTest {
 protected:
  // Trains tests/python/<script> (which prints "<name> checksum rank=R sum=.. weighted=..") on two
  // ranks under `dtrain run`, and with --reference 2 in one process on the data of both ranks.
  // Checks that both ranks print the same checksum (bit for bit: every rank must hold the same
  // parameters) and that it matches the reference within kReferenceTolerance.
  void expect_ranks_agree_with_reference(const std::string& script, const std::string& name) {
    const std::string python = dtrain::testing::python_with_torch();
    if (python.empty()) GTEST_SKIP() << dtrain::testing::kNoPythonWithTorch;
    const std::string path = std::string(DTRAIN_TEST_PYTHON_SCRIPTS) + "/" + script;
    // The reference trains meanwhile: both are mostly Python start-up.
    ChildProcess reference({dtrain::elastic::find_executable(python), path, "--reference", "2"},
                           dir_ / "reference.out", dir_ / "reference.err");
    RunResult run = dtrain({"run", "--nproc-per-node", "2", "--", python, path}, {}, 120s);
    ASSERT_TRUE(reference.wait(120s)) << "the reference run did not finish";
    ASSERT_EQ(reference.exit_code(), 0) << read_file(dir_ / "reference.err");
    ASSERT_EQ(run.exit_code, 0) << run.out << run.err;

    std::string rank0 = text_after(lines_of(run.out, 0), name + " checksum rank=0 ");
    std::string rank1 = text_after(lines_of(run.out, 1), name + " checksum rank=1 ");
    ASSERT_TRUE(parse_checksum(rank0)) << "rank 0 printed no checksum\n" << run.out << run.err;
    EXPECT_EQ(rank0, rank1) << "the ranks hold different parameters after training";

    std::string reference_text = read_file(dir_ / "reference.out");
    std::optional<Checksum> expected =
        parse_checksum(text_after({reference_text}, name + " checksum reference "));
    ASSERT_TRUE(expected) << "the reference printed no checksum: " << reference_text;
    for (const std::string& text : {rank0, rank1}) {
      std::optional<Checksum> actual = parse_checksum(text);
      ASSERT_TRUE(actual) << text;
      EXPECT_NEAR(actual->sum, expected->sum,
                  kReferenceTolerance * std::max(1.0, std::abs(expected->sum)))
          << "parameter sum, distributed vs one process";
      EXPECT_NEAR(actual->weighted, expected->weighted,
                  kReferenceTolerance * std::max(1.0, std::abs(expected->weighted)))
          << "position-weighted parameter sum, distributed vs one process";
    }
  }
};

TEST_F(TrainingScriptTest, TorchDdpRanksAgreeWithOneProcess) {
  expect_ranks_agree_with_reference("ddp_smoke.py", "ddp");
}

// FSDP2 (torch.distributed.fsdp.fully_shard) on CPU over gloo: each rank gathers the full
// parameters (DTensor.full_tensor()) before printing.
TEST_F(TrainingScriptTest, TorchFsdp2RanksAgreeWithOneProcess) {
  expect_ranks_agree_with_reference("fsdp2_smoke.py", "fsdp2");
}

}  // namespace
