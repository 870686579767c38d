// Pieces shared by the command-line tools: the error boundary, list parsing, tokenizer lookup,
// the parallel-layout flags.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace moe::cli {

// Runs `body`, turning any exception into one line "error: ..." on stderr and exit code 1.
int guarded(const std::function<int()>& body);

// Parses argv into `app`; a flag it does not know, a missing or malformed value is one line
// "error: ..." on stderr and exit code 1, as every other bad input (guarded); --help prints the
// help and exits 0. Returns -1 when parsing succeeded, else the exit code.
int parse_args(CLI::App& app, int argc, char** argv);

// "3,17,42" -> {3, 17, 42}; throws kInvalidArgument naming the bad item.
std::vector<int32_t> parse_ids(const std::string& text);

// The tokenizer.json to use: `explicit_path` if given, else <model_dir>/tokenizer.json; throws
// kIo with a hint when neither exists.
std::string tokenizer_path(const std::string& model_dir, const std::string& explicit_path);

// A byte count in the unit that shows it: "31.174 GB", "1.05 MB", "12.3 KB", "512 B".
std::string format_bytes(double bytes);

// Shortest text that reads back as the same f32.
std::string format_float(float value);

// --ep, --tp, --dp and --ep-backend, worded alike in every tool; the layout itself is checked
// by dist::DistConfig before any weight is read.
struct ParallelFlags {
  int* ep;
  int* tp;
  int* dp;
  std::string* ep_backend;
};
void add_parallel_flags(CLI::App* app, const ParallelFlags& flags);

}  // namespace moe::cli
