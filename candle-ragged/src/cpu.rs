//! Small helpers shared by the CPU implementations of the ops.

use half::{bf16, f16};

use crate::half_cpu::HalfSlice;

/// The element types the ops accept, widened to f32 for arithmetic.
pub(crate) trait Float32: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The slice itself when the type is f32 (read in place, nothing widened).
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// The slice itself when the type is bf16 (for the AMX tiles, which read bf16).
    fn as_bf16(_: &[Self]) -> Option<&[bf16]> {
        None
    }
    /// `src` as f32 into `dst` (the same length).
    fn widen(src: &[Self], dst: &mut [f32]);
}

impl Float32 for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
}

impl Float32 for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        HalfSlice::widen(src, dst)
    }
}

impl Float32 for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn as_bf16(s: &[bf16]) -> Option<&[bf16]> {
        Some(s)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        HalfSlice::widen(src, dst)
    }
}
