/* csrc/amx.h: the AMX paths' run-time side: may this CPU and OS run tiles (CPUID, XCR0, the
 * Linux permission), the target attribute of the tile bodies, the per-call tile
 * configuration and its release by the pool (pool.h), and the token count from which the
 * tile bodies run (below it the avx512vnni bodies do).
 *
 * amx is usable when CPUID.(7,0):EDX reports AMX-TILE (bit 24), AMX-INT8 (25) and AMX-BF16
 * (22), XCR0 enables XTILECFG and XTILEDATA (bits 17, 18), arch_prctl(ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA) grants this process the tile data, and the self-check
 * (colibri_amx_selfcheck, igemm_amx.h: the real tile bodies against their emulation) gives
 * the same bits; colibri_amx_why says which of these failed. amx-emu needs only avx512vnni.
 */
#ifndef COLIBRI_AMX_H
#define COLIBRI_AMX_H

#include <stdio.h>
#include "types.h"
#include "vnni.h"
#include "amx_tiles.h"
#if COLIBRI_AMX && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if COLIBRI_AMX
#define COLIBRI_AMX_TARGET COLIBRI_AVX512VNNI_TARGET ",amx-tile,amx-int8,amx-bf16"
#define COLIBRI_AMX_FN static __attribute__((target(COLIBRI_AMX_TARGET)))
#endif

static int colibri_amx_min_tokens = 16;      /* tokens from which the tile bodies run */
static const char *colibri_amx_why = "not checked yet";

#if COLIBRI_AMX
__attribute__((target("amx-tile"))) static void colibri_amx_release(void) { _tile_release(); }

/* LDTILECFG at every call: another library on this thread may have loaded its own. */
#define colibri_amx_config(cfg, id)                                                          \
    do {                                                                                    \
        _tile_loadconfig(cfg);                                                              \
        colibri_tiles_release = colibri_amx_release;                                        \
        colibri_tls_tiles = (id);                                                           \
    } while (0)
#endif

static int colibri_amx_state = -1;          /* amx: -1 not checked yet, 0 refused, 1 usable */
static int colibri_amx_warned = 0;

/* The outcome of a self-check (same: 1 when the bits agreed): a mismatch disables amx for
 * the process, with one warning line on stderr (the first time only). */
static int colibri_amx_verdict(int same)
{
    if (same) return 1;
    colibri_amx_state = 0;
    colibri_amx_why = "the self-check against the emulation failed";
    if (!colibri_amx_warned) {
        colibri_amx_warned = 1;
        fprintf(stderr, "colibri: AMX disabled: the tile bodies' self-check against their "
                        "emulation gave other bits; using avx512vnni\n");
    }
    return 0;
}

#if COLIBRI_AMX
static int colibri_amx_selfcheck(void);      /* igemm_amx.h */
#endif

/* 1 when the CPU, the OS and the kernel's permission let this process run tiles. */
static int colibri_amx_os_ready(void)
{
#if COLIBRI_AMX
    unsigned int a, b, c, d, lo, hi;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) { colibri_amx_why = "no CPUID leaf 7"; return 0; }
    if (!((d >> 24) & 1) || !((d >> 25) & 1) || !((d >> 22) & 1)) {
        colibri_amx_why = "CPUID reports no AMX-TILE / AMX-INT8 / AMX-BF16";
        return 0;
    }
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) {
        colibri_amx_why = "the OS does not enable XSAVE (CPUID.1:ECX.OSXSAVE)";
        return 0;
    }
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) {
        colibri_amx_why = "XCR0 does not enable the tile state (bits 17, 18)";
        return 0;
    }
#if defined(__linux__)
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        colibri_amx_why = "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) refused";
        return 0;
    }
#endif
    (void)hi;
    return 1;
#else
    colibri_amx_why = "built without the AMX bodies (compiler or target)";
    return 0;
#endif
}

/* isa: amx or amx-emu; avx512vnni_ok: this CPU runs the avx512vnni path (the bodies' base). */
static int colibri_amx_usable(int isa, int avx512vnni_ok)
{
    if (!avx512vnni_ok) return 0;
    if (isa == COLIBRI_ISA_AMX_EMU) return 1;
    if (colibri_amx_state < 0) {
        colibri_amx_state = colibri_amx_os_ready();
#if COLIBRI_AMX
        if (colibri_amx_state) colibri_amx_state = colibri_amx_verdict(colibri_amx_selfcheck());
#endif
        if (colibri_amx_state) colibri_amx_why = "usable";
    }
    return colibri_amx_state;
}

#endif /* COLIBRI_AMX_H */
