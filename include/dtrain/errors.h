// dtrain's exceptions, keyed to what the caller can do about them:
//   UsageError    - the call, flag, variable or file is wrong: fix it and run again;
//   CommError     - a peer is late or gone (TimeoutError, PeerLostError): an elastic restart can
//                   retry;
//   InternalError - a broken invariant inside dtrain: a bug to report.
// Messages follow one shape: "rank R/N: <operation>: <what happened>. <likely cause>. <the fix>".
#pragma once

#include <functional>
#include <stdexcept>
#include <string>

namespace dtrain {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class UsageError : public Error {
 public:
  using Error::Error;
};

class CommError : public Error {
 public:
  using Error::Error;
};

// A blocking operation waited past its timeout.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// A peer process closed its connection or died mid-operation.
class PeerLostError : public CommError {
 public:
  using CommError::CommError;
};

class InternalError : public Error {
 public:
  using Error::Error;
};

// The body of a program's main(), with dtrain's exit-code convention: a UsageError prints its one
// line and returns 2 (fix the command and run again), any other exception prints its message and
// returns 1.
//   int main(int argc, char** argv) { return dtrain::run_main([&] { return train(argc, argv); }); }
int run_main(const std::function<int()>& body);

}  // namespace dtrain
