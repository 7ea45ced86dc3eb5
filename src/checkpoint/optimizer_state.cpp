// LibTorch optimizers' state as Python's optimizer.state_dict() (see optimizer_state.h).
//
// Python numbers the parameters 0, 1, ... through the groups in order and keeps, per parameter,
// the tensors its step needs under the names below ("step" a float32 scalar tensor); per group,
// the hyperparameters and the indices of its parameters. LibTorch keeps the same quantities (its
// optimizers are ports of Python's) in typed structs keyed by the parameter's TensorImpl. Only
// what changes the arithmetic is checked on the way in: a Python option LibTorch lacks (maximize,
// AdamW's decoupled weight decay on an Adam) is refused; foreach, fused, capturable and
// differentiable only choose kernels and are ignored.
#include "checkpoint/optimizer_state.h"

#include <torch/optim.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

namespace dtrain::detail {
namespace {

namespace optim = torch::optim;
using c10::IValue;
using Dict = c10::impl::GenericDict;

Dict new_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }

[[noreturn]] void refuse(const std::string& why) { throw std::runtime_error(why); }

double number(const IValue& value, const std::string& what) {
  if (value.isDouble()) return value.toDouble();
  if (value.isInt()) return static_cast<double>(value.toInt());
  if (value.isBool()) return value.toBool() ? 1 : 0;
  if (value.isTensor() && value.toTensor().numel() == 1) return value.toTensor().item<double>();
  refuse(what + " is " + value.tagKind() + ", not a number");
}

IValue entry(const Dict& dict, const std::string& key, const std::string& where) {
  auto it = dict.find(key);
  if (it == dict.end()) refuse(where + " has no '" + key + "'");
  return it->value();
}

bool flag(const Dict& dict, const std::string& key) {
  auto it = dict.find(key);
  return it != dict.end() && it->value().isBool() && it->value().toBool();
}

// How one optimizer type maps: its group hyperparameters and its per-parameter state.
template <typename Optimizer, typename Options, typename State>
struct Mapping {
  const char* name;
  // Whether every parameter has a state from construction on (Adagrad's accumulators: its step()
  // does not create a missing one).
  bool state_from_construction;
  std::function<void(const Options&, Dict&)> save_group;
  std::function<void(const Dict&, Options&)> load_group;  // throws for what LibTorch lacks
  std::function<void(const State&, Dict&, const std::function<at::Tensor(const at::Tensor&)>&)>
      save_state;
  std::function<void(const Dict&, State&, const at::Tensor& param)> load_state;
};

at::Tensor step_tensor(int64_t step) {
  return at::scalar_tensor(static_cast<double>(step), at::kFloat);  // Python's form
}

// A state tensor from the file, checked against its parameter and put where the parameter is.
at::Tensor state_tensor(const Dict& state, const std::string& key, const at::Tensor& param,
                        const std::string& where) {
  IValue value = entry(state, key, where);
  if (!value.isTensor()) refuse(where + "'s '" + key + "' is not a tensor");
  at::Tensor t = value.toTensor();
  if (!t.sizes().equals(param.sizes())) {
    refuse(where + "'s '" + key + "' has shape " + c10::str(t.sizes()) + ", its parameter " +
           c10::str(param.sizes()));
  }
  return t.to(param.options(), /*non_blocking=*/false, /*copy=*/true);
}

template <typename Optimizer, typename Options, typename State>
std::optional<IValue> save_with(const optim::Optimizer& live, bool copy,
                                const Mapping<Optimizer, Options, State>& mapping) {
  auto* typed = dynamic_cast<const Optimizer*>(&live);
  if (typed == nullptr) return std::nullopt;
  auto keep = [copy](const at::Tensor& t) {
    return copy ? t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true) : t.detach().cpu();
  };
  Dict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  int64_t index = 0;
  for (const auto& group : typed->param_groups()) {
    Dict saved_group = new_dict();
    mapping.save_group(static_cast<const Options&>(group.options()), saved_group);
    c10::impl::GenericList params(c10::AnyType::get());  // not an int list: Note [torch.save's
                                                         // format] in torch_archive.cpp
    for (const auto& param : group.params()) {
      auto it = typed->state().find(param.unsafeGetTensorImpl());
      if (it != typed->state().end()) {
        Dict saved_state = new_dict();
        mapping.save_state(static_cast<const State&>(*it->second), saved_state, keep);
        state.insert(index, saved_state);
      }
      params.push_back(index++);
    }
    saved_group.insert("params", params);
    groups.push_back(saved_group);
  }
  Dict root = new_dict();
  root.insert("state", state);
  root.insert("param_groups", groups);
  return IValue(root);
}

template <typename Optimizer, typename Options, typename State>
bool load_with(const IValue& saved, optim::Optimizer& live,
               const Mapping<Optimizer, Options, State>& mapping) {
  auto* typed = dynamic_cast<Optimizer*>(&live);
  if (typed == nullptr) return false;
  if (!saved.isGenericDict()) refuse("the optimizer entry is not a dict");
  const Dict root = saved.toGenericDict();
  IValue groups_value = entry(root, "param_groups", "the optimizer entry");
  IValue state_value = entry(root, "state", "the optimizer entry");
  if (!groups_value.isList() || !state_value.isGenericDict()) {
    refuse("the optimizer entry's param_groups is not a list or its state not a dict");
  }
  auto groups = groups_value.toList();
  const Dict state = state_value.toGenericDict();
  auto& live_groups = typed->param_groups();
  if (groups.size() != live_groups.size()) {
    refuse("it holds " + std::to_string(groups.size()) + " parameter groups, this " + mapping.name +
           " has " + std::to_string(live_groups.size()));
  }
  // Everything is read and checked first; the optimizer changes only once all of it fits.
  std::vector<std::unique_ptr<Options>> options;
  std::vector<std::pair<void*, std::unique_ptr<State>>> states;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::string where = "param_groups[" + std::to_string(g) + "]";
    IValue group_value = groups.get(g);
    if (!group_value.isGenericDict()) refuse(where + " is not a dict");
    const Dict group = group_value.toGenericDict();
    auto group_options =
        std::make_unique<Options>(static_cast<const Options&>(live_groups[g].options()));
    mapping.load_group(group, *group_options);
    options.push_back(std::move(group_options));
    IValue params_value = entry(group, "params", where);
    if (!params_value.isList()) refuse(where + "'s params is not a list");
    auto params = params_value.toList();
    const auto& live_params = live_groups[g].params();
    if (params.size() != live_params.size()) {
      refuse(where + " holds " + std::to_string(params.size()) + " parameters, this " +
             mapping.name + "'s " + std::to_string(live_params.size()));
    }
    for (std::size_t p = 0; p < params.size(); ++p) {
      IValue index = params.get(p);
      if (!index.isInt()) refuse(where + "'s params holds a " + index.tagKind() + ", not an index");
      auto it = state.find(index.toInt());
      if (it == state.end() && mapping.state_from_construction) {
        refuse("it holds no state for parameter " + std::to_string(index.toInt()) + ", which " +
               mapping.name + " keeps for every parameter");
      }
      if (it == state.end()) continue;  // a parameter that has not stepped yet
      const std::string state_where = "state[" + std::to_string(index.toInt()) + "]";
      if (!it->value().isGenericDict()) refuse(state_where + " is not a dict");
      auto loaded = std::make_unique<State>();
      mapping.load_state(it->value().toGenericDict(), *loaded, live_params[p]);
      states.emplace_back(live_params[p].unsafeGetTensorImpl(), std::move(loaded));
    }
  }
  for (std::size_t g = 0; g < options.size(); ++g)
    live_groups[g].set_options(std::move(options[g]));
  typed->state().clear();
  for (auto& [key, loaded] : states) typed->state()[key] = std::move(loaded);
  return true;
}

void refuse_maximize(const Dict& group, const char* name) {
  if (flag(group, "maximize")) {
    refuse(std::string("a group has maximize=True, which LibTorch's ") + name + " lacks");
  }
}

// Adam and AdamW: one mapping, told apart by Python's decoupled_weight_decay.
template <typename Optimizer, typename Options, typename State>
Mapping<Optimizer, Options, State> adam_mapping(const char* name, bool decoupled) {
  return {
      name,
      /*state_from_construction=*/false,
      [decoupled](const Options& o, Dict& g) {
        g.insert("lr", o.lr());
        g.insert("betas",
                 c10::ivalue::Tuple::create(std::get<0>(o.betas()), std::get<1>(o.betas())));
        g.insert("eps", o.eps());
        g.insert("weight_decay", o.weight_decay());
        g.insert("amsgrad", o.amsgrad());
        g.insert("maximize", false);
        g.insert("decoupled_weight_decay", decoupled);
      },
      [name, decoupled](const Dict& g, Options& o) {
        refuse_maximize(g, name);
        auto it = g.find("decoupled_weight_decay");
        if (it != g.end() && it->value().isBool() && it->value().toBool() != decoupled) {
          refuse(std::string("it was saved by ") + (decoupled ? "Adam" : "AdamW") +
                 " (decoupled_weight_decay=" + (decoupled ? "False" : "True") + "), not " + name);
        }
        o.lr(number(entry(g, "lr", "a group"), "lr"));
        IValue betas = entry(g, "betas", "a group");
        if (!betas.isTuple() && !betas.isList()) refuse("a group's betas is not a pair");
        std::vector<IValue> pair =
            betas.isTuple() ? betas.toTupleRef().elements().vec() : betas.toList().vec();
        if (pair.size() != 2) refuse("a group's betas is not a pair");
        o.betas({number(pair[0], "betas[0]"), number(pair[1], "betas[1]")});
        o.eps(number(entry(g, "eps", "a group"), "eps"));
        o.weight_decay(number(entry(g, "weight_decay", "a group"), "weight_decay"));
        o.amsgrad(flag(g, "amsgrad"));
      },
      [](const State& s, Dict& d, const auto& keep) {
        d.insert("step", step_tensor(s.step()));
        d.insert("exp_avg", keep(s.exp_avg()));
        d.insert("exp_avg_sq", keep(s.exp_avg_sq()));
        if (s.max_exp_avg_sq().defined()) d.insert("max_exp_avg_sq", keep(s.max_exp_avg_sq()));
      },
      [](const Dict& d, State& s, const at::Tensor& p) {
        s.step(static_cast<int64_t>(number(entry(d, "step", "a state"), "step")));
        s.exp_avg(state_tensor(d, "exp_avg", p, "a state"));
        s.exp_avg_sq(state_tensor(d, "exp_avg_sq", p, "a state"));
        if (d.contains("max_exp_avg_sq"))
          s.max_exp_avg_sq(state_tensor(d, "max_exp_avg_sq", p, "a state"));
      },
  };
}

const Mapping<optim::SGD, optim::SGDOptions, optim::SGDParamState>& sgd() {
  static const Mapping<optim::SGD, optim::SGDOptions, optim::SGDParamState> mapping{
      "SGD",
      /*state_from_construction=*/false,
      [](const optim::SGDOptions& o, Dict& g) {
        g.insert("lr", o.lr());
        g.insert("momentum", o.momentum());
        g.insert("dampening", o.dampening());
        g.insert("weight_decay", o.weight_decay());
        g.insert("nesterov", o.nesterov());
        g.insert("maximize", false);
      },
      [](const Dict& g, optim::SGDOptions& o) {
        refuse_maximize(g, "SGD");
        o.lr(number(entry(g, "lr", "a group"), "lr"));
        o.momentum(number(entry(g, "momentum", "a group"), "momentum"));
        o.dampening(number(entry(g, "dampening", "a group"), "dampening"));
        o.weight_decay(number(entry(g, "weight_decay", "a group"), "weight_decay"));
        o.nesterov(flag(g, "nesterov"));
      },
      [](const optim::SGDParamState& s, Dict& d, const auto& keep) {
        if (s.momentum_buffer().defined()) d.insert("momentum_buffer", keep(s.momentum_buffer()));
      },
      [](const Dict& d, optim::SGDParamState& s, const at::Tensor& p) {
        auto it = d.find("momentum_buffer");
        if (it != d.end() && !it->value().isNone()) {
          s.momentum_buffer(state_tensor(d, "momentum_buffer", p, "a state"));
        }
      },
  };
  return mapping;
}

const Mapping<optim::Adagrad, optim::AdagradOptions, optim::AdagradParamState>& adagrad() {
  static const Mapping<optim::Adagrad, optim::AdagradOptions, optim::AdagradParamState> mapping{
      "Adagrad",
      /*state_from_construction=*/true,
      [](const optim::AdagradOptions& o, Dict& g) {
        g.insert("lr", o.lr());
        g.insert("lr_decay", o.lr_decay());
        g.insert("weight_decay", o.weight_decay());
        g.insert("initial_accumulator_value", o.initial_accumulator_value());
        g.insert("eps", o.eps());
        g.insert("maximize", false);
      },
      [](const Dict& g, optim::AdagradOptions& o) {
        refuse_maximize(g, "Adagrad");
        o.lr(number(entry(g, "lr", "a group"), "lr"));
        o.lr_decay(number(entry(g, "lr_decay", "a group"), "lr_decay"));
        o.weight_decay(number(entry(g, "weight_decay", "a group"), "weight_decay"));
        o.initial_accumulator_value(
            number(entry(g, "initial_accumulator_value", "a group"), "initial_accumulator_value"));
        o.eps(number(entry(g, "eps", "a group"), "eps"));
      },
      [](const optim::AdagradParamState& s, Dict& d, const auto& keep) {
        d.insert("step", step_tensor(s.step()));
        d.insert("sum", keep(s.sum()));
      },
      [](const Dict& d, optim::AdagradParamState& s, const at::Tensor& p) {
        s.step(static_cast<int64_t>(number(entry(d, "step", "a state"), "step")));
        s.sum(state_tensor(d, "sum", p, "a state"));
      },
  };
  return mapping;
}

const Mapping<optim::RMSprop, optim::RMSpropOptions, optim::RMSpropParamState>& rmsprop() {
  static const Mapping<optim::RMSprop, optim::RMSpropOptions, optim::RMSpropParamState> mapping{
      "RMSprop",
      /*state_from_construction=*/false,
      [](const optim::RMSpropOptions& o, Dict& g) {
        g.insert("lr", o.lr());
        g.insert("alpha", o.alpha());
        g.insert("eps", o.eps());
        g.insert("weight_decay", o.weight_decay());
        g.insert("momentum", o.momentum());
        g.insert("centered", o.centered());
        g.insert("maximize", false);
      },
      [](const Dict& g, optim::RMSpropOptions& o) {
        refuse_maximize(g, "RMSprop");
        o.lr(number(entry(g, "lr", "a group"), "lr"));
        o.alpha(number(entry(g, "alpha", "a group"), "alpha"));
        o.eps(number(entry(g, "eps", "a group"), "eps"));
        o.weight_decay(number(entry(g, "weight_decay", "a group"), "weight_decay"));
        o.momentum(number(entry(g, "momentum", "a group"), "momentum"));
        o.centered(flag(g, "centered"));
      },
      [](const optim::RMSpropParamState& s, Dict& d, const auto& keep) {
        d.insert("step", step_tensor(s.step()));
        d.insert("square_avg", keep(s.square_avg()));
        if (s.momentum_buffer().defined()) d.insert("momentum_buffer", keep(s.momentum_buffer()));
        if (s.grad_avg().defined()) d.insert("grad_avg", keep(s.grad_avg()));
      },
      [](const Dict& d, optim::RMSpropParamState& s, const at::Tensor& p) {
        s.step(static_cast<int64_t>(number(entry(d, "step", "a state"), "step")));
        s.square_avg(state_tensor(d, "square_avg", p, "a state"));
        if (d.contains("momentum_buffer"))
          s.momentum_buffer(state_tensor(d, "momentum_buffer", p, "a state"));
        if (d.contains("grad_avg")) s.grad_avg(state_tensor(d, "grad_avg", p, "a state"));
      },
  };
  return mapping;
}

const auto& adam() {
  static const auto mapping =
      adam_mapping<optim::Adam, optim::AdamOptions, optim::AdamParamState>("Adam", false);
  return mapping;
}

const auto& adamw() {
  static const auto mapping =
      adam_mapping<optim::AdamW, optim::AdamWOptions, optim::AdamWParamState>("AdamW", true);
  return mapping;
}

}  // namespace

std::optional<c10::IValue> python_optimizer_state(const torch::optim::Optimizer& optimizer,
                                                  bool copy) {
  torch::NoGradGuard no_grad;
  if (auto saved = save_with(optimizer, copy, sgd())) return saved;
  if (auto saved = save_with(optimizer, copy, adam())) return saved;
  if (auto saved = save_with(optimizer, copy, adamw())) return saved;
  if (auto saved = save_with(optimizer, copy, adagrad())) return saved;
  if (auto saved = save_with(optimizer, copy, rmsprop())) return saved;
  return std::nullopt;
}

std::string python_optimizer_class(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const optim::SGD*>(&optimizer)) return sgd().name;
  if (dynamic_cast<const optim::Adam*>(&optimizer)) return adam().name;
  if (dynamic_cast<const optim::AdamW*>(&optimizer)) return adamw().name;
  if (dynamic_cast<const optim::Adagrad*>(&optimizer)) return adagrad().name;
  if (dynamic_cast<const optim::RMSprop*>(&optimizer)) return rmsprop().name;
  return "";
}

void load_python_optimizer_state(const c10::IValue& saved, torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  if (load_with(saved, optimizer, sgd()) || load_with(saved, optimizer, adam()) ||
      load_with(saved, optimizer, adamw()) || load_with(saved, optimizer, adagrad()) ||
      load_with(saved, optimizer, rmsprop())) {
    return;
  }
  refuse(
      "this optimizer is none of SGD, Adam, AdamW, Adagrad, RMSprop, whose state dtrain reads "
      "in Python's form");
}

}  // namespace dtrain::detail
