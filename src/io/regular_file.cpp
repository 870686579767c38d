#include "io/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "moe/errors.h"

namespace moe {

namespace {

// What a file of this mode is, for the message that refuses it.
const char* kind_of(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "of an unknown type";
}

}  // namespace

RegularFile::RegularFile(const std::string& path) : path_(path) {
  struct stat st {};
  // stat() follows symbolic links, so a link to a regular file is accepted. Checking first means
  // that a device is never opened (opening one can have effects, e.g. rewinding a tape).
  if (::stat(path.c_str(), &st) != 0)
    MOE_THROW(kIo, "cannot open {}: {}", path, std::strerror(errno));
  MOE_CHECK(S_ISREG(st.st_mode), kIo, "{} is {}, not a regular file", path, kind_of(st.st_mode));
  // O_NONBLOCK: should the path have become a FIFO since the stat(), open() returns at once
  // instead of waiting for a writer (on a regular file the flag changes nothing). O_NOCTTY: a
  // terminal swapped in cannot become the controlling terminal.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd_ < 0) MOE_THROW(kIo, "cannot open {}: {}", path, std::strerror(errno));
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string what = kind_of(st.st_mode);
    ::close(fd_);
    MOE_THROW(kIo, "{} is {}, not a regular file", path, what);
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string RegularFile::read_all(uint64_t max_bytes) const {
  MOE_CHECK(size_ <= max_bytes, kIo, "{} holds {} bytes, more than the {} allowed for this file",
            path_, size_, max_bytes);
  std::string text(static_cast<size_t>(size_), '\0');
  // Reads until end of file rather than trusting the size: a file may change while being read
  // (and some kernel files report a size of 0). Bytes past the size go through a small buffer,
  // so the common case allocates once. pread: the descriptor's offset is not shared state.
  char more[4096];
  uint64_t done = 0;
  for (;;) {
    const bool in_place = done < text.size();
    char* dst = in_place ? text.data() + done : more;
    const size_t room = in_place ? text.size() - done : sizeof more;
    const ssize_t n = ::pread(fd_, dst, room, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) MOE_THROW(kIo, "cannot read {}: {}", path_, std::strerror(errno));
    if (n == 0) break;
    if (!in_place) text.append(more, static_cast<size_t>(n));
    done += static_cast<uint64_t>(n);
    MOE_CHECK(done <= max_bytes, kIo,
              "{} grew past the {} bytes allowed for this file while being read", path_,
              max_bytes);
  }
  text.resize(static_cast<size_t>(done));
  return text;
}

std::string read_regular_file(const std::string& path, uint64_t max_bytes) {
  return RegularFile(path).read_all(max_bytes);
}

}  // namespace moe
