//! [`FusedLinear`](crate::FusedLinear)'s bf16 CPU product on Intel AMX tiles (Sapphire Rapids and
//! later: `amx-tile` + `amx-bf16`), where the AVX tiles of [`crate::packed_cpu`] would widen
//! every weight to f32 and multiply in f32 lanes.
//!
//! Why: on the H200 machine's 16-core Xeon (AMX), timm's DeiT in PyTorch, whose bf16 `Linear`
//! runs oneDNN's AMX kernels, took a DeiT-S batch-8 bf16 forward in about half our time while
//! our f32 forward beat its f32 one by 1.2–1.6× (docs/BENCHMARKS.md, the CPU section, stop 68).
//! One `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32 sums:
//! 8,192 multiply-adds an instruction against AVX-512's 16.
//!
//! How: a bf16 weight is packed once, when the layer is made, into panels of 16 columns of `Wᵀ`
//! with K padded to a multiple of 32 by zeros and each pair of terms side by side (the layout
//! `tdpbf16ps` reads its second operand in: row `i / 2` of a panel holds, for each of its 16
//! columns, terms `i` and `i + 1`), so a panel's 32-term block is one 1 KB tile load. A task
//! rounds its rows of x to bf16 (exact for a bf16 model's activations, which are bf16 values
//! widened) into a buffer padded by zero rows and terms, then for each pair of panels and each
//! pair of 16-row tiles keeps four 16 × 16 f32 accumulator tiles over all of K, stores them,
//! copies the valid rows and columns out and applies the finish (bias, residual, GELU) as the
//! AVX path does. Each product of two bf16 values is exact in f32; the hardware adds them into
//! the f32 accumulator pair by pair, with denormals flushed, so a value can differ from the AVX
//! path's ordered chain by the rounding of the additions (the tests bound it; bit equality is
//! counted where AMX runs).

use std::sync::OnceLock;

use half::bf16;
use half::slice::HalfFloatSliceExt;

// A panel's 16 columns (the AVX panels' width, which the tasks split by) are one accumulator
// tile's 16 f32 a row.
use crate::packed_cpu::{Task, COLS};

/// Terms of K a tile step: a 16 × 32 bf16 tile of x, 64 bytes a row.
const STEP: usize = 32;

/// Rows of x a tile covers.
pub(crate) const TILE_ROWS: usize = 16;

/// Rows a full step of the task covers: two row tiles (four accumulators with two panels).
pub(crate) const ROWS: usize = 2 * TILE_ROWS;

/// Whether bf16 weights are packed for AMX tiles: the CPU has AMX-TILE and AMX-BF16, Linux lets
/// this process use the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once), and
/// `CANDLE_FASTPATH_CPU_AMX` is not `0` (read once; then bf16 takes the AVX tiles, as on CPUs
/// without AMX).
pub(crate) fn available() -> bool {
    static AMX: OnceLock<bool> = OnceLock::new();
    crate::switches::read_once(&AMX, "CANDLE_FASTPATH_CPU_AMX", |v| {
        !matches!(v, Some("0") | Some("off")) && cpu_has_amx_bf16() && request_tile_data()
    })
}

/// CPUID leaf 7: EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE).
fn cpu_has_amx_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid_count;
        // Leaf 7 is read only where the maximum leaf reaches it.
        let (max, leaf7) = (__cpuid_count(0, 0).eax, __cpuid_count(7, 0));
        max >= 7 && leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Asks Linux for the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`),
/// without which the first tile instruction faults; true when granted.
fn request_tile_data() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const SYS_ARCH_PRCTL: usize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let ret: isize;
        // SAFETY: arch_prctl with this request only changes the process's permitted XSAVE
        // features; the syscall clobbers rcx and r11, declared, and touches no memory of ours.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// K padded to a whole number of tile steps.
pub(crate) fn padded_depth(k: usize) -> usize {
    k.next_multiple_of(STEP)
}

/// Where term `i` of column `c` of a panel sits in it: row `i / 2` of the panel (32 values: two
/// terms for each of 16 columns), place `2c + i % 2`.
#[inline(always)]
fn place(i: usize, c: usize) -> usize {
    (i / 2) * 2 * COLS + 2 * c + i % 2
}

/// `w` (`[n, k]` row-major) as pair panels: panel `p` holds rows `16p ..` of W (zeros past row
/// `n` and past term `k`) at `p · kp · 16 + place(i, c)`, `kp` = [`padded_depth`]`(k)`.
pub(crate) fn pair_panels(w: &[bf16], n: usize, k: usize) -> Vec<bf16> {
    crate::packed_cpu::panels_placed(w, n, k, padded_depth(k), place)
}

/// W again (`[n, k]` row-major) from its pair panels.
pub(crate) fn unpair(panels: &[bf16], n: usize, k: usize) -> Vec<bf16> {
    crate::packed_cpu::rows_placed(panels, n, k, padded_depth(k), place)
}

/// The tile configuration `ldtilecfg` reads (palette 1): tiles 0–3 the accumulators (16 rows of
/// 16 f32), 4–5 the row tiles of x (16 rows of 32 bf16), 6–7 the panels' blocks (16 rows of 16
/// pairs).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1
        for t in 0..8 {
            // colsb[t] (u16 at 16 + 2t): 64 bytes a row for every tile here.
            c[16 + 2 * t] = 64;
            // rows[t] (u8 at 48 + t).
            c[48 + t] = TILE_ROWS as u8;
        }
        Self(c)
    }
}

/// One task of the product on AMX tiles: output rows `rows` × the columns of panels `panels`,
/// each value `Σ_i x[row][i] · W[col][i]` over all `k` terms, then `finish`.
///
/// # Safety
/// [`available`] is true; `weights` are [`pair_panels`] of an `[n, k]` weight; `x` holds rows
/// `rows` (`x_rs` apart, `k` terms each); `dst` has room for `[rows.end, n]` values and no
/// other thread touches this task's block.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn task(weights: &[bf16], n: usize, k: usize, task: Task<'_>) {
    use std::arch::asm;
    let Task {
        x,
        x_rs,
        rows,
        panels,
        dst,
        finish,
    } = task;
    let kp = padded_depth(k);
    let m = rows.len();
    let mp = m.next_multiple_of(TILE_ROWS);
    // The task's rows of x in bf16, `kp` terms a row, zero past term k and past row m; kept per
    // thread (a fresh buffer a call is a fresh mapping, whose page faults cost as much).
    thread_local!(static ROWS_BF16: std::cell::RefCell<Vec<bf16>> = const {
        std::cell::RefCell::new(Vec::new())
    });
    let mut a = ROWS_BF16.take();
    if a.len() < mp * kp {
        a.resize(mp * kp, bf16::ZERO);
    }
    for (r, dst_row) in a[..mp * kp].chunks_exact_mut(kp).enumerate() {
        if r < m {
            let src = &x[(rows.start + r) * x_rs..(rows.start + r) * x_rs + k];
            dst_row[..k].convert_from_f32_slice(src);
            dst_row[k..].fill(bf16::ZERO);
        } else {
            dst_row.fill(bf16::ZERO);
        }
    }
    let cfg = TileConfig::new();
    let mut c = [0f32; ROWS * 2 * COLS];
    let (a_rs, b_rs, c_rs) = (kp * 2, 2 * COLS * 2, 2 * COLS * 4);
    // SAFETY: AMX is usable (the caller's); every tile load reads 16 rows of 64 bytes inside
    // `a` (mp · kp values) or inside a panel (kp · 16 values), every store writes inside `c`.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        let mut p = panels.start;
        while p < panels.end {
            let two_panels = p + 1 < panels.end;
            let b0 = weights.as_ptr().add(p * kp * COLS);
            // An unpaired last panel loads its own block twice; the second result is dropped.
            let b1 = if two_panels { b0.add(kp * COLS) } else { b0 };
            let width = (n - p * COLS).min(if two_panels { 2 * COLS } else { COLS });
            for r0 in (0..mp).step_by(ROWS) {
                let two_tiles = r0 + TILE_ROWS < mp;
                let a0 = a.as_ptr().add(r0 * kp);
                asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
                if two_tiles {
                    asm!("tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
                }
                for s in 0..kp / STEP {
                    let (ak, bk) = (a0.add(s * STEP), s * STEP * COLS);
                    asm!(
                        "tileloadd tmm4, [{a} + {a_rs}*1]",
                        "tileloadd tmm6, [{b0} + {b_rs}*1]",
                        "tileloadd tmm7, [{b1} + {b_rs}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        a = in(reg) ak,
                        a_rs = in(reg) a_rs,
                        b0 = in(reg) b0.add(bk),
                        b1 = in(reg) b1.add(bk),
                        b_rs = in(reg) b_rs,
                        options(nostack, readonly),
                    );
                    if two_tiles {
                        asm!(
                            "tileloadd tmm5, [{a} + {a_rs}*1]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            a = in(reg) ak.add(TILE_ROWS * kp),
                            a_rs = in(reg) a_rs,
                            options(nostack, readonly),
                        );
                    }
                }
                let cp = c.as_mut_ptr();
                asm!(
                    "tilestored [{c0} + {c_rs}*1], tmm0",
                    "tilestored [{c1} + {c_rs}*1], tmm1",
                    c0 = in(reg) cp,
                    c1 = in(reg) cp.add(COLS),
                    c_rs = in(reg) c_rs,
                    options(nostack),
                );
                if two_tiles {
                    asm!(
                        "tilestored [{c0} + {c_rs}*1], tmm2",
                        "tilestored [{c1} + {c_rs}*1], tmm3",
                        c0 = in(reg) cp.add(TILE_ROWS * 2 * COLS),
                        c1 = in(reg) cp.add(TILE_ROWS * 2 * COLS + COLS),
                        c_rs = in(reg) c_rs,
                        options(nostack),
                    );
                }
                for i in 0..(m.saturating_sub(r0)).min(ROWS) {
                    let row = rows.start + r0 + i;
                    std::ptr::copy_nonoverlapping(
                        c.as_ptr().add(i * 2 * COLS),
                        dst.0.add(row * n + p * COLS),
                        width,
                    );
                }
            }
            p += if two_panels { 2 } else { 1 };
        }
        asm!("tilerelease", options(nostack, nomem));
    }
    ROWS_BF16.set(a);
    // SAFETY: this task's block, every value written above (the caller's dst).
    unsafe { finish.apply_block(dst, rows, panels, n) }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn task(_: &[bf16], _: usize, _: usize, _: Task<'_>) {
    unreachable!("AMX panels are made only where available() is true")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pair panels hold `Wᵀ`'s columns, two terms side by side, zeros past the last row
    /// and term, and give W back.
    #[test]
    fn pair_panels_hold_the_transpose_in_pairs() {
        let (n, k) = (19, 37);
        let w: Vec<bf16> = (0..n * k).map(|v| bf16::from_f32(v as f32)).collect();
        let p = pair_panels(&w, n, k);
        let kp = padded_depth(k);
        assert_eq!(kp, 64);
        assert_eq!(p.len(), 2 * kp * COLS);
        for panel in 0..2 {
            for i in 0..kp {
                for c in 0..COLS {
                    let row = panel * COLS + c;
                    let want = if row < n && i < k {
                        w[row * k + i]
                    } else {
                        bf16::ZERO
                    };
                    let got = p[panel * kp * COLS + place(i, c)];
                    assert_eq!(got, want, "panel {panel} term {i} column {c}");
                }
            }
        }
        assert_eq!(unpair(&p, n, k), w);
    }
}
