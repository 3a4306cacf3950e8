// libFuzzer target of the state loader (state_io.hpp): arbitrary bytes go to load_state for
// float and double states and into recurrent, multi-head recurrent, gated recurrent (kinds 8
// and 4), delta-rule recurrent (kind 7) and batched recurrent objects and the attention
// layers' States (a LinearAttentionLayer's, kind 3; a SoftmaxAttentionLayer's KV cache, kind
// 6): every kind, through a seekable and a non-seekable stream. Any exception but
// std::runtime_error is a bug, and so is a load that succeeds and does not save back to exactly
// the bytes it consumed (for a record of the old format version 1: to its version-2 form; for
// a gated decoder's kind-4 record: to its kind-8 form), or one that fails and changes the
// object. ASan and UBSan catch the rest.
#include <linattn/linattn.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <ios>
#include <istream>
#include <sstream>
#include <stdexcept>
#include <streambuf>
#include <string>

namespace {

[[noreturn]] void bug(const char* what) {
  std::fprintf(stderr, "fuzz_load_state: %s\n", what);
  std::abort();
}

// A stream buffer that cannot seek (a pipe): the loader cannot ask for the length.
class OneWayBuf : public std::streambuf {
 public:
  explicit OneWayBuf(std::string& bytes) {
    char* p = bytes.data();
    setg(p, p, p + bytes.size());
  }
};

// The version-2 form of the version-1 record `v1` (no log-decay): an 8-byte log-decay field of
// 0 inserted at 56, version 2, both CRCs recomputed. What saving a loaded version-1 record
// writes.
std::string upgraded(const std::string& v1) {
  if (v1.size() < 64) return std::string();
  std::string f = v1.substr(0, 56) + std::string(12, '\0') + v1.substr(60);
  auto* b = reinterpret_cast<unsigned char*>(&f[0]);
  linattn::detail::io::put_le(b + 8, std::uint32_t(2));
  linattn::detail::io::put_le(b + 64, linattn::detail::io::crc32(b, 64));
  linattn::detail::io::put_le(b + f.size() - 4, linattn::detail::io::crc32(b, f.size() - 4));
  return f;
}

// The kind-8 form of the gated kind-4 record `k4` of s-byte scalars: kind 8, without the
// unfolded count and the low parts (which a loaded kind-4 record has as zeros), both CRCs
// recomputed. What saving a loaded kind-4 record writes.
std::string compacted(const std::string& k4, std::size_t s) {
  if (k4.size() < 72) return std::string();
  const auto* h = reinterpret_cast<const unsigned char*>(k4.data());
  const std::size_t F = linattn::detail::io::get_le<std::uint64_t>(h + 40);
  const std::size_t M = linattn::detail::io::get_le<std::uint64_t>(h + 48);
  if (k4.size() < 72 + 16 + s * (2 * F * M + 3 * F)) return std::string();
  std::string f = k4.substr(0, 76) + k4.substr(84, s * F * M) +
                  k4.substr(84 + 2 * s * F * M, s * F) +
                  k4.substr(84 + s * (2 * F * M + 2 * F), s * F) + std::string(4, '\0');
  auto* b = reinterpret_cast<unsigned char*>(&f[0]);
  linattn::detail::io::put_le(b + 16, std::uint32_t(8));
  linattn::detail::io::put_le(b + 64, linattn::detail::io::crc32(b, 64));
  linattn::detail::io::put_le(b + f.size() - 4, linattn::detail::io::crc32(b, f.size() - 4));
  return f;
}

template <class T>
std::string saved(const T& x) {
  std::ostringstream os(std::ios::binary);
  linattn::save_state(os, x);
  return os.str();
}

// Loads with `load` from both kinds of stream; on success the re-saved object must be the
// bytes consumed, on failure (std::runtime_error only) `unchanged` must hold.
template <class Load, class Resave, class Unchanged>
void check(std::string& bytes, Load&& load, Resave&& resave, Unchanged&& unchanged) {
  for (int seekable = 0; seekable < 2; ++seekable) {
    std::istringstream string_stream(bytes, std::ios::binary);
    OneWayBuf buf(bytes);
    std::istream pipe(&buf);
    std::istream& is = seekable ? static_cast<std::istream&>(string_stream) : pipe;
    try {
      load(is);
    } catch (const std::runtime_error&) {
      if (!unchanged()) bug("a failed load changed the object");
      continue;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "unexpected exception: %s\n", e.what());
      bug("an exception other than std::runtime_error");
    } catch (...) {
      bug("a non-standard exception");
    }
    const std::string again = resave();
    const auto* h = reinterpret_cast<const unsigned char*>(bytes.data());
    using linattn::detail::io::get_le;
    const bool version1 = bytes.size() >= 12 && get_le<std::uint32_t>(h + 8) == 1;
    const bool kind4 = bytes.size() >= 20 && get_le<std::uint32_t>(h + 16) == 4;
    if (kind4) {  // a gated decoder's older record: saved again as kind 8
      const std::size_t s = get_le<std::uint32_t>(h + 12) == 1 ? 4 : 8;
      if (compacted(bytes, s) != again)
        bug("a loaded kind-4 record does not save back to its kind-8 form");
    } else if (version1) {
      if (again.size() < 8 || again.size() - 8 > bytes.size() ||
          upgraded(bytes.substr(0, again.size() - 8)) != again)
        bug("a loaded version-1 record does not save back to its version-2 form");
    } else if (again.size() > bytes.size() || bytes.compare(0, again.size(), again) != 0) {
      bug("a loaded record does not save back to the bytes it came from");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);

  linattn::LinearAttentionState<float> sf;
  check(bytes, [&](std::istream& is) { sf = linattn::load_state<float>(is); },
        [&] { return saved(sf); }, [] { return true; });
  linattn::LinearAttentionState<double> sd;
  check(bytes, [&](std::istream& is) { sd = linattn::load_state<double>(is); },
        [&] { return saved(sd); }, [] { return true; });

  // The shapes of the seed corpus (make_fuzz_seeds.cpp), so that mutations reach the payload.
  linattn::RecurrentLinearAttention<linattn::EluPlusOne, float> rf(3, 2);
  const std::string rf_before = saved(rf);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, rf); }, [&] { return saved(rf); },
        [&] { return saved(rf) == rf_before; });
  linattn::RecurrentLinearAttention<linattn::SoftmaxSplit, double> rd(2, 3);
  const std::string rd_before = saved(rd);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, rd); }, [&] { return saved(rd); },
        [&] { return saved(rd) == rd_before; });
  linattn::MultiHeadRecurrentLinearAttention<linattn::SoftmaxSplit, float> mh(2, 2, 2);
  const std::string mh_before = saved(mh);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, mh); }, [&] { return saved(mh); },
        [&] { return saved(mh) == mh_before; });
  // Kinds 8 and 4: a gated decoder in float and in double (D = F = 3, M = 2 and D = F = 2, M = 3).
  linattn::RecurrentGatedAttention<linattn::Identity, float> gf(3, 2);
  const std::string gf_before = saved(gf);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, gf); }, [&] { return saved(gf); },
        [&] { return saved(gf) == gf_before && gf.position() == 0; });
  linattn::RecurrentGatedAttention<linattn::Silu, double> gd(2, 3);
  const std::string gd_before = saved(gd);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, gd); }, [&] { return saved(gd); },
        [&] { return saved(gd) == gd_before && gd.position() == 0; });
  // Kind 7: delta-rule decoders in float and in double (D = F = 3, M = 2 and D = F = 2, M = 3).
  linattn::RecurrentDeltaRule<linattn::Identity, float> df(3, 2);
  const std::string df_before = saved(df);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, df); }, [&] { return saved(df); },
        [&] { return saved(df) == df_before && df.position() == 0; });
  linattn::RecurrentDeltaRule<linattn::L2Normalize<linattn::Silu>, double> dd(2, 3);
  const std::string dd_before = saved(dd);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, dd); }, [&] { return saved(dd); },
        [&] { return saved(dd) == dd_before && dd.position() == 0; });
  // Kind 5: batched decoders (B from the file) in float and in double (2 sequences of H = 2,
  // D = F = 3, M = 2 without maxima; 1 sequence of H = 1, D = F = 2, M = 3 with maxima).
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> bf(2, 2, 3, 2);
  const std::string bf_before = saved(bf);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, bf); }, [&] { return saved(bf); },
        [&] { return saved(bf) == bf_before && bf.sequences() == 2; });
  linattn::BatchedRecurrentLinearAttention<linattn::SoftmaxSplit, double> bd(1, 1, 2, 3);
  const std::string bd_before = saved(bd);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, bd); }, [&] { return saved(bd); },
        [&] { return saved(bd) == bd_before && bd.sequences() == 1; });
  // The attention layers' States: a linear layer's (kind 3, H = 2, D = F = 3, M = 2, no maxima;
  // its heads must share one position) and KV caches (kind 6) in float (H = 2, D = 3, M = 2)
  // and double (H = 1, D = 2, M = 3, with a reserved capacity that a load may keep).
  const linattn::LinearAttentionLayer<linattn::EluPlusOne, float> lf(5, 2, 3, 2);
  auto lfs = lf.make_state();
  const std::string lfs_before = saved(lfs);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, lfs); }, [&] { return saved(lfs); },
        [&] { return saved(lfs) == lfs_before && lfs.position() == 0; });
  const linattn::SoftmaxAttentionLayer<float> sfl(5, 2, 3, 2);
  auto sfs = sfl.make_state();
  const std::string sfs_before = saved(sfs);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, sfs); }, [&] { return saved(sfs); },
        [&] { return saved(sfs) == sfs_before && sfs.position() == 0 && sfs.capacity() == 0; });
  const linattn::SoftmaxAttentionLayer<double> sdl(4, 1, 2, 3);
  auto sds = sdl.make_state(8);
  const std::string sds_before = saved(sds);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, sds); }, [&] { return saved(sds); },
        [&] { return saved(sds) == sds_before && sds.position() == 0 && sds.capacity() == 8; });
  // Kind 9: a delta-rule layer's BatchedState in float (B from the file; H = 1 of D = F = 2,
  // M = 2; W = 3, C = 6).
  linattn::GatedDeltaNetConfig gc;
  gc.hidden_size = 4;
  gc.linear_num_key_heads = gc.linear_num_value_heads = 1;
  gc.linear_key_head_dim = gc.linear_value_head_dim = 2;
  gc.linear_conv_kernel_dim = 3;
  const linattn::GatedDeltaNetLayer<float> gdn(gc);
  auto gbs = gdn.make_batched_state(1);
  const std::string gbs_before = saved(gbs);
  check(bytes, [&](std::istream& is) { linattn::load_state(is, gbs); }, [&] { return saved(gbs); },
        [&] { return saved(gbs) == gbs_before && gbs.sequences() == 1; });
  return 0;
}
