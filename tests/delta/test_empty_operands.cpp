// M = 0 and N = 0 in every gated and delta-rule entry point: the results' shapes and zero
// gradients, and, in the sanitizer build, no null data bound to a reference (tests/CMakeLists.txt
// adds UBSan's null check to this file alone, which the other tests leave out for compile time).
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <linattn/delta_rule.hpp>
#include <linattn/delta_rule_backward.hpp>
#include <linattn/elu_plus_one.hpp>
#include <linattn/gated_attention.hpp>
#include <linattn/gated_attention_backward.hpp>
#include <linattn/identity.hpp>
#include <linattn/l2_normalize.hpp>
#include <linattn/multihead_workspace.hpp>
#include <linattn/recurrent_delta_rule.hpp>
#include <linattn/recurrent_gated_attention.hpp>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using test::Index;
using test::Mat;

// D = 0 is rejected (a feature map needs features); M = 0 and N = 0 run.
TEST(empty_operands, EmptyOperandsInGatedAndDeltaEntryPoints) {
  struct Shape {
    Index N, D, M;
  };
  for (const Shape s : {Shape{40, 8, 0}, Shape{0, 8, 6}, Shape{0, 8, 0}, Shape{1, 8, 0}}) {
    for (const CausalAlgorithm algo :
         {CausalAlgorithm::Auto, CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
      const std::string tag = "N=" + std::to_string(s.N) + " M=" + std::to_string(s.M) + " algo " +
                              std::to_string(int(algo));
      const Mat<float> Q = test::random_matrix<float>(s.N, s.D, 961),
                       K = test::random_matrix<float>(s.N, s.D, 962);
      const Mat<float> V = test::random_matrix<float>(s.N, s.M, 963),
                       dO = test::random_matrix<float>(s.N, s.M, 964);
      const Mat<float> beta = Mat<float>::Constant(s.N, 1, 0.5f),
                       g = Mat<float>::Constant(s.N, 1, -0.1f);
      const Mat<float> gf = Mat<float>::Constant(s.N, s.D, -0.1f), none(0, 1);
      linattn::DeltaOptions dop;
      dop.algorithm = algo;
      linattn::GatedOptions go;
      go.algorithm = algo;
      // Single head, forward and backward.
      for (const Mat<float>* la : {&g, &none}) {
        EXPECT_EQ(linattn::delta_rule_attention(Q, K, V, beta, *la,
                                                linattn::L2Normalize<linattn::Identity>{}, dop)
                      .cols(),
                  s.M)
            << tag;
        const auto gr = linattn::delta_rule_attention_backward(Q, K, V, beta, *la, dO,
                                                               linattn::Identity{}, dop);
        if (s.M == 0) {
          EXPECT_EQ(test::max_abs(gr.dQ), 0.0) << tag;
          EXPECT_EQ(test::max_abs(gr.dK), 0.0) << tag;
          EXPECT_EQ(test::max_abs(gr.dbeta), 0.0) << tag;
        }
      }
      for (const Mat<float>* gates : {&g, &gf}) {
        for (const bool norm : {false, true}) {
          go.normalize = norm;
          linattn::LinearAttentionState<float> st;
          const Mat<float> out =
              linattn::gated_linear_attention(Q, K, V, *gates, linattn::EluPlusOne{}, st, go);
          EXPECT_EQ(out.cols(), s.M) << tag;
          if (norm && s.N > 0) {
            // M = 0 still carries z: the same z as with values.
            linattn::LinearAttentionState<float> st1;
            const Mat<float> V1 = test::random_matrix<float>(s.N, 3, 965);
            linattn::gated_linear_attention(Q, K, V1, *gates, linattn::EluPlusOne{}, st1, go);
            EXPECT_LE(test::max_abs_diff(st.z, st1.z), 1e-5 * (1 + test::max_abs(st1.z))) << tag;
          }
          const auto gg = linattn::gated_linear_attention_backward(Q, K, V, *gates, dO,
                                                                   linattn::EluPlusOne{}, go);
          EXPECT_EQ(gg.dV.cols(), s.M) << tag;
          if (s.M == 0) {
            EXPECT_EQ(test::max_abs(gg.dQ), 0.0) << tag;
          }
        }
      }
      go.normalize = false;
      // Multi-head and batched (two heads, two sequences).
      const Index H = 2;
      const Mat<float> Q2 = test::random_matrix<float>(s.N, H * s.D, 966),
                       K2 = test::random_matrix<float>(s.N, H * s.D, 967);
      const Mat<float> V2 = test::random_matrix<float>(s.N, H * s.M, 968),
                       d2 = test::random_matrix<float>(s.N, H * s.M, 969);
      const Mat<float> b2 = Mat<float>::Constant(s.N, H, 0.5f),
                       g2 = Mat<float>::Constant(s.N, H, -0.1f);
      const std::vector<Index> offsets = {0, s.N / 2, s.N};
      linattn::MultiHeadWorkspace<float> ws;
      Mat<float> o2(s.N, H * s.M);
      linattn::multihead_delta_rule_attention(Q2, K2, V2, b2, g2, H, linattn::Identity{}, o2, ws,
                                              dop);
      linattn::multihead_delta_rule_attention_backward(Q2, K2, V2, b2, g2, d2, H,
                                                       linattn::Identity{}, dop);
      linattn::batched_delta_rule_attention(Q2, K2, V2, b2, g2, offsets, H, linattn::Identity{}, o2,
                                            ws, dop);
      linattn::multihead_gated_linear_attention(Q2, K2, V2, g2, H, linattn::Identity{}, o2, ws, go);
      linattn::multihead_gated_linear_attention_backward(Q2, K2, V2, g2, d2, H, linattn::Identity{},
                                                         go);
      linattn::batched_gated_linear_attention(Q2, K2, V2, g2, offsets, H, linattn::Identity{}, o2,
                                              ws, go);
      // The decode steps.
      if (s.N > 0) {
        linattn::RecurrentDeltaRule<linattn::Identity, float> dr(s.D, s.M, dop);
        linattn::RecurrentGatedAttention<linattn::Identity, float> gr(s.D, s.M, go);
        Eigen::VectorXf o(s.M);
        dr.step(Q.row(0), K.row(0), V.row(0), 0.5f, -0.1f, o);
        gr.step(Q.row(0), K.row(0), V.row(0), Eigen::VectorXf::Constant(1, -0.1f), o);
      }
    }
  }
}

}  // namespace
