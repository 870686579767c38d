#include "runtime/executor.h"

#include <algorithm>

#include "moe/errors.h"

namespace moe::runtime {

void check_plan(const StepPlan& plan, const Executor& executor) {
  const ExecutorLimits& lim = executor.limits();
  MOE_CHECK(!plan.rows.empty(), kInvalidArgument, "a step needs at least one row");
  MOE_CHECK(static_cast<int64_t>(plan.rows.size()) <= lim.max_sequences, kInvalidArgument,
            "a step of {} rows: the executor runs at most {} sequences", plan.rows.size(), lim.max_sequences);
  for (int32_t id : plan.tokens)
    MOE_CHECK(id >= 0 && id < lim.vocab, kInvalidArgument, "token id {} is outside the vocabulary [0, {})", id,
              lim.vocab);
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const StepRow& r = plan.rows[i];
    MOE_CHECK(r.count >= 1 && r.offset >= 0 &&
                  static_cast<int64_t>(r.offset) + r.count <= static_cast<int64_t>(plan.tokens.size()),
              kInvalidArgument, "row {}: tokens [{}, {}) are outside the step's {} tokens", i, r.offset,
              static_cast<int64_t>(r.offset) + r.count, plan.tokens.size());
    for (size_t j = 0; j < i; ++j)
      MOE_CHECK(plan.rows[j].seq != r.seq, kInvalidArgument, "sequence {} appears twice in one step", r.seq);
    const int64_t len = executor.length(r.seq);  // throws for a sequence that is not open
    MOE_CHECK(len + r.count <= lim.max_context, kInvalidArgument,
              "context full: sequence {} holds {} tokens, {} more exceed the context of {}", r.seq, len, r.count,
              lim.max_context);
    MOE_CHECK(r.draw >= 0, kInvalidArgument, "row {}: draw index {} is negative", i, r.draw);
    if (r.sample) validate_sampling(r.sampling);
  }
}

}  // namespace moe::runtime
