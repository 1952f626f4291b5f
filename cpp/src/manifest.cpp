// manifest.json: read with nlohmann, checked, turned into the plain structs
// the package needs. A key that is missing or of the wrong type is named.
#include "internal.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace flashrt::detail {
namespace {

using nlohmann::json;


// A JSON value and the key path that led to it, for messages.
struct Node {
  const json& value;
  std::string key;
  const std::filesystem::path& file;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(Error::Kind::Artifact, file.string() + ": " + key + " " + what);
  }
  Node operator[](const std::string& name) const {
    if (!value.is_object()) fail("is not an object");
    auto it = value.find(name);
    if (it == value.end()) fail("has no key '" + name + "'");
    return {*it, key.empty() ? name : key + "." + name, file};
  }
  Node operator[](size_t i) const { return {value.at(i), key + "[" + std::to_string(i) + "]", file}; }
  bool has(const std::string& name) const { return value.is_object() && value.contains(name); }
  bool null() const { return value.is_null(); }
  size_t size() const {
    if (!value.is_array()) fail("is not a list");
    return value.size();
  }
  template <typename T>
  T as() const {
    try {
      return value.get<T>();
    } catch (const json::exception&) {
      fail("has the wrong type (" + std::string(value.type_name()) + ": " + value.dump() + ")");
    }
  }
  at::ScalarType dtype() const {
    auto d = dtype_from_name(as<std::string>());
    if (!d) fail("names dtype '" + as<std::string>() + "', which this library does not know");
    return *d;
  }
  std::vector<int64_t> shape() const { return as<std::vector<int64_t>>(); }
  FileRecord file_record() const {
    FileRecord r;
    r.file = (*this)["file"].as<std::string>();
    if (r.file.empty() || r.file == "." || r.file == ".." || r.file.find('/') != std::string::npos) {
      (*this)["file"].fail("is '" + r.file + "', expected a file name inside the output directory");
    }
    r.sha256 = (*this)["sha256"].as<std::string>();
    if (has("chunk_sha256") && has("chunk_bytes") && has("bytes")) {
      r.bytes = (*this)["bytes"].as<int64_t>();
      r.chunk_bytes = (*this)["chunk_bytes"].as<int64_t>();
      r.chunk_sha256 = (*this)["chunk_sha256"].as<std::vector<std::string>>();
      if (r.chunk_bytes <= 0) (*this)["chunk_bytes"].fail("must be positive");
    }
    return r;
  }
};

std::vector<int64_t> row_major(const std::vector<int64_t>& shape) {
  std::vector<int64_t> stride(shape.size());
  int64_t step = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    stride[i] = step;
    step *= std::max<int64_t>(shape[i], 1);
  }
  return stride;
}

// One method's inputs, positional ones first (the order the module takes them in).
std::vector<InputSpec> parse_inputs(const Node& inputs, const std::filesystem::path& path) {
  std::vector<InputSpec> out;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Node in = inputs[i];
    InputSpec spec{in["name"].as<std::string>(), in["shape"].shape(), in["dtype"].dtype(), {}, false, {}, {}};
    if (in.has("positional")) spec.positional = in["positional"].as<bool>();
    if (in.has("low") && !in["low"].null()) spec.low = in["low"].as<int64_t>();
    if (in.has("high") && !in["high"].null()) spec.high = in["high"].as<int64_t>();
    const Node dynamic = in["dynamic"];
    for (const auto& [axis, dim] : dynamic.value.items()) {
      const Node d{dim, dynamic.key + "." + axis, path};
      DynamicDim dd{0, d["name"].as<std::string>(), d["min"].as<int64_t>(), d["max"].as<int64_t>()};
      try {
        dd.axis = std::stoll(axis);
      } catch (const std::exception&) {
        d.fail("is not an integer axis");
      }
      if (dd.axis < 0 || dd.axis >= static_cast<int64_t>(spec.shape.size())) {
        d.fail("is outside the input's " + std::to_string(spec.shape.size()) + " dims");
      }
      spec.dynamic.push_back(std::move(dd));
    }
    out.push_back(std::move(spec));
  }
  std::stable_partition(out.begin(), out.end(), [](const InputSpec& s) { return s.positional; });
  return out;
}

std::vector<std::string> keys(const json& object) {
  std::vector<std::string> out;
  if (object.is_object()) {
    for (const auto& [key, _] : object.items()) out.push_back(key);
  }
  return out;
}

// The methods in the manifest's own order (nlohmann's json sorts an object's keys).
std::vector<std::string> method_order(const std::string& text) {
  const auto ordered = nlohmann::ordered_json::parse(text);
  std::vector<std::string> names;
  for (const auto& [name, _] : ordered.at("methods").items()) names.push_back(name);
  return names;
}

}  // namespace

Manifest read_manifest(const std::filesystem::path& dir) {
  Manifest m;
  m.path = dir / "manifest.json";
  std::ifstream in(m.path, std::ios::binary);
  if (!in) {
    throw Error(Error::Kind::Artifact,
                m.path.string() + " does not exist: " + dir.string() + " holds no complete build");
  }
  std::stringstream text;
  text << in.rdbuf();
  json doc;
  try {
    doc = json::parse(text.str());
  } catch (const json::exception& e) {
    throw Error(Error::Kind::Artifact, m.path.string() + " is not valid JSON (" + e.what() + ")");
  }
  const Node root{doc, "", m.path};
  const bool has_schema = root.has("schema") && root["schema"].value.is_string();
  const std::string schema = has_schema ? root["schema"].as<std::string>() : "";
  if (schema != kManifestSchema) {
    throw Error(Error::Kind::Artifact,
                m.path.string() + " has schema '" + schema + "', expected '" + kManifestSchema + "'");
  }
  m.name = root["name"].as<std::string>();
  const Node target = root["target"];
  m.target_device = target["device"].as<std::string>();
  m.target_dtype = target["dtype"].as<std::string>();
  if (target.has("tf32") && !target["tf32"].null()) m.tf32 = target["tf32"].as<bool>();
  if (root.has("toolchain") && root["toolchain"].has("gpu") && !root["toolchain"]["gpu"].null()) {
    m.gpu_capability = root["toolchain"]["gpu"]["capability"].as<std::string>();
    m.gpu_name = root["toolchain"]["gpu"]["name"].as<std::string>();
  }

  m.package = root["package"].file_record();

  const Node weights = root["weights"];
  const std::string mode = weights["mode"].as<std::string>();
  if (mode != "baked" && mode != "external") weights["mode"].fail("is '" + mode + "', expected baked or external");
  m.external = mode == "external";
  if (m.external) m.weights_file = weights.file_record();
  const Node tensors = weights["tensors"];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Node t = tensors[i];
    WeightEntry e{t["fqn"].as<std::string>(), t["shape"].shape(), t["dtype"].dtype(), t["kind"].as<std::string>(),
                  true, {}, {}, {}};
    if (t.has("stride") && !t["stride"].null()) {
      e.stride = t["stride"].shape();
      if (e.stride.size() != e.shape.size()) t["stride"].fail("has " + std::to_string(e.stride.size()) + " axes");
    } else {
      e.stride = row_major(e.shape);
    }
    if (t.has("persistent") && !t["persistent"].null()) e.persistent = t["persistent"].as<bool>();
    e.names.push_back(e.fqn);
    if (t.has("source") && !t["source"].null()) e.names.push_back(t["source"].as<std::string>());
    if (t.has("aliases")) {
      for (auto& alias : t["aliases"].as<std::vector<std::string>>()) e.names.push_back(alias);
    }
    if (t.has("methods")) e.methods = t["methods"].as<std::map<std::string, std::string>>();
    m.weights.push_back(std::move(e));
  }
  if (weights.has("unused")) m.unused = weights["unused"].as<std::vector<std::string>>();

  if (root.has("state") && !root["state"].null()) {
    const Node state = root["state"];
    m.state_file = state.file_record();
    m.state_in_place = state.has("mode") && state["mode"].as<std::string>() == "in_place";
    const Node entries = state["tensors"];
    for (size_t i = 0; i < entries.size(); ++i) {
      const Node t = entries[i];
      m.state.push_back({t["fqn"].as<std::string>(), t["shape"].shape(), t["dtype"].dtype()});
    }
  }

  if (root.has("methods")) {
    const Node methods = root["methods"];
    for (const auto& name : method_order(text.str())) {
      const Node e = methods[name];
      MethodManifest method{name, e["model"].as<std::string>(), parse_inputs(e["inputs"], m.path), {}, {}, {}};
      method.constant_kwargs = keys(e["kwargs"].value);
      if (e.has("state")) method.state = e["state"].as<std::vector<std::string>>();
      method.kwargs_key = method.model == "model" ? "module.kwargs" : "module.methods." + name + ".kwargs";
      const bool forward = e["method"].as<std::string>() == "forward";
      if (forward && m.default_method.empty()) m.default_method = name;
      m.methods.push_back(std::move(method));
    }
    if (m.methods.empty()) methods.fail("lists no method");
    if (m.default_method.empty()) m.default_method = m.methods.front().name;
  } else {  // written before packages had several methods: one forward
    MethodManifest method{"forward", "model", parse_inputs(root["inputs"], m.path), {}, {}, "module.kwargs"};
    method.constant_kwargs = keys(root["config"]["module"].value.value("kwargs", json::object()));
    for (const auto& e : m.state) method.state.push_back(e.fqn);
    m.methods.push_back(std::move(method));
    m.default_method = "forward";
  }
  if (root.has("libraries") && root["libraries"].value.is_array()) {
    for (const auto& entry : root["libraries"].value) {
      m.libraries.emplace_back(entry.at("path").get<std::string>(), entry.at("ops").get<std::vector<std::string>>());
    }
  }
  if (root.has("serve") && root["serve"].value.is_object()) {
    const Node serve = root["serve"];
    if (serve.has("cuda_graphs")) m.cuda_graphs = serve["cuda_graphs"].as<bool>();
    if (serve.has("max_graphs")) m.max_graphs = serve["max_graphs"].as<size_t>();
  }
  try {
    m.contract = load_contract(doc);
  } catch (const json::exception& e) {
    throw Error(Error::Kind::Artifact, m.path.string() + " lacks what a load relies on (" + e.what() + ")");
  }
  return m;
}

}  // namespace flashrt::detail
