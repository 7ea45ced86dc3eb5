// What DistributedDataParallel and ShardedDataParallel share on the way from a module's parameters
// to gradients reduced over the ranks: the check that every rank has the same parameters, the
// assignment of parameters to buckets, and the hook that reports each gradient's arrival.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/compat.h"
#include "dtrain/comm.h"

namespace dtrain::detail {

// A parameter as the module names it (module->named_parameters()).
using NamedParameter = std::pair<std::string, at::Tensor>;

// Throws the same UsageError on every rank unless every rank of `group` has the same parameters:
// the same count, and the same name, shape and dtype at each position. The message names the first
// parameter that differs, what each differing rank has there, and the ranks; `what` names the
// wrapper in it ("DistributedDataParallel"). Collective: every rank calls it; two all-gathers, a
// third when the parameters differ. Blocks up to the group's timeout.
void check_same_parameters(ProcessGroup& group, const std::vector<NamedParameter>& parameters,
                           const std::string& what);

// Groups parameters into buckets of at most `bucket_cap_bytes` (`first_bucket_cap_bytes` for
// bucket 0), in reverse order, which approximates the order in which backward produces their
// gradients; a bucket holds one dtype and device. A parameter larger than the cap gets a bucket of
// its own. Returns, per bucket, the indices into `parameters` in the order they were added.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& parameters,
                                                int64_t first_bucket_cap_bytes,
                                                int64_t bucket_cap_bytes);

// Calls `on_ready` each time autograd's AccumulateGrad has written `parameter`'s gradient (from the
// thread running backward), until destroyed. Keeps the parameter's gradient accumulator alive:
// the hook lives on it.
class GradientReadyHook {
 public:
  GradientReadyHook(const at::Tensor& parameter, std::function<void()> on_ready);
  ~GradientReadyHook();
  GradientReadyHook(const GradientReadyHook&) = delete;
  GradientReadyHook& operator=(const GradientReadyHook&) = delete;

  // The parameter's gradient accumulator, for further hooks on it.
  const compat::GradAccumulatorPtr& accumulator() const { return accumulator_; }

 private:
  compat::GradAccumulatorPtr accumulator_;
  uintptr_t key_ = 0;
};

}  // namespace dtrain::detail
