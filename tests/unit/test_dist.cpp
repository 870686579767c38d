#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dist/communicator.h"
#include "dist/dist_config.h"
#include "dist/rank_group.h"
#include "moe/errors.h"
#include "moe/tensor.h"

namespace moe::dist {
namespace {

constexpr int kMaxRanks = 4;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The moe::Error that fn throws; a test failure when it throws nothing.
Error error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a moe::Error";
  return Error(ErrorKind::kInternal, "nothing thrown", __FILE__, __LINE__);
}

// Runs fn on every rank and returns, for each rank, the error it threw (or nullopt).
struct RankError {
  bool thrown = false;
  ErrorKind kind = ErrorKind::kInternal;
  std::string message;
};
RankError catch_on_rank(const std::function<void()>& fn) {
  RankError out;
  try {
    fn();
  } catch (const Error& e) {
    out.thrown = true;
    out.kind = e.kind();
    out.message = e.message();
  }
  return out;
}

// The rank's call threw an error of `kind` whose message holds every one of `parts`.
void expect_refused(const RankError& e, ErrorKind kind, std::initializer_list<const char*> parts) {
  EXPECT_TRUE(e.thrown);
  EXPECT_EQ(e.kind, kind) << e.message;
  for (const char* part : parts) EXPECT_TRUE(contains(e.message, part)) << e.message;
}

// ------------------------------------------------------------------------------------------------
// all_reduce_sum

TEST(DistCollectives, AllReduceF32KnownSums) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    constexpr size_t kCount = 37;
    std::vector<std::vector<float>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      EXPECT_EQ(comm.rank(), r);
      EXPECT_EQ(comm.size(), n);
      std::vector<float> x(kCount);
      for (size_t i = 0; i < kCount; ++i) x[i] = float(100 * r + i);  // f(r, i) = 100 r + i
      comm.all_reduce_sum(x.data(), kCount, DType::kF32);
      out[r] = x;
    });
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < kCount; ++i) {
        // sum_r (100 r + i) = 100 n(n-1)/2 + n i
        EXPECT_EQ(out[r][i], float(100 * n * (n - 1) / 2 + n * int(i))) << n << " ranks, i " << i;
      }
    }
  }
}

TEST(DistCollectives, AllReduceSumsInRankOrderOnEveryRank) {
  // Values whose f32 sum depends on the order of additions: each rank's result must equal the
  // left-to-right sum over ranks 0..n-1, bit for bit, on every rank.
  for (int n = 2; n <= kMaxRanks; ++n) {
    constexpr size_t kCount = 1000;
    // Rank 0 holds about +1e8, rank 1 about -1e8, the others small values: adding the small
    // values to either large one first loses them.
    // The inputs are tabulated once so that every use sees the same floats (the compiler may
    // contract a recomputed a*b+c into a fused multiply-add in one place and not another).
    std::vector<std::vector<float>> in(n, std::vector<float>(kCount));
    for (int r = 0; r < n; ++r) {
      float large = r == 0 ? 1.0e8f : (r == 1 ? -1.0e8f : 0.0f);
      for (size_t i = 0; i < kCount; ++i) {
        volatile float small = 0.1f * float(r + 1);
        volatile float ramp = 1e-3f * float(i);
        in[r][i] = large + small + ramp;
      }
    }
    std::vector<std::vector<float>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<float> x = in[r];
      comm.all_reduce_sum(x.data(), kCount, DType::kF32);
      out[r] = x;
    });
    for (size_t i = 0; i < kCount; ++i) {
      volatile float expected = in[0][i];
      for (int r = 1; r < n; ++r) expected = expected + in[r][i];
      for (int r = 0; r < n; ++r) {
        uint32_t a, b;
        std::memcpy(&a, &out[r][i], 4);
        float e = expected;
        std::memcpy(&b, &e, 4);
        ASSERT_EQ(a, b) << n << " ranks, rank " << r << ", i " << i;
      }
    }
  }
}

TEST(DistCollectives, AllReduceBf16KnownSums) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    constexpr size_t kCount = 16;
    std::vector<std::vector<uint16_t>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<uint16_t> x(kCount);
      // f(r, i) = (r + 1)/2 + i, exact in bf16; the sums stay below 128 in halves: exact too.
      for (size_t i = 0; i < kCount; ++i) x[i] = f32_to_bf16(0.5f * float(r + 1) + float(i));
      comm.all_reduce_sum(x.data(), kCount, DType::kBF16);
      out[r] = x;
    });
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < kCount; ++i) {
        float expected = 0.25f * float(n * (n + 1)) + float(n * int(i));  // (1/2) n(n+1)/2 + n i
        EXPECT_EQ(bf16_to_f32(out[r][i]), expected) << n << " ranks, i " << i;
      }
    }
  }
}

TEST(DistCollectives, AllReduceBf16AccumulatesInF32AndRoundsOnce) {
  // Rank 0 holds 256, the others 1. Adding in bf16 step by step would stay at 256 (256 + 1 is a
  // tie that rounds to even, 256). In f32: 3 ranks -> 258 (exact in bf16), 4 ranks -> 259, a tie
  // between 258 and 260 that rounds to the even 260.
  for (int n : {3, 4}) {
    std::vector<uint16_t> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      uint16_t x = f32_to_bf16(r == 0 ? 256.0f : 1.0f);
      comm.all_reduce_sum(&x, 1, DType::kBF16);
      out[r] = x;
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(bf16_to_f32(out[r]), n == 3 ? 258.0f : 260.0f);
  }
}

TEST(DistCollectives, AllReduceF16) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    std::vector<std::vector<uint16_t>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<uint16_t> x(8);
      for (int i = 0; i < 8; ++i) x[i] = f32_to_f16(float(r) - float(i) * 0.25f);
      comm.all_reduce_sum(x.data(), x.size(), DType::kF16);
      out[r] = x;
    });
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < 8; ++i) {
        EXPECT_EQ(f16_to_f32(out[r][i]), float(n * (n - 1) / 2) - 0.25f * float(n * i));
      }
    }
  }
}

TEST(DistCollectives, AllReduceLargeBuffer) {
  // More than one internal block; the last one partial.
  constexpr size_t kCount = 4096 * 3 + 17;
  for (int n : {2, 3}) {
    std::vector<std::vector<float>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<float> x(kCount);
      for (size_t i = 0; i < kCount; ++i) x[i] = float((i % 1000) * (r + 1));
      comm.all_reduce_sum(x.data(), kCount, DType::kF32);
      out[r] = x;
    });
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < kCount; ++i) {
        ASSERT_EQ(out[r][i], float((i % 1000) * n * (n + 1) / 2)) << i;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// all_gather, all_gatherv

uint8_t byte_of(int r, size_t i) { return static_cast<uint8_t>((r * 31 + i * 7 + 5) & 0xff); }

TEST(DistCollectives, AllGather) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    constexpr size_t kBytes = 13;
    std::vector<std::vector<uint8_t>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<uint8_t> send(kBytes), recv(kBytes * n, 0xee);
      for (size_t i = 0; i < kBytes; ++i) send[i] = byte_of(r, i);
      comm.all_gather(send.data(), recv.data(), kBytes);
      out[r] = recv;
    });
    for (int r = 0; r < n; ++r) {
      for (int j = 0; j < n; ++j) {
        for (size_t i = 0; i < kBytes; ++i) {
          ASSERT_EQ(out[r][j * kBytes + i], byte_of(j, i)) << n << " ranks, rank " << r;
        }
      }
    }
  }
}

TEST(DistCollectives, AllGatherInPlace) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    constexpr size_t kBytes = 6;
    std::vector<std::vector<uint8_t>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<uint8_t> buf(kBytes * n, 0);
      for (size_t i = 0; i < kBytes; ++i) buf[r * kBytes + i] = byte_of(r, i);
      comm.all_gather(buf.data() + r * kBytes, buf.data(), kBytes);
      out[r] = buf;
    });
    for (int r = 0; r < n; ++r) {
      for (int j = 0; j < n; ++j) {
        for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(out[r][j * kBytes + i], byte_of(j, i));
      }
    }
  }
}

size_t gatherv_bytes(int r) { return static_cast<size_t>((2 * r + 3) % 5); }  // 3, 0, 2, 4

// The ragged collectives' per-rank sizes size_of(0 .. n - 1), and their sum into *total.
std::vector<size_t> ragged_sizes(int n, size_t (*size_of)(int), size_t* total) {
  std::vector<size_t> sizes(static_cast<size_t>(n));
  *total = 0;
  for (int j = 0; j < n; ++j) *total += sizes[static_cast<size_t>(j)] = size_of(j);
  return sizes;
}

TEST(DistCollectives, AllGathervRagged) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    size_t total = 0;
    const std::vector<size_t> sizes = ragged_sizes(n, gatherv_bytes, &total);
    std::vector<std::vector<uint8_t>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<uint8_t> send;
      for (size_t i = 0; i < gatherv_bytes(r); ++i) send.push_back(byte_of(r, i));
      std::vector<uint8_t> recv(total, 0xee);
      comm.all_gatherv(send.data(), send.size(), recv.data(), sizes);
      out[r] = recv;
    });
    for (int r = 0; r < n; ++r) {
      size_t at = 0;
      for (int j = 0; j < n; ++j) {
        for (size_t i = 0; i < gatherv_bytes(j); ++i) ASSERT_EQ(out[r][at++], byte_of(j, i));
      }
      EXPECT_EQ(at, total);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// reduce_scatter_sum, reduce_scatterv_sum

TEST(DistCollectives, ReduceScatterF32) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    constexpr size_t kCount = 5;
    std::vector<std::vector<float>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      // Slice j, element i of rank r: 1000 r + 10 j + i.
      std::vector<float> send(kCount * n);
      for (int j = 0; j < n; ++j) {
        for (size_t i = 0; i < kCount; ++i) send[j * kCount + i] = float(1000 * r + 10 * j + i);
      }
      std::vector<float> recv(kCount, -1.0f);
      comm.reduce_scatter_sum(send.data(), recv.data(), kCount, DType::kF32);
      out[r] = recv;
    });
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < kCount; ++i) {
        // sum_s (1000 s + 10 r + i) = 1000 n(n-1)/2 + n (10 r + i)
        EXPECT_EQ(out[r][i], float(1000 * n * (n - 1) / 2 + n * (10 * r + int(i))));
      }
    }
  }
}

TEST(DistCollectives, ReduceScatterBf16InPlace) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    constexpr size_t kCount = 4;
    std::vector<std::vector<uint16_t>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      // Slice j, element i of rank r: r + 4 j + i (small integers, exact in bf16).
      std::vector<uint16_t> buf(kCount * n);
      for (int j = 0; j < n; ++j) {
        for (size_t i = 0; i < kCount; ++i) buf[j * kCount + i] = f32_to_bf16(float(r + 4 * j + i));
      }
      uint16_t* own = buf.data() + r * kCount;
      comm.reduce_scatter_sum(buf.data(), own, kCount, DType::kBF16);
      out[r].assign(own, own + kCount);
    });
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < kCount; ++i) {
        EXPECT_EQ(bf16_to_f32(out[r][i]), float(n * (n - 1) / 2 + n * (4 * r + int(i))));
      }
    }
  }
}

size_t scatterv_count(int j) { return static_cast<size_t>((j + 2) % 3); }  // 2, 0, 1, 2

TEST(DistCollectives, ReduceScattervRagged) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    size_t total = 0;
    const std::vector<size_t> counts = ragged_sizes(n, scatterv_count, &total);
    std::vector<std::vector<float>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<float> send;
      for (int j = 0; j < n; ++j) {
        for (size_t i = 0; i < counts[j]; ++i) send.push_back(float(r * r + 100 * j + i));
      }
      EXPECT_EQ(send.size(), total);
      std::vector<float> recv(counts[r] + 1, -7.0f);  // one guard element
      comm.reduce_scatterv_sum(send.data(), recv.data(), counts, DType::kF32);
      out[r] = recv;
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(out[r].size(), scatterv_count(r) + 1);
      for (size_t i = 0; i < scatterv_count(r); ++i) {
        // sum_s (s^2 + 100 r + i) = (n-1) n (2n-1)/6 + n (100 r + i)
        EXPECT_EQ(out[r][i], float((n - 1) * n * (2 * n - 1) / 6 + n * (100 * r + int(i))));
      }
      EXPECT_EQ(out[r].back(), -7.0f) << "wrote past its slice";
    }
  }
}

// ------------------------------------------------------------------------------------------------
// all_to_all, all_to_allv

TEST(DistCollectives, AllToAll) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    constexpr size_t kFloats = 3;
    std::vector<std::vector<float>> out(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<float> send(kFloats * n), recv(kFloats * n, -1.0f);
      // To rank j, element i: 100 r + 10 j + i.
      for (int j = 0; j < n; ++j) {
        for (size_t i = 0; i < kFloats; ++i) send[j * kFloats + i] = float(100 * r + 10 * j + i);
      }
      comm.all_to_all(send.data(), recv.data(), kFloats * sizeof(float));
      out[r] = recv;
    });
    for (int r = 0; r < n; ++r) {
      for (int j = 0; j < n; ++j) {
        for (size_t i = 0; i < kFloats; ++i) {
          EXPECT_EQ(out[r][j * kFloats + i], float(100 * j + 10 * r + i));  // from j, meant for r
        }
      }
    }
  }
}

// Rows that rank i sends to rank j in the ragged test: 0, 1 or 2, with zero-size slices in
// every group of two or more ranks (including to itself).
size_t rows_from_to(int i, int j) { return static_cast<size_t>((i + 2 * j) % 3); }
constexpr size_t kRowFloats = 2;
constexpr size_t kRowBytes = kRowFloats * sizeof(float);
float row_value(int from, int to, size_t row, size_t k) {
  return float(1000 * from + 100 * to + 10 * row + k);
}

TEST(DistCollectives, AllToAllvRaggedWithEmptySlices) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    std::vector<std::vector<float>> out(n);
    std::vector<OpStats> stats(n);
    run_ranks(n, [&](int r, Communicator& comm) {
      std::vector<size_t> send_bytes(n), recv_bytes(n);
      std::vector<float> send;
      size_t recv_floats = 0;
      for (int j = 0; j < n; ++j) {
        send_bytes[j] = rows_from_to(r, j) * kRowBytes;
        recv_bytes[j] = rows_from_to(j, r) * kRowBytes;
        recv_floats += rows_from_to(j, r) * kRowFloats;
        for (size_t row = 0; row < rows_from_to(r, j); ++row) {
          for (size_t k = 0; k < kRowFloats; ++k) send.push_back(row_value(r, j, row, k));
        }
      }
      std::vector<float> recv(recv_floats + 1, -5.0f);  // one guard element
      comm.all_to_allv(send.data(), send_bytes, recv.data(), recv_bytes);
      out[r] = recv;
      stats[r] = comm.stats().op("all_to_allv");
    });
    uint64_t total_sent = 0, total_moved = 0;
    for (int r = 0; r < n; ++r) {
      size_t at = 0;
      for (int j = 0; j < n; ++j) {
        for (size_t row = 0; row < rows_from_to(j, r); ++row) {
          for (size_t k = 0; k < kRowFloats; ++k) {
            ASSERT_EQ(out[r][at++], row_value(j, r, row, k)) << n << " ranks, rank " << r;
          }
        }
      }
      EXPECT_EQ(at + 1, out[r].size());
      EXPECT_EQ(out[r].back(), -5.0f) << "wrote past the receive buffer";
      // Byte counts by hand: everything rank r hands over, then without its self slice.
      uint64_t sent = 0;
      for (int j = 0; j < n; ++j) sent += rows_from_to(r, j) * kRowBytes;
      EXPECT_EQ(stats[r].calls, 1u);
      EXPECT_EQ(stats[r].bytes_sent, sent);
      EXPECT_EQ(stats[r].bytes_to_peers, sent - rows_from_to(r, r) * kRowBytes);
      total_sent += stats[r].bytes_sent;
    }
    // Summed over ranks, bytes_sent is every row that the exchange moves.
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) total_moved += rows_from_to(i, j) * kRowBytes;
    }
    EXPECT_EQ(total_sent, total_moved);
  }
}

TEST(DistCollectives, AllToAllvAllEmpty) {
  run_ranks(3, [&](int r, Communicator& comm) {
    std::vector<size_t> zeros(3, 0);
    comm.all_to_allv(nullptr, zeros, nullptr, zeros);
    EXPECT_EQ(comm.stats().op("all_to_allv").bytes_sent, 0u);
  });
}

// ------------------------------------------------------------------------------------------------
// broadcast, barrier

TEST(DistCollectives, Broadcast) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    for (int root = 0; root < n; ++root) {
      std::vector<std::vector<uint8_t>> out(n);
      run_ranks(n, [&](int r, Communicator& comm) {
        std::vector<uint8_t> data(9);
        for (size_t i = 0; i < data.size(); ++i) data[i] = byte_of(r, i);
        comm.broadcast(data.data(), data.size(), root);
        out[r] = data;
      });
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < 9; ++i) ASSERT_EQ(out[r][i], byte_of(root, i));
      }
    }
  }
}

TEST(DistCollectives, BarrierSeparatesPhases) {
  for (int n = 1; n <= kMaxRanks; ++n) {
    std::atomic<int> arrived{0};
    std::atomic<int> early{0};
    constexpr int kRounds = 50;
    run_ranks(n, [&](int r, Communicator& comm) {
      for (int round = 0; round < kRounds; ++round) {
        arrived.fetch_add(1);
        comm.barrier();
        // Every rank has arrived in this round before anyone leaves the barrier.
        if (arrived.load() < (round + 1) * n) early.fetch_add(1);
        comm.barrier();
      }
    });
    EXPECT_EQ(early.load(), 0);
    EXPECT_EQ(arrived.load(), kRounds * n);
  }
}

TEST(DistCollectives, ManyMixedCallsInSequence) {
  // Buffers are reused right after each call returns: a rank leaving too early would let a peer
  // read overwritten data.
  constexpr int n = 4;
  std::vector<int> bad(n, 0);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<float> buf(64);
    for (int round = 0; round < 200; ++round) {
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = float(round + r + i);
      comm.all_reduce_sum(buf.data(), buf.size(), DType::kF32);
      for (size_t i = 0; i < buf.size(); ++i) {
        if (buf[i] != float(n * (round + int(i)) + n * (n - 1) / 2)) bad[r]++;
      }
      std::vector<float> send(n), recv(n);
      for (int j = 0; j < n; ++j) send[j] = float(round * 16 + r * 4 + j);
      comm.all_to_all(send.data(), recv.data(), sizeof(float));
      for (int j = 0; j < n; ++j) {
        if (recv[j] != float(round * 16 + j * 4 + r)) bad[r]++;
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(bad[r], 0) << "rank " << r;
}

// ------------------------------------------------------------------------------------------------
// byte accounting

TEST(DistStats, HandComputedByteCounts) {
  constexpr int n = 3;
  std::vector<CommStats> stats(n);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<float> f(48);
    std::vector<uint16_t> h(10);
    std::vector<uint8_t> bytes(64), bytes2(64);
    comm.all_reduce_sum(f.data(), 10, DType::kF32);             // 40 bytes
    comm.all_reduce_sum(h.data(), 10, DType::kBF16);            // 20 bytes
    comm.reduce_scatter_sum(f.data(), f.data() + 40, 4, DType::kF32);  // 3 slices of 16 bytes
    comm.all_gather(bytes.data(), bytes2.data(), 7);            // 7 bytes to each of 3 ranks
    comm.all_to_all(bytes.data(), bytes2.data(), 5);            // 5 bytes per peer
    comm.broadcast(bytes.data(), 8, 1);                         // only the root sends
    comm.barrier();
    stats[r] = comm.stats();
  });
  for (int r = 0; r < n; ++r) {
    const CommStats& s = stats[r];
    EXPECT_EQ(s.op("all_reduce_sum").calls, 2u);
    EXPECT_EQ(s.op("all_reduce_sum").bytes_sent, 40u + 20u);
    EXPECT_EQ(s.op("all_reduce_sum").bytes_to_peers, 40u + 20u);
    EXPECT_EQ(s.op("reduce_scatter_sum").calls, 1u);
    EXPECT_EQ(s.op("reduce_scatter_sum").bytes_sent, 3u * 16u);
    EXPECT_EQ(s.op("reduce_scatter_sum").bytes_to_peers, 2u * 16u);
    EXPECT_EQ(s.op("all_gather").bytes_sent, 3u * 7u);
    EXPECT_EQ(s.op("all_gather").bytes_to_peers, 2u * 7u);
    EXPECT_EQ(s.op("all_to_all").bytes_sent, 3u * 5u);
    EXPECT_EQ(s.op("all_to_all").bytes_to_peers, 2u * 5u);
    EXPECT_EQ(s.op("broadcast").calls, 1u);
    EXPECT_EQ(s.op("broadcast").bytes_sent, r == 1 ? 24u : 0u);
    EXPECT_EQ(s.op("broadcast").bytes_to_peers, r == 1 ? 16u : 0u);
    EXPECT_EQ(s.op("barrier").calls, 1u);
    EXPECT_EQ(s.op("barrier").bytes_sent, 0u);
    EXPECT_EQ(s.op("never_called").calls, 0u);
    EXPECT_EQ(s.total.calls, 7u);
    EXPECT_EQ(s.total.bytes_sent, 60u + 48u + 21u + 15u + (r == 1 ? 24u : 0u));
    EXPECT_EQ(s.total.bytes_to_peers, 60u + 32u + 14u + 10u + (r == 1 ? 16u : 0u));
  }
}

TEST(DistStats, RaggedVariantsAndSingleRank) {
  constexpr int n = 2;
  std::vector<CommStats> stats(n);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<uint16_t> buf(16);
    std::vector<size_t> counts = {3, 5};  // elements per rank
    comm.reduce_scatterv_sum(buf.data(), buf.data() + 8, counts, DType::kF16);
    std::vector<uint8_t> send(16), recv(16);
    std::vector<size_t> sizes = {4, 6};
    comm.all_gatherv(send.data(), sizes[r], recv.data(), sizes);
    stats[r] = comm.stats();
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(stats[r].op("reduce_scatterv_sum").bytes_sent, 8u * 2u);
    EXPECT_EQ(stats[r].op("reduce_scatterv_sum").bytes_to_peers, (r == 0 ? 5u : 3u) * 2u);
    EXPECT_EQ(stats[r].op("all_gatherv").bytes_sent, 2u * (r == 0 ? 4u : 6u));
    EXPECT_EQ(stats[r].op("all_gatherv").bytes_to_peers, r == 0 ? 4u : 6u);
  }
  // One rank: everything stays home.
  run_ranks(1, [&](int, Communicator& comm) {
    std::vector<float> x(5);
    comm.all_reduce_sum(x.data(), 5, DType::kF32);
    std::vector<float> y(5);
    comm.all_to_all(x.data(), y.data(), 20);
    EXPECT_EQ(comm.stats().total.bytes_sent, 40u);
    EXPECT_EQ(comm.stats().total.bytes_to_peers, 0u);
  });
}

TEST(DistStats, ResetStats) {
  run_ranks(2, [&](int r, Communicator& comm) {
    std::vector<float> x(4);
    comm.all_reduce_sum(x.data(), 4, DType::kF32);
    EXPECT_EQ(comm.stats().total.calls, 1u);
    comm.reset_stats();
    EXPECT_EQ(comm.stats().total.calls, 0u);
    EXPECT_EQ(comm.stats().total.bytes_sent, 0u);
    EXPECT_EQ(comm.stats().op("all_reduce_sum").calls, 0u);
    EXPECT_TRUE(comm.stats().ops.empty());
    comm.all_reduce_sum(x.data(), 2, DType::kF32);
    EXPECT_EQ(comm.stats().total.calls, 1u);
    EXPECT_EQ(comm.stats().total.bytes_sent, 8u);
  });
}

// ------------------------------------------------------------------------------------------------
// failures: mismatched calls, invalid arguments, exceptions, abort

TEST(DistFailures, MismatchedCountIsReportedOnEveryRankAndGroupStaysUsable) {
  constexpr int n = 3;
  std::vector<RankError> errors(n);
  std::vector<float> after(n, 0.0f);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<float> x(8, 1.0f);
    errors[r] = catch_on_rank([&] { comm.all_reduce_sum(x.data(), r == 2 ? 7 : 8, DType::kF32); });
    // Nothing was reduced.
    EXPECT_EQ(x[0], 1.0f);
    EXPECT_EQ(comm.stats().total.calls, 0u);
    float y = float(r + 1);
    comm.all_reduce_sum(&y, 1, DType::kF32);
    after[r] = y;
  });
  for (int r = 0; r < n; ++r) {
    expect_refused(errors[r], ErrorKind::kInternal, {"mismatch", "count=7"});
    EXPECT_EQ(after[r], 6.0f);
  }
}

TEST(DistFailures, DifferentOperationsAreReported) {
  constexpr int n = 2;
  std::vector<RankError> errors(n);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<uint8_t> a(8), b(8);
    errors[r] = catch_on_rank([&] {
      if (r == 0) {
        comm.barrier();
      } else {
        comm.all_to_all(a.data(), b.data(), 4);
      }
    });
  });
  for (int r = 0; r < n; ++r) {
    expect_refused(errors[r], ErrorKind::kInternal, {"barrier", "all_to_all"});
  }
}

TEST(DistFailures, DtypeAndRootMismatches) {
  constexpr int n = 2;
  std::vector<RankError> dtype_errors(n), root_errors(n);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<uint8_t> x(16);
    dtype_errors[r] = catch_on_rank(
        [&] { comm.all_reduce_sum(x.data(), 2, r == 0 ? DType::kBF16 : DType::kF16); });
    root_errors[r] = catch_on_rank([&] { comm.broadcast(x.data(), 4, r); });
  });
  for (int r = 0; r < n; ++r) {
    expect_refused(dtype_errors[r], ErrorKind::kInternal, {});
    expect_refused(root_errors[r], ErrorKind::kInternal, {});
  }
}

TEST(DistFailures, AllToAllvSizesThatDoNotPairUp) {
  constexpr int n = 2;
  std::vector<RankError> errors(n);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<uint8_t> send(16), recv(16);
    // Rank 0 sends 4 bytes to rank 1, but rank 1 expects 3 from rank 0.
    std::vector<size_t> send_bytes = {4, 4};
    std::vector<size_t> recv_bytes = r == 0 ? std::vector<size_t>{4, 4} : std::vector<size_t>{3, 4};
    errors[r] = catch_on_rank(
        [&] { comm.all_to_allv(send.data(), send_bytes, recv.data(), recv_bytes); });
  });
  for (int r = 0; r < n; ++r) {
    expect_refused(errors[r], ErrorKind::kInternal, {"rank 0 sends 4 bytes to rank 1"});
  }
}

TEST(DistFailures, InvalidArgumentOnOneRankFailsEveryRank) {
  constexpr int n = 3;
  std::vector<RankError> bad_root(n), bad_vector(n);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<uint8_t> x(8);
    bad_root[r] = catch_on_rank([&] { comm.broadcast(x.data(), 8, r == 1 ? 7 : 0); });
    std::vector<size_t> sizes(r == 2 ? 2 : 3, 0);
    bad_vector[r] = catch_on_rank([&] { comm.all_to_allv(x.data(), sizes, x.data(), sizes); });
    comm.barrier();  // still usable
  });
  for (int r = 0; r < n; ++r) {
    expect_refused(bad_root[r], ErrorKind::kInvalidArgument, {"rank 1"});
    expect_refused(bad_vector[r], ErrorKind::kInvalidArgument, {"rank 2"});
  }
}

TEST(DistFailures, OverlappingAllToAllBuffersAreRejected) {
  std::vector<RankError> errors(2);
  run_ranks(2, [&](int r, Communicator& comm) {
    std::vector<uint8_t> buf(8);
    errors[r] = catch_on_rank([&] { comm.all_to_all(buf.data(), buf.data(), 4); });
  });
  for (const RankError& e : errors) expect_refused(e, ErrorKind::kInvalidArgument, {"overlap"});
}

TEST(DistFailures, ExceptionOnOneRankPropagatesWithoutDeadlock) {
  constexpr int n = 4;
  std::vector<RankError> others(n);
  try {
    run_ranks(n, [&](int r, Communicator& comm) {
      if (r == 1) throw std::runtime_error("boom on rank 1");
      others[r] = catch_on_rank([&] {
        float x = 1.0f;
        comm.all_reduce_sum(&x, 1, DType::kF32);  // rank 1 never joins
      });
      if (others[r].thrown) throw Error(others[r].kind, others[r].message, __FILE__, __LINE__);
    });
    ADD_FAILURE() << "run_ranks did not throw";
  } catch (const Error& e) {
    ADD_FAILURE() << "run_ranks rethrew the induced error instead of the original: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom on rank 1");
  }
  for (int r : {0, 2, 3}) {
    expect_refused(others[r], ErrorKind::kInternal, {"rank 1 failed: boom on rank 1"});
  }
}

TEST(DistFailures, RankThatReturnsEarlyDoesNotHangThePeers) {
  // Rank 0 makes one more call than rank 1.
  Error e = error_of([] {
    run_ranks(2, [](int r, Communicator& comm) {
      comm.barrier();
      if (r == 0) comm.barrier();
    });
  });
  EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  EXPECT_TRUE(contains(e.message(), "rank 1 finished")) << e.message();
}

TEST(DistFailures, AbortWakesWaitersAndFailsLaterCalls) {
  InProcessGroup group(3);
  auto c0 = group.communicator(0);
  auto c1 = group.communicator(1);
  auto c2 = group.communicator(2);
  std::vector<RankError> errors(2);
  std::atomic<int> started{0};
  std::thread t0([&] {
    started++;
    errors[0] = catch_on_rank([&] { c0->barrier(); });
  });
  std::thread t1([&] {
    started++;
    float x = 0;
    errors[1] = catch_on_rank([&] { c1->all_reduce_sum(&x, 1, DType::kF32); });
  });
  while (started.load() < 2) std::this_thread::yield();
  group.abort("stopped by the test");
  t0.join();
  t1.join();
  EXPECT_TRUE(group.aborted());
  for (const RankError& e : errors) expect_refused(e, ErrorKind::kInternal, {"stopped by the test"});
  Error later = error_of([&] { c2->barrier(); });
  EXPECT_EQ(later.kind(), ErrorKind::kInternal);
  EXPECT_TRUE(contains(later.message(), "stopped by the test"));
}

TEST(DistFailures, GroupArguments) {
  EXPECT_EQ(error_of([] { InProcessGroup g(0); }).kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_of([] { run_ranks(0, [](int, Communicator&) {}); }).kind(),
            ErrorKind::kInvalidArgument);
  InProcessGroup g(2);
  EXPECT_EQ(g.size(), 2);
  EXPECT_EQ(error_of([&] { g.communicator(2); }).kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_of([&] { g.communicator(-1); }).kind(), ErrorKind::kInvalidArgument);
  auto c = g.communicator(1);
  EXPECT_EQ(c->rank(), 1);
  EXPECT_EQ(error_of([&] { g.communicator(1); }).kind(), ErrorKind::kInvalidArgument);
}

// ------------------------------------------------------------------------------------------------
// DistConfig

const BuildCaps kCpu{};  // no CUDA, no peer access, no DeepEP

TEST(DistConfig, DefaultsAndCpuBackendsAreValid) {
  DistConfig config;
  EXPECT_EQ(config.tp, 1);
  EXPECT_EQ(config.ep, 1);
  EXPECT_EQ(config.dp, 1);
  EXPECT_EQ(config.ep_backend, "local_allreduce");
  EXPECT_NO_THROW(validate_dist_config(config, kCpu));
  for (const char* name :
       {"local_allreduce", "allgather_reducescatter", "alltoall_padded", "alltoall_packed"}) {
    config.ep = 4;
    config.ep_backend = name;
    EXPECT_NO_THROW(validate_dist_config(config, kCpu)) << name;
  }
}

TEST(DistConfig, BackendNames) {
  EXPECT_EQ(ep_backend_names(),
            (std::vector<std::string>{"local_allreduce", "allgather_reducescatter",
                                      "alltoall_padded", "alltoall_packed", "p2p", "deepep"}));
  EXPECT_EQ(available_ep_backends(kCpu),
            (std::vector<std::string>{"local_allreduce", "allgather_reducescatter",
                                      "alltoall_padded", "alltoall_packed"}));
  EXPECT_EQ(parse_ep_backend("local_allreduce"), EpBackend::kLocalAllreduce);
  EXPECT_EQ(parse_ep_backend("allgather_reducescatter"), EpBackend::kAllgatherReducescatter);
  EXPECT_EQ(parse_ep_backend("alltoall_padded"), EpBackend::kAlltoallPadded);
  EXPECT_EQ(parse_ep_backend("alltoall_packed"), EpBackend::kAlltoallPacked);
  EXPECT_EQ(parse_ep_backend("p2p"), EpBackend::kP2p);
  EXPECT_EQ(parse_ep_backend("deepep"), EpBackend::kDeepep);
  for (const std::string& name : ep_backend_names()) {
    EXPECT_EQ(ep_backend_name(parse_ep_backend(name)), name);
  }
  EXPECT_TRUE(ep_backend_needs_gpu(EpBackend::kP2p));
  EXPECT_TRUE(ep_backend_needs_gpu(EpBackend::kDeepep));
  EXPECT_FALSE(ep_backend_needs_gpu(EpBackend::kAlltoallPacked));
}

// What the engine builds on: which backends may sit inside a decode graph, which leave partial
// sums for the caller to reduce, and how many rows their experts must be sized for.
TEST(DistConfig, BackendTraitsDescribeTheExchange) {
  for (const std::string& name : ep_backend_names()) {
    const EpBackendTraits& t = ep_backend_traits(parse_ep_backend(name));
    const bool host_driven = name.find("all") != std::string::npos && name != "local_allreduce";
    EXPECT_EQ(t.graph_capturable, !host_driven && name != "deepep") << name;
    EXPECT_EQ(t.reduced_output, name != "local_allreduce") << name;
    EXPECT_EQ(t.host_counts, name == "alltoall_packed") << name;
    EXPECT_EQ(t.needs_peer_access, name == "p2p") << name;
    EXPECT_EQ(t.needs_gpu, ep_backend_needs_gpu(parse_ep_backend(name))) << name;
  }
  // Sharded backends receive at most one slice of ceil(T / n) rows from each of n ranks.
  const EpBackendTraits& packed = ep_backend_traits(EpBackend::kAlltoallPacked);
  EXPECT_EQ(packed.expert_rows(10, 4), 12);
  EXPECT_EQ(packed.expert_rows(1, 8), 8);
  EXPECT_EQ(packed.expert_rows(64, 2), 64);
  EXPECT_EQ(ep_backend_traits(EpBackend::kAllgatherReducescatter).expert_rows(10, 4), 10);
  EXPECT_EQ(ep_backend_traits(EpBackend::kLocalAllreduce).expert_rows(1, 8), 1);
  EXPECT_EQ(ep_backend_traits(EpBackend::kP2p).expert_rows(5, 2), 6);
  // Data-parallel attention: each rank passes its own T rows, and all n ranks' may arrive.
  for (const std::string& name : ep_backend_names()) {
    const EpBackendTraits& t = ep_backend_traits(parse_ep_backend(name));
    EXPECT_EQ(t.runs_data_parallel(), name != "local_allreduce") << name;
    if (t.runs_data_parallel()) EXPECT_EQ(t.expert_rows(5, 4, true), 20) << name;
  }
}

TEST(DistConfig, UnknownBackendListsValidNames) {
  DistConfig config;
  config.ep_backend = "alltoall";
  Error e = error_of([&] { validate_dist_config(config, kCpu); });
  EXPECT_EQ(e.kind(), ErrorKind::kConfig);
  EXPECT_TRUE(contains(e.message(), "'alltoall'")) << e.message();
  for (const char* name : {"local_allreduce", "allgather_reducescatter", "alltoall_padded",
                           "alltoall_packed", "p2p", "deepep"}) {
    EXPECT_TRUE(contains(e.message(), name)) << e.message();
  }
  EXPECT_EQ(error_of([] { parse_ep_backend("LOCAL_ALLREDUCE"); }).kind(), ErrorKind::kConfig);
  EXPECT_EQ(error_of([] { parse_ep_backend(""); }).kind(), ErrorKind::kConfig);
}

TEST(DistConfig, GpuBackendsOnCpuBuildNeedCuda) {
  for (const char* name : {"p2p", "deepep"}) {
    DistConfig config;
    config.ep = 2;
    config.ep_backend = name;
    Error e = error_of([&] { validate_dist_config(config, kCpu); });
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << name;
    EXPECT_TRUE(contains(e.message(), "CUDA")) << e.message();
    EXPECT_TRUE(contains(e.message(), std::string("'") + name + "'")) << e.message();
    // The names available here are listed.
    for (const char* available :
         {"local_allreduce", "allgather_reducescatter", "alltoall_padded", "alltoall_packed"}) {
      EXPECT_TRUE(contains(e.message(), available)) << e.message();
    }
  }
}

TEST(DistConfig, GpuBackendsWithCuda) {
  DistConfig config;
  config.ep = 2;
  config.ep_backend = "p2p";
  BuildCaps cuda_only;
  cuda_only.cuda = true;
  Error no_peer = error_of([&] { validate_dist_config(config, cuda_only); });
  EXPECT_EQ(no_peer.kind(), ErrorKind::kUnsupported);
  EXPECT_TRUE(contains(no_peer.message(), "peer access")) << no_peer.message();
  BuildCaps peers = cuda_only;
  peers.peer_access = true;
  EXPECT_NO_THROW(validate_dist_config(config, peers));
  EXPECT_EQ(available_ep_backends(peers).size(), 5u);

  config.ep_backend = "deepep";
  Error no_deepep = error_of([&] { validate_dist_config(config, peers); });
  EXPECT_EQ(no_deepep.kind(), ErrorKind::kUnsupported);
  EXPECT_TRUE(contains(no_deepep.message(), "not built")) << no_deepep.message();
  BuildCaps all = peers;
  all.deepep = true;
  EXPECT_NO_THROW(validate_dist_config(config, all));
}

TEST(DistConfig, ParallelDegrees) {
  auto kind_and_message = [](DistConfig config) {
    Error e = error_of([&] { validate_dist_config(config, kCpu); });
    return std::make_pair(e.kind(), e.message());
  };
  DistConfig dp;
  dp.dp = 2;
  auto [dp_kind, dp_message] = kind_and_message(dp);
  EXPECT_EQ(dp_kind, ErrorKind::kUnsupported);
  EXPECT_TRUE(contains(dp_message, "data parallelism is not supported yet")) << dp_message;

  DistConfig tp;
  tp.tp = 2;
  auto [tp_kind, tp_message] = kind_and_message(tp);
  EXPECT_EQ(tp_kind, ErrorKind::kUnsupported);
  EXPECT_TRUE(contains(tp_message, "tensor-parallel attention arrives with the multi-GPU backend"))
      << tp_message;

  for (int bad : {0, -1}) {
    DistConfig c1;
    c1.ep = bad;
    EXPECT_EQ(kind_and_message(c1).first, ErrorKind::kInvalidArgument);
    DistConfig c2;
    c2.tp = bad;
    EXPECT_EQ(kind_and_message(c2).first, ErrorKind::kInvalidArgument);
    DistConfig c3;
    c3.dp = bad;
    EXPECT_EQ(kind_and_message(c3).first, ErrorKind::kInvalidArgument);
  }
  DistConfig large_ep;
  large_ep.ep = 64;
  EXPECT_NO_THROW(validate_dist_config(large_ep, kCpu));
}

TEST(DistConfig, EpAgainstModel) {
  DistConfig config;
  config.ep = 8;
  EXPECT_NO_THROW(validate_ep_for_model(config, 8));
  EXPECT_NO_THROW(validate_ep_for_model(config, 128));
  config.ep = 9;
  Error e = error_of([&] { validate_ep_for_model(config, 8); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_TRUE(contains(e.message(), "ep 9 is larger than the number of experts 8")) << e.message();
  config.ep = 2;
  EXPECT_EQ(error_of([&] { validate_ep_for_model(config, 0); }).kind(),
            ErrorKind::kInvalidArgument);
  config.ep = 1;
  EXPECT_NO_THROW(validate_ep_for_model(config, 0));  // a dense model on one rank
}

}  // namespace
}  // namespace moe::dist
