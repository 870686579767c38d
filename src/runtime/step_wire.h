// The bytes of a step: StepPlan and StepResult as one flat little-endian message each, for a
// driver that schedules in one process and executors that run the step in others (the same plan
// goes to every worker, the result comes back from the one that samples). The plan carries no
// pointers, so the message is the plan itself; the decoder trusts nothing: every count is checked
// against the bytes left before anything is allocated, enums and flags against their ranges,
// temperature and top_p for finiteness, and trailing bytes are refused. A message
// from another version of the format is refused with both version numbers. What depends on the
// executor (sequences open, ids in the vocabulary, context room) is check_plan's, after decoding.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "runtime/executor.h"

namespace moe::runtime {

// Bumped whenever the layout below changes; both ends must agree.
constexpr uint16_t kStepWireVersion = 1;

std::vector<uint8_t> encode_plan(const StepPlan& plan);
// kFormat with one line naming what is wrong (truncated, a count past the message, a bad enum,
// trailing bytes, another kind of message or version).
StepPlan decode_plan(std::span<const uint8_t> bytes);

// Logits travel as f32 [rows, cols] tensors, as the executors return them.
std::vector<uint8_t> encode_result(const StepResult& result);
StepResult decode_result(std::span<const uint8_t> bytes);

}  // namespace moe::runtime
