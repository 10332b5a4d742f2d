//! The ragged attention's bf16 CPU path on Intel AMX tiles ([`crate::amx`]): both products of a
//! (sequence, head), `Q·Kᵀ` and `P·V`, as bf16 tile products with f32 sums, the softmax between
//! them in f32 as the other CPU kernels run it.
//!
//! Why: the f32-lane kernels ([`super::attention`]'s AVX-512 tiles) widen bf16 to f32 and make
//! 16 multiply-adds an instruction; one `tdpbf16ps` makes 8,192. At DeiT-S batch 8 in bf16 the
//! attention was a third of a block's time on the H200 machine's AMX host once the Linears ran on
//! AMX. With this path (and the vectorised exponential both paths share) the attention alone ran
//! 1.36–1.70× faster than on the f32 tiles there, the block 1.08–1.21× (docs/BENCHMARKS.md, the
//! CPU section, stop 69).
//!
//! How, per (sequence, head): K is packed once as pair panels of 16 keys (`Kᵀ`'s columns, head
//! dims in pairs) and V as pair panels of 16 head dims (keys in pairs), keys padded with zeros
//! to a multiple of 32. Each block of query rows (as in the other kernels) copies its rows of Q
//! into a bf16 buffer of whole 16-row tiles, multiplies them by the key panels into f32 scores,
//! turns each row's real keys into the softmax's numerators in f32 (scale, max, [`exp_f32`]),
//! rounds them to bf16 (zeros past the last key), multiplies by the value panels into f32 sums
//! and divides each row by the sum of its rounded numerators.
//!
//! Precision: Q, K and V are bf16 already (their products are exact in f32); the sums are f32
//! (added pairwise by the hardware, denormals flushed); the probabilities are rounded to bf16
//! before `P·V`, as FlashAttention does on the GPU: at most 2⁻⁹ of each term, the size of the
//! bf16 output's own rounding (the unit test holds it within 4e-3 of the output's size against
//! the f64 attention, the op's tests within their bf16 tolerance). `CANDLE_RAGGED_CPU_AMX=0`
//! runs bf16 on the f32-lane kernels instead.

use std::sync::OnceLock;

use half::bf16;

use crate::amx::{self, Tiles, COLS, STEP, TILE_ROWS};
use crate::attention::{exp_f32, scale_to_max, HeadRows};
use crate::half_cpu::rounded_bits;

/// Whether bf16 heads of `dim` head dims run on AMX tiles: [`amx::usable`], `dim` a multiple of
/// 32 (a tile step; 32, 64 and 128 are) and `CANDLE_RAGGED_CPU_AMX` not `0` (read once).
pub(crate) fn runs(dim: usize) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = *ON.get_or_init(|| {
        !matches!(
            std::env::var("CANDLE_RAGGED_CPU_AMX")
                .as_deref()
                .map(str::trim),
            Ok("0") | Ok("off")
        ) && amx::usable()
    });
    on && dim > 0 && dim.is_multiple_of(STEP)
}

/// One (sequence, head)'s keys and values as pair panels, each pair of terms one `u32` (the
/// lower-addressed bf16, the even term, in the low half): `k` holds `width / 16` panels of 16
/// keys (`dim` terms each), `v` holds `dim / 16` panels of 16 head dims (`width` terms each, the
/// keys); `width` is the keys padded to a multiple of 32, and every padded term is zero.
pub(crate) struct PairedKeysValues {
    k: Vec<u32>,
    v: Vec<u32>,
    width: usize,
    len: usize,
    dim: usize,
}

/// Two bf16 values as the pair a panel holds: `lo` in the low half.
#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
}

impl PairedKeysValues {
    /// Packs a head's `len` keys and values (`dim` values each, `dim` even), a pair of terms a
    /// store: [`amx::place`]`(i, c)` for an even `i` is the `u32` at `(i / 2) · 16 + c`.
    pub(crate) fn pack(
        k: HeadRows<'_, bf16>,
        v: HeadRows<'_, bf16>,
        len: usize,
        dim: usize,
    ) -> Self {
        let width = amx::padded_depth(len);
        let pairs = dim / 2;
        let mut kp = vec![0u32; width * pairs];
        let mut vp = vec![0u32; pairs * width];
        // K: key j is column j % 16 of panel j / 16; its terms in pairs, 16 apart.
        for j in 0..len {
            let row = &k.data[k.first + j * k.stride..][..dim];
            let panel = &mut kp[(j / COLS) * pairs * COLS..][..pairs * COLS];
            for (r, two) in row.chunks_exact(2).enumerate() {
                panel[r * COLS + j % COLS] = pair(two[0], two[1]);
            }
        }
        // V: keys 2t and 2t + 1 are pair row t of every panel, head dim c its column c % 16 of
        // panel c / 16: 16 consecutive stores a panel.
        for t in 0..len.div_ceil(2) {
            let even = &v.data[v.first + 2 * t * v.stride..][..dim];
            let odd = (2 * t + 1 < len).then(|| &v.data[v.first + (2 * t + 1) * v.stride..][..dim]);
            for c0 in (0..dim).step_by(COLS) {
                let out = &mut vp[(c0 / COLS) * (width / 2) * COLS + t * COLS..][..COLS];
                let even = &even[c0..c0 + COLS];
                match odd {
                    Some(odd) => {
                        for ((o, &e), &d) in out.iter_mut().zip(even).zip(&odd[c0..c0 + COLS]) {
                            *o = pair(e, d);
                        }
                    }
                    None => {
                        for (o, &e) in out.iter_mut().zip(even) {
                            *o = pair(e, bf16::ZERO);
                        }
                    }
                }
            }
        }
        Self {
            k: kp,
            v: vp,
            width,
            len,
            dim,
        }
    }

    /// The key panels as bf16 values.
    fn keys(&self) -> &[bf16] {
        // SAFETY: a u32 is two bf16 (u16) values; u32's alignment is a multiple of bf16's.
        unsafe { std::slice::from_raw_parts(self.k.as_ptr().cast(), 2 * self.k.len()) }
    }

    /// The value panels as bf16 values.
    fn values(&self) -> &[bf16] {
        // SAFETY: as in `keys`.
        unsafe { std::slice::from_raw_parts(self.v.as_ptr().cast(), 2 * self.v.len()) }
    }
}

/// Per-thread buffers of [`attend_rows`]: Q's rows, the scores, the probabilities, the sums.
#[derive(Default)]
struct Buffers {
    q: Vec<bf16>,
    scores: Vec<f32>,
    p: Vec<bf16>,
    o: Vec<f32>,
}

/// The first `n` values of `v`, grown with `fill` where it is shorter; values from an earlier
/// call are left as they are (every caller overwrites what it reads, or reads stale values only
/// into padding rows whose results are dropped).
fn sized<T: Copy>(v: &mut Vec<T>, n: usize, fill: T) -> &mut [T] {
    if v.len() < n {
        v.resize(n, fill);
    }
    &mut v[..n]
}

/// `out.len() / dim` query rows (from `q`'s first, at most 64) against the keys and values of
/// `kv`, scores scaled by `scale`, into `out` (`[rows, dim]`).
///
/// # Panics
/// If [`runs`]`(dim)` is false.
pub(crate) fn attend_rows(
    q: HeadRows<'_, bf16>,
    kv: &PairedKeysValues,
    scale: f32,
    out: &mut [f32],
) {
    let (width, len, dim) = (kv.width, kv.len, kv.dim);
    assert!(
        runs(dim),
        "ragged_attention (CPU): AMX tiles where they do not run"
    );
    let m = out.len() / dim;
    if m == 0 {
        return;
    }
    let mp = m.next_multiple_of(TILE_ROWS);
    thread_local!(static BUFFERS: std::cell::RefCell<Buffers> = Default::default());
    let mut bufs = BUFFERS.take();
    let Buffers {
        q: qa,
        scores,
        p,
        o,
    } = &mut bufs;
    // Rows past `m` of Q and P (up to the 16-row tile) hold stale values: a tile's output row
    // depends on its own input row alone, and those rows' results are dropped.
    let qa = sized(qa, mp * dim, bf16::ZERO);
    for (i, row) in qa.chunks_exact_mut(dim).take(m).enumerate() {
        row.copy_from_slice(&q.data[q.first + i * q.stride..][..dim]);
    }
    // Written whole by the tiles (every row of the tiles, every column of the panels).
    let scores = sized(scores, mp * width, 0.0);
    let o = sized(o, mp * dim, 0.0);
    let p = sized(p, mp * width, bf16::ZERO);
    // SAFETY: AMX runs (asserted above).
    let tiles = unsafe { Tiles::configure() };
    product(&tiles, qa, dim, kv.keys(), width, scores);
    let mut denoms = vec![0f32; m];
    for ((s, p), denom) in scores
        .chunks_exact_mut(width)
        .zip(p.chunks_exact_mut(width))
        .zip(denoms.iter_mut())
    {
        *denom = probabilities(&mut s[..len], scale, p, len);
    }
    product(&tiles, p, width, kv.values(), dim, o);
    drop(tiles);
    for ((out, o), denom) in out
        .chunks_exact_mut(dim)
        .zip(o.chunks_exact(dim))
        .zip(denoms.iter())
    {
        for (out, &o) in out.iter_mut().zip(o) {
            *out = o / denom;
        }
    }
    BUFFERS.set(bufs);
}

/// `c = a · B` on the tiles: `a` holds whole 16-row tiles of `depth` terms a row (a multiple of
/// 32), `panels` the pair panels of B's `cols` columns (`cols / 16` panels of `depth` terms, an
/// even count), `c` as many rows of `cols` values as `a` has rows.
///
/// # Panics
/// If the slices do not hold those sizes.
fn product(tiles: &Tiles, a: &[bf16], depth: usize, panels: &[bf16], cols: usize, c: &mut [f32]) {
    let rows = a.len() / depth.max(1);
    assert!(
        depth.is_multiple_of(STEP)
            && cols.is_multiple_of(2 * COLS)
            && rows.is_multiple_of(TILE_ROWS)
    );
    assert!(a.len() == rows * depth && panels.len() >= cols * depth && c.len() == rows * cols);
    for r0 in (0..rows).step_by(2 * TILE_ROWS) {
        let two_tiles = r0 + TILE_ROWS < rows;
        for panel in (0..cols / COLS).step_by(2) {
            // SAFETY: the tiles are configured (`tiles`); the block reads 16 or 32 rows of
            // `depth` terms from row r0 of `a`, two whole panels of `depth · 16` values, and
            // writes 32 columns of those rows of `c`, all inside the slices (asserted above).
            unsafe {
                let b0 = panels.as_ptr().add(panel * depth * COLS);
                tiles.block(
                    a.as_ptr().add(r0 * depth),
                    depth * 2,
                    two_tiles,
                    b0,
                    b0.add(depth * COLS),
                    depth / STEP,
                    c.as_mut_ptr().add(r0 * cols + panel * COLS),
                    cols * 4,
                );
            }
        }
    }
}

/// A row's probabilities for `P·V`: its `len` raw scores scaled by `scale`, `exp(score − max)`
/// rounded to bf16 into `p[..len]` and zeros into `p[len..]` (the padded keys); returns the sum
/// of the rounded values (so that the weights the tiles apply sum to one after the division).
/// Compiled for AVX-512 where the CPU has it (it does wherever AMX runs): 16 lanes a step, the
/// sum in 16 partial sums (no order to keep: the tiles add `P·V`'s terms in their own order).
fn probabilities(scores: &mut [f32], scale: f32, p: &mut [bf16], len: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bw") {
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn wide(scores: &mut [f32], scale: f32, p: &mut [bf16], len: usize) -> f32 {
            probabilities_with(scores, scale, p, len)
        }
        // SAFETY: the CPU reports AVX-512F and AVX-512BW.
        return unsafe { wide(scores, scale, p, len) };
    }
    probabilities_with(scores, scale, p, len)
}

/// The body of [`probabilities`], inlined into each build of it: passes simple enough to
/// vectorise (a first form that did it all in one loop over chunks of 16 ran ~8 cycles a score
/// on the H200 host, over half of the head's time).
#[inline(always)]
fn probabilities_with(scores: &mut [f32], scale: f32, p: &mut [bf16], len: usize) -> f32 {
    const LANES: usize = 16;
    let scores = &mut scores[..len];
    let max = scale_to_max(scores, scale);
    for s in scores.iter_mut() {
        *s = exp_f32(*s - max);
    }
    let (kept, pad) = p.split_at_mut(len);
    let mut sums = [0f32; LANES];
    let mut s_chunks = scores.chunks_exact(LANES);
    let mut p_chunks = kept.chunks_exact_mut(LANES);
    for (s, p) in (&mut s_chunks).zip(&mut p_chunks) {
        for j in 0..LANES {
            let rounded = rounded_bits(s[j].to_bits());
            p[j] = bf16::from_bits((rounded >> 16) as u16);
            sums[j] += f32::from_bits(rounded);
        }
    }
    let mut total: f32 = sums.iter().sum();
    for (s, p) in s_chunks.remainder().iter().zip(p_chunks.into_remainder()) {
        let rounded = rounded_bits(s.to_bits());
        *p = bf16::from_bits((rounded >> 16) as u16);
        total += f32::from_bits(rounded);
    }
    pad.fill(bf16::ZERO);
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One head's attention as the op runs it: K and V packed, then its blocks of query rows.
    fn attend_head(
        q: HeadRows<'_, bf16>,
        k: HeadRows<'_, bf16>,
        v: HeadRows<'_, bf16>,
        (len, dim, scale): (usize, usize, f32),
    ) -> Vec<f32> {
        let kv = PairedKeysValues::pack(k, v, len, dim);
        let rows = crate::attention::query_block_rows(len);
        let mut out = vec![f32::NAN; len * dim];
        for (b, out) in out.chunks_mut(rows * dim).enumerate() {
            let q = HeadRows::of(q.data, (q.first + b * rows * q.stride, q.stride));
            attend_rows(q, &kv, scale, out);
        }
        out
    }

    /// Rows `len × dim` of distinct bf16 values, `stride` apart from `first` (other values
    /// between them), as a fused qkv view would hold them.
    fn strided(len: usize, dim: usize, seed: u32) -> (Vec<bf16>, usize, usize) {
        let (first, stride) = (3, dim + 5);
        let mut state = seed;
        let data = (0..first + len * stride)
            .map(|_| {
                // A small LCG: values in [-2, 2) of 8 bits, exact in bf16.
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                bf16::from_f32(((state >> 24) as f32 - 128.0) / 64.0)
            })
            .collect();
        (data, first, stride)
    }

    /// The pair panels hold K's rows as columns and V's columns, each term in `amx::place`,
    /// and zeros for every padded key.
    #[test]
    fn keys_and_values_are_pair_panels() {
        let (len, dim) = (37, 32);
        let (k, kf, ks) = strided(len, dim, 1);
        let (v, vf, vs) = strided(len, dim, 2);
        let kv = PairedKeysValues::pack(
            HeadRows::of(&k, (kf, ks)),
            HeadRows::of(&v, (vf, vs)),
            len,
            dim,
        );
        assert_eq!(kv.width, 64);
        for j in 0..kv.width {
            for i in 0..dim {
                let (want_k, want_v) = if j < len {
                    (k[kf + j * ks + i], v[vf + j * vs + i])
                } else {
                    (bf16::ZERO, bf16::ZERO)
                };
                let got_k = kv.keys()[(j / COLS) * dim * COLS + amx::place(i, j % COLS)];
                let got_v = kv.values()[(i / COLS) * kv.width * COLS + amx::place(j, i % COLS)];
                assert_eq!(got_k, want_k, "key {j} dim {i}");
                assert_eq!(got_v, want_v, "value {j} dim {i}");
            }
        }
    }

    /// Where AMX runs: every odd length and head dim within 4e-3 of the f64 attention (relative
    /// to the output's largest value; the bf16 probabilities' rounding is a few 1e-4 here), from
    /// strided rows. Elsewhere: the path is off, and it is off for head dims that are not a
    /// multiple of 32 everywhere.
    #[test]
    fn amx_heads_match_the_f64_attention() {
        assert!(!runs(48) && !runs(0));
        if !runs(64) {
            assert!(!amx::usable() || std::env::var("CANDLE_RAGGED_CPU_AMX").is_ok());
            return;
        }
        for dim in [32, 64, 128] {
            for len in [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 197, 577] {
                let (q, qf, qs) = strided(len, dim, 3 + len as u32);
                let (k, kf, ks) = strided(len, dim, 5 + len as u32);
                let (v, vf, vs) = strided(len, dim, 7 + len as u32);
                let scale = 1.0 / (dim as f32).sqrt();
                let got = attend_head(
                    HeadRows::of(&q, (qf, qs)),
                    HeadRows::of(&k, (kf, ks)),
                    HeadRows::of(&v, (vf, vs)),
                    (len, dim, scale),
                );
                let x = |d: &[bf16], f: usize, s: usize, r: usize, c: usize| {
                    d[f + r * s + c].to_f32() as f64
                };
                let mut want = vec![0f64; len * dim];
                for r in 0..len {
                    let scores: Vec<f64> = (0..len)
                        .map(|j| {
                            (0..dim)
                                .map(|i| x(&q, qf, qs, r, i) * x(&k, kf, ks, j, i))
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for c in 0..dim {
                        want[r * dim + c] =
                            (0..len).map(|j| e[j] * x(&v, vf, vs, j, c)).sum::<f64>() / sum;
                    }
                }
                let size = want.iter().fold(0f64, |m, w| m.max(w.abs()));
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(&g, &w)| {
                        if g.is_finite() {
                            (g as f64 - w).abs()
                        } else {
                            f64::INFINITY
                        }
                    })
                    .fold(0f64, f64::max);
                assert!(
                    err <= 4e-3 * size,
                    "len {len} dim {dim}: max error {err:e} of {size:e}"
                );
            }
        }
    }
}
