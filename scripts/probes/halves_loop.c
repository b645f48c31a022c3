/* Instruction-level probe of the AVX-512 int4 halves kernel's inner loop (x86_avx512.c,
 * halves_tbl), in cycles per 16 weights of one row, everything in registers or L1.
 *
 *   gcc -O2 -mavx512f -mavx512vl scripts/probes/halves_loop.c -o /tmp/halves_loop && /tmp/halves_loop
 *
 * The clock comes from a chain of dependent integer adds (one cycle each on every x86-64 core).
 * Shapes, eight rows sharing one x vector as the kernel does:
 *   kernel   : per row, the chunk's 8 bytes broadcast from memory (vpbroadcastq), a variable
 *              shift (vpsrlvd), the 16-entry table lookup (vpermps), an fma with x
 *   no-bcast : the same without the broadcast (the shift reads a register)
 *   no-shift : broadcast, vpermps, fma
 *   no-perm  : broadcast, shift, fma
 *   imm-shift: no broadcast, a shift by an immediate (vpsrld), vpermps, fma -- what a layout
 *              whose 64-byte loads need no broadcast would run
 * and the single instructions' throughput (vpermps zmm, vpsrlvd zmm, fma zmm). */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 20000000L
static float buf[1024] __attribute__((aligned(64)));
#define CLOBBER "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", \
                "xmm22", "xmm23"
#define BODY8(ins) ins(0, 0) ins(1, 8) ins(2, 16) ins(3, 24) ins(4, 32) ins(5, 40) ins(6, 48) ins(7, 56)
#define SETUP "vpxord %%zmm20, %%zmm20, %%zmm20\n vpxord %%zmm21, %%zmm21, %%zmm21\n vpxord %%zmm22, %%zmm22, %%zmm22\n"
/* seconds per instance of `ins` (eight per iteration) */
#define PROBE(name, ins)                                                                            \
    static double name(void) {                                                                      \
        long n = N;                                                                                 \
        const float *p = buf;                                                                       \
        double t = now();                                                                           \
        __asm__ volatile(SETUP "1:\n vmovups 512(%1), %%zmm23\n" BODY8(ins) "dec %0\n jnz 1b\n"      \
                         : "+r"(n) : "r"(p) : CLOBBER);                                             \
        return (now() - t) / (N * 8.0);                                                             \
    }
#define BC(i, o) "vpbroadcastq " #o "(%1), %%zmm" #i "\n"
#define SH(i) "vpsrlvd %%zmm20, %%zmm" #i ", %%zmm" #i "\n"
#define PERM(i) "vpermps %%zmm21, %%zmm" #i ", %%zmm" #i "\n"
#define FMA(i) "vfmadd231ps %%zmm23, %%zmm" #i ", %%zmm1" #i "\n"
#define KERNEL(i, o) BC(i, o) SH(i) PERM(i) FMA(i)
#define NOBC(i, o) "vpsrlvd %%zmm20, %%zmm22, %%zmm" #i "\n" PERM(i) FMA(i)
#define NOSH(i, o) BC(i, o) PERM(i) FMA(i)
#define NOPERM(i, o) BC(i, o) SH(i) FMA(i)
#define IMM(i, o) "vpsrld $4, %%zmm22, %%zmm" #i "\n" PERM(i) FMA(i)
#define PERM_ONLY(i, o) "vpermps %%zmm21, %%zmm22, %%zmm" #i "\n"
#define SH_ONLY(i, o) "vpsrlvd %%zmm20, %%zmm22, %%zmm" #i "\n"
#define FMA_ONLY(i, o) "vfmadd231ps %%zmm21, %%zmm22, %%zmm" #i "\n"
PROBE(kernel, KERNEL)
PROBE(nobc, NOBC)
PROBE(nosh, NOSH)
PROBE(noperm, NOPERM)
PROBE(imm, IMM)
PROBE(perm_only, PERM_ONLY)
PROBE(sh_only, SH_ONLY)
PROBE(fma_only, FMA_ONLY)

static double clock_hz(void) {
    long n = 200000000L, a = 0;
    double t = now();
    __asm__ volatile("1:\n add $1, %1\n add $1, %1\n add $1, %1\n add $1, %1\n dec %0\n jnz 1b\n"
                     : "+r"(n), "+r"(a));
    return 4 * 200000000.0 / (now() - t);
}

int main(void) {
    const double hz = clock_hz();
    printf("clock %.2f GHz (dependent adds)\n", hz / 1e9);
    struct { const char *name; double (*f)(void); } shapes[] = {
        {"kernel", kernel}, {"no-bcast", nobc}, {"no-shift", nosh}, {"no-perm", noperm}, {"imm-shift", imm},
        {"vpermps zmm alone", perm_only}, {"vpsrlvd zmm alone", sh_only}, {"vfmadd zmm alone", fma_only}};
    for (unsigned i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        printf("%-18s %.2f cycles\n", shapes[i].name, shapes[i].f() * hz);
    return 0;
}
