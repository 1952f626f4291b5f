// Declarations shared by the library's sources; not installed.
#pragma once

#include <flashrt/package.h>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstddef>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace flashrt::detail {

// --- dtypes (safetensors.cpp) ---
// The manifest's dtype names ("float32") and safetensors' codes ("F32").
std::optional<at::ScalarType> dtype_from_name(const std::string& name);
std::optional<at::ScalarType> dtype_from_safetensors(const std::string& code);
std::string safetensors_code(at::ScalarType dtype);

// "[2, 32]", the way the Python side prints a shape.
std::string shape_str(const std::vector<int64_t>& shape);

// --- the manifest (manifest.cpp) ---
struct WeightEntry {
  std::string fqn;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  std::string kind;  // parameter | buffer | constant
  bool persistent = true;
  std::vector<std::string> names;  // fqn, then its export name (source), then tied aliases
  // The layout the compiled code reads it with (row-major for manifests that
  // do not record it): a tensor of the right shape laid out otherwise gives
  // wrong answers silently.
  std::vector<int64_t> stride;
  // A package of several methods: the name each method's model binds it by
  // (empty: every method binds it by its FQN).
  std::map<std::string, std::string> methods;
  // A checkpoint must supply parameters and persistent buffers; constants of
  // the forward's code and non-persistent buffers default to the build's values.
  bool required() const { return kind == "parameter" || (kind == "buffer" && persistent); }
  // The name `method`'s model binds this tensor by, or null when it does not bind it.
  const std::string* bound_by(const std::string& method) const {
    if (methods.empty()) return &fqn;
    auto it = methods.find(method);
    return it == methods.end() ? nullptr : &it->second;
  }
};

struct StateEntry {
  std::string fqn;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

struct FileRecord {
  std::string file;  // relative to the output directory
  std::string sha256;
  // Manifests since chunk digests: the file's size and the sha256 of each
  // chunk_bytes slice, checked on every core (absent in older manifests).
  std::optional<int64_t> bytes;
  int64_t chunk_bytes = 0;
  std::vector<std::string> chunk_sha256;
};

// --- digests (sha256.cpp) ---
// The sha256 of each `chunk_bytes` slice of the file's first `size` bytes,
// the slices shared out over one thread per usable core.
std::vector<std::string> chunk_digests(const std::filesystem::path& path, int64_t size, int64_t chunk_bytes);

// Empty when `path` holds the bytes `record` describes, else the file's sha256
// (for the refusal). With chunk digests the chunks are hashed on all cores and
// the whole file only when they disagree (a hand-edited manifest decides by
// its whole-file digest, as the Python loader does).
std::string altered_digest(const std::filesystem::path& path, const FileRecord& record);

// One entry point: its model in the archive, inputs and constant kwargs.
struct MethodManifest {
  std::string name;  // "decode"; "forward" for manifests of one unnamed method
  std::string model;  // the model's name inside model.pt2 ("model" for a single one)
  std::vector<InputSpec> inputs;  // positional first, then keyword ones
  std::vector<std::string> constant_kwargs;  // fixed at build time: no tensors
  std::vector<std::string> state;  // the buffers it writes
  std::string kwargs_key;  // "module.kwargs" or "module.methods.<name>.kwargs", for messages
};

struct Manifest {
  std::filesystem::path path;
  std::string name;
  std::string target_device;  // "cpu", "cuda", "cuda:1"
  std::string target_dtype;
  std::optional<bool> tf32;
  std::optional<std::string> gpu_capability;  // "9.0" for a CUDA build
  std::optional<std::string> gpu_name;
  FileRecord package;
  bool external = false;
  std::optional<FileRecord> weights_file;
  std::vector<WeightEntry> weights;
  std::vector<std::string> unused;  // names a checkpoint may carry that the graph never reads
  std::optional<FileRecord> state_file;
  std::vector<StateEntry> state;
  bool state_in_place = false;  // the compiled code writes the state (else threaded, or stateless)
  std::vector<MethodManifest> methods;  // in the manifest's order
  std::string default_method;  // the one that runs forward, else the first
  // Shared libraries registering the custom operators the package calls, loaded before it.
  std::vector<std::pair<std::string, std::vector<std::string>>> libraries;  // (path, operators)
  bool cuda_graphs = false;  // serve.cuda_graphs: the loader's default
  size_t max_graphs = 8;  // serve.max_graphs
  nlohmann::json contract;  // what a load relies on (see check_contract)
};

// Inside the package's archive: what a load relies on, as the build recorded it.
inline constexpr const char* kContractMember = "extra/flashrt_build/contract.json";
inline constexpr const char* kManifestSchema = "flashrt_build.manifest/1";

// What a load relies on, projected from manifest.json (contract.cpp).
nlohmann::json load_contract(const nlohmann::json& manifest);

// Throws Error(Artifact) when the manifest's load-relevant fields differ from
// the record the build wrote into the package (whose digest was checked
// first): an edited manifest is refused instead of trusted. A package built
// before the record existed passes.
void check_contract(const std::filesystem::path& package, const Manifest& m);

// Reads and checks `dir`/manifest.json; throws Error(Artifact) naming the file and key.
Manifest read_manifest(const std::filesystem::path& dir);

// --- the package's call spec (call_spec.cpp) ---
// What the compiled code takes and returns, from torch's serialised pytree
// treespecs (AOTIModelPackageLoader::get_call_spec()).
struct CallSpec {
  // Flat tensor inputs in the compiled code's order: an input's name, or
  // "flashrt_state.<fqn>" for a threaded buffer.
  std::vector<std::string> order;
  std::vector<std::string> outputs;  // output leaves' paths, state excluded
  std::vector<std::string> state_outputs;  // the trailing outputs: new state values, by fqn
};

// Of one method (its inputs; its state when threaded).
CallSpec parse_call_spec(const std::vector<std::string>& spec, const MethodManifest& method, const Manifest& manifest);

inline constexpr const char* kStateKwarg = "flashrt_state";

// --- weights against the manifest (package.cpp) ---
struct TableEntry {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  std::optional<c10::Device> device;  // known for tensors in memory, not for a file's table
  // Of the caller's tensors, bound as they are; a file's are laid out when read.
  std::optional<std::vector<int64_t>> stride;
};

// Do `stride` and the entry's agree? Axes of size 1 are never stepped along.
bool same_layout(const std::vector<int64_t>& stride, const WeightEntry& entry);
using Table = std::map<std::string, TableEntry>;

// Every difference between the manifest's tensors and a table, as the
// Python side's `runtime.checkpoint.compare` lists them: (kind, names) in the order
// missing, unexpected, wrong shape, wrong dtype, wrong device, wrong strides; kinds without
// names left out. `chosen` gets fqn -> the table's name for it.
std::vector<std::pair<std::string, std::vector<std::string>>> compare(const std::vector<WeightEntry>& entries,
                                                                      const Table& table,
                                                                      const std::vector<std::string>& unused,
                                                                      std::optional<c10::Device> device,
                                                                      std::map<std::string, std::string>& chosen);

// --- what every method of a package shares (package.cpp) ---
struct Shared {
  Manifest manifest;
  std::filesystem::path dir;
  c10::Device device{c10::kCPU};
  TensorMap state;  // by FQN: the caller's buffers, or owned copies of state.safetensors
  std::mutex calls;  // one call (or bind) of the package at a time
  bool graphs = false;  // CUDA graph replay
  size_t max_graphs = 8;
};

std::string join(const std::vector<std::string>& items, const char* sep = ", ");
bool same_device(const c10::Device& a, const c10::Device& b);

// A CUDA graph of one input shape: the tensors it reads and writes (method.cpp).
struct Graph;

}  // namespace flashrt::detail

namespace flashrt {

// One method's model and call plan (method.cpp); the package binds its weights.
struct Method::Impl {
  const detail::MethodManifest* spec = nullptr;
  detail::Shared* shared = nullptr;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  detail::CallSpec call;
  std::vector<std::string> input_names;  // the order run() takes them in
  // Per flat input of the compiled code: an index into run()'s inputs (>= 0)
  // or into state_in (-1 - i).
  std::vector<int> slots;
  std::vector<at::Tensor> state_in;  // threaded state, in call order
  std::vector<at::Tensor> state_out;  // in the order the package returns them
  size_t n_dims = 0;  // distinct dynamic dim names, numbered in dim_ids
  std::vector<std::vector<int>> dim_ids;  // per input, per dynamic dim
  std::vector<std::vector<std::pair<size_t, int64_t>>> static_axes;  // per input: (axis, size) of each static axis
  // CUDA graphs by the inputs' sizes; shapes seen once (their warm-up call ran plain).
  std::map<std::vector<int64_t>, std::unique_ptr<detail::Graph>> graphs;
  std::set<std::vector<int64_t>> warmed;
  bool said_full = false;

  Impl();
  ~Impl();
  // After the state is in place: the order of the compiled code's inputs, the checks' tables.
  void plan();
  std::vector<at::Tensor> invoke(const std::vector<at::Tensor>& inputs);  // plain, or from a graph
  void drop_graphs();
};

}  // namespace flashrt
