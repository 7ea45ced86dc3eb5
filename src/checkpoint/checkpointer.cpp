// dtrain::Checkpointer: turning a TrainingState into a checkpoint payload and back, the background
// writer of asynchronous saves, and the load that rank 0 broadcasts (see dtrain/checkpoint.h).
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>

#include "checkpoint/checkpoint_file.h"
#include "checkpoint/state_parts.h"
#include "common/format.h"
#include "common/log.h"
#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/data.h"

namespace dtrain {
namespace {

// Bumped when the payload's layout changes incompatibly.
constexpr int64_t kPayloadFormat = 1;

// The GradScaler's state lies among the values, as "grad_scaler.scale", ... (where checkpoints of
// GradScaler::save_to, before TrainingState::grad_scaler, put it: they load as they did).
const std::string kScalerKey = "grad_scaler";

// The state as it is written: tensors detached from the model (copies in asynchronous mode, so the
// training loop may change the originals), everything else by value.
struct Snapshot {
  std::vector<std::pair<std::string, at::Tensor>> model;
  // The optimizer: a deep copy to serialize later (LibTorch's own optimizers, asynchronous mode),
  // or the optimizer itself (synchronous mode), or its archive already serialized (other
  // optimizers, asynchronous mode).
  std::unique_ptr<torch::optim::Optimizer> optimizer_copy;
  const torch::optim::Optimizer* optimizer = nullptr;
  std::string optimizer_bytes;
  bool has_sampler = false;
  SamplerState sampler;
  int64_t step = 0;
  at::Tensor rng;  // undefined: not saved
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> values;
};

at::Tensor copy_of(const at::Tensor& t) { return t.defined() ? t.detach().clone() : t; }

// Note [Copying an optimizer]: LibTorch's optimizers expose their state only through their
// archive, and serializing that archive (OutputArchive::save_to, a TorchScript export) takes
// 10-20 ms for the trainer's MLP, too long to hold the training loop for. So for the optimizers
// LibTorch ships, an asynchronous save builds a shadow optimizer of the same type: the same
// parameter groups (only their identities are serialized, not their values) and a copy of every
// parameter's state with its tensors cloned; the background thread serializes the shadow. Other
// optimizers (LBFGS, the user's own) are serialized on the caller's thread.
template <typename Optimizer, typename ParamState, typename Options>
std::unique_ptr<torch::optim::Optimizer> shadow_copy(
    const torch::optim::Optimizer& live, const std::function<void(ParamState&)>& clone_tensors) {
  auto* typed = dynamic_cast<const Optimizer*>(&live);
  if (typed == nullptr) return nullptr;
  auto shadow = std::make_unique<Optimizer>(typed->param_groups(),
                                            static_cast<const Options&>(typed->defaults()));
  for (const auto& [key, state] : typed->state()) {
    auto copy = state->clone();
    clone_tensors(static_cast<ParamState&>(*copy));
    shadow->state()[key] = std::move(copy);
  }
  return shadow;
}

std::unique_ptr<torch::optim::Optimizer> copy_optimizer(const torch::optim::Optimizer& live) {
  namespace optim = torch::optim;
  // Adam and AdamW keep the same moments under the same names.
  auto copy_adam_moments = [](auto& s) {
    s.exp_avg(copy_of(s.exp_avg()));
    s.exp_avg_sq(copy_of(s.exp_avg_sq()));
    s.max_exp_avg_sq(copy_of(s.max_exp_avg_sq()));
  };
  if (auto copy = shadow_copy<optim::SGD, optim::SGDParamState, optim::SGDOptions>(
          live, [](auto& s) { s.momentum_buffer(copy_of(s.momentum_buffer())); }))
    return copy;
  if (auto copy = shadow_copy<optim::Adam, optim::AdamParamState, optim::AdamOptions>(
          live, copy_adam_moments))
    return copy;
  if (auto copy = shadow_copy<optim::AdamW, optim::AdamWParamState, optim::AdamWOptions>(
          live, copy_adam_moments))
    return copy;
  if (auto copy = shadow_copy<optim::Adagrad, optim::AdagradParamState, optim::AdagradOptions>(
          live, [](auto& s) { s.sum(copy_of(s.sum())); }))
    return copy;
  if (auto copy = shadow_copy<optim::RMSprop, optim::RMSpropParamState, optim::RMSpropOptions>(
          live, [](auto& s) {
            s.square_avg(copy_of(s.square_avg()));
            s.momentum_buffer(copy_of(s.momentum_buffer()));
            s.grad_avg(copy_of(s.grad_avg()));
          }))
    return copy;
  return nullptr;
}

std::string serialize_optimizer(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

Snapshot take_snapshot(const TrainingState& state, bool copy) {
  torch::NoGradGuard no_grad;
  // A copy lands on the CPU: the background writer then never touches a device the training loop
  // is using, and the training loop may overwrite the original as soon as save() returns.
  auto keep = [copy](const at::Tensor& t) {
    return copy ? t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true) : t.detach();
  };
  Snapshot snapshot;
  if (state.model) {
    for (auto& [name, tensor] : detail::model_tensors(*state.model))
      snapshot.model.emplace_back(name, keep(tensor));
  }
  if (state.optimizer && !copy) {
    snapshot.optimizer = state.optimizer;
  } else if (state.optimizer) {
    snapshot.optimizer_copy = copy_optimizer(*state.optimizer);  // Note [Copying an optimizer]
    if (!snapshot.optimizer_copy) snapshot.optimizer_bytes = serialize_optimizer(*state.optimizer);
  }
  if (state.sampler) {
    snapshot.has_sampler = true;
    snapshot.sampler = state.sampler->state();
  }
  snapshot.step = state.step;
  if (state.rng) snapshot.rng = detail::cpu_rng_state();
  for (const auto& [name, tensor] : state.tensors) {
    TORCH_CHECK(tensor.defined(), "checkpoint: TrainingState::tensors['", name, "'] is undefined");
    snapshot.tensors[name] = keep(tensor);
  }
  snapshot.values = state.values;
  if (state.grad_scaler && state.grad_scaler->is_enabled()) {
    amp::GradScalerState s = state.grad_scaler->state_dict();
    auto exact = [](double value) {  // %.17g reads back as the same double
      char text[40];
      std::snprintf(text, sizeof text, "%.17g", value);
      return std::string(text);
    };
    snapshot.values[kScalerKey + ".scale"] = exact(s.scale);
    snapshot.values[kScalerKey + ".growth_factor"] = exact(s.growth_factor);
    snapshot.values[kScalerKey + ".backoff_factor"] = exact(s.backoff_factor);
    snapshot.values[kScalerKey + ".growth_interval"] = std::to_string(s.growth_interval);
    snapshot.values[kScalerKey + ".growth_tracker"] = std::to_string(s.growth_tracker);
  }
  return snapshot;
}

// The GradScaler's state from a checkpoint's values; nullopt when it holds none (saved without a
// scaler, or with a disabled one).
std::optional<amp::GradScalerState> saved_scaler(
    const c10::Dict<std::string, std::string>& values,
    const std::function<UsageError(const std::string&)>& unusable) {
  const char* const fields[] = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                                "growth_tracker"};
  int present = 0;
  for (const char* field : fields) present += values.contains(kScalerKey + "." + field) ? 1 : 0;
  if (present == 0) return std::nullopt;
  auto number = [&](const char* field) {
    const std::string name = kScalerKey + "." + field;
    if (!values.contains(name)) {
      throw unusable("holds part of a GradScaler's state but no '" + name +
                     "' value; it was not written by a dtrain Checkpointer");
    }
    const std::string text = values.at(name);
    char* end = nullptr;
    errno = 0;
    double value = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || errno == ERANGE) {
      throw unusable("its GradScaler value '" + name + "' is '" + text + "', not a number");
    }
    return value;
  };
  amp::GradScalerState loaded;
  loaded.scale = number("scale");
  loaded.growth_factor = number("growth_factor");
  loaded.backoff_factor = number("backoff_factor");
  loaded.growth_interval = static_cast<int64_t>(number("growth_interval"));
  loaded.growth_tracker = static_cast<int64_t>(number("growth_tracker"));
  return loaded;
}

at::Tensor bytes_tensor(const std::string& bytes) {
  at::Tensor t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string tensor_bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel()));
}

std::vector<char> encode(const Snapshot& snapshot) {
  c10::Dict<std::string, at::Tensor> model;
  for (const auto& [name, tensor] : snapshot.model) model.insert(name, tensor.cpu());
  c10::Dict<std::string, at::Tensor> tensors;
  for (const auto& [name, tensor] : snapshot.tensors) tensors.insert(name, tensor.cpu());
  c10::Dict<std::string, std::string> values;
  for (const auto& [key, value] : snapshot.values) values.insert(key, value);

  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  root.insert("format", kPayloadFormat);
  root.insert("step", snapshot.step);
  root.insert("model", model);
  const torch::optim::Optimizer* optimizer =
      snapshot.optimizer_copy ? snapshot.optimizer_copy.get() : snapshot.optimizer;
  std::string optimizer_bytes =
      optimizer ? serialize_optimizer(*optimizer) : snapshot.optimizer_bytes;
  root.insert("has_optimizer", !optimizer_bytes.empty());
  root.insert("optimizer", bytes_tensor(optimizer_bytes));
  root.insert("has_sampler", snapshot.has_sampler);
  root.insert("sampler",
              torch::tensor({snapshot.sampler.epoch, snapshot.sampler.samples_consumed}));
  root.insert("has_rng", snapshot.rng.defined());
  root.insert("rng", snapshot.rng.defined() ? snapshot.rng : torch::empty({0}, torch::kUInt8));
  root.insert("tensors", tensors);
  root.insert("values", values);
  return torch::jit::pickle_save(root);
}

std::string shape_text(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

// Fills state from a payload that passed its checksum. Checks everything the model and sampler
// will take before changing any of them, so a checkpoint that does not fit leaves the model as it
// was.
void apply(const std::vector<char>& payload, const std::string& path, TrainingState& state) {
  auto unusable = [&](const std::string& why) {
    return UsageError("checkpoint " + path + ": " + why);
  };
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  try {
    root = torch::jit::pickle_load(payload).toGenericDict();
  } catch (const std::exception& e) {
    throw unusable(
        "its checksum holds but its contents cannot be decoded (written by another dtrain "
        "version?); move it aside to resume from an older one");
  }
  auto entry = [&](const std::string& key) {
    auto it = root.find(key);
    if (it == root.end()) {
      throw unusable("has no '" + key +
                     "' entry (written by another dtrain version?); move it aside to resume "
                     "from an older one");
    }
    return it->value();
  };
  if (entry("format").toInt() != kPayloadFormat) {
    throw unusable("is in format " + std::to_string(entry("format").toInt()) +
                   ", this dtrain reads format " + std::to_string(kPayloadFormat) +
                   "; load it with the dtrain that wrote it");
  }

  std::vector<std::pair<at::Tensor, at::Tensor>> model_copies;  // (destination, saved)
  if (state.model) {
    auto saved = c10::impl::toTypedDict<std::string, at::Tensor>(entry("model").toGenericDict());
    auto mine = detail::model_tensors(*state.model);
    for (const auto& [name, tensor] : mine) {
      auto it = saved.find(name);
      if (it == saved.end()) {
        throw unusable("has no tensor '" + name + "' of the model (of shape " + shape_text(tensor) +
                       "); it was saved from another model: load it into the model that saved it");
      }
      if (!it->value().sizes().equals(tensor.sizes())) {
        throw unusable("holds '" + name + "' of shape " + shape_text(it->value()) +
                       " but the model's is " + shape_text(tensor) +
                       "; it was saved from another model: load it into the model that saved it");
      }
      model_copies.emplace_back(tensor, it->value());
    }
    if (saved.size() != mine.size()) {
      for (const auto& item : saved) {
        bool known = std::any_of(mine.begin(), mine.end(),
                                 [&](const auto& m) { return m.first == item.key(); });
        if (!known) {
          throw unusable("holds '" + item.key() +
                         "', which the model does not have; it was saved from another model: "
                         "load it into the model that saved it");
        }
      }
    }
  }
  SamplerState sampler_state;
  if (state.sampler) {
    if (!entry("has_sampler").toBool()) {
      throw unusable("holds no sampler position; it was saved without TrainingState::sampler");
    }
    at::Tensor position = entry("sampler").toTensor();
    sampler_state = {position[0].item<int64_t>(), position[1].item<int64_t>()};
    if (sampler_state.epoch < 0 || sampler_state.samples_consumed < 0 ||
        sampler_state.samples_consumed > state.sampler->dataset_size()) {
      throw unusable("its sampler position (epoch " + std::to_string(sampler_state.epoch) + ", " +
                     std::to_string(sampler_state.samples_consumed) +
                     " samples consumed) does not fit a dataset of " +
                     std::to_string(state.sampler->dataset_size()) +
                     " samples; resume it with the dataset it was saved with");
    }
  }
  if (state.optimizer) {
    if (!entry("has_optimizer").toBool()) {
      throw unusable("holds no optimizer state; it was saved without TrainingState::optimizer");
    }
    std::string bytes = tensor_bytes(entry("optimizer").toTensor());
    try {
      torch::serialize::InputArchive archive;
      archive.load_from(bytes.data(), bytes.size());
      state.optimizer->load(archive);
    } catch (const c10::Error& e) {
      throw unusable(std::string("its optimizer state does not fit this optimizer (") +
                     e.what_without_backtrace() +
                     "); resume with the optimizer and parameters that saved it");
    }
  }
  auto values = c10::impl::toTypedDict<std::string, std::string>(entry("values").toGenericDict());
  if (state.grad_scaler && state.grad_scaler->is_enabled()) {
    // Before the model: a bad entry (the scaler checks before it changes) leaves everything as it
    // was.
    if (auto scaler = saved_scaler(values, unusable)) state.grad_scaler->load_state_dict(*scaler);
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& [destination, saved] : model_copies) destination.copy_(saved);
  }
  if (state.sampler) state.sampler->load_state(sampler_state);
  if (state.rng && entry("has_rng").toBool()) detail::set_cpu_rng_state(entry("rng").toTensor());
  state.step = entry("step").toInt();
  state.tensors.clear();
  for (const auto& item :
       c10::impl::toTypedDict<std::string, at::Tensor>(entry("tensors").toGenericDict())) {
    state.tensors[item.key()] = item.value();
  }
  state.values.clear();
  for (const auto& item : values) state.values[item.key()] = item.value();
}

}  // namespace

struct Checkpointer::Impl {
  // The asynchronous save in flight, and how it ended.
  std::thread writer;
  std::exception_ptr failure;
};

Checkpointer::Checkpointer(CheckpointOptions options, std::shared_ptr<ProcessGroup> group)
    : options_(std::move(options)), group_(std::move(group)), impl_(std::make_unique<Impl>()) {
  if (options_.dir.empty()) {
    throw UsageError("dtrain::Checkpointer: CheckpointOptions::dir is empty; name a folder");
  }
  if (options_.keep_last < 1) {
    throw UsageError("dtrain::Checkpointer: CheckpointOptions::keep_last is " +
                     std::to_string(options_.keep_last) + "; keep at least 1 checkpoint");
  }
  if (options_.prefix.empty() || options_.prefix.find('/') != std::string::npos) {
    throw UsageError("dtrain::Checkpointer: CheckpointOptions::prefix '" + options_.prefix +
                     "' must be a non-empty file name without '/'");
  }
}

Checkpointer::~Checkpointer() {
  try {
    wait();
  } catch (const std::exception& e) {
    DTRAIN_LOG(kError, "checkpoint: the last asynchronous save failed: " << e.what());
  } catch (...) {
    DTRAIN_LOG(kError, "checkpoint: the last asynchronous save failed");
  }
}

void Checkpointer::wait() {
  if (impl_->writer.joinable()) impl_->writer.join();
  if (impl_->failure) {
    std::exception_ptr failure = impl_->failure;
    impl_->failure = nullptr;
    std::rethrow_exception(failure);
  }
}

std::string Checkpointer::save(const TrainingState& state) {
  wait();
  std::string path = detail::checkpoint_path(options_.dir, options_.prefix, state.step);
  auto write = [path, options = options_, step = state.step](const Snapshot& snapshot) {
    detail::write_checkpoint_file(path, encode(snapshot));
    detail::prune_checkpoint_files(options.dir, options.prefix, options.keep_last, step);
    DTRAIN_LOG(kDebug, "checkpoint: saved " << path);
  };
  if (!options_.async) {
    write(take_snapshot(state, /*copy=*/false));
    return path;
  }
  auto snapshot = std::make_shared<Snapshot>(take_snapshot(state, /*copy=*/true));
  impl_->writer = std::thread([this, snapshot, write, path] {
    try {
      write(*snapshot);
    } catch (const std::exception& e) {
      // Also reported at once: the next save or wait() may be far away.
      DTRAIN_LOG(kError, "checkpoint: asynchronous save of " << path << " failed: " << e.what());
      impl_->failure = std::current_exception();
    } catch (...) {
      impl_->failure = std::current_exception();
    }
  });
  return path;
}

std::vector<std::string> Checkpointer::list() const {
  std::vector<std::string> paths;
  for (const auto& file : detail::list_checkpoint_files(options_.dir, options_.prefix))
    paths.push_back(file.path);
  return paths;
}

namespace {

// The newest intact checkpoint of the folder: its path and payload, or an empty path when there is
// none. Newer damaged files are named in a warning and in *skipped.
std::string find_latest(const CheckpointOptions& options, std::vector<char>* payload,
                        std::vector<std::string>* skipped) {
  auto files = detail::list_checkpoint_files(options.dir, options.prefix);
  for (auto file = files.rbegin(); file != files.rend(); ++file) {
    std::string why;
    if (detail::read_checkpoint_file(file->path, payload, &why)) return file->path;
    DTRAIN_LOG(kWarn, "checkpoint " << file->path << " is damaged and skipped: " << why
                                    << "; trying the one before it (move the damaged file aside "
                                       "to silence this)");
    skipped->push_back(file->path);
  }
  payload->clear();
  return "";
}

}  // namespace

std::optional<LoadedCheckpoint> Checkpointer::load_latest(TrainingState& state) {
  ProcessGroup* group = group_.get();
  wait();  // a save in flight may be the newest checkpoint
  LoadedCheckpoint loaded;
  std::vector<char> payload;
  if (!group || group->size() == 1) {
    loaded.path = find_latest(options_, &payload, &loaded.skipped);
  } else {
    // Rank 0 reads; every rank gets {failed, text length, payload length} and then text + payload
    // as one byte tensor. The text is the path, or rank 0's error message when it failed: then
    // every rank fails with the same line and none is left waiting in a broadcast.
    std::string text;
    int64_t failed = 0;
    if (group->rank() == 0) {
      try {
        text = loaded.path = find_latest(options_, &payload, &loaded.skipped);
      } catch (const std::exception& e) {
        text = e.what();
        failed = 1;
        payload.clear();
      }
    }
    at::Tensor sizes = torch::tensor(
        {failed, static_cast<int64_t>(text.size()), static_cast<int64_t>(payload.size())});
    group->broadcast(sizes, 0);
    failed = sizes[0].item<int64_t>();
    const int64_t text_size = sizes[1].item<int64_t>(), payload_size = sizes[2].item<int64_t>();
    at::Tensor bytes = torch::empty({text_size + payload_size}, torch::kUInt8);
    if (group->rank() == 0) {
      char* out = static_cast<char*>(bytes.data_ptr());
      std::memcpy(out, text.data(), text.size());
      if (!payload.empty()) std::memcpy(out + text.size(), payload.data(), payload.size());
    }
    if (bytes.numel() > 0) group->broadcast(bytes, 0);
    if (group->rank() != 0) {
      const char* in = static_cast<const char*>(bytes.data_ptr());
      text.assign(in, static_cast<std::size_t>(text_size));
      payload.assign(in + text_size, in + text_size + payload_size);
      if (!failed) loaded.path = text;
    }
    if (failed) {
      throw UsageError(detail::rank_text(*group) + ": checkpoint load: rank 0 could not read " +
                       options_.dir + ": " + text);
    }
  }
  if (loaded.path.empty()) return std::nullopt;
  apply(payload, loaded.path, state);
  loaded.step = state.step;
  return loaded;
}

}  // namespace dtrain
