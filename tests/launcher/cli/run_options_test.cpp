// Flag parsing of `dtrain run`, in-process: every accepted spelling, and every rejected input
// naming its flag in a single line. The same inputs through the real binary are covered in
// launcher_test.cpp.
#include "launcher/cli/run_options.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtrain/errors.h"

namespace dtrain::cli {
namespace {

using Args = std::vector<std::string>;

TEST(RunOptions, DefaultsMatchTorchrun) {
  RunOptions options = parse_run_options({"./train"});
  EXPECT_EQ(options.nproc_per_node, 1);
  EXPECT_EQ(options.nnodes, 1);
  EXPECT_EQ(options.node_rank, 0);
  EXPECT_EQ(options.master_addr, "127.0.0.1");
  EXPECT_EQ(options.master_port, 0);
  EXPECT_EQ(options.max_restarts, 0);
  EXPECT_EQ(options.log_dir, "");
  EXPECT_EQ(options.run_id, "none");
  EXPECT_DOUBLE_EQ(options.grace_period_s, 5.0);
  EXPECT_FALSE(options.no_python);
  EXPECT_FALSE(options.standalone);
  EXPECT_EQ(options.recovery, "in-place");
  EXPECT_EQ(options.command, Args({"./train"}));
}

// In place by default (issue 21), on one node or several, under either rendezvous.
TEST(RunOptions, RecoveryIsInPlaceByDefault) {
  EXPECT_TRUE(recovers_in_place(parse_run_options({"./train"})));
  EXPECT_TRUE(
      recovers_in_place(parse_run_options({"--nnodes", "2", "--node-rank", "1", "--master-addr",
                                           "10.0.0.1", "--master-port", "29500", "./train"})));
  EXPECT_TRUE(recovers_in_place(parse_run_options(
      {"--nnodes=1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "node0", "./train"})));
  EXPECT_TRUE(recovers_in_place(parse_run_options({"--recovery=in-place", "./train"})));
  EXPECT_FALSE(recovers_in_place(parse_run_options({"--recovery", "restart", "./train"})));
  EXPECT_FALSE(recovers_in_place(
      parse_run_options({"--nnodes=1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0",
                         "--recovery", "restart", "./train"})));
}

TEST(RunOptions, AcceptsSpaceEqualsAndUnderscoreSpellings) {
  RunOptions options = parse_run_options(
      {"--nproc-per-node", "3", "--nnodes=2:2", "--node_rank", "1", "--master_addr=10.0.0.1",
       "--master-port", "29501", "--max_restarts=4", "--log-dir", "logs", "--rdzv_id", "job7",
       "--grace-period=0.5", "--no_python", "--", "./train", "--epochs", "3"});
  EXPECT_EQ(options.nproc_per_node, 3);
  EXPECT_EQ(options.nnodes, 2);
  EXPECT_EQ(options.node_rank, 1);
  EXPECT_EQ(options.master_addr, "10.0.0.1");
  EXPECT_EQ(options.master_port, 29501);
  EXPECT_EQ(options.max_restarts, 4);
  EXPECT_EQ(options.log_dir, "logs");
  EXPECT_EQ(options.run_id, "job7");
  EXPECT_DOUBLE_EQ(options.grace_period_s, 0.5);
  EXPECT_TRUE(options.no_python);
  EXPECT_EQ(options.command, Args({"./train", "--epochs", "3"}));
}

TEST(RunOptions, ProgramStartsAtFirstNonFlagAndKeepsItsOwnFlags) {
  RunOptions options =
      parse_run_options({"--run-id", "x", "prog", "--nproc-per-node", "7", "--", "-v"});
  EXPECT_EQ(options.nproc_per_node, 1);
  EXPECT_EQ(options.command, Args({"prog", "--nproc-per-node", "7", "--", "-v"}));
}

TEST(RunOptions, ProgramWordsPassUntouched) {
  // Words the launcher's own flags would read differently: an empty value after '=', a flag of
  // the launcher, "--" and -h, all belonging to the program.
  Args program = {"prog", "--log-dir=", "--nproc-per-node", "--", "-h", "--x=a=b", "", "-"};
  Args args = {"--nproc_per_node=2", "--"};
  args.insert(args.end(), program.begin(), program.end());
  EXPECT_EQ(parse_run_options(args).command, program);
  EXPECT_EQ(parse_run_options({"--", "--log-dir="}).command, Args({"--log-dir="}));
  EXPECT_EQ(parse_run_options({"--master-port=0", "-"}).command, Args({"-"}));
}

// torchrun's rules: 'cpu' one worker per usable CPU, 'gpu' one per CUDA device (none: an error),
// 'auto' per device where there are any, else per CPU ('auto' used to count CPUs on a GPU node,
// and 'gpu' was refused as an unknown value).
TEST(RunOptions, NprocPerNodeCountsCpusOrGpusAsTorchrun) {
  const int cpus = usable_cpus();
  const int gpus = visible_gpus();
  EXPECT_GE(cpus, 1);
  EXPECT_EQ(parse_run_options({"--nproc-per-node=cpu", "p"}).nproc_per_node, cpus);
  EXPECT_EQ(parse_run_options({"--nproc_per_node", "auto", "p"}).nproc_per_node,
            gpus > 0 ? gpus : cpus);
  if (gpus > 0) {
    EXPECT_EQ(parse_run_options({"--nproc-per-node", "gpu", "p"}).nproc_per_node, gpus);
    return;
  }
  try {
    parse_run_options({"--nproc-per-node", "gpu", "p"});
    FAIL() << "'gpu' accepted on a node without CUDA devices";
  } catch (const UsageError& error) {
    std::string message = error.what();
    EXPECT_EQ(message.rfind("dtrain run: --nproc-per-node: expected a positive integer, 'auto', "
                            "'cpu' or 'gpu', got 'gpu'; 'gpu' counts CUDA devices, and this node "
                            "shows none",
                            0),
              0u)
        << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

// Every torchrun flag that has a meaning for a native program is taken, in torchrun's spellings
// (these used to be refused as unknown flags).
TEST(RunOptions, TakesTorchrunsOtherFlags) {
  RunOptions options =
      parse_run_options({"--role", "trainer", "--local_addr", "10.0.0.5", "--start-method", "fork",
                         "--no-python", "--shutdown_timeout", "7", "--event-log-handler", "null",
                         "--signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "p"});
  EXPECT_EQ(options.role, "trainer");
  EXPECT_EQ(options.local_addr, "10.0.0.5");
  EXPECT_EQ(options.start_method, "fork");
  EXPECT_TRUE(options.no_python);
  EXPECT_DOUBLE_EQ(options.grace_period_s, 7);
  // fork and a static --local-addr change nothing: one warning line each.
  ASSERT_EQ(options.warnings.size(), 2u) << testing::PrintToString(options.warnings);
  EXPECT_EQ(options.warnings[0].rfind("warning: --start-method fork has no effect", 0), 0u);
  EXPECT_EQ(options.warnings[1].rfind("warning: --local-addr 10.0.0.5 has no effect with "
                                      "--rdzv-backend static",
                                      0),
            0u);
  EXPECT_EQ(parse_run_options({"p"}).role, "default");
  EXPECT_TRUE(parse_run_options({"--start_method=spawn", "p"}).warnings.empty());
  RunOptions elastic = parse_run_options(
      {"--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--local-addr", "10.0.0.5", "p"});
  EXPECT_EQ(elastic.local_addr, "10.0.0.5");
  EXPECT_TRUE(elastic.warnings.empty());
}

// Each flag of torchrun's in its '_' spelling, with a value it accepts.
TEST(RunOptions, EveryTorchrunFlagTakesItsUnderscoreSpelling) {
  const std::vector<Args> flags = {{"--nproc_per_node", "2"},
                                   {"--max_restarts", "1"},
                                   {"--monitor_interval", "1"},
                                   {"--start_method", "spawn"},
                                   {"--log_dir", "logs"},
                                   {"--local_ranks_filter", "0"},
                                   {"--node_rank", "0"},
                                   {"--master_addr", "h"},
                                   {"--master_port", "0"},
                                   {"--local_addr", "h"},
                                   {"--rdzv_id", "x"},
                                   {"--rdzv_backend", "static"},
                                   {"--rdzv_conf", "timeout=5"},
                                   {"--shutdown_timeout", "2"},
                                   {"--event_log_handler", "null"},
                                   {"--no_python"},
                                   {"--log_dir=logs", "--redirects", "1"}};
  for (const Args& flag : flags) {
    Args args = flag;
    args.push_back("p");
    EXPECT_NO_THROW(parse_run_options(args)) << testing::PrintToString(args);
  }
  EXPECT_EQ(parse_run_options({"--rdzv_backend", "c10d", "--rdzv_endpoint", "h:5", "p"}).rdzv_port,
            5);
}

// torchrun's --redirects (to the log file instead of the console), --tee (to both) and
// --local-ranks-filter (the console shows only these local ranks; the files are not filtered).
TEST(RunOptions, RedirectsTeeAndLocalRanksFilterRouteEachStream) {
  constexpr int kBoth = kStdoutStream | kStderrStream;
  RunOptions plain = parse_run_options({"--nproc-per-node", "2", "--log-dir", "logs", "p"});
  EXPECT_TRUE(plain.console_streams.empty());  // dtrain's own rule: everything to both
  EXPECT_TRUE(plain.log_streams.empty());

  RunOptions mixed =
      parse_run_options({"--nproc-per-node", "3", "--log-dir", "logs", "--redirects", "1", "--tee",
                         "0:2,2:3", "--local_ranks_filter", "0,2", "p"});
  EXPECT_EQ(mixed.console_streams, std::vector<int>({kStderrStream, 0, kStderrStream}));
  EXPECT_EQ(mixed.log_streams, std::vector<int>({kBoth, kStdoutStream, kBoth}));

  RunOptions short_form = parse_run_options({"-r3", "--log-dir", "logs", "p"});
  EXPECT_EQ(short_form.console_streams, std::vector<int>({0}));
  EXPECT_EQ(short_form.log_streams, std::vector<int>({kBoth}));

  RunOptions tee = parse_run_options({"-t", "2", "--log-dir", "logs", "p"});
  EXPECT_EQ(tee.console_streams, std::vector<int>({kBoth}));
  EXPECT_EQ(tee.log_streams, std::vector<int>({kStderrStream}));

  RunOptions filtered =
      parse_run_options({"--nproc-per-node", "2", "--local-ranks-filter", "1", "p"});
  EXPECT_EQ(filtered.console_streams, std::vector<int>({0, kBoth}));
  EXPECT_EQ(filtered.log_streams, std::vector<int>({kBoth, kBoth}));

  // Nothing written to a file needs no --log-dir.
  EXPECT_NO_THROW(parse_run_options({"--redirects", "0", "--tee=0:0", "p"}));
}

// torchrun's --rdzv-conf keys: read_timeout bounds a call to the store (dtrain's join_timeout);
// close_timeout and is_host are taken with a warning that they change nothing here.
TEST(RunOptions, RdzvConfTakesTorchrunsKeys) {
  RunOptions options =
      parse_run_options({"--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--rdzv-conf",
                         "read_timeout=20,close_timeout=5,is_host=True,keep_alive_interval=5,keep_"
                         "alive_max_attempt=3",
                         "p"});
  EXPECT_DOUBLE_EQ(options.rdzv_conf.join_timeout_s, 20);
  EXPECT_DOUBLE_EQ(options.rdzv_conf.keep_alive_interval_s, 5);
  EXPECT_EQ(options.rdzv_conf.keep_alive_max_attempt, 3);
  ASSERT_EQ(options.warnings.size(), 2u) << testing::PrintToString(options.warnings);
  EXPECT_EQ(options.warnings[0].rfind("warning: --rdzv-conf close_timeout=5 is ignored", 0), 0u);
  EXPECT_EQ(options.warnings[1].rfind("warning: --rdzv-conf is_host=True is ignored", 0), 0u);
}

TEST(RunOptions, StandaloneIsOneNodeWithAFreePort) {
  RunOptions options = parse_run_options({"--standalone", "--nproc-per-node", "2", "p"});
  EXPECT_TRUE(options.standalone);
  EXPECT_EQ(options.nnodes, 1);
  EXPECT_EQ(options.master_port, 0);
}

TEST(RunOptions, HelpWinsOverWhatFollowsIt) {
  EXPECT_TRUE(parse_run_options({"-h", "--nproc-per-node", "0"}).help);
  EXPECT_TRUE(parse_run_options({"--help"}).help);
  EXPECT_TRUE(parse_run_options({"-h", "--bogus"}).help);
  EXPECT_NE(run_usage().find("--nproc-per-node"), std::string::npos);
  // What a worker's exit code 2 does, static and elastic (static_rendezvous.cpp,
  // elastic_rendezvous.cpp), stated where users look.
  EXPECT_NE(run_usage().find("A worker that exits with code 2 (a usage error: bad flag, variable "
                             "or file) is not restarted,\nwhatever --max-restarts says, on static "
                             "and elastic nodes alike"),
            std::string::npos);
}

// A rejected input and the text its one-line message must contain.
struct BadInput {
  Args args;
  std::string expected;
};

class RunOptionsRejects : public testing::TestWithParam<BadInput> {};

TEST_P(RunOptionsRejects, WithOneLineNamingTheFlag) {
  const BadInput& input = GetParam();
  try {
    parse_run_options(input.args);
    FAIL() << "accepted: " << testing::PrintToString(input.args);
  } catch (const UsageError& error) {
    std::string message = error.what();
    EXPECT_EQ(message.rfind("dtrain run: ", 0), 0u) << message;
    EXPECT_NE(message.find(input.expected), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(RunOptions, ElasticFlagsAsTorchrunSpellsThem) {
  RunOptions options =
      parse_run_options({"--nnodes=1:3", "--rdzv_backend", "c10d", "--rdzv-endpoint", "node0:29555",
                         "--rdzv-id", "job7", "--rdzv-conf",
                         "timeout=20,last_call_timeout=0,join_timeout=5,keep_alive_interval="
                         "0.2,keep_alive_max_attempt=4",
                         "--monitor-interval", "0.1", "--max-restarts", "2", "p"});
  EXPECT_TRUE(is_elastic(options));
  EXPECT_EQ(options.min_nodes, 1);
  EXPECT_EQ(options.nnodes, 3);
  EXPECT_EQ(options.rdzv_host, "node0");
  EXPECT_EQ(options.rdzv_port, 29555);
  EXPECT_EQ(options.run_id, "job7");
  EXPECT_DOUBLE_EQ(options.rdzv_conf.timeout_s, 20);
  EXPECT_DOUBLE_EQ(options.rdzv_conf.last_call_timeout_s, 0);
  EXPECT_DOUBLE_EQ(options.rdzv_conf.join_timeout_s, 5);
  EXPECT_DOUBLE_EQ(options.rdzv_conf.keep_alive_interval_s, 0.2);
  EXPECT_EQ(options.rdzv_conf.keep_alive_max_attempt, 4);
  EXPECT_DOUBLE_EQ(options.monitor_interval_s, 0.1);

  // Default ports as torchrun's c10d and etcd's client port; IPv6 in brackets.
  EXPECT_EQ(parse_run_options({"--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "p"}).rdzv_port,
            29400);
  EXPECT_EQ(parse_run_options({"--rdzv-backend", "etcd", "--rdzv-endpoint", "h", "p"}).rdzv_port,
            2379);
  RunOptions v6 = parse_run_options({"--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]:7", "p"});
  EXPECT_EQ(v6.rdzv_host, "::1");
  EXPECT_EQ(v6.rdzv_port, 7);
  EXPECT_FALSE(is_elastic(parse_run_options({"p"})));
}

// etcd: every member of its cluster, as torchrun's etcd backend takes them; the agents fail over
// between them (the backend gets the list as given, the first member is where this node's address
// is looked up from).
TEST(RunOptions, EtcdTakesTheMembersOfItsClusterAsAList) {
  RunOptions options = parse_run_options(
      {"--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2381,e2,[::1]:2379", "p"});
  EXPECT_EQ(options.rdzv_endpoint, "e1:2381,e2,[::1]:2379");
  EXPECT_EQ(options.rdzv_host, "e1");
  EXPECT_EQ(options.rdzv_port, 2381);
  EXPECT_EQ(
      parse_run_options({"--rdzv-backend", "etcd", "--rdzv-endpoint", "e1", "p"}).rdzv_endpoint,
      "e1");
}

INSTANTIATE_TEST_SUITE_P(
    Flags, RunOptionsRejects,
    testing::Values(
        BadInput{{"--bogus", "p"}, "unknown flag '--bogus'"},
        BadInput{{"--recovery", "sometimes", "p"},
                 "--recovery: expected one of restart, in-place, got 'sometimes'"},
        BadInput{{"-x", "p"}, "unknown flag '-x'"},
        BadInput{{"--nproc-per-node"}, "--nproc-per-node: missing value"},
        BadInput{{"--nproc-per-node", "--nnodes", "2", "p"}, "--nproc-per-node: missing value"},
        BadInput{{"--nproc-per-node", "abc", "p"},
                 "--nproc-per-node: expected a positive integer, 'auto', 'cpu' or 'gpu', got "
                 "'abc'"},
        BadInput{{"--nproc-per-node", "0", "p"},
                 "dtrain run: --nproc-per-node: expected a positive integer, 'auto', 'cpu' or "
                 "'gpu', got '0'"},
        // torchrun's flags: a value they do not take, or the reason a flag is refused.
        BadInput{{"--redirects", "4", "--log-dir", "logs", "p"},
                 "--redirects: expected 0..3 (1 stdout, 2 stderr, 3 both) for every rank, or "
                 "LOCAL_RANK:0..3,... for some, got '4'"},
        BadInput{{"--tee", "0:5", "--log-dir", "logs", "p"}, "--tee: expected 0..3"},
        BadInput{{"-r", "0:1,", "--log-dir", "logs", "p"}, "--redirects: expected 0..3"},
        BadInput{{"--redirects", "3", "p"},
                 "--redirects: '3' writes to <dir>/rank<R>.log, but no --log-dir was given; add "
                 "--log-dir DIR"},
        BadInput{{"--tee", "0:1", "p"}, "--tee: '0:1' writes to <dir>/rank<R>.log"},
        BadInput{{"--local-ranks-filter", "0,x", "p"},
                 "--local-ranks-filter: expected local ranks separated by commas, e.g. 0 or 0,2, "
                 "got '0,x'"},
        BadInput{{"--role=", "p"}, "--role: expected a role name, got ''"},
        BadInput{{"--local-addr=", "p"}, "--local-addr: expected a host name or address"},
        BadInput{{"--start-method", "thread", "p"},
                 "--start-method: expected one of spawn, fork, forkserver, got 'thread'"},
        BadInput{{"-m", "mymod", "--epochs", "3"},
                 "-m/--module: runs Python module 'mymod' with torchrun's interpreter; dtrain run "
                 "is not Python: run `dtrain run [flags] python3 -u -m mymod [args...]` instead"},
        BadInput{{"--module", "pkg.train"}, "python3 -u -m pkg.train"},
        BadInput{{"--run_path", "/abs/train.py"},
                 "--run-path: runs '/abs/train.py' inside torchrun's own Python interpreter"},
        BadInput{{"--no-python=yes", "p"}, "--no-python: takes no value, got 'yes'"},
        BadInput{{"--shutdown-timeout", "3", "--grace-period", "1", "p"},
                 "--shutdown-timeout: the same wait as --grace-period"},
        BadInput{{"--event-log-handler", "console", "p"},
                 "--event-log-handler: torchrun's flag is not supported, got 'console'"},
        BadInput{{"--signals-to-handle", "SIGUSR1", "p"},
                 "--signals-to-handle: torchrun's flag is not supported, got 'SIGUSR1'"},
        BadInput{{"--numa_binding", "node", "p"},
                 "--numa-binding: torchrun's flag is not supported, got 'node'"},
        BadInput{{"--log-line-prefix-template", "${rank}: ", "p"},
                 "--log-line-prefix-template: torchrun's flag is not supported"},
        BadInput{{"--virtual-local-rank", "p"},
                 "--virtual-local-rank: torchrun's flag is not supported"},
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf",
                  "is_host=maybe", "p"},
                 "--rdzv-conf is_host: expected true or false (1, 0, yes, no), got 'maybe'"},
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf",
                  "close_timeout=-1", "p"},
                 "--rdzv-conf close_timeout: expected a number of seconds above 0"},
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf",
                  "read_timeout=soon", "p"},
                 "--rdzv-conf read_timeout: expected a number of seconds above 0"},
        BadInput{{"--nproc-per-node=2x", "p"}, "got '2x'"},
        BadInput{{"--nproc-per-node", "99999999999999999999", "p"}, "--nproc-per-node"},
        BadInput{{"--nnodes", "0", "p"},
                 "--nnodes: expected a positive integer N or a range MIN:MAX, got '0'"},
        BadInput{{"--nnodes", "1:4", "p"},
                 "--nnodes: an elastic range 1:4 needs --rdzv-backend c10d or etcd"},
        BadInput{{"--nnodes", "3:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "p"},
                 "--nnodes: expected MIN:MAX with MIN <= MAX, got '3:2'"},
        BadInput{{"--rdzv-backend", "zookeeper", "p"},
                 "--rdzv-backend: expected one of c10d, etcd, static, got 'zookeeper'"},
        BadInput{{"--nnodes", "1:2", "--rdzv-backend", "c10d", "p"},
                 "--rdzv-endpoint: required with --rdzv-backend c10d"},
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "host:port", "p"},
                 "--rdzv-endpoint: expected HOST:PORT"},
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "host:70000", "p"},
                 "--rdzv-endpoint: expected HOST:PORT"},
        // The whole value, what a port may be and what to do (issue 21: "got '0'").
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "hostA:0", "p"},
                 "--rdzv-endpoint: expected HOST:PORT with a port in 1..65535, got 'hostA:0'; "
                 "give the port the rendezvous listens on, the same on every node (e.g. "
                 "hostA:29400), or the host alone for the default port 29400"},
        BadInput{{"--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd1:99999", "p"},
                 "got 'etcd1:99999'; give the port the rendezvous listens on, the same on every "
                 "node (e.g. etcd1:2379), or the host alone for the default port 2379"},
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", ":29400", "p"},
                 "--rdzv-endpoint: expected HOST:PORT"},
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "a:1:2", "p"},
                 "--rdzv-endpoint: expected HOST:PORT"},
        BadInput{{"--rdzv-endpoint", "h:1", "p"}, "--rdzv-endpoint: used only with"},
        // Lists: etcd only; every item a HOST:PORT, named with the list; none empty or repeated.
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1,g:1", "p"},
                 "--rdzv-endpoint: a list of endpoints ('h:1,g:1') is for --rdzv-backend etcd"},
        BadInput{{"--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,,e3:2379", "p"},
                 "--rdzv-endpoint: an empty item in the list 'e1:2379,,e3:2379'"},
        BadInput{{"--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,", "p"},
                 "--rdzv-endpoint: an empty item in the list 'e1:2379,'"},
        BadInput{{"--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,e2:0", "p"},
                 "got 'e2:0' (in the list 'e1:2379,e2:0'); give the port"},
        BadInput{{"--rdzv-backend", "etcd", "--rdzv-endpoint", "e1,e2:x:1", "p"},
                 "--rdzv-endpoint: expected HOST:PORT (a host name or address, a port in "
                 "1..65535), got 'e2:x:1' (in the list 'e1,e2:x:1')"},
        BadInput{{"--rdzv-backend", "etcd", "--rdzv-endpoint", "e1,e2,e1:2379", "p"},
                 "--rdzv-endpoint: 'e1:2379' is listed twice in 'e1,e2,e1:2379'"},
        BadInput{
            {"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "speed=9", "p"},
            "--rdzv-conf: unknown key 'speed'; expected one of: timeout, last_call_timeout"},
        BadInput{
            {"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "timeout", "p"},
            "--rdzv-conf: expected key=value pairs"},
        BadInput{
            {"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "timeout=-1", "p"},
            "--rdzv-conf timeout: expected a number of seconds above 0"},
        BadInput{{"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--node-rank", "1", "p"},
                 "--node-rank: decided by the rendezvous"},
        BadInput{{"--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--master-port", "5", "p"},
                 "--master-port: decided by the rendezvous"},
        BadInput{
            {"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--monitor-interval", "0", "p"},
            "--monitor-interval: expected a number of seconds in 0.01..3600, got '0'"},
        BadInput{{"--nnodes", "2:x", "p"}, "--nnodes"},
        BadInput{{"--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "p"},
                 "--node-rank: expected an integer in 0..1 (below --nnodes 2), got '2'"},
        BadInput{{"--node-rank", "1", "p"}, "--node-rank"},
        BadInput{{"--node-rank", "-1", "p"},
                 "--node-rank: expected a non-negative integer, got '-1'"},
        BadInput{{"--nnodes", "2", "p"}, "--master-port: required with --nnodes 2"},
        BadInput{{"--master-port", "70000", "p"},
                 "--master-port: expected a port in 1..65535, or 0 for a free one, got '70000'"},
        BadInput{{"--master-port", "-1", "p"}, "--master-port"},
        BadInput{{"--master-addr=", "p"}, "--master-addr"},
        BadInput{{"--max-restarts", "-1", "p"}, "--max-restarts: expected a non-negative integer"},
        BadInput{{"--grace-period", "soon", "p"}, "--grace-period"},
        BadInput{{"--grace-period", "-2", "p"}, "--grace-period"},
        BadInput{{"--standalone=yes", "p"}, "--standalone: takes no value"},
        BadInput{{"--standalone", "--nnodes", "2", "--master-port", "1234", "p"}, "--standalone"},
        BadInput{{"--standalone", "--master-port", "1234", "p"}, "--master-port"},
        BadInput{{"--nproc-per-node", "2"}, "no program given"},
        BadInput{{"--"}, "no program given"}, BadInput{{}, "no program given"}));

}  // namespace
}  // namespace dtrain::cli
