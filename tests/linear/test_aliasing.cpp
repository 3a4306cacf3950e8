// An output that shares memory with an input. Every out-parameter entry
// point throws std::invalid_argument naming the function and the operand before writing
// anything, whatever the algorithm; disjoint blocks of one packed buffer (which interleave in
// memory) are accepted and give the separate-matrix result; the recurrent classes copy their
// inputs first, so there aliasing is allowed and gives the right result. The overlap
// predicate itself is checked against a brute-force intersection of the sets of bytes.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using test::Index;
using Eigen::Dynamic;
using MatF = Eigen::MatrixXf;
using RowMatF = Eigen::Matrix<float, Dynamic, Dynamic, Eigen::RowMajor>;
using DynStride = Eigen::Stride<Dynamic, Dynamic>;
template <class M>
using SMap = Eigen::Map<M, Eigen::Unaligned, DynStride>;
using ColView = SMap<MatF>;
using RowView = SMap<RowMatF>;
using MaskView = Eigen::Map<const Eigen::Array<bool, Dynamic, 1>>;

// A view of rows x cols starting at (r0, c0) of the rows0 x cols0 matrix stored at `data`
// (column-major or row-major): a Block in all but type, so that every entry point can be
// called with the same operand types whatever the case.
template <class View>
View view_of(float* data, Index rows0, Index cols0, Index r0, Index c0, Index rows, Index cols) {
  constexpr bool row_major = View::IsRowMajor;
  const Index ld = row_major ? cols0 : rows0;
  float* p = data + (row_major ? r0 * ld + c0 : c0 * ld + r0);
  return View(p, rows, cols, DynStride(ld, 1));
}

// ---------------------------------------------------------------------------------------------
// Every out-parameter entry point, callable on column-major and row-major views.
// ---------------------------------------------------------------------------------------------

struct Entry {
  std::string name;  // as in the message, without "linattn::"
  bool masked = false;
  std::function<void(const ColView&, const ColView&, const ColView&, const MaskView&, ColView&)> col;
  std::function<void(const RowView&, const RowView&, const RowView&, const MaskView&, RowView&)> row;
};

template <class F>
Entry make_entry(std::string name, bool masked, F f) {
  Entry e;
  e.name = std::move(name);
  e.masked = masked;
  e.col = [f](const ColView& Q, const ColView& K, const ColView& V, const MaskView& m, ColView& out) {
    f(Q, K, V, m, out);
  };
  e.row = [f](const RowView& Q, const RowView& K, const RowView& V, const MaskView& m, RowView& out) {
    f(Q, K, V, m, out);
  };
  return e;
}

constexpr Index kHeads = 2;

std::vector<Entry> entries() {
  using linattn::CausalAlgorithm;
  using linattn::EluPlusOne;
  using linattn::SoftmaxAlgorithm;
  using linattn::SoftmaxSplit;
  static linattn::Workspace<float> ws;
  static linattn::MultiHeadWorkspace<float> mws;
  std::vector<Entry> list;
  const auto phis = std::make_tuple(EluPlusOne{}, SoftmaxSplit{});
  std::apply(
      [&](auto... phi) {
        (list.push_back(make_entry("linear_attention", false,
                                   [phi](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                                     linattn::linear_attention(Q, K, V, phi, out, ws);
                                   })),
         ...);
        (list.push_back(make_entry("masked_linear_attention", true,
                                   [phi](const auto& Q, const auto& K, const auto& V, const auto& m, auto& out) {
                                     linattn::masked_linear_attention(Q, K, V, m, phi, out, ws);
                                   })),
         ...);
      },
      phis);
  for (const CausalAlgorithm algo :
       {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent, CausalAlgorithm::Auto}) {
    linattn::CausalOptions opts;
    opts.algorithm = algo;
    std::apply(
        [&](auto... phi) {
          (list.push_back(make_entry("causal_linear_attention", false,
                                     [phi, opts](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                                       linattn::LinearAttentionState<float> st;
                                       linattn::causal_linear_attention(Q, K, V, phi, st, out, ws, opts);
                                     })),
           ...);
          (list.push_back(make_entry("masked_causal_linear_attention", true,
                                     [phi, opts](const auto& Q, const auto& K, const auto& V, const auto& m, auto& out) {
                                       linattn::LinearAttentionState<float> st;
                                       linattn::masked_causal_linear_attention(Q, K, V, m, phi, st, out, ws, opts);
                                     })),
           ...);
        },
        phis);
    list.push_back(make_entry("multihead_causal_linear_attention", false,
                              [opts](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                                linattn::multihead_causal_linear_attention(Q, K, V, kHeads, EluPlusOne{}, out,
                                                                           mws, opts);
                              }));
    list.push_back(make_entry("batched_causal_linear_attention", false,
                              [opts](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                                const std::vector<Index> offsets = {0, Q.rows() / 3, Q.rows()};
                                linattn::batched_causal_linear_attention(Q, K, V, offsets, kHeads, EluPlusOne{},
                                                                         out, mws, opts);
                              }));
  }
  for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Tiled, SoftmaxAlgorithm::Naive}) {
    list.push_back(make_entry("softmax_attention", false,
                              [algo](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                                linattn::softmax_attention(Q, K, V, out, ws, algo);
                              }));
    list.push_back(make_entry("causal_softmax_attention", false,
                              [algo](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                                linattn::causal_softmax_attention(Q, K, V, out, ws, algo);
                              }));
    list.push_back(make_entry("multihead_softmax_attention", false,
                              [algo](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                                linattn::multihead_softmax_attention(Q, K, V, kHeads, out, mws, algo);
                              }));
    list.push_back(make_entry("multihead_causal_softmax_attention", false,
                              [algo](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                                linattn::multihead_causal_softmax_attention(Q, K, V, kHeads, out, mws, algo);
                              }));
  }
  list.push_back(make_entry("multihead_linear_attention", false,
                            [](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                              linattn::multihead_linear_attention(Q, K, V, kHeads, EluPlusOne{}, out, mws);
                            }));
  list.push_back(make_entry("batched_linear_attention", false,
                            [](const auto& Q, const auto& K, const auto& V, const auto&, auto& out) {
                              const std::vector<Index> offsets = {0, Q.rows() / 3, Q.rows()};
                              linattn::batched_linear_attention(Q, K, V, offsets, offsets, kHeads,
                                                                EluPlusOne{}, out, mws);
                            }));
  return list;
}

// N queries and keys (causal entries need N == L; out = Q or K needs M == D), crossing the
// 48-row chunks, the 128-row blocks and one 256-row softmax tile; D = M even for 2 heads.
constexpr Index N = 300, D = 6;

// A buffer of (N + 1) x (4·D + 1): Q, K, V are its column blocks 0, 1, 2 (of D columns) and
// block 3 is free for a disjoint output; the extra row and column let an output be shifted.
struct Buffer {
  static constexpr Index rows = N + 1, cols = 4 * D + 1;
  std::vector<float> data;
  explicit Buffer(std::uint32_t seed) : data(static_cast<std::size_t>(rows * cols)) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (float& x : data) x = dist(gen);
  }
  template <class View>
  View at(Index r0, Index c0, Index r, Index c) {
    return view_of<View>(data.data(), rows, cols, r0, c0, r, c);
  }
};

// The mask: key 5 and every 7th key from 11 on are masked.
Eigen::Array<bool, Dynamic, 1> the_mask() {
  Eigen::Array<bool, Dynamic, 1> m(N);
  for (Index j = 0; j < N; ++j) m(j) = !(j == 5 || (j >= 11 && j % 7 == 4));
  return m;
}

struct AliasCase {
  std::string what;      // for failure messages
  Index r0, c0;          // where `out` starts in the buffer
  std::string operand;   // the operand the message must name
};

// out = Q, K, V exactly, and shifted by one row or one column so that it only partly
// overlaps (the first overlapped operand in the order Q, K, V is named).
const std::vector<AliasCase>& alias_cases() {
  static const std::vector<AliasCase> list = {
      {"out = Q", 0, 0, "Q"},
      {"out = K", 0, D, "K"},
      {"out = V", 0, 2 * D, "V"},
      {"out = Q shifted down one row", 1, 0, "Q"},
      {"out = V shifted down one row", 1, 2 * D, "V"},
      {"out = V shifted right one column (also covers the free column)", 0, 2 * D + 1, "V"},
      {"out = K shifted left one column (last column of Q)", 0, D - 1, "Q"},
      {"out = V shifted left one column (last column of K)", 0, 2 * D - 1, "K"},
      {"out = V shifted down and right (one element of block 3)", 1, 2 * D + 1, "V"},
  };
  return list;
}

template <class View>
void check_alias_cases(const Entry& e, const char* layout) {
  const auto mask = the_mask();
  const MaskView m(mask.data(), mask.size());
  for (const AliasCase& c : alias_cases()) {
    Buffer buf(7);
    const std::vector<float> before = buf.data;
    const View Q = buf.at<View>(0, 0, N, D), K = buf.at<View>(0, D, N, D), V = buf.at<View>(0, 2 * D, N, D);
    View out = buf.at<View>(c.r0, c.c0, N, D);
    const std::string where = e.name + " [" + layout + ", " + c.what + "]";
    try {
      if constexpr (View::IsRowMajor)
        e.row(Q, K, V, m, out);
      else
        e.col(Q, K, V, m, out);
      ADD_FAILURE() << where << ": no exception";
    } catch (const std::invalid_argument& ex) {
      const std::string msg = ex.what();
      for (const std::string& part :
           {"linattn::" + e.name + ":", "overlaps the memory of " + c.operand + " ",
            std::string("out is 300x6"), c.operand + " is 300x6"})
        EXPECT_NE(msg.find(part), std::string::npos) << where << ": \"" << msg << "\" lacks \"" << part << "\"";
    }
    EXPECT_TRUE(buf.data == before) << where << ": the buffer was written before the check";
  }
}

TEST(Aliasing, EveryEntryRejectsAnOutputOverlappingQKV) {
  for (const Entry& e : entries()) {
    check_alias_cases<ColView>(e, "column-major");
    check_alias_cases<RowView>(e, "row-major");
  }
}

// The packed layout: Q, K, V and out are column blocks 0..3 of one buffer. In a row-major
// buffer the blocks interleave (row i of out lies between rows i and i + 1 of V), in a
// column-major one they are adjacent; both must be accepted and give the separate-matrix
// result.
template <class View, class Plain>
void check_packed_blocks(const Entry& e, const char* layout) {
  const auto mask = the_mask();
  const MaskView m(mask.data(), mask.size());
  Buffer buf(11);
  const View Q = buf.at<View>(0, 0, N, D), K = buf.at<View>(0, D, N, D), V = buf.at<View>(0, 2 * D, N, D);
  // A free block that touches V at both ends of every row (row-major) or column (column-major).
  View out = buf.at<View>(0, 3 * D, N, D);
  const std::string where = e.name + " [" + layout + ", packed blocks]";
  Plain q = Q, k = K, v = V, expected(N, D);
  View q_view(q.data(), N, D, DynStride(View::IsRowMajor ? D : N, 1));
  View k_view(k.data(), N, D, DynStride(View::IsRowMajor ? D : N, 1));
  View v_view(v.data(), N, D, DynStride(View::IsRowMajor ? D : N, 1));
  View e_view(expected.data(), N, D, DynStride(View::IsRowMajor ? D : N, 1));
  try {
    if constexpr (View::IsRowMajor) {
      e.row(q_view, k_view, v_view, m, e_view);
      e.row(Q, K, V, m, out);
    } else {
      e.col(q_view, k_view, v_view, m, e_view);
      e.col(Q, K, V, m, out);
    }
  } catch (const std::exception& ex) {
    ADD_FAILURE() << where << ": " << ex.what();
    return;
  }
  // Same operations on the same numbers in memory of another stride: equal up to the
  // vectorisation of unaligned rows (measured: 0 on x86-64 with AVX2, see the log).
  const double err = test::max_abs_diff(Plain(out), expected);
  test::report_error(where, err);
  EXPECT_LE(err, 4 * 1.1920929e-7) << where;
  EXPECT_GT(test::max_abs(expected), 0.0) << where;
}

TEST(Aliasing, DisjointBlocksOfOnePackedBufferAreAccepted) {
  for (const Entry& e : entries()) {
    check_packed_blocks<ColView, MatF>(e, "column-major");
    check_packed_blocks<RowView, RowMatF>(e, "row-major");
  }
}

// The key mask must not share memory with the output either (the causal kernels read it chunk
// by chunk while writing; the non-causal ones are rejected alike for one rule). The mask's
// bytes live inside the output's floats, as in an arena that packs several buffers.
TEST(Aliasing, OutputOverlappingTheKeyMaskIsRejected) {
  for (const Entry& e : entries()) {
    if (!e.masked) continue;
    Buffer buf(3);
    MatF out_store = MatF::Zero(N + 1, D);
    bool* mask_bytes = reinterpret_cast<bool*>(out_store.data() + N * D / 2);
    for (Index j = 0; j < N; ++j) mask_bytes[j] = true;
    const MaskView m(mask_bytes, N);
    const std::vector<float> before(out_store.data(), out_store.data() + out_store.size());
    const ColView Q = buf.at<ColView>(0, 0, N, D), K = buf.at<ColView>(0, D, N, D), V = buf.at<ColView>(0, 2 * D, N, D);
    ColView out(out_store.data() + 1, N, D, DynStride(N + 1, 1));
    try {
      e.col(Q, K, V, m, out);
      ADD_FAILURE() << e.name << ": no exception";
    } catch (const std::invalid_argument& ex) {
      const std::string msg = ex.what();
      for (const std::string& part : {"linattn::" + e.name + ":", std::string("overlaps the memory of the key mask"),
                                      std::string("the key mask is 300x1"), std::string("out is 300x6")})
        EXPECT_NE(msg.find(part), std::string::npos) << e.name << ": \"" << msg << "\" lacks \"" << part << "\"";
    }
    EXPECT_TRUE(std::equal(before.begin(), before.end(), out_store.data())) << e.name << ": written";
    // The mask's bytes just past the output's last float: accepted.
    MatF store2 = MatF::Zero(N * D + N, 1);
    bool* after = reinterpret_cast<bool*>(store2.data() + N * D);
    for (Index j = 0; j < N; ++j) after[j] = true;
    ColView out2(store2.data(), N, D, DynStride(N, 1));
    EXPECT_NO_THROW(e.col(Q, K, V, MaskView(after, N), out2)) << e.name;
  }
}

// A product operand is evaluated into a temporary before the output is written (Eigen's
// nested_eval), so it may read the output's memory: documented as safe, checked here.
TEST(Aliasing, ProductOperandReadingTheOutputIsSafe) {
  const MatF Q = test::random_matrix<float>(N, D, 1), K = test::random_matrix<float>(N, D, 2);
  const MatF V0 = test::random_matrix<float>(N, D, 3), I = MatF::Identity(D, D);
  linattn::Workspace<float> ws;
  MatF expected(N, D), out(N, D);
  for (const auto algo : {linattn::SoftmaxAlgorithm::Tiled, linattn::SoftmaxAlgorithm::Naive}) {
    linattn::softmax_attention(Q, K, V0, expected, ws, algo);
    out = V0;
    linattn::softmax_attention(Q, K, out * I, out, ws, algo);
    EXPECT_EQ(test::max_abs_diff(out, expected), 0.0);
  }
  linattn::CausalOptions opts;
  opts.algorithm = linattn::CausalAlgorithm::Chunked;
  linattn::LinearAttentionState<float> s1, s2;
  linattn::causal_linear_attention(Q, K, V0, linattn::EluPlusOne{}, s1, expected, ws, opts);
  out = V0;
  linattn::causal_linear_attention(Q, K, out * I, linattn::EluPlusOne{}, s2, out, ws, opts);
  EXPECT_EQ(test::max_abs_diff(out, expected), 0.0);
}

// ---------------------------------------------------------------------------------------------
// The recurrent classes copy their inputs before writing: aliasing is allowed there.
// ---------------------------------------------------------------------------------------------

TEST(Aliasing, RecurrentStepMayWriteOverItsInputs) {
  const Index T = 20;
  const MatF X = test::random_matrix<float>(T, 3 * D, 21);
  for (int which = 0; which < 3; ++which) {
    linattn::RecurrentLinearAttention<linattn::EluPlusOne, float> a(D, D), b(D, D);
    for (Index t = 0; t < T; ++t) {
      Eigen::VectorXf q = X.row(t).segment(0, D).transpose(), k = X.row(t).segment(D, D).transpose(),
                      v = X.row(t).segment(2 * D, D).transpose();
      Eigen::VectorXf expected(D);
      a.step(q, k, v, expected);
      Eigen::VectorXf& out = which == 0 ? q : which == 1 ? k : v;
      b.step(q, k, v, out);
      EXPECT_EQ(test::max_abs_diff(out, expected), 0.0) << "operand " << which << ", token " << t;
    }
  }
  linattn::LinearCrossAttention<linattn::EluPlusOne, float> cross(D, D);
  cross.set_memory(X.leftCols(D), X.middleCols(D, D));
  Eigen::VectorXf q = X.row(3).segment(2 * D, D).transpose();
  const Eigen::VectorXf expected = cross.query(q);
  cross.query(q, q);
  EXPECT_EQ(test::max_abs_diff(q, expected), 0.0);
}

// MultiHeadRecurrentLinearAttention runs its heads one after the other: with M > D, head h's
// output covers inputs of head h + 1, which must still be read as they were.
TEST(Aliasing, MultiHeadRecurrentStepMayWriteOverItsInputs) {
  const Index H = 3, T = 12;
  for (const auto& dims : {std::pair<Index, Index>{2, 2}, {2, 5}, {5, 2}}) {
    const Index Dh = dims.first, Mh = dims.second;
    const MatF X = test::random_matrix<float>(T, 2 * H * Dh + H * Mh, 31);
    for (int which = 0; which < 3; ++which) {
      linattn::MultiHeadRecurrentLinearAttention<linattn::EluPlusOne, float> a(H, Dh, Mh), b(H, Dh, Mh);
      for (Index t = 0; t < T; ++t) {
        const Eigen::VectorXf q0 = X.row(t).segment(0, H * Dh).transpose();
        const Eigen::VectorXf k0 = X.row(t).segment(H * Dh, H * Dh).transpose();
        const Eigen::VectorXf v0 = X.row(t).segment(2 * H * Dh, H * Mh).transpose();
        Eigen::VectorXf expected(H * Mh);
        a.step(q0, k0, v0, expected);
        // The aliased input lives at the start of a buffer large enough for the output.
        Eigen::VectorXf store = Eigen::VectorXf::Zero(std::max(H * Dh, H * Mh));
        const Eigen::VectorXf& src = which == 0 ? q0 : which == 1 ? k0 : v0;
        store.head(src.size()) = src;
        auto aliased = store.head(src.size());
        auto out = store.head(H * Mh);
        const std::string where = "D=" + std::to_string(Dh) + " M=" + std::to_string(Mh) +
                                  " operand " + std::to_string(which) + " token " + std::to_string(t);
        if (which == 0) b.step(aliased, k0, v0, out);
        if (which == 1) b.step(q0, aliased, v0, out);
        if (which == 2) b.step(q0, k0, aliased, out);
        EXPECT_EQ(test::max_abs_diff(Eigen::VectorXf(out), expected), 0.0) << where;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The overlap predicate against brute force.
// ---------------------------------------------------------------------------------------------

// Marks the bytes of a region given by (offset, width, two strides and counts) in `marks`.
struct RawRegion {
  std::int64_t offset, width, s0, n0, s1, n1;
};

bool brute_force_overlap(const RawRegion& a, const RawRegion& b, std::vector<unsigned char>& marks) {
  std::fill(marks.begin(), marks.end(), 0);
  for (std::int64_t i = 0; i < a.n0; ++i)
    for (std::int64_t j = 0; j < a.n1; ++j)
      for (std::int64_t w = 0; w < a.width; ++w)
        marks.at(static_cast<std::size_t>(a.offset + i * a.s0 + j * a.s1 + w)) = 1;
  for (std::int64_t i = 0; i < b.n0; ++i)
    for (std::int64_t j = 0; j < b.n1; ++j)
      for (std::int64_t w = 0; w < b.width; ++w)
        if (marks.at(static_cast<std::size_t>(b.offset + i * b.s0 + j * b.s1 + w))) return true;
  return false;
}

TEST(OverlapPredicate, RandomStridedRegionsMatchBruteForce) {
  // Offsets, strides (possibly negative or zero) and widths of 1, 2, 4, 8 bytes in a shared
  // buffer; strides in units of the width (as for one scalar type) or arbitrary bytes (a bool
  // mask against float storage). Every region stays inside the buffer.
  std::mt19937 gen(2024);
  const auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  // Offsets in [6000, 6800] and extents under 4100 bytes either way keep every byte inside.
  constexpr std::int64_t kBytes = 16384;
  std::vector<unsigned char> marks(kBytes);
  alignas(64) static unsigned char buffer[kBytes];
  const auto base = reinterpret_cast<std::uintptr_t>(buffer);
  int overlapping = 0, interleaved_disjoint = 0;
  const int cases = 100000;
  for (int it = 0; it < cases; ++it) {
    const int mode = uni(0, 3);
    RawRegion r[2];
    for (RawRegion& x : r) {
      x.width = mode == 0 ? 4 : std::int64_t(1) << uni(0, 3);
      const std::int64_t unit = mode == 0 ? 4 : mode == 1 ? x.width : 1;
      x.n0 = uni(0, 7);
      x.n1 = uni(0, 7);
      x.s0 = uni(-12, 12) * unit;
      x.s1 = uni(-40, 40) * unit;
      if (uni(0, 3) == 0) x.s1 = x.s0 * uni(-6, 6);  // commensurate strides
      x.offset = (6000 + uni(0, 800)) / unit * unit;
    }
    if (mode == 3) r[1].s1 = r[0].s1;  // a shared outer stride (blocks of one matrix)
    const bool expected = brute_force_overlap(r[0], r[1], marks);
    const auto region = [&](const RawRegion& x) {
      return linattn::detail::make_memory_region(base + static_cast<std::uintptr_t>(x.offset), x.width, x.s0,
                                                 x.n0, x.s1, x.n1);
    };
    const auto A = region(r[0]), B = region(r[1]);
    ASSERT_EQ(linattn::detail::regions_overlap(A, B), expected)
        << "case " << it << ": A = " << r[0].offset << " + " << r[0].s0 << "x" << r[0].n0 << " + " << r[0].s1
        << "x" << r[0].n1 << " (width " << r[0].width << "), B = " << r[1].offset << " + " << r[1].s0 << "x"
        << r[1].n0 << " + " << r[1].s1 << "x" << r[1].n1 << " (width " << r[1].width << ")";
    ASSERT_EQ(linattn::detail::regions_overlap(B, A), expected) << "case " << it << " (swapped)";
    overlapping += expected;
    if (!expected && !A.empty && !B.empty) {
      // Disjoint although their address ranges intersect: what an interval test gets wrong.
      const auto lo = std::max(A.base, B.base);
      const auto hi = std::min(A.base + static_cast<std::uintptr_t>(A.extent()),
                               B.base + static_cast<std::uintptr_t>(B.extent()));
      interleaved_disjoint += lo < hi;
    }
  }
  std::cout << "[ overlap  ] " << overlapping << " of " << cases << " overlap; " << interleaved_disjoint
            << " are disjoint with intersecting address ranges" << std::endl;
  EXPECT_GT(overlapping, cases / 20);
  EXPECT_GT(interleaved_disjoint, cases / 20);
}

// Eigen Maps with runtime inner and outer strides, row- and column-major, against the set of
// the coefficients' addresses: checks memory_region() (data(), strides, storage order) too.
template <class MA, class MB>
void check_maps(std::mt19937& gen, float* buffer, Index size, int& overlapping) {
  const auto uni = [&](int lo, int hi) { return static_cast<Index>(std::uniform_int_distribution<int>(lo, hi)(gen)); };
  const auto make = [&](auto* type_tag) {
    using M = std::remove_pointer_t<decltype(type_tag)>;
    const Index rows = uni(0, 6), cols = uni(0, 6);
    const Index inner = uni(-4, 5), outer = uni(-30, 30);
    // Place (0, 0) so that every coefficient stays inside the buffer.
    Index lo = 0, hi = 0;
    const Index n_in = M::IsRowMajor ? cols : rows, n_out = M::IsRowMajor ? rows : cols;
    for (const Index off : {Index(0), inner * std::max<Index>(n_in - 1, 0)}) lo = std::min(lo, off), hi = std::max(hi, off);
    Index lo2 = lo, hi2 = hi;
    for (const Index off : {Index(0), outer * std::max<Index>(n_out - 1, 0)}) lo2 = std::min(lo2, lo + off), hi2 = std::max(hi2, hi + off);
    const Index start = -lo2 + uni(0, static_cast<int>(size - 1 - (hi2 - lo2)));
    return SMap<M>(buffer + start, rows, cols, DynStride(outer, inner));
  };
  const auto a = make(static_cast<MA*>(nullptr));
  const auto b = make(static_cast<MB*>(nullptr));
  bool expected = false;
  for (Index i = 0; i < a.rows() && !expected; ++i)
    for (Index j = 0; j < a.cols() && !expected; ++j)
      for (Index k = 0; k < b.rows() && !expected; ++k)
        for (Index l = 0; l < b.cols() && !expected; ++l) expected = &a.coeff(i, j) == &b.coeff(k, l);
  ASSERT_EQ(linattn::detail::memory_overlaps(a, b), expected)
      << "a: " << a.rows() << "x" << a.cols() << " strides (" << a.innerStride() << ", " << a.outerStride()
      << ") at " << (a.data() - buffer) << "; b: " << b.rows() << "x" << b.cols() << " strides ("
      << b.innerStride() << ", " << b.outerStride() << ") at " << (b.data() - buffer);
  overlapping += expected;
}

TEST(OverlapPredicate, EigenMapsWithStridesMatchBruteForce) {
  std::mt19937 gen(77);
  std::vector<float> buffer(400);
  int overlapping = 0;
  for (int it = 0; it < 5000; ++it) {
    check_maps<MatF, MatF>(gen, buffer.data(), 400, overlapping);
    check_maps<MatF, RowMatF>(gen, buffer.data(), 400, overlapping);
    check_maps<RowMatF, MatF>(gen, buffer.data(), 400, overlapping);
    check_maps<RowMatF, RowMatF>(gen, buffer.data(), 400, overlapping);
  }
  std::cout << "[ overlap  ] " << overlapping << " of 20000 map pairs overlap" << std::endl;
  EXPECT_GT(overlapping, 1000);
}

// Every pair of blocks (and rows, columns, vectors) of one 7 x 9 matrix in each storage order.
template <class M>
void check_all_blocks() {
  M X = M::Zero(7, 9);
  const auto overlap_by_address = [](auto&& a, auto&& b) {
    for (Index i = 0; i < a.rows(); ++i)
      for (Index j = 0; j < a.cols(); ++j)
        for (Index k = 0; k < b.rows(); ++k)
          for (Index l = 0; l < b.cols(); ++l)
            if (&a.coeffRef(i, j) == &b.coeffRef(k, l)) return true;
    return false;
  };
  std::mt19937 gen(5);
  const auto uni = [&](Index lo, Index hi) { return std::uniform_int_distribution<Index>(lo, hi)(gen); };
  int overlapping = 0;
  for (int it = 0; it < 3000; ++it) {
    const Index r0 = uni(0, 7), c0 = uni(0, 9), r1 = uni(0, 7), c1 = uni(0, 9);
    auto a = X.block(r0, c0, uni(0, 7 - r0), uni(0, 9 - c0));
    auto b = X.block(r1, c1, uni(0, 7 - r1), uni(0, 9 - c1));
    const bool expected = overlap_by_address(a, b);
    ASSERT_EQ(linattn::detail::memory_overlaps(a, b), expected) << it;
    overlapping += expected;
    // Vectors taken from the matrix: a row against a column, a column against a block.
    auto row = X.row(uni(0, 6)).segment(c0 == 9 ? 0 : c0, c0 == 9 ? 0 : uni(0, 9 - c0));
    auto col = X.col(uni(0, 8)).segment(r1 == 7 ? 0 : r1, r1 == 7 ? 0 : uni(0, 7 - r1));
    ASSERT_EQ(linattn::detail::memory_overlaps(row, col), overlap_by_address(row, col)) << it;
    ASSERT_EQ(linattn::detail::memory_overlaps(col, b), overlap_by_address(col, b)) << it;
    ASSERT_EQ(linattn::detail::memory_overlaps(b.transpose(), row), overlap_by_address(b.transpose(), row)) << it;
  }
  EXPECT_GT(overlapping, 100);
}

TEST(OverlapPredicate, BlocksOfOneMatrixMatchBruteForce) {
  check_all_blocks<MatF>();
  check_all_blocks<RowMatF>();
  check_all_blocks<Eigen::MatrixXd>();
  check_all_blocks<Eigen::Matrix<double, Dynamic, Dynamic, Eigen::RowMajor>>();
}

TEST(OverlapPredicate, EmptyAndExpressionOperandsNeverOverlap) {
  MatF X = MatF::Random(6, 6);
  // Empty views, even at the same address as a non-empty one.
  EXPECT_FALSE(linattn::detail::memory_overlaps(X.block(0, 0, 0, 3), X));
  EXPECT_FALSE(linattn::detail::memory_overlaps(X, X.block(2, 2, 3, 0)));
  EXPECT_FALSE(linattn::detail::memory_overlaps(MatF(0, 0), MatF(0, 0)));
  // Without memory of their own, expressions cannot be checked (documented).
  EXPECT_FALSE(linattn::detail::memory_overlaps(X, 2 * X));
  EXPECT_FALSE(linattn::detail::memory_overlaps(X, X * X));
  EXPECT_TRUE(linattn::detail::memory_overlaps(X, X.transpose()));
  EXPECT_TRUE(linattn::detail::memory_overlaps(X.col(2), X.row(4)));
  EXPECT_FALSE(linattn::detail::memory_overlaps(X.col(2), X.col(3)));
}

TEST(OverlapPredicate, LargeStridesDoNotOverflow) {
  // Vectors with strides near 2^36 bytes in a virtual address range (never dereferenced):
  // their gcd reasoning works modulo about 2^33, where a plain product would overflow.
  const std::uintptr_t base = std::uintptr_t(1) << 40;
  const std::int64_t s = (std::int64_t(1) << 36) + 8, t = (std::int64_t(1) << 36) - 8;
  const auto A = linattn::detail::make_memory_region(base, 8, s, 100, 0, 1);
  // B = base + 8 + k·t meets A iff i·s − k·t lies in [1, 15]: i = k gives 16·i, i ≠ k gives
  // at least 2^36 − 800 in magnitude: never.
  const auto B = linattn::detail::make_memory_region(base + 8, 8, t, 100, 0, 1);
  EXPECT_FALSE(linattn::detail::regions_overlap(A, B));
  EXPECT_FALSE(linattn::detail::regions_overlap(B, A));
  // C = base + 16 + k·t: i = k = 1 gives the same address base + s.
  const auto C = linattn::detail::make_memory_region(base + 16, 8, t, 100, 0, 1);
  EXPECT_TRUE(linattn::detail::regions_overlap(A, C));
  EXPECT_TRUE(linattn::detail::regions_overlap(C, A));
  // C with 1 element only: base + 16 is no element of A.
  EXPECT_FALSE(linattn::detail::regions_overlap(A, linattn::detail::make_memory_region(base + 16, 8, t, 1, 0, 1)));
  EXPECT_EQ(linattn::detail::overlap::mul_mod((std::int64_t(1) << 40) - 3, (std::int64_t(1) << 40) - 5,
                                              (std::int64_t(1) << 40) - 1),
            8);  // (−2)·(−4) mod (2^40 − 1)
}

}  // namespace
