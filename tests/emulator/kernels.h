// The kernels' own helper names, on ptx.h (included by cuda.h). A source built for the
// emulation sees GG_HOST_EMULATION (the grouped GEMM ladder: gemm_common.cuh, gemm_v4-v6) and
// QG_EMULATED_PTX (the quantized ladders: quant/common.cuh, wna16_common.cuh, the rungs'
// files; wgmma_operands.cuh takes either) and leaves out its inline PTX; these take its place,
// with the same names and semantics, so that everything else runs as written.
#pragma once
#define GG_HOST_EMULATION 1
#define QG_EMULATED_PTX 1

// ----------------------------------------------------------------------------- the GEMM ladder
// Shared addresses are byte offsets into the CTA's shared memory. On the GPU the static
// shared memory (the tile's slots) comes first and the dynamic buffer after it, 16-byte
// aligned only: here it starts 48 bytes in, so a kernel that needs a stricter alignment (v5's
// 1024-byte swizzle atoms) must find it itself, as on the GPU.
#define EMU_GG_STATIC_SMEM 48
#define GG_DYNAMIC_SMEM(name) unsigned char* name = emu_dynamic_smem(EMU_GG_STATIC_SMEM)
inline unsigned gg_smem_addr(const void* p) { return emu_smem_offset(p); }
inline void gg_cp_async16(unsigned dst, const void* src, int src_bytes) {
    emu_cp_async(emu_smem + dst, src, 16, src_bytes);
}
inline void gg_cp_async_commit() { emu_cp_async_commit(); }
template <int PENDING> inline void gg_cp_async_wait() { emu_cp_async_wait(PENDING); }
inline void gg_cp_async_wait_all() {
    emu_cp_async_commit();
    emu_cp_async_wait(0);
}
inline void gg_ldsm_x4(unsigned* r, unsigned addr) {
    emu_check_window(addr, 16, "ldmatrix");
    emu_ldmatrix_x4(r, emu_smem + addr);
}
inline void gg_mma(float* d, const unsigned* a, const unsigned* b, EmuElem e) {
    emu_mma(*reinterpret_cast<float(*)[4]>(d), *reinterpret_cast<const uint32_t(*)[4]>(a),
            *reinterpret_cast<const uint32_t(*)[2]>(b), e);
}
inline void gg_mma(float* d, const unsigned* a, const unsigned* b, __half*) { gg_mma(d, a, b, EMU_F16); }
inline void gg_mma(float* d, const unsigned* a, const unsigned* b, __nv_bfloat16*) {
    gg_mma(d, a, b, EMU_BF16);
}
template <typename T> constexpr EmuElem emu_elem_of();
template <> constexpr EmuElem emu_elem_of<__half>() { return EMU_F16; }
template <> constexpr EmuElem emu_elem_of<__nv_bfloat16>() { return EMU_BF16; }
#ifdef GG_T   // (templates: a ladder built for fp32 never instantiates them)
template <typename T = GG_T>
inline void gg_wgmma_n64(float* d, unsigned long long da, unsigned long long db) {
    emu_wgmma_issue(d, da, db, 64, emu_elem_of<T>());
}
template <typename T = GG_T>
inline void gg_wgmma_n128(float* d, unsigned long long da, unsigned long long db) {
    emu_wgmma_issue(d, da, db, 128, emu_elem_of<T>());
}
template <typename T = GG_T>
inline void gg_wgmma_n256(float* d, unsigned long long da, unsigned long long db) {
    emu_wgmma_issue(d, da, db, 256, emu_elem_of<T>());
}
#endif
// v6's ring: mbarrier.init starts the ring checks of ptx.h
inline void gg_mbar_init(unsigned bar, unsigned count) {
    emu_check_window(bar, 8, "mbarrier.init");
    emu_ring_start();
    emu_mbar_init(emu_smem + bar, count);
}
inline void gg_fence_mbar_init() {}
inline void gg_mbar_arrive(unsigned bar) { emu_mbar_arrive(emu_smem + bar); }
inline void gg_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    emu_mbar_arrive_expect_tx(emu_smem + bar, bytes);
}
inline void gg_mbar_wait(unsigned bar, unsigned parity) { emu_mbar_wait(emu_smem + bar, parity); }
inline void gg_cp_async_mbar_arrive(unsigned bar) { emu_cp_async_mbar_arrive(emu_smem + bar); }
inline void gg_tma_load_3d(unsigned dst, const void* map, int c0, int c1, int c2, unsigned bar) {
    emu_tma_load_3d(dst, map, c0, c1, c2, emu_smem + bar);
}
template <int R> inline void gg_setmaxnreg_dec() {}
template <int R> inline void gg_setmaxnreg_inc() {}
inline void gg_bar_named(int id, int count) { emu_bar_sync(id, count); }

// ----------------------------------------------------------------------------- the decode rungs
// experts_decode.cu: its weight load without L1 allocation (a cache hint: a plain load here)
inline uint4 ld_weights(const uint4* p) { return *p; }
// experts_decode_ring.cu (its mbarriers are the GEMM's gg_mbar_* above)
inline void dec_bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    emu_bulk_copy(dst, src, bytes, emu_smem + bar);
}
inline void dec_fence_proxy_async_global() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void dec_bar_sync(int id, int count) { emu_bar_sync(id, count); }
// ----------------------------------------------------------------------------- wgmma_operands.cuh
inline void wg_fence_proxy_async() { emu_fence_proxy_async(); }
inline void wg_fence() { emu_wgmma_fence(); }
inline void wg_commit() { emu_wgmma_commit(); }
template <int PENDING> inline void wg_wait() { emu_wgmma_wait(PENDING); }

// ----------------------------------------------------------------------------- the quantized ladders
// Shared addresses are pointers; the 16-bit element of a build is bf16 where ELEM_BF16 is
// defined to 1, fp16 otherwise (also where it is not defined: act.cu).
#if ELEM_BF16
#define QG_ELEM_H 0
#else
#define QG_ELEM_H 1
#endif
inline void qg_cp16(void* dst, const void* src, bool pred) { emu_cp_async(dst, src, 16, pred ? 16 : 0); }
inline void qg_cp4(void* dst, const void* src, bool pred) { emu_cp_async(dst, src, 4, pred ? 4 : 0); }
inline void qg_cp8(void* dst, const void* src) { emu_cp_async(dst, src, 8, 8); }
inline void qg_commit() { emu_cp_async_commit(); }
template <int N> inline void qg_wait() { emu_cp_async_wait(N); }
inline void qg_mma_k32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    emu_mma(d, a, b, EMU_E4M3);
}
inline void qg_mma_k32(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    emu_mma(d, a, b, EMU_S8);
}
template <bool H = QG_ELEM_H>
inline void qg_mma_k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    emu_mma(d, a, b, H ? EMU_F16 : EMU_BF16);
}
// wna16 v3: 16-byte register loads and the paired 16-bit subtraction of the decode
inline void qg_ld16(uint32_t (&r)[4], const void* p) { std::memcpy(r, p, 16); }
inline void qg_ld16_stream(uint32_t (&r)[4], const void* p) { std::memcpy(r, p, 16); }
inline uint32_t qg_sub2(uint32_t x, uint32_t y) {
    const EmuElem e = QG_ELEM_H ? EMU_F16 : EMU_BF16;
    auto enc = [&](float f) { return QG_ELEM_H ? (uint32_t)__float2half_rn(f).b
                                                : (uint32_t)__float2bfloat16_rn(f).b; };
    return enc(emu_decode(e, x & 0xffffu) - emu_decode(e, y & 0xffffu)) |
           (enc(emu_decode(e, x >> 16) - emu_decode(e, y >> 16)) << 16);
}
// wna16 v5's warp-specialized ring (mbarriers, named barrier 1) and the programmatic launch
inline void qg_mbar_init(const void* b, unsigned count) { emu_mbar_init(b, count); }
inline void qg_mbar_arrive(const void* b) { emu_mbar_arrive(b); }
inline void qg_mbar_arrive_on_copies(const void* b) { emu_cp_async_mbar_arrive(b); }
inline void qg_mbar_wait(const void* b, unsigned parity) { emu_mbar_wait(b, parity); }
inline void qg_bar_team(int n) { emu_bar_sync(1, n); }
inline void qg_grid_dependency_wait() { emu_grid_dependency_wait(); }

// w8a8 v4 (w8a8_v4_wgmma.cu): shared offsets, fp8 wgmma from two descriptors, run at once
inline unsigned fw_smem(const void* p) { return emu_smem_offset(p); }
inline void fw_cp16(unsigned dst, const void* src, bool pred) { qg_cp16(emu_smem + dst, src, pred); }
inline void fw_cp4(unsigned dst, const void* src, bool pred) { qg_cp4(emu_smem + dst, src, pred); }
inline void fw_wgmma_n64(float* d, unsigned long long da, unsigned long long db, int acc) {
    emu_wgmma_ss_now(d, da, db, 64, EMU_E4M3, acc != 0);
}
inline void fw_wgmma_n128(float* d, unsigned long long da, unsigned long long db, int acc) {
    emu_wgmma_ss_now(d, da, db, 128, EMU_E4M3, acc != 0);
}

// wna16 v6 (wna16_v6_wgmma.cu): A (the dequantized weights) from registers, run at once
inline unsigned ww_smem(const void* p) { return emu_smem_offset(p); }
template <int NN> struct WwMma {
    static void run(float (&d)[NN / 2], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                    unsigned long long desc, int acc) {
        const uint32_t a[4] = {a0, a1, a2, a3};
        emu_wgmma_rs_now(d, a, desc, NN, QG_ELEM_H ? EMU_F16 : EMU_BF16, acc != 0);
    }
};
