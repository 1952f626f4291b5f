// flashrt: serve a flashrt_build package from C++ with the checks Python's
// `flashrt_build.load` makes.
//
//   auto pkg = flashrt::Package::open("outputs/gpt2_tiny/cpu-external-default");
//   std::vector<at::Tensor> out = pkg.run({input_ids});
//
// open() checks the package's sha256 (and the sidecar's, when it reads it)
// against manifest.json before any of the package's code is loaded, checks
// every weight by name, shape and dtype before binding it, and run() checks
// every input against the manifest: libtorch's own loader runs a wrong weight
// or input shape silently.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace flashrt {

// Every refusal: an altered or incomplete artifact, weights that do not fit
// the package, inputs it was not built for. The message names the file, the
// tensor or the input, and the expected and actual values.
class Error : public std::runtime_error {
 public:
  enum class Kind {
    Artifact,  // a file missing, altered since its build, or unreadable
    Weights,   // weights whose names, shapes, dtypes or devices differ from the manifest's
    Input,     // inputs the package was not built for
  };
  Error(Kind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  Kind kind() const noexcept { return kind_; }

 private:
  Kind kind_;
};

// Tensors by name: weights by FQN, inputs by input name.
using TensorMap = std::unordered_map<std::string, at::Tensor>;

struct DynamicDim {
  int64_t axis;
  std::string name;  // dims of one name must agree across inputs
  int64_t min;
  int64_t max;
};

// One input of the package, as the manifest describes it.
struct InputSpec {
  std::string name;
  std::vector<int64_t> shape;  // the example shape; dynamic axes vary within their range
  at::ScalarType dtype;
  std::vector<DynamicDim> dynamic;
  bool positional;
  // The values an integer input may hold, [low, high) (a token id below the
  // vocabulary size); unset where the config declared none. Every call checks
  // them: a value outside would make the compiled code read out of bounds.
  std::optional<int64_t> low;
  std::optional<int64_t> high;
};

// Where open() spent its time, for logs and benchmarks.
struct OpenStats {
  uint64_t package_bytes = 0;
  double package_hash_s = 0;  // sha256 of model.pt2
  uint64_t weights_bytes = 0;  // bytes of the sidecar or checkpoint read (0: none read)
  double weights_hash_s = 0;  // sha256 of the sidecar (0: not read, or a checkpoint, which has no digest)
  double weights_read_s = 0;  // map the file and parse its header
  double load_s = 0;  // libtorch's loader: unpack the package, load its code
  double bind_s = 0;  // check names, shapes, dtypes; copy to the device; bind
  double total_s = 0;
};

// A loaded, checked package. Movable, not copyable. A stateless package's
// run() may be called from several threads at once (libtorch's runner takes
// them in turn); bind() and a stateful package's calls must not overlap.
class Package {
 public:
  // The package in `dir` (a flashrt_build output directory) on `device`
  // (default: the build's target device). An external-weights package binds
  // its sidecar, weights.safetensors; a baked one keeps its weights.
  static Package open(const std::filesystem::path& dir, std::optional<c10::Device> device = std::nullopt);
  // ... binding the caller's tensors (a state dict), borrowed: no weight is
  // copied, and an in-place edit of one shows in the next call's output. The
  // tensors must be on `device`. Names may be the module's FQNs or tied
  // aliases; constants of the forward's own code and non-persistent buffers
  // may be left out (the sidecar's values are bound). For a stateful module,
  // tensors named like its state are threaded and updated in place.
  static Package open(const std::filesystem::path& dir, std::optional<c10::Device> device, const TensorMap& weights);
  // ... binding a safetensors checkpoint, memory-mapped (on the CPU, bound
  // without a copy).
  static Package open(const std::filesystem::path& dir, std::optional<c10::Device> device,
                      const std::filesystem::path& checkpoint);

  Package(Package&&) noexcept;
  Package& operator=(Package&&) noexcept;
  ~Package();

  // Binds other weights, checked the same way; not while another thread runs.
  void bind(const TensorMap& weights);
  void bind(const std::filesystem::path& checkpoint);

  // One call. Inputs in the order of inputs() (positional inputs, then keyword
  // ones), or by name. Returns the output tree's leaves in order (see
  // output_names()). A stateful package's state is read and written back.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs);
  std::vector<at::Tensor> run(const TensorMap& inputs);

  // Throws Error(Kind::Input) naming the first input that does not fit: its
  // dtype, device, rank, a static size, a dynamic size outside its range, two
  // inputs sharing a dynamic dim with different sizes, or a value outside its
  // declared range. run() calls it.
  void check_inputs(const std::vector<at::Tensor>& inputs) const;

  const std::string& name() const;  // the module's name
  const std::filesystem::path& dir() const;
  c10::Device device() const;
  bool external() const;  // weights=external: code only, weights bound at open
  const std::vector<InputSpec>& inputs() const;
  // Output leaves by path in the output tree: "output" for a lone tensor,
  // else keys and indices joined by "." ("logits", "0.hidden").
  const std::vector<std::string>& output_names() const;
  // The tensors bound, by the package's FQN (empty when the baked ones are kept).
  const TensorMap& weights() const;
  // A stateful module's threaded buffers by FQN, updated after every call.
  const TensorMap& state() const;
  // The FQNs the compiled code binds, as libtorch reports them.
  std::vector<std::string> constant_fqns() const;
  const OpenStats& open_stats() const;

 private:
  struct Impl;
  explicit Package(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A safetensors file, memory-mapped. Tensors are views of the mapping, which
// stays alive as long as any of them does; writing to one changes this
// process's copy only (the mapping is private).
class SafetensorsFile {
 public:
  // Throws Error(Kind::Artifact) naming the file when it is not valid safetensors.
  explicit SafetensorsFile(const std::filesystem::path& path);
  const std::filesystem::path& path() const;
  const std::vector<std::string>& names() const;  // in file order
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  at::Tensor tensor(const std::string& name) const;  // a CPU view, no copy
  TensorMap tensors() const;
  uint64_t bytes() const;  // the file's size

 private:
  struct Mapped;
  std::shared_ptr<Mapped> mapped_;
};

// Writes tensors (any device; copied to the CPU) as safetensors, in the given order.
void save_safetensors(const std::filesystem::path& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors);

// The manifest's dtype name of a scalar type ("float32", "int64", "bfloat16").
std::string dtype_name(at::ScalarType dtype);

// The lowercase hex sha256 of a file, read in large blocks.
std::string file_sha256(const std::filesystem::path& path);

}  // namespace flashrt
