// sha256 of a file through OpenSSL's EVP API, read in 1 MiB blocks.
#include "internal.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
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

}  // namespace

std::string file_sha256(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(Error::Kind::Artifact, path.string() + " cannot be read: " + std::strerror(errno));
  }
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  Digest ctx = new_digest();
  std::vector<unsigned char> block(1 << 20);
  for (;;) {
    ssize_t n = ::read(fd, block.data(), block.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      throw Error(Error::Kind::Artifact, path.string() + " cannot be read: " + std::strerror(err));
    }
    if (n == 0) break;
    EVP_DigestUpdate(ctx.get(), block.data(), static_cast<size_t>(n));
  }
  ::close(fd);
  return hex_digest(ctx.get());
}

}  // namespace flashrt
