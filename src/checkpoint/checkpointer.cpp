// dtrain::Checkpointer: turning a TrainingState into a checkpoint payload and back, the background
// writer of asynchronous saves, and the load that rank 0 broadcasts (see dtrain/checkpoint.h).
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
#include "checkpoint/optimizer_state.h"
#include "checkpoint/state_parts.h"
#include "checkpoint/torch_archive.h"
#include "common/format.h"
#include "common/log.h"
#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm.h"
#include "dtrain/data.h"

namespace dtrain {
namespace {

// Bumped when the payload's layout changes incompatibly. 1: a framed file (the 24-byte header of
// checkpoint_file.h before a TorchScript pickle; read still). 2: a torch.save file of plain state
// dicts (Note [Checkpoint file]).
constexpr int64_t kPayloadFormat = 2;

using Dict = c10::impl::GenericDict;

Dict new_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }

// The state as it is written: tensors detached from the model (copies on the CPU in asynchronous
// mode, so the training loop may change the originals), everything else by value.
struct Snapshot {
  std::vector<std::pair<std::string, at::Tensor>> model;
  // The optimizer in Python's form (optimizer_state.h), or for an optimizer that has none (LBFGS,
  // the caller's own) its LibTorch archive: serialized here, on the caller's thread.
  std::optional<c10::IValue> optimizer;
  std::string optimizer_class;  // Python's name of it
  std::string optimizer_archive;
  std::optional<SamplerState> sampler;
  int64_t step = 0;
  at::Tensor rng;  // undefined: not saved
  std::optional<amp::GradScalerState> grad_scaler;
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> values;
};

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
  if (state.optimizer) {
    snapshot.optimizer = detail::python_optimizer_state(*state.optimizer, copy);
    snapshot.optimizer_class = detail::python_optimizer_class(*state.optimizer);
    if (!snapshot.optimizer) snapshot.optimizer_archive = serialize_optimizer(*state.optimizer);
  }
  if (state.sampler) snapshot.sampler = state.sampler->state();
  snapshot.step = state.step;
  if (state.rng) snapshot.rng = detail::cpu_rng_state();
  if (state.grad_scaler && state.grad_scaler->is_enabled()) {
    snapshot.grad_scaler = state.grad_scaler->state_dict();
  }
  for (const auto& [name, tensor] : state.tensors) {
    TORCH_CHECK(tensor.defined(), "checkpoint: TrainingState::tensors['", name, "'] is undefined");
    snapshot.tensors[name] = keep(tensor);
  }
  snapshot.values = state.values;
  return snapshot;
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

// Note [Checkpoint file] has the layout; each entry is what Python's own object would save
// (state_dict() of the model, optimizer and GradScaler, torch.get_rng_state()).
std::vector<char> encode(const Snapshot& snapshot) {
  Dict root = new_dict();
  root.insert("format", kPayloadFormat);
  root.insert("step", snapshot.step);
  Dict model = new_dict();
  for (const auto& [name, tensor] : snapshot.model) model.insert(name, tensor.cpu());
  root.insert("model", model);
  if (snapshot.optimizer) {
    root.insert("optimizer", *snapshot.optimizer);
    // Python's state dict does not say whose it is; this does, for a clear refusal at load.
    root.insert("optimizer_class", snapshot.optimizer_class);
  }
  if (!snapshot.optimizer_archive.empty()) {
    root.insert("optimizer_archive", bytes_tensor(snapshot.optimizer_archive));
  }
  if (snapshot.sampler) {
    Dict sampler = new_dict();
    sampler.insert("epoch", snapshot.sampler->epoch);
    sampler.insert("samples_consumed", snapshot.sampler->samples_consumed);
    root.insert("sampler", sampler);
  }
  if (snapshot.rng.defined()) root.insert("rng", snapshot.rng);
  if (snapshot.grad_scaler) {
    Dict scaler = new_dict();  // GradScaler.state_dict()'s keys
    scaler.insert("scale", snapshot.grad_scaler->scale);
    scaler.insert("growth_factor", snapshot.grad_scaler->growth_factor);
    scaler.insert("backoff_factor", snapshot.grad_scaler->backoff_factor);
    scaler.insert("growth_interval", snapshot.grad_scaler->growth_interval);
    scaler.insert("_growth_tracker", snapshot.grad_scaler->growth_tracker);
    root.insert("grad_scaler", scaler);
  }
  Dict tensors = new_dict();
  for (const auto& [name, tensor] : snapshot.tensors) tensors.insert(name, tensor.cpu());
  root.insert("tensors", tensors);
  Dict values = new_dict();
  for (const auto& [key, value] : snapshot.values) values.insert(key, value);
  root.insert("values", values);
  return detail::save_torch_archive(root);
}

std::string shape_text(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

using Unusable = std::function<UsageError(const std::string&)>;

// A format-1 payload in format 2's layout: "has_*" flags become absent entries, the sampler
// position a dict, the optimizer's LibTorch archive "optimizer_archive"; the GradScaler stays
// among the values, where format 1 kept it.
Dict from_format_1(const Dict& old) {
  Dict root = new_dict();
  for (const char* key : {"step", "model", "tensors", "values"}) {
    if (old.contains(key)) root.insert(key, old.at(key));
  }
  auto has = [&](const char* key) { return old.contains(key) && old.at(key).toBool(); };
  if (has("has_optimizer")) root.insert("optimizer_archive", old.at("optimizer"));
  if (has("has_sampler")) {
    at::Tensor position = old.at("sampler").toTensor();
    Dict sampler = new_dict();
    sampler.insert("epoch", position[0].item<int64_t>());
    sampler.insert("samples_consumed", position[1].item<int64_t>());
    root.insert("sampler", sampler);
  }
  if (has("has_rng")) root.insert("rng", old.at("rng"));
  return root;
}

// The GradScaler's state under values' "grad_scaler.*" (format 1, and GradScaler::save_to before
// TrainingState::grad_scaler); nullopt when it holds none.
std::optional<amp::GradScalerState> scaler_among_values(
    const std::map<std::string, std::string>& values, const Unusable& unusable) {
  const std::string prefix = "grad_scaler.";
  const char* const fields[] = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                                "growth_tracker"};
  int present = 0;
  for (const char* field : fields) present += values.count(prefix + field) ? 1 : 0;
  if (present == 0) return std::nullopt;
  auto number = [&](const char* field) {
    const std::string name = prefix + field;
    auto it = values.find(name);
    if (it == values.end()) {
      throw unusable("holds part of a GradScaler's state but no '" + name +
                     "' value; it was not written by a dtrain Checkpointer");
    }
    char* end = nullptr;
    errno = 0;
    double value = std::strtod(it->second.c_str(), &end);
    if (it->second.empty() || *end != '\0' || errno == ERANGE) {
      throw unusable("its GradScaler value '" + name + "' is '" + it->second + "', not a number");
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

// A number of a dict a checkpoint holds (Python may have written 2 for 2.0, or a 0-d tensor).
double number_in(const Dict& dict, const std::string& key, const std::string& where,
                 const Unusable& unusable) {
  auto it = dict.find(key);
  if (it == dict.end()) throw unusable("its " + where + " has no '" + key + "'");
  const c10::IValue& v = it->value();
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().item<double>();
  throw unusable("its " + where + "'s '" + key + "' is " + v.tagKind() + ", not a number");
}

// A dict of string keys (an entry of the root) as (key, value) pairs; throws when it is not one.
std::vector<std::pair<std::string, c10::IValue>> items_of(const c10::IValue& value,
                                                          const std::string& what,
                                                          const Unusable& unusable) {
  if (!value.isGenericDict()) throw unusable("its '" + what + "' entry is not a dict");
  std::vector<std::pair<std::string, c10::IValue>> items;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString()) throw unusable("its '" + what + "' has a key that is no string");
    items.emplace_back(item.key().toStringRef(), item.value());
  }
  return items;
}

// Fills state from a checkpoint's bytes (a torch.save file, or format 1's payload, which is one
// too) that passed their check. Checks everything before
// changing anything, so a checkpoint that does not fit leaves the state as it was. file_step
// stands in for a step the file does not hold (one Python wrote).
void apply(const std::vector<char>& bytes, const std::string& path, int64_t file_step,
           TrainingState& state) {
  Unusable unusable = [&](const std::string& why) {
    return UsageError("checkpoint " + path + ": " + why);
  };
  Dict root = new_dict();
  try {
    c10::IValue value = detail::load_torch_archive(bytes);
    if (!value.isGenericDict()) throw std::runtime_error("not a dict");
    root = value.toGenericDict();
  } catch (const std::exception& e) {
    const c10::Error* error = dynamic_cast<const c10::Error*>(&e);
    std::string cause = error ? error->what_without_backtrace() : e.what();
    cause = cause.substr(0, cause.find('\n'));
    throw unusable(
        "its checksum holds but its contents cannot be decoded as a dict of state dicts (" + cause +
        "); move it aside to resume from an older one");
  }
  if (root.contains("format")) {
    const c10::IValue& format = root.at("format");
    if (format.isInt() && format.toInt() == 1) {
      root = from_format_1(root);
    } else if (!format.isInt() || format.toInt() != kPayloadFormat) {
      throw unusable("is in format " + c10::str(format) + ", this dtrain reads formats 1 and " +
                     std::to_string(kPayloadFormat) + "; load it with the dtrain that wrote it");
    }
  }
  auto entry = [&](const std::string& key, const std::string& missing) {
    auto it = root.find(key);
    if (it == root.end()) throw unusable("has no '" + key + "' entry; " + missing);
    return it->value();
  };

  std::vector<std::pair<at::Tensor, at::Tensor>> model_copies;  // (destination, saved)
  if (state.model) {
    auto saved = items_of(entry("model", "it was saved without a model"), "model", unusable);
    std::map<std::string, at::Tensor> by_name;
    for (auto& [name, value] : saved) {
      if (!value.isTensor()) throw unusable("its model entry '" + name + "' is not a tensor");
      by_name[name] = value.toTensor();
    }
    auto mine = detail::model_tensors(*state.model);
    for (const auto& [name, tensor] : mine) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        throw unusable("has no tensor '" + name + "' of the model (of shape " + shape_text(tensor) +
                       "); it was saved from another model: load it into the model that saved it");
      }
      if (!it->second.sizes().equals(tensor.sizes())) {
        throw unusable("holds '" + name + "' of shape " + shape_text(it->second) +
                       " but the model's is " + shape_text(tensor) +
                       "; it was saved from another model: load it into the model that saved it");
      }
      model_copies.emplace_back(tensor, it->second);
      by_name.erase(it);
    }
    if (!by_name.empty()) {
      throw unusable("holds '" + by_name.begin()->first +
                     "', which the model does not have; it was saved from another model: load "
                     "it into the model that saved it");
    }
  }
  SamplerState sampler_state;
  if (state.sampler) {
    c10::IValue sampler = entry("sampler", "it was saved without TrainingState::sampler");
    if (!sampler.isGenericDict()) throw unusable("its 'sampler' entry is not a dict");
    const Dict position = sampler.toGenericDict();
    sampler_state = {
        static_cast<int64_t>(number_in(position, "epoch", "sampler", unusable)),
        static_cast<int64_t>(number_in(position, "samples_consumed", "sampler", unusable))};
    if (sampler_state.epoch < 0 || sampler_state.samples_consumed < 0 ||
        sampler_state.samples_consumed > state.sampler->dataset_size()) {
      throw unusable("its sampler position (epoch " + std::to_string(sampler_state.epoch) + ", " +
                     std::to_string(sampler_state.samples_consumed) +
                     " samples consumed) does not fit a dataset of " +
                     std::to_string(state.sampler->dataset_size()) +
                     " samples; resume it with the dataset it was saved with");
    }
  }
  std::map<std::string, std::string> values;
  if (root.contains("values")) {
    for (auto& [key, value] : items_of(root.at("values"), "values", unusable)) {
      if (!value.isString()) throw unusable("its value '" + key + "' is not a string");
      values[key] = value.toStringRef();
    }
  }
  std::map<std::string, at::Tensor> tensors;
  if (root.contains("tensors")) {
    for (auto& [name, value] : items_of(root.at("tensors"), "tensors", unusable)) {
      if (!value.isTensor()) throw unusable("its tensors entry '" + name + "' is not a tensor");
      tensors[name] = value.toTensor();
    }
  }
  std::optional<amp::GradScalerState> scaler;
  if (root.contains("grad_scaler")) {
    const c10::IValue& saved = root.at("grad_scaler");
    if (!saved.isGenericDict()) throw unusable("its 'grad_scaler' entry is not a dict");
    const Dict d = saved.toGenericDict();
    scaler = amp::GradScalerState{
        number_in(d, "scale", "grad_scaler", unusable),
        number_in(d, "growth_factor", "grad_scaler", unusable),
        number_in(d, "backoff_factor", "grad_scaler", unusable),
        static_cast<int64_t>(number_in(d, "growth_interval", "grad_scaler", unusable)),
        static_cast<int64_t>(number_in(d, "_growth_tracker", "grad_scaler", unusable))};
  } else {
    scaler = scaler_among_values(values, unusable);
  }
  c10::IValue step = root.contains("step") ? root.at("step") : c10::IValue(file_step);
  if (!step.isInt()) throw unusable("its 'step' entry is not an integer");
  at::Tensor rng;  // undefined: the generator stays as it is
  if (state.rng && root.contains("rng")) {
    const c10::IValue& saved = root.at("rng");
    if (!saved.isTensor())
      throw unusable("its 'rng' entry is " + saved.tagKind() + ", not a tensor");
    rng = saved.toTensor();
    try {
      detail::check_cpu_rng_state(rng);
    } catch (const c10::Error& e) {
      std::string cause = e.what_without_backtrace();
      throw unusable("its 'rng' entry is not a state of torch's CPU generator (" +
                     cause.substr(0, cause.find('\n')) +
                     "); save torch.get_rng_state() there, or load with TrainingState::rng false");
    }
  }

  // The optimizer and the scaler check what they take before they change; after them nothing can
  // fail.
  if (state.optimizer) {
    try {
      const std::string mine = detail::python_optimizer_class(*state.optimizer);
      if (root.contains("optimizer_class") && root.at("optimizer_class").isString() &&
          root.at("optimizer_class").toStringRef() != mine) {
        throw unusable("holds the state of " + root.at("optimizer_class").toStringRef() +
                       ", not of this " + (mine.empty() ? "optimizer" : mine) +
                       "; resume with the optimizer that saved it");
      }
      if (root.contains("optimizer")) {
        detail::load_python_optimizer_state(root.at("optimizer"), *state.optimizer);
      } else {
        std::string bytes = tensor_bytes(
            entry("optimizer_archive", "it was saved without TrainingState::optimizer").toTensor());
        torch::serialize::InputArchive archive;
        archive.load_from(bytes.data(), bytes.size());
        state.optimizer->load(archive);
      }
    } catch (const UsageError&) {
      throw;
    } catch (const c10::Error& e) {
      throw unusable(std::string("its optimizer state does not fit this optimizer (") +
                     e.what_without_backtrace() +
                     "); resume with the optimizer and parameters that saved it");
    } catch (const std::exception& e) {
      throw unusable(std::string("its optimizer state does not fit this optimizer (") + e.what() +
                     "); resume with the optimizer and parameters that saved it");
    }
  }
  if (state.grad_scaler && state.grad_scaler->is_enabled() && scaler) {
    state.grad_scaler->load_state_dict(*scaler);
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& [destination, saved] : model_copies) destination.copy_(saved);
  }
  if (state.sampler) state.sampler->load_state(sampler_state);
  if (rng.defined()) detail::set_cpu_rng_state(rng);
  state.step = step.toInt();
  state.tensors = std::move(tensors);
  state.values = std::move(values);
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
    detail::write_file_durably(path, encode(snapshot));
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

// The newest intact checkpoint of the folder: its file and bytes, or an empty path when there is
// none. Newer damaged files are named in a warning and in *skipped.
detail::CheckpointFile find_latest(const CheckpointOptions& options, std::vector<char>* bytes,
                                   std::vector<std::string>* skipped) {
  auto files = detail::list_checkpoint_files(options.dir, options.prefix);
  for (auto file = files.rbegin(); file != files.rend(); ++file) {
    std::string why;
    if (detail::read_replicated_checkpoint_file(file->path, bytes, &why)) return *file;
    DTRAIN_LOG(kWarn, "checkpoint " << file->path << " is damaged and skipped: " << why
                                    << "; trying the one before it (move the damaged file aside "
                                       "to silence this)");
    skipped->push_back(file->path);
  }
  bytes->clear();
  return {};
}

}  // namespace

std::optional<LoadedCheckpoint> Checkpointer::load_latest(TrainingState& state) {
  ProcessGroup* group = group_.get();
  wait();  // a save in flight may be the newest checkpoint
  LoadedCheckpoint loaded;
  std::vector<char> payload;
  int64_t file_step = 0;
  if (!group || group->size() == 1) {
    auto file = find_latest(options_, &payload, &loaded.skipped);
    loaded.path = file.path;
    file_step = file.step;
  } else {
    // Rank 0 reads; every rank gets {failed, text length, payload length, the file's step} and
    // then text + payload
    // as one byte tensor. The text is the path, or rank 0's error message when it failed: then
    // every rank fails with the same line and none is left waiting in a broadcast.
    std::string text;
    int64_t failed = 0;
    if (group->rank() == 0) {
      try {
        auto file = find_latest(options_, &payload, &loaded.skipped);
        text = loaded.path = file.path;
        file_step = file.step;
      } catch (const std::exception& e) {
        text = e.what();
        failed = 1;
        payload.clear();
      }
    }
    at::Tensor sizes = torch::tensor({failed, static_cast<int64_t>(text.size()),
                                      static_cast<int64_t>(payload.size()), file_step});
    group->broadcast(sizes, 0);
    failed = sizes[0].item<int64_t>();
    file_step = sizes[3].item<int64_t>();
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
  apply(payload, loaded.path, file_step, state);
  loaded.step = state.step;
  return loaded;
}

}  // namespace dtrain
