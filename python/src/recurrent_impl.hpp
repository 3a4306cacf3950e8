// The decoding state of B sequences x H heads (linattn.RecurrentState): a
// BatchedRecurrentLinearAttention behind a virtual interface, so that Python picks the feature
// map by name at run time. Also the causal prefill that carries the states in and out
// (linear_attention(..., initial_state=, output_final_state=True)). For one scalar type:
// included by recurrent_f32.cpp and recurrent_f64.cpp.
#pragma once

#include <linattn/batched_recurrent.hpp>
#include <linattn/multihead.hpp>
#include <linattn/state_io.hpp>

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "linear_impl.hpp"

namespace linattn_python {

using Slots = py::array_t<std::int64_t, py::array::c_style>;

template <class Scalar>
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual std::string feature_map() const = 0;
  virtual Index sequences() const = 0;
  virtual Index heads() const = 0;
  virtual Index key_heads() const = 0;
  virtual Index key_dim() const = 0;
  virtual Index value_dim() const = 0;
  virtual Index feature_dim() const = 0;
  virtual std::vector<Index> positions() const = 0;
  virtual Array<Scalar> step(const Array<Scalar>& q, const Array<Scalar>& k,
                             const Array<Scalar>& v, const std::optional<Slots>& slots) = 0;
  virtual Array<Scalar> prefill(const Array<Scalar>& q, const Array<Scalar>& k,
                                const Array<Scalar>& v, const std::optional<KeyMask>& mask,
                                const std::optional<Offsets>& offsets) = 0;
  virtual void reset(std::optional<Index> b) = 0;
  virtual Index add_sequence() = 0;
  virtual void remove_sequence(Index b) = 0;
  virtual void resize(Index B) = 0;
  virtual py::bytes save() const = 0;
  virtual void load(const py::bytes& data) = 0;
  virtual std::unique_ptr<Decoder> clone() const = 0;
  virtual py::tuple states() const = 0;
};

template <class Phi, class Scalar>
class DecoderOf final : public Decoder<Scalar> {
 public:
  // key_heads: Hk query/key heads shared by the H value heads (0: H).
  DecoderOf(std::string name, Index B, Index H, Index D, Index M, Phi phi, Index key_heads)
      : name_(std::move(name)), dec_(B, H, D, M, phi, causal_options(key_heads)), phi_(phi) {}

  std::string feature_map() const override { return name_; }
  Index sequences() const override { return dec_.sequences(); }
  Index heads() const override { return dec_.heads(); }
  Index key_heads() const override { return dec_.key_heads(); }
  Index key_dim() const override { return dec_.key_dim(); }
  Index value_dim() const override { return dec_.value_dim(); }
  Index feature_dim() const override { return dec_.feature_dim(); }
  std::vector<Index> positions() const override {
    std::vector<Index> p(static_cast<std::size_t>(dec_.sequences()));
    for (Index b = 0; b < dec_.sequences(); ++b) p[static_cast<std::size_t>(b)] = dec_.position(b);
    return p;
  }

  Array<Scalar> step(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                     const std::optional<Slots>& slots) override {
    const char* fn = "RecurrentState.step";
    const auto Q = rows_of(fn, "q", q), K = rows_of(fn, "k", k), V = rows_of(fn, "v", v);
    Array<Scalar> out = new_rows<Scalar>(Q.rows(), V.cols());
    auto O = rows_of(out);
    if (slots) {
      if (slots->ndim() != 1)
        throw std::invalid_argument(std::string(fn) + ": slots must be 1-D");
      const Eigen::Map<const Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1>> S(slots->data(),
                                                                               slots->shape(0));
      Unlocked unlocked;
      dec_.step(S, Q, K, V, O);
    } else {
      Unlocked unlocked;
      dec_.step(Q, K, V, O);
    }
    return out;
  }

  // Every sequence continues over its rows of q, k, v (offsets: B + 1 entries; none: B = 1),
  // with the chunked causal kernel; its state and position then stand after its last row.
  Array<Scalar> prefill(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                        const std::optional<KeyMask>& mask,
                        const std::optional<Offsets>& offsets) override {
    const Operands<Scalar> x("causal_linear_attention", q, k, v, offsets, offsets);
    const Index B = static_cast<Index>(x.q_offsets.size()) - 1, H = dec_.heads(),
                Hk = dec_.key_heads();
    if (B != dec_.sequences())
      throw std::invalid_argument(std::string(x.fn) + ": initial_state holds " +
                                  std::to_string(dec_.sequences()) + " sequences but the input has " +
                                  std::to_string(B));
    if (x.Q.cols() != Hk * dec_.key_dim() || x.V.cols() != H * dec_.value_dim())
      throw std::invalid_argument(
          std::string(x.fn) + ": initial_state has H = " + std::to_string(H) +
          " value heads over Hk = " + std::to_string(Hk) + " query/key heads, of D = " +
          std::to_string(dec_.key_dim()) + ", M = " + std::to_string(dec_.value_dim()) +
          " but q has " + std::to_string(x.Q.cols()) + " columns and v " +
          std::to_string(x.V.cols()));
    Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
    auto O = rows_of(out);
    {
      Unlocked unlocked;
      std::vector<linattn::LinearAttentionState<Scalar>> states = dec_.states();
      linattn::MultiHeadWorkspace<Scalar> ws;
      if (mask) {
        linattn::masked_batched_causal_linear_attention(x.Q, x.K, x.V, x.q_offsets, mask_of(*mask), H,
                                                        phi_, states, O, ws, causal_options(Hk));
      } else {
        linattn::batched_causal_linear_attention(x.Q, x.K, x.V, x.q_offsets, H, phi_, states, O,
                                                 ws, causal_options(Hk));
      }
      for (Index b = 0; b < B; ++b) {
        const Index at = dec_.position(b) + x.q_offsets[b + 1] - x.q_offsets[b];
        for (Index h = 0; h < H; ++h)
          dec_.set_state(b, h, states[static_cast<std::size_t>(b * H + h)], at);
      }
    }
    return out;
  }

  void reset(std::optional<Index> b) override {
    if (b)
      dec_.reset(*b);
    else
      dec_.reset();
  }
  Index add_sequence() override { return dec_.add_sequence(); }
  void remove_sequence(Index b) override { dec_.remove_sequence(b); }
  void resize(Index B) override { dec_.resize(B); }

  py::bytes save() const override {
    std::ostringstream os(std::ios::binary);
    {
      Unlocked unlocked;
      linattn::save_state(os, dec_);
    }
    return py::bytes(os.str());
  }
  void load(const py::bytes& data) override {
    std::istringstream is(std::string(data), std::ios::binary);
    Unlocked unlocked;
    linattn::load_state(is, dec_);
  }
  std::unique_ptr<Decoder<Scalar>> clone() const override {
    return std::make_unique<DecoderOf>(*this);
  }

  // (S, z): B·H·F x M and B·H x F, the folded states, sequence-major.
  py::tuple states() const override {
    const Index B = dec_.sequences(), H = dec_.heads(), F = dec_.feature_dim(),
                M = dec_.value_dim();
    Array<Scalar> S = new_rows<Scalar>(B * H * F, M), z = new_rows<Scalar>(B * H, F);
    auto Sm = rows_of(S);
    auto zm = rows_of(z);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        const auto st = dec_.state(b, h);
        Sm.middleRows((b * H + h) * F, F) = st.S;
        zm.row(b * H + h) = st.z.transpose();
      }
    return py::make_tuple(S, z);
  }

 private:
  static linattn::CausalOptions causal_options(Index key_heads) {
    linattn::CausalOptions o;
    o.key_heads = key_heads;
    return o;
  }

  std::string name_;
  linattn::BatchedRecurrentLinearAttention<Phi, Scalar> dec_;
  Phi phi_;
};

template <class Scalar>
std::unique_ptr<Decoder<Scalar>> new_decoder(Index B, Index H, Index D, Index M,
                                             const std::string& map, Index key_heads) {
  std::unique_ptr<Decoder<Scalar>> d;
  with_feature_map("RecurrentState", map, [&](const auto& phi) {
    using Phi = std::decay_t<decltype(phi)>;
    d = std::make_unique<DecoderOf<Phi, Scalar>>(map, B, H, D, M, phi, key_heads);
  });
  return d;
}

template <class Scalar>
void register_recurrent(py::module_& m, const char* name) {
  using D = Decoder<Scalar>;
  py::class_<D>(m, name)
      .def_property_readonly("feature_map", &D::feature_map)
      .def_property_readonly("sequences", &D::sequences)
      .def_property_readonly("heads", &D::heads)
      .def_property_readonly("key_heads", &D::key_heads)
      .def_property_readonly("key_dim", &D::key_dim)
      .def_property_readonly("value_dim", &D::value_dim)
      .def_property_readonly("feature_dim", &D::feature_dim)
      .def("positions", &D::positions)
      .def("step", &D::step, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("slots"))
      .def("prefill", &D::prefill, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
           py::arg("offsets"))
      .def("reset", &D::reset, py::arg("b"))
      .def("add_sequence", &D::add_sequence)
      .def("remove_sequence", &D::remove_sequence, py::arg("b"))
      .def("resize", &D::resize, py::arg("B"))
      .def("save", &D::save)
      .def("load", &D::load, py::arg("data"))
      .def("clone", &D::clone)
      .def("states", &D::states);
  m.def(sizeof(Scalar) == 4 ? "new_decoder_f32" : "new_decoder_f64", &new_decoder<Scalar>,
        py::arg("B"), py::arg("H"), py::arg("D"), py::arg("M"), py::arg("feature_map"),
        py::arg("key_heads") = 0);
}

}  // namespace linattn_python
