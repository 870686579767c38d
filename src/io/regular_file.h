// Opening the files of a model directory (weights, index, config, tokenizer): only regular files,
// or symbolic links to them, are opened. A FIFO, a directory, a device or a socket in their place
// is refused at once with one line naming the path and what it is, instead of blocking in open()
// or read() (a FIFO without a writer, a terminal) or reading forever (/dev/zero).
#pragma once

#include <cstdint>
#include <string>

namespace moe {

// A read-only descriptor of a regular file, closed on destruction.
class RegularFile {
 public:
  // Opens `path`. Throws kIo naming the path when it is missing or unreadable, or when it is not
  // a regular file (naming what it is: a FIFO, a directory, a character device...). The type is
  // checked before the open, so that a device is never opened, and again on the open descriptor,
  // so that a file swapped for a FIFO in between is still refused; the open itself cannot block.
  explicit RegularFile(const std::string& path);
  ~RegularFile();
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  // The size when the file was opened.
  uint64_t size() const { return size_; }

  // Reads the whole file from the start. Throws kIo naming the path when it holds more than
  // max_bytes (the size is checked before anything is allocated) or when a read fails.
  std::string read_all(uint64_t max_bytes) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// RegularFile(path).read_all(max_bytes): the text of a JSON file of a model directory.
std::string read_regular_file(const std::string& path, uint64_t max_bytes);

}  // namespace moe
