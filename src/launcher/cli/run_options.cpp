// Parsing `dtrain run`'s flags (see run_options.h) with CLI11 (flags.h). Accepted spellings follow
// torchrun: "--flag value", "--flag=value", and the underscore forms ("--nproc_per_node") that
// torchrun also takes.
#include "launcher/cli/run_options.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <deque>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "dtrain/errors.h"
#include "launcher/cli/flags.h"

namespace dtrain::cli {
namespace {

[[noreturn]] void fail(const std::string& message) { throw UsageError("dtrain run: " + message); }

[[noreturn]] void bad_value(std::string_view flag, std::string_view expected,
                            std::string_view got) {
  fail(std::string(flag) + ": " + expected_but_got(expected, got));
}

// --nnodes N or MIN:MAX.
void parse_nnodes(const std::string& value, RunOptions& options) {
  constexpr std::string_view kFlag = "--nnodes";
  constexpr std::string_view kExpected = "a positive integer N or a range MIN:MAX";
  std::string_view text = value;
  std::size_t colon = text.find(':');
  std::optional<long long> low = integer_in(text.substr(0, colon), 1, 1 << 20);
  std::optional<long long> high = low;
  if (colon != std::string_view::npos) high = integer_in(text.substr(colon + 1), 1, 1 << 20);
  if (!low || !high) bad_value(kFlag, kExpected, value);
  if (*low > *high) bad_value(kFlag, "MIN:MAX with MIN <= MAX", value);
  options.min_nodes = static_cast<int>(*low);
  options.nnodes = static_cast<int>(*high);
}

// One HOST[:PORT] or [IPV6]:PORT of --rdzv-endpoint, whose whole value is `value`. Every error
// names the endpoint as given (and the list it is in), what is expected and how to write it (a bad
// port used to be reported alone: "got '0'"). Returns the host and the port (0: none given).
std::pair<std::string, int> parse_one_endpoint(const std::string& item, const std::string& value,
                                               const std::string& default_port) {
  constexpr std::string_view kFlag = "--rdzv-endpoint";
  const std::string in_list = item == value ? "" : " (in the list '" + value + "')";
  auto bad_form = [&] {
    fail(std::string(kFlag) + ": " +
         expected_but_got("HOST:PORT (a host name or address, a port in 1..65535)", item) +
         in_list + "; write it as host:" + default_port + ", or [address]:" + default_port +
         " for an IPv6 address");
  };
  std::string host = item;
  std::string port;
  if (!item.empty() && item.front() == '[') {
    std::size_t close = item.find(']');
    if (close == std::string::npos) bad_form();
    host = item.substr(1, close - 1);
    std::string rest = item.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') bad_form();
      port = rest.substr(1);
      if (port.empty()) bad_form();
    }
  } else if (std::size_t colon = item.find(':'); colon != std::string::npos) {
    if (item.find(':', colon + 1) != std::string::npos) bad_form();
    host = item.substr(0, colon);
    port = item.substr(colon + 1);
    if (port.empty()) bad_form();
  }
  if (host.empty() || host.find_first_of(" /\t") != std::string::npos) bad_form();
  if (port.empty()) return {host, 0};
  std::optional<long long> number = integer_in(port, 1, 65535);
  if (!number) {
    // Port 0 ("any free port") cannot work here: every node must name the same port.
    std::string shown_host = item.front() == '[' ? "[" + host + "]" : host;
    fail(std::string(kFlag) + ": expected HOST:PORT with a port in 1..65535, got '" + item + "'" +
         in_list + "; give the port the rendezvous listens on, the same on every node (e.g. " +
         shown_host + ":" + default_port + "), or the host alone for the default port " +
         default_port);
  }
  return {host, static_cast<int>(*number)};
}

// --rdzv-endpoint: one HOST[:PORT], or with etcd the members of its cluster, HOST[:PORT],... (as
// torchrun's etcd backend takes them; the agents fail over between them). rdzv_host and rdzv_port
// are the first.
void parse_endpoint(const std::string& value, RunOptions& options) {
  const bool etcd = options.rdzv_backend == "etcd";
  const std::string default_port = etcd ? "2379" : "29400";
  std::vector<std::string> items;
  for (std::size_t start = 0;;) {
    std::size_t comma = value.find(',', start);
    items.push_back(value.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (items.size() > 1 && !etcd) {
    fail("--rdzv-endpoint: a list of endpoints ('" + value +
         "') is for --rdzv-backend etcd (the members of an etcd cluster); with " +
         options.rdzv_backend + " give the one HOST:PORT of the node hosting the store");
  }
  std::vector<std::pair<std::string, int>> parsed;
  for (const std::string& item : items) {
    if (item.empty() && items.size() > 1) {
      fail("--rdzv-endpoint: an empty item in the list '" + value +
           "'; expected HOST:PORT,HOST:PORT,... separated by single commas, e.g. "
           "etcd1:2379,etcd2:2379,etcd3:2379");
    }
    auto endpoint = parse_one_endpoint(item, value, default_port);
    if (endpoint.second == 0) endpoint.second = std::stoi(default_port);
    if (std::find(parsed.begin(), parsed.end(), endpoint) != parsed.end()) {
      fail("--rdzv-endpoint: '" + item + "' is listed twice in '" + value +
           "'; name each member of the etcd cluster once");
    }
    parsed.push_back(endpoint);
  }
  options.rdzv_host = parsed.front().first;
  options.rdzv_port = parsed.front().second;
  options.rdzv_endpoint = value;
}

// --rdzv-conf key=value,key=value.
// torchrun's keys: join_timeout and read_timeout are not torchrun's meaning (RendezvousConf), the
// keys without a meaning here are accepted with a warning, so that torchrun's command lines run.
void parse_rdzv_conf(const std::string& value, RendezvousConf& conf,
                     std::vector<std::string>& warnings) {
  constexpr std::string_view kFlag = "--rdzv-conf";
  constexpr std::string_view kKeys =
      "timeout, last_call_timeout, join_timeout, read_timeout, keep_alive_interval, "
      "keep_alive_max_attempt, close_timeout, is_host";
  std::string_view rest = value;
  while (!rest.empty()) {
    std::size_t comma = rest.find(',');
    std::string item(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    std::size_t equals = item.find('=');
    if (equals == std::string::npos || equals == 0) {
      bad_value(kFlag, "key=value pairs separated by commas (keys: " + std::string(kKeys) + ")",
                item);
    }
    std::string key = item.substr(0, equals);
    std::string text = item.substr(equals + 1);
    std::string name = std::string(kFlag) + " " + key;
    // A number of seconds in (low, high], or [low, high] with `from_low`.
    auto seconds = [&](double low, double high, std::string_view expected, bool from_low = false) {
      std::optional<double> number = number_in(text, low, high, from_low);
      if (!number) bad_value(name, expected, text);
      return *number;
    };
    constexpr std::string_view kSeconds = "a number of seconds above 0 (at most a week)";
    constexpr double kWeek = 7 * 86400.0;
    if (key == "timeout") {
      conf.timeout_s = seconds(0, kWeek, kSeconds);
    } else if (key == "last_call_timeout") {
      conf.last_call_timeout_s = seconds(0, kWeek, "a number of seconds", true);
    } else if (key == "join_timeout" || key == "read_timeout") {
      // torchrun's read_timeout bounds each call to the store, as this does.
      conf.join_timeout_s = seconds(0, kWeek, kSeconds);
    } else if (key == "keep_alive_interval") {
      conf.keep_alive_interval_s = seconds(0.009, 3600, "seconds in 0.01..3600");
    } else if (key == "keep_alive_max_attempt") {
      std::optional<long long> attempts = integer_in(text, 1, 1000);
      if (!attempts) bad_value(name, "an integer in 1..1000", text);
      conf.keep_alive_max_attempt = static_cast<int>(*attempts);
    } else if (key == "close_timeout") {
      seconds(0, kWeek, kSeconds);
      warnings.push_back("warning: " + name + "=" + text +
                         " is ignored: dtrain's rendezvous does not wait for its closing (the "
                         "agents leave when their workers end)");
    } else if (key == "is_host") {
      // torchrun's get_as_bool spellings.
      std::string lower = text;
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      const std::vector<std::string> known = {"1", "0", "true", "false", "yes", "no", "y", "n"};
      if (std::find(known.begin(), known.end(), lower) == known.end()) {
        bad_value(name, "true or false (1, 0, yes, no)", text);
      }
      warnings.push_back("warning: " + name + "=" + text +
                         " is ignored: the agent that can bind --rdzv-endpoint hosts the store");
    } else {
      fail(std::string(kFlag) + ": unknown key '" + key +
           "'; expected one of: " + std::string(kKeys));
    }
  }
}

constexpr std::string_view kWorkersExpected = "a positive integer, 'auto', 'cpu' or 'gpu'";

// --nproc-per-node as torchrun counts it: 'cpu' one worker per usable CPU, 'gpu' one per CUDA
// device (an error without one), 'auto' one per device where there are any, else per CPU. The
// count is then checked as any number.
CLI::Validator workers_per_node() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text == "cpu") text = std::to_string(usable_cpus());
        if (text == "auto") {
          int gpus = visible_gpus();
          text = std::to_string(gpus > 0 ? gpus : usable_cpus());
        }
        if (text == "gpu") {
          int gpus = visible_gpus();
          if (gpus == 0) {
            return expected_but_got(kWorkersExpected, text) +
                   "; 'gpu' counts CUDA devices, and this node shows none (no NVIDIA driver, or "
                   "CUDA_VISIBLE_DEVICES hides them): give a number, or 'cpu'";
          }
          text = std::to_string(gpus);
        }
        return {};
      },
      "");
}

// The items of a comma-separated list, empty ones included ("" is one empty item), for the
// parsers to refuse.
std::vector<std::string_view> comma_items(std::string_view value) {
  std::vector<std::string_view> items;
  for (;;) {
    std::size_t comma = value.find(',');
    items.push_back(value.substr(0, comma));
    if (comma == std::string_view::npos) return items;
    value = value.substr(comma + 1);
  }
}

// torchrun's --redirects/--tee value for each of `local_ranks` ranks: one bit set for all
// ("0".."3"), or LOCAL_RANK:BITS,... (ranks not named: 0).
std::vector<int> parse_streams(std::string_view flag, const std::string& value, int local_ranks) {
  constexpr std::string_view kExpected =
      "0..3 (1 stdout, 2 stderr, 3 both) for every rank, or LOCAL_RANK:0..3,... for some";
  if (std::optional<long long> all = integer_in(value, 0, 3); all && value.size() == 1) {
    return std::vector<int>(static_cast<std::size_t>(local_ranks), static_cast<int>(*all));
  }
  std::vector<int> streams(static_cast<std::size_t>(local_ranks), 0);
  for (std::string_view item : comma_items(value)) {
    std::size_t colon = item.find(':');
    std::optional<long long> rank = colon == std::string_view::npos
                                        ? std::nullopt
                                        : integer_in(item.substr(0, colon), 0, 1 << 20);
    std::optional<long long> bits =
        colon == std::string_view::npos ? std::nullopt : integer_in(item.substr(colon + 1), 0, 3);
    if (!rank || !bits || item.size() - colon != 2) bad_value(flag, kExpected, value);
    // A rank this node does not run matters to no worker, as in torchrun's mapping.
    if (*rank < local_ranks) streams[static_cast<std::size_t>(*rank)] = static_cast<int>(*bits);
  }
  return streams;
}

// --local-ranks-filter R,R,...: the local ranks whose lines reach the console.
std::vector<long long> parse_rank_list(const std::string& value) {
  std::vector<long long> ranks;
  for (std::string_view item : comma_items(value)) {
    std::optional<long long> rank = integer_in(item, 0, 1 << 20);
    if (!rank) {
      bad_value("--local-ranks-filter", "local ranks separated by commas, e.g. 0 or 0,2", value);
    }
    ranks.push_back(*rank);
  }
  return ranks;
}

// Where each local rank's streams go (RunOptions::console_streams, log_streams): --redirects sends
// a stream to the log file instead of the console, --tee to both, --local-ranks-filter keeps the
// other ranks off the console. Without --redirects and --tee, dtrain's --log-dir keeps its own
// rule: every stream to the console and to the file.
void route_output(const std::optional<std::string>& redirects,
                  const std::optional<std::string>& tee, const std::optional<std::string>& filter,
                  RunOptions& options) {
  if (!redirects && !tee && !filter) return;
  const int ranks = options.nproc_per_node;
  const std::vector<int> none(static_cast<std::size_t>(ranks), 0);
  std::vector<int> redirected = redirects ? parse_streams("--redirects", *redirects, ranks) : none;
  std::vector<int> teed = tee ? parse_streams("--tee", *tee, ranks) : none;
  const int both = kStdoutStream | kStderrStream;
  options.console_streams.assign(static_cast<std::size_t>(ranks), both);
  options.log_streams.assign(static_cast<std::size_t>(ranks), both);
  for (std::size_t rank = 0; rank < static_cast<std::size_t>(ranks); ++rank) {
    options.console_streams[rank] = both & ~redirected[rank];
    if (redirects || tee) options.log_streams[rank] = redirected[rank] | teed[rank];
  }
  if (filter) {
    std::vector<long long> shown = parse_rank_list(*filter);
    for (std::size_t rank = 0; rank < static_cast<std::size_t>(ranks); ++rank) {
      if (std::find(shown.begin(), shown.end(), static_cast<long long>(rank)) == shown.end()) {
        options.console_streams[rank] = 0;
      }
    }
  }
  // torchrun writes to a temporary folder without --log-dir; dtrain writes only where it is told.
  auto needs_log_dir = [&](const char* flag, const std::optional<std::string>& value,
                           const std::vector<int>& streams) {
    bool writes = std::any_of(streams.begin(), streams.end(), [](int bits) { return bits != 0; });
    if (writes && options.log_dir.empty()) {
      fail(std::string(flag) + ": '" + *value + "' writes to <dir>/rank<R>.log, but no --log-dir " +
           "was given; add --log-dir DIR (torchrun would pick a temporary folder)");
    }
  };
  needs_log_dir("--redirects", redirects, redirected);
  needs_log_dir("--tee", tee, teed);
}

void check_combinations(RunOptions& options, bool port_given, bool node_rank_given,
                        bool master_addr_given) {
  if (is_elastic(options)) {
    std::string backend = "--rdzv-backend " + options.rdzv_backend;
    if (options.standalone) {
      fail("--standalone: runs a single static node; drop it or " + backend);
    }
    if (options.rdzv_host.empty()) {
      fail("--rdzv-endpoint: required with " + backend + ", got none; expected HOST:PORT of " +
           (options.rdzv_backend == "etcd" ? "the etcd server" : "the node hosting the store"));
    }
    if (options.rdzv_port == 0) options.rdzv_port = options.rdzv_backend == "etcd" ? 2379 : 29400;
    if (node_rank_given || master_addr_given || port_given) {
      fail(std::string(node_rank_given     ? "--node-rank"
                       : master_addr_given ? "--master-addr"
                                           : "--master-port") +
           ": decided by the rendezvous with " + backend + "; drop it");
    }
    if (options.command.empty()) {
      fail("no program given; expected `dtrain run [flags] [--] program [args...]`");
    }
    return;
  }
  if (options.min_nodes != options.nnodes) {
    fail("--nnodes: an elastic range " + std::to_string(options.min_nodes) + ":" +
         std::to_string(options.nnodes) +
         " needs --rdzv-backend c10d or etcd (and --rdzv-endpoint); for a static job give N");
  }
  if (!options.rdzv_host.empty()) {
    fail("--rdzv-endpoint: used only with --rdzv-backend c10d or etcd, got it with static");
  }
  if (options.standalone) {
    if (options.nnodes != 1) {
      fail("--standalone: runs a single node, but --nnodes is " + std::to_string(options.nnodes) +
           "; drop one of the two");
    }
    if (port_given && options.master_port != 0) {
      fail("--master-port: --standalone picks a free port itself; drop one of the two, got '" +
           std::to_string(options.master_port) + "'");
    }
  }
  if (std::string problem = node_rank_problem(options.node_rank, options.nnodes);
      !problem.empty()) {
    fail(problem);
  }
  if (options.nnodes > 1 && options.master_port == 0) {
    fail("--master-port: required with --nnodes " + std::to_string(options.nnodes) +
         " (every node must name the same port), got " + (port_given ? "'0'" : "none"));
  }
  if (options.command.empty()) {
    fail("no program given; expected `dtrain run [flags] [--] program [args...]`");
  }
}

}  // namespace

RunOptions parse_run_options(const std::vector<std::string>& args) {
  RunOptions options;
  CLI::App app;
  prepare_command_line(app, "dtrain run");
  // A flag that takes a value, in both of torchrun's spellings.
  auto valued = [&app](std::string_view name, auto& target,
                       std::vector<CLI::Validator> checks = {}) {
    return add_valued_flag(app, with_underscores(name), target, std::move(checks));
  };
  valued("--nproc-per-node", options.nproc_per_node,
         {workers_per_node(), integer(1, 1 << 20, std::string(kWorkersExpected))});
  std::string nnodes;
  CLI::Option* nnodes_flag = valued("--nnodes", nnodes);
  CLI::Option* node_rank =
      valued("--node-rank", options.node_rank, {integer(0, 1 << 20, "a non-negative integer")});
  CLI::Option* master_addr =
      valued("--master-addr", options.master_addr, {non_empty("a host name or address")});
  CLI::Option* master_port = valued("--master-port", options.master_port,
                                    {integer(0, 65535, "a port in 1..65535, or 0 for a free one")});
  valued("--max-restarts", options.max_restarts, {integer(0, 1 << 30, "a non-negative integer")});
  valued("--recovery", options.recovery, {one_of({"restart", "in-place"})});
  valued("--log-dir", options.log_dir, {non_empty("a directory")});
  // torchrun's --rdzv-id is dtrain's --run-id.
  CLI::Option* run_id =
      add_valued_flag(app, with_underscores("--run-id") + "," + with_underscores("--rdzv-id"),
                      options.run_id, {non_empty("a non-empty id")});
  // A day is far beyond any sane grace period; the bound also keeps the milliseconds in range.
  CLI::Option* grace_period =
      valued("--grace-period", options.grace_period_s,
             {number(0, 86400, "a number of seconds in 0..86400", /*low_inclusive=*/true)});
  // torchrun's name for the same wait (an integer there).
  double shutdown_timeout_s = 0;
  CLI::Option* shutdown_timeout =
      valued("--shutdown-timeout", shutdown_timeout_s,
             {number(0, 86400, "a number of seconds in 0..86400", /*low_inclusive=*/true)});
  valued("--rdzv-backend", options.rdzv_backend, {one_of({"c10d", "etcd", "static"})});
  std::string endpoint;
  CLI::Option* endpoint_flag = valued("--rdzv-endpoint", endpoint);
  std::string conf;
  CLI::Option* conf_flag = valued("--rdzv-conf", conf);
  valued("--rdzv-token", options.rdzv_token, {non_empty("a non-empty token")});
  valued("--monitor-interval", options.monitor_interval_s,
         {number(0.009, 3600, "a number of seconds in 0.01..3600")});
  add_switch(app, with_underscores("--no-python"), options.no_python);
  add_switch(app, "--standalone", options.standalone);
  // torchrun's output flags (route_output). CLI11 takes "-r3" as "-r 3", as argparse does.
  std::string redirects;
  std::string tee;
  std::string ranks_filter;
  CLI::Option* redirects_flag = add_valued_flag(app, "-r,--redirects", redirects);
  CLI::Option* tee_flag = add_valued_flag(app, "-t,--tee", tee);
  CLI::Option* filter_flag = valued("--local-ranks-filter", ranks_filter);
  valued("--role", options.role, {non_empty("a role name")});
  CLI::Option* local_addr =
      valued("--local-addr", options.local_addr, {non_empty("a host name or address")});
  valued("--start-method", options.start_method, {one_of({"spawn", "fork", "forkserver"})});
  // torchrun's Python-only switches: known, so that the refusal can say why.
  bool module = false;
  bool run_path = false;
  add_switch(app, "-m,--module", module);
  add_switch(app, with_underscores("--run-path"), run_path);
  // torchrun's flags dtrain does not implement, refused after the parse with the reason.
  // torchrun's default value (`harmless`, when it has one) is accepted: it asks for nothing.
  struct Refused {
    std::string why;
    std::string harmless;
    std::string value;
    CLI::Option* option = nullptr;
  };
  std::deque<Refused> refused;  // a deque: the options hold references to the values
  auto refuse = [&](std::string_view name, std::string why, std::string harmless = {}) {
    Refused& flag = refused.emplace_back();
    flag.why = std::move(why);
    flag.harmless = std::move(harmless);
    flag.option = valued(name, flag.value);
  };
  refuse("--event-log-handler",
         "names a Python event handler registered with torchrun; dtrain run logs to stderr only",
         "null");
  refuse("--log-line-prefix-template",
         "not implemented; every relayed line starts with [rank<R>]: (its global rank)");
  refuse("--duplicate-stdout-filters", "not implemented; filter the console output with grep");
  refuse("--duplicate-stderr-filters", "not implemented; filter the console output with grep");
  refuse("--logs-specs", "names a Python LogsSpecs entry point; use --log-dir, --redirects, --tee");
  refuse("--numa-binding", "not implemented; bind the program itself (numactl, taskset)");
  refuse("--signals-to-handle",
         "not implemented; dtrain run forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the workers",
         "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
  bool virtual_local_rank = false;
  CLI::Option* virtual_flag =
      add_switch(app, with_underscores("--virtual-local-rank"), virtual_local_rank);

  std::optional<std::vector<std::string>> command = parse_command_line(app, args);
  if (!command) {
    options.help = true;  // wins over everything else on the line, as in torchrun
    return options;
  }
  options.command = std::move(*command);
  const std::string program = options.command.empty() ? "" : options.command.front();
  if (module) {
    fail("-m/--module: runs Python module '" + program + "' with torchrun's interpreter; dtrain " +
         "run is not Python: run `dtrain run [flags] python3 -u -m " +
         (program.empty() ? "MODULE" : program) + " [args...]` instead");
  }
  if (run_path) {
    fail("--run-path: runs '" + program + "' inside torchrun's own Python interpreter (runpy), " +
         "which dtrain run does not have; drop it: a .py program runs under $DTRAIN_PYTHON " +
         "(default python3) in a process of its own");
  }
  for (const Refused& flag : refused) {
    if (flag.option->count() > 0 && (flag.harmless.empty() || flag.value != flag.harmless)) {
      fail(
          flag.option->get_name() + ": torchrun's flag is not supported, got '" + flag.value +
          "': " + flag.why +
          (flag.harmless.empty() ? "" : " (accepted: torchrun's default '" + flag.harmless + "')"));
    }
  }
  if (virtual_flag->count() > 0) {
    fail(
        "--virtual-local-rank: torchrun's flag is not supported: not implemented; each worker "
        "sees every GPU, LOCAL_RANK says which is its own");
  }
  if (shutdown_timeout->count() > 0) {
    if (grace_period->count() > 0) {
      fail(
          "--shutdown-timeout: the same wait as --grace-period (torchrun's name); give one of "
          "the two");
    }
    options.grace_period_s = shutdown_timeout_s;
  }
  // Output routing needs the number of workers and --log-dir.
  auto given = [](const CLI::Option* flag, const std::string& value) {
    return flag->count() > 0 ? std::optional<std::string>(value) : std::nullopt;
  };
  route_output(given(redirects_flag, redirects), given(tee_flag, tee),
               given(filter_flag, ranks_filter), options);
  if (options.start_method != "spawn") {
    options.warnings.push_back("warning: --start-method " + options.start_method +
                               " has no effect: every worker is started as a new program (fork "
                               "and exec), as spawn starts a Python worker");
  }
  if (nnodes_flag->count() > 0) parse_nnodes(nnodes, options);
  if (endpoint_flag->count() > 0) parse_endpoint(endpoint, options);
  if (conf_flag->count() > 0) parse_rdzv_conf(conf, options.rdzv_conf, options.warnings);
  options.run_id_given = run_id->count() > 0;
  check_combinations(options, master_port->count() > 0, node_rank->count() > 0,
                     master_addr->count() > 0);
  if (local_addr->count() > 0 && !is_elastic(options)) {
    options.warnings.push_back("warning: --local-addr " + options.local_addr +
                               " has no effect with --rdzv-backend static: the workers reach the "
                               "store at --master-addr, as in torchrun");
  }
  return options;
}

std::string node_rank_problem(int node_rank, int nnodes) {
  if (node_rank < nnodes) return "";
  return "--node-rank: expected an integer in 0.." + std::to_string(nnodes - 1) +
         " (below --nnodes " + std::to_string(nnodes) + "), got '" + std::to_string(node_rank) +
         "'";
}

int visible_gpus() {
  // The launcher stays free of LibTorch and CUDA (it builds and starts in seconds, and runs on CPU
  // nodes), so it cannot ask torch::cuda::device_count(). It asks the driver itself instead:
  // libcuda.so.1 comes with the NVIDIA driver on every GPU node and is opened only here, when
  // 'gpu' or 'auto' is given. cuDeviceGetCount honours CUDA_VISIBLE_DEVICES, as
  // torch.cuda.device_count() does. cuInit in the launcher is harmless to the workers: they are
  // started with exec, which leaves the driver's state behind.
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) return 0;
  using Init = int (*)(unsigned int);
  using DeviceCount = int (*)(int*);
  auto init = reinterpret_cast<Init>(dlsym(driver, "cuInit"));
  auto device_count = reinterpret_cast<DeviceCount>(dlsym(driver, "cuDeviceGetCount"));
  int devices = 0;
  // 0 is CUDA_SUCCESS; any error (no device, driver too old for the card) counts as none.
  if (init == nullptr || device_count == nullptr || init(0) != 0 || device_count(&devices) != 0) {
    devices = 0;
  }
  // Left loaded: the driver may not be unloaded once initialised.
  return devices;
}

int usable_cpus() {
  // The affinity mask, which taskset and container limits narrow.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

std::string run_usage() {
  return R"(usage: dtrain run [flags] [--] program [args...]

Starts --nproc-per-node copies of `program` on this node with the environment torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK, GROUP_WORLD_SIZE,
ROLE_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, ...), relays their output prefixed with [rank<R>]:,
stops them all when one fails and restarts them up to --max-restarts times (under --recovery
in-place, the default, only the failed one where the program recovers in place).
A program ending in .py runs under $DTRAIN_PYTHON (default: python3 on PATH) unless --no-python.

flags (also as --flag=value, and with '_' for '-' as torchrun spells them; torchrun's flags
and what dtrain run does with each: doc/launcher.md):
  --nproc-per-node N     workers on this node (default 1); 'cpu': one per usable CPU; 'gpu': one
                         per visible CUDA device (none: an error); 'auto': 'gpu' where there
                         are CUDA devices, else 'cpu'
  --nnodes N|MIN:MAX     nodes in the job; a range MIN:MAX makes it elastic (default 1)
  --max-restarts K       worker failures the job restarts from (default 0)
  --recovery MODE        in-place (default): only the failed worker restarts and joins the
                         survivors, who go on from the state they hold (programs using
                         dtrain::ResilientDataParallel; the workers of others restart
                         together); with c10d/etcd a node lost or joining changes the
                         running round in place too (not node 0's loss, nor a SIGTERM);
                         restart: a failure restarts every worker of the node
  --log-dir DIR          also append each rank's output to DIR/rank<R>.log
  -r, --redirects S      streams only to DIR/rank<R>.log, not the console (needs --log-dir):
                         0 none, 1 stdout, 2 stderr, 3 both; or per local rank: 0:3,1:2
  -t, --tee S            streams to DIR/rank<R>.log and the console (same values). With either
                         of the two, the log files hold only the streams they name
  --local-ranks-filter R,...  only these local ranks' lines reach the console (not the files)
  --role NAME            the workers' ROLE_NAME (default 'default')
  --run-id ID            TORCHELASTIC_RUN_ID and the rendezvous job id (alias --rdzv-id)
  --grace-period SECS    time between SIGTERM and SIGKILL when stopping workers (default 5;
                         elastic: at most 0.5 when a peer node was lost, as they cannot stop
                         together with it)
  --shutdown-timeout S   torchrun's name for --grace-period
  --no-python            run a .py program directly instead of through python
  --standalone           single node with a free port (torchrun compatibility)
  --start-method M       spawn, fork or forkserver: no effect (a worker is always a new program,
                         as spawn starts a Python one)
  -m/--module and --run-path are refused: they run Python inside torchrun's interpreter; run
  `dtrain run [flags] python3 -u -m MODULE ...` instead of -m.
  -h, --help             this text

static nodes (--rdzv-backend static, the default):
  --node-rank R          this node's rank, 0 <= R < nnodes (default 0)
  --master-addr HOST     host of the node running rank 0 (default 127.0.0.1)
  --master-port PORT     store port on the master; 0 or absent: a free one (single node only)
  Every node runs `dtrain run` with its own --node-rank and the same master; restarts are local.

elastic nodes (one `dtrain run` agent per node, all with the same flags):
  --rdzv-backend B       c10d: a store hosted by the agent that can bind --rdzv-endpoint (if that
                         agent dies the job ends); etcd: an etcd server (no single point of failure)
  --rdzv-endpoint H:P    where the store or etcd listens (default port 29400 c10d, 2379 etcd);
                         etcd: H:P,H:P,... every member of its cluster, the agents fail over
  --rdzv-id JOB          the job's id: agents with the same id form one job
  --rdzv-conf K=V,...    timeout=900 (s a round may take to complete), last_call_timeout=30 (s
                         to wait for more nodes once MIN joined), join_timeout=60 (s to reach the
                         store at start; any later call at most 15 s; NOT torchrun's, which
                         bounds the whole rendezvous: use timeout), read_timeout (torchrun's
                         name, sets join_timeout), keep_alive_interval=1 (s between
                         heartbeats), keep_alive_max_attempt=3 (missed heartbeats = node dead);
                         close_timeout and is_host are accepted and ignored (a warning)
  --local-addr HOST      the address this node gives the others (MASTER_ADDR when it runs rank
                         0); default: its address on the route to --rdzv-endpoint
  --monitor-interval S   how often the agent looks at the rendezvous while workers run (0.5)
  --rdzv-token TOKEN     require this token from every agent (c10d); better: the variable
                         DTRAIN_RDZV_TOKEN, which stays out of process listings
  A round starts when MAX nodes joined, or MIN and the last call passed. A failed worker restarts
  every node's workers (TORCHELASTIC_RESTART_COUNT = round number); a lost node (no heartbeat) or
  one that leaves (SIGTERM) shrinks the job if MIN still holds, else the job ends naming it; a node
  that arrives later waits and the job grows at the next monitor interval. Under --recovery
  in-place, once the workers formed their group, a lost node (not node 0) leaves and a new one
  joins the running round without a restart (its workers join as newcomers).

Each worker's environment is torchrun's: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME=default, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID (a fresh
uuid on a single node without --master-port, unless --run-id), TORCHELASTIC_ERROR_FILE (in a
temporary folder removed when dtrain run exits),
TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT, TORCH_NCCL_ASYNC_ERROR_HANDLING=1 and
OMP_NUM_THREADS=1 with several workers (each unless already set). dtrain's own:
DTRAIN_RECOVERY=restart|in-place (--recovery), and DTRAIN_RECOVERY_JOIN=1 for a worker restarted
alone, which joins the running workers as a newcomer and takes its state from a live peer.
TORCHELASTIC_USE_AGENT_STORE=True, as in torchrun: node 0's launcher hosts the workers' store, so
that it outlives every worker. Differences: TORCHELASTIC_USE_AGENT_STORE=False (no store in the
launcher: rank 0 hosts it) under --recovery restart; MASTER_ADDR is an address (127.0.0.1 on one
node) where torchrun may give a host name (localhost); no TORCHELASTIC_TIMER_FILE (torchrun's
TORCHELASTIC_ENABLE_FILE_TIMER=1 watchdog is not implemented).

Exit code: 0 when every worker succeeds (for a worker restarted alone: its last run; one that
--recovery in-place could not replace, the others going on without it, does not count); the first
failing worker's exit code (128 + signal if a signal killed it); 128 + signal when dtrain run
itself is interrupted; 1 when the elastic job ends for another reason (lost nodes, no rendezvous
store answering in time, another program on the c10d endpoint's port); 2 for bad flags.
A worker that exits with code 2 (a usage error: bad flag, variable or file) is not restarted,
whatever --max-restarts says, on static and elastic nodes alike: a restart cannot fix it.
)";
}

}  // namespace dtrain::cli
