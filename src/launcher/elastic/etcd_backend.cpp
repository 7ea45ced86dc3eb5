// EtcdBackend (see etcd_backend.h): the rendezvous state as one etcd key, through etcd's v3 JSON
// gateway over libcurl.
#include "launcher/elastic/etcd_backend.h"

#include <curl/curl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>
#include <vector>

#include "common/format.h"
#include "dtrain/errors.h"

namespace dtrain::elastic {
namespace {

using nlohmann::json;

// etcd's gateway carries keys and values as base64 (proto3 JSON's encoding of `bytes`).
constexpr char kBase64Alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(const std::string& bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    uint32_t triple = (uint32_t(uint8_t(bytes[i])) << 16) | (uint32_t(uint8_t(bytes[i + 1])) << 8) |
                      uint32_t(uint8_t(bytes[i + 2]));
    out += kBase64Alphabet[(triple >> 18) & 63];
    out += kBase64Alphabet[(triple >> 12) & 63];
    out += kBase64Alphabet[(triple >> 6) & 63];
    out += kBase64Alphabet[triple & 63];
  }
  size_t rest = bytes.size() - i;
  if (rest > 0) {
    uint32_t triple = uint32_t(uint8_t(bytes[i])) << 16;
    if (rest == 2) triple |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    out += kBase64Alphabet[(triple >> 18) & 63];
    out += kBase64Alphabet[(triple >> 12) & 63];
    out += rest == 2 ? kBase64Alphabet[(triple >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

// nullopt when `text` is not padded standard base64.
std::optional<std::string> base64_decode(const std::string& text) {
  auto value_of = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    bool last = i + 4 == text.size();
    int padding = last ? (text[i + 3] == '=') + (text[i + 2] == '=') : 0;
    uint32_t quad = 0;
    for (int k = 0; k < 4; ++k) {
      int value = k >= 4 - padding ? 0 : value_of(text[i + k]);
      if (value < 0) return std::nullopt;
      quad = (quad << 6) | uint32_t(value);
    }
    out += char((quad >> 16) & 0xff);
    if (padding < 2) out += char((quad >> 8) & 0xff);
    if (padding < 1) out += char(quad & 0xff);
  }
  return out;
}

// proto3 JSON writes int64 fields as strings ("mod_revision":"7") and leaves out zero values.
uint64_t json_uint64(const json& object, const char* field) {
  auto it = object.find(field);
  if (it == object.end()) return 0;
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  if (it->is_string()) {
    const std::string& text = it->get_ref<const std::string&>();
    if (!text.empty() && text.find_first_not_of("0123456789") == std::string::npos) {
      return std::stoull(text);
    }
  }
  throw std::invalid_argument(std::string("field '") + field + "' is not an unsigned integer");
}

std::string excerpt(const std::string& body) {
  constexpr size_t kMax = 200;
  return body.size() <= kMax ? body : body.substr(0, kMax) + "...";
}

// One member as given: HOST:PORT (or [IPv6]:PORT) for messages, http://HOST:PORT for requests,
// and the host (without brackets) and port to resolve.
struct ParsedEndpoint {
  std::string host_port;
  std::string base_url;
  std::string host;
  int port = 0;
};

ParsedEndpoint parse_endpoint(const std::string& given) {
  auto bad = [&](const std::string& why) {
    return UsageError("etcd endpoint '" + given + "': " + why +
                      "; expected HOST:PORT, e.g. 127.0.0.1:2379");
  };
  std::string rest = given;
  if (rest.rfind("https://", 0) == 0) throw bad("TLS (https) is not supported, only plain http");
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  std::string host;
  std::string port_text;
  if (!rest.empty() && rest.front() == '[') {
    size_t close = rest.find(']');
    if (close == std::string::npos) throw bad("unclosed '[' of an IPv6 address");
    host = rest.substr(0, close + 1);
    std::string after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') throw bad("unexpected text after the IPv6 address");
      port_text = after.substr(1);
      if (port_text.empty()) throw bad("empty port");
    }
  } else {
    size_t colon = rest.find(':');
    if (colon != std::string::npos && rest.find(':', colon + 1) != std::string::npos) {
      throw bad("an IPv6 address needs brackets, as in [::1]:2379");
    }
    host = rest.substr(0, colon);
    if (colon != std::string::npos) {
      port_text = rest.substr(colon + 1);
      if (port_text.empty()) throw bad("empty port");
    }
  }
  if (host.empty() || host == "[]") throw bad("no host");
  if (host.find_first_of("/?#@ ") != std::string::npos) throw bad("not a host name or address");
  int port = EtcdBackend::kDefaultPort;
  if (!port_text.empty()) {
    if (port_text.size() > 5 || port_text.find_first_not_of("0123456789") != std::string::npos) {
      throw bad("port '" + port_text + "' is not a number");
    }
    port = std::stoi(port_text);
    if (port < 1 || port > 65535) throw bad("port " + port_text + " is outside 1..65535");
  }
  std::string host_port = host + ":" + std::to_string(port);
  const bool bracketed = host.front() == '[';
  return {host_port, "http://" + host_port, bracketed ? host.substr(1, host.size() - 2) : host,
          port};
}

// The comma-separated endpoints of `given`, each still to be parsed. An empty item (",," or a comma
// at either end) is an error naming the list.
std::vector<std::string> split_endpoints(const std::string& given) {
  std::vector<std::string> items;
  size_t start = 0;
  for (;;) {
    size_t comma = given.find(',', start);
    items.push_back(given.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (items.size() > 1) {
    for (const std::string& item : items) {
      if (item.empty()) {
        throw UsageError("etcd endpoints '" + given +
                         "': an empty item between commas; expected HOST:PORT,HOST:PORT,... " +
                         "(the members of one etcd cluster), e.g. 10.0.0.1:2379,10.0.0.2:2379");
      }
    }
  }
  return items;
}

size_t append_to_string(char* data, size_t size, size_t count, void* target) {
  static_cast<std::string*>(target)->append(data, size * count);
  return size * count;
}

}  // namespace

struct EtcdBackend::Http {
  Http() {
    // curl_global_init is not thread-safe in every libcurl build; once per process is what it
    // needs.
    static std::once_flag global_init;
    std::call_once(global_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    curl = curl_easy_init();
    headers = curl_slist_append(nullptr, "Content-Type: application/json");
    // curl asks large POSTs to wait for "100 Continue" (up to a second); etcd needs no such pause.
    headers = curl_slist_append(headers, "Expect:");
    if (curl == nullptr || headers == nullptr) {
      throw InternalError("etcd rendezvous backend: libcurl could not create a handle");
    }
  }
  ~Http() {
    curl_slist_free_all(headers);
    if (curl != nullptr) curl_easy_cleanup(curl);
  }
  CURL* curl = nullptr;
  curl_slist* headers = nullptr;
  char error[CURL_ERROR_SIZE] = {};
};

EtcdBackend::EtcdBackend(const std::string& endpoints, const std::string& run_id,
                         std::chrono::milliseconds timeout, std::string key_prefix)
    : timeout_(timeout) {
  for (const std::string& given : split_endpoints(endpoints)) {
    ParsedEndpoint parsed = parse_endpoint(given);
    std::string& host_port = parsed.host_port;
    for (const Member& earlier : members_) {
      if (earlier.endpoint == host_port) {
        throw UsageError("etcd endpoints '" + endpoints + "': " + host_port +
                         " is listed twice; name each member of the etcd cluster once");
      }
    }
    endpoint_ += (endpoint_.empty() ? "" : ",") + host_port;
    std::vector<SocketAddress> addresses = resolve_addresses(parsed.host, parsed.port);
    members_.push_back(Member{std::move(host_port), std::move(parsed.base_url),
                              std::move(parsed.host), parsed.port, std::move(addresses)});
  }
  if (run_id.empty()) {
    throw UsageError(
        "etcd rendezvous backend: the run id is empty; give the job one with --rdzv-id");
  }
  if (timeout.count() <= 0) {
    throw UsageError("etcd rendezvous backend: the timeout must be positive, got " +
                     detail::seconds_text(timeout));
  }
  key_ = std::move(key_prefix) + run_id + "/state";
  http_ = std::make_unique<Http>();
}

EtcdBackend::~EtcdBackend() = default;

// Note [Failing over between etcd members]
// With several endpoints (the members of one etcd cluster), a call goes to the member that answered
// last; one that does not answer (refused, reset, silent, or an HTTP 5xx: etcd while it has no
// leader) is left for the next, and so on round the list, round after round (100 ms apart) until
// the call's timeout. Each try gets an equal share of what is left of the timeout for the members
// still to try in the round, so that a member that is only silent (its host lost: nothing resets
// the connection) costs a third of the timeout with three members, and the call still succeeds on
// another; later rounds ride out an election, when the members left have no leader for a second or
// two after the leader was lost. The member that answers is tried first from then on: one lost
// member slows one call, not every call. Any member serves the whole key space (etcd replicates
// it), and a write is one compare-and-set transaction: a write that timed out on one member but
// was applied there fails its comparison on the next, which returns the state as it is now, as
// after a lost race; the caller reads it and decides again (etcd_backend.h). An answer that is an
// error etcd gave (HTTP 4xx, a malformed reply) is not retried: every member would give it.
std::string EtcdBackend::request(const std::string& path, const std::string* post_body,
                                 const std::string& operation, Clock::time_point deadline) {
  constexpr auto kBetweenRounds = std::chrono::milliseconds(100);
  for (;;) {
    std::string failures;
    bool every_one_timed_out = true;
    for (size_t tried = 0; tried < members_.size(); ++tried) {
      const size_t index = (current_ + tried) % members_.size();
      const Clock::time_point share =
          Clock::now() + (deadline - Clock::now()) / static_cast<int>(members_.size() - tried);
      bool unanswered = false;
      try {
        std::string reply =
            request_to(members_[index], path, post_body, operation, share, &unanswered);
        current_ = index;
        return reply;
      } catch (const TimeoutError& error) {
        if (!unanswered || members_.size() == 1) throw;
        failures += (failures.empty() ? "" : " | ") + std::string(error.what());
      } catch (const CommError& error) {
        if (!unanswered || members_.size() == 1) throw;
        failures += (failures.empty() ? "" : " | ") + std::string(error.what());
        every_one_timed_out = false;
      }
    }
    if (Clock::now() + kBetweenRounds >= deadline) {
      std::string message = "no member of the etcd cluster " + endpoint_ +
                            " answered within the call's " + detail::seconds_text(timeout_) +
                            " timeout: " + failures;
      if (every_one_timed_out) throw TimeoutError(message);
      throw CommError(message);
    }
    std::this_thread::sleep_for(kBetweenRounds);
  }
}

std::string EtcdBackend::request_to(const Member& member, const std::string& path,
                                    const std::string* post_body, const std::string& operation,
                                    Clock::time_point deadline, bool* unanswered) {
  // What is left of the call's budget (at least 1 ms: curl takes 0 to mean "no limit").
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  long budget_ms = std::max<long>(1, static_cast<long>(left.count()));
  // The wait a timeout reports: the call's own timeout, or this member's share of it, named as
  // such: mid-job the agent shortens the timeout to what is left of its patience (Note [A store
  // that stops answering] in src/launcher/cli/elastic_rendezvous.cpp), which can be far less than
  // how long etcd has been silent.
  const std::string waited =
      members_.size() == 1 ? "the call's " + detail::seconds_text(timeout_) + " timeout"
                           : "its " + detail::seconds_text(std::chrono::milliseconds(budget_ms)) +
                                 " share of the call's timeout";
  CURL* curl = http_->curl;
  std::string response;
  std::string url = member.base_url + path;
  http_->error[0] = '\0';
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  // No signals: a timeout must not longjmp out of another thread's resolver (libcurl's advice for
  // multi-threaded programs; the agent runs its rendezvous beside monitoring threads).
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, budget_ms);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, budget_ms);
  // etcd is reached directly: an http_proxy in the environment (common on clusters, meant for the
  // internet) would otherwise receive the rendezvous traffic, loopback included.
  curl_easy_setopt(curl, CURLOPT_PROXY, "");
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, http_->error);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, append_to_string);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response);
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, http_->headers);
  if (post_body != nullptr) {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, post_body->data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(post_body->size()));
  } else {
    curl_easy_setopt(curl, CURLOPT_HTTPGET, 1L);
  }

  CURLcode code = curl_easy_perform(curl);
  std::string detail = http_->error[0] != '\0' ? http_->error : curl_easy_strerror(code);
  std::string at = "etcd at " + member.endpoint;
  // No answer from this member (another may give one): every transport failure.
  *unanswered = code != CURLE_OK;
  switch (code) {
    case CURLE_OK:
      break;
    case CURLE_OPERATION_TIMEDOUT:
      throw TimeoutError(at + ": " + operation + " got no answer within " + waited +
                         "; the server is stopped, overloaded or unreachable from here (" + detail +
                         ")");
    case CURLE_COULDNT_CONNECT: {
      long os_errno = 0;
      curl_easy_getinfo(curl, CURLINFO_OS_ERRNO, &os_errno);
      // Refused: the host answered, so nothing listens there. Anything else (no route, a host that
      // never answers) looks the same whether etcd's host is down or this node is cut off from it.
      if (os_errno != ECONNREFUSED) {
        throw CommError(at + " could not be reached (" + detail +
                        "): either its host is down or this node is cut off from it");
      }
      throw CommError(at + " refused the connection; is etcd running there? (apt-get install " +
                      "etcd-server; or start one: etcd --listen-client-urls " + member.base_url +
                      " --advertise-client-urls " + member.base_url + ")");
    }
    case CURLE_COULDNT_RESOLVE_HOST:
      throw CommError(at + ": the host name does not resolve (" + detail +
                      "); check the rendezvous endpoint");
    default:
      throw CommError(at + ": " + operation + " failed: " + detail);
  }

  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  if (status != 200) {
    *unanswered = status >= 500;  // etcd without a leader, or a gateway in front of it
    // grpc-gateway errors are {"error": ..., "message": ..., "code": N}.
    json error = json::parse(response, nullptr, false);
    std::string message = excerpt(response);
    if (error.is_object() && error.contains("message") && error["message"].is_string()) {
      message = error["message"].get<std::string>();
    }
    std::string hint;
    if (status == 404) {
      hint = "; this server does not serve etcd's v3 JSON gateway at " + path +
             " (etcd 3.4 or newer is needed; is it etcd at all?)";
    }
    throw CommError(at + ": " + operation + ": HTTP " + std::to_string(status) + ": " + message +
                    hint);
  }
  return response;
}

Knock EtcdBackend::knock(std::chrono::milliseconds timeout) {
  // Every member's addresses at once: a cluster member that takes the connection is enough to keep
  // waiting for the cluster (it may be electing a leader).
  std::vector<SocketAddress> addresses;
  for (const Member& member : members_) {
    if (!member.addresses.empty()) {
      addresses.insert(addresses.end(), member.addresses.begin(), member.addresses.end());
      continue;
    }
    // Did not resolve when the agent started: resolved now (which may wait on a resolver).
    for (const SocketAddress& address : resolve_addresses(member.host, member.port)) {
      addresses.push_back(address);
    }
  }
  return elastic::knock(addresses, timeout);
}

std::optional<VersionedState> EtcdBackend::get_state() {
  const std::string operation = "read the rendezvous state (key " + key_ + ")";
  std::string body = json{{"key", base64_encode(key_)}}.dump();
  std::string reply_text = request("/v3/kv/range", &body, operation, Clock::now() + timeout_);
  try {
    json reply = json::parse(reply_text);
    if (!reply.contains("kvs") || reply["kvs"].empty()) return std::nullopt;
    const json& kv = reply["kvs"].at(0);
    std::optional<std::string> state = base64_decode(kv.value("value", std::string()));
    uint64_t version = json_uint64(kv, "mod_revision");
    if (!state || version == 0) throw std::invalid_argument("bad value or mod_revision");
    return VersionedState{std::move(*state), version};
  } catch (const std::exception& error) {
    throw CommError(at() + ": " + operation + ": unexpected reply (" + error.what() +
                    "): " + excerpt(reply_text));
  }
}

// One transaction: compare the key's revision with what the caller read, put on a match, read the
// key back otherwise, so a lost race costs no second round trip.
RendezvousBackend::SetResult EtcdBackend::set_state(const std::string& state,
                                                    std::optional<uint64_t> expected_version) {
  // One budget for the whole call: the lease grant (with a TTL), the transaction, the compaction.
  Clock::time_point deadline = Clock::now() + timeout_;
  const std::string operation = "write the rendezvous state (key " + key_ + ")";
  const std::string key = base64_encode(key_);
  json compare =
      expected_version
          ? json{{"key", key},
                 {"target", "MOD"},
                 {"result", "EQUAL"},
                 {"mod_revision", std::to_string(*expected_version)}}
          // A key that was never written (or was deleted) has create_revision 0.
          : json{{"key", key}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}};
  json put = {{"key", key}, {"value", base64_encode(state)}};
  if (int64_t lease = lease_for_write(deadline); lease != 0) put["lease"] = std::to_string(lease);
  json txn = {
      {"compare", json::array({compare})},
      {"success", json::array({{{"request_put", put}}})},
      {"failure", json::array({{{"request_range", {{"key", key}}}}})},
  };
  std::string body = txn.dump();
  std::string reply_text = request("/v3/kv/txn", &body, operation, deadline);

  std::optional<SetResult> result;
  uint64_t written_revision = 0;
  try {
    json reply = json::parse(reply_text);
    if (reply.value("succeeded", false)) {
      // All writes of a transaction carry its revision, which the reply's header reports.
      uint64_t revision = json_uint64(reply.at("header"), "revision");
      if (revision == 0) throw std::invalid_argument("no revision in the header");
      result = SetResult{VersionedState{state, revision}, true};
      written_revision = revision;
    } else {
      const json& range = reply.at("responses").at(0).at("response_range");
      if (range.contains("kvs") && !range["kvs"].empty()) {
        const json& kv = range["kvs"].at(0);
        std::optional<std::string> current = base64_decode(kv.value("value", std::string()));
        uint64_t version = json_uint64(kv, "mod_revision");
        if (!current || version == 0) throw std::invalid_argument("bad value or mod_revision");
        result = SetResult{VersionedState{std::move(*current), version}, false};
      }
    }
  } catch (const std::exception& error) {
    throw CommError(at() + ": " + operation + ": unexpected reply (" + error.what() +
                    "): " + excerpt(reply_text));
  }
  if (!result) {
    // The comparison failed and the key is gone: it expired, or something outside dtrain deleted
    // it.
    std::string cause = state_ttl_.count() > 0
                            ? "its TTL of " + detail::seconds_text(state_ttl_) +
                                  " expired with no write, or it was deleted (etcdctl del?)"
                            : "it was deleted (etcdctl del?)";
    throw CommError(at() + ": " + operation + ": the key vanished while the " +
                    "job was using it: " + cause + "; restart the job, or give it a new --rdzv-id");
  }
  if (written_revision != 0) maybe_compact(written_revision, deadline);
  return *result;
}

int64_t EtcdBackend::lease_for_write(Clock::time_point deadline) {
  if (state_ttl_.count() <= 0) return 0;
  Clock::time_point asked = Clock::now();
  if (lease_id_ != 0 && asked - lease_granted_ < state_ttl_ / 2) return lease_id_;
  const std::string operation = "grant a lease for the state's TTL";
  std::string body = json{{"TTL", std::to_string(state_ttl_.count())}}.dump();
  std::string reply_text = request("/v3/lease/grant", &body, operation, deadline);
  json reply = json::parse(reply_text, nullptr, false);
  int64_t id = 0;
  try {
    if (reply.is_object() && reply.value("error", std::string()) != "") {
      throw std::invalid_argument(reply["error"].get<std::string>());
    }
    id = static_cast<int64_t>(json_uint64(reply, "ID"));
    if (id == 0) throw std::invalid_argument("no lease ID");
  } catch (const std::exception& error) {
    throw CommError(at() + ": " + operation + ": " + error.what() + ": " + excerpt(reply_text));
  }
  lease_id_ = id;
  lease_granted_ = asked;  // the lease started no earlier than this: its age is not underestimated
  return id;
}

// Note [Compacting etcd's history]
// etcd keeps every past revision of every key until the history is compacted, and Debian's etcd
// does not compact by itself (--auto-compaction-retention is 0). The agents rewrite the state at
// every heartbeat, so a long job would fill etcd's quota (2 GiB by default) with old copies of it,
// after which etcd refuses all writes ("mvcc: database space exceeded") and the job stops. So the
// agent whose write lands on a multiple of compaction_interval_ compacts the history older than
// compaction_interval_ revisions: one agent at a time does it, about every compaction_interval_
// writes, and the current state is never touched. Best effort, within what is left of the call's
// timeout: the write has already succeeded, and a failed compaction is retried at the next multiple
// (one that someone else already did fails harmlessly with "required revision has been compacted").
void EtcdBackend::maybe_compact(uint64_t written_revision, Clock::time_point deadline) {
  if (compaction_interval_ == 0 || Clock::now() >= deadline ||
      written_revision % compaction_interval_ != 0 || written_revision <= compaction_interval_) {
    return;
  }
  std::string body =
      json{{"revision", std::to_string(written_revision - compaction_interval_)}}.dump();
  try {
    request("/v3/kv/compaction", &body, "compact etcd's history", deadline);
  } catch (const CommError&) {
  }
}

void EtcdBackend::check_reachable() {
  std::string reply_text = request("/version", nullptr, "GET /version", Clock::now() + timeout_);
  json reply = json::parse(reply_text, nullptr, false);
  if (!reply.is_object() || !reply.contains("etcdserver") || !reply["etcdserver"].is_string()) {
    throw CommError("the server at " + current_member() +
                    " answered GET /version but is not etcd (reply: " + excerpt(reply_text) +
                    "); check the rendezvous endpoint");
  }
  std::string version = reply["etcdserver"].get<std::string>();
  int major = 0;
  int minor = 0;
  if (std::sscanf(version.c_str(), "%d.%d", &major, &minor) == 2 &&
      (major < 3 || (major == 3 && minor < 4))) {
    throw CommError(at() + " is version " + version +
                    "; dtrain needs etcd 3.4 or newer (its /v3 JSON gateway)");
  }
  get_state();  // proves the v3 gateway answers and that this client may read the key
}

}  // namespace dtrain::elastic
