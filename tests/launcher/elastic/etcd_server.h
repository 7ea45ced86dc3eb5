// Test helper: a real etcd server (Debian's etcd-server, /usr/bin/etcd) on free loopback ports with
// a temporary data directory, for the tests of the etcd rendezvous backend and of `dtrain run
// --rdzv-backend etcd`.
//
//   if (!EtcdServer::available()) GTEST_SKIP() << EtcdServer::skip_reason();
//   EtcdServer etcd;
//   etcd.start();                 // waits until it answers; throws with etcd's log tail otherwise
//   run("dtrain run --rdzv-backend etcd --rdzv-endpoint " + etcd.endpoint() + " ...");
//   etcd.stop();                  // also done by the destructor
//
// etcd runs as a child of the thread that calls start() and is killed if that thread's process dies
// (PR_SET_PDEATHSIG), so a test killed by ctest's timeout leaves no etcd behind. Start it from the
// test's main thread.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace dtrain::testing {

class EtcdServer {
 public:
  static constexpr const char* kBinary = "/usr/bin/etcd";

  static bool available() { return access(kBinary, X_OK) == 0; }
  static std::string skip_reason() {
    return std::string(kBinary) + " is not installed (Debian: apt-get install etcd-server)";
  }

  EtcdServer() = default;
  ~EtcdServer() { stop(); }
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  // Starts etcd with its client and peer URLs on free 127.0.0.1 ports and a fresh data directory,
  // and waits until GET /health says it is healthy, at most `timeout`. Throws std::runtime_error
  // with the end of etcd's log if it does not come up. A port taken between picking and binding is
  // retried with new ports.
  void start(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    stop();
    char pattern[] = "/tmp/dtrain-etcd-XXXXXX";
    if (mkdtemp(pattern) == nullptr) throw std::runtime_error("EtcdServer: mkdtemp failed");
    dir_ = pattern;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string last_log;
    for (int attempt = 0; attempt < 3; ++attempt) {
      client_port_ = free_loopback_port();
      int peer_port = free_loopback_port();
      while (peer_port == client_port_) peer_port = free_loopback_port();
      spawn(peer_port, attempt);
      while (std::chrono::steady_clock::now() < deadline) {
        if (healthy(client_port_)) return;
        int status = 0;
        if (waitpid(pid_, &status, WNOHANG) == pid_) {
          pid_ = -1;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      last_log = log_tail();
      if (pid_ > 0) break;  // still running but never healthy: out of time
      if (last_log.find("address already in use") == std::string::npos) break;
    }
    std::string endpoint_text = endpoint();
    stop();
    throw std::runtime_error("EtcdServer: etcd on " + endpoint_text +
                             " did not become healthy; its log ends with:\n" + last_log);
  }

  // "127.0.0.1:PORT", the client endpoint (what --rdzv-endpoint takes).
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }
  int client_port() const { return client_port_; }
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }

  // One HTTP/1.0 request to etcd's client port over a plain socket (no libcurl: the helper must not
  // depend on the code under test), e.g. post("/v3/kv/range", R"({"key":"..."})") to look at what
  // a test left in etcd. Returns the whole reply, status line and headers included; "" when etcd
  // does not answer within 2 s.
  std::string post(const std::string& path, const std::string& json_body) const {
    return http(client_port_, "POST", path, json_body);
  }

  // SIGSTOP / SIGCONT: a server that accepts connections (the kernel's backlog) and never answers.
  // pause() returns once every thread of etcd is stopped: kill() returns before that, and a thread
  // still running could answer one more request.
  void pause() {
    if (pid_ <= 0) return;
    kill(pid_, SIGSTOP);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!all_threads_stopped() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  void resume() {
    if (pid_ > 0) kill(pid_, SIGCONT);
  }

  // Kills etcd (SIGKILL: the tests need no graceful shutdown, and a paused one dies too), reaps it
  // and removes its data directory. Safe to call twice.
  void stop() noexcept {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
      pid_ = -1;
    }
    if (!dir_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
      dir_.clear();
    }
  }

 private:
  static int free_loopback_port() {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      if (fd >= 0) close(fd);
      throw std::runtime_error("EtcdServer: cannot bind a loopback socket to pick a port");
    }
    close(fd);
    return ntohs(address.sin_port);
  }

  void spawn(int peer_port, int attempt) {
    std::string client_url = "http://127.0.0.1:" + std::to_string(client_port_);
    std::string peer_url = "http://127.0.0.1:" + std::to_string(peer_port);
    std::string data_dir = dir_ + "/data" + std::to_string(attempt);
    std::vector<std::string> args = {kBinary,
                                     "--name=dtrain-test",
                                     "--data-dir=" + data_dir,
                                     "--listen-client-urls=" + client_url,
                                     "--advertise-client-urls=" + client_url,
                                     "--listen-peer-urls=" + peer_url,
                                     "--initial-advertise-peer-urls=" + peer_url,
                                     "--initial-cluster=dtrain-test=" + peer_url,
                                     "--logger=zap",
                                     "--log-level=warn"};
    std::vector<char*> argv;
    for (auto& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    std::string log_path = log_file();
    pid_t parent = getpid();
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("EtcdServer: fork failed");
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
      int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      int null = open("/dev/null", O_RDONLY);
      if (log >= 0) {
        dup2(log, STDOUT_FILENO);
        dup2(log, STDERR_FILENO);
      }
      if (null >= 0) dup2(null, STDIN_FILENO);
      execv(kBinary, argv.data());
      _exit(127);
    }
  }

  // Whether /proc/<pid>/task/*/stat shows every thread in state T (stopped).
  bool all_threads_stopped() const {
    std::error_code error;
    std::filesystem::directory_iterator tasks("/proc/" + std::to_string(pid_) + "/task", error);
    if (error) return false;
    for (const auto& task : tasks) {
      std::ifstream in(task.path() / "stat");
      std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      size_t name_end = stat.rfind(')');  // the state follows the command name in parentheses
      if (name_end == std::string::npos || name_end + 2 >= stat.size()) return false;
      if (stat[name_end + 2] != 'T' && stat[name_end + 2] != 't') return false;
    }
    return true;
  }

  std::string log_file() const { return dir_ + "/etcd.log"; }

  std::string log_tail() const {
    std::ifstream in(log_file());
    std::stringstream text;
    text << in.rdbuf();
    std::string all = text.str();
    return all.size() > 2000 ? all.substr(all.size() - 2000) : all;
  }

  static bool healthy(int port) {
    return http(port, "GET", "/health", "").find("\"health\":\"true\"") != std::string::npos;
  }

  static std::string http(int port, const std::string& method, const std::string& path,
                          const std::string& body) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return "";
    timeval limit{2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(port));
    std::string reply;
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
      std::string request =
          method + " " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n" +
          "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
          "\r\n\r\n" + body;
      if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(request.size())) {
        char chunk[4096];
        ssize_t n;
        while ((n = recv(fd, chunk, sizeof(chunk), 0)) > 0) reply.append(chunk, n);
      }
    }
    close(fd);
    return reply;
  }

  std::string dir_;
  int client_port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace dtrain::testing
