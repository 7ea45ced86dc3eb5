// Several "hosts" on one machine, for tier-2 tests of what a cluster does and one machine does not:
// each host a Linux network namespace with its own address (10.77.0.<n+1>/24 on its eth0) and its
// own hostname, which resolves nowhere, as on a cluster whose nodes know each other only by
// address. The hosts meet on a bridge that lives in a namespace of its own (the "switch"), so that
// nothing is added to the machine's own interfaces and no address leaves the namespaces. A test
// makes them, runs commands "on" them, pulls a host's cable (link down: nothing it sends leaves,
// nothing reaches it, and no connection is reset), cuts the network between two hosts alone, caps
// a host's bandwidth, kills everything on a host, and leaves nothing behind: the destructor kills
// what still runs in the namespaces and deletes them (with their links). Needs root
// (CAP_NET_ADMIN, CAP_SYS_ADMIN), `ip` and `unshare` (`tc` for a cap, `bridge` for a cut between
// two hosts); where the kernel or the container refuses, problem() says why and the test skips
// with it:
//   NamespaceHosts hosts(3);
//   if (!hosts.problem().empty()) GTEST_SKIP() << hosts.problem();
//   run_command(hosts.on(1, bin("dtrain") + " run ..."));
// Nothing crosses between hosts through shared memory: the launcher and the library decide "same
// host" by hostname, which differs. (The filesystem is shared: tests use it for their records.)
// Header-only, LibTorch-free.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/subprocess.h"

namespace dtrain::testing {

class NamespaceHosts {
 public:
  // `count` hosts (2 or 3 in the tests; up to 250 work).
  explicit NamespaceHosts(int count) : count_(count) {
    static int made = 0;  // several sets in one test process, one after another or at once
    const std::string id = std::to_string(::getpid()) + "n" + std::to_string(made++);
    switch_ = "dtrain" + id + "s";
    for (int h = 0; h < count; ++h) names_.push_back("dtrain" + id + "h" + std::to_string(h));
    if (::geteuid() != 0) {
      problem_ = "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)";
      return;
    }
    std::string script = "set -e; ip netns add " + switch_ + "; ip -n " + switch_ +
                         " link add br0 type bridge; ip -n " + switch_ + " link set br0 up";
    for (int h = 0; h < count; ++h) {
      const std::string port = port_name(h);
      script += "; ip netns add " + names_[h] + "; ip -n " + switch_ + " link add " + port +
                " type veth peer name eth0 netns " + names_[h] + "; ip -n " + switch_ +
                " link set " + port + " master br0; ip -n " + switch_ + " link set " + port +
                " up; ip -n " + names_[h] + " addr add " + address(h) + "/24 dev eth0; ip -n " +
                names_[h] + " link set eth0 up; ip -n " + names_[h] + " link set lo up";
    }
    auto made_them = run_command("sh -c '" + script + "'", 30);
    if (made_them.exit_code != 0) {
      problem_ = "cannot make " + std::to_string(count) +
                 " namespace hosts (the kernel or the container refused): " + made_them.output;
    }
  }

  // Kills whatever still runs on the hosts, then deletes the namespaces: deleting one deletes the
  // veth end inside it, and with it the pair.
  ~NamespaceHosts() {
    for (int h = 0; h < count_; ++h) kill_all(h);
    std::string script;
    for (const auto& name : names_) script += "ip netns del " + name + " 2>/dev/null; ";
    run_command("sh -c '" + script + "ip netns del " + switch_ + " 2>/dev/null; true'", 30);
  }

  NamespaceHosts(const NamespaceHosts&) = delete;
  NamespaceHosts& operator=(const NamespaceHosts&) = delete;

  // Empty when the hosts are up; else why not.
  const std::string& problem() const { return problem_; }
  int count() const { return count_; }
  static std::string address(int host) { return "10.77.0." + std::to_string(host + 1); }
  static std::string hostname(int host) { return "dtrain-node-" + std::to_string(host); }
  const std::string& namespace_of(int host) const { return names_.at(host); }

  // `command` run on host `host`, under its hostname (a UTS namespace of its own): a shell command
  // line, for run_command or a script. `command` must not contain double quotes.
  std::string on(int host, const std::string& command) const {
    return "ip netns exec " + names_.at(host) + " unshare --uts sh -c \"hostname " +
           hostname(host) + " && exec " + command + "\"";
  }

  // Pulls (up = false) or plugs back host `host`'s cable: its port on the switch goes down, and
  // with it the carrier of the host's eth0. Packets are dropped, not refused: no connection is
  // reset, TCP just retransmits. True when `ip` did it.
  bool set_link(int host, bool up) const {
    return run_command("ip -n " + switch_ + " link set " + port_name(host) + (up ? " up" : " down"),
                       30)
               .exit_code == 0;
  }

  // Cuts (cut = true) or mends the network between hosts `a` and `b` alone: each still reaches
  // every other host, as when one link or switch port between two machines fails while the network
  // that reaches the rest still works. Their ports on the switch are isolated (bridge port
  // isolation: isolated ports forward nothing to one another), so packets between the two are
  // dropped, not refused. One pair at a time. True when `bridge` did it.
  bool cut_between(int a, int b, bool cut) const {
    const std::string set = "ip netns exec " + switch_ + " bridge link set dev ";
    const std::string mode = cut ? " isolated on" : " isolated off";
    return run_command(set + port_name(a) + mode, 30).exit_code == 0 &&
           run_command(set + port_name(b) + mode, 30).exit_code == 0;
  }

  // A firewall on host `host` that drops every TCP connection coming in (drop = true: each SYN
  // that is not a reply), while the connections it opens itself go through: a one-way cut, which
  // neither a link down nor a switch port isolated can make. drop = false takes it away. True when
  // `nft` (Debian's nftables, over the kernel's nf_tables) did it.
  bool drop_incoming(int host, bool drop) const {
    const std::string nft = "ip netns exec " + names_.at(host) + " nft ";
    if (!drop) return run_command(nft + "delete table inet dtrain_firewall", 30).exit_code == 0;
    return run_command(nft +
                           "'add table inet dtrain_firewall; add chain inet dtrain_firewall in { "
                           "type filter hook input priority 0; policy accept; }; add rule inet "
                           "dtrain_firewall in iif lo accept; add rule inet dtrain_firewall in "
                           "tcp flags & (syn | ack) == syn drop'",
                       30)
               .exit_code == 0;
  }

  // Caps what host `host` sends at `mbit` Mbit/s (a token bucket filter on its eth0); 0 removes the
  // cap. True when `tc` did it.
  bool cap(int host, int mbit) const {
    const std::string tc = "ip netns exec " + names_.at(host) + " tc qdisc ";
    if (mbit <= 0) return run_command(tc + "del dev eth0 root", 30).exit_code == 0;
    return run_command(tc + "replace dev eth0 root tbf rate " + std::to_string(mbit) +
                           "mbit burst 64kb latency 400ms",
                       30)
               .exit_code == 0;
  }

  // The processes that run on host `host` (in its network namespace), by pid.
  std::vector<int> pids(int host) const {
    std::vector<int> found;
    std::istringstream lines(run_command("ip netns pids " + names_.at(host), 30).output);
    for (int pid; lines >> pid;) found.push_back(pid);
    return found;
  }

  // kill -9 of every process on host `host`, repeated (a launcher may start a worker between two
  // looks) until none is left, 20 rounds at most. Returns how many were killed.
  int kill_all(int host) const {
    int killed = 0;
    for (int round = 0; round < 20; ++round) {
      const std::vector<int> found = pids(host);
      if (found.empty()) break;
      for (int pid : found) killed += ::kill(pid, SIGKILL) == 0 ? 1 : 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return killed;
  }

 private:
  // Appended, not "h" + to_string(): GCC 12 warns wrongly (-Wstringop-overflow) on that inlined.
  static std::string port_name(int host) { return std::string("h").append(std::to_string(host)); }

  int count_;
  std::string switch_;
  std::vector<std::string> names_;
  std::string problem_;
};

}  // namespace dtrain::testing
