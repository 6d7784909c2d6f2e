// The launcher of one grouped-GEMM kernel of the ladder (cuda_kernels/cupy/gemm_v*.cu) on the
// emulator, as a program: tests/cupy/test_gemm_emulated.py builds it after the kernel's source
// (GG_KERNEL_NAME: the kernel; GG_EMU_EXTRA_ARGS: what it takes after GG_KERNEL_ARGS).
//
// argv[1] = input file: 32 int64 header words, then a, w, sorted_token_ids, expert_ids,
// num_tokens_post_padded, topk_weights, bias, c, then up to two extra arrays; argv[2] = output
// file: c, then the extra arrays, as the kernel left them. Header: N, Kd, P, top_k, B, L, mul,
// bias_kind, grid x, grid y, block x, block y, dynamic shared memory bytes, the byte sizes of
// the 8 arrays, grid z, the CTA order (0: x fastest; else a shuffle seeded by it), the number
// of extra arrays, their byte sizes, two extra ints.
// c and the extra arrays get 4 KiB of 0xAB canaries on both sides: a write outside them fails.
unsigned char* emu_x[2];
int emu_xi[2];
#ifndef GG_EMU_EXTRA_ARGS
#define GG_EMU_EXTRA_ARGS
#endif
#ifdef GG_KERNEL_TAKES_TMAP
// v6's CUtensorMap, emulated: w's base address, then the words of the launcher's
// v6_tensor_map_fields (the first extra array), then ptx.h's magic word
GgTmap emu_tmap() {
    GgTmap m{};
    m.words[0] = (unsigned long long)(uintptr_t)emu_readable[1].first;
    std::memcpy(&m.words[1], emu_x[0], 10 * 8);
    m.words[11] = EMU_TMAP_MAGIC;
    return m;
}
#endif
int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* f = std::fopen(argv[1], "rb");
    long long h[32];
    if (std::fread(h, 8, 32, f) != 32) return 2;
    const int N = h[0], Kd = h[1], P = h[2], top_k = h[3], B = h[4], L = h[5], mul = h[6],
              bias_kind = h[7], gx = h[8], gy = h[9], bx = h[10], by = h[11];
    const long long* nbytes = h + 13;
    std::vector<std::vector<unsigned char>> buf(7);
    for (int i = 0; i < 7; ++i) {
        buf[i].resize(nbytes[i] + 16);
        if (nbytes[i] && std::fread(buf[i].data(), 1, nbytes[i], f) != (size_t)nbytes[i]) return 2;
    }
    for (int i = 0; i < 2; ++i)   // a and w: what the kernel's copies may read
        emu_readable.push_back({buf[i].data(), buf[i].data() + nbytes[i]});
    const size_t cbytes = nbytes[7], guard = 4096;
    std::vector<unsigned char> cbuf(cbytes + 2 * guard, 0xAB);
    unsigned char* c = cbuf.data() + guard;
    if (cbytes && std::fread(c, 1, cbytes, f) != cbytes) return 2;   // the caller's c (poisoned)
    const int gz = h[21] > 0 ? (int)h[21] : 1, n_extra = (int)h[23];
    std::vector<std::vector<unsigned char>> xbuf(2);
    for (int i = 0; i < 2; ++i) {
        xbuf[i].assign((i < n_extra ? h[24 + i] : 16) + 2 * guard, 0xAB);
        emu_x[i] = xbuf[i].data() + guard;
        if (i < n_extra && h[24 + i] && std::fread(emu_x[i], 1, h[24 + i], f) != (size_t)h[24 + i])
            return 2;
        emu_xi[i] = (int)h[26 + i];
    }
    std::fclose(f);
    emu_window_lo = EMU_GG_STATIC_SMEM;                 // the dynamic buffer, as launched
    emu_window_hi = EMU_GG_STATIC_SMEM + (unsigned)h[12];
    emu_set_block_order(h[22] ? (unsigned)h[22] : 0);
    launch(dim3(gx, gy, gz), dim3(bx, by), h[12], [&] {
        GG_KERNEL_NAME((const GG_T*)buf[0].data(), (const GG_T*)buf[1].data(), (GG_T*)c,
                       (const int*)buf[2].data(), (const int*)buf[3].data(),
                       (const int*)buf[4].data(), (const float*)buf[5].data(),
                       (const void*)buf[6].data(), N, Kd, P, top_k, B, L, mul,
                       bias_kind GG_EMU_EXTRA_ARGS);
    });
    for (size_t i = 0; i < guard; ++i)
        if (cbuf[i] != 0xAB || cbuf[guard + cbytes + i] != 0xAB) {
            std::fprintf(stderr, "EMULATOR: write outside c\n");
            return 4;
        }
    for (int x = 0; x < n_extra; ++x)
        for (size_t i = 0; i < guard; ++i)
            if (xbuf[x][i] != 0xAB || xbuf[x][guard + h[24 + x] + i] != 0xAB) {
                std::fprintf(stderr, "EMULATOR: write outside extra array %d\n", x);
                return 4;
            }
    FILE* o = std::fopen(argv[2], "wb");
    std::fwrite(c, 1, cbytes, o);
    for (int x = 0; x < n_extra; ++x) std::fwrite(emu_x[x], 1, h[24 + x], o);
    std::fclose(o);
    return 0;
}
