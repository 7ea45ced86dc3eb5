// `dtrain run --recovery in-place` end to end: a failed worker is restarted alone as a newcomer
// (DTRAIN_RECOVERY_JOIN=1) while the others keep running, rank 0 too (the launcher hosts the
// workers' store); workers that form no in-place group restart together; restarts run out as in
// restart mode. The workers are /bin/sh
// scripts that record their pid and environment per attempt in the test's temporary folder
// ("<what>.<rank>.<TORCHELASTIC_RESTART_COUNT>"). Every wait is bounded, in the launcher run
// (kRunTimeout) and in the scripts' loops (600 x 0.05 s).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "launcher/elastic/worker_store.h"
#include "launcher_fixture.h"
#include "support/subprocess.h"
#include "test_support.h"

namespace {

using namespace dtrain::cli::testing_support;

class RecoveryTest : public LauncherTest {
 protected:
  // The environment a worker dumped for attempt `attempt`; empty when it never ran that attempt.
  std::map<std::string, std::string> env_of(int rank, int attempt) {
    return parse_env(
        read_file(dir_ / ("env." + std::to_string(rank) + "." + std::to_string(attempt))));
  }
  // The pid in the file $1/<name>, or -1 when the worker never wrote it.
  pid_t pid_in(const std::string& name) {
    std::string text = read_file(dir_ / name);
    return text.empty() ? -1 : static_cast<pid_t>(std::stol(text));
  }
  // Left for TearDown to kill if the test fails before the launcher stopped it.
  void clean_up(const std::string& pid_file) {
    if (pid_t pid = pid_in(pid_file); pid > 0) cleanup_.push_back(pid);
  }
};

// Records this attempt's pid and environment; then `rest`. The worker does not recover in place.
std::string recorded_only(const std::string& rest) {
  return "echo $$ > \"$1/pid.$RANK.$TORCHELASTIC_RESTART_COUNT\";"
         "env > \"$1/env.$RANK.$TORCHELASTIC_RESTART_COUNT\";" +
         rest;
}

// As recorded_only, after writing into the launcher's store (WorkerStore, TCPStore's protocol:
// VALIDATE with its magic number, then SET) the key that dtrain::ResilientDataParallel's first
// generation writes: the launcher then knows the workers recover in place.
std::string recorded(const std::string& rest) {
  return "python3 -c 'import os, socket, struct;"
         " s = socket.create_connection((os.environ[\"MASTER_ADDR\"], "
         "int(os.environ[\"MASTER_PORT\"])));"
         " k = b\"/dtrain/recovery/g0/closed\"; v = b\"sh\";"
         " s.sendall(b\"\\0\" + struct.pack(\"<I\", 0x3C85F7CE) + b\"\\1\" +"
         " struct.pack(\"<Q\", len(k)) + k + struct.pack(\"<Q\", len(v)) + v); s.close()' || exit "
         "9;" +
         recorded_only(rest);
}

// Waits (at most 30 s) until the file $1/<name> is written.
std::string wait_for(const std::string& name) {
  return "n=0; while [ ! -s \"$1/" + name + "\" ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1));" +
         " done;";
}

TEST_F(RecoveryTest, AFailedWorkerIsRestartedAloneAsANewcomer) {
  // Local rank 1 of 3 fails on its first run once the others are up. Ranks 0 and 2 wait for its
  // replacement, then write their pid again: the same process, never restarted.
  RunResult run = dtrain(
      concat(
          {"run", "--nproc-per-node", "3", "--recovery", "in-place", "--max-restarts", "2", "--"},
          sh(recorded("if [ $RANK = 1 ]; then"
                      "  if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then " +
                      wait_for("pid.0.0") + wait_for("pid.2.0") +
                      "    echo 'rank 1 dies' >&2; exit 3;"
                      "  fi; exit 0;"
                      "fi;" +
                      wait_for("pid.1.1") + "echo $$ > \"$1/end.$RANK\"; exit 0"))),
      {{"DTRAIN_RECOVERY_JOIN", "1"}});  // inherited: must not reach the first workers
  EXPECT_EQ(run.exit_code, 0) << run.err;
  for (int rank : {0, 2}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    pid_t first = pid_in("pid." + std::to_string(rank) + ".0");
    EXPECT_GT(first, 0);
    EXPECT_EQ(pid_in("end." + std::to_string(rank)), first) << "the survivor was restarted";
    EXPECT_TRUE(env_of(rank, 1).empty()) << "the survivor ran a second attempt";
    EXPECT_EQ(env_of(rank, 0).count("DTRAIN_RECOVERY_JOIN"), 0u);
    EXPECT_EQ(env_of(rank, 0)["DTRAIN_RECOVERY"], "in-place");
  }
  pid_t dead = pid_in("pid.1.0");
  std::map<std::string, std::string> newcomer = env_of(1, 1);
  EXPECT_EQ(env_of(1, 0).count("DTRAIN_RECOVERY_JOIN"), 0u);
  EXPECT_EQ(newcomer["DTRAIN_RECOVERY_JOIN"], "1");
  EXPECT_EQ(newcomer["TORCHELASTIC_RESTART_COUNT"], "1");
  EXPECT_EQ(newcomer["DTRAIN_RECOVERY"], "in-place");
  EXPECT_EQ(newcomer["RANK"], "1");
  EXPECT_EQ(newcomer["LOCAL_RANK"], "1");
  EXPECT_EQ(newcomer["WORLD_SIZE"], "3");
  // The survivors' store is still where it was: the newcomer must find it there.
  EXPECT_EQ(newcomer["MASTER_PORT"], env_of(0, 0)["MASTER_PORT"]);
  EXPECT_TRUE(newcomer["TORCHELASTIC_ERROR_FILE"].ends_with("/attempt_1/1/error.json"))
      << newcomer["TORCHELASTIC_ERROR_FILE"];
  EXPECT_NE(pid_in("pid.1.1"), dead);
  EXPECT_NE(run.err.find("dtrain run: rank 1/3 (local rank 1, pid " + std::to_string(dead) +
                         ") exited with code 3 on attempt 0; restarting it alone as a newcomer, "
                         "the other workers keep running (restart 1 of 2)\n"),
            std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("[rank1]: rank 1 dies"), std::string::npos) << run.err;
  EXPECT_EQ(count(run.err, "restarting the worker group"), 0) << run.err;
  EXPECT_EQ(count(run.err, "worker failed:"), 0) << run.err;
}

TEST_F(RecoveryTest, RankZeroIsRestartedAloneToo) {
  // The launcher hosts the workers' store (TORCHELASTIC_USE_AGENT_STORE=True), so rank 0's death
  // takes nothing from the survivors: it is restarted alone like any other rank.
  RunResult run =
      dtrain(concat({"run", "--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts",
                     "1", "--grace-period", "2", "--"},
                    sh(recorded("if [ $RANK = 0 ]; then"
                                "  if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then " +
                                wait_for("pid.1.0") +
                                " exit 3; fi; exit 0;"
                                "fi;" +
                                wait_for("pid.0.1") + "echo $$ > \"$1/end.$RANK\"; exit 0"))));
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.err.find("restarting it alone as a newcomer"), std::string::npos) << run.err;
  EXPECT_EQ(pid_in("end.1"), pid_in("pid.1.0")) << "rank 1 was restarted";
  std::map<std::string, std::string> newcomer = env_of(0, 1);
  EXPECT_EQ(newcomer["DTRAIN_RECOVERY_JOIN"], "1");
  EXPECT_EQ(newcomer["TORCHELASTIC_USE_AGENT_STORE"], "True");
  EXPECT_EQ(newcomer["MASTER_PORT"], env_of(1, 0)["MASTER_PORT"]);
  EXPECT_EQ(env_of(1, 0)["TORCHELASTIC_USE_AGENT_STORE"], "True");
}

TEST_F(RecoveryTest, WorkersThatFormNoInPlaceGroupRestartTogether) {
  // Workers that never wrote the in-place group's key into the store (a program without
  // dtrain::ResilientDataParallel) cannot take a newcomer: their survivors would fail too. So rank
  // 1's failure stops rank 0 (which would sleep for five minutes) and both start again, neither
  // as a newcomer.
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "2", "--recovery", "in-place",
                                 "--max-restarts", "1", "--grace-period", "2", "--"},
                                sh(recorded_only("if [ $TORCHELASTIC_RESTART_COUNT != 0 ]; then "
                                                 "exit 0; fi;"
                                                 "if [ $RANK = 1 ]; then " +
                                                 wait_for("pid.0.0") +
                                                 " exit 3; fi;"
                                                 "exec sleep 300"))));
  clean_up("pid.0.0");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_LT(run.seconds, 20) << "rank 0 was not stopped promptly";
  EXPECT_NE(run.err.find("dtrain run: the workers formed no in-place group"), std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("restarting the worker group of this node: attempt 1 (restart 1 of 1)"),
            std::string::npos)
      << run.err;
  EXPECT_EQ(run.err.find("restarting it alone"), std::string::npos) << run.err;
  expect_all_gone({pid_in("pid.0.0")}, "rank 0 of the first attempt");
  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    std::map<std::string, std::string> second = env_of(rank, 1);
    EXPECT_EQ(second["TORCHELASTIC_RESTART_COUNT"], "1");
    EXPECT_EQ(second.count("DTRAIN_RECOVERY_JOIN"), 0u);
  }
}

// On a node other than 0 the store is node 0's launcher's, so this node's launcher asks it
// (check_in_worker_store) whether the workers formed an in-place group. The test hosts that store
// as node 0's launcher would, and runs node 1 alone, in place by default: first with workers that
// do not recover in place, whose failure restarts the node's group (it must not restart one alone:
// a program's survivors that do not recover in place fail too); then with workers that wrote the
// group's key, one of which is restarted alone.
TEST_F(RecoveryTest, OnAnotherNodeTheLauncherAsksNodeZerosStoreWhetherToRestartOneAlone) {
  for (const bool in_place_group : {false, true}) {
    SCOPED_TRACE(in_place_group ? "an in-place group" : "no in-place group");
    dtrain::elastic::WorkerStore node_zeros("127.0.0.1", 0);
    const std::string script =
        "if [ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $LOCAL_RANK = 1 ]; then exit 3; fi; exit 0";
    RunResult run = dtrain(concat(
        {"run", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-port",
         std::to_string(node_zeros.port()), "--max-restarts", "1", "--grace-period", "2", "--"},
        sh(in_place_group ? recorded(script) : recorded_only(script))));
    EXPECT_EQ(run.exit_code, 0) << run.err;
    EXPECT_EQ(run.err.find("could not"), std::string::npos) << run.err;
    if (in_place_group) {
      EXPECT_NE(run.err.find("rank 3/4 (local rank 1, pid " + std::to_string(pid_in("pid.3.0")) +
                             ") exited with code 3 on attempt 0; restarting it alone"),
                std::string::npos)
          << run.err;
      EXPECT_EQ(env_of(3, 1)["DTRAIN_RECOVERY_JOIN"], "1");
    } else {
      EXPECT_NE(run.err.find("dtrain run: the workers formed no in-place group"), std::string::npos)
          << run.err;
      EXPECT_EQ(run.err.find("restarting it alone"), std::string::npos) << run.err;
      EXPECT_EQ(env_of(3, 1).count("DTRAIN_RECOVERY_JOIN"), 0u);
      EXPECT_EQ(env_of(2, 1)["TORCHELASTIC_RESTART_COUNT"], "1");  // the whole node's group
    }
  }
}

TEST_F(RecoveryTest, WhenRestartsRunOutTheSurvivorsGoOnWithoutTheWorker) {
  // Rank 1 fails every time: its first failure is restarted alone; the newcomer's failure finds no
  // restart left, and since the workers recover in place, rank 0 goes on without it: a smaller job,
  // not a stopped one. Rank 0 finishes once the newcomer has failed, and the job succeeds.
  RunResult run = dtrain(concat(
      {"run", "--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "1",
       "--grace-period", "2", "--"},
      sh(recorded("if [ $RANK = 1 ]; then " + wait_for("pid.0.0") +
                  " echo \"failing attempt $TORCHELASTIC_RESTART_COUNT\" >&2;"
                  " echo x > \"$1/failed.$TORCHELASTIC_RESTART_COUNT\"; exit 5; fi;" +
                  wait_for("failed.1") + " sleep 0.5; echo $$ > \"$1/end.$RANK\"; exit 0"))));
  clean_up("pid.0.0");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(count(run.err, "restarting it alone as a newcomer"), 1) << run.err;
  EXPECT_NE(
      run.err.find("dtrain run: rank 1/2 (local rank 1, pid " + std::to_string(pid_in("pid.1.1")) +
                   ") exited with code 5 on attempt 1; no restart left to replace it "
                   "(--max-restarts 1): the other 1 worker(s) go on without it\n"),
      std::string::npos)
      << run.err;
  EXPECT_EQ(pid_in("end.0"), pid_in("pid.0.0")) << "rank 0 was restarted";
  EXPECT_EQ(count(run.err, "worker failed:"), 0) << run.err;
}

// Reads (polling up to 10 s) the exit notice of the worker whose pid is in $1/pid.1.0 from the
// workers' store, as dtrain::ResilientDataParallel's membership does (src/recovery/membership.h:
// "exited/<host>/<pid>/<pid namespace>"): CHECK until it exists, then GET; writes it to $1/exited.
constexpr const char* kReadExitNotice = R"(import os, socket, struct, sys, time
d = sys.argv[1]
pid = open(os.path.join(d, "pid.1.0")).read().strip()
key = ("/dtrain/recovery/exited/%s/%s/%d" % (socket.gethostname(), pid,
       os.stat("/proc/self/ns/pid").st_ino)).encode()
s = socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
def receive(n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            sys.exit(8)
        data += chunk
    return data
s.sendall(b"\0" + struct.pack("<I", 0x3C85F7CE))
for _ in range(200):
    s.sendall(b"\5" + struct.pack("<Q", 1) + struct.pack("<Q", len(key)) + key)
    if receive(1) == b"\0":
        s.sendall(b"\3" + struct.pack("<Q", len(key)) + key)
        value = receive(struct.unpack("<Q", receive(8))[0])
        open(os.path.join(d, "exited"), "wb").write(value)
        break
    time.sleep(0.05)
)";

TEST_F(RecoveryTest, AFailedWorkersDeathIsWrittenIntoTheWorkersStore) {
  // Note [Heartbeats] (src/recovery/membership.h): survivors on other hosts cannot check a dead
  // worker's pid, so its launcher writes its death into the store they all reach. Rank 1 fails;
  // rank 0 reads the notice under rank 1's host, pid and pid namespace.
  write_file(dir_ / "read_exit.py", kReadExitNotice);
  RunResult run = dtrain(concat(
      {"run", "--nproc-per-node", "2", "--recovery", "in-place", "--max-restarts", "0", "--"},
      sh(recorded("if [ $RANK = 1 ]; then " + wait_for("pid.0.0") + " exit 5; fi;" +
                  wait_for("pid.1.0") + " python3 \"$1/read_exit.py\" \"$1\" || exit 9; exit 0"))));
  clean_up("pid.0.0");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(read_file(dir_ / "exited"), "exited with code 5") << run.err;
}

TEST_F(RecoveryTest, AStopOnSigtermRestartsTheWholeGroup) {
  // A worker that exits 143 stopped on SIGTERM together with its peers (dtrain/stop.h): a newcomer
  // would find nobody to join, so the whole group restarts (and resumes from the checkpoint they
  // saved).
  RunResult stopped = dtrain(concat({"run", "--nproc-per-node", "2", "--recovery", "in-place",
                                     "--max-restarts", "1", "--grace-period", "2", "--"},
                                    sh(recorded("if [ $TORCHELASTIC_RESTART_COUNT != 0 ]; then "
                                                "exit 0; fi;"
                                                "if [ $RANK = 1 ]; then " +
                                                wait_for("pid.0.0") +
                                                " exit 143; fi;"
                                                "exec sleep 300"))));
  clean_up("pid.0.0");
  EXPECT_EQ(stopped.exit_code, 0) << stopped.err;
  EXPECT_NE(stopped.err.find("a worker stopped on SIGTERM (exit code 143) with its peers: "
                             "restarting the whole group from the last checkpoint"),
            std::string::npos)
      << stopped.err;
  EXPECT_NE(stopped.err.find("restarting the worker group of this node: attempt 1"),
            std::string::npos)
      << stopped.err;
  EXPECT_EQ(stopped.err.find("restarting it alone"), std::string::npos) << stopped.err;
  for (int rank : {0, 1}) {
    ASSERT_FALSE(env_of(rank, 1).empty()) << rank;
    EXPECT_EQ(env_of(rank, 1).count("DTRAIN_RECOVERY_JOIN"), 0u) << rank;
  }
}

TEST_F(RecoveryTest, WhenNoWorkerIsLeftTheWholeGroupRestarts) {
  // The only worker fails: nobody is left to admit a newcomer, so the group restarts as a whole.
  RunResult alone = dtrain(concat(
      {"run", "--nproc-per-node", "1", "--recovery", "in-place", "--max-restarts", "1", "--"},
      sh(recorded("if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exit "
                  "3; fi; exit 0"))));
  EXPECT_EQ(alone.exit_code, 0) << alone.err;
  EXPECT_NE(alone.err.find("no worker is left to admit a newcomer"), std::string::npos)
      << alone.err;
  EXPECT_EQ(alone.err.find("restarting it alone"), std::string::npos) << alone.err;
  ASSERT_FALSE(env_of(0, 1).empty());
  EXPECT_EQ(env_of(0, 1).count("DTRAIN_RECOVERY_JOIN"), 0u);
}

TEST_F(RecoveryTest, AUsageErrorIsNotRestarted) {
  RunResult run = dtrain(concat({"run", "--nproc-per-node", "2", "--recovery", "in-place",
                                 "--max-restarts", "3", "--grace-period", "2", "--"},
                                sh(recorded("if [ $RANK = 1 ]; then exit 2; fi; exec sleep 300"))));
  clean_up("pid.0.0");
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_EQ(run.err.find("restarting it alone"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("not restarting: exit code 2 is a usage error"), std::string::npos)
      << run.err;
  EXPECT_TRUE(env_of(1, 1).empty());
}

// Under an elastic rendezvous TORCHELASTIC_RESTART_COUNT is the round number, while a worker
// restarted alone spends from this node's own budget: the newcomer's count must still come after
// the run it replaces (never below, never the same attempt and error-file folder). Round 0's
// workers form no in-place group, so rank 1's failure starts round 1 (count 1); there they do, and
// rank 1's failure restarts it alone: count 2. It used to get the node's restarts spent, 1.
TEST_F(RecoveryTest, UnderAnElasticRendezvousAWorkerRestartedAloneCountsOnFromItsRound) {
  const std::string script =
      "if [ \"${DTRAIN_RECOVERY_JOIN-}\" = 1 ]; then"
      "  echo $TORCHELASTIC_RESTART_COUNT > \"$1/joined_rc\";"
      "  env > \"$1/env.joined\"; exit 0;"
      "fi;"
      "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then " +
      recorded_only("if [ $RANK = 1 ]; then " + wait_for("pid.0.0") +
                    " exit 3; fi; exec sleep 300;") +
      "fi;" +
      recorded("if [ $RANK = 1 ]; then " + wait_for("pid.0.1") + " exit 3; fi;" +
               wait_for("joined_rc") + " exit 0");
  RunResult run = dtrain(concat({"run",
                                 "--nnodes",
                                 "1:1",
                                 "--rdzv-backend",
                                 "c10d",
                                 "--rdzv-endpoint",
                                 "127.0.0.1:" + std::to_string(dtrain::testing::free_port()),
                                 "--rdzv-conf",
                                 "keep_alive_interval=0.2,join_timeout=10",
                                 "--monitor-interval",
                                 "0.1",
                                 "--nproc-per-node",
                                 "2",
                                 "--recovery",
                                 "in-place",
                                 "--max-restarts",
                                 "3",
                                 "--grace-period",
                                 "2",
                                 "--"},
                                sh(script)));
  clean_up("pid.0.0");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(env_of(1, 1)["TORCHELASTIC_RESTART_COUNT"], "1") << run.err;  // round 1's start
  EXPECT_NE(run.err.find("exited with code 3 on attempt 1; restarting it alone"), std::string::npos)
      << run.err;
  EXPECT_EQ(read_file(dir_ / "joined_rc"), "2\n") << run.err;
  const std::string error_file =
      parse_env(read_file(dir_ / "env.joined"))["TORCHELASTIC_ERROR_FILE"];
  EXPECT_TRUE(error_file.ends_with("/attempt_2/1/error.json")) << error_file;
}

}  // namespace
