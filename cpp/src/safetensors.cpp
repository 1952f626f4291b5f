// safetensors files: memory-mapped, their JSON header parsed with nlohmann,
// tensors as views of the mapping; and writing them.
//
// Layout: 8-byte little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
// then the data, offsets relative to its start.
#include "internal.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace flashrt {
namespace {

struct DtypeName {
  at::ScalarType dtype;
  const char* name;  // the manifest's (torch's) name
  const char* code;  // safetensors'
};

constexpr DtypeName kDtypes[] = {
    {at::kFloat, "float32", "F32"},
    {at::kDouble, "float64", "F64"},
    {at::kHalf, "float16", "F16"},
    {at::kBFloat16, "bfloat16", "BF16"},
    {at::kLong, "int64", "I64"},
    {at::kInt, "int32", "I32"},
    {at::kShort, "int16", "I16"},
    {at::kChar, "int8", "I8"},
    {at::kByte, "uint8", "U8"},
    {at::kBool, "bool", "BOOL"},
    {at::kFloat8_e4m3fn, "float8_e4m3fn", "F8_E4M3"},
    {at::kFloat8_e5m2, "float8_e5m2", "F8_E5M2"},
    {at::kComplexFloat, "complex64", "C64"},
    {at::kUInt16, "uint16", "U16"},
    {at::kUInt32, "uint32", "U32"},
    {at::kUInt64, "uint64", "U64"},
};

Error bad_file(const std::filesystem::path& path, const std::string& what) {
  return Error(Error::Kind::Artifact, path.string() + " is not a valid safetensors file: " + what);
}

}  // namespace

namespace detail {

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

std::optional<at::ScalarType> dtype_from_safetensors(const std::string& code) {
  for (const auto& d : kDtypes) {
    if (code == d.code) return d.dtype;
  }
  return std::nullopt;
}

std::string safetensors_code(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (dtype == d.dtype) return d.code;
  }
  throw Error(Error::Kind::Input, "dtype " + std::string(c10::toString(dtype)) + " cannot be written as safetensors");
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return out + "]";
}

}  // namespace detail

std::string dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (dtype == d.dtype) return d.name;
  }
  return c10::toString(dtype);
}

struct SafetensorsFile::Mapped {
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin;
    uint64_t end;
  };
  std::filesystem::path path;
  void* base = nullptr;
  uint64_t size = 0;
  const unsigned char* data = nullptr;  // start of the tensor data
  std::vector<std::string> names;
  std::unordered_map<std::string, Entry> entries;

  ~Mapped() {
    if (base != nullptr) ::munmap(base, size);
  }

  const Entry& entry(const std::string& name) const {
    auto it = entries.find(name);
    if (it == entries.end()) {
      throw Error(Error::Kind::Weights, path.string() + " has no tensor '" + name + "'");
    }
    return it->second;
  }
};

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : mapped_(std::make_shared<Mapped>()) {
  Mapped& m = *mapped_;
  m.path = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(Error::Kind::Artifact, path.string() + " cannot be read: " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw Error(Error::Kind::Artifact, path.string() + " cannot be read: " + std::strerror(err));
  }
  m.size = static_cast<uint64_t>(st.st_size);
  if (m.size < 8) {
    ::close(fd);
    throw bad_file(path, std::to_string(m.size) + " bytes, shorter than its 8-byte header length");
  }
  // Private and writable: a write to a bound tensor (copy-on-write) never reaches the file.
  m.base = ::mmap(nullptr, m.size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (m.base == MAP_FAILED) {
    m.base = nullptr;
    throw Error(Error::Kind::Artifact, path.string() + " cannot be mapped: " + std::strerror(err));
  }
  const auto* bytes = static_cast<const unsigned char*>(m.base);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[i];
  if (header_size > m.size - 8) {
    throw bad_file(path, "its header length " + std::to_string(header_size) + " exceeds the file's " +
                             std::to_string(m.size) + " bytes");
  }
  m.data = bytes + 8 + header_size;
  const uint64_t data_size = m.size - 8 - header_size;
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(bytes + 8, bytes + 8 + header_size);
  } catch (const nlohmann::json::exception& e) {
    throw bad_file(path, std::string("its header is not JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw bad_file(path, "its header is not a JSON object");
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      const std::string code = info.at("dtype").get<std::string>();
      auto dtype = detail::dtype_from_safetensors(code);
      if (!dtype) throw bad_file(path, "tensor '" + name + "' has dtype " + code + ", which torch cannot read");
      Mapped::Entry e{*dtype, info.at("shape").get<std::vector<int64_t>>(), 0, 0};
      const auto offsets = info.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2) throw bad_file(path, "tensor '" + name + "' has no [begin, end] data_offsets");
      e.begin = offsets[0];
      e.end = offsets[1];
      uint64_t numel = 1;
      for (int64_t d : e.shape) {
        if (d < 0) throw bad_file(path, "tensor '" + name + "' has shape " + detail::shape_str(e.shape));
        numel *= static_cast<uint64_t>(d);
      }
      const uint64_t want = numel * c10::elementSize(*dtype);
      if (e.begin > e.end || e.end > data_size || e.end - e.begin != want) {
        throw bad_file(path, "tensor '" + name + "' has data_offsets [" + std::to_string(e.begin) + ", " +
                                 std::to_string(e.end) + "] for " + std::to_string(want) + " bytes of " +
                                 std::to_string(data_size));
      }
      m.names.push_back(name);
      m.entries.emplace(name, std::move(e));
    } catch (const nlohmann::json::exception& e) {
      throw bad_file(path, "tensor '" + name + "': " + e.what());
    }
  }
}

const std::filesystem::path& SafetensorsFile::path() const { return mapped_->path; }
const std::vector<std::string>& SafetensorsFile::names() const { return mapped_->names; }
bool SafetensorsFile::contains(const std::string& name) const { return mapped_->entries.count(name) != 0; }
std::vector<int64_t> SafetensorsFile::shape(const std::string& name) const { return mapped_->entry(name).shape; }
at::ScalarType SafetensorsFile::dtype(const std::string& name) const { return mapped_->entry(name).dtype; }
uint64_t SafetensorsFile::bytes() const { return mapped_->size; }

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const Mapped::Entry& e = mapped_->entry(name);
  auto options = at::TensorOptions().dtype(e.dtype).device(at::kCPU);
  if (e.begin == e.end) return at::empty(e.shape, options);
  void* data = const_cast<unsigned char*>(mapped_->data + e.begin);
  // The view keeps the mapping alive: the deleter owns a reference to it.
  auto keep = mapped_;
  at::Tensor view = at::from_blob(data, e.shape, [keep](void*) {}, options);
  if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(e.dtype) != 0) {
    return view.clone();  // a writer that did not align its tensors: copy rather than misread
  }
  return view;
}

TensorMap SafetensorsFile::tensors() const {
  TensorMap out;
  for (const auto& name : mapped_->names) out.emplace(name, tensor(name));
  return out;
}

void save_safetensors(const std::filesystem::path& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::vector<at::Tensor> host;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const uint64_t size = t.numel() * t.element_size();
    header[name] = {{"dtype", detail::safetensors_code(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + size}}};
    offset += size;
    host.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  unsigned char length[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(length), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : host) {
    out.write(static_cast<const char*>(t.const_data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
  }
  if (!out) throw Error(Error::Kind::Artifact, path.string() + " cannot be written");
}

}  // namespace flashrt
