// The order the compiled code takes its inputs in and the shape of what it
// returns, read from the package's own call spec: torch's pytree treespecs
// serialised as JSON, `[protocol, {"type", "context", "children_spec"}]`.
// Never assumed: a kwargs dict's keys are in the order the build passed them.
#include "internal.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace flashrt::detail {
namespace {

using nlohmann::json;

[[noreturn]] void unsupported(const Manifest& m, const std::string& what) {
  throw Error(Error::Kind::Artifact, m.path.parent_path().string() + ": the package's call spec " + what);
}

json tree_of(const std::string& text, const Manifest& m, const char* which) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    unsupported(m, std::string("(") + which + ") is not JSON: " + e.what());
  }
  if (!doc.is_array() || doc.size() != 2 || !doc[1].is_object()) {
    unsupported(m, std::string("(") + which + ") is not a [protocol, treespec] pair");
  }
  return doc[1];
}

bool is_leaf(const json& node) { return node.at("type").is_null(); }
const json& children(const json& node) { return node.at("children_spec"); }

// A container's keys (dicts, ModelOutputs, namedtuples) or, for sequences, none.
std::vector<std::string> keys_of(const json& node) {
  const json& context = node.at("context");
  if (!context.is_string()) return {};
  json parsed = json::parse(context.get<std::string>(), nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_array() || parsed.size() != children(node).size()) return {};
  std::vector<std::string> keys;
  for (const auto& k : parsed) {
    if (!k.is_string()) return {};
    keys.push_back(k.get<std::string>());
  }
  return keys;
}

void output_paths(const json& node, const std::string& prefix, std::vector<std::string>& out) {
  if (is_leaf(node)) {
    out.push_back(prefix.empty() ? "output" : prefix);
    return;
  }
  const auto keys = keys_of(node);
  const json& kids = children(node);
  for (size_t i = 0; i < kids.size(); ++i) {
    const std::string part = keys.empty() ? std::to_string(i) : keys[i];
    output_paths(kids[i], prefix.empty() ? part : prefix + "." + part, out);
  }
}

}  // namespace

CallSpec parse_call_spec(const std::vector<std::string>& spec, const MethodManifest& method, const Manifest& m) {
  const std::vector<InputSpec>& inputs = method.inputs;
  const std::vector<std::string>& constants = method.constant_kwargs;
  const size_t threaded = m.state_in_place ? 0 : method.state.size();
  if (spec.size() != 2) unsupported(m, "has " + std::to_string(spec.size()) + " parts, expected 2 (inputs, outputs)");
  CallSpec call;
  try {
    // Inputs: ((args...), {kwargs...}); the flat order is the leaves' depth-first order.
    const json in = tree_of(spec[0], m, "inputs");
    if (is_leaf(in) || children(in).size() != 2) unsupported(m, "does not take (args, kwargs)");
    std::vector<std::string> positional;
    for (const auto& s : inputs) {
      if (s.positional) positional.push_back(s.name);
    }
    const json& args = children(in)[0];
    if (children(args).size() != positional.size()) {
      unsupported(m, "takes " + std::to_string(children(args).size()) + " positional inputs; the manifest lists " +
                         std::to_string(positional.size()));
    }
    for (size_t i = 0; i < positional.size(); ++i) {
      if (!is_leaf(children(args)[i])) unsupported(m, "takes a nested positional input '" + positional[i] + "'");
      call.order.push_back(positional[i]);
    }
    const json& kwargs = children(in)[1];
    const auto keys = keys_of(kwargs);
    if (keys.size() != children(kwargs).size()) unsupported(m, "has keyword inputs without names");
    for (size_t i = 0; i < keys.size(); ++i) {
      const json& child = children(kwargs)[i];
      const std::string& key = keys[i];
      if (key == kStateKwarg && !is_leaf(child)) {
        for (const auto& buffer : keys_of(child)) call.order.push_back(std::string(kStateKwarg) + "." + buffer);
        continue;
      }
      const bool constant = std::find(constants.begin(), constants.end(), key) != constants.end();
      if (constant) continue;  // a constant keyword argument: no tensor, the package takes none for it
      const bool input = std::any_of(inputs.begin(), inputs.end(), [&](const InputSpec& s) { return s.name == key; });
      if (!input || !is_leaf(child)) {
        unsupported(m, "takes '" + key +
                           "', which is neither a tensor input nor a constant keyword argument of the manifest");
      }
      call.order.push_back(key);
    }
    if (call.order.size() != inputs.size() + threaded) {
      unsupported(m, "of " + method.name + " takes " + std::to_string(call.order.size()) +
                         " tensors; the manifest lists " + std::to_string(inputs.size()) + " inputs and " +
                         std::to_string(threaded) + " threaded state buffers");
    }

    // Outputs: the output tree, or (output tree, {state}) for threaded state.
    const json out = tree_of(spec[1], m, "outputs");
    const json* tree = &out;
    if (threaded) {
      if (is_leaf(out) || children(out).size() != 2) unsupported(m, "does not return (outputs, state)");
      tree = &children(out)[0];
      call.state_outputs = keys_of(children(out)[1]);
      if (call.state_outputs.size() != threaded) unsupported(m, "does not return every state buffer");
    }
    output_paths(*tree, "", call.outputs);
  } catch (const json::exception& e) {
    unsupported(m, std::string("is malformed: ") + e.what());
  }
  return call;
}

}  // namespace flashrt::detail
