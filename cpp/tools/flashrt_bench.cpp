// flashrt-bench: what flashrt::Package costs over libtorch's bare loader, in
// one process, variants alternating. Driven by bench/cpp_runner.py.
//
//   flashrt-bench DIR --inputs IN.safetensors [--device D] [--calls N] [--rounds R] [--opens K] [--cold]
//                 [--threads T]
//   flashrt-bench --file PATH [--cold]     the "files" figures of one file only
//
// Prints one JSON object:
//   open:       K x Package::open's OpenStats (digests, read, libtorch load, bind)
//   bare_open:  K x seconds for libtorch's loader plus load_constants of the
//               same sidecar (mapped, bound in place): no digest, no check
//   files:      per file (package, sidecar) its bytes and GB/s of read() and
//               of sha256 (flashrt::file_sha256, one core) and of the chunked
//               check a load makes (all cores), warm (page cache) and, with
//               --cold, after dropping the file's pages (posix_fadvise
//               DONTNEED): the disk
//   calls:      R rounds of N calls each (microseconds per call) of
//               AOTIModelPackageLoader::run, ::boxed_run and Package::run,
//               the order rotated every round (--calls 0: none)
// Packages with one input and no threaded state (the bare loader is given
// the input as it is).
#include <flashrt/package.h>

#include "internal.h"  // the load's chunked digest check, timed on its own

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds(const std::function<void()>& fn) {
  const auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void drop_cache(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

double read_all(const std::filesystem::path& path) {
  return seconds([&] {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    std::vector<char> block(1 << 20);
    while (::read(fd, block.data(), block.size()) > 0) {
    }
    ::close(fd);
  });
}

// GB/s of reading and hashing one file, warm and (optionally) cold.
json file_speeds(const std::filesystem::path& path, bool cold) {
  const double gb = static_cast<double>(std::filesystem::file_size(path)) / 1e9;
  json out = {{"file", path.filename().string()}, {"bytes", std::filesystem::file_size(path)}};
  // The check a load makes: the file's chunk digests (the build's 32 MiB
  // chunks) on every core; computed once here, untimed, as a build would.
  flashrt::detail::FileRecord record;
  record.bytes = static_cast<int64_t>(std::filesystem::file_size(path));
  record.chunk_bytes = 32 << 20;
  record.chunk_sha256 = flashrt::detail::chunk_digests(path, *record.bytes, record.chunk_bytes);
  std::vector<std::pair<std::string, std::function<void()>>> ways = {
      {"read", [&] { read_all(path); }},
      {"sha256", [&] { flashrt::file_sha256(path); }},
      {"sha256 chunks", [&] {
         if (!flashrt::detail::altered_digest(path, record).empty()) throw std::runtime_error("chunks disagree");
       }},
  };
  for (const auto& [name, fn] : ways) {
    fn();  // warm the page cache
    out["warm"][name] = gb / seconds(fn);
    if (cold) {
      drop_cache(path);
      out["cold"][name] = gb / seconds(fn);
    }
  }
  return out;
}

void sync(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: flashrt-bench DIR --inputs IN.safetensors [--device D] [--calls N] [--rounds R] "
                 "[--opens K] [--cold] [--threads T]\n       flashrt-bench --file PATH [--cold]\n";
    return 2;
  }
  const std::string first = argv[1];
  if (first == "--file") {
    const bool cold = argc > 3 && std::string(argv[3]) == "--cold";
    std::cout << file_speeds(argv[2], cold).dump(1) << "\n";
    return 0;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::path inputs_path;
  std::optional<c10::Device> device;
  int calls = 2000, rounds = 5, opens = 3;
  bool cold = false;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&] { return std::string(argv[++i]); };
    if (arg == "--inputs") inputs_path = next();
    else if (arg == "--device") device = c10::Device(next());
    else if (arg == "--calls") calls = std::stoi(next());
    else if (arg == "--rounds") rounds = std::stoi(next());
    else if (arg == "--opens") opens = std::stoi(next());
    else if (arg == "--cold") cold = true;
    else if (arg == "--threads") at::set_num_threads(std::stoi(next()));
  }
  try {
    json report;
    // Open: the checked open against the bare one, alternating.
    for (int k = 0; k < opens; ++k) {
      if (cold) {
        drop_cache(dir / "model.pt2");
        drop_cache(dir / "weights.safetensors");
      }
      // The bare open below goes to the device the checked open chose (the
      // package's target device unless --device names another).
      c10::Device target = c10::kCPU;
      flashrt::OpenStats stats;
      {
        const flashrt::Package opened = flashrt::Package::open(dir, device);
        stats = opened.open_stats();
        target = opened.device();
      }
      report["open"].push_back({{"package_bytes", stats.package_bytes},
                                {"package_hash_s", stats.package_hash_s},
                                {"weights_bytes", stats.weights_bytes},
                                {"weights_hash_s", stats.weights_hash_s},
                                {"weights_read_s", stats.weights_read_s},
                                {"load_s", stats.load_s},
                                {"bind_s", stats.bind_s},
                                {"total_s", stats.total_s}});
      if (cold) {
        drop_cache(dir / "model.pt2");
        drop_cache(dir / "weights.safetensors");
      }
      report["bare_open_s"].push_back(seconds([&] {
        const c10::Device d = target;
        torch::inductor::AOTIModelPackageLoader bare((dir / "model.pt2").string(), "model", false, 1,
                                                     d.is_cuda() ? d.index() : -1);
        if (std::filesystem::exists(dir / "weights.safetensors")) {
          flashrt::TensorMap constants;
          for (auto& [name, t] : flashrt::SafetensorsFile(dir / "weights.safetensors").tensors()) {
            constants.emplace(name, t.to(d));
          }
          bare.load_constants(constants, false, true, true);
        }
        sync(d);
      }));
    }

    report["files"].push_back(file_speeds(dir / "model.pt2", cold));
    if (std::filesystem::exists(dir / "weights.safetensors")) {
      report["files"].push_back(file_speeds(dir / "weights.safetensors", cold));
    }

    // Calls: libtorch's loader bound to the very tensors the package binds.
    flashrt::Package pkg = flashrt::Package::open(dir, device);
    report["device"] = pkg.device().str();
    report["name"] = pkg.name();
    if (calls == 0) {
      std::cout << report.dump(1) << "\n";
      return 0;
    }
    if (pkg.inputs().size() != 1 || !pkg.state().empty()) {
      throw std::runtime_error("flashrt-bench times packages with one input and no state");
    }
    torch::inductor::AOTIModelPackageLoader bare((dir / "model.pt2").string(), "model", false, 1,
                                                 pkg.device().is_cuda() ? pkg.device().index() : -1);
    if (!pkg.weights().empty()) {
      flashrt::TensorMap constants = pkg.weights();
      bare.load_constants(constants, false, pkg.external(), true);
    }
    const at::Tensor x = flashrt::SafetensorsFile(inputs_path).tensor(pkg.inputs()[0].name).to(pkg.device());
    const std::vector<at::Tensor> inputs = {x};
    // A sanity check, not a verification: a GPU's kernels need not be bit-reproducible.
    const at::Tensor a = bare.run(inputs).at(0).cpu().to(at::kFloat), b = pkg.run(inputs).at(0).cpu().to(at::kFloat);
    if (!at::allclose(a, b, 1e-2, 1e-2)) {
      throw std::runtime_error("the bare loader and Package::run disagree");
    }
    std::vector<std::pair<std::string, std::function<void()>>> variants = {
        {"libtorch run", [&] { bare.run(inputs); }},
        {"libtorch boxed_run", [&] { bare.boxed_run(std::vector<at::Tensor>(inputs)); }},
        {"flashrt Package::run", [&] { pkg.run(inputs); }},
    };
    for (auto& [name, fn] : variants) {
      for (int i = 0; i < std::max(calls / 10, 10); ++i) fn();  // warm-up
    }
    for (int r = 0; r < rounds; ++r) {
      for (size_t v = 0; v < variants.size(); ++v) {
        auto& [name, fn] = variants[(v + r) % variants.size()];
        const double s = seconds([&] {
          for (int i = 0; i < calls; ++i) fn();
          sync(pkg.device());
        });
        report["calls"][name].push_back(s / calls * 1e6);
      }
    }
    std::cout << report.dump(1) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "flashrt-bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
