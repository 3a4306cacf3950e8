// Non-finite values and empty operands in the causal, gated and delta-rule kernels:
//  - causality for NaN and inf: a non-finite query, key or value at row r leaves every row
//    before r exactly as on clean inputs, in every algorithm and chunk position (first, last and
//    an inner row of a chunk), in both storage orders;
//  - key masks isolate: NaN / inf in the keys and values of masked rows change nothing, in the
//    forward kernels and the masked gradients;
//  - the delta rule on unnormalised keys (β‖k̂‖² > 2) goes non-finite at the recurrence's own
//    row in the chunked form too, with every earlier row finite and equal to it;
//  (M = 0 and N = 0: test_empty_operands.cpp.)
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <functional>
#include <limits>
#include <linattn/linattn.hpp>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using test::Index;
using test::Mat;
using test::RowMat;

using Runner = std::function<void(const char* layout, const Mat<double>& Q, const Mat<double>& K,
                                  const Mat<double>& V, Mat<double>& out)>;

template <class S>
struct Family {
  std::string name;
  Index chunk;  // the chunk length of the chunked form (0: none)
  // out = the kernel on Q, K, V (given in S), in the storage order `row_major`.
  std::function<Mat<S>(const Mat<S>&, const Mat<S>&, const Mat<S>&, bool row_major)> run;
  bool token_fallback_on_bad_key = false;  // SoftmaxSplit redoes such a chunk token by token
};

// Runs f on Q, K, V in column-major or row-major storage and returns the output column-major.
template <class S, class F>
Mat<S> in_layout(bool row_major, const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V, F&& f) {
  if (!row_major) return f(Q, K, V);
  const RowMat<S> q = Q, k = K, v = V;
  return f(q, k, v);
}

template <class S>
std::vector<Family<S>> families(Index N, Index D) {
  std::vector<Family<S>> fs;
  const Mat<S> g = -0.05 * test::random_matrix<S>(N, 1, 901, 0, 1);
  const Mat<S> gf = -0.05 * test::random_matrix<S>(N, D, 902, 0, 1);
  const Mat<S> gs = -3.0 * test::random_matrix<S>(N, D, 903, 0, 1);  // strong: sub-chunks
  const Mat<S> beta = test::random_matrix<S>(N, 1, 904, 0.2, 1.0);
  for (const CausalAlgorithm algo :
       {CausalAlgorithm::Auto, CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    const std::string an = algo == CausalAlgorithm::Auto      ? "auto"
                           : algo == CausalAlgorithm::Chunked ? "chunked"
                                                              : "recurrent";
    for (const Index chunk : {Index(0), Index(16)}) {
      if (algo != CausalAlgorithm::Chunked && chunk != 0) continue;
      const std::string tag = an + "/C=" + std::to_string(chunk);
      linattn::CausalOptions co;
      co.algorithm = algo;
      co.chunk_size = chunk;
      const Index cc = algo == CausalAlgorithm::Chunked ? (chunk ? chunk : 48) : 0;
      fs.push_back(
          {"causal EluPlusOne " + tag, cc,
           [co](const auto& Q, const auto& K, const auto& V, bool rm) {
             return in_layout<S>(rm, Q, K, V, [&](const auto& q, const auto& k, const auto& v) {
               return Mat<S>(linattn::causal_linear_attention(q, k, v, linattn::EluPlusOne{}, co));
             });
           }});
      fs.push_back({"causal SoftmaxSplit " + tag, cc,
                    [co](const auto& Q, const auto& K, const auto& V, bool rm) {
                      return in_layout<S>(rm, Q, K, V,
                                          [&](const auto& q, const auto& k, const auto& v) {
                                            return Mat<S>(linattn::causal_linear_attention(
                                                q, k, v, linattn::SoftmaxSplit{}, co));
                                          });
                    },
                    true});
      linattn::GatedOptions go;
      go.algorithm = algo;
      go.chunk_size = chunk;
      const Index gc = algo == CausalAlgorithm::Chunked ? (chunk ? chunk : 64) : 0;
      for (const bool norm : {false, true}) {
        go.normalize = norm;
        const std::string gn = norm ? " normalized " : " ";
        fs.push_back({"gated scalar" + gn + tag, gc,
                      [go, g](const auto& Q, const auto& K, const auto& V, bool rm) {
                        return in_layout<S>(rm, Q, K, V,
                                            [&](const auto& q, const auto& k, const auto& v) {
                                              return Mat<S>(linattn::gated_linear_attention(
                                                  q, k, v, g, linattn::EluPlusOne{}, go));
                                            });
                      }});
        fs.push_back({"gated per-feature" + gn + tag, gc,
                      [go, gf](const auto& Q, const auto& K, const auto& V, bool rm) {
                        return in_layout<S>(rm, Q, K, V,
                                            [&](const auto& q, const auto& k, const auto& v) {
                                              return Mat<S>(linattn::gated_linear_attention(
                                                  q, k, v, gf, linattn::EluPlusOne{}, go));
                                            });
                      }});
      }
      go.normalize = false;
      fs.push_back(
          {"gated per-feature strong " + tag, gc,
           [go, gs](const auto& Q, const auto& K, const auto& V, bool rm) {
             return in_layout<S>(rm, Q, K, V, [&](const auto& q, const auto& k, const auto& v) {
               return Mat<S>(linattn::gated_linear_attention(q, k, v, gs, linattn::Identity{}, go));
             });
           }});
      linattn::DeltaOptions dop;
      dop.algorithm = algo;
      dop.chunk_size = chunk;
      const Index dc = algo == CausalAlgorithm::Chunked ? (chunk ? chunk : 32) : 0;
      for (const bool decay : {false, true}) {
        const Mat<S> la = decay ? g : Mat<S>(0, 1);
        fs.push_back(
            {std::string("delta ") + (decay ? "gated " : "") + tag, dc,
             [dop, beta, la](const auto& Q, const auto& K, const auto& V, bool rm) {
               return in_layout<S>(rm, Q, K, V, [&](const auto& q, const auto& k, const auto& v) {
                 return Mat<S>(linattn::delta_rule_attention(
                     q, k, v, beta, la, linattn::L2Normalize<linattn::Identity>{}, dop));
               });
             }});
      }
    }
  }
  return fs;
}

// Rows before the poisoned row `r` must be exactly those of the clean run (or, where a chunk is
// redone token by token, equal to them to rounding).
template <class S>
void check_prefix(const Mat<S>& clean, const Mat<S>& poisoned, Index r, bool exact,
                  const std::string& what) {
  ASSERT_EQ(poisoned.rows(), clean.rows()) << what;
  if (r == 0) return;
  const auto a = clean.topRows(r), b = poisoned.topRows(r);
  if (exact) {
    EXPECT_TRUE(test::same_bits(a, b))
        << what << ": rows before " << r << " changed, max diff " << test::max_abs_diff(a, b);
  } else {
    EXPECT_TRUE(test::all_finite(b)) << what;
    EXPECT_LE(test::max_abs_diff(a, b), test::bound<S>(2e-5, 1e-12)) << what;
  }
}

template <class S>
void check_causality() {
  const Index D = 16, M = 20, N = 3 * 64 + 7;
  const Mat<S> Q = test::random_matrix<S>(N, D, 911), K = test::random_matrix<S>(N, D, 912);
  const Mat<S> V = test::random_matrix<S>(N, M, 913);
  const S nan = std::numeric_limits<S>::quiet_NaN(), inf = std::numeric_limits<S>::infinity();
  int cases = 0;
  for (const auto& f : families<S>(N, D)) {
    for (const bool rm : {false, true}) {
      const Mat<S> clean = f.run(Q, K, V, rm);
      ASSERT_TRUE(test::all_finite(clean)) << f.name;
      // An inner row, the first and the last row of a chunk (of the second chunk), and row 40.
      const Index C = f.chunk > 0 ? f.chunk : 48;
      for (const Index r : {C + C / 2 + 1, C, 2 * C - 1, Index(40)}) {
        for (const S bad : {nan, inf, -inf}) {
          for (const char which : {'q', 'k', 'v'}) {
            Mat<S> q = Q, k = K, v = V;
            (which == 'q' ? q : which == 'k' ? k : v)(r, 3) = bad;
            const Mat<S> out = f.run(q, k, v, rm);
            const bool exact = !(f.token_fallback_on_bad_key && which == 'k');
            check_prefix(clean, out, r, exact,
                         f.name + (rm ? " row-major" : " col-major") + " " + which + "(" +
                             std::to_string(r) + ", 3) = " + std::to_string(double(bad)));
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

TEST(hardening_nan, NonFiniteValuesKeepCausality) {
  IF_FLOAT(check_causality<float>());
  IF_DOUBLE(check_causality<double>());
}

// The default causal call at D = M = 160 (Auto picks Chunked: F·M > 128²).
TEST(hardening_nan, DefaultCausalCallLargeStateKeepsCausality) {
  const Index N = 150, D = 160, M = 160;
  const Mat<float> Q = test::random_matrix<float>(N, D, 921),
                   K = test::random_matrix<float>(N, D, 922);
  const Mat<float> V = test::random_matrix<float>(N, M, 923);
  const Mat<float> clean = linattn::causal_linear_attention(Q, K, V);
  for (const Index r : {Index(40), Index(48), Index(95)}) {
    Mat<float> v = V;
    v(r, 7) = std::numeric_limits<float>::quiet_NaN();
    check_prefix<float>(clean, linattn::causal_linear_attention(Q, K, v), r, true,
                        "default call, v(" + std::to_string(r) + ", 7) = NaN");
  }
  // The gated default call there is chunked too (scalar and per-feature gates).
  const Mat<float> g = -0.05f * test::random_matrix<float>(N, 1, 924, 0, 1);
  const Mat<float> gf = -0.05f * test::random_matrix<float>(N, D, 925, 0, 1);
  for (const Mat<float>* gates : {&g, &gf}) {
    const Mat<float> gclean = linattn::gated_linear_attention(Q, K, V, *gates);
    for (const Index r : {Index(40), Index(64), Index(127)}) {
      Mat<float> v = V;
      v(r, 7) = std::numeric_limits<float>::infinity();
      check_prefix<float>(gclean, linattn::gated_linear_attention(Q, K, v, *gates), r, true,
                          "gated default call, v(" + std::to_string(r) + ", 7) = inf");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Masks: a masked key's row holds NaN or inf; the output is that of the same call with the row
// holding ordinary numbers, bit for bit.
// ---------------------------------------------------------------------------------------------

template <class S>
void check_mask_isolation() {
  const S nan = std::numeric_limits<S>::quiet_NaN(), inf = std::numeric_limits<S>::infinity();
  const Index N = 150, D = 12, M = 10;
  const Mat<S> Q = test::random_matrix<S>(N, D, 931), K = test::random_matrix<S>(N, D, 932);
  const Mat<S> V = test::random_matrix<S>(N, M, 933);
  Eigen::Array<bool, Eigen::Dynamic, 1> pad =
      Eigen::Array<bool, Eigen::Dynamic, 1>::Constant(N, true);
  pad.tail(37).setConstant(false);  // padding at the end
  Eigen::Array<bool, Eigen::Dynamic, 1> sparse = pad;
  for (Index j = 0; j < N; j += 5) sparse(j) = false;
  for (const auto& keep : {pad, sparse}) {
    for (const S bad : {nan, inf}) {
      Mat<S> Kp = K, Vp = V;
      for (Index j = 0; j < N; ++j)
        if (!keep(j)) {
          Kp.row(j).setConstant(bad);
          Vp.row(j).setConstant(bad);
        }
      const std::string tag = std::string(test::scalar_name<S>()) +
                              (keep.count() > 100 ? " padding" : " sparse") +
                              (std::isnan(bad) ? " NaN" : " inf");
      EXPECT_TRUE(
          test::same_bits(linattn::masked_linear_attention(Q, Kp, Vp, keep, linattn::EluPlusOne{}),
                          linattn::masked_linear_attention(Q, K, V, keep, linattn::EluPlusOne{})))
          << tag << " non-causal";
      EXPECT_TRUE(test::same_bits(
          linattn::masked_linear_attention(Q, Kp, Vp, keep, linattn::SoftmaxSplit{}),
          linattn::masked_linear_attention(Q, K, V, keep, linattn::SoftmaxSplit{})))
          << tag << " non-causal SoftmaxSplit";
      for (const CausalAlgorithm algo :
           {CausalAlgorithm::Auto, CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
        for (const Index chunk : {Index(0), Index(16)}) {
          linattn::CausalOptions co;
          co.algorithm = algo;
          co.chunk_size = chunk;
          const std::string t =
              tag + " causal algo " + std::to_string(int(algo)) + " C=" + std::to_string(chunk);
          EXPECT_TRUE(test::same_bits(
              linattn::masked_causal_linear_attention(Q, Kp, Vp, keep, linattn::EluPlusOne{}, co),
              linattn::masked_causal_linear_attention(Q, K, V, keep, linattn::EluPlusOne{}, co)))
              << t;
          EXPECT_TRUE(test::same_bits(
              linattn::masked_causal_linear_attention(Q, Kp, Vp, keep, linattn::SoftmaxSplit{}, co),
              linattn::masked_causal_linear_attention(Q, K, V, keep, linattn::SoftmaxSplit{}, co)))
              << t << " SoftmaxSplit";
        }
      }
      // Row-major packed heads, the batched kernels (two sequences, two heads).
      const Index H = 2;
      RowMat<S> Q2(N, H * D), K2(N, H * D), V2(N, H * M), Kp2(N, H * D), Vp2(N, H * M);
      Q2 << Q, Q.reverse();
      K2 << K, K.reverse();
      V2 << V, V.reverse();
      Kp2 = K2;
      Vp2 = V2;
      for (Index j = 0; j < N; ++j)
        if (!keep(j)) {
          Kp2.row(j).setConstant(bad);
          Vp2.row(j).setConstant(bad);
        }
      const std::vector<Index> offsets = {0, 70, N};
      linattn::MultiHeadWorkspace<S> ws;
      RowMat<S> a(N, H * M), b(N, H * M);
      linattn::masked_batched_linear_attention(Q2, Kp2, Vp2, offsets, offsets, keep, H,
                                               linattn::EluPlusOne{}, a, ws);
      linattn::masked_batched_linear_attention(Q2, K2, V2, offsets, offsets, keep, H,
                                               linattn::EluPlusOne{}, b, ws);
      EXPECT_TRUE(test::same_bits(a, b)) << tag << " batched non-causal";
      for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
        linattn::CausalOptions co;
        co.algorithm = algo;
        linattn::masked_batched_causal_linear_attention(Q2, Kp2, Vp2, offsets, keep, H,
                                                        linattn::EluPlusOne{}, a, ws, co);
        linattn::masked_batched_causal_linear_attention(Q2, K2, V2, offsets, keep, H,
                                                        linattn::EluPlusOne{}, b, ws, co);
        EXPECT_TRUE(test::same_bits(a, b)) << tag << " batched causal algo " << int(algo);
      }
    }
  }
}

TEST(hardening_nan, MaskedRowsOfNaNAndInfChangeNothing) {
  IF_FLOAT(check_mask_isolation<float>());
  IF_DOUBLE(check_mask_isolation<double>());
}

// The masked gradients: NaN in masked rows reaches no gradient.
TEST(hardening_nan, MaskedBackwardIgnoresNaNRows) {
  const Index N = 150, D = 12, M = 10;
  const Mat<float> Q = test::random_matrix<float>(N, D, 971),
                   K = test::random_matrix<float>(N, D, 972);
  const Mat<float> V = test::random_matrix<float>(N, M, 973),
                   dO = test::random_matrix<float>(N, M, 974);
  Eigen::Array<bool, Eigen::Dynamic, 1> keep =
      Eigen::Array<bool, Eigen::Dynamic, 1>::Constant(N, true);
  keep.tail(30).setConstant(false);
  keep(10) = false;
  Mat<float> Kp = K, Vp = V;
  for (Index j = 0; j < N; ++j)
    if (!keep(j)) {
      Kp.row(j).setConstant(std::numeric_limits<float>::quiet_NaN());
      Vp.row(j).setConstant(std::numeric_limits<float>::quiet_NaN());
    }
  const auto same = [](const auto& a, const auto& b, const std::string& what) {
    EXPECT_TRUE(test::same_bits(a.dQ, b.dQ)) << what << " dQ";
    EXPECT_TRUE(test::same_bits(a.dK, b.dK)) << what << " dK";
    EXPECT_TRUE(test::same_bits(a.dV, b.dV)) << what << " dV";
  };
  same(linattn::masked_linear_attention_backward(Q, Kp, Vp, dO, keep, linattn::EluPlusOne{}),
       linattn::masked_linear_attention_backward(Q, K, V, dO, keep, linattn::EluPlusOne{}),
       "non-causal");
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    linattn::CausalOptions co;
    co.algorithm = algo;
    same(linattn::masked_causal_linear_attention_backward(Q, Kp, Vp, dO, keep,
                                                          linattn::EluPlusOne{}, co),
         linattn::masked_causal_linear_attention_backward(Q, K, V, dO, keep, linattn::EluPlusOne{},
                                                          co),
         "causal algo " + std::to_string(int(algo)));
  }
}

// The default causal call at D = M = 160 with padding of NaN values.
TEST(hardening_nan, MaskedDefaultCausalCallLargeState) {
  const Index N = 130, D = 160, M = 160;
  const Mat<float> Q = test::random_matrix<float>(N, D, 941),
                   K = test::random_matrix<float>(N, D, 942);
  const Mat<float> V = test::random_matrix<float>(N, M, 943);
  Eigen::Array<bool, Eigen::Dynamic, 1> keep =
      Eigen::Array<bool, Eigen::Dynamic, 1>::Constant(N, true);
  keep.segment(20, 9).setConstant(false);
  keep.tail(30).setConstant(false);
  Mat<float> Vp = V;
  for (Index j = 0; j < N; ++j)
    if (!keep(j)) Vp.row(j).setConstant(std::numeric_limits<float>::quiet_NaN());
  const Mat<float> a = linattn::masked_causal_linear_attention(Q, K, Vp, keep);
  EXPECT_TRUE(test::all_finite(a));
  EXPECT_TRUE(test::same_bits(a, linattn::masked_causal_linear_attention(Q, K, V, keep)));
}

// ---------------------------------------------------------------------------------------------
// The delta rule on unnormalised keys: β‖k̂‖² = 50 and 100, where the state grows geometrically.
// ---------------------------------------------------------------------------------------------

Index first_non_finite_row(const Mat<float>& x) {
  for (Index i = 0; i < x.rows(); ++i)
    if (!x.row(i).allFinite()) return i;
  return x.rows();
}

TEST(hardening_nan, DeltaRawKeysChunkedAsFiniteAsRecurrence) {
  const Index N = 256, D = 64, M = 64;
  const Mat<float> Q = test::random_matrix<float>(N, D, 951),
                   V = test::random_matrix<float>(N, M, 953);
  Mat<float> K = test::random_matrix<float>(N, D, 952);
  K.rowwise().normalize();
  K *= 10.0f;  // ‖k‖ = 10
  for (const float b : {0.5f, 1.0f}) {
    for (const bool decay : {false, true}) {
      const Mat<float> beta = Mat<float>::Constant(N, 1, b);
      const Mat<float> la = decay ? Mat<float>::Constant(N, 1, -0.01f) : Mat<float>(0, 1);
      linattn::DeltaOptions rec, chk;
      rec.algorithm = CausalAlgorithm::Recurrent;
      chk.algorithm = CausalAlgorithm::Chunked;
      const Mat<float> r =
          linattn::delta_rule_attention(Q, K, V, beta, la, linattn::Identity{}, rec);
      const std::string tag = "beta " + std::to_string(b) + (decay ? " decay" : "");
      const Index fr = first_non_finite_row(r);
      ASSERT_LT(fr, N) << tag << ": the recurrence was expected to overflow";
      for (const Index chunk : {Index(0), Index(16), Index(64)}) {
        chk.chunk_size = chunk;
        const Mat<float> c =
            linattn::delta_rule_attention(Q, K, V, beta, la, linattn::Identity{}, chk);
        const Index fc = first_non_finite_row(c);
        // The same row up to the rounding of the overflowing step itself.
        EXPECT_GE(fc, fr - 1) << tag << " C=" << chunk;
        EXPECT_LE(fc, fr + 1) << tag << " C=" << chunk;
        // Rows before it agree with the recurrence relative to their size (they grow with it).
        const Index n = std::min(fc, fr);
        for (Index i = 0; i < n; ++i) {
          const double scale = std::max(1.0, double(r.row(i).cwiseAbs().maxCoeff()));
          EXPECT_LE((c.row(i) - r.row(i)).cwiseAbs().maxCoeff() / scale, 1e-3)
              << tag << " C=" << chunk << " row " << i;
        }
      }
    }
  }
}

}  // namespace
