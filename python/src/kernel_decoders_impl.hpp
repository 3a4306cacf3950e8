// The decoders of the gated kernels and of the delta rule (linattn.GatedDecoder,
// linattn.DeltaRuleDecoder): a BatchedRecurrentGatedAttention or BatchedRecurrentDeltaRule
// behind one virtual interface, so that Python picks the kernel and the feature map by name at
// run time. States go in and out in FLA's layout [B, H, K, V] (S of head h of sequence b is
// K x V row-major, as LinearAttentionState::S: no transpose). For one scalar type: included by
// kernel_decoders_f32.cpp and kernel_decoders_f64.cpp; the float decoders that keep their states
// in bf16 / half by kernel_decoders_low.cpp.
#pragma once

#include <linattn/delta/batched_recurrent_delta_rule.hpp>
#include <linattn/gated/batched_recurrent_gated_attention.hpp>
#include <linattn/state_io_decoders.hpp>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "bindings.hpp"
#include "gated_delta_impl.hpp"

namespace linattn_python {

using IndexVector = Eigen::Map<const Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1>>;

// A 1-D int64 array (slots, offsets) as an Eigen vector the decoders read in place.
inline IndexVector index_vector(const char* fn, const char* name, const Offsets& a) {
  if (a.ndim() != 1)
    throw std::invalid_argument(std::string(fn) + ": " + name + " must be 1-D, got " +
                                std::to_string(a.ndim()) + " dimensions");
  return IndexVector(a.data(), a.shape(0));
}

template <class Scalar>
class KernelDecoder {
 public:
  virtual ~KernelDecoder() = default;
  virtual std::string kernel() const = 0;
  virtual std::string feature_map() const = 0;
  virtual std::string state_dtype() const = 0;
  virtual Index sequences() const = 0;
  virtual Index heads() const = 0;
  virtual Index key_heads() const = 0;
  virtual Index key_dim() const = 0;
  virtual Index value_dim() const = 0;
  virtual Index feature_dim() const = 0;
  virtual std::vector<Index> positions() const = 0;
  virtual Array<Scalar> step(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                             const std::optional<Array<Scalar>>& g,
                             const std::optional<Array<Scalar>>& beta,
                             const std::optional<Offsets>& slots) = 0;
  virtual Array<Scalar> extend(const Offsets& slots, const Offsets& offsets, const Array<Scalar>& q,
                               const Array<Scalar>& k, const Array<Scalar>& v,
                               const std::optional<Array<Scalar>>& g,
                               const std::optional<Array<Scalar>>& beta) = 0;
  virtual void keep_snapshots(Index count) = 0;
  virtual Index kept_snapshots() const = 0;
  virtual Index snapshots(Index b) const = 0;
  virtual void rollback(Index b, Index tokens) = 0;
  virtual void reset(std::optional<Index> b) = 0;
  virtual Index add_sequence() = 0;
  virtual void remove_sequence(Index b) = 0;
  virtual void resize(Index B) = 0;
  virtual py::tuple states() const = 0;
  virtual void set_states(const Array<Scalar>& S, const std::optional<Array<Scalar>>& z,
                          const std::vector<Index>& positions) = 0;
  virtual py::bytes save() const = 0;
  virtual void load(const py::bytes& data) = 0;
  virtual std::unique_ptr<KernelDecoder> clone() const = 0;
};

// Batched: BatchedRecurrentGatedAttention<Phi, Scalar> or BatchedRecurrentDeltaRule<Phi,
// Scalar>; Options: its GatedOptions or DeltaOptions (kept to build a decoder on load()).
template <class Batched, class Phi, class Options, class Scalar>
class KernelDecoderOf final : public KernelDecoder<Scalar> {
  static constexpr bool kDelta = std::is_same_v<Options, linattn::DeltaOptions>;
  using State = linattn::LinearAttentionState<Scalar>;

 public:
  KernelDecoderOf(std::string map, Index B, Index H, Index D, Index M, const Phi& phi,
                  const Options& options)
      : map_(std::move(map)), phi_(phi), options_(options), dec_(B, H, D, M, phi, options) {}

  std::string kernel() const override { return kDelta ? "delta" : "gated"; }
  std::string feature_map() const override { return map_; }
  // What S is kept in between tokens, as numpy / torch name it.
  std::string state_dtype() const override {
    using Storage = typename Batched::Decoder::StateStorage;
    if constexpr (std::is_same_v<Storage, Eigen::bfloat16>)
      return "bfloat16";
    else if constexpr (std::is_same_v<Storage, Eigen::half>)
      return "float16";
    else
      return sizeof(Storage) == 4 ? "float32" : "float64";
  }
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
                     const std::optional<Array<Scalar>>& g,
                     const std::optional<Array<Scalar>>& beta,
                     const std::optional<Offsets>& slots) override {
    const char* fn = kDelta ? "DeltaRuleDecoder.step" : "GatedDecoder.step";
    const auto Q = rows_of(fn, "q", q), K = rows_of(fn, "k", k), V = rows_of(fn, "v", v);
    Array<Scalar> out = new_rows<Scalar>(V.rows(), V.cols());
    auto O = rows_of(out);
    run(fn, g, beta, Q.rows(), [&](const auto& G, const auto&... Bt) {
      if (slots) {
        const IndexVector S = index_vector(fn, "slots", *slots);
        Unlocked unlocked;
        dec_.step(S, Q, K, V, Bt..., G, O);
      } else {
        Unlocked unlocked;
        dec_.step(Q, K, V, Bt..., G, O);
      }
    });
    return out;
  }

  Array<Scalar> extend(const Offsets& slots, const Offsets& offsets, const Array<Scalar>& q,
                       const Array<Scalar>& k, const Array<Scalar>& v,
                       const std::optional<Array<Scalar>>& g,
                       const std::optional<Array<Scalar>>& beta) override {
    const char* fn = kDelta ? "DeltaRuleDecoder.extend" : "GatedDecoder.extend";
    const auto Q = rows_of(fn, "q", q), K = rows_of(fn, "k", k), V = rows_of(fn, "v", v);
    const IndexVector S = index_vector(fn, "slots", slots);
    const IndexVector Off = index_vector(fn, "cu_seqlens", offsets);
    Array<Scalar> out = new_rows<Scalar>(V.rows(), V.cols());
    auto O = rows_of(out);
    run(fn, g, beta, Q.rows(), [&](const auto& G, const auto&... Bt) {
      Unlocked unlocked;
      dec_.extend(S, Off, Q, K, V, Bt..., G, O);
    });
    return out;
  }

  void keep_snapshots(Index count) override {
    dec_.keep_snapshots(count);
    keep_ = count;
  }
  Index kept_snapshots() const override { return keep_; }
  Index snapshots(Index b) const override { return dec_.snapshots(b); }
  void rollback(Index b, Index tokens) override { dec_.rollback(b, tokens); }

  void reset(std::optional<Index> b) override {
    if (b)
      dec_.reset(*b);
    else
      dec_.reset();
  }
  Index add_sequence() override { return dec_.add_sequence(); }
  void remove_sequence(Index b) override { dec_.remove_sequence(b); }
  void resize(Index B) override { dec_.resize(B); }

  // (S, z): [B, H, F, M] and [B, H, F] (z: zero for the delta rule, which keeps none); a
  // bf16 / half S widened (exact).
  py::tuple states() const override {
    const Index B = dec_.sequences(), H = dec_.heads(), F = dec_.feature_dim(),
                M = dec_.value_dim();
    Array<Scalar> S({py::ssize_t(B), py::ssize_t(H), py::ssize_t(F), py::ssize_t(M)});
    Array<Scalar> z({py::ssize_t(B), py::ssize_t(H), py::ssize_t(F)});
    Scalar* s = S.mutable_data();
    Scalar* zp = z.mutable_data();
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        const Index i = b * H + h;
        const State st = dec_.state(b, h);
        Rows<Scalar>(s + i * F * M, F, M) = st.S;
        Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>> zi(zp + i * F, F);
        if (st.z.size() == F)
          zi = st.z;
        else
          zi.setZero();
      }
    return py::make_tuple(S, z);
  }

  // Every head from S [B, H, F, M] (and z [B, H, F], or zero), sequence b at positions[b];
  // all checked before any head changes (a bf16 / half decoder rounds S to its storage).
  void set_states(const Array<Scalar>& S, const std::optional<Array<Scalar>>& z,
                  const std::vector<Index>& positions) override {
    const char* fn = kDelta ? "DeltaRuleDecoder.set_states" : "GatedDecoder.set_states";
    const Index B = dec_.sequences(), H = dec_.heads(), F = dec_.feature_dim(),
                M = dec_.value_dim();
    const std::string want = "[" + std::to_string(B) + ", " + std::to_string(H) + ", " +
                             std::to_string(F) + ", " + std::to_string(M) + "]";
    if (S.ndim() != 4 || S.shape(0) != B || S.shape(1) != H || S.shape(2) != F || S.shape(3) != M)
      throw std::invalid_argument(std::string(fn) + ": the states must be " + want +
                                  " (sequences, heads, K, V)");
    if (z && (z->ndim() != 3 || z->shape(0) != B || z->shape(1) != H || z->shape(2) != F))
      throw std::invalid_argument(std::string(fn) + ": z must be [" + std::to_string(B) + ", " +
                                  std::to_string(H) + ", " + std::to_string(F) + "]");
    if (static_cast<Index>(positions.size()) != B)
      throw std::invalid_argument(std::string(fn) + ": positions has " +
                                  std::to_string(positions.size()) +
                                  " entries, not B = " + std::to_string(B));
    std::vector<State> states(static_cast<std::size_t>(B * H), State(F, M));
    for (std::size_t i = 0; i < states.size(); ++i) {
      states[i].S = ConstRows<Scalar>(S.data() + Index(i) * F * M, F, M);
      if (z)
        states[i].z =
            Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>(z->data() + Index(i) * F, F);
    }
    bool uniform = true;
    for (Index b = 1; b < B; ++b) uniform = uniform && positions[std::size_t(b)] == positions[0];
    for (Index p : positions)
      if (p < 0)
        throw std::invalid_argument(std::string(fn) + ": positions must be >= 0, got " +
                                    std::to_string(p));
    Unlocked unlocked;
    // set_states() checks every state before it installs any; per-sequence positions then
    // only renumber states that are known to fit.
    dec_.set_states(states, B > 0 && uniform ? positions[0] : 0);
    if (!uniform)
      for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h)
          dec_.set_state(b, h, states[std::size_t(b * H + h)], positions[std::size_t(b)]);
  }

  py::bytes save() const override {
    std::ostringstream os(std::ios::binary);
    {
      Unlocked unlocked;
      linattn::save_state(os, dec_);
    }
    return py::bytes(os.str());
  }

  // The file's number of sequences (its records are of one size for these shapes: 80 bytes
  // and the state, state_io_decoders.hpp; a bf16 / half state is recorded in float), into a
  // new decoder: on any failure nothing changed.
  void load(const py::bytes& data) override {
    const char* fn = kDelta ? "DeltaRuleDecoder.load" : "GatedDecoder.load";
    std::string bytes(data);
    const Index H = dec_.heads(), F = dec_.feature_dim(), M = dec_.value_dim();
    const std::size_t record =
        80 + sizeof(Scalar) * static_cast<std::size_t>(F * M + (kDelta ? 0 : 2 * F));
    const std::size_t sequence = record * static_cast<std::size_t>(H);
    if (bytes.size() % sequence != 0)
      throw std::runtime_error(std::string(fn) + ": " + std::to_string(bytes.size()) +
                               " bytes are not whole sequences of " + std::to_string(H) +
                               " records of " + std::to_string(record) +
                               " bytes (the save() of a decoder of H = " + std::to_string(H) +
                               ", K = " + std::to_string(dec_.key_dim()) +
                               ", V = " + std::to_string(M) + " and this dtype)");
    const Index B = static_cast<Index>(bytes.size() / sequence);
    Batched next(B, H, dec_.key_dim(), M, phi_, options_);
    {
      std::istringstream is(std::move(bytes), std::ios::binary);
      Unlocked unlocked;
      linattn::load_state(is, next);
    }
    if (keep_) next.keep_snapshots(keep_);
    dec_ = std::move(next);
  }

  std::unique_ptr<KernelDecoder<Scalar>> clone() const override {
    return std::make_unique<KernelDecoderOf>(*this);
  }

 private:
  // f(log gates, [beta]) with the optional arrays as maps: the gated decoder takes its log
  // gates, the delta rule beta and its log-decays (none: N x 0, no decay).
  template <class F>
  void run(const char* fn, const std::optional<Array<Scalar>>& g,
           const std::optional<Array<Scalar>>& beta, Index rows, F&& f) {
    const auto G = params_of(fn, "g", g, rows);
    if constexpr (kDelta) {
      if (!beta) throw std::invalid_argument(std::string(fn) + ": beta is required");
      f(G, rows_of(fn, "beta", *beta));
    } else {
      if (!g) throw std::invalid_argument(std::string(fn) + ": g (the log gates) is required");
      if (beta) throw std::invalid_argument(std::string(fn) + ": the gated kernels take no beta");
      f(G);
    }
  }

  std::string map_;
  Phi phi_;
  Options options_;
  Batched dec_;
  Index keep_ = 0;
};

template <class Scalar, class StateScalar = Scalar>
std::unique_ptr<KernelDecoder<Scalar>> new_gated_decoder(Index B, Index H, Index D, Index M,
                                                         Index key_heads, const std::string& map,
                                                         double scale, bool normalize) {
  linattn::GatedOptions o;
  o.scale = scale;
  o.normalize = normalize;
  o.key_heads = key_heads;
  std::unique_ptr<KernelDecoder<Scalar>> d;
  with_gated_map("GatedDecoder", map, [&](const auto& phi) {
    using Phi = std::decay_t<decltype(phi)>;
    using Batched = linattn::BatchedRecurrentGatedAttention<Phi, Scalar, StateScalar>;
    d = std::make_unique<KernelDecoderOf<Batched, Phi, linattn::GatedOptions, Scalar>>(map, B, H, D,
                                                                                       M, phi, o);
  });
  return d;
}

template <class Scalar, class StateScalar = Scalar>
std::unique_ptr<KernelDecoder<Scalar>> new_delta_decoder(Index B, Index H, Index D, Index M,
                                                         Index key_heads, const std::string& map,
                                                         double scale, double eps) {
  linattn::DeltaOptions o;
  o.scale = scale;
  o.key_heads = key_heads;
  std::unique_ptr<KernelDecoder<Scalar>> d;
  with_delta_map("DeltaRuleDecoder", map, eps, [&](const auto& phi) {
    using Phi = std::decay_t<decltype(phi)>;
    using Batched = linattn::BatchedRecurrentDeltaRule<Phi, Scalar, StateScalar>;
    d = std::make_unique<KernelDecoderOf<Batched, Phi, linattn::DeltaOptions, Scalar>>(map, B, H, D,
                                                                                       M, phi, o);
  });
  return d;
}

template <class Scalar>
void register_kernel_decoders(py::module_& m, const char* name) {
  using D = KernelDecoder<Scalar>;
  py::class_<D>(m, name)
      .def_property_readonly("kernel", &D::kernel)
      .def_property_readonly("feature_map", &D::feature_map)
      .def_property_readonly("state_dtype", &D::state_dtype)
      .def_property_readonly("sequences", &D::sequences)
      .def_property_readonly("heads", &D::heads)
      .def_property_readonly("key_heads", &D::key_heads)
      .def_property_readonly("key_dim", &D::key_dim)
      .def_property_readonly("value_dim", &D::value_dim)
      .def_property_readonly("feature_dim", &D::feature_dim)
      .def_property_readonly("kept_snapshots", &D::kept_snapshots)
      .def("positions", &D::positions)
      .def("step", &D::step, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
           py::arg("beta"), py::arg("slots"))
      .def("extend", &D::extend, py::arg("slots"), py::arg("offsets"), py::arg("q"), py::arg("k"),
           py::arg("v"), py::arg("g"), py::arg("beta"))
      .def("keep_snapshots", &D::keep_snapshots, py::arg("count"))
      .def("snapshots", &D::snapshots, py::arg("b"))
      .def("rollback", &D::rollback, py::arg("b"), py::arg("tokens"))
      .def("reset", &D::reset, py::arg("b"))
      .def("add_sequence", &D::add_sequence)
      .def("remove_sequence", &D::remove_sequence, py::arg("b"))
      .def("resize", &D::resize, py::arg("B"))
      .def("states", &D::states)
      .def("set_states", &D::set_states, py::arg("S"), py::arg("z"), py::arg("positions"))
      .def("save", &D::save)
      .def("load", &D::load, py::arg("data"))
      .def("clone", &D::clone);
  const bool f32 = sizeof(Scalar) == 4;
  m.def(f32 ? "new_gated_decoder_f32" : "new_gated_decoder_f64", &new_gated_decoder<Scalar, Scalar>,
        py::arg("B"), py::arg("H"), py::arg("D"), py::arg("M"), py::arg("key_heads"),
        py::arg("feature_map"), py::arg("scale"), py::arg("normalize"));
  m.def(f32 ? "new_delta_decoder_f32" : "new_delta_decoder_f64", &new_delta_decoder<Scalar, Scalar>,
        py::arg("B"), py::arg("H"), py::arg("D"), py::arg("M"), py::arg("key_heads"),
        py::arg("feature_map"), py::arg("scale"), py::arg("eps"));
}

}  // namespace linattn_python
