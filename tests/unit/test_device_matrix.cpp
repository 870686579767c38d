// The weight-format seam's host side: a matrix's format names itself, a row slice moves the
// data and (for block-scaled formats) the scales by whole blocks, and a kernel that reads only
// bf16 refuses any other format with one line naming it.
#include <gtest/gtest.h>

#include <string>

#include "backend/cuda_moe.h"
#include "backend/device_matrix.h"
#include "moe/weight_format.h"
#include "test_util.h"

namespace moe {
namespace {

using cuda::DeviceMatrix;

TEST(WeightFormat, NamesItself) {
  EXPECT_EQ(WeightFormat{}.name(), "bf16");
  EXPECT_FALSE(WeightFormat{}.scaled());
  const WeightFormat blocks{DType::kF32, 128, 128};
  EXPECT_TRUE(blocks.scaled());
  EXPECT_EQ(blocks.name(), "f32 (128 x 128 blocks)");
  EXPECT_FALSE(blocks == WeightFormat{});
}

TEST(DeviceMatrix, RowSliceOfBf16MovesByWholeRows) {
  alignas(16) static const uint16_t storage[6 * 4] = {};
  const DeviceMatrix m = DeviceMatrix::bf16(storage, 6, 4);
  const DeviceMatrix s = m.row_slice(2, 3);
  EXPECT_EQ(s.data, storage + 2 * 4);
  EXPECT_EQ(s.rows, 3);
  EXPECT_EQ(s.cols, 4);
  EXPECT_EQ(s.matrix_stride(), 12);
  EXPECT_EQ(test::error_kind_of([&] { m.row_slice(4, 3); }), ErrorKind::kInternal) << "past the last row";
}

TEST(DeviceMatrix, RowSliceOfABlockScaledMatrixMovesItsScalesByBlocks) {
  // 300 x 200 in 128 x 128 blocks: 3 block rows of 2 scales each (edge blocks partial).
  alignas(16) static const float values[300 * 200] = {};
  static const float scales[3 * 2] = {1, 2, 3, 4, 5, 6};
  DeviceMatrix m;
  m.data = values;
  m.format = WeightFormat{DType::kF32, 128, 128};
  m.scales = scales;
  m.rows = 300;
  m.cols = 200;
  const DeviceMatrix s = m.row_slice(256, 44);
  EXPECT_EQ(s.data, values + 256 * 200);
  EXPECT_EQ(s.scales, scales + 4) << "the third block row";
  EXPECT_EQ(s.rows, 44);
  std::string why;
  EXPECT_EQ(test::error_kind_of([&] { m.row_slice(100, 10); }, &why), ErrorKind::kInternal) << "inside a block";
  EXPECT_NE(why.find("splits a block of 128 rows"), std::string::npos) << why;
}

TEST(DeviceMatrix, Bf16KernelsRefuseOtherFormatsNamingThem) {
  alignas(16) static const float values[8] = {};
  DeviceMatrix m;
  m.data = values;
  m.format = WeightFormat{DType::kF32, 0, 0};
  m.rows = 2;
  m.cols = 4;
  std::string why;
  EXPECT_EQ(test::error_kind_of([&] { m.bf16_data("dense projection"); }, &why), ErrorKind::kUnsupported);
  EXPECT_EQ(why.rfind("dense projection: no CUDA kernel reads f32 weights yet", 0), 0u) << why;
  EXPECT_EQ(DeviceMatrix::bf16(values, 2, 8).bf16_data("x"), static_cast<const void*>(values));
}

#if defined(MOE_WITH_CUDA)
// The experts check their matrices' shapes and format before anything reaches the device.
TEST(DeviceMatrix, ExpertsRefuseMatricesThatDoNotFitTheirShape) {
  alignas(16) static const uint16_t w[4 * 2 * 16 * 32] = {};
  const cuda::ExpertShape shape{4, 32, 16, 2};
  std::string why;
  EXPECT_EQ(test::error_kind_of([&] {
              cuda::Experts e(DeviceMatrix::bf16(w, 32, 16, 4), DeviceMatrix::bf16(w, 32, 16, 4), shape, 8);
            }, &why),
            ErrorKind::kInvalidArgument)
      << "gate_up of 16 columns for a hidden size of 32";
  EXPECT_EQ(test::error_kind_of([&] {
              cuda::Experts e(DeviceMatrix::bf16(w, 32, 32, 3), DeviceMatrix::bf16(w, 32, 16, 4), shape, 8);
            }, &why),
            ErrorKind::kInvalidArgument)
      << "three matrices for four experts";
  EXPECT_NE(why.find("the experts' gate_up"), std::string::npos) << why;
  DeviceMatrix f32 = DeviceMatrix::bf16(w, 32, 32, 4);
  f32.format = WeightFormat{DType::kF32, 0, 0};
  EXPECT_EQ(test::error_kind_of([&] { cuda::Experts e(f32, DeviceMatrix::bf16(w, 32, 16, 4), shape, 8); }, &why),
            ErrorKind::kUnsupported);
  EXPECT_NE(why.find("f32 weights"), std::string::npos) << why;
}
#endif

}  // namespace
}  // namespace moe
