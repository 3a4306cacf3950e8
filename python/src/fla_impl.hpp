// flash-linear-attention's calls for one scalar type: the gated kernels and the delta rule with
// carried states (FLA's initial_state / final_state, [N, H, K, V]: state b·H + h is K x V
// row-major, as LinearAttentionState::S), shared key heads (GVA) and per-channel decays (KDA),
// forward and backward, and the gate activations of core/gates.hpp. Included by fla_f32.cpp and
// fla_f64.cpp, apart from gated_delta_f32/f64.cpp so that neither rebuild waits on the other.
#pragma once

#include <linattn/core/gates.hpp>

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "gated_delta_impl.hpp"

namespace linattn_python {

// The per-sequence, per-head layout of one FLA call: B sequences (cu_seqlens or one), H value
// heads reading Hk key heads of D features, values of M, and the states' F x M (F = D: the maps
// of these kernels keep the key's size).
struct FlaLayout {
  Index B, H, Hk, D, M;
  Index group() const { return H / Hk; }
};

template <class Scalar>
FlaLayout fla_layout(const Operands<Scalar>& x, Index heads, Index key_heads) {
  const Index Hk = key_heads > 0 ? key_heads : heads;
  if (heads <= 0 || Hk <= 0 || heads % Hk != 0 || x.Q.cols() % Hk != 0 || x.V.cols() % heads != 0)
    throw std::invalid_argument(std::string(x.fn) + ": " + std::to_string(heads) +
                                " value heads cannot share " + std::to_string(Hk) +
                                " key heads (q has " + std::to_string(x.Q.cols()) +
                                " columns, v " + std::to_string(x.V.cols()) + ")");
  return {Index(x.q_offsets.size()) - 1, heads, Hk, x.Q.cols() / Hk, x.V.cols() / heads};
}

// An [N, H, F, M] array (N·H states of F x M) checked against the call, or none.
template <class Scalar>
const Scalar* state_array(const char* fn, const char* name, const std::optional<Array<Scalar>>& a,
                          const FlaLayout& l) {
  if (!a) return nullptr;
  const Array<Scalar>& s = *a;
  if (s.ndim() != 4 || s.shape(0) != l.B || s.shape(1) != l.H || s.shape(2) != l.D ||
      s.shape(3) != l.M)
    throw std::invalid_argument(std::string(fn) + ": " + name + " must be [" +
                                std::to_string(l.B) + ", " + std::to_string(l.H) + ", " +
                                std::to_string(l.D) + ", " + std::to_string(l.M) +
                                "] (sequences, heads, K, V)");
  return s.data();
}

template <class Scalar>
using StateMap = Eigen::Map<const RowMatrix<Scalar>>;

// The states of one call from h0 (zero without), one per sequence and head, sequence-major.
template <class Scalar>
std::vector<linattn::LinearAttentionState<Scalar>> initial_states(const Scalar* h0,
                                                                  const FlaLayout& l) {
  std::vector<linattn::LinearAttentionState<Scalar>> states(
      static_cast<std::size_t>(l.B * l.H), linattn::LinearAttentionState<Scalar>(l.D, l.M));
  if (h0)
    for (std::size_t i = 0; i < states.size(); ++i)
      states[i].S = StateMap<Scalar>(h0 + Index(i) * l.D * l.M, l.D, l.M);
  return states;
}

// The final states as FLA returns them, [N, H, K, V], the compensated low parts added in.
template <class Scalar>
py::object final_states(const std::vector<linattn::LinearAttentionState<Scalar>>& states,
                        const FlaLayout& l) {
  Array<Scalar> out({py::ssize_t(l.B), py::ssize_t(l.H), py::ssize_t(l.D), py::ssize_t(l.M)});
  Scalar* p = out.mutable_data();
  for (std::size_t i = 0; i < states.size(); ++i) {
    Rows<Scalar> dst(p + Index(i) * l.D * l.M, l.D, l.M);
    const auto& st = states[i];
    dst = st.S;
    if (st.S_lo.rows() == l.D && st.S_lo.cols() == l.M) dst += st.S_lo;
  }
  return std::move(out);
}

// f(t) for t in [0, count) on the kernel threads; the first exception is raised after all ran.
template <class F>
void each_task(Index count, F&& f) {
  std::exception_ptr error;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic)
#endif
  for (Index t = 0; t < count; ++t) {
    try {
      f(t);
    } catch (...) {
#ifdef _OPENMP
#pragma omp critical(linattn_python_each_task)
#endif
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

template <class Scalar>
py::tuple fla_gated_forward(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                            const Array<Scalar>& log_gates, Index heads, Index key_heads,
                            const std::string& map, double scale,
                            const std::optional<Offsets>& offsets,
                            const std::optional<Array<Scalar>>& h0, bool want_final) {
  const Operands<Scalar> x("gated_linear_attention", q, k, v, offsets, offsets);
  const FlaLayout l = fla_layout(x, heads, key_heads);
  const Scalar* s0 = state_array(x.fn, "initial_state", h0, l);
  const auto G = rows_of(x.fn, "g", log_gates);
  linattn::GatedOptions opts;
  opts.scale = scale;
  opts.key_heads = key_heads;
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  std::vector<linattn::LinearAttentionState<Scalar>> states;
  {
    Unlocked unlocked;
    if (s0 || want_final) states = initial_states(s0, l);
    with_gated_map(x.fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      if (states.empty())
        linattn::batched_gated_linear_attention(x.Q, x.K, x.V, G, x.q_offsets, heads, phi, O, ws,
                                                opts);
      else
        linattn::batched_gated_linear_attention(x.Q, x.K, x.V, G, x.q_offsets, heads, phi,
                                                states, O, ws, opts);
    });
  }
  return py::make_tuple(out, want_final ? final_states(states, l) : py::none());
}

template <class Scalar>
py::tuple fla_delta_forward(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                            const Array<Scalar>& beta, const std::optional<Array<Scalar>>& log_a,
                            Index heads, Index key_heads, const std::string& map, double scale,
                            const std::optional<Offsets>& offsets, double eps,
                            const std::optional<Array<Scalar>>& h0, bool want_final) {
  const Operands<Scalar> x("delta_rule_attention", q, k, v, offsets, offsets);
  const FlaLayout l = fla_layout(x, heads, key_heads);
  const Scalar* s0 = state_array(x.fn, "initial_state", h0, l);
  const auto B = rows_of(x.fn, "beta", beta);
  const auto A = params_of(x.fn, "g", log_a, x.Q.rows());
  linattn::DeltaOptions opts;
  opts.scale = scale;
  opts.key_heads = key_heads;
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  std::vector<linattn::LinearAttentionState<Scalar>> states;
  {
    Unlocked unlocked;
    if (s0 || want_final) states = initial_states(s0, l);
    with_delta_map(x.fn, map, eps, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      if (states.empty())
        linattn::batched_delta_rule_attention(x.Q, x.K, x.V, B, A, x.q_offsets, heads, phi, O, ws,
                                              opts);
      else
        linattn::batched_delta_rule_attention(x.Q, x.K, x.V, B, A, x.q_offsets, heads, phi,
                                              states, O, ws, opts);
    });
  }
  return py::make_tuple(out, want_final ? final_states(states, l) : py::none());
}

// The carried states of one backward: state i of h0 (empty: zero) and the gradient dht_i of the
// final state (empty: zero), and the array dh0 receives (when h0 was given).
template <class Scalar>
struct StateIO {
  const Scalar* h0;
  const Scalar* dht;
  std::optional<Array<Scalar>> dh0;
  Scalar* dh0_data = nullptr;

  StateIO(const char* fn, const std::optional<Array<Scalar>>& initial,
          const std::optional<Array<Scalar>>& d_final, const FlaLayout& l)
      : h0(state_array(fn, "initial_state", initial, l)),
        dht(state_array(fn, "d_final_state", d_final, l)) {
    if (h0) {
      dh0.emplace(std::vector<py::ssize_t>{py::ssize_t(l.B), py::ssize_t(l.H), py::ssize_t(l.D),
                                           py::ssize_t(l.M)});
      dh0_data = dh0->mutable_data();
    }
  }

  linattn::LinearAttentionState<Scalar> initial(Index i, const FlaLayout& l) const {
    linattn::LinearAttentionState<Scalar> st;
    if (h0) {
      st = linattn::LinearAttentionState<Scalar>(l.D, l.M);
      st.S = StateMap<Scalar>(h0 + i * l.D * l.M, l.D, l.M);
    }
    return st;
  }

  linattn::StateGradient<Scalar> d_final(Index i, const FlaLayout& l) const {
    linattn::StateGradient<Scalar> g;
    if (dht) g.dS = StateMap<Scalar>(dht + i * l.D * l.M, l.D, l.M);
    return g;
  }

  // dh0_i from the kernel's d_initial (empty: zero) or, for an empty sequence, dht_i itself.
  void store(Index i, const linattn::StateGradient<Scalar>& d, bool empty_sequence,
             const FlaLayout& l) {
    if (!dh0_data) return;
    Rows<Scalar> dst(dh0_data + i * l.D * l.M, l.D, l.M);
    if (empty_sequence && dht)
      dst = StateMap<Scalar>(dht + i * l.D * l.M, l.D, l.M);
    else if (!empty_sequence && d.dS.rows() == l.D && d.dS.cols() == l.M)
      dst = d.dS;
    else
      dst.setZero();
  }

  py::object result() const { return dh0 ? py::object(*dh0) : py::none(); }
};

// The gradients of one (sequence, key head) task: each of its G value heads through `head`
// (dq, dk receive the head's gradients of the shared q, k block), summed into dQ and dK.
template <class Scalar, class Head>
void key_head_task(Rows<Scalar>& dQ, Rows<Scalar>& dK, Index r0, Index n, Index c,
                   const FlaLayout& l, Head&& head) {
  auto dq = dQ.block(r0, c * l.D, n, l.D);
  auto dk = dK.block(r0, c * l.D, n, l.D);
  RowMatrix<Scalar> tq, tk;
  for (Index j = 0; j < l.group(); ++j) {
    const Index h = c * l.group() + j;
    if (j == 0) {
      head(h, dq, dk);
      continue;
    }
    tq.resize(n, l.D);
    tk.resize(n, l.D);
    head(h, tq, tk);
    dq += tq;
    dk += tk;
  }
}

template <class Scalar>
py::tuple fla_gated_backward(const Array<Scalar>& q, const Array<Scalar>& k,
                             const Array<Scalar>& v, const Array<Scalar>& log_gates,
                             const Array<Scalar>& dout, Index heads, Index key_heads,
                             const std::string& map, double scale,
                             const std::optional<Offsets>& offsets,
                             const std::optional<Array<Scalar>>& h0,
                             const std::optional<Array<Scalar>>& dht) {
  const Operands<Scalar> x("gated_linear_attention_backward", q, k, v, offsets, offsets);
  const FlaLayout l = fla_layout(x, heads, key_heads);
  const auto G = rows_of(x.fn, "g", log_gates);
  const auto dO = x.dout(dout);
  if (G.rows() != x.Q.rows() || G.cols() % heads != 0)
    throw std::invalid_argument(std::string(x.fn) + ": g is " + std::to_string(G.rows()) + "x" +
                                std::to_string(G.cols()) + " but q has " +
                                std::to_string(x.Q.rows()) + " rows and there are " +
                                std::to_string(heads) + " heads");
  StateIO<Scalar> io(x.fn, h0, dht, l);
  linattn::GatedOptions opts;  // one head at a time: no key_heads
  opts.scale = scale;
  const Index gw = G.cols() / heads;
  Gradients<Scalar> g(x);
  Array<Scalar> dg = new_rows<Scalar>(G.rows(), G.cols());
  auto dG = rows_of(dg);
  {
    Unlocked unlocked;
    with_gated_map(x.fn, map, [&](const auto& phi) {
      each_task(l.B * l.Hk, [&](Index t) {
        const Index b = t / l.Hk, c = t % l.Hk;
        const Index r0 = x.q_offsets[std::size_t(b)], n = x.q_offsets[std::size_t(b) + 1] - r0;
        linattn::Workspace<Scalar> ws;
        key_head_task(g.dQ, g.dK, r0, n, c, l, [&](Index h, auto& dq, auto& dk) {
          const Index i = b * l.H + h;
          linattn::StateGradient<Scalar> d0;
          if (n > 0) {
            auto dv = g.dV.block(r0, h * l.M, n, l.M);
            auto dgs = dG.block(r0, h * gw, n, gw);
            linattn::gated_linear_attention_backward(
                x.Q.block(r0, c * l.D, n, l.D), x.K.block(r0, c * l.D, n, l.D),
                x.V.block(r0, h * l.M, n, l.M), G.block(r0, h * gw, n, gw),
                dO.block(r0, h * l.M, n, l.M), phi, io.initial(i, l), io.d_final(i, l), dq, dk,
                dv, dgs, d0, ws, opts);
          }
          io.store(i, d0, n == 0, l);
        });
      });
    });
  }
  return py::make_tuple(g.dq, g.dk, g.dv, dg, io.result());
}

template <class Scalar>
py::tuple fla_delta_backward(const Array<Scalar>& q, const Array<Scalar>& k,
                             const Array<Scalar>& v, const Array<Scalar>& beta,
                             const std::optional<Array<Scalar>>& log_a, const Array<Scalar>& dout,
                             Index heads, Index key_heads, const std::string& map, double scale,
                             const std::optional<Offsets>& offsets, double eps,
                             const std::optional<Array<Scalar>>& h0,
                             const std::optional<Array<Scalar>>& dht) {
  const Operands<Scalar> x("delta_rule_attention_backward", q, k, v, offsets, offsets);
  const FlaLayout l = fla_layout(x, heads, key_heads);
  const auto B = rows_of(x.fn, "beta", beta);
  const auto A = params_of(x.fn, "g", log_a, x.Q.rows());
  const auto dO = x.dout(dout);
  if (B.rows() != x.Q.rows() || B.cols() != heads || A.rows() != x.Q.rows() ||
      A.cols() % heads != 0)
    throw std::invalid_argument(std::string(x.fn) + ": beta is " + std::to_string(B.rows()) +
                                "x" + std::to_string(B.cols()) + " and g " +
                                std::to_string(A.rows()) + "x" + std::to_string(A.cols()) +
                                " but q has " + std::to_string(x.Q.rows()) + " rows and there are " +
                                std::to_string(heads) + " heads");
  StateIO<Scalar> io(x.fn, h0, dht, l);
  linattn::DeltaOptions opts;  // one head at a time: no key_heads
  opts.scale = scale;
  const Index gw = A.cols() / heads;
  Gradients<Scalar> g(x);
  Array<Scalar> db = new_rows<Scalar>(B.rows(), B.cols());
  Array<Scalar> da = new_rows<Scalar>(A.rows(), A.cols());
  auto dB = rows_of(db);
  auto dA = rows_of(da);
  {
    Unlocked unlocked;
    with_delta_map(x.fn, map, eps, [&](const auto& phi) {
      each_task(l.B * l.Hk, [&](Index t) {
        const Index b = t / l.Hk, c = t % l.Hk;
        const Index r0 = x.q_offsets[std::size_t(b)], n = x.q_offsets[std::size_t(b) + 1] - r0;
        linattn::Workspace<Scalar> ws;
        key_head_task(g.dQ, g.dK, r0, n, c, l, [&](Index h, auto& dq, auto& dk) {
          const Index i = b * l.H + h;
          linattn::StateGradient<Scalar> d0;
          if (n > 0) {
            auto dv = g.dV.block(r0, h * l.M, n, l.M);
            auto dbs = dB.block(r0, h, n, 1);
            auto das = dA.block(r0, h * gw, n, gw);
            linattn::delta_rule_attention_backward(
                x.Q.block(r0, c * l.D, n, l.D), x.K.block(r0, c * l.D, n, l.D),
                x.V.block(r0, h * l.M, n, l.M), B.block(r0, h, n, 1),
                A.block(r0, h * gw, n, gw), dO.block(r0, h * l.M, n, l.M), phi,
                io.initial(i, l), io.d_final(i, l), dq, dk, dv, dbs, das, d0, ws, opts);
          }
          io.store(i, d0, n == 0, l);
        });
      });
    });
  }
  py::object dg = log_a ? py::object(da) : py::none();
  return py::make_tuple(g.dq, g.dk, g.dv, db, dg, io.result());
}

// The gate activations: a N x H·C, A_log H, dt_bias H·C or none; lower_bound set: KDA's
// lb·sigmoid form, else −exp(A_log)·softplus.
inline linattn::GateOptions gate_options(std::optional<double> lower_bound) {
  linattn::GateOptions o;
  if (lower_bound) {
    o.activation = linattn::GateActivation::LowerBoundSigmoid;
    o.lower_bound = *lower_bound;
  }
  return o;
}

template <class Scalar>
using VectorMap = Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>;

template <class Scalar>
VectorMap<Scalar> vector_of(const std::optional<Array<Scalar>>& a) {
  if (!a) return VectorMap<Scalar>(nullptr, 0);
  return VectorMap<Scalar>(a->data(), a->size());
}

template <class Scalar>
Array<Scalar> gate_forward(const Array<Scalar>& a, const Array<Scalar>& A_log,
                           const std::optional<Array<Scalar>>& dt_bias,
                           std::optional<double> lower_bound) {
  const auto X = rows_of("gate_activation", "g", a);
  Array<Scalar> g = new_rows<Scalar>(X.rows(), X.cols());
  auto G = rows_of(g);
  linattn::gate_activation(X, VectorMap<Scalar>(A_log.data(), A_log.size()), vector_of(dt_bias),
                           G, gate_options(lower_bound));
  return g;
}

template <class Scalar>
py::tuple gate_backward(const Array<Scalar>& a, const Array<Scalar>& A_log,
                        const std::optional<Array<Scalar>>& dt_bias, const Array<Scalar>& dg,
                        std::optional<double> lower_bound) {
  const auto X = rows_of("gate_activation_backward", "g", a);
  const auto dG = rows_of("gate_activation_backward", "dg", dg);
  Array<Scalar> da = new_rows<Scalar>(X.rows(), X.cols());
  Array<Scalar> dl(std::vector<py::ssize_t>{py::ssize_t(A_log.size())});
  Array<Scalar> dbias(std::vector<py::ssize_t>{py::ssize_t(dt_bias ? dt_bias->size() : 0)});
  auto dA = rows_of(da);
  Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>> dL(dl.mutable_data(), dl.size());
  Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>> dB(dbias.mutable_data(), dbias.size());
  linattn::gate_activation_backward(X, VectorMap<Scalar>(A_log.data(), A_log.size()),
                                    vector_of(dt_bias), dG, dA, dL, dB,
                                    gate_options(lower_bound));
  return py::make_tuple(da, dl, dt_bias ? py::object(dbias) : py::none());
}

template <class Scalar>
Array<Scalar> beta_forward(const Array<Scalar>& b, bool times_two) {
  const auto X = rows_of("beta_activation", "beta", b);
  Array<Scalar> beta = new_rows<Scalar>(X.rows(), X.cols());
  auto Y = rows_of(beta);
  linattn::beta_activation(X, Y, times_two);
  return beta;
}

template <class Scalar>
Array<Scalar> beta_backward(const Array<Scalar>& b, const Array<Scalar>& dbeta, bool times_two) {
  const auto X = rows_of("beta_activation_backward", "beta", b);
  Array<Scalar> db = new_rows<Scalar>(X.rows(), X.cols());
  auto dB = rows_of(db);
  linattn::beta_activation_backward(X, rows_of("beta_activation_backward", "dbeta", dbeta), dB,
                                    times_two);
  return db;
}

template <class Scalar>
void register_fla(py::module_& m) {
  m.def("fla_gated_forward", &fla_gated_forward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("heads"), py::arg("key_heads"), py::arg("feature_map"),
        py::arg("scale"), py::arg("offsets"), py::arg("initial_state"), py::arg("want_final"));
  m.def("fla_gated_backward", &fla_gated_backward<Scalar>, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("g"), py::arg("dout"), py::arg("heads"), py::arg("key_heads"),
        py::arg("feature_map"), py::arg("scale"), py::arg("offsets"), py::arg("initial_state"),
        py::arg("d_final_state"));
  m.def("fla_delta_forward", &fla_delta_forward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("beta"), py::arg("g"), py::arg("heads"), py::arg("key_heads"),
        py::arg("feature_map"), py::arg("scale"), py::arg("offsets"), py::arg("eps"),
        py::arg("initial_state"), py::arg("want_final"));
  m.def("fla_delta_backward", &fla_delta_backward<Scalar>, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("beta"), py::arg("g"), py::arg("dout"), py::arg("heads"),
        py::arg("key_heads"), py::arg("feature_map"), py::arg("scale"), py::arg("offsets"),
        py::arg("eps"), py::arg("initial_state"), py::arg("d_final_state"));
  m.def("gate_forward", &gate_forward<Scalar>, py::arg("a"), py::arg("A_log"), py::arg("dt_bias"),
        py::arg("lower_bound"));
  m.def("gate_backward", &gate_backward<Scalar>, py::arg("a"), py::arg("A_log"),
        py::arg("dt_bias"), py::arg("dg"), py::arg("lower_bound"));
  m.def("beta_forward", &beta_forward<Scalar>, py::arg("b"), py::arg("times_two"));
  m.def("beta_backward", &beta_backward<Scalar>, py::arg("b"), py::arg("dbeta"),
        py::arg("times_two"));
}

}  // namespace linattn_python
