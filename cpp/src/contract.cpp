// What a load relies on, projected from manifest.json exactly as
// flashrt_build/runtime/contract.py projects it, and held against the record
// the build wrote inside the package: an edited manifest is refused.
#include "internal.h"

#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <nlohmann/json.hpp>

namespace flashrt::detail {
namespace {

using nlohmann::json;

json value_or_null(const json& node, const char* key) {
  return node.is_object() && node.contains(key) ? node.at(key) : json(nullptr);
}

// The first key at which two JSON values differ, dotted; empty when equal.
std::string first_difference(const json& a, const json& b, const std::string& key) {
  if (a.is_object() && b.is_object()) {
    std::vector<std::string> keys;
    for (const auto& [k, _] : a.items()) keys.push_back(k);
    for (const auto& [k, _] : b.items()) {
      if (!a.contains(k)) keys.push_back(k);
    }
    std::sort(keys.begin(), keys.end());
    for (const auto& k : keys) {
      const std::string found = first_difference(value_or_null(a, k.c_str()), value_or_null(b, k.c_str()),
                                                 key.empty() ? k : key + "." + k);
      if (!found.empty()) return found;
    }
    return "";
  }
  if (a.is_array() && b.is_array() && a.size() == b.size()) {
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string found = first_difference(a[i], b[i], key + "[" + std::to_string(i) + "]");
      if (!found.empty()) return found;
    }
    return "";
  }
  return a == b ? "" : (key.empty() ? "the manifest" : key);
}

}  // namespace

// What loading and calling the package relies on, projected from the
// manifest exactly as flashrt_build.runtime.manifest.load_contract does; the
// build records the same inside the package.
json load_contract(const json& doc) {
  const json& weights = doc.at("weights");
  json tensors = json::array();
  for (const auto& t : weights.at("tensors")) {
    json entry = t;
    entry.erase("sha256");
    tensors.push_back(std::move(entry));
  }
  const json gpu_node = value_or_null(doc.at("toolchain"), "gpu");
  const json gpu = gpu_node.is_null()
                       ? json(nullptr)
                       : json{{"name", value_or_null(gpu_node, "name")}, {"capability", value_or_null(gpu_node, "capability")}};
  json state = nullptr;
  if (!value_or_null(doc, "state").is_null()) {
    state = json::array();
    for (const auto& t : doc["state"].at("tensors")) {
      state.push_back({{"fqn", t.at("fqn")}, {"shape", t.at("shape")}, {"dtype", t.at("dtype")}});
    }
  }
  json methods = json::object();
  const json declared = value_or_null(doc, "methods");
  for (const auto& [name, e] : declared.items()) {
    json method = json::object();
    for (const char* key : {"method", "model", "inputs", "outputs", "kwargs", "state"}) method[key] = value_or_null(e, key);
    methods[name] = std::move(method);
  }
  const json& target = doc.at("target");
  json contract = {
      {"schema", kManifestSchema},
      {"target",
       {{"device", value_or_null(target, "device")},
        {"dtype", value_or_null(target, "dtype")},
        {"tf32", value_or_null(target, "tf32")}}},
      {"gpu", gpu},
      {"weights",
       {{"mode", weights.at("mode")},
        {"tensors", tensors},
        {"unused", weights.contains("unused") ? weights["unused"] : json::array()}}},
      {"state", state},
      {"inputs", doc.at("inputs")},
      {"outputs", doc.at("outputs")},
      {"methods", methods},
  };
  // Only for in-place state: the contracts of earlier packages stay as they were.
  if (!state.is_null() && value_or_null(doc["state"], "mode") == "in_place") contract.emplace("state_mode", "in_place");
  return contract;
}

void check_contract(const std::filesystem::path& package, const Manifest& m) {
  std::string recorded;
  try {
    caffe2::serialize::PyTorchStreamReader reader(package.string());
    if (!reader.hasRecord(kContractMember)) return;  // built before packages recorded it
    const auto [data, size] = reader.getRecord(kContractMember);
    recorded.assign(static_cast<const char*>(data.get()), size);
  } catch (const c10::Error& e) {
    throw Error(Error::Kind::Artifact, package.string() + " cannot be read as an archive: " + e.what_without_backtrace());
  }
  json built;
  try {
    built = json::parse(recorded);
  } catch (const json::exception& e) {
    throw Error(Error::Kind::Artifact, package.string() + ": its record of the manifest is not JSON (" + e.what() + ")");
  }
  const std::string key = first_difference(m.contract, built, "");
  if (!key.empty()) {
    throw Error(Error::Kind::Artifact, m.path.string() + " was edited after its build: " + key +
                                           " differs from the package's own record; refusing to load it");
  }
}

}  // namespace flashrt::detail
