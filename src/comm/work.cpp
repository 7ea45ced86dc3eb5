// Operations in flight: one InFlight class per transport (c10d's Gloo/NCCL work, a queued
// shared-memory collective, a shared-memory message), and the one place where their failures become
// dtrain's errors.
//
// Note [Timeouts are told by the clock]
// Gloo reports a timeout as text ("Timed out waiting ..."), a dead peer as other text, and c10d
// sometimes wraps one in the other. Guessing from the words once turned a link cut after 8 s into
// "timed out after 20 s", dropping the real cause. Instead each InFlight sorts its transport's
// failure into a TransportFailure kind where it is caught: the shared-memory transport knows its
// kinds; for c10d, an error raised before the operation's deadline is a lost peer (with the
// transport's words and the time it happened), one raised at or after the deadline a timeout.
#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm/group_state.h"
#include "comm/shm_p2p.h"
#include "comm/shm_transport.h"
#include "common/log.h"

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;

std::string first_line(std::string text) {
  if (auto newline = text.find('\n'); newline != std::string::npos) text.resize(newline);
  return text;
}

TransportFailure from_shm(const ShmFailure& e) {
  switch (e.kind) {
    case ShmFailure::Kind::kTimeout:
      return {TransportFailure::Kind::kTimeout, e.what(), e.late_rank};
    case ShmFailure::Kind::kPeerLost:
      return {TransportFailure::Kind::kPeerLost, e.what(), e.late_rank};
    case ShmFailure::Kind::kMismatch:
      return {TransportFailure::Kind::kMismatch, e.what(), e.late_rank};
    case ShmFailure::Kind::kDestroyed:
      return {TransportFailure::Kind::kDestroyed, e.what(), e.late_rank};
  }
  return {TransportFailure::Kind::kPeerLost, e.what(), e.late_rank};
}

// A c10d error: a timeout if the operation's timeout has passed since it was issued, else a lost
// peer (Note [Timeouts are told by the clock]). Every timer that can fire (the wait's, Gloo's own)
// started after the operation was issued, so a real timeout always passes this test.
TransportFailure from_c10d(const std::string& what, Clock::time_point started,
                           std::chrono::milliseconds timeout) {
  const bool late = Clock::now() - started >= timeout;
  return {late ? TransportFailure::Kind::kTimeout : TransportFailure::Kind::kPeerLost,
          first_line(what)};
}

class C10dInFlight : public InFlight {
 public:
  C10dInFlight(c10::intrusive_ptr<c10d::Work> work, bool nccl)
      : work_(std::move(work)), nccl_(nccl) {}

  void wait(Clock::time_point started, std::chrono::milliseconds timeout,
            const std::function<std::string()>& abandon) override {
    try {
      if (!abandon) {
        work_->wait(timeout);
        return;
      }
      if (nccl_) {
        poll(timeout, abandon);
        return;
      }
      // In slices, asking `abandon` between them. c10d's wait(t) throws when t passes with the
      // operation not done, and leaves it running: the next slice waits on. An operation that is
      // done answers the next wait at once, with its own result.
      const auto deadline = Clock::now() + timeout;
      for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        try {
          work_->wait(std::clamp(left, std::chrono::milliseconds(1), kAbandonSlice));
          return;
        } catch (const c10::Error&) {
          if (work_->isCompleted()) {
            work_->wait(timeout);  // its own failure, or (done as the slice ended) its success
            return;
          }
          if (Clock::now() >= deadline) throw;
        }
        std::string reason = abandon();
        if (!reason.empty()) throw TransportFailure{TransportFailure::Kind::kAbandoned, reason};
      }
    } catch (const TransportFailure&) {
      throw;
    } catch (const c10::Error& e) {
      throw from_c10d(e.what_without_backtrace(), started, timeout);
    } catch (const std::exception& e) {
      throw from_c10d(e.what(), started, timeout);
    }
  }
  bool finished() const override { return work_->isCompleted(); }

 private:
  // Note [Waiting for NCCL]
  // NCCL's wait(t) cannot be cut into slices as Gloo's is: when t passes it aborts the whole
  // communicator (c10d's blocking wait), so a slice that ended would end the group. Its
  // isCompleted() asks the work's CUDA event (and NCCL's asynchronous error) without waiting, so
  // the wait polls that, asking `abandon` every kAbandonSlice: a lost host or a cut link, which
  // NCCL may never report (its kernels spin on the device), ends the wait in seconds, and in-place
  // recovery then aborts the communicator (RecoveryCore::release_group). Once done, wait() with
  // no timeout joins the caller's stream to NCCL's, and throws the work's own failure if it had
  // one. The pause between polls starts short, so that a collective that ends soon is not
  // waited for much longer than c10d's own blocking wait would (it sleeps 1 ms between looks).
  void poll(std::chrono::milliseconds timeout, const std::function<std::string()>& abandon) {
    const auto begun = Clock::now();
    const auto deadline = begun + timeout;
    auto next_ask = begun + kAbandonSlice;
    auto pause = std::chrono::microseconds(20);
    while (!work_->isCompleted()) {
      const auto now = Clock::now();
      if (now >= deadline) {
        throw TransportFailure{TransportFailure::Kind::kTimeout,
                               "NCCL's operation did not complete"};
      }
      if (now >= next_ask) {
        std::string reason = abandon();
        if (!reason.empty()) throw TransportFailure{TransportFailure::Kind::kAbandoned, reason};
        next_ask = now + kAbandonSlice;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(2 * pause, std::chrono::microseconds(1000));
    }
    work_->wait();
  }

  c10::intrusive_ptr<c10d::Work> work_;
  bool nccl_;
};

class ShmCollectiveInFlight : public InFlight {
 public:
  explicit ShmCollectiveInFlight(std::shared_future<void> done) : done_(std::move(done)) {}

  void wait(Clock::time_point started, std::chrono::milliseconds timeout,
            const std::function<std::string()>& abandon) override {
    // The transport's thread enforces the timeout itself; this bound only guards against a stuck
    // thread. With `abandon`, in slices asking it between them: a peer whose process hangs, or one
    // that gave up on this group, never comes to the operation, and its own death would have been
    // seen by the transport. The operation is left to the transport's thread, and the group is
    // not used again.
    const auto deadline = Clock::now() + 2 * timeout + std::chrono::seconds(10);
    for (;;) {
      const auto left = deadline - Clock::now();
      const auto slice = abandon ? std::min<Clock::duration>(left, kAbandonSlice) : left;
      if (done_.wait_for(slice) == std::future_status::ready) break;
      if (Clock::now() >= deadline) {
        throw TransportFailure{TransportFailure::Kind::kTimeout,
                               "the shared-memory transport's thread did not finish"};
      }
      if (!abandon) continue;
      std::string reason = abandon();
      if (!reason.empty()) throw TransportFailure{TransportFailure::Kind::kAbandoned, reason};
    }
    try {
      done_.get();
    } catch (const ShmFailure& e) {
      throw from_shm(e);
    }
  }
  bool finished() const override {
    return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  bool timed_by_transport() const override { return true; }

 private:
  std::shared_future<void> done_;
};

class ShmMessageInFlight : public InFlight {
 public:
  ShmMessageInFlight(ShmPointToPoint& transport, std::shared_ptr<ShmMessage> message)
      : transport_(transport), message_(std::move(message)) {}

  void wait(Clock::time_point started, std::chrono::milliseconds timeout,
            const std::function<std::string()>&) override {
    try {
      transport_.wait(*message_, timeout);
    } catch (const ShmFailure& e) {
      throw from_shm(e);
    }
  }
  bool finished() const override { return message_->done.load(std::memory_order_acquire); }

 private:
  ShmPointToPoint& transport_;  // the group's; the WorkState keeps the group alive
  std::shared_ptr<ShmMessage> message_;
};

// Turns a failed or late operation into dtrain's error, naming who did not arrive and what really
// happened, and marks the group broken.
[[noreturn]] void fail(WorkState& work, const TransportFailure& failure) {
  GroupState& group = *work.group;
  const bool peer_to_peer = work.seq == 0;
  std::ostringstream message;
  message << group.who() << ": " << work.op;
  if (peer_to_peer) {
    message << " with rank " << group.global_ranks[work.peer] << " on " << group.group_label();
  } else {
    message << " #" << work.seq << " on " << group.group_label();
  }
  using Kind = TransportFailure::Kind;
  if (failure.kind == Kind::kMismatch || failure.kind == Kind::kDestroyed) {
    if (peer_to_peer) message << " (tag " << work.tag << ")";
    message << ": " << failure.cause;
    group.record_failure(message.str());
    if (failure.kind == Kind::kDestroyed) {
      message << ". Wait for asynchronous work before destroying its group.";
    } else if (peer_to_peer) {
      message
          << ". The send and the recv of one (peer, tag) must have the same number of elements and "
             "dtype.";
    } else {
      message << ". Every rank must pass the same shape, dtype and op.";
    }
    throw UsageError(message.str());
  }

  if (failure.kind == Kind::kAbandoned) {
    // No look into the store for the missing ranks: the cause is known, and the store may be out of
    // reach (a cut link).
    message << " abandoned after " << seconds_text(Clock::now() - work.started) << ": "
            << failure.cause << ".";
    group.record_failure(message.str());
    throw PeerLostError(message.str());
  }
  const bool timed_out = failure.kind == Kind::kTimeout;
  if (timed_out) {
    message << " timed out after " << seconds_text(work.timeout);
  } else {
    message << " failed after " << seconds_text(Clock::now() - work.started) << " ("
            << failure.cause << ")";
  }
  if (peer_to_peer) {
    message << "; rank " << group.global_ranks[work.peer] << " did not post the matching "
            << (std::string(work.op) == "send" ? "recv" : "send") << " (tag " << work.tag << ").";
  } else {
    // A peer the transport saw exit needs no waiting for the others' posts: it is the cause.
    const bool dead_peer_known = failure.kind == Kind::kPeerLost && failure.late_rank >= 0;
    std::string missing = group.progress->describe_missing(
        work.seq, group.global_ranks, !dead_peer_known && group.wait_for_peer_posts);
    if (failure.late_rank >= 0 && missing.rfind("every rank reached it", 0) == 0) {
      // Queued asynchronous operations: every rank issued it, but rank `late_rank` never got to run
      // it.
      missing = "rank " + std::to_string(group.global_ranks[failure.late_rank]) +
                " issued it but never arrived in the shared-memory exchange";
    }
    message << "; " << missing << ".";
  }
  message << (timed_out ? " Likely cause: a rank took a different code path, is stuck or died"
                        : " Likely cause: a peer died or its connection was cut");
  message << ". Set DTRAIN_DEBUG=detail to log every collective.";
  group.record_failure(message.str());
  if (timed_out) throw TimeoutError(message.str());
  throw PeerLostError(message.str());
}

}  // namespace

GroupState::GroupState() = default;

GroupState::~GroupState() {
  progress.reset();
#ifdef DTRAIN_WITH_CUDA
  // ProcessGroupNCCL's destructor aborts its communicators itself, but first warns, on every
  // program's exit, that destroy_process_group() was not called. Aborting it here does what the
  // destructor would, without the warning; PyTorch's graceful shutdown() would flush operations
  // still queued instead, and hang on one whose peer never comes. A failed group is left to the OS
  // below, and so is one that abort_nccl() aborted after a failure: destroying it joins c10d's
  // watchdog threads, which may still be handling that failure (not run on a GPU), and the
  // release threads that destroy old generations are joined at exit. The cost: one backend and
  // its threads per recovery, bounded by max_recoveries.
  if (nccl_aborted) (void)nccl.release();
  if (nccl && failure.empty()) {
    try {
      nccl->abort();
    } catch (const std::exception& e) {
      DTRAIN_LOG(kWarn, "aborting NCCL of " << group_label() << ": " << e.what());
    }
  }
#endif
  if (!failure.empty()) {
    // After a timeout a Gloo worker thread may still be blocked inside the transport, and the
    // backend's destructor would join it, stalling exit for another full timeout. The process is
    // going down with an error anyway: leave the backend to the OS.
    (void)gloo.release();
#ifdef DTRAIN_WITH_CUDA
    (void)nccl.release();
#endif
  }
}

std::string GroupState::who() const { return rank_text(global_ranks[rank], world_size); }

std::string GroupState::group_label() const { return "group '" + name + "'"; }

void GroupState::record_failure(const std::string& message) {
  std::lock_guard<std::mutex> lock(failure_mutex);
  if (failure.empty()) failure = message;
}

void GroupState::abort_nccl() {
#ifdef DTRAIN_WITH_CUDA
  if (!nccl) return;
  nccl_aborted = true;
  nccl->abort();
#endif
}

void GroupState::check_usable() {
  std::lock_guard<std::mutex> lock(failure_mutex);
  if (!failure.empty()) {
    throw CommError(who() + ": " + group_label() +
                    " cannot be used after an earlier failure: " + failure);
  }
}

std::unique_ptr<InFlight> c10d_in_flight(c10::intrusive_ptr<c10d::Work> work, bool nccl) {
  return std::make_unique<C10dInFlight>(std::move(work), nccl);
}

std::unique_ptr<InFlight> shm_collective_in_flight(std::shared_future<void> done) {
  return std::make_unique<ShmCollectiveInFlight>(std::move(done));
}

std::unique_ptr<InFlight> shm_message_in_flight(ShmPointToPoint& transport,
                                                std::shared_ptr<ShmMessage> message) {
  return std::make_unique<ShmMessageInFlight>(transport, std::move(message));
}

std::shared_ptr<WorkState> start_work(const std::shared_ptr<GroupState>& group_ptr, const char* op,
                                      bool collective, int peer, const CollectiveOptions& options,
                                      uint64_t bytes,
                                      const std::function<void(WorkState&)>& launch) {
  GroupState& group = *group_ptr;
  group.check_usable();
  auto work = std::make_shared<WorkState>();
  work->started = Clock::now();
  group.stat_ops.fetch_add(1, std::memory_order_relaxed);
  group.stat_bytes.fetch_add(bytes, std::memory_order_relaxed);
  work->group = group_ptr;
  work->op = op;
  work->peer = peer;
  work->timeout = options.timeout.count() > 0 ? options.timeout : group.timeout;
  if (collective) work->seq = group.progress->begin(op);
  if (log::detail()) {
    DTRAIN_LOG(kDebug, op << (collective ? " #" + std::to_string(work->seq) : "") << " on "
                          << group.group_label());
  }
  try {
    launch(*work);
  } catch (const UsageError&) {
    throw;
  } catch (const c10::Error& e) {
    fail(*work, from_c10d(e.what_without_backtrace(), work->started, work->timeout));
  }
  return work;
}

void wait_for(WorkState& work) {
  if (work.done) return;
  try {
    // Collectives only: Gloo's send and recv (SendWork, RecvWork) treat a wait that times out as
    // the end of the whole context, so their waits are never cut into slices. (NCCL's collectives
    // are polled instead: Note [Waiting for NCCL].)
    const bool sliceable = work.seq != 0 && work.group->abandon_check;
    std::function<std::string()> abandon;
    if (sliceable) abandon = [&work] { return work.group->abandon_check(work.started); };
    work.in_flight->wait(work.started, work.timeout, abandon);
  } catch (const TransportFailure& failure) {
    fail(work, failure);
  }
  work.done = true;
  if (!work.in_flight->timed_by_transport()) {
    work.group->stat_busy_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - work.started).count(),
        std::memory_order_relaxed);
  }
  if (work.finish) work.finish();
}

}  // namespace dtrain::detail

namespace dtrain {

void Work::wait() {
  if (!state_)
    throw UsageError("Work::wait() on an empty Work (default-constructed or moved from)");
  detail::wait_for(*state_);
}

bool Work::is_completed() const {
  if (!state_ || state_->done) return true;
  return state_->in_flight->finished();
}

}  // namespace dtrain
