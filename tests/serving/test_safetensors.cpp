// safetensors files (serving/safetensors.hpp, spec §8 "Weights files"): files built byte by byte
// here, independent of the writer, read back with their names, dtypes, shapes, values (F32,
// F64, BF16, F16, a 0-d and an empty tensor) and metadata; writer to reader round trips keep
// every bit (float, double, bf16, half, NaN and infinities included) in memory and through a
// file, with the writer's layout (sorted names, padding, alignment) checked; every rule of the
// format that a file can break is a std::runtime_error naming the problem, and every request
// the file cannot satisfy a std::invalid_argument naming the tensor and the shapes or dtype.
#include <linattn/serving.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using linattn::Index;
using linattn::SafetensorsFile;
using linattn::SafetensorsWriter;
using linattn::TensorDtype;

// ---- bytes by hand ------------------------------------------------------------------------

std::string le(std::uint64_t v, int bytes) {
  std::string s;
  for (int i = 0; i < bytes; ++i) s += static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// A string literal's bytes, NULs included.
template <std::size_t N>
std::string lit(const char (&s)[N]) {
  return std::string(s, N - 1);
}

// A file of `json` (its size as the 8-byte prefix) and `data`.
std::string file_of(const std::string& json, const std::string& data = "") {
  return le(json.size(), 8) + json + data;
}

template <class T, class Bits>
Bits bits_of(T x) {
  static_assert(sizeof(T) == sizeof(Bits), "same size");
  Bits b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

template <class Scalar>
bool same_bits(Scalar a, Scalar b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// The what() of the exception of type E that f throws ("" and a failure otherwise).
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no exception";
  return "";
}

std::string load_error(const std::string& bytes) {
  return message_of<std::runtime_error>([&] { SafetensorsFile::from_bytes(bytes, "bad.st"); });
}

// A file's load fails with a std::runtime_error whose message has every needle.
void expect_corrupt(const std::string& bytes, std::initializer_list<const char*> needles) {
  const std::string m = load_error(bytes);
  EXPECT_NE(m.find("linattn::SafetensorsFile: bad.st: "), std::string::npos) << m;
  for (const char* n : needles)
    EXPECT_NE(m.find(n), std::string::npos) << "'" << n << "' in: " << m;
}

void expect_bad_json(const std::string& json, const char* needle) {
  SCOPED_TRACE(json);
  expect_corrupt(file_of(json), {"bad header", needle});
}

// ---- a file written by hand ---------------------------------------------------------------

// F32 [2, 3] = 1 -2 0.5 / 3 inf nan, F64 [] = -0.1, BF16 [3] = 1 -2 0.15625, F16 [2, 2] =
// 1 -2 65504 2^-24, F32 [0, 4], I64 [2] = 7 -1; in a data order unlike the names' order.
std::string handmade() {
  const std::string f32 =
      lit("\x00\x00\x80\x3f"
          "\x00\x00\x00\xc0"
          "\x00\x00\x00\x3f"
          "\x00\x00\x40\x40"
          "\x00\x00\x80\x7f"
          "\x00\x00\xc0\x7f");
  const std::string f64 = lit("\x9a\x99\x99\x99\x99\x99\xb9\xbf");
  const std::string bf16 =
      lit("\x80\x3f"
          "\x00\xc0"
          "\x20\x3e");
  const std::string f16 =
      lit("\x00\x3c"
          "\x00\xc0"
          "\xff\x7b"
          "\x01\x00");
  const std::string i64 = le(7, 8) + le(~std::uint64_t(0), 8);
  // data: i64 [0,16) f64 [16,24) f32 [24,48) f16 [48,56) bf16 [56,62); empty at 62
  const std::string json =
      "{\"w.f32\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [24, 48]},\n"
      " \"__metadata__\": {\"format\": \"pt\", \"note\": \"caf\\u00e9 \\\"q\\\"\"},\n"
      " \"s.f64\": {\"shape\": [], \"dtype\": \"F64\", \"data_offsets\": [16, 24]},\n"
      " \"b.bf16\": {\"dtype\": \"BF16\", \"shape\": [3], \"data_offsets\": [56, 62]},\n"
      " \"h.f16\": {\"dtype\": \"F16\", \"shape\": [2, 2], \"data_offsets\": [48, 56],"
      " \"extra\": {\"skipped\": [1, 2.5e-3, true, null, \"x\"]}},\n"
      " \"e.empty\": {\"dtype\": \"F32\", \"shape\": [0, 4], \"data_offsets\": [62, 62]},\n"
      " \"i.int\": {\"dtype\": \"I64\", \"shape\": [2], \"data_offsets\": [0, 16]}}    ";
  return file_of(json, i64 + f64 + f32 + f16 + bf16);
}

TEST(SafetensorsRead, HandmadeFileNamesShapesDtypesMetadata) {
  const auto f = SafetensorsFile::from_bytes(handmade());
  EXPECT_EQ(f.names(),
            (std::vector<std::string>{"b.bf16", "e.empty", "h.f16", "i.int", "s.f64", "w.f32"}));
  EXPECT_TRUE(f.contains("w.f32"));
  EXPECT_FALSE(f.contains("w"));
  EXPECT_FALSE(f.contains("__metadata__"));
  EXPECT_EQ(f.info("w.f32").dtype, TensorDtype::F32);
  EXPECT_EQ(f.info("w.f32").shape, (std::vector<Index>{2, 3}));
  EXPECT_EQ(f.info("w.f32").begin, 24u);
  EXPECT_EQ(f.info("w.f32").end, 48u);
  EXPECT_EQ(f.info("s.f64").shape, std::vector<Index>{});
  EXPECT_EQ(f.info("s.f64").size(), 1);
  EXPECT_EQ(f.info("e.empty").size(), 0);
  EXPECT_EQ(f.info("b.bf16").dtype, TensorDtype::BF16);
  EXPECT_EQ(f.info("h.f16").dtype, TensorDtype::F16);
  EXPECT_EQ(f.info("i.int").dtype, TensorDtype::I64);
  EXPECT_STREQ(linattn::dtype_name(TensorDtype::BF16), "BF16");
  EXPECT_STREQ(linattn::dtype_name(TensorDtype::F8_E4M3), "F8_E4M3");
  EXPECT_EQ(linattn::dtype_size(TensorDtype::F64), 8u);
  EXPECT_EQ(linattn::dtype_size(TensorDtype::BOOL), 1u);
  ASSERT_EQ(f.metadata().size(), 2u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "caf\xc3\xa9 \"q\"");
}

TEST(SafetensorsRead, HandmadeFileValues) {
  const auto f = SafetensorsFile::from_bytes(handmade());
  const Eigen::MatrixXf w = f.matrix<float>("w.f32", 2, 3);  // column-major, row-major data
  EXPECT_EQ(w(0, 0), 1.0f);
  EXPECT_EQ(w(0, 1), -2.0f);
  EXPECT_EQ(w(0, 2), 0.5f);
  EXPECT_EQ(w(1, 0), 3.0f);
  EXPECT_EQ(w(1, 1), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(w(1, 2)));
  const Eigen::MatrixXd wd = f.matrix<double>("w.f32", 2, 3);
  EXPECT_EQ(wd(0, 2), 0.5);

  double s = 0;
  f.read("s.f64", {}, &s);
  EXPECT_EQ(s, -0.1);
  float sf = 0;
  f.read("s.f64", {}, &sf);
  EXPECT_EQ(sf, -0.1f);  // rounded to nearest

  const Eigen::VectorXf b = f.vector<float>("b.bf16", 3);
  EXPECT_EQ(b(0), 1.0f);
  EXPECT_EQ(b(1), -2.0f);
  EXPECT_EQ(b(2), 0.15625f);
  const auto braw = f.vector<Eigen::bfloat16>("b.bf16", 3);
  EXPECT_EQ((bits_of<Eigen::bfloat16, std::uint16_t>(braw(2))), 0x3e20);

  const Eigen::MatrixXd h = f.matrix<double>("h.f16", 2, 2);
  EXPECT_EQ(h(0, 0), 1.0);
  EXPECT_EQ(h(0, 1), -2.0);
  EXPECT_EQ(h(1, 0), 65504.0);
  EXPECT_EQ(h(1, 1), std::ldexp(1.0, -24));  // the smallest subnormal half

  const Eigen::MatrixXf e = f.matrix<float>("e.empty", 0, 4);
  EXPECT_EQ(e.rows(), 0);
  EXPECT_EQ(e.cols(), 4);

  const std::string_view raw = f.raw("i.int");
  ASSERT_EQ(raw.size(), 16u);
  EXPECT_EQ(raw.substr(0, 8), le(7, 8));
  EXPECT_EQ(raw.substr(8), std::string(8, '\xff'));
}

TEST(SafetensorsRead, IntoStridedOutputsAndConvWeights) {
  // F32 [3, 1, 2] = 0..5, a torch Conv1d weight [C, 1, W].
  std::string data;
  for (int i = 0; i < 6; ++i) data += le(bits_of<float, std::uint32_t>(float(i)), 4);
  const auto f = SafetensorsFile::from_bytes(
      file_of("{\"conv\":{\"dtype\":\"F32\",\"shape\":[3,1,2],\"data_offsets\":[0,24]}}", data));
  Eigen::MatrixXf w(3, 2);
  f.read("conv", {3, 1, 2}, w);
  for (int c = 0; c < 3; ++c)
    for (int k = 0; k < 2; ++k) EXPECT_EQ(w(c, k), float(2 * c + k));
  Eigen::MatrixXd big = Eigen::MatrixXd::Constant(5, 6, -1);
  f.read("conv", {3, 1, 2}, big.block(1, 2, 2, 3));  // 2 x 3 of a larger matrix: row-major fill
  EXPECT_EQ(big(1, 2), 0.0);
  EXPECT_EQ(big(1, 4), 2.0);
  EXPECT_EQ(big(2, 2), 3.0);
  EXPECT_EQ(big(2, 4), 5.0);
  EXPECT_EQ(big(0, 2), -1.0);
  EXPECT_EQ(big(3, 2), -1.0);
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> flat(1, 6);
  f.read("conv", {3, 1, 2}, flat);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(flat(0, i), float(i));
  EXPECT_NE(message_of<std::invalid_argument>([&] {
              f.read("conv", {3, 2}, w);
            }).find("has shape [3, 1, 2], expected [3, 2]"),
            std::string::npos);
}

// ---- the writer ---------------------------------------------------------------------------

template <class Scalar>
Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> special_matrix(Index rows, Index cols,
                                                                     std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m(i) = Scalar(dist(gen));
  m(0) = Scalar(std::numeric_limits<float>::quiet_NaN());
  m(1) = Scalar(-std::numeric_limits<float>::infinity());
  m(2) = Scalar(-0.0f);
  m(3) = std::numeric_limits<Scalar>::denorm_min();
  return m;
}

template <class A, class B>
void expect_same_bits(const A& a, const B& b) {
  ASSERT_EQ(a.rows(), b.rows());
  ASSERT_EQ(a.cols(), b.cols());
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j)
      EXPECT_TRUE(same_bits(a(i, j), b(i, j))) << "at (" << i << ", " << j << ")";
}

SafetensorsWriter four_dtypes(Eigen::MatrixXf& f, Eigen::MatrixXd& d,
                              linattn::Matrix<Eigen::bfloat16>& b,
                              linattn::Matrix<Eigen::half>& h) {
  f = special_matrix<float>(5, 7, 1);
  d = special_matrix<double>(3, 4, 2);
  b = special_matrix<Eigen::bfloat16>(7, 3, 3);
  h = special_matrix<Eigen::half>(2, 9, 4);
  SafetensorsWriter w;
  w.add("model.f", f).add("model.d", d).add("model.b", b).add("model.h", h);
  const Eigen::VectorXf v = Eigen::VectorXf::LinSpaced(5, -1.0f, 1.0f);
  w.add("model.v", v);
  const double scalar = 2.5;
  w.add("model.scalar", {}, &scalar);
  w.add("model.empty", {0, 3}, static_cast<const float*>(nullptr));
  w.set_metadata("format", "pt").set_metadata("with \"quotes\"\n", "caf\xc3\xa9");
  return w;
}

void expect_round_trip(const SafetensorsFile& r) {
  Eigen::MatrixXf f;
  Eigen::MatrixXd d;
  linattn::Matrix<Eigen::bfloat16> b;
  linattn::Matrix<Eigen::half> h;
  four_dtypes(f, d, b, h);
  expect_same_bits(r.matrix<float>("model.f", 5, 7), f);
  expect_same_bits(r.matrix<double>("model.d", 3, 4), d);
  expect_same_bits(r.matrix<Eigen::bfloat16>("model.b", 7, 3), b);
  expect_same_bits(r.matrix<Eigen::half>("model.h", 2, 9), h);
  // bf16 and half widen exactly to float.
  expect_same_bits(r.matrix<float>("model.b", 7, 3), b.cast<float>().eval());
  expect_same_bits(r.matrix<float>("model.h", 2, 9), h.cast<float>().eval());
  EXPECT_EQ(r.info("model.f").dtype, TensorDtype::F32);
  EXPECT_EQ(r.info("model.d").dtype, TensorDtype::F64);
  EXPECT_EQ(r.info("model.b").dtype, TensorDtype::BF16);
  EXPECT_EQ(r.info("model.h").dtype, TensorDtype::F16);
  EXPECT_EQ(r.info("model.v").shape, std::vector<Index>{5});
  EXPECT_TRUE(r.vector<float>("model.v", 5) == Eigen::VectorXf::LinSpaced(5, -1.0f, 1.0f));
  Eigen::VectorXf v(5);
  r.read("model.v", v);
  EXPECT_EQ(v(4), 1.0f);
  double s = 0;
  r.read("model.scalar", {}, &s);
  EXPECT_EQ(s, 2.5);
  EXPECT_EQ(r.info("model.empty").shape, (std::vector<Index>{0, 3}));
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("with \"quotes\"\n"), "caf\xc3\xa9");
}

TEST(SafetensorsWrite, RoundTripInMemoryIsBitExact) {
  Eigen::MatrixXf f;
  Eigen::MatrixXd d;
  linattn::Matrix<Eigen::bfloat16> b;
  linattn::Matrix<Eigen::half> h;
  const std::string bytes = four_dtypes(f, d, b, h).bytes();
  expect_round_trip(SafetensorsFile::from_bytes(bytes));
}

TEST(SafetensorsWrite, RoundTripThroughAFile) {
  Eigen::MatrixXf f;
  Eigen::MatrixXd d;
  linattn::Matrix<Eigen::bfloat16> b;
  linattn::Matrix<Eigen::half> h;
  const std::string path = ::testing::TempDir() + "linattn_test_safetensors.safetensors";
  four_dtypes(f, d, b, h).write(path);
  {
    const SafetensorsFile r(path);
    EXPECT_EQ(r.source(), path);
    expect_round_trip(r);
  }
  std::remove(path.c_str());
  const std::string m = message_of<std::runtime_error>([&] { SafetensorsFile r(path); });
  EXPECT_NE(m.find(path), std::string::npos) << m;
  EXPECT_NE(m.find("cannot be opened"), std::string::npos) << m;
  const std::string w = message_of<std::runtime_error>(
      [&] { SafetensorsWriter().write(::testing::TempDir() + "no/such/dir/x.safetensors"); });
  EXPECT_NE(w.find("SafetensorsWriter::write"), std::string::npos) << w;
}

TEST(SafetensorsWrite, ExactBytesSortedPaddedAligned) {
  const float one = 1.0f;
  const double two = 2.0;
  const std::string bytes = SafetensorsWriter()
                                .add("b", {1}, &one)
                                .add("a", {}, &two)
                                .add("c", {1}, &one)
                                .set_metadata("format", "pt")
                                .bytes();
  // The header sorted by name after the metadata; the F64 tensor first in the data.
  std::string json =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"a\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
      "\"c\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}";
  json.append((8 - json.size() % 8) % 8, ' ');
  const std::string expected =
      file_of(json, le(0x4000000000000000ull, 8) + le(0x3f800000, 4) + le(0x3f800000, 4));
  EXPECT_EQ(bytes, expected);
  EXPECT_EQ((bytes.size() - 16) % 8, 0u);

  // Mixed element sizes: each tensor starts at a multiple of its element size in the file.
  Eigen::MatrixXf f;
  Eigen::MatrixXd d;
  linattn::Matrix<Eigen::bfloat16> b;
  linattn::Matrix<Eigen::half> h;
  const std::string mixed = four_dtypes(f, d, b, h).bytes();
  const auto r = SafetensorsFile::from_bytes(mixed);
  std::uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = header << 8 | static_cast<unsigned char>(mixed[i]);
  const std::uint64_t start = 8 + header;
  EXPECT_EQ(start % 8, 0u);
  for (const auto& t : r.tensors())
    EXPECT_EQ((start + t.begin) % linattn::dtype_size(t.dtype), 0u) << t.name;
}

TEST(SafetensorsWrite, BadArguments) {
  const float x[2] = {1, 2};
  SafetensorsWriter w;
  w.add("a", {2}, x);
  EXPECT_NE(message_of<std::invalid_argument>([&] { w.add("a", {2}, x); }).find("already added"),
            std::string::npos);
  EXPECT_NE(message_of<std::invalid_argument>([&] {
              w.add("__metadata__", {2}, x);
            }).find("__metadata__"),
            std::string::npos);
  EXPECT_NE(message_of<std::invalid_argument>([&] {
              w.add("n", {-1, 2}, x);
            }).find("invalid shape [-1, 2]"),
            std::string::npos);
  EXPECT_NE(message_of<std::invalid_argument>([&] {
              w.add("z", {2}, static_cast<const float*>(nullptr));
            }).find("null"),
            std::string::npos);
  EXPECT_NE(message_of<std::invalid_argument>([&] { w.add("\xff", {2}, x); }).find("UTF-8"),
            std::string::npos);
  EXPECT_NE(
      message_of<std::invalid_argument>([&] { w.set_metadata("k", "\xc0\x80"); }).find("UTF-8"),
      std::string::npos);
  EXPECT_EQ(w.size(), 1u);
}

// ---- every rule a file can break ----------------------------------------------------------

const char* const kOne = "{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

TEST(SafetensorsCorrupt, TruncatedAndHeaderSize) {
  const std::string good = file_of(kOne, std::string(8, '\0'));
  EXPECT_NO_THROW(SafetensorsFile::from_bytes(good));
  expect_corrupt("", {"truncated", "fewer than the 8"});
  expect_corrupt(good.substr(0, 7), {"truncated"});
  const std::string larger =
      "header size " + std::to_string(std::strlen(kOne)) + " is larger than the 12 bytes";
  expect_corrupt(good.substr(0, 20), {larger.c_str()});
  expect_corrupt(good.substr(0, good.size() - 1), {"tensor 't'", "ends past the data buffer"});
  expect_corrupt(le(100'000'001, 8) + "{}", {"above the limit"});
  expect_corrupt(le(~std::uint64_t(0), 8) + "{}", {"above the limit"});
  expect_corrupt(le(0, 8), {"bad header", "JSON object"});
}

TEST(SafetensorsCorrupt, BadJson) {
  expect_bad_json("[]", "JSON object");
  expect_bad_json("{", "a string");
  expect_bad_json("{\"t\"", "':'");
  expect_bad_json("{\"t\":", "must be an object");
  expect_bad_json("{} x", "unexpected text after");
  expect_bad_json("{}{}", "unexpected text after");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},}", "a string");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2] \"data_offsets\":[0,8]}}",
                  "',' or '}' in tensor 't'");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2,],\"data_offsets\":[0,8]}}",
                  "must be an integer");
  expect_bad_json("{\"unterminated", "unterminated string");
  expect_bad_json("{\"a\\qb\":{}}", "invalid escape");
  expect_bad_json("{\"a\\u12\":{}}", "4 hex digits");
  expect_bad_json("{\"a\\ud800\":{}}", "lone high surrogate");
  expect_bad_json("{\"a\\udc00\":{}}", "lone low surrogate");
  expect_bad_json("{\"a\tb\":{}}", "control character");
  expect_bad_json("{\"\xff\":{}}", "not valid UTF-8");
  expect_bad_json("{\"\xc0\xaf\":{}}", "not valid UTF-8");  // overlong '/'
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}",
                  "the shape of tensor 't' must be a non-negative integer");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}",
                  "must be an integer");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}",
                  "leading zeros");
  expect_bad_json(
      "{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,99999999999999999999]}}",
      "too large");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}",
                  "must be [begin, end], not [0]");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}",
                  "an array for the shape of tensor 't'");
  expect_bad_json("{\"t\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}",
                  "the dtype of tensor 't' must be a string");
  expect_bad_json("{\"t\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,1]}}",
                  "unknown dtype \"F4\" of tensor 't'");
  expect_bad_json("{\"t\":{\"shape\":[2],\"data_offsets\":[0,8]}}", "tensor 't' has no \"dtype\"");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", "has no \"shape\"");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2]}}", "has no \"data_offsets\"");
  expect_bad_json("{\"__metadata__\":{\"k\":1}}", "value of 'k' must be a string");
  expect_bad_json("{\"__metadata__\":[]}", "an object of strings");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":[1,}}",
                  "a JSON value");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":tru}}",
                  "a JSON value");
  expect_bad_json("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":" +
                      std::string(100, '[') + std::string(100, ']') + "}}",
                  "nested too deeply");
}

TEST(SafetensorsCorrupt, DuplicateKeys) {
  const std::string t = "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}";
  expect_corrupt(file_of("{\"t\":" + t + ",\"t\":" + t + "}", std::string(4, '\0')),
                 {"the key 't' appears twice"});
  expect_corrupt(file_of("{\"__metadata__\":{},\"__metadata__\":{}}"),
                 {"the key '__metadata__' appears twice"});
  expect_corrupt(file_of("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}"),
                 {"the __metadata__ key 'k' appears twice"});
  expect_corrupt(
      file_of("{\"t\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
              std::string(4, '\0')),
      {"the key 'dtype' of tensor 't' appears twice"});
}

TEST(SafetensorsCorrupt, OffsetsSizesOverlapsHoles) {
  const auto entry = [](const char* name, const char* shape, int b, int e) {
    return "\"" + std::string(name) + "\":{\"dtype\":\"F32\",\"shape\":" + shape +
           ",\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(e) + "]}";
  };
  const std::string z8(8, '\0'), z16(16, '\0');
  // Past the end.
  expect_corrupt(file_of("{" + entry("t", "[2]", 8, 16) + "}", z8),
                 {"tensor 't' (data_offsets [8, 16])", "ends past the data buffer of 8 bytes"});
  // Size mismatch.
  expect_corrupt(file_of("{" + entry("t", "[3]", 0, 8) + "}", z8),
                 {"tensor 't'", "holds 8 bytes but its shape [3] of F32 needs 12"});
  expect_corrupt(file_of("{" + entry("t", "[4611686018427387904,4]", 0, 8) + "}", z8),
                 {"is too large"});
  // End before begin.
  expect_corrupt(file_of("{" + entry("t", "[0]", 8, 0) + "}", z8), {"ends before it begins"});
  // Overlap.
  expect_corrupt(file_of("{" + entry("a", "[2]", 0, 8) + "," + entry("b", "[2]", 4, 12) + "}", z16),
                 {"tensor 'b' (data_offsets [4, 12]) overlaps tensor 'a'"});
  expect_corrupt(file_of("{" + entry("a", "[2]", 0, 8) + "," + entry("b", "[2]", 0, 8) + "}", z8),
                 {"overlaps"});
  expect_corrupt(file_of("{" + entry("a", "[2]", 0, 8) + "," + entry("e", "[0]", 4, 4) + "}", z8),
                 {"tensor 'e' (data_offsets [4, 4]) overlaps tensor 'a'"});
  // Holes: at the start, between tensors, at the end, and a buffer with no tensor.
  expect_corrupt(file_of("{" + entry("a", "[2]", 8, 16) + "}", z16),
                 {"hole", "bytes [0, 8) belong to no tensor"});
  expect_corrupt(file_of("{" + entry("a", "[1]", 0, 4) + "," + entry("b", "[2]", 8, 16) + "}", z16),
                 {"hole", "bytes [4, 8)", "before tensor 'b'"});
  expect_corrupt(file_of("{" + entry("a", "[2]", 0, 8) + "}", z16),
                 {"hole", "its last 8 bytes (from offset 8)"});
  expect_corrupt(file_of("{}", "x"), {"hole"});
  // Allowed: tensors of no bytes at the same offset, anywhere the buffer is tiled.
  EXPECT_NO_THROW(SafetensorsFile::from_bytes(
      file_of("{" + entry("a", "[2]", 0, 8) + "," + entry("e", "[0]", 8, 8) + "," +
                  entry("f", "[0,5]", 8, 8) + "," + entry("g", "[0]", 0, 0) + "}",
              z8)));
  EXPECT_NO_THROW(SafetensorsFile::from_bytes(file_of("{}")));
  EXPECT_NO_THROW(SafetensorsFile::from_bytes(file_of(" \t\r\n{ } \n  ")));
}

// ---- requests the file cannot satisfy -----------------------------------------------------

TEST(SafetensorsRequest, MissingWrongShapeIntegerDtype) {
  const auto f = SafetensorsFile::from_bytes(handmade(), "model.safetensors");
  const auto invalid = [](auto&& fn) { return message_of<std::invalid_argument>(fn); };
  std::string m = invalid([&] { f.info("nope"); });
  EXPECT_NE(m.find("linattn::SafetensorsFile::info: model.safetensors: tensor 'nope' is not in "
                   "the file"),
            std::string::npos)
      << m;
  m = invalid([&] { f.matrix<float>("nope", 1, 1); });
  EXPECT_NE(m.find("SafetensorsFile::matrix"), std::string::npos) << m;
  EXPECT_NE(m.find("not in the file"), std::string::npos) << m;
  EXPECT_NE(invalid([&] { f.raw("nope"); }).find("not in the file"), std::string::npos);

  m = invalid([&] { f.matrix<float>("w.f32", 3, 2); });
  EXPECT_NE(m.find("linattn::SafetensorsFile::matrix: model.safetensors: tensor 'w.f32' has "
                   "shape [2, 3], expected [3, 2]"),
            std::string::npos)
      << m;
  m = invalid([&] { f.vector<float>("b.bf16", 4); });
  EXPECT_NE(m.find("SafetensorsFile::vector"), std::string::npos) << m;
  EXPECT_NE(m.find("shape [3], expected [4]"), std::string::npos) << m;
  m = invalid([&] { f.vector<float>("s.f64", 1); });
  EXPECT_NE(m.find("shape [], expected [1]"), std::string::npos) << m;
  Eigen::MatrixXf out = Eigen::MatrixXf::Constant(3, 2, 7.0f);
  m = invalid([&] { f.read("w.f32", out); });
  EXPECT_NE(m.find("has shape [2, 3], expected [3, 2]"), std::string::npos) << m;
  m = invalid([&] { f.read("w.f32", {2, 3}, out.topRows(1)); });
  EXPECT_NE(m.find("shape [2, 3] does not fill the 1x2 output"), std::string::npos) << m;
  EXPECT_TRUE((out.array() == 7.0f).all());  // unchanged
  m = invalid([&] { f.read("w.f32", {-2, -3}, out.data()); });
  EXPECT_NE(m.find("negative dimension"), std::string::npos) << m;

  m = invalid([&] { f.vector<double>("i.int", 2); });
  EXPECT_NE(m.find("tensor 'i.int' is I64, not a floating dtype"), std::string::npos) << m;
  EXPECT_EQ(f.raw("i.int").size(), 16u);  // still readable as bytes
}

TEST(SafetensorsRequest, KnownUnconvertibleDtypesLoad) {
  const auto f = SafetensorsFile::from_bytes(
      file_of("{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]},"
              "\"m\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[2,3]}}",
              "\x38\xb8\x01"));
  EXPECT_EQ(f.info("q").dtype, TensorDtype::F8_E4M3);
  EXPECT_EQ(f.raw("q"), "\x38\xb8");
  EXPECT_EQ(f.info("m").dtype, TensorDtype::BOOL);
  const std::string m = message_of<std::invalid_argument>([&] { f.vector<float>("q", 2); });
  EXPECT_NE(m.find("F8_E4M3"), std::string::npos) << m;
}

TEST(SafetensorsRead, EscapedNamesRoundTrip) {
  const auto f = SafetensorsFile::from_bytes(
      file_of("{\"a\\u00e9\\ud83d\\ude00\\n\\/\":{\"dtype\":\"F32\",\"shape\":[],"
              "\"data_offsets\":[0,4]}}",
              le(0x3f800000, 4)));
  const std::string name = "a\xc3\xa9\xf0\x9f\x98\x80\n/";
  ASSERT_TRUE(f.contains(name));
  float x = 0;
  f.read(name, {}, &x);
  EXPECT_EQ(x, 1.0f);
  // The writer escapes what it must; the reader gives the same name back.
  const std::string odd = "q\"\\\x01 \xe2\x82\xac";
  const auto g = SafetensorsFile::from_bytes(SafetensorsWriter().add(odd, {}, &x).bytes());
  EXPECT_EQ(g.names(), std::vector<std::string>{odd});
}

}  // namespace
