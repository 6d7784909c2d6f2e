// The PTX instructions the kernels write inline, on the CPU (included by cuda.h, which says
// how threads, warps and CTAs run). Each keeps the instruction's contract at its edge, so that
// a kernel relying on more than the hardware promises fails here:
//   cp.async          copies land only when a wait_group retires their group, or at a
//                     cp.async.mbarrier.arrive (the latest the hardware may); 16-byte copies
//                     are 16-byte aligned; a copy never waited for fails the CTA
//   griddepcontrol    a programmatic launch started while the grid before it still runs
//                     (emu_pdl_arm): its inputs read as 0xFF until the CTA's wait
//   ldmatrix.x4       each lane gathers its pieces of four 8x8 matrices from 32 row addresses
//   mma.sync          m16n8k16 (fp16 / bf16) and m16n8k32 (e4m3 / s8) from all 32 lanes'
//                     fragments, with the fragment layouts of the PTX ISA
//   wgmma             64 x N x K from shared-memory descriptors (K-major, no swizzle or
//                     32/64/128-byte swizzle) or A from the warpgroup's registers; deferred
//                     to the wgmma.wait_group that completes it, or run at once
//   mbarrier          arrival and transaction counts, phases, try_wait.parity
//   the tensor copy   cp.async.bulk.tensor.3d from an emulated CUtensorMap, 128-byte swizzle
//   the bulk copy     cp.async.bulk (global to shared, a multiple of 16 bytes)
//   bar.sync id, n    a barrier of n threads
// and the checker of the ring protocol (emu_ring_checks): every 16 bytes of shared memory
// that a copy writes and a wgmma reads carry the mbarrier phase its copy landed in, the wgmma
// reads not yet released, and the phase of that release. A wgmma must find every piece landed
// in a phase its thread waited for (and a cp.async piece behind a fence.proxy.async of that
// thread after the wait); a copy must find no unreleased read, and the release in a phase its
// thread waited for. Either missing wait (consumer on full, producer on empty) fails
// deterministically, whatever the threads' timing.
#pragma once

// ----------------------------------------------------------------------------- cp.async
struct EmuCopy { unsigned char* dst; const unsigned char* src; int n, src_bytes; };
thread_local std::vector<EmuCopy> emu_copies;                 // issued, not committed
thread_local std::deque<std::vector<EmuCopy>> emu_copy_groups;   // committed, not landed
// The global ranges a cp.async may read (none registered: anywhere), e.g. a GEMM's a and w
std::vector<std::pair<const unsigned char*, const unsigned char*>> emu_readable;
bool emu_ring_checks = false;

inline void emu_pdl_read(const void* src, int n);
inline void emu_ring_write(unsigned off, const char* who);
inline void emu_land(const EmuCopy& c) {
    std::memset(c.dst, 0, c.n);
    if (c.src_bytes) std::memcpy(c.dst, c.src, c.src_bytes);
}
// cp.async of n bytes (4, 8 or 16) from src to dst, reading src_bytes of them (0: zeros only)
inline void emu_cp_async(void* dst, const void* src, int n, int src_bytes) {
    const unsigned char* s = static_cast<const unsigned char*>(src);
    if ((uintptr_t)dst % n) emu_fail("cp.async: shared destination not aligned to its size", n);
    if (src_bytes != 0 && src_bytes != n) emu_fail("cp.async: src-size not 0 or cp-size", src_bytes);
    if (src_bytes) {
        if ((uintptr_t)s % n) emu_fail("cp.async: global source not aligned to its size", n);
        bool inside = emu_readable.empty();
        for (const auto& r : emu_readable) inside |= s >= r.first && s + n <= r.second;
        if (!inside) emu_fail("cp.async: reads outside the arrays it may read", (long long)(uintptr_t)s);
        emu_pdl_read(src, src_bytes);
    }
    unsigned char* d = static_cast<unsigned char*>(dst);
    if (d >= emu_smem && d < emu_smem + EMU_SMEM_BYTES) {   // (not a static __shared__ array)
        emu_check_window((unsigned)(d - emu_smem), n, "cp.async");
        if (emu_ring_checks) emu_ring_write((unsigned)(d - emu_smem), "cp.async");
    }
    emu_copies.push_back({static_cast<unsigned char*>(dst), s, n, src_bytes});
}
inline void emu_cp_async_commit() {
    emu_copy_groups.push_back(std::move(emu_copies));
    emu_copies.clear();
}
// cp.async.wait_group: the groups beyond the newest `pending` land
inline void emu_cp_async_wait(int pending) {
    if (!emu_copies.empty()) emu_fail("cp.async.wait_group with uncommitted copies", emu_copies.size());
    while ((int)emu_copy_groups.size() > pending) {
        for (const EmuCopy& c : emu_copy_groups.front()) emu_land(c);
        emu_copy_groups.pop_front();
    }
}

// ----------------------------------------------------------------------------- griddepcontrol
// A programmatic launch, armed for the next launch by emu_pdl_arm: the worst case of a grid
// started while the grid before it still runs. Until every thread of a CTA has reached
// griddepcontrol.wait (or exited), the ranges the earlier grid writes (`inputs`) hold 0xFF
// bytes (NaN in every float format; the real bytes come back at the wait) and a cp.async from
// them counts as an early read; the ranges this grid writes (`outputs`) must be as the CTA found
// them when its threads meet there. The emulated wait is a CTA-wide rendezvous (the hardware's
// is per thread): a rendezvous that does not fill within a minute opens anyway, counted as stuck.
struct EmuRange { unsigned char* p; size_t n; std::vector<unsigned char> kept; };
struct EmuPdl {
    bool armed = false, ignore_waits = false;   // ignore_waits: the checks' own test
    std::vector<EmuRange> inputs, outputs;
    std::mutex m;
    std::condition_variable cv;
    unsigned arrived = 0, exited = 0, threads = 0;
    bool open = true;
    int early_reads = 0, early_writes = 0, stuck = 0;
};
EmuPdl emu_pdl;
thread_local bool emu_dep_waited = false;
inline void emu_pdl_read(const void* src, int n) {
    if (!emu_pdl.armed || emu_dep_waited) return;
    const unsigned char* s = static_cast<const unsigned char*>(src);
    for (const EmuRange& r : emu_pdl.inputs)
        if (s < r.p + r.n && s + n > r.p) {
            std::lock_guard<std::mutex> l(emu_pdl.m);
            ++emu_pdl.early_reads;
            return;
        }
}
inline void emu_pdl_open() {                 // (under emu_pdl.m) the earlier grid is done
    for (const EmuRange& r : emu_pdl.outputs)
        if (std::memcmp(r.p, r.kept.data(), r.n) != 0) ++emu_pdl.early_writes;
    for (const EmuRange& r : emu_pdl.inputs) std::memcpy(r.p, r.kept.data(), r.n);
    emu_pdl.open = true;
    emu_pdl.cv.notify_all();
}
inline void emu_grid_dependency_wait() {
    if (!emu_pdl.armed || emu_dep_waited || emu_pdl.ignore_waits) return;
    std::unique_lock<std::mutex> l(emu_pdl.m);
    emu_dep_waited = true;
    if (++emu_pdl.arrived + emu_pdl.exited == emu_pdl.threads) {
        emu_pdl_open();
    } else if (!emu_pdl.cv.wait_for(l, std::chrono::seconds(60), [] { return emu_pdl.open; })) {
        ++emu_pdl.stuck;
        emu_pdl_open();
    }
}
extern "C" void emu_pdl_arm(int n_in, void** in, const size_t* in_bytes, int n_out, void** out,
                            const size_t* out_bytes, int ignore_waits) {
    emu_pdl.inputs.clear();
    emu_pdl.outputs.clear();
    for (int i = 0; i < n_in; ++i)
        emu_pdl.inputs.push_back({static_cast<unsigned char*>(in[i]), in_bytes[i], {}});
    for (int i = 0; i < n_out; ++i)
        emu_pdl.outputs.push_back({static_cast<unsigned char*>(out[i]), out_bytes[i], {}});
    emu_pdl.armed = true;
    emu_pdl.ignore_waits = ignore_waits != 0;
    emu_pdl.early_reads = emu_pdl.early_writes = emu_pdl.stuck = 0;
}
extern "C" void emu_pdl_counts(int* counts) {
    counts[0] = emu_pdl.early_reads;
    counts[1] = emu_pdl.early_writes;
    counts[2] = emu_pdl.stuck;
}

// ----------------------------------------------------------------------------- around a CTA
thread_local std::vector<unsigned> emu_read_done;   // chunks of completed, unreleased reads
struct EmuWgmma;
thread_local std::vector<EmuWgmma> emu_wg_open;
thread_local std::vector<std::vector<EmuWgmma>> emu_wg_groups;
inline void emu_cta_begin(unsigned threads) {      // before the CTA's threads start
    emu_pdl.arrived = emu_pdl.exited = 0;
    emu_pdl.threads = threads;
    emu_pdl.open = !emu_pdl.armed;
    if (!emu_pdl.armed) return;
    for (EmuRange& r : emu_pdl.inputs) {
        r.kept.assign(r.p, r.p + r.n);
        std::memset(r.p, 0xFF, r.n);
    }
    for (EmuRange& r : emu_pdl.outputs) r.kept.assign(r.p, r.p + r.n);
}
inline void emu_thread_end() {                     // a thread leaves the kernel
    if (!emu_copies.empty() || !emu_copy_groups.empty())
        emu_fail("a thread ended with cp.async copies never waited for",
                 emu_copies.size() + emu_copy_groups.size());
    if (!emu_wg_open.empty() || !emu_wg_groups.empty())
        emu_fail("a thread ended with wgmma batches never waited for", emu_wg_groups.size());
    if (!emu_read_done.empty())
        emu_fail("a thread ended with wgmma reads never released on a barrier", emu_read_done.size());
    if (emu_pdl.armed && !emu_dep_waited) {
        std::lock_guard<std::mutex> l(emu_pdl.m);
        if (++emu_pdl.exited + emu_pdl.arrived == emu_pdl.threads && !emu_pdl.open) emu_pdl_open();
    }
    emu_dep_waited = false;
}
inline void emu_launch_end() {                     // armed for one launch only
    emu_pdl.armed = emu_pdl.ignore_waits = false;
    emu_pdl.inputs.clear();
    emu_pdl.outputs.clear();
}

// ----------------------------------------------------------------------------- ldmatrix, mma
// ldmatrix.x4: lane l gives the address of row l % 8 of matrix l / 8 and gets row l / 4,
// columns 2 (l % 4), 2 (l % 4) + 1 of each matrix j in register j
inline void emu_ldmatrix_x4(unsigned* r, const unsigned char* row) {
    if ((uintptr_t)row % 16) emu_fail("ldmatrix: row address not 16-byte aligned", (long long)(uintptr_t)row);
    unsigned char all[32][EMU_LANE_BYTES];
    emu_warp_exchange(0xffffffffu, &row, sizeof(row), all);
    const int lane = emu_tid & 31;
    for (int j = 0; j < 4; ++j)
        std::memcpy(&r[j], emu_lane_value<const unsigned char*>(all, 8 * j + lane / 4) + (lane % 4) * 4, 4);
}

enum EmuElem { EMU_F16, EMU_BF16, EMU_E4M3, EMU_S8 };
inline float emu_decode(EmuElem e, unsigned bits) {
    switch (e) {
        case EMU_F16: return __half2float({(uint16_t)bits});
        case EMU_BF16: return __bfloat162float({(uint16_t)bits});
        case EMU_E4M3: return emu_e4m3_value(bits);
        default: return (float)(signed char)bits;
    }
}
inline int emu_elem_bytes(EmuElem e) { return e == EMU_F16 || e == EMU_BF16 ? 2 : 1; }

// mma.sync.m16n8kK (K = 32 bytes' worth: 16 16-bit or 32 8-bit elements), D += A B.
// A (16 x K, row) in a[0..3]: a[0] row g, a[1] row g + 8, a[2] / a[3] the same rows' second
// half of K; B (K x 8, col) in b[0..1]: column g, b[1] the second half of K; D: d[0], d[1] row
// g, columns 2t, 2t + 1, d[2], d[3] row g + 8 (g = lane / 4, t = lane % 4). Each register holds
// 4 / elem_bytes consecutive k, the lower k in the lower bits.
template <typename Acc>
inline void emu_mma(Acc (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], EmuElem e) {
    struct { uint32_t a[4], b[2]; } in;
    std::memcpy(in.a, a, 16);
    std::memcpy(in.b, b, 8);
    unsigned char all[32][EMU_LANE_BYTES];
    emu_warp_exchange(0xffffffffu, &in, sizeof(in), all);
    const int eb = emu_elem_bytes(e), per = 4 / eb, K = 32 / eb, half = K / 2;
    auto bits = [&](uint32_t reg, int k) { return (reg >> (8 * eb * (k % per))) & ((1u << (8 * eb)) - 1); };
    auto A = [&](int row, int k) {
        decltype(in) x;
        std::memcpy(&x, all[(row % 8) * 4 + (k % half) / per], sizeof(x));
        return emu_decode(e, bits(x.a[(row >= 8) + 2 * (k >= half)], k));
    };
    auto B = [&](int k, int col) {
        decltype(in) x;
        std::memcpy(&x, all[col * 4 + (k % half) / per], sizeof(x));
        return emu_decode(e, bits(x.b[k >= half], k));
    };
    const int g = (emu_tid & 31) >> 2, t = emu_tid & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        Acc s = 0;
        for (int k = 0; k < K; ++k) s += (Acc)A(row, k) * (Acc)B(k, col);
        d[i] += s;
    }
}

// ----------------------------------------------------------------------------- mbarrier
// A pending count and a transaction count; a phase completes when both are zero, and a
// try_wait.parity(p) returns once the phase of parity p is over (the current phase's parity
// differs from p). The ring checker's state lives beside them, under the same lock.
struct EmuMbar { long gen = 0; int expected = 0, pending = 0; long long tx = 0; long phase = 0; };
struct EmuSeen { long gen = -1, phase = 0, seq = 0; };   // a thread's view of one mbarrier
struct EmuChunk {
    int state = 0;                 // 0 never written, 1 a copy in flight, 2 landed
    const void* bar = nullptr; long gen = 0, phase = 0; bool generic = false;   // the landing
    int readers = 0;               // wgmma reads issued and not yet released
    bool rel = false; const void* rel_bar = nullptr; long rel_gen = 0, rel_phase = 0;
};
std::mutex emu_mb_m;
std::condition_variable emu_mb_cv;
std::unordered_map<const void*, EmuMbar> emu_mbars;
long emu_mb_gen = 0;
std::vector<EmuChunk> emu_chunks(EMU_SMEM_BYTES / 16);
thread_local std::unordered_map<const void*, EmuSeen> emu_seen;
thread_local long emu_seq = 0, emu_fence_seq = -1;

inline EmuMbar& emu_mbar(const void* bar) {          // (under emu_mb_m)
    auto it = emu_mbars.find(bar);
    if (it == emu_mbars.end()) emu_fail("mbarrier used before mbarrier.init", (long long)(uintptr_t)bar);
    return it->second;
}
inline bool emu_seen_past(const void* bar, long gen, long phase) {   // waited past `phase`?
    auto it = emu_seen.find(bar);
    return it != emu_seen.end() && it->second.gen == gen && it->second.phase > phase;
}
inline void emu_ring_write(unsigned off, const char* who) {   // a copy starts writing `off`
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuChunk& c = emu_chunks[off / 16];
    if (c.readers > 0) {
        std::fprintf(stderr, "EMULATOR: %s overwrites shared memory that an issued wgmma has "
                     "not released (a missing wait on the empty barrier?)\n", who);
        emu_fail("write while read", off);
    }
    if (c.rel && !emu_seen_past(c.rel_bar, c.rel_gen, c.rel_phase)) {
        std::fprintf(stderr, "EMULATOR: %s overwrites shared memory released in an empty-barrier "
                     "phase this thread has not waited for\n", who);
        emu_fail("write before the release is observed", off);
    }
    c.state = 1;
}
inline void emu_ring_land(unsigned off, const void* bar, const EmuMbar& m, bool generic) {
    EmuChunk& c = emu_chunks[off / 16];
    c.state = 2; c.bar = bar; c.gen = m.gen; c.phase = m.phase; c.generic = generic;
}
inline void emu_mbar_complete(EmuMbar& m) {          // (under emu_mb_m)
    if (m.pending == 0 && m.tx == 0) {
        ++m.phase;
        m.pending = m.expected;
        emu_mb_cv.notify_all();
    }
}
inline void emu_mbar_arrive_locked(const void* bar, EmuMbar& m) {
    if (m.pending <= 0) emu_fail("mbarrier: arrival with no pending count", (long long)(uintptr_t)bar);
    --m.pending;
    emu_mbar_complete(m);
}
// the ring of a new CTA: nothing landed or read; the checks run from here on
inline void emu_ring_start() {
    std::lock_guard<std::mutex> l(emu_mb_m);
    for (EmuChunk& c : emu_chunks) c = EmuChunk{};
    emu_ring_checks = true;
}
inline void emu_mbar_init(const void* bar, unsigned count) {
    std::lock_guard<std::mutex> l(emu_mb_m);
    if ((uintptr_t)bar % 8) emu_fail("mbarrier.init: not 8-byte aligned", (long long)(uintptr_t)bar);
    EmuMbar& m = emu_mbars[bar];
    m.gen = ++emu_mb_gen;
    m.expected = m.pending = (int)count;
    m.tx = 0;
    m.phase = 0;
}
// mbarrier.arrive: this thread's completed wgmma reads are released in the current phase
inline void emu_mbar_arrive(const void* bar) {
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    for (unsigned ci : emu_read_done) {
        EmuChunk& c = emu_chunks[ci];
        --c.readers;
        c.rel = true; c.rel_bar = bar; c.rel_gen = m.gen; c.rel_phase = m.phase;
    }
    emu_read_done.clear();
    emu_mbar_arrive_locked(bar, m);
}
inline void emu_mbar_arrive_expect_tx(const void* bar, unsigned bytes) {
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    m.tx += bytes;
    emu_mbar_arrive_locked(bar, m);
}
inline void emu_mbar_wait(const void* bar, unsigned parity) {
    std::unique_lock<std::mutex> l(emu_mb_m);
    EmuMbar* m = &emu_mbar(bar);
    if (!emu_mb_cv.wait_for(l, std::chrono::seconds(EMU_WAIT_S),
                            [&] { return (unsigned)(m->phase & 1) != (parity & 1u); })) {
        std::fprintf(stderr, "EMULATOR: waiting for parity %u of an mbarrier: %ld phases "
                     "completed, %d arrivals and %lld bytes pending\n", parity, m->phase,
                     m->pending, m->tx);
        emu_fail("mbarrier.try_wait: no phase completed in time (a deadlock)");
    }
    EmuSeen& s = emu_seen[bar];
    if (s.gen != m->gen) s = EmuSeen{m->gen, 0, 0};
    s.phase = std::max(s.phase, m->phase);
    s.seq = ++emu_seq;
}
// cp.async.mbarrier.arrive.noinc: this thread's copies land (now: as early as allowed once
// they were issued, so a missing wait cannot hide behind a late copy), then its arrival counts
inline void emu_cp_async_mbar_arrive(const void* bar) {
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    emu_copy_groups.push_back(std::move(emu_copies));
    emu_copies.clear();
    for (const auto& g : emu_copy_groups)
        for (const EmuCopy& c : g) {
            emu_land(c);
            if (emu_ring_checks) emu_ring_land(emu_smem_offset(c.dst), bar, m, true);
        }
    emu_copy_groups.clear();
    emu_mbar_arrive_locked(bar, m);
}
inline void emu_fence_proxy_async() { emu_fence_seq = ++emu_seq; }

// bar.sync id, count: one std::barrier per (CTA, id, count), reused by a later CTA at the
// same address (the CTAs of a cooperative launch run at once: each has its own)
inline void emu_bar_sync(int id, int count) {
    static std::mutex mu;
    static std::map<std::pair<const void*, long>, std::barrier<>*> bars;
    std::barrier<>* b;
    {
        std::lock_guard<std::mutex> l(mu);
        auto& slot = bars[{emu_cta, (long)id << 20 | count}];
        if (!slot) slot = new std::barrier<>(count);
        b = slot;
    }
    b->arrive_and_wait();
}

// ----------------------------------------------------------------------------- the bulk copy
// cp.async.bulk.shared::cluster.global: `bytes` (a multiple of 16) from global src to shared
// offset dst, both 16-byte aligned, landed at once and counted down on bar's transactions
inline void emu_bulk_copy(unsigned dst, const void* src, unsigned bytes, const void* bar) {
    if (bytes == 0 || bytes % 16) emu_fail("bulk copy: a size not a multiple of 16 > 0", bytes);
    if (dst % 16 || (uintptr_t)src % 16) emu_fail("bulk copy: an address not 16-byte aligned", dst);
    emu_check_window(dst, bytes, "the bulk copy");
    bool inside = emu_readable.empty();
    const unsigned char* s = static_cast<const unsigned char*>(src);
    for (const auto& r : emu_readable) inside |= s >= r.first && s + bytes <= r.second;
    if (!inside) emu_fail("bulk copy: reads outside the arrays it may read",
                          (long long)(uintptr_t)s);
    std::memcpy(emu_smem + dst, src, bytes);
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    m.tx -= bytes;
    emu_mbar_complete(m);
}

// ----------------------------------------------------------------------------- wgmma
// A K-major operand through its shared-memory matrix descriptor (the PTX ISA's): element
// (r, k) of a 16-byte core-matrix row of `eb`-byte elements at
//   no swizzle (type 0):  start + (r/8) SBO + (k / (16/eb)) LBO + (r%8) 16 + (k % (16/eb)) eb;
//   swizzle W = 128/64/32 bytes (type 1/2/3): rows of W bytes, A = start + (r/8) SBO + (r%8) W
//     + k eb, then bits [4, 4 + log2(W/16)) of A XORed with bits [7, ...) of A (absolute
//     addresses: the atoms must be 1024-byte aligned, base offset 0); one K slice of 32 bytes
//     stays inside one W-byte row.
inline unsigned emu_desc_offset(unsigned long long desc, int r, int k, int eb) {
    const int type = (int)(desc >> 62);
    if (((desc >> 49) & 7) != 0) emu_fail("wgmma: base offset != 0 is not emulated");
    if (((desc >> 46) & 7) != 0 || ((desc >> 52) & 0x3FF) != 0 || ((desc >> 14) & 3) != 0 ||
        ((desc >> 30) & 3) != 0)
        emu_fail("wgmma: reserved descriptor bits set", (long long)(desc >> 32));
    const unsigned start = (unsigned)(desc & 0x3FFF) << 4;
    const unsigned lbo = (unsigned)((desc >> 16) & 0x3FFF) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    const int per = 16 / eb;
    unsigned off;
    if (type == 0) {
        off = start + (r / 8) * sbo + (k / per) * lbo + (r % 8) * 16 + (k % per) * eb;
    } else {
        const unsigned W = type == 1 ? 128u : (type == 2 ? 64u : 32u);
        if (sbo != 8 * W) emu_fail("wgmma: swizzled K-major tile with SBO != 8 rows", sbo);
        if ((start % W) + 32 > W) emu_fail("wgmma: a K slice not inside one swizzled row", start);
        const unsigned A = start + (r / 8) * sbo + (r % 8) * W + k * eb;
        off = A ^ (((A >> 7) & (W / 16 - 1)) << 4);
    }
    if (start % 16) emu_fail("wgmma: descriptor start not 16-byte aligned", start);
    emu_check_window(off, eb, "a wgmma operand");
    return off;
}
inline float emu_desc_value(unsigned long long desc, int r, int k, EmuElem e) {
    const int eb = emu_elem_bytes(e);
    unsigned bits = 0;
    std::memcpy(&bits, emu_smem + emu_desc_offset(desc, r, k, eb), eb);
    return emu_decode(e, bits);
}
// The accumulator fragment of wgmma.m64nNk*: thread t of the warpgroup holds d[4j + i] =
// D(16 (t/32) + (t%32)/4 + 8 (i/2), 8j + 2 (t%4) + i%2).
template <typename Fa, typename Fb>
inline void emu_wgmma_tile(float* d, int n, int K, bool accumulate, Fa a, Fb b) {
    const int t = emu_tid % 128, wq = t / 32, lane = t % 32;
    for (int j = 0; j < n / 8; ++j)
        for (int i = 0; i < 4; ++i) {
            const int row = 16 * wq + lane / 4 + 8 * (i / 2), col = 8 * j + 2 * (lane % 4) + (i % 2);
            float s = 0.0f;
            for (int k = 0; k < K; ++k) s += a(row, k) * b(col, k);
            d[4 * j + i] = (accumulate ? d[4 * j + i] : 0.0f) + s;
        }
}

// Deferred wgmma (both operands in shared memory): issued into the open batch, run by the
// wgmma.wait_group that completes its batch (as late as the hardware may read the operands).
// Under the ring checks lane 0 of each warp checks the warpgroup's reads at issue.
struct EmuWgmma { float* d; unsigned long long da, db; int n; EmuElem e; std::vector<unsigned> chunks; };
inline void emu_wgmma_run(const EmuWgmma& m) {
    const int K = 32 / emu_elem_bytes(m.e);
    emu_wgmma_tile(m.d, m.n, K, true, [&](int r, int k) { return emu_desc_value(m.da, r, k, m.e); },
                   [&](int c, int k) { return emu_desc_value(m.db, c, k, m.e); });
    emu_read_done.insert(emu_read_done.end(), m.chunks.begin(), m.chunks.end());
}
inline void emu_ring_reads(EmuWgmma& m) {            // the 16-byte pieces it reads, checked
    const int eb = emu_elem_bytes(m.e), K = 32 / eb, per = 16 / eb;
    for (int r = 0; r < 64; ++r)
        for (int k = 0; k < K; k += per) m.chunks.push_back(emu_desc_offset(m.da, r, k, eb) / 16);
    for (int r = 0; r < m.n; ++r)
        for (int k = 0; k < K; k += per) m.chunks.push_back(emu_desc_offset(m.db, r, k, eb) / 16);
    std::sort(m.chunks.begin(), m.chunks.end());
    m.chunks.erase(std::unique(m.chunks.begin(), m.chunks.end()), m.chunks.end());
    std::lock_guard<std::mutex> l(emu_mb_m);
    for (unsigned ci : m.chunks) {
        EmuChunk& c = emu_chunks[ci];
        if (c.state != 2)
            emu_fail("wgmma reads shared memory no copy has landed in (a missing wait on the "
                     "full barrier?)", ci * 16);
        if (!emu_seen_past(c.bar, c.gen, c.phase))
            emu_fail("wgmma reads a copy whose full-barrier phase this thread has not waited "
                     "for", ci * 16);
        if (c.generic && emu_fence_seq < emu_seen[c.bar].seq)
            emu_fail("wgmma reads cp.async data with no fence.proxy.async after the wait", ci * 16);
        ++c.readers;
    }
}
inline void emu_wgmma_issue(float* d, unsigned long long da, unsigned long long db, int n, EmuElem e) {
    EmuWgmma m{d, da, db, n, e, {}};
    if (emu_ring_checks && emu_tid % 32 == 0) emu_ring_reads(m);
    emu_wg_open.push_back(std::move(m));
}
// wgmma.fence / commit_group / wait_group are .sync.aligned: the warp's lanes execute them
// together; a wait returns once every lane's share of the batches it completes has run
inline void emu_wgmma_fence() { __syncwarp(); }
inline void emu_wgmma_commit() {
    emu_wg_groups.push_back(std::move(emu_wg_open));
    emu_wg_open.clear();
}
inline void emu_wgmma_wait(int pending) {
    __syncwarp();
    if (!emu_wg_open.empty()) emu_fail("wgmma.wait_group with uncommitted wgmma");
    while ((int)emu_wg_groups.size() > pending) {
        for (const EmuWgmma& m : emu_wg_groups.front()) emu_wgmma_run(m);
        emu_wg_groups.erase(emu_wg_groups.begin());
    }
    __syncwarp();
}
// wgmma run at once, both operands through descriptors (scale-d: accumulate or overwrite)
inline void emu_wgmma_ss_now(float* d, unsigned long long da, unsigned long long db, int n,
                             EmuElem e, bool accumulate) {
    emu_wgmma_tile(d, n, 32 / emu_elem_bytes(e), accumulate,
                   [&](int r, int k) { return emu_desc_value(da, r, k, e); },
                   [&](int c, int k) { return emu_desc_value(db, c, k, e); });
}
// wgmma run at once, A (64 x 16, 16-bit) from the warpgroup's registers in mma.sync's A
// layout (thread t's a[0..3] hold the rows of warp t/32), B through its descriptor. Every
// thread of the CTA calls it together (its fragments meet at two CTA barriers).
inline void emu_wgmma_rs_now(float* d, const uint32_t (&a)[4], unsigned long long db, int n,
                             EmuElem e, bool accumulate) {
    uint32_t* regs = emu_cta->regs.data();
    const int wg0 = emu_tid / 128 * 128;
    std::memcpy(regs + 4 * emu_tid, a, 16);
    __syncthreads();                       // the warpgroup's fragments are in
    auto A = [&](int row, int k) {
        const int r = row % 16, lane = 4 * (r % 8) + (k % 8) / 2;
        const uint32_t v = regs[4 * (wg0 + 32 * (row / 16) + lane) + (r >= 8) + 2 * (k >= 8)];
        return emu_decode(e, (k & 1) ? v >> 16 : v & 0xFFFFu);
    };
    emu_wgmma_tile(d, n, 16, accumulate, A, [&](int c, int k) { return emu_desc_value(db, c, k, e); });
    __syncthreads();                       // read before the next wgmma writes the table
}

// ----------------------------------------------------------------------------- the tensor copy
// cp.async.bulk.tensor.3d with an emulated CUtensorMap (words, as the launcher's
// v6_tensor_map_fields): [0] the global base, [1..3] dims (innermost first), [4..5] the strides
// of dims 1 and 2 in bytes, [6..8] the box, [9] element bytes, [10] swizzle bytes (128: 16-byte
// chunk bits [4, 7) XORed with address bits [7, 10), the destination 1024-byte aligned), [11]
// a magic word. Out-of-bounds elements are zeros; the box's bytes count down the barrier's
// transactions (all of them, filled or not, as on the hardware).
#define EMU_TMAP_MAGIC 0x7E45A0C0FFEEull
inline void emu_tma_load_3d(unsigned dst, const void* map, int c0, int c1, int c2, const void* bar) {
    const unsigned long long* v = static_cast<const unsigned long long*>(map);
    if (v[11] != EMU_TMAP_MAGIC) emu_fail("tensor copy: not an emulated tensor map");
    const unsigned char* base = reinterpret_cast<const unsigned char*>(v[0]);
    const long long dim[3] = {(long long)v[1], (long long)v[2], (long long)v[3]};
    const long long stride[3] = {0, (long long)v[4], (long long)v[5]};   // (dim 0: elements)
    const int box[3] = {(int)v[6], (int)v[7], (int)v[8]};
    const int elem = (int)v[9], sw = (int)v[10];
    const long long row_bytes = (long long)box[0] * elem;
    if (sw != 128 || row_bytes > sw || row_bytes % 16)
        emu_fail("tensor copy: the box's inner extent must be a multiple of 16 bytes <= the "
                 "128-byte swizzle", row_bytes);
    if (dst % 1024) emu_fail("tensor copy: 128-byte swizzle needs a 1024-byte aligned box", dst);
    const long long bytes = row_bytes * box[1] * box[2];
    emu_check_window(dst, (unsigned)bytes, "the tensor copy's box");
    for (long long o = 0; o < bytes; o += 16)
        if (emu_ring_checks) emu_ring_write(dst + (unsigned)o, "the tensor copy");
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    for (int z = 0; z < box[2]; ++z)
        for (int y = 0; y < box[1]; ++y)
            for (long long x = 0; x < row_bytes; x += 16) {
                const unsigned lin = (unsigned)(((long long)z * box[1] + y) * row_bytes + x);
                const unsigned o = dst + (lin ^ (((lin >> 7) & 7) << 4));
                for (int b = 0; b < 16; b += elem) {
                    const long long i0 = c0 + (x + b) / elem, i1 = c1 + y, i2 = c2 + z;
                    unsigned char* d = emu_smem + o + b;
                    if (i0 < 0 || i0 >= dim[0] || i1 < 0 || i1 >= dim[1] || i2 < 0 || i2 >= dim[2])
                        std::memset(d, 0, elem);
                    else
                        std::memcpy(d, base + i0 * elem + i1 * stride[1] + i2 * stride[2], elem);
                }
                if (emu_ring_checks) emu_ring_land(o, bar, m, false);
            }
    m.tx -= bytes;
    emu_mbar_complete(m);
}
