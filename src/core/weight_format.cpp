#include "moe/weight_format.h"

#include <fmt/format.h>

namespace moe {

std::string WeightFormat::name() const {
  if (!scaled()) return dtype_name(dtype);
  return fmt::format("{} ({} x {} blocks)", dtype_name(dtype), block_rows, block_cols);
}

}  // namespace moe
