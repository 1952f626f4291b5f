// sha256 of a file or a range of it through OpenSSL's EVP API; a manifest's
// chunk digests checked on every core.
#include "internal.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace flashrt {
namespace {

using Digest = std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)>;

Digest new_digest() {
  Digest ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("OpenSSL could not start a sha256 digest");
  }
  return ctx;
}

std::string hex_digest(EVP_MD_CTX* ctx) {
  unsigned char bytes[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_DigestFinal_ex(ctx, bytes, &size) != 1) {
    throw std::runtime_error("OpenSSL could not finish a sha256 digest");
  }
  static const char hex[] = "0123456789abcdef";
  std::string out(2 * size, '0');
  for (unsigned int i = 0; i < size; ++i) {
    out[2 * i] = hex[bytes[i] >> 4];
    out[2 * i + 1] = hex[bytes[i] & 0xf];
  }
  return out;
}

int open_for_reading(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(Error::Kind::Artifact, path.string() + " cannot be read: " + std::strerror(errno));
  }
  return fd;
}

// sha256 of `length` bytes from `offset` (fewer if the file ends first),
// read in 1 MiB blocks.
std::string range_sha256(const std::filesystem::path& path, int64_t offset, int64_t length) {
  const int fd = open_for_reading(path);
  ::posix_fadvise(fd, offset, 0, POSIX_FADV_SEQUENTIAL);  // 0: to the end of the file
  Digest ctx = new_digest();
  std::vector<unsigned char> block(1 << 20);
  for (int64_t end = offset + length; offset < end;) {
    const size_t want = static_cast<size_t>(std::min<int64_t>(block.size(), end - offset));
    const ssize_t n = ::pread(fd, block.data(), want, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw Error(Error::Kind::Artifact, path.string() + " cannot be read: " + std::strerror(err));
    }
    if (n == 0) break;
    EVP_DigestUpdate(ctx.get(), block.data(), static_cast<size_t>(n));
    offset += n;
  }
  ::close(fd);
  return hex_digest(ctx.get());
}

// The cores this process may run on (a SLURM job's, not the host's).
size_t usable_cores() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

std::vector<std::string> detail::chunk_digests(const std::filesystem::path& path, int64_t size, int64_t chunk_bytes) {
  const size_t n = std::max<size_t>(1, static_cast<size_t>((size + chunk_bytes - 1) / chunk_bytes));
  std::vector<std::string> out(n);
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        const int64_t offset = static_cast<int64_t>(i) * chunk_bytes;
        out[i] = range_sha256(path, offset, std::min(chunk_bytes, size - offset));
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
      }
    }
  };
  const size_t threads = std::min(n, usable_cores());
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  return out;
}

std::string detail::altered_digest(const std::filesystem::path& path, const detail::FileRecord& record) {
  if (!record.chunk_sha256.empty() && record.bytes && record.chunk_bytes > 0) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (!ec && static_cast<int64_t>(size) == *record.bytes &&
        chunk_digests(path, *record.bytes, record.chunk_bytes) == record.chunk_sha256) {
      return "";
    }
  }
  const std::string digest = file_sha256(path);
  return digest == record.sha256 ? "" : digest;
}

std::string file_sha256(const std::filesystem::path& path) {
  return range_sha256(path, 0, std::numeric_limits<int64_t>::max());  // to the end of the file
}

}  // namespace flashrt
