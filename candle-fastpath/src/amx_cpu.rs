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

use candle_ragged::amx::{self, Tiles, COLS, TILE_ROWS};
use half::bf16;

use crate::packed_cpu::Task;
use candle_ragged::half_cpu::HalfSlice;

// The tasks split the output by the AVX panels' 16 columns; an AMX panel must be as wide.
const _: () = assert!(COLS == crate::packed_cpu::COLS);

/// Rows a full step of the task covers: two row tiles (four accumulators with two panels).
pub(crate) const ROWS: usize = 2 * TILE_ROWS;

/// Whether bf16 weights are packed for AMX tiles: [`amx::usable`] (the CPU has AMX-TILE and
/// AMX-BF16 and Linux lets this process use the tile data) and `CANDLE_FASTPATH_CPU_AMX` is not
/// `0` (read once; then bf16 takes the AVX tiles, as on CPUs without AMX).
pub(crate) fn available() -> bool {
    static AMX: OnceLock<bool> = OnceLock::new();
    crate::switches::read_once(&AMX, "CANDLE_FASTPATH_CPU_AMX", |v| {
        !matches!(v, Some("0") | Some("off")) && amx::usable()
    })
}

/// `w` (`[n, k]` row-major) as pair panels: panel `p` holds rows `16p ..` of W (zeros past row
/// `n` and past term `k`) at `p · kp · 16 + place(i, c)`, `kp` = [`amx::padded_depth`]`(k)`.
pub(crate) fn pair_panels(w: &[bf16], n: usize, k: usize) -> Vec<bf16> {
    crate::packed_cpu::panels_placed(w, n, k, amx::padded_depth(k), amx::place)
}

/// W again (`[n, k]` row-major) from its pair panels.
pub(crate) fn unpair(panels: &[bf16], n: usize, k: usize) -> Vec<bf16> {
    crate::packed_cpu::rows_placed(panels, n, k, amx::padded_depth(k), amx::place)
}

/// One task of the product on AMX tiles: output rows `rows` × the columns of panels `panels`,
/// each value `Σ_i x[row][i] · W[col][i]` over all `k` terms, then `finish`.
///
/// # Safety
/// [`available`] is true; `weights` are [`pair_panels`] of an `[n, k]` weight; `x` holds rows
/// `rows` (`x_rs` apart, `k` terms each); `dst` has room for `[rows.end, n]` values and no
/// other thread touches this task's block.
pub(crate) unsafe fn task(weights: &[bf16], n: usize, k: usize, task: Task<'_>) {
    let Task {
        x,
        x_rs,
        rows,
        panels,
        dst,
        finish,
    } = task;
    let kp = amx::padded_depth(k);
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
            bf16::narrow(src, &mut dst_row[..k]);
            dst_row[k..].fill(bf16::ZERO);
        } else {
            dst_row.fill(bf16::ZERO);
        }
    }
    let mut c = [0f32; ROWS * 2 * COLS];
    // SAFETY: AMX is usable (the caller's). Every block reads 16 or 32 rows of `kp` terms inside
    // `a` (mp · kp values) and two panels' `kp · 16` values inside `weights` (an unpaired last
    // panel is read twice, the second result dropped), and stores 16 or 32 rows of 32 f32 into
    // `c`; the copies write the task's own block of `dst` (the caller's).
    unsafe {
        let tiles = Tiles::configure();
        let mut p = panels.start;
        while p < panels.end {
            let two_panels = p + 1 < panels.end;
            let b0 = weights.as_ptr().add(p * kp * COLS);
            let b1 = if two_panels { b0.add(kp * COLS) } else { b0 };
            let width = (n - p * COLS).min(if two_panels { 2 * COLS } else { COLS });
            for r0 in (0..mp).step_by(ROWS) {
                let two_tiles = r0 + TILE_ROWS < mp;
                let a0 = a.as_ptr().add(r0 * kp);
                let c_rs = 2 * COLS * 4;
                tiles.block(
                    a0,
                    kp * 2,
                    two_tiles,
                    b0,
                    b1,
                    kp / amx::STEP,
                    c.as_mut_ptr(),
                    c_rs,
                );
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
    }
    ROWS_BF16.set(a);
    // SAFETY: this task's block, every value written above (the caller's dst).
    unsafe { finish.apply_block(dst, rows, panels, n) }
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
        let kp = amx::padded_depth(k);
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
                    let got = p[panel * kp * COLS + amx::place(i, c)];
                    assert_eq!(got, want, "panel {panel} term {i} column {c}");
                }
            }
        }
        assert_eq!(unpair(&p, n, k), w);
    }
}
