// Saving and loading states (state_io.hpp, spec §8): round trips of every map in float and
// double keep every bit; a recurrent decode saved part-way and resumed in a fresh object gives
// the uninterrupted outputs bit for bit; every malformed file (truncated, bit-flipped, wrong
// type, kind or shape, absurd shapes, failing streams) is a std::runtime_error that names the
// problem and leaves the target object as it was; so is a file whose values no decoder holds
// (a negative position, a log-decay that is NaN or > 0). The gated decoder
// (RecurrentGatedAttention, kind 8, compact; its older kind-4 files still load) and the
// delta-rule decoder (RecurrentDeltaRule, kind 7: S and the position) resume bit for bit, the
// gated one with scalar and per-feature gates, the batched decoder
// (BatchedRecurrentLinearAttention, kind 5) with its sequences at different positions, and the
// attention layers' States (LinearAttentionLayer: kind 3; SoftmaxAttentionLayer's KV cache:
// kind 6) through prefills and steps.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <ios>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::EluPlusOne;
using linattn::GatedOptions;
using linattn::Identity;
using linattn::LinearAttentionState;
using linattn::MultiHeadRecurrentLinearAttention;
using linattn::NormalizedCosine;
using linattn::RecurrentGatedAttention;
using linattn::RecurrentLinearAttention;
using linattn::Silu;
using linattn::SoftmaxSplit;
using test::Index;
using test::Mat;

using test::same_bits;
using test::same_state;

template <class T>
std::string saved(const T& x) {
  std::ostringstream os(std::ios::binary);
  linattn::save_state(os, x);
  return os.str();
}

// The message of the std::runtime_error that f throws ("" and a test failure if none).
template <class F>
std::string runtime_error_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a std::runtime_error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no exception";
  return "";
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// A read-only stream buffer that cannot seek (as a pipe): the loader cannot ask its length.
class OneWayBuf : public std::streambuf {
 public:
  explicit OneWayBuf(std::string bytes) : bytes_(std::move(bytes)) {
    char* p = bytes_.data();
    setg(p, p, p + bytes_.size());
  }

 private:
  std::string bytes_;
};

// A sink that takes `capacity` bytes and then fails (a full disk).
class FullDiskBuf : public std::streambuf {
 public:
  explicit FullDiskBuf(std::size_t capacity) : capacity_(capacity) {}

 protected:
  int_type overflow(int_type c) override {
    if (used_ >= capacity_) return traits_type::eof();
    ++used_;
    return traits_type::not_eof(c);
  }
  std::streamsize xsputn(const char*, std::streamsize n) override {
    const std::streamsize k = std::min<std::streamsize>(n, std::streamsize(capacity_ - used_));
    used_ += std::size_t(k);
    return k;
  }

 private:
  std::size_t capacity_, used_ = 0;
};

// A header with a correct CRC declaring what the caller wants (for files the saver never
// writes): the 60 bytes of version 1, or for any other version the 68 of version 2 with
// `decay` log-decay entries per head.
std::string header(std::uint32_t version, std::uint32_t scalar, std::uint32_t kind,
                   std::uint32_t flags, std::uint64_t heads, std::uint64_t D, std::uint64_t F,
                   std::uint64_t M, std::uint64_t decay = 0) {
  unsigned char h[68];
  const unsigned char magic[8] = {0x89, 'L', 'A', 'S', '\r', '\n', 0x1A, '\n'};
  std::memcpy(h, magic, 8);
  linattn::detail::io::put_le(h + 8, version);
  linattn::detail::io::put_le(h + 12, scalar);
  linattn::detail::io::put_le(h + 16, kind);
  linattn::detail::io::put_le(h + 20, flags);
  linattn::detail::io::put_le(h + 24, heads);
  linattn::detail::io::put_le(h + 32, D);
  linattn::detail::io::put_le(h + 40, F);
  linattn::detail::io::put_le(h + 48, M);
  const std::size_t n = version == 1 ? 60 : 68;
  if (version != 1) linattn::detail::io::put_le(h + 56, decay);
  linattn::detail::io::put_le(h + n - 4, linattn::detail::io::crc32(h, n - 4));
  return std::string(reinterpret_cast<const char*>(h), n);
}

// Replaces the trailing CRC by the right one for the (edited) bytes before it.
void reseal(std::string& file) {
  const std::uint32_t crc = linattn::detail::io::crc32(file.data(), file.size() - 4);
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&file[file.size() - 4]), crc);
}

// Replaces the version-2 header's CRC by the right one for its (edited) bytes 0-63.
void reseal_header(std::string& file) {
  auto* b = reinterpret_cast<unsigned char*>(&file[0]);
  linattn::detail::io::put_le(b + 64, linattn::detail::io::crc32(b, 64));
}

// The version-1 file of the same record as a version-2 file of an undecayed state (L = 0):
// version 1, no log-decay field (the 8 bytes at 56), both CRCs recomputed. As linattn wrote
// before decayed states existed.
std::string as_version1(const std::string& v2) {
  EXPECT_EQ(linattn::detail::io::get_le<std::uint64_t>(
                reinterpret_cast<const unsigned char*>(v2.data()) + 56),
            0u);
  std::string f = v2.substr(0, 56) + v2.substr(64);
  auto* b = reinterpret_cast<unsigned char*>(&f[0]);
  linattn::detail::io::put_le(b + 8, std::uint32_t(1));
  linattn::detail::io::put_le(b + 56, linattn::detail::io::crc32(b, 56));
  reseal(f);
  return f;
}

// A state with a total log-decay of `decay` entries (1: scalar decay, F: per-feature gates),
// some of them -inf (a reset), and low parts that are not zero.
template <class S>
LinearAttentionState<S> decayed_state(Index F, Index M, Index decay, std::uint32_t seed) {
  LinearAttentionState<S> st(F, M);
  st.S = test::random_matrix<S>(F, M, seed, -3, 3);
  st.S_lo = test::random_matrix<S>(F, M, seed + 1, -1e-9, 1e-9);
  st.z = test::random_matrix<S>(F, 1, seed + 2, 0, 3);
  st.z_lo = test::random_matrix<S>(F, 1, seed + 3, -1e-9, 1e-9);
  st.log_decay = test::random_matrix<S>(decay, 1, seed + 4, -40, 0);
  if (decay > 1) st.log_decay(1) = -std::numeric_limits<S>::infinity();
  return st;
}

// Runs rnn over rows [from, to) and returns their outputs.
template <class R, class S>
Mat<S> run(R& rnn, const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V, Index from, Index to) {
  Mat<S> out(to - from, V.cols());
  Eigen::Matrix<S, Eigen::Dynamic, 1> o(V.cols());
  for (Index t = from; t < to; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), o);
    out.row(t - from) = o.transpose();
  }
  return out;
}

// Runs a gated decoder over rows [from, to) with the log gates of row t of G (N x 1 or N x F)
// before `switch_at` and of row t of G2 from it on, and returns their outputs.
template <class R, class S>
Mat<S> run_gated(R& rnn, const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V, const Mat<S>& G,
                 const Mat<S>& G2, Index switch_at, Index from, Index to) {
  Mat<S> out(to - from, V.cols());
  Eigen::Matrix<S, Eigen::Dynamic, 1> o(V.cols());
  for (Index t = from; t < to; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), t < switch_at ? G.row(t) : G2.row(t), o);
    out.row(t - from) = o.transpose();
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// Format
// ------------------------------------------------------------------------------------------

TEST(StateIoFormat, Crc32CheckValue) {
  EXPECT_EQ(linattn::detail::io::crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(linattn::detail::io::crc32("", 0), 0u);
}

TEST(StateIoFormat, LayoutIsLittleEndianAsDocumented) {
  LinearAttentionState<float> st(1, 2, /*per_feature=*/true);
  st.S << 1.0f, -2.0f;
  st.z << 0.5f;
  st.m << -std::numeric_limits<float>::infinity();
  const std::string f = saved(st);
  ASSERT_EQ(f.size(), 72u + 16u + 4u * (2 * 2 + 2 + 1));
  const auto* b = reinterpret_cast<const unsigned char*>(f.data());
  const unsigned char magic[8] = {0x89, 0x4C, 0x41, 0x53, 0x0D, 0x0A, 0x1A, 0x0A};
  EXPECT_EQ(std::memcmp(b, magic, 8), 0);
  const auto u32 = [&](std::size_t at) { return linattn::detail::io::get_le<std::uint32_t>(b + at); };
  const auto u64 = [&](std::size_t at) { return linattn::detail::io::get_le<std::uint64_t>(b + at); };
  EXPECT_EQ(u32(8), 2u);   // version
  EXPECT_EQ(u32(12), 1u);  // float
  EXPECT_EQ(u32(16), 1u);  // a LinearAttentionState
  EXPECT_EQ(u32(20), 1u);  // maxima
  EXPECT_EQ(u64(24), 1u);  // heads
  EXPECT_EQ(u64(32), 0u);  // D unknown
  EXPECT_EQ(u64(40), 1u);  // F
  EXPECT_EQ(u64(48), 2u);  // M
  EXPECT_EQ(u64(56), 0u);  // no log-decay
  EXPECT_EQ(u32(64), linattn::detail::io::crc32(b, 64));
  EXPECT_EQ(u64(68), 0u);  // position
  EXPECT_EQ(u64(76), 0u);  // unfolded tokens
  // S = (1, -2): 0x3F800000 and 0xC0000000, least significant byte first.
  const unsigned char s_bytes[8] = {0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0};
  EXPECT_EQ(std::memcmp(b + 84, s_bytes, 8), 0);
  EXPECT_EQ(u64(92), 0u);            // S_lo: zeros
  EXPECT_EQ(u32(100), 0x3F000000u);  // z = 0.5
  EXPECT_EQ(u32(104), 0u);           // z_lo
  EXPECT_EQ(u32(108), 0xFF800000u);  // m = -inf
  EXPECT_EQ(u32(112), linattn::detail::io::crc32(b, 112));
}

TEST(StateIoFormat, LogDecayLayoutIsAsDocumented) {
  LinearAttentionState<double> st(2, 1);
  st.S << 1.0, 2.0;
  st.z << 3.0, 4.0;
  st.log_decay.resize(2);
  st.log_decay << -0.5, -std::numeric_limits<double>::infinity();
  const std::string f = saved(st);
  ASSERT_EQ(f.size(), 72u + 16u + 8u * (2 * 2 + 2 * 2 + 2));
  const auto* b = reinterpret_cast<const unsigned char*>(f.data());
  const auto u64 = [&](std::size_t at) { return linattn::detail::io::get_le<std::uint64_t>(b + at); };
  EXPECT_EQ(u64(56), 2u);  // L = F: per-feature gates
  EXPECT_EQ(linattn::detail::io::get_le<std::uint32_t>(b + 64), linattn::detail::io::crc32(b, 64));
  // S (2), S_lo (2), z (2), z_lo (2) from 84, then log_decay: -0.5 and -inf.
  EXPECT_EQ(u64(84), 0x3FF0000000000000u);
  EXPECT_EQ(u64(84 + 8 * 8), 0xBFE0000000000000u);
  EXPECT_EQ(u64(84 + 9 * 8), 0xFFF0000000000000u);
  EXPECT_EQ(linattn::detail::io::get_le<std::uint32_t>(b + 84 + 10 * 8),
            linattn::detail::io::crc32(b, 84 + 10 * 8));
  // One entry: a scalar decay.
  st.log_decay.resize(1);
  st.log_decay << -3.0;
  const std::string g = saved(st);
  EXPECT_EQ(g.size(), f.size() - 8);
  EXPECT_EQ(linattn::detail::io::get_le<std::uint64_t>(
                reinterpret_cast<const unsigned char*>(g.data()) + 56),
            1u);
}

// ------------------------------------------------------------------------------------------
// Round trips
// ------------------------------------------------------------------------------------------

template <class S>
class StateIoRoundTrip : public ::testing::Test {};
// One or both scalar types (test::TypedScalars): every case instantiates the kernels whose state
// it saves, in its type.
using StateIoScalars = test::TypedScalars;
TYPED_TEST_SUITE(StateIoRoundTrip, StateIoScalars, );

template <class S, class Phi>
void check_round_trip(const Phi& phi, Index D, Index M, std::uint32_t seed) {
  const Mat<S> K = test::random_matrix<S>(37, D, seed, -3, 3);
  const Mat<S> V = test::random_matrix<S>(37, M, seed + 1);
  LinearAttentionState<S> st = linattn::summarize(K, V, phi);
  st.S_lo.setConstant(S(1e-9));  // low parts that are not zero must survive too
  if (st.m.size() > 0) {  // a feature before any key: m = -inf, zero sums
    st.m(0) = -std::numeric_limits<S>::infinity();
    st.S.row(0).setZero();
    st.S_lo.row(0).setZero();
    st.z(0) = 0;
    st.z_lo(0) = 0;
  }
  const std::string f = saved(st);
  EXPECT_EQ(f.size(), std::size_t(72 + 16 + sizeof(S) * (2 * st.S.size() + 2 * st.z.size() +
                                                         st.m.size())));
  std::istringstream is(f, std::ios::binary);
  const auto back = linattn::load_state<S>(is);
  EXPECT_TRUE(same_state(back, st));
  EXPECT_EQ(is.peek(), std::char_traits<char>::eof());  // exactly one record consumed
}

TYPED_TEST(StateIoRoundTrip, EveryMapKeepsEveryBit) {
  using S = TypeParam;
  check_round_trip<S>(EluPlusOne{}, 5, 3, 11);
  check_round_trip<S>(SoftmaxSplit{}, 4, 6, 12);
  check_round_trip<S>(NormalizedCosine{}, 6, 2, 13);
}

TYPED_TEST(StateIoRoundTrip, DecayedStatesKeepEveryBit) {
  using S = TypeParam;
  for (const Index decay : {Index(1), Index(5)}) {
    SCOPED_TRACE(std::to_string(decay) + " log-decay entries");
    const auto st = decayed_state<S>(5, 3, decay, 61);
    const std::string f = saved(st);
    EXPECT_EQ(f.size(), std::size_t(72 + 16 + sizeof(S) * (2 * 15 + 2 * 5 + decay)));
    std::istringstream is(f, std::ios::binary);
    const auto back = linattn::load_state<S>(is);
    EXPECT_TRUE(same_state(back, st));
    EXPECT_TRUE(same_bits(back.log_decay, st.log_decay));
    EXPECT_EQ(is.peek(), std::char_traits<char>::eof());
    EXPECT_EQ(saved(back), f);
  }
  // F = 1: one entry is both a scalar decay and per-feature gates.
  const auto one = decayed_state<S>(1, 4, 1, 62);
  std::istringstream is(saved(one), std::ios::binary);
  EXPECT_TRUE(same_bits(linattn::load_state<S>(is).log_decay, one.log_decay));
  // An undecayed state loads with an empty log-decay.
  std::istringstream plain(saved(LinearAttentionState<S>(3, 2)), std::ios::binary);
  EXPECT_EQ(linattn::load_state<S>(plain).log_decay.size(), 0);
}

// The state a recurrent object holds is saved with whatever log-decay it has (set_state()
// copies one), so that it loads back bit for bit.
TYPED_TEST(StateIoRoundTrip, RecurrentObjectsKeepALogDecay) {
  using S = TypeParam;
  using Access = linattn::detail::RecurrentStateAccess;
  RecurrentLinearAttention<EluPlusOne, S> rnn(4, 3);
  Access::install(rnn, decayed_state<S>(4, 3, 1, 63), 17, 5);
  std::stringstream file(std::ios::in | std::ios::out | std::ios::binary);
  linattn::save_state(file, rnn);
  RecurrentLinearAttention<EluPlusOne, S> back(4, 3);
  linattn::load_state(file, back);
  EXPECT_TRUE(same_state(Access::state(back), Access::state(rnn)));
  EXPECT_TRUE(same_bits(Access::state(back).log_decay, Access::state(rnn).log_decay));
  EXPECT_EQ(back.position(), 17);

  MultiHeadRecurrentLinearAttention<EluPlusOne, S> heads(2, 4, 3);
  Access::install(heads.head(0), decayed_state<S>(4, 3, 4, 64), 1, 1);
  try {
    linattn::save_state(file, heads);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "linattn::save_state: the heads' log-decays differ in size: head 0 has 4 "
              "entries, head 1 has 0");
  }
  Access::install(heads.head(1), decayed_state<S>(4, 3, 4, 65), 1, 1);
  std::stringstream two(std::ios::in | std::ios::out | std::ios::binary);
  linattn::save_state(two, heads);
  MultiHeadRecurrentLinearAttention<EluPlusOne, S> heads_back(2, 4, 3);
  linattn::load_state(two, heads_back);
  for (Index h = 0; h < 2; ++h)
    EXPECT_TRUE(same_bits(Access::state(heads_back.head(h)).log_decay,
                          Access::state(heads.head(h)).log_decay));
}

// Files of format version 1 (before decayed states) load exactly as before: the same state,
// an empty log-decay.
TYPED_TEST(StateIoRoundTrip, Version1FilesStillLoad) {
  using S = TypeParam;
  // Written by hand in the old layout: F = 1, M = 2, S = (1, -2), z = 0.5, with maxima m = 0.25.
  std::string v1 = header(1, sizeof(S) == 4 ? 1 : 2, 1, 1, 1, 0, 1, 2);
  ASSERT_EQ(v1.size(), 60u);
  const auto put = [&](auto v) {
    unsigned char b[sizeof(v)];
    linattn::detail::io::put_le(b, v);
    v1.append(reinterpret_cast<const char*>(b), sizeof(v));
  };
  const auto put_scalar = [&](S x) {
    linattn::detail::io::Bits<S> bits;
    std::memcpy(&bits, &x, sizeof bits);
    put(bits);
  };
  put(std::uint64_t(0));  // position
  put(std::uint64_t(0));  // unfolded tokens
  for (const S x : {S(1), S(-2), S(0), S(0), S(0.5), S(0), S(0.25)}) put_scalar(x);  // S S_lo z z_lo m
  put(std::uint32_t(0));
  reseal(v1);
  ASSERT_EQ(v1.size(), 64u + 16u + sizeof(S) * 7);
  std::istringstream is(v1, std::ios::binary);
  const auto st = linattn::load_state<S>(is);
  EXPECT_EQ(is.peek(), std::char_traits<char>::eof());
  ASSERT_EQ(st.S.rows(), 1);
  ASSERT_EQ(st.S.cols(), 2);
  EXPECT_EQ(st.S(0, 0), S(1));
  EXPECT_EQ(st.S(0, 1), S(-2));
  EXPECT_EQ(st.z(0), S(0.5));
  EXPECT_EQ(st.m(0), S(0.25));
  EXPECT_TRUE(st.S_lo.isZero(0));
  EXPECT_EQ(st.log_decay.size(), 0);
  // Saving it again writes version 2.
  EXPECT_EQ(as_version1(saved(st)), v1);

  // Every kind: the version-1 file of a state, a recurrent decode and a multi-head one.
  const auto sum = linattn::summarize(test::random_matrix<S>(9, 3, 71),
                                      test::random_matrix<S>(9, 2, 72), SoftmaxSplit{});
  std::istringstream a(as_version1(saved(sum)), std::ios::binary);
  EXPECT_TRUE(same_state(linattn::load_state<S>(a), sum));
  const Mat<S> X = test::random_matrix<S>(50, 6, 73);
  RecurrentLinearAttention<EluPlusOne, S> rnn(6, 6);
  run(rnn, X, X, X, 0, 50);
  RecurrentLinearAttention<EluPlusOne, S> rnn_back(6, 6);
  std::istringstream b(as_version1(saved(rnn)), std::ios::binary);
  linattn::load_state(b, rnn_back);
  EXPECT_EQ(saved(rnn_back), saved(rnn));
  MultiHeadRecurrentLinearAttention<SoftmaxSplit, S> heads(2, 3, 3), heads_back(2, 3, 3);
  run(heads, X, X, X, 0, 50);
  std::istringstream c(as_version1(saved(heads)), std::ios::binary);
  linattn::load_state(c, heads_back);
  EXPECT_EQ(saved(heads_back), saved(heads));
}

TYPED_TEST(StateIoRoundTrip, FreshMaximaAreMinusInfinity) {
  using S = TypeParam;
  const auto st = linattn::make_state<S>(SoftmaxSplit{}, 3, 2);
  std::istringstream is(saved(st), std::ios::binary);
  const auto back = linattn::load_state<S>(is);
  ASSERT_EQ(back.m.size(), 3);
  for (Index d = 0; d < 3; ++d) EXPECT_EQ(back.m(d), -std::numeric_limits<S>::infinity());
  EXPECT_TRUE(same_state(back, st));
}

TYPED_TEST(StateIoRoundTrip, EmptyLowPartsLoadAsZerosAndEmptyStateStaysEmpty) {
  using S = TypeParam;
  LinearAttentionState<S> st;
  st.S = test::random_matrix<S>(3, 4, 5);
  st.z = test::random_matrix<S>(3, 1, 6);
  std::istringstream is(saved(st), std::ios::binary);
  const auto back = linattn::load_state<S>(is);
  EXPECT_TRUE(same_bits(back.S, st.S));
  EXPECT_TRUE(same_bits(back.z, st.z));
  EXPECT_TRUE(back.S_lo.isZero(0));
  EXPECT_EQ(back.S_lo.rows(), 3);
  EXPECT_EQ(back.S_lo.cols(), 4);
  EXPECT_TRUE(back.z_lo.isZero(0));
  EXPECT_EQ(back.z_lo.size(), 3);
  EXPECT_EQ(back.m.size(), 0);

  std::istringstream empty(saved(LinearAttentionState<S>{}), std::ios::binary);
  EXPECT_TRUE(linattn::load_state<S>(empty).empty());
}

TYPED_TEST(StateIoRoundTrip, RecordsFollowEachOtherInOneStream) {
  using S = TypeParam;
  const auto a = linattn::summarize(test::random_matrix<S>(9, 3, 1), test::random_matrix<S>(9, 2, 2));
  const auto b = linattn::summarize(test::random_matrix<S>(9, 4, 3), test::random_matrix<S>(9, 5, 4),
                                    SoftmaxSplit{});
  std::stringstream ss(std::ios::in | std::ios::out | std::ios::binary);
  linattn::save_state(ss, a);
  linattn::save_state(ss, b);
  EXPECT_TRUE(same_state(linattn::load_state<S>(ss), a));
  EXPECT_TRUE(same_state(linattn::load_state<S>(ss), b));
}

TYPED_TEST(StateIoRoundTrip, ThroughAFile) {
  using S = TypeParam;
  const auto st = linattn::summarize(test::random_matrix<S>(20, 4, 7), test::random_matrix<S>(20, 3, 8),
                                     SoftmaxSplit{});
  const std::string path = ::testing::TempDir() + "linattn_state_io_" +
                           std::to_string(sizeof(S)) + ".state";
  {
    std::ofstream out(path, std::ios::binary);
    linattn::save_state(out, st);
  }
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(same_state(linattn::load_state<S>(in), st));
  in.close();
  std::remove(path.c_str());
}

// ------------------------------------------------------------------------------------------
// Resuming a decode
// ------------------------------------------------------------------------------------------

template <class S>
class StateIoResume : public ::testing::Test {};
TYPED_TEST_SUITE(StateIoResume, StateIoScalars, );

// The uninterrupted run against runs saved after k tokens, loaded into a fresh object and
// continued: the same bits for every k, before, at and after a fold of the low parts.
template <class S, class Phi>
void check_resume(Index D, Index M, std::uint32_t seed) {
  constexpr Index N = 300;
  const Mat<S> Q = test::random_matrix<S>(N, D, seed, -2, 2);
  const Mat<S> K = test::random_matrix<S>(N, D, seed + 1, -2, 2);
  const Mat<S> V = test::random_matrix<S>(N, M, seed + 2);
  RecurrentLinearAttention<Phi, S> whole(D, M);
  const Mat<S> expected = run(whole, Q, K, V, 0, N);
  for (const Index k : {Index(0), Index(1), Index(77), Index(127), Index(128), Index(200), N - 1}) {
    SCOPED_TRACE("saved after " + std::to_string(k) + " tokens");
    RecurrentLinearAttention<Phi, S> first(D, M);
    run(first, Q, K, V, 0, k);
    std::stringstream file(std::ios::in | std::ios::out | std::ios::binary);
    linattn::save_state(file, first);
    RecurrentLinearAttention<Phi, S> resumed(D, M);
    linattn::load_state(file, resumed);
    EXPECT_EQ(resumed.position(), k);
    const Mat<S> rest = run(resumed, Q, K, V, k, N);
    EXPECT_TRUE(same_bits(rest, expected.bottomRows(N - k)));
    EXPECT_TRUE(same_state(resumed.state(), whole.state()));
  }
}

TYPED_TEST(StateIoResume, RecurrentIsBitIdentical) {
  using S = TypeParam;
  check_resume<S, EluPlusOne>(6, 5, 21);
  check_resume<S, SoftmaxSplit>(5, 7, 22);
  check_resume<S, NormalizedCosine>(8, 4, 23);
}

TYPED_TEST(StateIoResume, MultiHeadIsBitIdentical) {
  using S = TypeParam;
  constexpr Index H = 3, D = 4, M = 5, N = 260, k = 150;
  const Mat<S> Q = test::random_matrix<S>(N, H * D, 31, -2, 2);
  const Mat<S> K = test::random_matrix<S>(N, H * D, 32, -2, 2);
  const Mat<S> V = test::random_matrix<S>(N, H * M, 33);
  MultiHeadRecurrentLinearAttention<SoftmaxSplit, S> whole(H, D, M);
  const Mat<S> expected = run(whole, Q, K, V, 0, N);
  MultiHeadRecurrentLinearAttention<SoftmaxSplit, S> first(H, D, M);
  run(first, Q, K, V, 0, k);
  std::stringstream file(std::ios::in | std::ios::out | std::ios::binary);
  linattn::save_state(file, first);
  MultiHeadRecurrentLinearAttention<SoftmaxSplit, S> resumed(H, D, M);
  linattn::load_state(file, resumed);
  for (Index h = 0; h < H; ++h) EXPECT_EQ(resumed.head(h).position(), k);
  EXPECT_TRUE(same_bits(run(resumed, Q, K, V, k, N), expected.bottomRows(N - k)));
}

// "Another process": the bytes go through a file and a fresh std::ifstream.
TEST(StateIoResume, ThroughAFile) {
  constexpr Index D = 8, M = 8, N = 400, k = 201;
  const Mat<float> Q = test::random_matrix<float>(N, D, 41, -2, 2);
  const Mat<float> K = test::random_matrix<float>(N, D, 42, -2, 2);
  const Mat<float> V = test::random_matrix<float>(N, M, 43);
  RecurrentLinearAttention<EluPlusOne, float> whole(D, M);
  const Mat<float> expected = run(whole, Q, K, V, 0, N);
  const std::string path = ::testing::TempDir() + "linattn_state_io_resume.state";
  {
    RecurrentLinearAttention<EluPlusOne, float> first(D, M);
    run(first, Q, K, V, 0, k);
    std::ofstream out(path, std::ios::binary);
    linattn::save_state(out, first);
  }
  RecurrentLinearAttention<EluPlusOne, float> resumed(D, M);
  {
    std::ifstream in(path, std::ios::binary);
    linattn::load_state(in, resumed);
  }
  std::remove(path.c_str());
  EXPECT_TRUE(same_bits(run(resumed, Q, K, V, k, N), expected.bottomRows(N - k)));
}

// The gated decoder: the uninterrupted run against runs saved after k tokens, loaded into a
// fresh object (built with the same map and options: the file does not record them) and
// continued. Scalar gates, per-feature gates, scalar gates that turn into per-feature ones
// after token 50, and the unused decoder; gates down to -20 (float underflows some products to
// zero). The decoder keeps F log-decay entries whatever its gates (L = F in the file).
template <class S, class Phi>
void check_gated_resume(Index D, Index M, const GatedOptions& opts, std::uint32_t seed) {
  constexpr Index N = 120;
  const Mat<S> Q = test::random_matrix<S>(N, D, seed, -2, 2);
  const Mat<S> K = test::random_matrix<S>(N, D, seed + 1, -2, 2);
  const Mat<S> V = test::random_matrix<S>(N, M, seed + 2);
  const Index F = Phi{}.feature_dim(D);
  const Mat<S> scalar_gates = test::random_matrix<S>(N, 1, seed + 3, -1, 0);
  Mat<S> feature_gates = test::random_matrix<S>(N, F, seed + 4, -0.5, 0);
  feature_gates(N / 2, 0) = S(-20);
  struct Case {
    const char* name;
    const Mat<S>* G;
    Index switch_at;
  };
  const Case cases[] = {{"scalar gates", &scalar_gates, N},
                        {"per-feature gates", &feature_gates, N},
                        {"scalar, then per-feature gates", &scalar_gates, 50}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RecurrentGatedAttention<Phi, S> whole(D, M, opts);
    const Mat<S> expected = run_gated(whole, Q, K, V, *c.G, feature_gates, c.switch_at, 0, N);
    for (const Index k : {Index(0), Index(1), Index(49), Index(50), Index(77), N - 1}) {
      SCOPED_TRACE("saved after " + std::to_string(k) + " tokens");
      RecurrentGatedAttention<Phi, S> first(D, M, opts);
      run_gated(first, Q, K, V, *c.G, feature_gates, c.switch_at, 0, k);
      std::stringstream file(std::ios::in | std::ios::out | std::ios::binary);
      linattn::save_state(file, first);
      EXPECT_EQ(file.str().size(), std::size_t(80 + sizeof(S) * (F * M + 2 * F)));  // compact
      RecurrentGatedAttention<Phi, S> resumed(D, M, opts);
      linattn::load_state(file, resumed);
      EXPECT_EQ(file.peek(), std::char_traits<char>::eof());  // exactly one record consumed
      EXPECT_EQ(resumed.position(), k);
      EXPECT_TRUE(same_state(resumed.state(), first.state()));
      EXPECT_TRUE(same_bits(resumed.state().log_decay, first.state().log_decay));
      const Mat<S> rest = run_gated(resumed, Q, K, V, *c.G, feature_gates, c.switch_at, k, N);
      EXPECT_TRUE(same_bits(rest, expected.bottomRows(N - k)));
      EXPECT_TRUE(same_state(resumed.state(), whole.state()));
      EXPECT_TRUE(same_bits(resumed.state().log_decay, whole.state().log_decay));
      EXPECT_EQ(resumed.position(), N);
    }
  }
}

template <class S>
class StateIoGatedResume : public ::testing::Test {};
TYPED_TEST_SUITE(StateIoGatedResume, StateIoScalars, );

TYPED_TEST(StateIoGatedResume, IsBitIdentical) {
  using S = TypeParam;
  GatedOptions scaled;
  scaled.scale = 0.35;
  GatedOptions normalized;
  normalized.normalize = true;
  check_gated_resume<S, Identity>(6, 5, scaled, 91);
  check_gated_resume<S, Silu>(5, 7, GatedOptions{}, 92);
  check_gated_resume<S, linattn::L2Normalize<Silu>>(4, 3, scaled, 93);
  check_gated_resume<S, EluPlusOne>(5, 4, normalized, 94);
}

// The documented layout of a gated record (kind 8, compact): the key dimension, L = F, the
// position, then S, z and the log-decay only.
TEST(StateIoGatedResume, LayoutIsAsDocumented) {
  RecurrentGatedAttention<Identity, float> rnn(3, 2);
  const Mat<float> X = test::random_matrix<float>(4, 3, 95);
  const Mat<float> G = test::random_matrix<float>(4, 3, 96, -1, 0);
  run_gated(rnn, X, X, X.leftCols(2).eval(), G, G, 4, 0, 4);
  const std::string f = saved(rnn);
  ASSERT_EQ(f.size(), std::size_t(80 + 4 * (6 + 2 * 3)));
  const auto* b = reinterpret_cast<const unsigned char*>(f.data());
  using linattn::detail::io::get_le;
  EXPECT_EQ(get_le<std::uint32_t>(b + 8), 2u);   // version
  EXPECT_EQ(get_le<std::uint32_t>(b + 12), 1u);  // float
  EXPECT_EQ(get_le<std::uint32_t>(b + 16), 8u);  // kind: RecurrentGatedAttention, compact
  EXPECT_EQ(get_le<std::uint32_t>(b + 20), 0u);  // no maxima
  EXPECT_EQ(get_le<std::uint64_t>(b + 24), 1u);  // heads
  EXPECT_EQ(get_le<std::uint64_t>(b + 32), 3u);  // D
  EXPECT_EQ(get_le<std::uint64_t>(b + 40), 3u);  // F
  EXPECT_EQ(get_le<std::uint64_t>(b + 48), 2u);  // M
  EXPECT_EQ(get_le<std::uint64_t>(b + 56), 3u);  // L = F
  EXPECT_EQ(get_le<std::uint64_t>(b + 68), 4u);  // position
  const auto floats = [&](std::size_t at, Index n) {
    Eigen::VectorXf x(n);
    for (Index i = 0; i < n; ++i) {
      const std::uint32_t bits = get_le<std::uint32_t>(b + at + 4 * std::size_t(i));
      std::memcpy(&x(i), &bits, sizeof bits);
    }
    return x;
  };
  const auto& st = rnn.state();
  Eigen::VectorXf S_rows(6);
  for (Index r = 0; r < 3; ++r) S_rows.segment(2 * r, 2) = st.S.row(r).transpose();
  EXPECT_TRUE(same_bits(floats(76, 6), S_rows));            // S, row-major
  EXPECT_TRUE(same_bits(floats(76 + 24, 3), st.z));         // z
  EXPECT_TRUE(same_bits(floats(76 + 36, 3), st.log_decay));  // log_decay
  EXPECT_EQ(get_le<std::uint32_t>(b + 76 + 48),
            linattn::checksum(f.data(), f.size() - 4));  // the trailing CRC
}

// The kind-4 file of the same gated record (as linattn wrote before kind 8): kind 4, the
// unfolded count (0) after the position, zero low parts after S and z; both CRCs recomputed.
std::string as_kind4(const std::string& compact, std::size_t s) {
  using linattn::detail::io::get_le;
  const auto* b = reinterpret_cast<const unsigned char*>(compact.data());
  EXPECT_EQ(get_le<std::uint32_t>(b + 16), 8u);
  const std::size_t F = get_le<std::uint64_t>(b + 40), M = get_le<std::uint64_t>(b + 48);
  std::string f = compact.substr(0, 76) + std::string(8, '\0') + compact.substr(76, s * F * M) +
                  std::string(s * F * M, '\0') + compact.substr(76 + s * F * M, s * F) +
                  std::string(s * F, '\0') + compact.substr(76 + s * (F * M + F));
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&f[16]), std::uint32_t(4));
  reseal_header(f);
  reseal(f);
  return f;
}

// Kind-4 files still load, into the same state and position, and resume bit for bit; saved
// again they are written as kind 8.
TEST(StateIoGatedResume, Kind4FilesStillLoad) {
  constexpr Index D = 4, M = 3, N = 60, k = 33;
  const Mat<double> Q = test::random_matrix<double>(N, D, 97, -2, 2);
  const Mat<double> V = test::random_matrix<double>(N, M, 98);
  const Mat<double> G = test::random_matrix<double>(N, D, 99, -1, 0);
  RecurrentGatedAttention<Silu, double> whole(D, M), first(D, M), resumed(D, M);
  const Mat<double> expected = run_gated(whole, Q, Q, V, G, G, N, 0, N);
  run_gated(first, Q, Q, V, G, G, N, 0, k);
  const std::string old = as_kind4(saved(first), 8);
  EXPECT_EQ(old.size(), std::size_t(72 + 16 + 8 * (2 * D * M + 3 * D)));
  std::istringstream is(old, std::ios::binary);
  linattn::load_state(is, resumed);
  EXPECT_EQ(resumed.position(), k);
  EXPECT_TRUE(same_state(resumed.state(), first.state()));
  EXPECT_EQ(saved(resumed), saved(first));
  EXPECT_TRUE(same_bits(run_gated(resumed, Q, Q, V, G, G, N, k, N), expected.bottomRows(N - k)));
}

// ------------------------------------------------------------------------------------------
// Failures
// ------------------------------------------------------------------------------------------

// A small decode in progress (SoftmaxSplit, double) and its file.
struct Saved {
  RecurrentLinearAttention<SoftmaxSplit, double> rnn{3, 2};
  std::string file;
  Saved() {
    const Mat<double> Q = test::random_matrix<double>(10, 3, 51);
    const Mat<double> K = test::random_matrix<double>(10, 3, 52);
    const Mat<double> V = test::random_matrix<double>(10, 2, 53);
    run(rnn, Q, K, V, 0, 10);
    file = saved(rnn);
  }
};

// Another object of the same shape, in another position: what a failed load must keep.
RecurrentLinearAttention<SoftmaxSplit, double> bystander() {
  RecurrentLinearAttention<SoftmaxSplit, double> rnn(3, 2);
  const Mat<double> X = test::random_matrix<double>(5, 3, 54);
  run(rnn, X, X, test::random_matrix<double>(5, 2, 55), 0, 5);
  return rnn;
}

TEST(StateIoFailure, EveryTruncationThrowsAndNamesTheField) {
  const Saved s;
  auto target = bystander();
  const std::string before = saved(target);
  for (std::size_t len = 0; len < s.file.size(); ++len) {
    SCOPED_TRACE("first " + std::to_string(len) + " bytes");
    const std::string cut = s.file.substr(0, len);
    std::istringstream seekable(cut, std::ios::binary);
    const std::string m1 = runtime_error_of([&] { linattn::load_state(seekable, target); });
    EXPECT_TRUE(starts_with(m1, "linattn::load_state: truncated file: expected ")) << m1;
    OneWayBuf buf(cut);  // the other path: the loader cannot ask for the length
    std::istream pipe(&buf);
    const std::string m2 = runtime_error_of([&] { linattn::load_state(pipe, target); });
    EXPECT_EQ(m1, m2);
  }
  EXPECT_EQ(saved(target), before);
  // The message says which field and how much of it there was.
  std::istringstream is(s.file.substr(0, 68 + 16 + 20), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(is, target); }),
            "linattn::load_state: truncated file: expected 48 bytes of S, got 20");
  std::istringstream empty("");
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(empty, target); }),
            "linattn::load_state: truncated file: expected 8 bytes of magic number, got 0");
}

TEST(StateIoFailure, EverySingleBitFlipThrows) {
  const Saved s;
  auto target = bystander();
  const std::string before = saved(target);
  std::mt19937 gen(20240613);
  std::uniform_int_distribution<std::size_t> pos(0, s.file.size() * 8 - 1);
  for (int trial = 0; trial < 3000; ++trial) {
    const std::size_t bit = pos(gen), byte = bit / 8;
    std::string f = s.file;
    f[byte] = char(f[byte] ^ (1 << (bit % 8)));
    std::istringstream is(f, std::ios::binary);
    const std::string m = runtime_error_of([&] { linattn::load_state(is, target); });
    const char* expected = byte < 8    ? "linattn::load_state: wrong magic number"
                           : byte < 12 ? "linattn::load_state: unsupported format version"
                           : byte < 68 ? "linattn::load_state: corrupted header: checksum mismatch"
                                       : "linattn::load_state: corrupted data: checksum mismatch";
    ASSERT_TRUE(starts_with(m, expected)) << "bit " << bit << ": " << m;
  }
  EXPECT_EQ(saved(target), before);
}

TEST(StateIoFailure, WrongScalarType) {
  const Saved s;
  RecurrentLinearAttention<SoftmaxSplit, float> target(3, 2);
  const std::string before = saved(target);
  std::istringstream is(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(is, target); }),
            "linattn::load_state: wrong scalar type: the file holds double, not float");
  EXPECT_EQ(saved(target), before);
  std::istringstream st(saved(LinearAttentionState<float>(2, 2)), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(st); }),
            "linattn::load_state: wrong scalar type: the file holds float, not double");
}

TEST(StateIoFailure, WrongKind) {
  const Saved s;
  std::istringstream a(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(a); }),
            "linattn::load_state: wrong kind: the file holds the state of a "
            "RecurrentLinearAttention, not a LinearAttentionState");
  auto target = bystander();
  const std::string before = saved(target);
  std::istringstream b(saved(LinearAttentionState<double>(3, 2, true)), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, target); }),
            "linattn::load_state: wrong kind: the file holds a LinearAttentionState, not the "
            "state of a RecurrentLinearAttention");
  EXPECT_EQ(saved(target), before);
  MultiHeadRecurrentLinearAttention<SoftmaxSplit, double> heads(1, 3, 2);
  std::istringstream c(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, heads); }),
            "linattn::load_state: wrong kind: the file holds the state of a "
            "RecurrentLinearAttention, not the states of a MultiHeadRecurrentLinearAttention");
}

TEST(StateIoFailure, WrongShapeForTheObject) {
  const Saved s;  // SoftmaxSplit, D = F = 3, M = 2
  RecurrentLinearAttention<SoftmaxSplit, double> wider(3, 5);
  const std::string before = saved(wider);
  std::istringstream a(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, wider); }),
            "linattn::load_state: shape mismatch: the file holds 1 head(s) of D = 3, F = 3, "
            "M = 2 with running maxima, this RecurrentLinearAttention has 1 head(s) of D = 3, "
            "F = 3, M = 5 with running maxima");
  EXPECT_EQ(saved(wider), before);
  RecurrentLinearAttention<EluPlusOne, double> other_map(3, 2);
  std::istringstream b(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, other_map); }),
            "linattn::load_state: shape mismatch: the file holds 1 head(s) of D = 3, F = 3, "
            "M = 2 with running maxima, this RecurrentLinearAttention has 1 head(s) of D = 3, "
            "F = 3, M = 2 without running maxima");

  MultiHeadRecurrentLinearAttention<EluPlusOne, float> two(2, 4, 4), three(3, 4, 4);
  const Mat<float> X = test::random_matrix<float>(3, 12, 56);
  run(three, X, X, X, 0, 3);
  const std::string three_before = saved(three);
  std::istringstream c(saved(two), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, three); }),
            "linattn::load_state: shape mismatch: the file holds 2 head(s) of D = 4, F = 4, "
            "M = 4 without running maxima, this MultiHeadRecurrentLinearAttention has 3 head(s) "
            "of D = 4, F = 4, M = 4 without running maxima");
  EXPECT_EQ(saved(three), three_before);
}

TEST(StateIoFailure, HeaderFieldsAreChecked) {
  const auto load = [](const std::string& bytes) {
    std::istringstream is(bytes, std::ios::binary);
    return runtime_error_of([&] { linattn::load_state<float>(is); });
  };
  const std::string p = "linattn::load_state: ";
  EXPECT_EQ(load("\x89LAS\n\x1a\n\n" + std::string(100, '\0')),
            p + "wrong magic number: not a linattn state file (or one that went through a "
                "text-mode stream)");
  for (const std::uint32_t v : {0u, 3u, 0x01000000u})
    EXPECT_EQ(load(header(v, 1, 1, 0, 1, 0, 2, 2)),
              p + "unsupported format version " + std::to_string(v) +
                  " (this linattn reads versions 1 and 2)");
  for (const std::uint32_t v : {1u, 2u}) {  // the same checks in both versions
    SCOPED_TRACE("version " + std::to_string(v));
    EXPECT_EQ(load(header(v, 3, 1, 0, 1, 0, 2, 2)), p + "unknown scalar type code 3");
    EXPECT_EQ(load(header(v, 1, 10, 0, 1, 0, 2, 2)), p + "unknown kind code 10");
    EXPECT_EQ(load(header(v, 1, 1, 8, 1, 0, 2, 2)), p + "unknown flags 8");
    EXPECT_EQ(load(header(v, 1, 1, 0, 2, 0, 2, 2)), p + "invalid head count 2");
    EXPECT_EQ(load(header(v, 1, 1, 0, 1, 5, 2, 2)), p + "invalid key dimension 5");
    MultiHeadRecurrentLinearAttention<EluPlusOne, float> heads(2, 2, 2);
    std::istringstream zero(header(v, 1, 3, 0, 0, 2, 2, 2), std::ios::binary);
    EXPECT_EQ(runtime_error_of([&] { linattn::load_state(zero, heads); }),
              p + "invalid head count 0");
  }
  // Kinds 4 (RecurrentGatedAttention), 5 (BatchedRecurrentLinearAttention) and 6
  // (SoftmaxAttentionLayer::State) came with version 2.
  EXPECT_EQ(load(header(1, 1, 4, 0, 1, 2, 2, 2)), p + "unknown kind code 4");
  EXPECT_EQ(load(header(1, 1, 5, 0, 1, 2, 2, 2)), p + "unknown kind code 5");
  EXPECT_EQ(load(header(1, 1, 6, 0, 1, 2, 0, 2)), p + "unknown kind code 6");
  EXPECT_EQ(load(header(1, 1, 7, 0, 1, 2, 2, 2)), p + "unknown kind code 7");
  EXPECT_EQ(load(header(1, 1, 8, 0, 1, 2, 2, 2)), p + "unknown kind code 8");
  EXPECT_EQ(load(header(2, 1, 5, 0, 1, 2, 2, 2)),
            p + "wrong kind: the file holds the states of a BatchedRecurrentLinearAttention, "
                "not a LinearAttentionState");
  RecurrentGatedAttention<Identity, float> gated(2, 2);
  std::istringstream v1(header(1, 1, 4, 0, 1, 2, 2, 2), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(v1, gated); }),
            p + "unknown kind code 4");
  std::istringstream two_heads(header(2, 1, 4, 0, 2, 2, 2, 2, 2), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(two_heads, gated); }),
            p + "invalid head count 2");
  // Maxima need features, and the compact records (kinds 7 and 8) have none.
  EXPECT_EQ(load(header(2, 1, 1, 1, 1, 0, 0, 0)), p + "invalid flags 1: running maxima with F = 0");
  linattn::RecurrentDeltaRule<Identity, float> delta(2, 2);
  std::istringstream maxima(header(2, 1, 7, 1, 1, 2, 2, 2), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(maxima, delta); }),
            p + "invalid flags 1: the state of a RecurrentDeltaRule has no running maxima");
  std::istringstream gated_maxima(header(2, 1, 8, 1, 1, 2, 2, 2, 2), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(gated_maxima, gated); }),
            p + "invalid flags 1: the state of a RecurrentGatedAttention has no running maxima");
  // The storage flags (bits 1, 2: S kept in bf16 / half) belong to float compact records only,
  // one at a time.
  const std::string storage =
      "a bf16 / half state is one storage type, of a float gated or delta-rule decoder's "
      "compact record";
  EXPECT_EQ(load(header(2, 1, 1, 2, 1, 0, 2, 2)), p + "invalid flags 2: " + storage);
  std::istringstream both(header(2, 1, 7, 6, 1, 2, 2, 2), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(both, delta); }),
            p + "invalid flags 6: " + storage);
  linattn::RecurrentDeltaRule<Identity, double> delta_d(2, 2);
  std::istringstream in_double(header(2, 2, 7, 2, 1, 2, 2, 2), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(in_double, delta_d); }),
            p + "invalid flags 2: " + storage);
  // The gated decoder keeps F log-decay entries: L = 0 or 1 is no record of it.
  for (const std::uint32_t kind : {4u, 8u})
    for (const std::uint64_t L : {std::uint64_t(0), std::uint64_t(1)}) {
      std::istringstream is(header(2, 1, kind, 0, 1, 2, 2, 2, L), std::ios::binary);
      EXPECT_EQ(runtime_error_of([&] { linattn::load_state(is, gated); }),
                p + "invalid log-decay size " + std::to_string(L) +
                    ": a RecurrentGatedAttention keeps F = 2 entries");
    }
  EXPECT_EQ(gated.position(), 0);
  EXPECT_TRUE(same_bits(gated.state().log_decay, Eigen::VectorXf::Zero(2)));
}

// The log-decay size L of a version-2 header must be 0, 1 or F, and 0 with running maxima;
// a failed load leaves the target as it was.
TEST(StateIoFailure, BadLogDecaySizeIsRejected) {
  const auto load = [](const std::string& bytes) {
    std::istringstream is(bytes, std::ios::binary);
    return runtime_error_of([&] { linattn::load_state<float>(is); });
  };
  const std::string p = "linattn::load_state: ";
  EXPECT_EQ(load(header(2, 1, 1, 0, 1, 0, 4, 2, 3)),
            p + "invalid log-decay size 3 (must be 0, 1 or F = 4)");
  EXPECT_EQ(load(header(2, 1, 1, 0, 1, 0, 4, 2, 5)),
            p + "invalid log-decay size 5 (must be 0, 1 or F = 4)");
  EXPECT_EQ(load(header(2, 1, 1, 0, 1, 0, 4, 2, std::uint64_t(1) << 63)),
            p + "invalid log-decay size 9223372036854775808 (must be 0, 1 or F = 4)");
  EXPECT_EQ(load(header(2, 1, 1, 1, 1, 0, 4, 2, 1)),
            p + "invalid log-decay size 1: a state with running maxima (SoftmaxSplit) has no "
                "log-decay");
  // Sizes 1 and F with a truncated record: the declared size is accepted, the record is short.
  EXPECT_EQ(load(header(2, 1, 1, 0, 1, 0, 4, 2, 4)),
            p + "truncated file: expected 8 bytes of position, got 0");

  // In a real file, into a recurrent object (F = 3): the target is unchanged.
  const Saved s;  // SoftmaxSplit: running maxima
  auto target = bystander();
  const std::string before = saved(target);
  for (const std::uint64_t L : {std::uint64_t(1), std::uint64_t(2), std::uint64_t(3)}) {
    std::string f = s.file;
    linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&f[56]), L);
    reseal_header(f);
    std::istringstream is(f, std::ios::binary);
    EXPECT_EQ(runtime_error_of([&] { linattn::load_state(is, target); }),
              L == 2 ? p + "invalid log-decay size 2 (must be 0, 1 or F = 3)"
                     : p + "invalid log-decay size " + std::to_string(L) +
                           ": a state with running maxima (SoftmaxSplit) has no log-decay");
  }
  EXPECT_EQ(saved(target), before);

  // A decayed state's file cut inside its log-decay names the field.
  const std::string d = saved(decayed_state<double>(2, 2, 2, 81));
  std::istringstream cut(d.substr(0, d.size() - 4 - 12), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(cut); }),
            p + "truncated file: expected 16 bytes of log_decay, got 4");
  for (std::size_t len = 0; len < d.size(); ++len) {
    std::istringstream is(d.substr(0, len), std::ios::binary);
    const std::string m = runtime_error_of([&] { linattn::load_state<double>(is); });
    ASSERT_TRUE(starts_with(m, p + "truncated file: expected ")) << len << ": " << m;
  }
}

TEST(StateIoFailure, InvalidRecordFieldsAreChecked) {
  const Saved s;
  auto target = bystander();
  const std::string before = saved(target);
  std::string f = s.file;
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&f[76]), std::uint64_t(200));
  reseal(f);
  std::istringstream a(f, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, target); }),
            "linattn::load_state: invalid record: 200 unfolded tokens (at most 127)");
  EXPECT_EQ(saved(target), before);
  std::string g = saved(LinearAttentionState<double>(2, 2));
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&g[68]), std::uint64_t(7));
  reseal(g);
  std::istringstream b(g, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(b); }),
            "linattn::load_state: invalid record: a LinearAttentionState has position 0 and 0 "
            "unfolded tokens, the file says 7 and 0");
}

// A gated decode in progress (Silu, double, per-feature gates: L = F = 3, M = 2), its file,
// and another object of the same shape in another position (what a failed load must keep).
template <class Phi = Silu>
RecurrentGatedAttention<Phi, double> gated_decoder(Index D, Index M, Index tokens,
                                                   std::uint32_t seed) {
  RecurrentGatedAttention<Phi, double> rnn(D, M);
  const Mat<double> X = test::random_matrix<double>(tokens, D, seed);
  const Mat<double> V = test::random_matrix<double>(tokens, M, seed + 1);
  const Mat<double> G = test::random_matrix<double>(tokens, D, seed + 2, -1, 0);
  run_gated(rnn, X, X, V, G, G, tokens, 0, tokens);
  return rnn;
}

// Everything a failed load must keep: the state's bits, log_decay and position.
template <class R>
std::string snapshot(const R& rnn) {
  return saved(rnn) + "|" + std::to_string(rnn.position()) + "|" +
         std::to_string(rnn.state().log_decay.size());
}

TEST(StateIoGatedFailure, WrongShapeIsRejectedAndTheObjectKept) {
  const auto source = gated_decoder(3, 2, 10, 71);
  const std::string file = saved(source);
  const std::string p = "linattn::load_state: shape mismatch: the file holds 1 head(s) of D = 3, "
                        "F = 3, M = 2 without running maxima, this RecurrentGatedAttention has ";
  auto wider = gated_decoder(3, 5, 4, 72);   // another value dimension
  auto longer = gated_decoder(4, 2, 4, 73);  // another key (and feature) dimension
  const std::string wider_before = snapshot(wider), longer_before = snapshot(longer);
  std::istringstream a(file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, wider); }),
            p + "1 head(s) of D = 3, F = 3, M = 5 without running maxima");
  std::istringstream b(file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, longer); }),
            p + "1 head(s) of D = 4, F = 4, M = 2 without running maxima");
  EXPECT_EQ(snapshot(wider), wider_before);
  EXPECT_EQ(snapshot(longer), longer_before);
  EXPECT_EQ(wider.position(), 4);
  // The same shape loads (and the file records the state, not the map: Identity has F = D).
  RecurrentGatedAttention<Identity, double> other_map(3, 2);
  std::istringstream c(file, std::ios::binary);
  linattn::load_state(c, other_map);
  EXPECT_TRUE(same_state(other_map.state(), source.state()));
  EXPECT_EQ(other_map.position(), 10);
}

TEST(StateIoGatedFailure, WrongKindIsRejected) {
  const std::string file = saved(gated_decoder(3, 2, 10, 74));
  const std::string p = "linattn::load_state: wrong kind: the file holds ";
  std::istringstream a(file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(a); }),
            p + "the state of a RecurrentGatedAttention, not a LinearAttentionState");
  RecurrentLinearAttention<EluPlusOne, double> plain(3, 2);
  std::istringstream b(file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, plain); }),
            p + "the state of a RecurrentGatedAttention, not the state of a "
                "RecurrentLinearAttention");
  auto target = gated_decoder(3, 2, 5, 75);
  const std::string before = snapshot(target);
  std::istringstream c(saved(plain), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, target); }),
            p + "the state of a RecurrentLinearAttention, not the state of a "
                "RecurrentGatedAttention");
  std::istringstream d(saved(target.state()), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(d, target); }),
            p + "a LinearAttentionState, not the state of a RecurrentGatedAttention");
  EXPECT_EQ(snapshot(target), before);
}

TEST(StateIoGatedFailure, EveryTruncationAndBitFlipThrows) {
  const std::string file = saved(gated_decoder(3, 2, 10, 76));
  auto target = gated_decoder(3, 2, 5, 77);
  const std::string before = snapshot(target);
  for (std::size_t len = 0; len < file.size(); ++len) {
    SCOPED_TRACE("first " + std::to_string(len) + " bytes");
    const std::string cut = file.substr(0, len);
    std::istringstream seekable(cut, std::ios::binary);
    const std::string m1 = runtime_error_of([&] { linattn::load_state(seekable, target); });
    EXPECT_TRUE(starts_with(m1, "linattn::load_state: truncated file: expected ")) << m1;
    OneWayBuf buf(cut);
    std::istream pipe(&buf);
    EXPECT_EQ(runtime_error_of([&] { linattn::load_state(pipe, target); }), m1);
  }
  // Cut inside the log-decay (3 doubles before the trailing CRC), the message names it.
  std::istringstream cut(file.substr(0, file.size() - 4 - 20), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(cut, target); }),
            "linattn::load_state: truncated file: expected 24 bytes of log_decay, got 4");
  for (std::size_t bit = 0; bit < file.size() * 8; bit += 7) {
    std::string f = file;
    f[bit / 8] = char(f[bit / 8] ^ (1 << (bit % 8)));
    std::istringstream is(f, std::ios::binary);
    const std::string m = runtime_error_of([&] { linattn::load_state(is, target); });
    ASSERT_TRUE(starts_with(m, "linattn::load_state: ")) << "bit " << bit << ": " << m;
  }
  EXPECT_EQ(snapshot(target), before);
}

// A gated record has no low part: unfolded tokens or low parts that are not all zero bits (a
// -0 included) are refused, though the checksums are right.
TEST(StateIoGatedFailure, InvalidRecordFieldsAreChecked) {
  const std::string compact = saved(gated_decoder(3, 2, 10, 78));
  const std::string file = as_kind4(compact, 8);  // the kind that has these fields
  auto target = gated_decoder(3, 2, 5, 79);
  const std::string before = snapshot(target);
  const std::string p = "linattn::load_state: invalid record: a RecurrentGatedAttention keeps "
                        "no low part";
  std::string f = file;
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&f[76]), std::uint64_t(3));
  reseal(f);
  std::istringstream a(f, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, target); }),
            p + ", so 0 unfolded tokens, the file says 3");
  const std::size_t s_lo = 84 + 8 * 6, z_lo = 84 + 8 * (12 + 3);
  for (const std::size_t at : {s_lo, s_lo + 8 * 5, z_lo, z_lo + 8 * 2}) {
    for (const double lo : {1e-20, -0.0}) {
      std::string g = file;
      std::uint64_t bits;
      std::memcpy(&bits, &lo, sizeof bits);
      linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&g[at]), bits);
      reseal(g);
      std::istringstream b(g, std::ios::binary);
      EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, target); }),
                p + ", the file's S_lo or z_lo is not all zero bits")
          << "byte " << at << ", " << lo;
    }
  }
  EXPECT_EQ(snapshot(target), before);
  // Positions are taken as written, any count of tokens; a negative one is no decoder's.
  std::string h = compact;
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&h[68]), std::uint64_t(123456789));
  reseal(h);
  std::istringstream c(h, std::ios::binary);
  linattn::load_state(c, target);
  EXPECT_EQ(target.position(), 123456789);
  EXPECT_EQ(saved(target), h);
  const std::string kept = snapshot(target);
  for (const std::string& kind : {compact, file}) {
    std::string n = kind;
    linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&n[68]),
                                linattn::detail::io::from_signed(-5));
    reseal(n);
    std::istringstream d(n, std::ios::binary);
    EXPECT_EQ(runtime_error_of([&] { linattn::load_state(d, target); }),
              "linattn::load_state: invalid record: position -5 (a decoding position counts "
              "tokens and is never negative)");
  }
  EXPECT_EQ(snapshot(target), kept);
}

// Shapes past the sanity bounds are refused from the header; a large declared state with a
// short stream is refused before its size is allocated, whether or not the stream can tell
// its length. (Allocating the declared 32 GiB would throw std::bad_alloc on the CI machine.)
TEST(StateIoFailure, HugeDeclaredShapesDoNotAllocate) {
  const std::string p = "linattn::load_state: ";
  std::istringstream absurd(header(1, 1, 1, 0, 1, 0, 1ull << 40, 1ull << 40), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<float>(absurd); }),
            p + "absurd shape: F = 1099511627776, M = 1099511627776, 1 head(s) (more than the 64 "
                "GiB this loader accepts)");
  std::istringstream too_much(header(1, 2, 1, 0, 1, 0, 1u << 16, 1u << 16), std::ios::binary);
  EXPECT_TRUE(starts_with(runtime_error_of([&] { linattn::load_state<double>(too_much); }),
                          p + "absurd shape: F = 65536, M = 65536"));
  MultiHeadRecurrentLinearAttention<EluPlusOne, float> heads(2, 2, 2);
  std::istringstream many(header(1, 1, 3, 0, 1u << 20, 2, 2, 2), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(many, heads); }),
            p + "invalid head count 1048576");

  // 2^16 x 2^16 floats: 16 GiB of S, within the bounds, with 100 bytes behind the header.
  const std::string big = header(1, 1, 1, 0, 1, 0, 1u << 16, 1u << 16) + std::string(100, '\0');
  const std::string expected = p + "truncated file: expected 17179869184 bytes of S, got 84";
  std::istringstream seekable(big, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<float>(seekable); }), expected);
  OneWayBuf buf(big);
  std::istream pipe(&buf);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<float>(pipe); }), expected);
}

TEST(StateIoFailure, StreamStatesAreChecked) {
  const Saved s;
  auto target = bystander();
  const std::string before = saved(target);
  std::istringstream failed(s.file, std::ios::binary);
  failed.setstate(std::ios::failbit);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(failed, target); }),
            "linattn::load_state: the stream is not readable (its failbit or badbit is set)");
  // An exception mask does not replace the loader's own message.
  std::istringstream masked(s.file.substr(0, 100), std::ios::binary);
  masked.exceptions(std::ios::failbit | std::ios::eofbit | std::ios::badbit);
  EXPECT_TRUE(starts_with(runtime_error_of([&] { linattn::load_state(masked, target); }),
                          "linattn::load_state: truncated file: expected 48 bytes of S, got 16"));
  EXPECT_EQ(saved(target), before);

  std::ostringstream bad;
  bad.setstate(std::ios::badbit);
  EXPECT_EQ(runtime_error_of([&] { linattn::save_state(bad, s.rnn); }),
            "linattn::save_state: the stream is not writable (its failbit or badbit is set)");
  for (const bool with_mask : {false, true}) {
    FullDiskBuf disk(50);
    std::ostream out(&disk);
    if (with_mask) out.exceptions(std::ios::badbit | std::ios::failbit);
    EXPECT_TRUE(starts_with(runtime_error_of([&] { linattn::save_state(out, s.rnn); }),
                            "linattn::save_state: writing failed after 0 bytes"));
  }
}

TEST(StateIoFailure, InconsistentStateIsRefusedBySave) {
  LinearAttentionState<float> st(3, 2);
  st.z.resize(2);
  std::ostringstream os;
  try {
    linattn::save_state(os, st);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "linattn::save_state: the state's parts disagree in shape: S is 3x2, z has 2 "
              "entries, m 0, S_lo is 3x2, z_lo has 3");
  }
  EXPECT_TRUE(os.str().empty());
}

TEST(StateIoFailure, BadLogDecayIsRefusedBySave) {
  const auto message = [](const LinearAttentionState<float>& st) {
    std::ostringstream os;
    try {
      linattn::save_state(os, st);
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_TRUE(os.str().empty());
      return std::string(e.what());
    }
    return std::string();
  };
  LinearAttentionState<float> st(4, 2);
  st.log_decay.setZero(3);
  EXPECT_EQ(message(st),
            "linattn::save_state: the state's log-decay has 3 entries, not 0, 1 or F = 4");
  LinearAttentionState<float> mx(4, 2, /*per_feature=*/true);
  mx.log_decay.setZero(1);
  EXPECT_EQ(message(mx),
            "linattn::save_state: a state with running maxima (SoftmaxSplit) has no log-decay, "
            "this one has 1 entries");
}


// ------------------------------------------------------------------------------------------
// Batched decoders (BatchedRecurrentLinearAttention, kind 5)
// ------------------------------------------------------------------------------------------

using linattn::BatchedRecurrentLinearAttention;

constexpr Index kBatchRows = 8;  // input rows per step: sequence b's token of step t at t·8 + b

// Runs steps [from, to) of a batched decode of dec.sequences() (at most kBatchRows)
// sequences: at step t sequence b consumes row t·kBatchRows + b of Q, K, V unless
// t % (b + 3) == b (it skips the step), so that the sequences sit at different positions and
// fold at different steps. Steps where every sequence is active go through step(q, k, v, out),
// the others through step(slots, ...). Returns the outputs in the same rows (zero if skipped).
template <class R, class S>
Mat<S> run_batched(R& dec, const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V, Index from,
                   Index to) {
  const Index B = dec.sequences(), HM = V.cols();
  Mat<S> out = Mat<S>::Zero((to - from) * kBatchRows, HM);
  for (Index t = from; t < to; ++t) {
    std::vector<Index> active;
    for (Index b = 0; b < B; ++b)
      if (t % (b + 3) != b) active.push_back(b);
    const Index n = static_cast<Index>(active.size()), r0 = t * kBatchRows;
    const Index o0 = (t - from) * kBatchRows;
    if (n == B) {
      Mat<S> o(B, HM);
      dec.step(Q.middleRows(r0, B), K.middleRows(r0, B), V.middleRows(r0, B), o);
      out.middleRows(o0, B) = o;
      continue;
    }
    Eigen::VectorXi slots(n);
    Mat<S> q(n, Q.cols()), k(n, K.cols()), v(n, HM), o(n, HM);
    for (Index i = 0; i < n; ++i) {
      const Index b = active[static_cast<std::size_t>(i)];
      slots(i) = static_cast<int>(b);
      q.row(i) = Q.row(r0 + b);
      k.row(i) = K.row(r0 + b);
      v.row(i) = V.row(r0 + b);
    }
    dec.step(slots, q, k, v, o);
    for (Index i = 0; i < n; ++i) out.row(o0 + active[static_cast<std::size_t>(i)]) = o.row(i);
  }
  return out;
}

// The inputs of `steps` steps of H heads of D, M (rows as run_batched() reads them).
template <class S>
struct BatchedInputs {
  Mat<S> Q, K, V;
  BatchedInputs(Index steps, Index H, Index D, Index M, std::uint32_t seed)
      : Q(test::random_matrix<S>(steps * kBatchRows, H * D, seed, -2, 2)),
        K(test::random_matrix<S>(steps * kBatchRows, H * D, seed + 1, -2, 2)),
        V(test::random_matrix<S>(steps * kBatchRows, H * M, seed + 2)) {}
};

// Bytes of a kind-5 file: 72 + 8 + B·H·(16 + s·(2FM + 2F [+ F] + L)).
std::size_t batched_file_bytes(Index B, Index H, Index F, Index M, bool maxima, Index L,
                               std::size_t s) {
  return std::size_t(72 + 8) +
         std::size_t(B * H) * (16 + s * std::size_t(2 * F * M + (maxima ? 3 : 2) * F + L));
}

template <class S>
class StateIoBatched : public ::testing::Test {};
TYPED_TEST_SUITE(StateIoBatched, StateIoScalars, );

// B = 3 sequences of H = 2 heads (D = 5, M = 3) decoded for 200 steps in which the sequences
// skip different steps: more than 128 tokens each, none a multiple of 128, different
// positions and unfolded counts. Saved, loaded into fresh decoders of B = 0 and of B = 5 (one
// with a history of its own), and continued for 200 more steps (more than 128 tokens of every
// sequence): the uninterrupted decode's outputs and states, bit for bit.
template <class S, class Phi>
void check_batched_resume(std::uint32_t seed) {
  constexpr Index B = 3, H = 2, D = 5, M = 3, N = 400, k = 200;
  constexpr Index fold = BatchedRecurrentLinearAttention<Phi, S>::kFoldTokens;
  using Access = linattn::detail::RecurrentStateAccess;
  const BatchedInputs<S> in(N, H, D, M, seed);
  BatchedRecurrentLinearAttention<Phi, S> whole(B, H, D, M);
  const Mat<S> expected = run_batched(whole, in.Q, in.K, in.V, 0, N);
  BatchedRecurrentLinearAttention<Phi, S> first(B, H, D, M);
  run_batched(first, in.Q, in.K, in.V, 0, k);
  for (Index b = 0; b < B; ++b) {
    EXPECT_GT(first.position(b), fold);
    EXPECT_NE(first.position(b) % fold, 0);
    EXPECT_GT(whole.position(b) - first.position(b), fold);
    for (Index c = 0; c < b; ++c) {
      EXPECT_NE(first.position(b), first.position(c));
      EXPECT_NE(Access::unfolded(first, b, 0), Access::unfolded(first, c, 0));
    }
  }
  std::stringstream file(std::ios::in | std::ios::out | std::ios::binary);
  linattn::save_state(file, first);
  const std::string bytes = file.str();
  constexpr bool maxima = linattn::normalizes_keys_per_feature_v<Phi>;
  EXPECT_EQ(bytes.size(), batched_file_bytes(B, H, D, M, maxima, 0, sizeof(S)));
  for (const Index fresh : {Index(0), Index(5)}) {
    SCOPED_TRACE("loaded into a decoder of B = " + std::to_string(fresh));
    BatchedRecurrentLinearAttention<Phi, S> resumed(fresh, H, D, M);
    const BatchedInputs<S> other(20, H, D, M, seed + 7);
    run_batched(resumed, other.Q, other.K, other.V, 0, 20);
    std::istringstream is(bytes, std::ios::binary);
    linattn::load_state(is, resumed);
    EXPECT_EQ(is.peek(), std::char_traits<char>::eof());  // exactly one record consumed
    ASSERT_EQ(resumed.sequences(), B);
    for (Index b = 0; b < B; ++b) EXPECT_EQ(resumed.position(b), first.position(b));
    EXPECT_EQ(saved(resumed), bytes);
    const Mat<S> rest = run_batched(resumed, in.Q, in.K, in.V, k, N);
    EXPECT_TRUE(same_bits(rest, expected.bottomRows((N - k) * kBatchRows)));
    for (Index b = 0; b < B; ++b) {
      EXPECT_EQ(resumed.position(b), whole.position(b));
      for (Index h = 0; h < H; ++h) {
        EXPECT_TRUE(same_state(Access::state(resumed, b, h), Access::state(whole, b, h)));
        EXPECT_EQ(Access::unfolded(resumed, b, h), Access::unfolded(whole, b, h));
      }
    }
  }
  // The same file through a stream that cannot seek.
  OneWayBuf buf(bytes);
  std::istream pipe(&buf);
  BatchedRecurrentLinearAttention<Phi, S> piped(1, H, D, M);
  linattn::load_state(pipe, piped);
  EXPECT_EQ(saved(piped), bytes);
}

TYPED_TEST(StateIoBatched, ResumeIsBitIdentical) {
  using S = TypeParam;
  check_batched_resume<S, EluPlusOne>(111);
  check_batched_resume<S, SoftmaxSplit>(112);
}

// remove_sequence() keeps the removed sequence's states as spares past B·H: only the live
// sequences are written, in their new numbering, and the loaded decoder continues as the
// saved one does (also after add_sequence(), which reuses a spare in one and allocates in the
// other).
TYPED_TEST(StateIoBatched, RemoveSequenceSavesOnlyTheLiveSequences) {
  using S = TypeParam;
  constexpr Index H = 2, D = 5, M = 3, N = 330, k = 140;
  const BatchedInputs<S> in(N, H, D, M, 121);
  BatchedRecurrentLinearAttention<EluPlusOne, S> dec(4, H, D, M);
  run_batched(dec, in.Q, in.K, in.V, 0, k);
  const Index pos2 = dec.position(2), pos3 = dec.position(3);
  dec.remove_sequence(1);  // sequence 3 becomes sequence 1
  ASSERT_EQ(dec.sequences(), 3);
  const std::string f = saved(dec);
  EXPECT_EQ(f.size(), batched_file_bytes(3, H, D, M, false, 0, sizeof(S)));
  EXPECT_EQ(linattn::detail::io::get_le<std::uint64_t>(
                reinterpret_cast<const unsigned char*>(f.data()) + 68),
            3u);
  BatchedRecurrentLinearAttention<EluPlusOne, S> back(0, H, D, M);
  std::istringstream is(f, std::ios::binary);
  linattn::load_state(is, back);
  ASSERT_EQ(back.sequences(), 3);
  EXPECT_EQ(back.position(1), pos3);
  EXPECT_EQ(back.position(2), pos2);
  EXPECT_EQ(saved(back), f);
  EXPECT_TRUE(same_bits(run_batched(back, in.Q, in.K, in.V, k, 300),
                        run_batched(dec, in.Q, in.K, in.V, k, 300)));
  EXPECT_EQ(back.add_sequence(), 3);
  EXPECT_EQ(dec.add_sequence(), 3);
  EXPECT_EQ(back.position(3), 0);
  EXPECT_TRUE(same_bits(run_batched(back, in.Q, in.K, in.V, 300, N),
                        run_batched(dec, in.Q, in.K, in.V, 300, N)));
  EXPECT_EQ(saved(back), saved(dec));
}

// B = 0: an 80-byte file (a decoder whose sequences were all removed writes the same), which
// loads as an empty decoder that then grows like a new one.
TYPED_TEST(StateIoBatched, EmptyDecoderRoundTrips) {
  using S = TypeParam;
  constexpr Index H = 2, D = 4, M = 3;
  const BatchedInputs<S> in(140, H, D, M, 131);
  BatchedRecurrentLinearAttention<SoftmaxSplit, S> empty(0, H, D, M);
  const std::string f = saved(empty);
  ASSERT_EQ(f.size(), 80u);
  EXPECT_EQ(f.size(), batched_file_bytes(0, H, D, M, true, 0, sizeof(S)));
  EXPECT_EQ(linattn::detail::io::get_le<std::uint64_t>(
                reinterpret_cast<const unsigned char*>(f.data()) + 68),
            0u);
  BatchedRecurrentLinearAttention<SoftmaxSplit, S> emptied(2, H, D, M);
  run_batched(emptied, in.Q, in.K, in.V, 0, 10);
  emptied.remove_sequence(1);
  emptied.remove_sequence(0);
  EXPECT_EQ(saved(emptied), f);

  BatchedRecurrentLinearAttention<SoftmaxSplit, S> target(3, H, D, M);
  run_batched(target, in.Q, in.K, in.V, 0, 5);
  std::istringstream is(f, std::ios::binary);
  linattn::load_state(is, target);
  EXPECT_EQ(is.peek(), std::char_traits<char>::eof());
  EXPECT_EQ(target.sequences(), 0);
  EXPECT_EQ(saved(target), f);
  target.add_sequence();
  target.add_sequence();
  BatchedRecurrentLinearAttention<SoftmaxSplit, S> fresh(2, H, D, M);
  EXPECT_TRUE(same_bits(run_batched(target, in.Q, in.K, in.V, 0, 140),
                        run_batched(fresh, in.Q, in.K, in.V, 0, 140)));
  EXPECT_EQ(saved(target), saved(fresh));
}

// The documented layout: kind 5, H in the heads field, B first in the payload, then the
// records sequence-major, each with its sequence's position and its own unfolded count.
TEST(StateIoBatched, LayoutIsAsDocumented) {
  using Access = linattn::detail::RecurrentStateAccess;
  using linattn::detail::io::get_le;
  constexpr Index B = 2, H = 2, D = 3, M = 2;
  const BatchedInputs<float> in(7, H, D, M, 141);
  BatchedRecurrentLinearAttention<EluPlusOne, float> dec(B, H, D, M);
  run_batched(dec, in.Q, in.K, in.V, 0, 7);
  ASSERT_NE(dec.position(0), dec.position(1));
  const std::string f = saved(dec);
  const std::size_t record = 16 + 4 * (2 * 6 + 2 * 3);
  ASSERT_EQ(f.size(), 72 + 8 + 4 * record);
  const auto* b = reinterpret_cast<const unsigned char*>(f.data());
  EXPECT_EQ(get_le<std::uint32_t>(b + 8), 2u);   // version
  EXPECT_EQ(get_le<std::uint32_t>(b + 12), 1u);  // float
  EXPECT_EQ(get_le<std::uint32_t>(b + 16), 5u);  // kind: BatchedRecurrentLinearAttention
  EXPECT_EQ(get_le<std::uint32_t>(b + 20), 0u);  // no maxima
  EXPECT_EQ(get_le<std::uint64_t>(b + 24), 2u);  // H, heads per sequence
  EXPECT_EQ(get_le<std::uint64_t>(b + 32), 3u);  // D
  EXPECT_EQ(get_le<std::uint64_t>(b + 40), 3u);  // F
  EXPECT_EQ(get_le<std::uint64_t>(b + 48), 2u);  // M
  EXPECT_EQ(get_le<std::uint64_t>(b + 56), 0u);  // L
  EXPECT_EQ(get_le<std::uint32_t>(b + 64), linattn::detail::io::crc32(b, 64));
  EXPECT_EQ(get_le<std::uint64_t>(b + 68), 2u);  // B
  for (Index s = 0; s < B; ++s)
    for (Index h = 0; h < H; ++h) {
      SCOPED_TRACE("sequence " + std::to_string(s) + ", head " + std::to_string(h));
      const unsigned char* r = b + 76 + std::size_t(s * H + h) * record;
      EXPECT_EQ(get_le<std::uint64_t>(r), std::uint64_t(dec.position(s)));
      EXPECT_EQ(get_le<std::uint64_t>(r + 8), std::uint64_t(Access::unfolded(dec, s, h)));
      Eigen::Matrix<float, 3, 2, Eigen::RowMajor> S;
      for (Index i = 0; i < 6; ++i) {
        const std::uint32_t bits = get_le<std::uint32_t>(r + 16 + 4 * i);
        std::memcpy(S.data() + i, &bits, sizeof bits);
      }
      EXPECT_TRUE(same_bits(S, Access::state(dec, s, h).S));
    }
  EXPECT_EQ(get_le<std::uint32_t>(b + f.size() - 4), linattn::detail::io::crc32(b, f.size() - 4));
}

// States set with a log-decay (set_state() copies it) are saved with it when all B·H agree in
// size, and refused by save_state otherwise.
TEST(StateIoBatched, LogDecaysAreSavedAndMustAgree) {
  constexpr Index H = 2, D = 4, M = 3;
  BatchedRecurrentLinearAttention<EluPlusOne, double> dec(2, H, D, M);
  dec.set_state(1, 1, decayed_state<double>(D, M, 1, 151), 9);
  std::ostringstream os(std::ios::binary);
  try {
    linattn::save_state(os, dec);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "linattn::save_state: the states' log-decays differ in size: sequence 0, head 0 "
              "has 0 entries, sequence 1, head 1 has 1");
  }
  EXPECT_TRUE(os.str().empty());
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < H; ++h)
      dec.set_state(b, h, decayed_state<double>(D, M, 1, 152 + std::uint32_t(b * H + h)), 9 + b);
  const std::string f = saved(dec);
  EXPECT_EQ(f.size(), batched_file_bytes(2, H, D, M, false, 1, 8));
  BatchedRecurrentLinearAttention<EluPlusOne, double> back(0, H, D, M);
  std::istringstream is(f, std::ios::binary);
  linattn::load_state(is, back);
  for (Index b = 0; b < 2; ++b) {
    EXPECT_EQ(back.position(b), 9 + b);
    for (Index h = 0; h < H; ++h)
      EXPECT_TRUE(same_bits(back.state(b, h).log_decay, dec.state(b, h).log_decay));
  }
  EXPECT_EQ(saved(back), f);
}

// A batched decode in progress (SoftmaxSplit, double, B = 3, H = 2, D = F = 5, M = 3) and its
// file.
struct SavedBatched {
  static constexpr Index H = 2, D = 5, M = 3;
  using Decoder = BatchedRecurrentLinearAttention<SoftmaxSplit, double>;
  BatchedInputs<double> in{300, H, D, M, 161};
  Decoder dec{3, H, D, M};
  std::string file;
  std::size_t record = 16 + 8 * (2 * D * M + 3 * D);  // bytes of one head record
  SavedBatched() {
    run_batched(dec, in.Q, in.K, in.V, 0, 140);
    file = saved(dec);
  }
  std::size_t record_at(Index b, Index h) const { return 76 + std::size_t(b * H + h) * record; }
};

// Another decoder of the same shapes in another position, and its twin: a failed load must
// leave it so that it continues exactly as the twin that never tried.
SavedBatched::Decoder batched_bystander() {
  SavedBatched::Decoder dec(2, SavedBatched::H, SavedBatched::D, SavedBatched::M);
  const BatchedInputs<double> in(20, SavedBatched::H, SavedBatched::D, SavedBatched::M, 171);
  run_batched(dec, in.Q, in.K, in.V, 0, 20);
  return dec;
}

// The target is unchanged: the same file, and the same outputs from here on as its twin's.
void expect_unchanged(SavedBatched::Decoder& target, SavedBatched::Decoder twin) {
  EXPECT_EQ(target.sequences(), twin.sequences());
  EXPECT_EQ(saved(target), saved(twin));
  const BatchedInputs<double> in(150, SavedBatched::H, SavedBatched::D, SavedBatched::M, 181);
  EXPECT_TRUE(same_bits(run_batched(target, in.Q, in.K, in.V, 0, 150),
                        run_batched(twin, in.Q, in.K, in.V, 0, 150)));
}

TEST(StateIoBatchedFailure, WrongKindIsRejected) {
  const SavedBatched s;
  const std::string p = "linattn::load_state: wrong kind: the file holds ";
  MultiHeadRecurrentLinearAttention<SoftmaxSplit, double> heads(2, 5, 3);
  const std::string heads_before = saved(heads);
  std::istringstream a(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, heads); }),
            p + "the states of a BatchedRecurrentLinearAttention, not the states of a "
                "MultiHeadRecurrentLinearAttention");
  EXPECT_EQ(saved(heads), heads_before);
  std::istringstream b(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(b); }),
            p + "the states of a BatchedRecurrentLinearAttention, not a LinearAttentionState");

  auto target = batched_bystander();
  const auto twin = batched_bystander();
  std::istringstream c(heads_before, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, target); }),
            p + "the states of a MultiHeadRecurrentLinearAttention, not the states of a "
                "BatchedRecurrentLinearAttention");
  std::istringstream d(saved(RecurrentLinearAttention<SoftmaxSplit, double>(5, 3)),
                       std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(d, target); }),
            p + "the state of a RecurrentLinearAttention, not the states of a "
                "BatchedRecurrentLinearAttention");
  expect_unchanged(target, twin);
}

TEST(StateIoBatchedFailure, WrongShapeIsRejected) {
  const SavedBatched s;  // H = 2, D = F = 5, M = 3, with maxima
  const std::string p = "linattn::load_state: shape mismatch: the file holds 2 head(s) of D = "
                        "5, F = 5, M = 3 with running maxima, this "
                        "BatchedRecurrentLinearAttention has ";
  BatchedRecurrentLinearAttention<SoftmaxSplit, double> three_heads(3, 3, 5, 3);
  BatchedRecurrentLinearAttention<SoftmaxSplit, double> wider(3, 2, 5, 4);
  BatchedRecurrentLinearAttention<EluPlusOne, double> other_map(3, 2, 5, 3);
  const std::string three_before = saved(three_heads), wider_before = saved(wider);
  std::istringstream a(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, three_heads); }),
            p + "3 head(s) of D = 5, F = 5, M = 3 with running maxima");
  std::istringstream b(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, wider); }),
            p + "2 head(s) of D = 5, F = 5, M = 4 with running maxima");
  std::istringstream c(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, other_map); }),
            p + "2 head(s) of D = 5, F = 5, M = 3 without running maxima");
  EXPECT_EQ(saved(three_heads), three_before);
  EXPECT_EQ(saved(wider), wider_before);
  EXPECT_EQ(three_heads.sequences(), 3);
}

// The H records of a sequence carry its one position: a file whose checksums are right but
// whose heads disagree is refused, naming the record.
TEST(StateIoBatchedFailure, HeadsThatDisagreeOnThePositionAreRejected) {
  const SavedBatched s;
  auto target = batched_bystander();
  const auto twin = batched_bystander();
  const std::int64_t pos1 = s.dec.position(1);
  std::string f = s.file;
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&f[s.record_at(1, 1)]),
                              std::uint64_t(pos1 + 1));
  reseal(f);
  std::istringstream a(f, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, target); }),
            "linattn::load_state: invalid record: sequence 1, head 1: position " +
                std::to_string(pos1 + 1) + ", but head 0 of the sequence has " +
                std::to_string(pos1) + " (the heads of a sequence share one position)");
  // Head 0 changed instead: head 1 disagrees with it.
  std::string g = s.file;
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&g[s.record_at(2, 0)]),
                              std::uint64_t(0));
  reseal(g);
  std::istringstream b(g, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, target); }),
            "linattn::load_state: invalid record: sequence 2, head 1: position " +
                std::to_string(s.dec.position(2)) +
                ", but head 0 of the sequence has 0 (the heads of a sequence share one position)");
  // An unfolded count of 128 or more, named by its record.
  std::string u = s.file;
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&u[s.record_at(0, 1) + 8]),
                              std::uint64_t(128));
  reseal(u);
  std::istringstream c(u, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, target); }),
            "linattn::load_state: invalid record: sequence 0, head 1: 128 unfolded tokens (at "
            "most 127)");
  expect_unchanged(target, twin);
  // Positions equal in all heads of a sequence load as written.
  std::string ok = s.file;
  for (Index h = 0; h < SavedBatched::H; ++h)
    linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&ok[s.record_at(1, h)]),
                                std::uint64_t(123456789));
  reseal(ok);
  std::istringstream d(ok, std::ios::binary);
  linattn::load_state(d, target);
  EXPECT_EQ(target.position(1), 123456789);
  EXPECT_EQ(saved(target), ok);
}

TEST(StateIoBatchedFailure, EveryTruncationThrowsAndNamesTheField) {
  const SavedBatched s;
  auto target = batched_bystander();
  const auto twin = batched_bystander();
  for (std::size_t len = 0; len < s.file.size(); ++len) {
    SCOPED_TRACE("first " + std::to_string(len) + " bytes");
    const std::string cut = s.file.substr(0, len);
    std::istringstream seekable(cut, std::ios::binary);
    const std::string m1 = runtime_error_of([&] { linattn::load_state(seekable, target); });
    ASSERT_TRUE(starts_with(m1, "linattn::load_state: truncated file: expected ")) << m1;
    OneWayBuf buf(cut);
    std::istream pipe(&buf);
    ASSERT_EQ(runtime_error_of([&] { linattn::load_state(pipe, target); }), m1);
  }
  const auto message = [&](std::size_t len) {
    std::istringstream is(s.file.substr(0, len), std::ios::binary);
    return runtime_error_of([&] { linattn::load_state(is, target); });
  };
  const std::string p = "linattn::load_state: truncated file: expected ";
  EXPECT_EQ(message(68), p + "8 bytes of sequence count B, got 0");
  EXPECT_EQ(message(71), p + "8 bytes of sequence count B, got 3");
  EXPECT_EQ(message(76), p + "8 bytes of position (sequence 0, head 0), got 0");
  EXPECT_EQ(message(s.record_at(1, 1) + 5), p + "8 bytes of position (sequence 1, head 1), got 5");
  EXPECT_EQ(message(s.record_at(2, 0) + 16 + 10), p + "120 bytes of S (sequence 2, head 0), got 10");
  EXPECT_EQ(message(s.record_at(2, 1) + 16 + 8 * 30 + 8 * 10 + 3),
            p + "40 bytes of m (sequence 2, head 1), got 3");
  EXPECT_EQ(message(s.file.size() - 1), p + "4 bytes of checksum, got 3");
  expect_unchanged(target, twin);
}

// A flipped byte of a record (or of the trailing CRC) is a checksum mismatch; one of B makes
// the file's length or checksum wrong, refused as well.
TEST(StateIoBatchedFailure, FlippedBytesThrow) {
  const SavedBatched s;
  auto target = batched_bystander();
  const auto twin = batched_bystander();
  for (std::size_t at = 68; at < s.file.size(); at += 5) {
    for (const int bit : {0, 5}) {
      std::string f = s.file;
      f[at] = char(f[at] ^ (1 << bit));
      std::istringstream is(f, std::ios::binary);
      const std::string m = runtime_error_of([&] { linattn::load_state(is, target); });
      if (at >= 76)
        ASSERT_TRUE(starts_with(m, "linattn::load_state: corrupted data: checksum mismatch"))
            << "byte " << at << ", bit " << bit << ": " << m;
      else
        ASSERT_TRUE(starts_with(m, "linattn::load_state: ")) << "byte " << at << ": " << m;
    }
  }
  expect_unchanged(target, twin);
}

// B is checked against the sanity bounds before the records are read or anything allocated;
// a file of B = 0 sequences has no log-decay.
TEST(StateIoBatchedFailure, AbsurdSequenceCountsDoNotAllocate) {
  const std::string p = "linattn::load_state: ";
  const auto with_b = [](std::string f, std::uint64_t B) {
    unsigned char b[8];
    linattn::detail::io::put_le(b, B);
    return f.append(reinterpret_cast<const char*>(b), 8);
  };
  auto target = batched_bystander();
  const auto twin = batched_bystander();
  const auto load = [&](const std::string& bytes) {
    std::istringstream is(bytes, std::ios::binary);
    return runtime_error_of([&] { linattn::load_state(is, target); });
  };
  const std::string h = header(2, 2, 5, 1, 2, 5, 5, 3);  // double, maxima, H = 2, D = F = 5, M = 3
  EXPECT_EQ(load(with_b(h, std::uint64_t(1) << 40)),
            p + "absurd shape: B = 1099511627776 sequences of 2 head(s) (more than the "
                "16777216 (sequence, head) states this loader accepts)");
  EXPECT_EQ(load(with_b(h, ~std::uint64_t(0))),
            p + "absurd shape: B = 18446744073709551615 sequences of 2 head(s) (more than the "
                "16777216 (sequence, head) states this loader accepts)");
  // Within the bounds (2^24 records of 376 bytes) with 100 bytes of them in the stream:
  // refused before the records are allocated, whether or not the stream can tell its length.
  const std::string many = with_b(h, std::uint64_t(1) << 23) + std::string(100, '\0');
  const std::string short_of_many =
      p + "truncated file: expected 120 bytes of S (sequence 0, head 0), got 84";
  EXPECT_EQ(load(many), short_of_many);
  OneWayBuf buf(many);
  std::istream pipe(&buf);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(pipe, target); }), short_of_many);
  // Within both header bounds, more than 64 GiB of records (checked below the object: no
  // decoder of F = M = 2^16 is built). 2^16 x 2^16 floats of S and of S_lo: 32 GiB a record.
  {
    std::istringstream is(with_b(header(2, 1, 5, 0, 1, 1, 1u << 16, 1u << 16), 3),
                          std::ios::binary);
    std::uint32_t crc = 0;
    const auto hd = linattn::detail::io::read_header<float>(is, "load_state", 5, crc);
    EXPECT_EQ(runtime_error_of(
                  [&] { linattn::detail::io::read_payload<float>(is, "load_state", hd, crc); }),
              p + "absurd shape: F = 65536, M = 65536, B = 3 sequences of 1 head(s) (more than "
                  "the 64 GiB this loader accepts)");
  }
  // B = 0 with a log-decay size: nothing to decay, and it would not save back.
  std::string empty_decayed = with_b(header(2, 2, 5, 0, 2, 5, 5, 3, 1), 0) + std::string(4, '\0');
  reseal(empty_decayed);
  BatchedRecurrentLinearAttention<EluPlusOne, double> plain(1, 2, 5, 3);
  std::istringstream e(empty_decayed, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(e, plain); }),
            p + "invalid log-decay size 1: a file of B = 0 sequences has no state to decay (L "
                "must be 0)");
  EXPECT_EQ(plain.sequences(), 1);
  expect_unchanged(target, twin);
}

// ------------------------------------------------------------------------------------------
// Attention layers: LinearAttentionLayer::State (kind 3) and SoftmaxAttentionLayer::State
// (kind 6, the KV cache)
// ------------------------------------------------------------------------------------------

using linattn::LinearAttentionLayer;
using linattn::SoftmaxAttentionLayer;

// A layer of d_model = 7 and H = 2 heads of D = 5, M = 3 (D != M, neither dividing d_model) by
// default, with random weights and non-zero biases.
template <class Layer>
Layer layer_of(std::uint32_t seed, Index d_model = 7, Index H = 2, Index D = 5, Index M = 3) {
  Layer layer(d_model, H, D, M);
  layer.reset_parameters(seed);
  using S = typename decltype(layer.bq)::Scalar;
  layer.bq = test::random_matrix<S>(layer.bq.size(), 1, seed + 1, -0.5, 0.5);
  layer.bk = test::random_matrix<S>(layer.bk.size(), 1, seed + 2, -0.5, 0.5);
  layer.bv = test::random_matrix<S>(layer.bv.size(), 1, seed + 3, -0.5, 0.5);
  layer.bo = test::random_matrix<S>(layer.bo.size(), 1, seed + 4, -0.5, 0.5);
  return layer;
}

// Generation over rows [from, to) of X: a prefill (forward(X, state)) of the first `prefill`
// rows, then one step per row. Returns the output rows.
template <class Layer, class State, class S>
Mat<S> decode(const Layer& layer, State& state, const Mat<S>& X, Index from, Index prefill,
              Index to) {
  Mat<S> Y(to - from, layer.d_model());
  if (prefill > 0) Y.topRows(prefill) = layer.forward(X.middleRows(from, prefill), state);
  Eigen::Matrix<S, Eigen::Dynamic, 1> y(layer.d_model());
  for (Index t = from + prefill; t < to; ++t) {
    layer.step(X.row(t), state, y);
    Y.row(t - from) = y.transpose();
  }
  return Y;
}

template <class S>
class StateIoLayer : public ::testing::Test {};
TYPED_TEST_SUITE(StateIoLayer, StateIoScalars, );

// A decode of 190 tokens (a prefill of 40, then 150 steps: past a fold of the low parts, and
// 22 tokens into the next) saved, loaded into a fresh State and into one with a history of its
// own, and continued by 150 steps (past the next fold), a prefill of 30 and 150 more steps:
// the uninterrupted decode's outputs bit for bit, position() restored, and the same final
// state. Returns the saved bytes.
template <class Layer>
std::string check_layer_resume(const Layer& layer, std::uint32_t seed) {
  using S = typename decltype(layer.bq)::Scalar;
  constexpr Index N = 520, prefill = 40, k = 190;
  const Mat<S> X = test::random_matrix<S>(N, layer.d_model(), seed, -2, 2);
  const auto rest = [&](auto& state) {
    Mat<S> out(N - k, layer.d_model());
    out.topRows(150) = decode(layer, state, X, k, 0, k + 150);
    out.bottomRows(N - k - 150) = decode(layer, state, X, k + 150, 30, N);
    return out;
  };
  auto whole = layer.make_state();
  decode(layer, whole, X, 0, prefill, k);
  auto first = whole;  // the decode to save, at token k
  const Mat<S> expected = rest(whole);
  EXPECT_EQ(first.position(), k);
  const std::string bytes = saved(first);
  EXPECT_EQ(saved(first), bytes);  // saving does not move the state
  for (const int target : {0, 1, 2}) {
    SCOPED_TRACE("target " + std::to_string(target));
    auto resumed = layer.make_state();
    if (target == 1) decode(layer, resumed, X, 300, 7, 330);  // a history of its own
    if (target < 2) {
      std::istringstream is(bytes, std::ios::binary);
      linattn::load_state(is, resumed);
      EXPECT_EQ(is.peek(), std::char_traits<char>::eof());  // exactly one record consumed
    } else {
      OneWayBuf buf(bytes);  // a stream that cannot seek
      std::istream pipe(&buf);
      linattn::load_state(pipe, resumed);
    }
    EXPECT_EQ(resumed.position(), k);
    EXPECT_EQ(saved(resumed), bytes);
    EXPECT_TRUE(same_bits(rest(resumed), expected));
    EXPECT_EQ(resumed.position(), N);
    EXPECT_EQ(saved(resumed), saved(whole));
  }
  return bytes;
}

template <class S, class Phi>
void check_linear_layer_resume(std::uint32_t seed) {
  using Access = linattn::detail::RecurrentStateAccess;
  const auto layer = layer_of<LinearAttentionLayer<Phi, S>>(seed);
  const std::string bytes = check_layer_resume(layer, seed + 10);
  // The bytes of the heads' multi-head file (kind 3), saved 22 tokens after a fold.
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  EXPECT_EQ(linattn::detail::io::get_le<std::uint32_t>(b + 16), 3u);
  constexpr bool maxima = linattn::normalizes_keys_per_feature_v<Phi>;
  EXPECT_EQ(bytes.size(), std::size_t(72 + 2 * (16 + sizeof(S) * (2 * 5 * 3 + (maxima ? 3 : 2) * 5))));
  auto state = layer.make_state();
  std::istringstream is(bytes, std::ios::binary);
  linattn::load_state(is, state);
  EXPECT_EQ(saved(state.heads()), bytes);
  for (Index h = 0; h < 2; ++h) {
    EXPECT_EQ(state.heads().head(h).position(), 190);
    EXPECT_EQ(Access::unfolded(state.heads().head(h)), 22);
  }
  // The same file written before layer states could be saved (format version 1) loads as well.
  auto old = layer.make_state();
  std::istringstream v1(as_version1(bytes), std::ios::binary);
  linattn::load_state(v1, old);
  EXPECT_EQ(old.position(), 190);
  EXPECT_EQ(saved(old), bytes);
  // A State's file loads into a MultiHeadRecurrentLinearAttention of its shapes, and back.
  MultiHeadRecurrentLinearAttention<Phi, S> heads(2, 5, 3);
  std::istringstream mh(bytes, std::ios::binary);
  linattn::load_state(mh, heads);
  EXPECT_EQ(saved(heads), bytes);
}

TYPED_TEST(StateIoLayer, LinearLayerResumesBitIdentically) {
  using S = TypeParam;
  check_linear_layer_resume<S, EluPlusOne>(201);
  check_linear_layer_resume<S, SoftmaxSplit>(202);
}

TYPED_TEST(StateIoLayer, SoftmaxLayerResumesBitIdentically) {
  using S = TypeParam;
  const auto layer = layer_of<SoftmaxAttentionLayer<S>>(211);
  const std::string bytes = check_layer_resume(layer, 221);
  EXPECT_EQ(bytes.size(), std::size_t(72 + 8) + 190 * 2 * (5 + 3) * sizeof(S));
  // Loaded into a State whose capacity holds the file's tokens, the cache keeps its memory
  // (steps go on without allocating); into one that does not, it is reallocated to T rows.
  auto roomy = layer.make_state(1000);
  std::istringstream a(bytes, std::ios::binary);
  linattn::load_state(a, roomy);
  EXPECT_EQ(roomy.capacity(), 1000);
  EXPECT_EQ(roomy.position(), 190);
  auto small = layer.make_state(10);
  std::istringstream b(bytes, std::ios::binary);
  linattn::load_state(b, small);
  EXPECT_EQ(small.capacity(), 190);
  EXPECT_TRUE(same_bits(small.keys(), roomy.keys()));
  EXPECT_TRUE(same_bits(small.values(), roomy.values()));
  const Mat<S> X = test::random_matrix<S>(40, 7, 231, -2, 2);
  EXPECT_TRUE(same_bits(decode(layer, small, X, 0, 0, 40), decode(layer, roomy, X, 0, 0, 40)));
}

// An empty cache (T = 0, 80 bytes) round trips: loaded into a State with a history, it empties
// it, which then continues like a new one.
TYPED_TEST(StateIoLayer, EmptyCacheRoundTrips) {
  using S = TypeParam;
  const auto layer = layer_of<SoftmaxAttentionLayer<S>>(241);
  const std::string f = saved(layer.make_state());
  ASSERT_EQ(f.size(), 80u);
  EXPECT_EQ(saved(layer.make_state(64)), f);  // the capacity is not saved
  const Mat<S> X = test::random_matrix<S>(30, 7, 242, -2, 2);
  auto target = layer.make_state();
  decode(layer, target, X, 0, 5, 12);
  std::istringstream is(f, std::ios::binary);
  linattn::load_state(is, target);
  EXPECT_EQ(target.position(), 0);
  EXPECT_EQ(saved(target), f);
  auto fresh = layer.make_state();
  EXPECT_TRUE(same_bits(decode(layer, target, X, 0, 10, 30), decode(layer, fresh, X, 0, 10, 30)));
}

// The documented layout of kind 6: the header (H, D, F = 0, M, L = 0, no flags), T at 68, the T
// key rows, then the T value rows, row-major, then the CRC.
TEST(StateIoLayer, KVCacheLayoutIsAsDocumented) {
  using linattn::detail::io::get_le;
  const auto layer = layer_of<SoftmaxAttentionLayer<float>>(251);
  auto state = layer.make_state();
  decode(layer, state, test::random_matrix<float>(9, 7, 252), 0, 4, 9);
  const std::string f = saved(state);
  ASSERT_EQ(f.size(), 72 + 8 + 9 * 2 * (5 + 3) * 4u);
  const auto* b = reinterpret_cast<const unsigned char*>(f.data());
  EXPECT_EQ(get_le<std::uint32_t>(b + 8), 2u);   // version
  EXPECT_EQ(get_le<std::uint32_t>(b + 12), 1u);  // float
  EXPECT_EQ(get_le<std::uint32_t>(b + 16), 6u);  // kind: SoftmaxAttentionLayer::State
  EXPECT_EQ(get_le<std::uint32_t>(b + 20), 0u);  // flags
  EXPECT_EQ(get_le<std::uint64_t>(b + 24), 2u);  // H
  EXPECT_EQ(get_le<std::uint64_t>(b + 32), 5u);  // D
  EXPECT_EQ(get_le<std::uint64_t>(b + 40), 0u);  // F: no feature map
  EXPECT_EQ(get_le<std::uint64_t>(b + 48), 3u);  // M
  EXPECT_EQ(get_le<std::uint64_t>(b + 56), 0u);  // L
  EXPECT_EQ(get_le<std::uint32_t>(b + 64), linattn::detail::io::crc32(b, 64));
  EXPECT_EQ(get_le<std::uint64_t>(b + 68), 9u);  // T
  const auto read = [&](std::size_t at, Index rows, Index cols) {
    test::RowMat<float> m(rows, cols);
    for (Index i = 0; i < rows * cols; ++i) {
      const std::uint32_t bits = get_le<std::uint32_t>(b + at + 4 * std::size_t(i));
      std::memcpy(m.data() + i, &bits, sizeof bits);
    }
    return m;
  };
  EXPECT_TRUE(same_bits(read(76, 9, 10), state.keys()));
  EXPECT_TRUE(same_bits(read(76 + 9 * 10 * 4, 9, 6), state.values()));
  EXPECT_EQ(get_le<std::uint32_t>(b + f.size() - 4), linattn::detail::io::crc32(b, f.size() - 4));
}

// Failures of the linear layer's State: a decode in progress (SoftmaxSplit, double, H = 2,
// D = F = 5, M = 3: records of 376 bytes), its file, and a State in another position with its
// twin: a failed load must leave the State so that it continues exactly as the twin.
struct SavedLinearLayer {
  using Layer = LinearAttentionLayer<SoftmaxSplit, double>;
  Layer layer = layer_of<Layer>(261);
  Mat<double> X = test::random_matrix<double>(200, 7, 262, -2, 2);
  std::string file;
  std::size_t record = 16 + 8 * (2 * 5 * 3 + 3 * 5);
  SavedLinearLayer() {
    auto state = layer.make_state();
    decode(layer, state, X, 0, 8, 20);
    file = saved(state);
  }
  Layer::State bystander() const {
    auto state = layer.make_state();
    decode(layer, state, X, 50, 3, 61);
    return state;
  }
  void expect_unchanged(Layer::State& target, Layer::State twin) const {
    EXPECT_EQ(target.position(), twin.position());
    EXPECT_EQ(saved(target), saved(twin));
    EXPECT_TRUE(same_bits(decode(layer, target, X, 61, 0, 200), decode(layer, twin, X, 61, 0, 200)));
  }
};

TEST(StateIoLayerFailure, LinearWrongKindAndShapeAreRejected) {
  const SavedLinearLayer s;
  auto target = s.bystander();
  const auto twin = target;
  const std::string p = "linattn::load_state: wrong kind: the file holds ";
  const std::string as_linear = ", not the states of a MultiHeadRecurrentLinearAttention (as a "
                                "LinearAttentionLayer::State is saved)";
  const auto cache = layer_of<SoftmaxAttentionLayer<double>>(263);
  std::istringstream a(saved(cache.make_state()), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, target); }),
            p + "the KV cache of a SoftmaxAttentionLayer::State" + as_linear);
  std::istringstream b(saved(RecurrentLinearAttention<SoftmaxSplit, double>(5, 3)),
                       std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, target); }),
            p + "the state of a RecurrentLinearAttention" + as_linear);
  std::istringstream c(saved(BatchedRecurrentLinearAttention<SoftmaxSplit, double>(1, 2, 5, 3)),
                       std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, target); }),
            p + "the states of a BatchedRecurrentLinearAttention" + as_linear);
  std::istringstream d(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(d); }),
            p + "the states of a MultiHeadRecurrentLinearAttention, not a LinearAttentionState");
  s.expect_unchanged(target, twin);

  const std::string m = "linattn::load_state: shape mismatch: the file holds 2 head(s) of D = 5, "
                        "F = 5, M = 3 with running maxima, this LinearAttentionLayer::State has ";
  const auto shape = [&](auto other) {
    auto state = other.make_state();
    const std::string before = saved(state);
    std::istringstream is(s.file, std::ios::binary);
    const std::string msg = runtime_error_of([&] { linattn::load_state(is, state); });
    EXPECT_EQ(saved(state), before);
    return msg;
  };
  using Soft = LinearAttentionLayer<SoftmaxSplit, double>;
  EXPECT_EQ(shape(Soft(7, 3, 5, 3)), m + "3 head(s) of D = 5, F = 5, M = 3 with running maxima");
  EXPECT_EQ(shape(Soft(7, 2, 4, 3)), m + "2 head(s) of D = 4, F = 4, M = 3 with running maxima");
  EXPECT_EQ(shape(Soft(7, 2, 5, 4)), m + "2 head(s) of D = 5, F = 5, M = 4 with running maxima");
  EXPECT_EQ(shape(LinearAttentionLayer<EluPlusOne, double>(7, 2, 5, 3)),
            m + "2 head(s) of D = 5, F = 5, M = 3 without running maxima");
  auto single = LinearAttentionLayer<SoftmaxSplit, float>(7, 2, 5, 3).make_state();
  std::istringstream e(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(e, single); }),
            "linattn::load_state: wrong scalar type: the file holds double, not float");
  EXPECT_EQ(single.position(), 0);
}

// The heads of a State share one position: a file whose heads disagree is refused (naming the
// head), and so is saving a State whose heads were set to different positions.
TEST(StateIoLayerFailure, LinearHeadsAtDifferentPositionsAreRejected) {
  const SavedLinearLayer s;
  auto target = s.bystander();
  const auto twin = target;
  std::string f = s.file;
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&f[68 + s.record]),
                              std::uint64_t(21));
  reseal(f);
  std::istringstream a(f, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, target); }),
            "linattn::load_state: invalid record: head 1: position 21, but head 0 has 20 (the "
            "heads of a LinearAttentionLayer::State share one position)");
  s.expect_unchanged(target, twin);
  // The same file is a valid MultiHeadRecurrentLinearAttention (whose heads may differ).
  MultiHeadRecurrentLinearAttention<SoftmaxSplit, double> heads(2, 5, 3);
  std::istringstream b(f, std::ios::binary);
  linattn::load_state(b, heads);
  EXPECT_EQ(heads.head(1).position(), 21);

  auto state = s.layer.make_state();
  state.heads().head(1).set_state(state.heads().head(1).state(), 4);
  std::ostringstream os(std::ios::binary);
  try {
    linattn::save_state(os, state);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "linattn::save_state: the heads' positions differ: head 0 is at 0, head 1 at 4 "
              "(the heads of a LinearAttentionLayer::State share one position)");
  }
  EXPECT_TRUE(os.str().empty());
}

TEST(StateIoLayerFailure, LinearTruncationsAndFlippedBytesThrow) {
  const SavedLinearLayer s;
  auto target = s.bystander();
  const auto twin = target;
  ASSERT_EQ(s.file.size(), 72 + 2 * s.record);
  for (std::size_t len = 0; len < s.file.size(); ++len) {
    SCOPED_TRACE("first " + std::to_string(len) + " bytes");
    const std::string cut = s.file.substr(0, len);
    std::istringstream seekable(cut, std::ios::binary);
    const std::string m1 = runtime_error_of([&] { linattn::load_state(seekable, target); });
    ASSERT_TRUE(starts_with(m1, "linattn::load_state: truncated file: expected ")) << m1;
    OneWayBuf buf(cut);
    std::istream pipe(&buf);
    ASSERT_EQ(runtime_error_of([&] { linattn::load_state(pipe, target); }), m1);
  }
  const auto message = [&](std::size_t len) {
    std::istringstream is(s.file.substr(0, len), std::ios::binary);
    return runtime_error_of([&] { linattn::load_state(is, target); });
  };
  const std::string p = "linattn::load_state: truncated file: expected ";
  EXPECT_EQ(message(30), p + "56 bytes of header, got 18");
  EXPECT_EQ(message(68), p + "8 bytes of position (head 0), got 0");
  EXPECT_EQ(message(68 + s.record + 16 + 10), p + "120 bytes of S (head 1), got 10");
  EXPECT_EQ(message(s.file.size() - 1), p + "4 bytes of checksum, got 3");
  for (std::size_t at = 0; at < s.file.size(); ++at) {
    std::string f = s.file;
    f[at] = char(f[at] ^ (1 << (at % 8)));
    std::istringstream is(f, std::ios::binary);
    const std::string m = runtime_error_of([&] { linattn::load_state(is, target); });
    const char* expected = at < 8    ? "linattn::load_state: wrong magic number"
                           : at < 12 ? "linattn::load_state: unsupported format version"
                           : at < 68 ? "linattn::load_state: corrupted header: checksum mismatch"
                                     : "linattn::load_state: corrupted data: checksum mismatch";
    ASSERT_TRUE(starts_with(m, expected)) << "byte " << at << ": " << m;
  }
  s.expect_unchanged(target, twin);
}

// Failures of the softmax layer's State: a cache of T = 12 tokens (double, H = 2, D = 5,
// M = 3: rows of 80 key bytes and 48 value bytes), its file, and a State with another cache
// and its twin.
struct SavedCache {
  using Layer = SoftmaxAttentionLayer<double>;
  Layer layer = layer_of<Layer>(271);
  Mat<double> X = test::random_matrix<double>(100, 7, 272, -2, 2);
  std::string file;
  SavedCache() {
    auto state = layer.make_state();
    decode(layer, state, X, 0, 6, 12);
    file = saved(state);
  }
  Layer::State bystander() const {
    auto state = layer.make_state(40);
    decode(layer, state, X, 50, 3, 59);
    return state;
  }
  void expect_unchanged(Layer::State& target, Layer::State twin) const {
    EXPECT_EQ(target.position(), twin.position());
    EXPECT_EQ(target.capacity(), twin.capacity());
    EXPECT_EQ(saved(target), saved(twin));
    EXPECT_TRUE(same_bits(decode(layer, target, X, 59, 0, 100), decode(layer, twin, X, 59, 0, 100)));
  }
};

TEST(StateIoLayerFailure, CacheWrongKindAndShapeAreRejected) {
  const SavedCache s;
  auto target = s.bystander();
  const auto twin = target;
  const std::string p = "linattn::load_state: wrong kind: the file holds ";
  const auto linear = layer_of<LinearAttentionLayer<EluPlusOne, double>>(273);
  std::istringstream a(saved(linear.make_state()), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, target); }),
            p + "the states of a MultiHeadRecurrentLinearAttention, not the KV cache of a "
                "SoftmaxAttentionLayer::State");
  std::istringstream b(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(b); }),
            p + "the KV cache of a SoftmaxAttentionLayer::State, not a LinearAttentionState");
  MultiHeadRecurrentLinearAttention<EluPlusOne, double> heads(2, 5, 3);
  std::istringstream c(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, heads); }),
            p + "the KV cache of a SoftmaxAttentionLayer::State, not the states of a "
                "MultiHeadRecurrentLinearAttention");
  s.expect_unchanged(target, twin);

  const std::string m = "linattn::load_state: shape mismatch: the file holds a KV cache of 2 "
                        "head(s) of D = 5, M = 3, this SoftmaxAttentionLayer::State has ";
  const auto shape = [&](const SoftmaxAttentionLayer<double>& other) {
    auto state = other.make_state(4);
    const std::string before = saved(state);
    std::istringstream is(s.file, std::ios::binary);
    const std::string msg = runtime_error_of([&] { linattn::load_state(is, state); });
    EXPECT_EQ(saved(state), before);
    EXPECT_EQ(state.capacity(), 4);
    return msg;
  };
  EXPECT_EQ(shape(SoftmaxAttentionLayer<double>(7, 2, 4, 3)), m + "2 head(s) of D = 4, M = 3");
  EXPECT_EQ(shape(SoftmaxAttentionLayer<double>(7, 2, 5, 4)), m + "2 head(s) of D = 5, M = 4");
  // The same H·D and H·M columns in one head: the head count is part of the shape.
  EXPECT_EQ(shape(SoftmaxAttentionLayer<double>(7, 1, 10, 6)), m + "1 head(s) of D = 10, M = 6");
  // d_model is not: a layer of another d_model with the same heads takes the cache.
  auto wider = SoftmaxAttentionLayer<double>(9, 2, 5, 3).make_state();
  std::istringstream d(s.file, std::ios::binary);
  linattn::load_state(d, wider);
  EXPECT_EQ(wider.position(), 12);
  auto single = SoftmaxAttentionLayer<float>(7, 2, 5, 3).make_state();
  std::istringstream e(s.file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(e, single); }),
            "linattn::load_state: wrong scalar type: the file holds double, not float");
}

TEST(StateIoLayerFailure, CacheTruncationsAndFlippedBytesThrow) {
  const SavedCache s;
  auto target = s.bystander();
  const auto twin = target;
  ASSERT_EQ(s.file.size(), 80 + 12 * (80 + 48u));
  for (std::size_t len = 0; len < s.file.size(); ++len) {
    SCOPED_TRACE("first " + std::to_string(len) + " bytes");
    const std::string cut = s.file.substr(0, len);
    std::istringstream seekable(cut, std::ios::binary);
    const std::string m1 = runtime_error_of([&] { linattn::load_state(seekable, target); });
    ASSERT_TRUE(starts_with(m1, "linattn::load_state: truncated file: expected ")) << m1;
    OneWayBuf buf(cut);
    std::istream pipe(&buf);
    ASSERT_EQ(runtime_error_of([&] { linattn::load_state(pipe, target); }), m1);
  }
  const auto message = [&](std::size_t len) {
    std::istringstream is(s.file.substr(0, len), std::ios::binary);
    return runtime_error_of([&] { linattn::load_state(is, target); });
  };
  const std::string p = "linattn::load_state: truncated file: expected ";
  EXPECT_EQ(message(68), p + "8 bytes of cached token count T, got 0");
  EXPECT_EQ(message(71), p + "8 bytes of cached token count T, got 3");
  EXPECT_EQ(message(76 + 100), p + "960 bytes of keys, got 100");
  EXPECT_EQ(message(76 + 960 + 5), p + "576 bytes of values, got 5");
  EXPECT_EQ(message(s.file.size() - 1), p + "4 bytes of checksum, got 3");
  for (std::size_t at = 0; at < s.file.size(); ++at) {
    std::string f = s.file;
    f[at] = char(f[at] ^ (1 << (at % 8)));
    std::istringstream is(f, std::ios::binary);
    const std::string m = runtime_error_of([&] { linattn::load_state(is, target); });
    if (at >= 76 || at < 68)
      ASSERT_TRUE(starts_with(m, at < 8    ? "linattn::load_state: wrong magic number"
                                 : at < 12 ? "linattn::load_state: unsupported format version"
                                 : at < 68 ? "linattn::load_state: corrupted header: checksum "
                                             "mismatch"
                                           : "linattn::load_state: corrupted data: checksum "
                                             "mismatch"))
          << "byte " << at << ": " << m;
    else  // T: a wrong length (truncated, or the checksum over the wrong bytes) or absurd
      ASSERT_TRUE(starts_with(m, "linattn::load_state: ")) << "byte " << at << ": " << m;
  }
  s.expect_unchanged(target, twin);
}

// The header of a KV cache has no feature map, maxima or log-decay; kind 6 does not exist in
// format version 1; T and the rows are checked against the sanity bounds before anything is
// allocated.
TEST(StateIoLayerFailure, CacheHeaderAndAbsurdSizesAreChecked) {
  const SavedCache s;
  auto target = s.bystander();
  const auto twin = target;
  const auto load = [&](const std::string& bytes) {
    std::istringstream is(bytes, std::ios::binary);
    return runtime_error_of([&] { linattn::load_state(is, target); });
  };
  const auto with_t = [](std::string f, std::uint64_t T) {
    unsigned char b[8];
    linattn::detail::io::put_le(b, T);
    return f.append(reinterpret_cast<const char*>(b), 8);
  };
  const std::string p = "linattn::load_state: ";
  EXPECT_EQ(load(header(2, 2, 6, 0, 2, 5, 1, 3)),
            p + "invalid feature dimension 1: a KV cache has no feature map (F must be 0)");
  EXPECT_EQ(load(header(2, 2, 6, 1, 2, 5, 0, 3)),
            p + "invalid flags 1: a KV cache has no running maxima");
  EXPECT_EQ(load(header(2, 2, 6, 0, 2, 5, 0, 3, 1)),
            p + "invalid log-decay size 1: a KV cache has no log-decay (L must be 0)");
  EXPECT_EQ(load(header(1, 2, 6, 0, 2, 5, 0, 3)), p + "unknown kind code 6");
  EXPECT_EQ(load(header(2, 2, 6, 0, 0, 5, 0, 3)), p + "invalid head count 0");
  EXPECT_EQ(load(header(2, 2, 6, 0, 2, 0, 0, 3)), p + "invalid key dimension 0");
  EXPECT_EQ(load(header(2, 2, 6, 0, 1u << 16, 1u << 24, 0, 1u << 24)),
            p + "absurd shape: one cached token of 65536 head(s) of D = 16777216, M = 16777216 "
                "is more than the 64 GiB this loader accepts");
  const std::string h = header(2, 2, 6, 0, 2, 5, 0, 3);
  EXPECT_EQ(load(with_t(h, std::uint64_t(1) << 40)),
            p + "absurd shape: T = 1099511627776 cached tokens of 2 head(s) of D = 5, M = 3 "
                "(more than the 64 GiB this loader accepts)");
  EXPECT_EQ(load(with_t(h, ~std::uint64_t(0))),
            p + "absurd shape: T = 18446744073709551615 cached tokens of 2 head(s) of D = 5, "
                "M = 3 (more than the 64 GiB this loader accepts)");
  // 2^28 tokens of 128 bytes (32 GiB) declared, 100 bytes there: refused before the rows are
  // allocated, whether or not the stream can tell its length.
  const std::string many = with_t(h, std::uint64_t(1) << 28) + std::string(100, '\0');
  const std::string short_of_many = p + "truncated file: expected 21474836480 bytes of keys, got 100";
  EXPECT_EQ(load(many), short_of_many);
  OneWayBuf buf(many);
  std::istream pipe(&buf);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(pipe, target); }), short_of_many);
  s.expect_unchanged(target, twin);
}


// ------------------------------------------------------------------------------------------
// The delta-rule decoder (RecurrentDeltaRule, kind 7: compact)
// ------------------------------------------------------------------------------------------

using linattn::RecurrentDeltaRule;

// Runs a delta-rule decoder over rows [from, to) (beta in [0, 2], log_a in [-0.5, 0] from the
// columns of P) and returns their outputs.
template <class R, class S>
Mat<S> run_delta(R& rnn, const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V, const Mat<S>& P,
                 Index from, Index to) {
  Mat<S> out(to - from, V.cols());
  Eigen::Matrix<S, Eigen::Dynamic, 1> o(V.cols());
  for (Index t = from; t < to; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), P(t, 0), P(t, 1), o);
    out.row(t - from) = o.transpose();
  }
  return out;
}

template <class S>
struct DeltaInputs {
  Mat<S> Q, K, V, P;
  DeltaInputs(Index N, Index D, Index M, std::uint32_t seed)
      : Q(test::random_matrix<S>(N, D, seed, -2, 2)),
        K(test::random_matrix<S>(N, D, seed + 1, -2, 2)),
        V(test::random_matrix<S>(N, M, seed + 2)),
        P(N, 2) {
    P.col(0) = test::random_matrix<S>(N, 1, seed + 3, 0, 2);
    P.col(1) = test::random_matrix<S>(N, 1, seed + 4, -0.5, 0);
  }
};

// The uninterrupted decode against decodes saved after k tokens (the last step's update still
// pending in the object), loaded into a fresh object and continued: the same bits; the file is
// the state and 80 bytes, and saving changes nothing in the saved object.
template <class S, class Phi>
void check_delta_resume(Index D, Index M, std::uint32_t seed) {
  constexpr Index N = 90;
  const DeltaInputs<S> in(N, D, M, seed);
  const Index F = Phi{}.feature_dim(D);
  RecurrentDeltaRule<Phi, S> whole(D, M);
  const Mat<S> expected = run_delta(whole, in.Q, in.K, in.V, in.P, 0, N);
  for (const Index k : {Index(0), Index(1), Index(40), N - 1}) {
    SCOPED_TRACE("saved after " + std::to_string(k) + " tokens");
    RecurrentDeltaRule<Phi, S> first(D, M), twin(D, M);
    run_delta(first, in.Q, in.K, in.V, in.P, 0, k);
    run_delta(twin, in.Q, in.K, in.V, in.P, 0, k);
    std::stringstream file(std::ios::in | std::ios::out | std::ios::binary);
    linattn::save_state(file, first);
    EXPECT_EQ(file.str().size(), std::size_t(80) + sizeof(S) * std::size_t(F * M));
    RecurrentDeltaRule<Phi, S> resumed(D, M);
    run_delta(resumed, in.Q, in.K, in.V, in.P, 0, 7);  // a history that the load replaces
    linattn::load_state(file, resumed);
    EXPECT_EQ(file.peek(), std::char_traits<char>::eof());  // exactly one record consumed
    EXPECT_EQ(resumed.position(), k);
    EXPECT_TRUE(same_state(resumed.state(), first.state()));
    EXPECT_TRUE(same_bits(run_delta(resumed, in.Q, in.K, in.V, in.P, k, N),
                          expected.bottomRows(N - k)));
    EXPECT_TRUE(same_bits(run_delta(first, in.Q, in.K, in.V, in.P, k, N),
                          run_delta(twin, in.Q, in.K, in.V, in.P, k, N)))
        << "saving changed the saved decoder";
    EXPECT_TRUE(same_state(resumed.state(), whole.state()));
  }
}

template <class S>
class StateIoDeltaResume : public ::testing::Test {};
TYPED_TEST_SUITE(StateIoDeltaResume, StateIoScalars, );

TYPED_TEST(StateIoDeltaResume, IsBitIdentical) {
  using S = TypeParam;
  check_delta_resume<S, Identity>(6, 5, 131);
  check_delta_resume<S, linattn::L2Normalize<Silu>>(5, 19, 132);  // M: a vector block and a tail
}

// The documented layout (kind 7): the header, the position, S row-major (the last update
// applied), the CRC. One float head of F = M = 128 is its 64 KiB of state and 80 bytes, where
// saving state() as a LinearAttentionState took 2·F·M + 2·F scalars.
TEST(StateIoDeltaResume, LayoutIsAsDocumentedAndCompact) {
  RecurrentDeltaRule<Identity, float> rnn(3, 2);
  const DeltaInputs<float> in(4, 3, 2, 133);
  run_delta(rnn, in.Q, in.K, in.V, in.P, 0, 4);
  const std::string f = saved(rnn);
  ASSERT_EQ(f.size(), std::size_t(80 + 4 * 6));
  const auto* b = reinterpret_cast<const unsigned char*>(f.data());
  using linattn::detail::io::get_le;
  EXPECT_EQ(get_le<std::uint32_t>(b + 16), 7u);  // kind: RecurrentDeltaRule
  EXPECT_EQ(get_le<std::uint32_t>(b + 20), 0u);  // no maxima
  EXPECT_EQ(get_le<std::uint64_t>(b + 24), 1u);  // heads
  EXPECT_EQ(get_le<std::uint64_t>(b + 32), 3u);  // D
  EXPECT_EQ(get_le<std::uint64_t>(b + 40), 3u);  // F
  EXPECT_EQ(get_le<std::uint64_t>(b + 48), 2u);  // M
  EXPECT_EQ(get_le<std::uint64_t>(b + 56), 0u);  // L
  EXPECT_EQ(get_le<std::uint64_t>(b + 68), 4u);  // position
  const auto st = rnn.state();
  for (Index i = 0; i < 6; ++i) {
    const std::uint32_t bits = get_le<std::uint32_t>(b + 76 + 4 * std::size_t(i));
    float x;
    std::memcpy(&x, &bits, sizeof bits);
    EXPECT_TRUE(same_bits(Eigen::VectorXf::Constant(1, x),
                          Eigen::VectorXf::Constant(1, st.S(i / 2, i % 2))))
        << i;
  }
  EXPECT_EQ(get_le<std::uint32_t>(b + 100), linattn::checksum(f.data(), 100));
  RecurrentDeltaRule<linattn::L2Normalize<Silu>, float> big(128, 128);
  const DeltaInputs<float> bi(3, 128, 128, 134);
  run_delta(big, bi.Q, bi.K, bi.V, bi.P, 0, 3);
  EXPECT_EQ(saved(big).size(), std::size_t(65536 + 80));
  EXPECT_EQ(saved(big.state()).size(), std::size_t(72 + 16 + 4 * (2 * 128 * 128 + 2 * 128)));
}

TEST(StateIoDeltaFailure, WrongKindShapeAndDecaySizeAreRejected) {
  RecurrentDeltaRule<Identity, double> source(3, 2);
  const DeltaInputs<double> in(10, 3, 2, 135);
  run_delta(source, in.Q, in.K, in.V, in.P, 0, 10);
  const std::string file = saved(source);
  RecurrentDeltaRule<Identity, double> target(3, 2), wider(3, 4);
  run_delta(target, in.Q, in.K, in.V, in.P, 0, 5);
  const std::string before = saved(target);
  const std::string p = "linattn::load_state: ";
  const auto load = [](const std::string& bytes, auto& object) {
    std::istringstream is(bytes, std::ios::binary);
    return runtime_error_of([&] { linattn::load_state(is, object); });
  };
  RecurrentGatedAttention<Identity, double> gated(3, 2);
  RecurrentLinearAttention<Identity, double> plain(3, 2);
  EXPECT_EQ(load(file, gated), p + "wrong kind: the file holds the state of a RecurrentDeltaRule, "
                                   "not the state of a RecurrentGatedAttention");
  EXPECT_EQ(load(file, plain), p + "wrong kind: the file holds the state of a RecurrentDeltaRule, "
                                   "not the state of a RecurrentLinearAttention");
  EXPECT_EQ(load(saved(gated), target), p + "wrong kind: the file holds the state of a "
                                            "RecurrentGatedAttention, not the state of a "
                                            "RecurrentDeltaRule");
  EXPECT_EQ(load(saved(source.state()), target),
            p + "wrong kind: the file holds a LinearAttentionState, not the state of a "
                "RecurrentDeltaRule");
  std::istringstream st(file, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state<double>(st); }),
            p + "wrong kind: the file holds the state of a RecurrentDeltaRule, not a "
                "LinearAttentionState");
  EXPECT_EQ(load(file, wider), p + "shape mismatch: the file holds 1 head(s) of D = 3, F = 3, "
                                   "M = 2 without running maxima, this RecurrentDeltaRule has 1 "
                                   "head(s) of D = 3, F = 3, M = 4 without running maxima");
  std::string decayed = file;  // L = 1: not a delta-rule record
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&decayed[56]), std::uint64_t(1));
  reseal_header(decayed);
  EXPECT_EQ(load(decayed, target), p + "invalid log-decay size 1: a RecurrentDeltaRule keeps no "
                                       "log-decay (L must be 0)");
  std::string negative = file;
  linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&negative[68]),
                              linattn::detail::io::from_signed(-5));
  reseal(negative);
  EXPECT_EQ(load(negative, target), p + "invalid record: position -5 (a decoding position counts "
                                        "tokens and is never negative)");
  EXPECT_EQ(saved(target), before);
  EXPECT_EQ(target.position(), 5);
}

TEST(StateIoDeltaFailure, EveryTruncationAndBitFlipThrows) {
  RecurrentDeltaRule<Identity, double> source(3, 2), target(3, 2);
  const DeltaInputs<double> in(10, 3, 2, 136);
  run_delta(source, in.Q, in.K, in.V, in.P, 0, 10);
  run_delta(target, in.Q, in.K, in.V, in.P, 0, 4);
  const std::string file = saved(source), before = saved(target);
  for (std::size_t len = 0; len < file.size(); ++len) {
    SCOPED_TRACE("first " + std::to_string(len) + " bytes");
    const std::string cut = file.substr(0, len);
    std::istringstream seekable(cut, std::ios::binary);
    const std::string m1 = runtime_error_of([&] { linattn::load_state(seekable, target); });
    EXPECT_TRUE(starts_with(m1, "linattn::load_state: truncated file: expected ")) << m1;
    OneWayBuf buf(cut);
    std::istream pipe(&buf);
    EXPECT_EQ(runtime_error_of([&] { linattn::load_state(pipe, target); }), m1);
  }
  std::istringstream cut(file.substr(0, 68 + 8 + 20), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(cut, target); }),
            "linattn::load_state: truncated file: expected 48 bytes of S, got 20");
  for (std::size_t bit = 0; bit < file.size() * 8; bit += 3) {
    std::string f = file;
    f[bit / 8] = char(f[bit / 8] ^ (1 << (bit % 8)));
    std::istringstream is(f, std::ios::binary);
    const std::string m = runtime_error_of([&] { linattn::load_state(is, target); });
    ASSERT_TRUE(starts_with(m, "linattn::load_state: ")) << "bit " << bit << ": " << m;
  }
  EXPECT_EQ(saved(target), before);
  EXPECT_EQ(target.position(), 4);
}

// ------------------------------------------------------------------------------------------
// Impossible values: a negative position, a log-decay that no gates give
// ------------------------------------------------------------------------------------------

// Files with right checksums but impossible values are refused ("invalid record"), whatever
// the kind; set_state() refuses the same with std::invalid_argument, and save_state() refuses
// to write a log-decay that would not load. NaN and inf in S and z are a poisoned but
// representable state (a NaN token reaches it): they save and load as they are.
TEST(StateIoFailure, ImpossiblePositionsAndLogDecaysAreRejected) {
  const std::string p = "linattn::load_state: invalid record: ";
  const std::string negative = "position -5 (a decoding position counts tokens and is never "
                               "negative)";
  const auto with_position = [](std::string f, std::size_t at, std::int64_t position) {
    linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&f[at]),
                                linattn::detail::io::from_signed(position));
    reseal(f);
    return f;
  };
  // Kind 2.
  const Saved s;
  auto target = bystander();
  const std::string before = saved(target);
  std::istringstream a(with_position(s.file, 68, -5), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(a, target); }), p + negative);
  std::istringstream a2(with_position(s.file, 68, std::numeric_limits<std::int64_t>::min()),
                        std::ios::binary);
  EXPECT_TRUE(starts_with(runtime_error_of([&] { linattn::load_state(a2, target); }),
                          p + "position -9223372036854775808"));
  EXPECT_EQ(saved(target), before);
  // Kind 3: head 1 of 2.
  MultiHeadRecurrentLinearAttention<EluPlusOne, float> heads(2, 2, 2);
  const std::string mh = saved(heads);
  const std::size_t record = 16 + 4 * (2 * 4 + 2 * 2);
  std::istringstream b(with_position(mh, 68 + record, -5), std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(b, heads); }), p + "head 1: " + negative);
  // Kind 5: every head of sequence 0 (head 0 is checked first).
  BatchedRecurrentLinearAttention<EluPlusOne, float> dec(2, 2, 2, 2);
  std::string bf = saved(dec);
  for (std::size_t h = 0; h < 2; ++h)
    linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&bf[76 + h * record]),
                                linattn::detail::io::from_signed(-5));
  reseal(bf);
  std::istringstream c(bf, std::ios::binary);
  EXPECT_EQ(runtime_error_of([&] { linattn::load_state(c, dec); }),
            p + "sequence 0, head 0: " + negative);

  // Log-decays: NaN, +inf and positive values (the smallest one too) are no total of gates
  // <= 0; 0, -0 and -inf are.
  const double inf = std::numeric_limits<double>::infinity();
  LinearAttentionState<double> st = decayed_state<double>(3, 2, 3, 137);
  const std::string good = saved(st);
  const std::size_t ld = good.size() - 4 - 3 * 8;  // the log-decay's entries
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), inf, 0.5,
                           std::numeric_limits<double>::denorm_min()}) {
    std::string f = good;
    std::uint64_t bits;
    std::memcpy(&bits, &bad, sizeof bits);
    linattn::detail::io::put_le(reinterpret_cast<unsigned char*>(&f[ld + 16]), bits);
    reseal(f);
    std::istringstream is(f, std::ios::binary);
    const std::string m = runtime_error_of([&] { linattn::load_state<double>(is); });
    EXPECT_TRUE(starts_with(m, p + "log_decay(2) = ")) << m;
    EXPECT_NE(m.find(": a total log-decay is a sum of log gates <= 0 (NaN, +inf and positive "
                     "values are impossible)"),
              std::string::npos)
        << m;
    // save_state and set_state refuse the same state.
    LinearAttentionState<double> bad_state = st;
    bad_state.log_decay(2) = bad;
    std::ostringstream os;
    test::expect_invalid([&] { linattn::save_state(os, bad_state); },
                         "linattn::save_state: the state's log_decay(2) = ", "save_state");
    EXPECT_TRUE(os.str().empty());
    RecurrentGatedAttention<Identity, double> gated(3, 2);
    test::expect_invalid([&] { gated.set_state(bad_state); },
                         "RecurrentGatedAttention::set_state: the state's log_decay(2) = ",
                         "gated set_state");
  }
  for (const double fine : {0.0, -0.0, -inf}) {
    LinearAttentionState<double> ok = st;
    ok.log_decay(2) = fine;
    std::istringstream is(saved(ok), std::ios::binary);
    EXPECT_TRUE(same_bits(linattn::load_state<double>(is).log_decay, ok.log_decay));
  }
  // Non-finite S and z are kept as they are.
  LinearAttentionState<double> poisoned = st;
  poisoned.S(1, 1) = std::numeric_limits<double>::quiet_NaN();
  poisoned.z(0) = inf;
  std::istringstream is(saved(poisoned), std::ios::binary);
  EXPECT_TRUE(same_state(linattn::load_state<double>(is), poisoned));

  // set_state with a negative position, in every decoder that takes one.
  RecurrentLinearAttention<EluPlusOne, float> rnn(2, 2);
  test::expect_invalid([&] { rnn.set_state(rnn.state(), -3); },
                       "RecurrentLinearAttention::set_state: position = -3", "recurrent");
  test::expect_invalid([&] { dec.set_state(1, 0, dec.state(1, 0), -3); },
                       "BatchedRecurrentLinearAttention::set_state: position = -3", "batched");
  test::expect_invalid([&] { dec.set_states(dec.states(), -1); },
                       "BatchedRecurrentLinearAttention::set_states: position = -1", "batched");
  RecurrentGatedAttention<Identity, float> gated(2, 2);
  test::expect_invalid([&] { gated.set_state(gated.state(), -3); },
                       "RecurrentGatedAttention::set_state: position = -3", "gated");
  EXPECT_EQ(rnn.position(), 0);
  EXPECT_EQ(dec.position(1), 0);
}

// ------------------------------------------------------------------------------------------
// The public checksum
// ------------------------------------------------------------------------------------------

TEST(StateIoFormat, PublicChecksumIsTheFilesCrc) {
  EXPECT_EQ(linattn::checksum("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(linattn::checksum("", 0), 0u);
  EXPECT_EQ(linattn::checksum("6789", 4, linattn::checksum("12345", 5)), 0xCBF43926u);
  const Saved s;
  const auto* b = reinterpret_cast<const unsigned char*>(s.file.data());
  EXPECT_EQ(linattn::checksum(b, 64), linattn::detail::io::get_le<std::uint32_t>(b + 64));
  EXPECT_EQ(linattn::checksum(b, s.file.size() - 4),
            linattn::detail::io::get_le<std::uint32_t>(b + s.file.size() - 4));
  // Over a matrix: the scalars' little-endian IEEE bits in storage order (as a file stores S),
  // whatever the expression; a row-major matrix in row order.
  const Mat<double> X = test::random_matrix<double>(5, 3, 138);
  std::string bytes;
  for (Index c = 0; c < X.cols(); ++c)
    for (Index r = 0; r < X.rows(); ++r) {
      unsigned char le[8];
      std::uint64_t bits;
      std::memcpy(&bits, &X(r, c), 8);
      linattn::detail::io::put_le(le, bits);
      bytes.append(reinterpret_cast<const char*>(le), 8);
    }
  EXPECT_EQ(linattn::checksum(X), linattn::checksum(bytes.data(), bytes.size()));
  EXPECT_EQ(linattn::checksum(X.leftCols(2)), linattn::checksum(bytes.data(), 80));
  EXPECT_EQ(linattn::checksum(X.col(2), linattn::checksum(X.leftCols(2))), linattn::checksum(X));
  const LinearAttentionState<double>::StateMatrix R = X;  // row-major
  EXPECT_EQ(linattn::checksum(R), linattn::checksum(Mat<double>(X.transpose())));
  EXPECT_NE(linattn::checksum(R), linattn::checksum(X));
  const Eigen::VectorXf big = Eigen::VectorXf::LinSpaced(1000, -1, 1);  // several buffers
  EXPECT_EQ(linattn::checksum(big), linattn::checksum(big.data(), 4000));  // a little-endian host
}

}  // namespace
