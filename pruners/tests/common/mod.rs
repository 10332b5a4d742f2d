//! Shared helpers for the pruners integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};

/// Stacks images (each `[len, C]` rows) into a padded `[B, N, C]` tensor; padding rows are
/// filled with `pad` (to prove padding never matters). `n` = padded length (>= max len).
pub fn pad_batch(images: &[Vec<Vec<f32>>], n: usize, pad: f32) -> (Tensor, Vec<usize>) {
    let c = images[0][0].len();
    let mut data = Vec::with_capacity(images.len() * n * c);
    let mut lengths = Vec::new();
    for img in images {
        lengths.push(img.len());
        for row in img {
            assert_eq!(row.len(), c);
            data.extend_from_slice(row);
        }
        for _ in img.len()..n {
            data.extend(std::iter::repeat_n(pad, c));
        }
    }
    (
        Tensor::from_vec(data, (images.len(), n, c), &Device::Cpu).unwrap(),
        lengths,
    )
}

/// `[B, N]` tensor from rows padded with `pad`.
pub fn pad_rows(rows: &[Vec<f32>], n: usize, pad: f32) -> Tensor {
    let mut data = Vec::new();
    for r in rows {
        data.extend_from_slice(r);
        data.extend(std::iter::repeat_n(pad, n - r.len()));
    }
    Tensor::from_vec(data, (rows.len(), n), &Device::Cpu).unwrap()
}

/// A token of `c` channels with L2 norm `norm` (direction varies with `seed`).
pub fn token_with_norm(norm: f32, c: usize, seed: usize) -> Vec<f32> {
    let raw: Vec<f32> = (0..c)
        .map(|i| (((i + 1) * (seed + 3)) % 7) as f32 + 1.0)
        .collect();
    let n = raw.iter().map(|x| x * x).sum::<f32>().sqrt();
    raw.iter().map(|x| x / n * norm).collect()
}

/// An image: `num_prefix` prefix tokens (norm 0.01, i.e. they would never win) then the
/// patch tokens with the given norms.
pub fn image_with_norms(num_prefix: usize, norms: &[f32], c: usize) -> Vec<Vec<f32>> {
    (0..num_prefix)
        .map(|i| token_with_norm(0.01, c, i))
        .chain(
            norms
                .iter()
                .enumerate()
                .map(|(i, &n)| token_with_norm(n, c, i + 7)),
        )
        .collect()
}

pub fn u32s(v: &[usize]) -> Vec<u32> {
    v.iter().map(|&x| x as u32).collect()
}

pub fn to_dtype(t: &Tensor, dt: DType) -> Tensor {
    t.to_dtype(dt).unwrap()
}
