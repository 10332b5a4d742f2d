//! f16 / bf16 slices widened to f32 and narrowed back, for every CPU step that runs a half type
//! through f32: here the attention's bf16 probabilities on AMX tiles and its f16 / bf16 rows on
//! the f32 tiles; in `candle-fastpath` the packed products' tasks, the row-chunked block, the
//! LayerNorm and the GELU (which is why the module is public, hidden from the docs: a building
//! block, not this crate's API).
//!
//! Why: `half`'s bf16 slice conversions are element loops (its f16 ones use F16C), which the
//! crate's baseline build vectorises four lanes at a time at best, and a bf16 forward converts
//! every activation at least twice a layer (widened to f32 for the arithmetic, rounded where the
//! layer stores it). On AMX tiles the product itself runs so fast that these passes are a large
//! part of the rest. The loops below are the same arithmetic written without branches, compiled
//! for AVX-512 and for AVX2 where the CPU has them, so that they run 16 or 8 lanes wide: on the
//! H200 machine's 16-core AMX host, against the same operations with `half`'s loops (one binary
//! each, the same call): a DeiT block in bf16 1.12–1.37× faster (DeiT-S batch 8 4.20 → 3.44 ms),
//! its LayerNorm 1.3–2.4×, and a bf16 forward of DeiT-T / S 0.98–1.41× over two rounds
//! (docs/BENCHMARKS.md, the CPU section, stop 69). On the build machine (AVX2) narrowing runs ~3× and widening ~2.5×
//! faster than `half`'s loops.
//!
//! The same bits as `half`'s `bf16::from_f32` / `to_f32`, NaNs included (quieted, payload kept):
//! round to nearest, ties to even, overflow to infinity (unit tests, on every kernel the CPU
//! has).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// A half type the CPU steps widen to f32 and narrow back.
pub trait HalfSlice: Copy + Default + Send + Sync {
    /// `src` as f32 into `dst` (the same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// `src` rounded to this type into `dst` (the same length).
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `v` rounded to this type in place, as if narrowed and widened again.
    fn round(v: &mut [f32]) {
        let mut buf = [Self::default(); 256];
        for piece in v.chunks_mut(buf.len()) {
            let b = &mut buf[..piece.len()];
            Self::narrow(piece, b);
            Self::widen(b, piece);
        }
    }
}

impl HalfSlice for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        // half's f16 conversions use F16C where the CPU has it.
        src.convert_to_f32_slice(dst)
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

impl HalfSlice for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "bf16 widen: lengths differ");
        // SAFETY: bf16 is a transparent u16.
        let src = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u16>(), src.len()) };
        match lanes() {
            // SAFETY: lanes() saw the features on this CPU.
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx512 => unsafe { widen_avx512(src, dst) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx2 => unsafe { widen_avx2(src, dst) },
            _ => widen_bits(src, dst),
        }
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        assert_eq!(src.len(), dst.len(), "bf16 narrow: lengths differ");
        // SAFETY: bf16 is a transparent u16; `dst` is borrowed mutably.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u16>(), dst.len()) };
        match lanes() {
            // SAFETY: lanes() saw the features on this CPU.
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx512 => unsafe { narrow_avx512(src, dst) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx2 => unsafe { narrow_avx2(src, dst) },
            _ => narrow_bits(src, dst),
        }
    }
    fn round(v: &mut [f32]) {
        match lanes() {
            // SAFETY: lanes() saw the features on this CPU.
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx512 => unsafe { round_avx512(v) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx2 => unsafe { round_avx2(v) },
            _ => round_bits(v),
        }
    }
}

/// The widest lanes the loops are compiled for that this CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lanes {
    Avx512,
    Avx2,
    Baseline,
}

fn lanes() -> Lanes {
    #[cfg(target_arch = "x86_64")]
    {
        // is_x86_feature_detected! reads a cached word after the first call.
        if std::arch::is_x86_feature_detected!("avx512bw") {
            return Lanes::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Lanes::Avx2;
        }
    }
    Lanes::Baseline
}

/// Whether bf16 bits `h` are a NaN.
#[inline(always)]
fn bf16_nan(h: u32) -> bool {
    h & 0x7FFF > 0x7F80
}

/// Whether f32 bits `x` are a NaN.
#[inline(always)]
fn f32_nan(x: u32) -> bool {
    x & 0x7FFF_FFFF > 0x7F80_0000
}

/// f32 bits `x` rounded to bf16, placed in the upper half: nearest, ties to even (adding
/// `0x7FFF` plus the kept part's lowest bit carries into it exactly when the dropped half is
/// over `0x8000`, or equal with that bit odd; a finite value past the largest bf16 carries into
/// the exponent and becomes infinity); a NaN keeps its upper half with the quiet bit set.
#[inline(always)]
pub(crate) fn rounded_bits(x: u32) -> u32 {
    let nearest = x.wrapping_add(0x7FFF + ((x >> 16) & 1));
    (if f32_nan(x) { x | 0x0040_0000 } else { nearest }) & 0xFFFF_0000
}

#[inline(always)]
fn widen_bits(src: &[u16], dst: &mut [f32]) {
    for (d, &h) in dst.iter_mut().zip(src) {
        let h = h as u32;
        *d = f32::from_bits(if bf16_nan(h) { h | 0x40 } else { h } << 16);
    }
}

#[inline(always)]
fn narrow_bits(src: &[f32], dst: &mut [u16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = (rounded_bits(s.to_bits()) >> 16) as u16;
    }
}

#[inline(always)]
fn round_bits(v: &mut [f32]) {
    for x in v {
        *x = f32::from_bits(rounded_bits(x.to_bits()));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen_avx512(src: &[u16], dst: &mut [f32]) {
    widen_bits(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(src: &[u16], dst: &mut [f32]) {
    widen_bits(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn narrow_avx512(src: &[f32], dst: &mut [u16]) {
    narrow_bits(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn narrow_avx2(src: &[f32], dst: &mut [u16]) {
    narrow_bits(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn round_avx512(v: &mut [f32]) {
    round_bits(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_avx2(v: &mut [f32]) {
    round_bits(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Values that exercise every branch of half's conversion: NaNs (quiet, signalling, with
    /// payloads, negative), infinities, the largest finite values and the ones that round past
    /// them, ties (even and odd), subnormals, zeros, and random bits of every exponent.
    fn cases() -> Vec<f32> {
        let mut bits: Vec<u32> = vec![
            0x7FC0_0000,
            0x7F80_0001,
            0xFF80_0001,
            0x7FBF_FFFF,
            0x7F81_2345,
            0xFFC1_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F7F_7FFF,
            0x7F7F_8000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x3F81_7FFF,
            0x0000_0001,
            0x8000_8000,
            0x0001_8000,
            0x007F_FFFF,
            0x0000_0000,
            0x8000_0000,
            0x4049_0FDB,
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(69);
        bits.extend((0..100_003).map(|_| rng.random::<u32>()));
        bits.into_iter().map(f32::from_bits).collect()
    }

    /// Every kernel this CPU has, for each loop.
    fn kernels() -> Vec<Lanes> {
        let mut k = vec![Lanes::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                k.push(Lanes::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512bw") {
                k.push(Lanes::Avx512);
            }
        }
        k
    }

    fn narrow_on(lanes: Lanes, src: &[f32], dst: &mut [u16]) {
        match lanes {
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx512 => unsafe { narrow_avx512(src, dst) },
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx2 => unsafe { narrow_avx2(src, dst) },
            _ => narrow_bits(src, dst),
        }
    }

    fn widen_on(lanes: Lanes, src: &[u16], dst: &mut [f32]) {
        match lanes {
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx512 => unsafe { widen_avx512(src, dst) },
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx2 => unsafe { widen_avx2(src, dst) },
            _ => widen_bits(src, dst),
        }
    }

    fn round_on(lanes: Lanes, v: &mut [f32]) {
        match lanes {
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx512 => unsafe { round_avx512(v) },
            #[cfg(target_arch = "x86_64")]
            Lanes::Avx2 => unsafe { round_avx2(v) },
            _ => round_bits(v),
        }
    }

    /// Narrowing, widening and rounding give half's bits for every case on every kernel
    /// (odd lengths, so that each vector loop's tail runs too), and through the trait.
    #[test]
    fn bf16_conversions_are_halfs_bits() {
        let src = cases();
        let want: Vec<u16> = src.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        let want_wide: Vec<u32> = want
            .iter()
            .map(|&h| bf16::from_bits(h).to_f32().to_bits())
            .collect();
        for lanes in kernels() {
            let mut got = vec![0xDEADu16; src.len()];
            narrow_on(lanes, &src, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{lanes:?} narrow {:#010x}", src[i].to_bits());
            }
            let mut wide = vec![f32::NAN; src.len()];
            widen_on(lanes, &want, &mut wide);
            for (i, (g, w)) in wide.iter().zip(&want_wide).enumerate() {
                assert_eq!(g.to_bits(), *w, "{lanes:?} widen {:#06x}", want[i]);
            }
            let mut rounded = src.clone();
            round_on(lanes, &mut rounded);
            for (i, (g, w)) in rounded.iter().zip(&want_wide).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    *w,
                    "{lanes:?} round {:#010x}",
                    src[i].to_bits()
                );
            }
        }
        let mut through = vec![bf16::ZERO; 197];
        let mut rounded = src[..197].to_vec();
        <bf16 as HalfSlice>::round(&mut rounded);
        assert!(rounded
            .iter()
            .zip(&want_wide)
            .all(|(g, w)| g.to_bits() == *w));
        <bf16 as HalfSlice>::narrow(&src[..197], &mut through);
        assert!(through.iter().zip(&want).all(|(g, w)| g.to_bits() == *w));
        let mut back = vec![0f32; 197];
        <bf16 as HalfSlice>::widen(&through, &mut back);
        assert!(back.iter().zip(&want_wide).all(|(g, w)| g.to_bits() == *w));
    }
}
