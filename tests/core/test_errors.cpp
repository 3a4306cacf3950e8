// Argument checking (checks.hpp): every entry point throws std::invalid_argument on bad shapes,
// with a message naming the function and the operands' shapes, before writing anything.
// (Causal linear attention has its own error tests with the causal suite.)
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using test::Index;
using MatF = Eigen::MatrixXf;

// One entry point: its name as it must appear in the message, and a call on (Q, K, V). The
// out+workspace forms write into `out` (sized N x M unless a test says otherwise).
struct Entry {
  std::string name;
  bool causal;
  std::function<void(const MatF& Q, const MatF& K, const MatF& V, MatF& out)> call;
};

std::vector<Entry> entries() {
  using linattn::SoftmaxAlgorithm;
  static linattn::Workspace<float> ws;
  std::vector<Entry> list;
  const auto la = [](auto map) {
    return [map](const MatF& Q, const MatF& K, const MatF& V, MatF& out) {
      out = linattn::linear_attention(Q, K, V, map);
    };
  };
  const auto la_out = [](auto map) {
    return [map](const MatF& Q, const MatF& K, const MatF& V, MatF& out) {
      linattn::linear_attention(Q, K, V, map, out, ws);
    };
  };
  list.push_back({"linattn::linear_attention", false, la(linattn::EluPlusOne{})});
  list.push_back({"linattn::linear_attention", false, la(linattn::SoftmaxSplit{})});
  list.push_back({"linattn::linear_attention", false, la(linattn::NormalizedCosine{})});
  list.push_back({"linattn::linear_attention", false, la_out(linattn::EluPlusOne{})});
  list.push_back({"linattn::linear_attention", false, la_out(linattn::SoftmaxSplit{})});
  list.push_back({"linattn::linear_attention", false, la_out(linattn::NormalizedCosine{})});
  list.push_back({"linattn::linear_attention", false,
                  [](const MatF& Q, const MatF& K, const MatF& V, MatF& out) {
                    out = linattn::linear_attention(Q, K, V);  // default map
                  }});
  for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled}) {
    list.push_back({"linattn::softmax_attention", false,
                    [algo](const MatF& Q, const MatF& K, const MatF& V, MatF& out) {
                      out = linattn::softmax_attention(Q, K, V, algo);
                    }});
    list.push_back({"linattn::softmax_attention", false,
                    [algo](const MatF& Q, const MatF& K, const MatF& V, MatF& out) {
                      linattn::softmax_attention(Q, K, V, out, ws, algo);
                    }});
    list.push_back({"linattn::causal_softmax_attention", true,
                    [algo](const MatF& Q, const MatF& K, const MatF& V, MatF& out) {
                      out = linattn::causal_softmax_attention(Q, K, V, algo);
                    }});
    list.push_back({"linattn::causal_softmax_attention", true,
                    [algo](const MatF& Q, const MatF& K, const MatF& V, MatF& out) {
                      linattn::causal_softmax_attention(Q, K, V, out, ws, algo);
                    }});
  }
  return list;
}

// Calls the entry point and expects std::invalid_argument whose message contains every part.
// `out` is pre-filled with a sentinel and must be left untouched.
void expect_invalid(const Entry& e, const MatF& Q, const MatF& K, const MatF& V, Index out_rows,
                    Index out_cols, const std::vector<std::string>& parts, int index) {
  MatF out = MatF::Constant(out_rows, out_cols, 7.0f);
  const std::string where = e.name + " (entry " + std::to_string(index) + ")";
  std::vector<std::string> needles = parts;
  needles.push_back(e.name);
  test::expect_invalid([&] { e.call(Q, K, V, out); }, needles,
                       where + " for Q " + std::to_string(Q.rows()) + "x" + std::to_string(Q.cols()) +
                           ", K " + std::to_string(K.rows()) + "x" + std::to_string(K.cols()) +
                           ", V " + std::to_string(V.rows()) + "x" + std::to_string(V.cols()));
  EXPECT_EQ(out.rows(), out_rows) << where;
  EXPECT_EQ(out.cols(), out_cols) << where;
  if (out.rows() == out_rows && out.cols() == out_cols) {
    EXPECT_TRUE((out.array() == 7.0f).all()) << where << ": the output was written before the check";
  }
}

MatF rnd(Index r, Index c) { return test::random_matrix<float>(r, c, test::seed_of({r, c})); }

TEST(Errors, QAndKColumnMismatch) {
  int i = 0;
  for (const Entry& e : entries()) {
    expect_invalid(e, rnd(10, 4), rnd(12, 3), rnd(12, 5), 10, 5,
                   {e.name, "Q is 10x4", "K is 12x3", "V is 12x5"}, i++);
  }
}

TEST(Errors, KAndVRowMismatch) {
  int i = 0;
  for (const Entry& e : entries()) {
    const Index N = e.causal ? 12 : 10;
    expect_invalid(e, rnd(N, 4), rnd(12, 4), rnd(11, 5), N, 5,
                   {e.name, "Q is " + std::to_string(N) + "x4", "K is 12x4", "V is 11x5"}, i++);
  }
}

TEST(Errors, ZeroKeyDimension) {
  int i = 0;
  for (const Entry& e : entries()) {
    const Index N = e.causal ? 12 : 10;
    expect_invalid(e, MatF(N, 0), MatF(12, 0), rnd(12, 5), N, 5,
                   {e.name, "Q is " + std::to_string(N) + "x0", "K is 12x0", "V is 12x5"}, i++);
  }
}

TEST(Errors, WrongOutputShape) {
  // Only the out+workspace forms take an output.
  using linattn::SoftmaxAlgorithm;
  const MatF Q = rnd(10, 4), K = rnd(10, 4), V = rnd(10, 5);
  linattn::Workspace<float> ws;
  const auto check = [&](const std::string& name, const std::function<void(MatF&)>& call) {
    for (const auto& shape : {std::pair<Index, Index>{9, 5}, {10, 4}, {11, 5}, {0, 0}, {5, 10}}) {
      MatF out = MatF::Constant(shape.first, shape.second, 7.0f);
      try {
        call(out);
        ADD_FAILURE() << name << ": no exception for an output of " << shape.first << "x" << shape.second;
      } catch (const std::invalid_argument& ex) {
        const std::string msg = ex.what();
        const std::string got = std::to_string(shape.first) + "x" + std::to_string(shape.second);
        EXPECT_NE(msg.find(name), std::string::npos) << msg;
        EXPECT_NE(msg.find(got), std::string::npos) << msg;
        EXPECT_NE(msg.find("10x5"), std::string::npos) << msg;
        EXPECT_TRUE((out.array() == 7.0f).all()) << name << ": wrote into a wrong-shaped output";
      }
    }
  };
  check("linattn::linear_attention", [&](MatF& out) { linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, out, ws); });
  check("linattn::linear_attention", [&](MatF& out) { linattn::linear_attention(Q, K, V, linattn::SoftmaxSplit{}, out, ws); });
  check("linattn::linear_attention", [&](MatF& out) { linattn::linear_attention(Q, K, V, linattn::NormalizedCosine{}, out, ws); });
  for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled}) {
    check("linattn::softmax_attention", [&](MatF& out) { linattn::softmax_attention(Q, K, V, out, ws, algo); });
    check("linattn::causal_softmax_attention",
          [&](MatF& out) { linattn::causal_softmax_attention(Q, K, V, out, ws, algo); });
  }
  // A block of the wrong shape, too.
  MatF big = MatF::Zero(20, 20);
  EXPECT_THROW(linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, big.block(0, 0, 10, 6), ws),
               std::invalid_argument);
}

TEST(Errors, CausalSoftmaxNeedsAsManyQueriesAsKeys) {
  using linattn::SoftmaxAlgorithm;
  const MatF Q = rnd(10, 4), K = rnd(12, 4), V = rnd(12, 5);
  int i = 0;
  for (const Entry& e : entries()) {
    if (e.causal) {
      expect_invalid(e, Q, K, V, 10, 5, {e.name, "Q is 10x4", "K is 12x4", "V is 12x5"}, i);
    } else {
      MatF out(10, 5);
      EXPECT_NO_THROW(e.call(Q, K, V, out)) << e.name << ": cross-attention (N != L) is allowed";
    }
    ++i;
  }
  // N > L as well.
  EXPECT_THROW(linattn::causal_softmax_attention(rnd(13, 4), K, V), std::invalid_argument);
}

TEST(Errors, ShapesOfBlocksAndMapsAreReported) {
  // The shapes in the message are those of the expressions passed, not of their storage.
  MatF big = rnd(30, 30);
  const MatF& cbig = big;
  std::vector<float> buf(12 * 3, 1.0f);
  const Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> Km(buf.data(), 12, 3);
  try {
    (void)linattn::linear_attention(cbig.block(2, 3, 10, 4), Km, cbig.block(0, 0, 12, 5));
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& ex) {
    const std::string msg = ex.what();
    EXPECT_NE(msg.find("linattn::linear_attention"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Q is 10x4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("K is 12x3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("V is 12x5"), std::string::npos) << msg;
  }
}

TEST(Errors, WorkspaceStillWorksAfterAnError) {
  linattn::Workspace<float> ws;
  const MatF Q = rnd(70, 6), K = rnd(80, 6), V = rnd(80, 3);
  MatF out(70, 3);
  EXPECT_THROW(linattn::linear_attention(Q, rnd(80, 5), V, linattn::EluPlusOne{}, out, ws), std::invalid_argument);
  EXPECT_THROW(linattn::softmax_attention(Q, K, rnd(79, 3), out, ws), std::invalid_argument);
  linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, out, ws);
  EXPECT_EQ(test::max_abs_diff(out, linattn::linear_attention(Q, K, V, linattn::EluPlusOne{})), 0.0);
  linattn::softmax_attention(Q, K, V, out, ws);
  EXPECT_EQ(test::max_abs_diff(out, linattn::softmax_attention(Q, K, V)), 0.0);
}

}  // namespace
